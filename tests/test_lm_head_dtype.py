"""The lm_head backward in the compute dtype (issue 17, 2c): `.backward()` runs
outside autocast, so under `single`/DDP bf16 `ChunkedLogProbs.backward` must
take the dtype its forward ran in, not the fp32 master weights'. CPU bf16
autocast takes the same code; logits reach real-model scale (|z| ~ 36)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from areno.backend.model import chunked_logprobs

_GEMMS = (torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default)


class GemmDtypes(TorchDispatchMode):
    """Records the input dtypes of every matrix product dispatched under it."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[torch.dtype, torch.dtype]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in _GEMMS:
            a, b = args[-2], args[-1]
            self.seen.append((a.dtype, b.dtype))
        return func(*args, **(kwargs or {}))


def _case(seed: int = 0):
    """hidden [64, 64], weight [500, 64] (logits up to ~36), targets, grad weights."""
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(64, 64, generator=g, requires_grad=True)
    w = torch.randn(500, 64, generator=g, requires_grad=True)
    t = torch.randint(0, 500, (64,), generator=g)
    return h, w, t, torch.randn(64, generator=g), torch.randn(64, generator=g)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def test_lm_head_backward_gemms_run_in_bf16_after_a_bf16_autocast_forward() -> None:
    h, w, t, a, b = _case()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        lp, ent = chunked_logprobs(h, w, t, 16)
    mode = GemmDtypes()
    with mode:  # outside autocast, as the train step's backward
        gh, gw = torch.autograd.grad((lp * a + ent * b).sum(), [h, w])
    assert len(mode.seen) == 3 * 4  # recomputed logits, dh, dW for each of 4 chunks
    assert set(mode.seen) == {(torch.bfloat16, torch.bfloat16)}, mode.seen
    assert gh.dtype == gw.dtype == torch.float32  # grads in the masters' dtype


def test_lm_head_gradient_matches_autograd_through_the_same_bf16_logits() -> None:
    """The reference: autograd of log-softmax over autocast's bf16 logits. The
    backward's recomputed logits are forward's, so the gradients agree to bf16
    rounding of dz (measured 4e-5 for dh, 2e-3 for dW; an fp32 recompute: 4%)."""
    h, w, t, a, b = _case(1)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        lp, ent = chunked_logprobs(h, w, t, 16)
        ls = torch.log_softmax(F.linear(h, w).float(), -1)
    lp_ref, ent_ref = ls.gather(1, t[:, None])[:, 0], -(ls.exp() * ls).sum(-1)
    torch.testing.assert_close(lp, lp_ref, atol=1e-4, rtol=0)
    torch.testing.assert_close(ent, ent_ref, atol=1e-4, rtol=0)
    got = torch.autograd.grad((lp * a + ent * b).sum(), [h, w])
    want = torch.autograd.grad((lp_ref * a + ent_ref * b).sum(), [h, w])
    assert rel_err(got[0], want[0]) < 1e-3
    assert rel_err(got[1], want[1]) < 1e-2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_without_autocast_the_lm_head_runs_in_the_weights_dtype(dtype) -> None:
    """FSDP2 and fp32 runs: no autocast, so the gathered weight's dtype (bf16
    params under FSDP2's mixed precision) as before."""
    h, w, t, a, _ = _case(2)
    h, w = h.detach().to(dtype).requires_grad_(), w.detach().to(dtype).requires_grad_()
    mode = GemmDtypes()
    with mode:
        lp, _ = chunked_logprobs(h, w, t, 64)
        torch.autograd.grad((lp * a).sum(), [h, w])
    assert set(mode.seen) == {(dtype, dtype)}


def test_lm_head_benchmark_smoke_run_times_both_paths(tmp_path) -> None:
    """scripts/bench_lm_head.py --smoke: both backwards timed, the same gradient."""
    import json
    import math

    from arenobench import lm_head as bench

    out = tmp_path / "lm_head.json"
    bench.main(["--smoke", "--repeats", "1", "--min-run-time", "0", "--out", str(out)])
    res = json.loads(out.read_text())
    assert set(res["timings"]) == {"fp32 (before)", "bf16 (now)"}
    assert all(math.isfinite(t["median_s"]) and t["median_s"] > 0 for t in res["timings"].values())
    assert math.isfinite(res["ratio"]) and res["ratio"] > 0
    assert max(res["grad_rel_err"].values()) < 5e-2  # the two paths compute one gradient
