"""The GPU's varlen branch on CPU (issue 17, 2a/2b): bf16 autocast over fp32
master weights (`single`, and DDP), through the varlen adapter, into a stand-in
with the exact signature of torch 2.10, 2.11 and 2.13's `varlen_attn` that
asserts the flash kernel's input contract (tests/varlen_signatures.py), and the
results compared with the sdpa path under the same autocast."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.attention.varlen as tv
import torch.nn.functional as F
import varlen_signatures as vs
from helpers import random_batch
from rank_test_hooks import full_state
from test_backend_units import VOCAB, policy_module, local_worker, make_split

from areno.backend import attention, worker
from areno.backend.handoff import PackWriter
from areno.pack import build_train_pack

BF16 = torch.autocast("cpu", dtype=torch.bfloat16)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """|a - b| / |b| in the L2 norm over the whole tensor."""
    return float((a.double() - b.double()).norm() / b.double().norm())


def test_the_2_13_stand_in_has_the_installed_signature() -> None:
    """The stand-in for the installed torch is its signature, name for name and
    kind for kind, with the same defaults: a changed torch fails here first."""
    import inspect

    installed = inspect.signature(tv.varlen_attn).parameters
    stand_in = inspect.signature(vs.make("2.13", [])).parameters
    assert vs.parameter_names(tv.varlen_attn) == vs.parameter_names(vs.make("2.13", []))
    assert [p.default for p in installed.values()] == [p.default for p in stand_in.values()]


def test_the_adapter_reads_each_signature() -> None:
    got = {v: attention.varlen_signature(vs.make(v, [])) for v in vs.VERSIONS}
    assert got == {
        "2.10": attention.VarlenSignature(causal_by_window=False, has_scale=False, has_gqa=False),
        "2.11": attention.VarlenSignature(causal_by_window=True, has_scale=True, has_gqa=False),
        "2.13": attention.VarlenSignature(causal_by_window=True, has_scale=True, has_gqa=True),
    }


def test_an_unknown_varlen_signature_warns_once_and_the_known_ones_do_not() -> None:
    import warnings

    def varlen_attn_next(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
                         window_size=(-1, -1), enable_gqa=False, softcap=0.0):
        raise AssertionError("not called")

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a known signature warns nothing
        for v in vs.VERSIONS:
            attention.varlen_signature(vs.make(v, []))
    with pytest.warns(RuntimeWarning, match=r"varlen_attn\(.*softcap.*\) is not one of the signatures areno "
                                            r"was tested with \(torch 2.10, 2.11, 2.13\)"):
        sig = attention.varlen_signature(varlen_attn_next)
    assert sig == attention.VarlenSignature(causal_by_window=True, has_scale=True, has_gqa=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        attention.varlen_signature(varlen_attn_next)  # once: read per function, not per layer call


def _bf16_forward_backward(tiny_chat_path, impl: str, pack):
    """(logp, grads) of one packed pass under bf16 autocast, backward outside it
    (as the train step), over fp32 master weights."""
    policy = policy_module(tiny_chat_path, impl)
    with BF16:
        lp, ent = policy(pack.input_ids.long()[None], pack.position_ids.long()[None], pack.targets.long()[None],
                         cu_seqlens=pack.cu_seqlens, max_seqlen=pack.max_seqlen)
    (lp.sum() + ent.sum()).backward()
    return lp, {n: p.grad for n, p in policy.named_parameters()}


@pytest.fixture(scope="module")
def sdpa_bf16(tiny_chat_path):
    """The pack and the sdpa path's (logp, grads) under bf16 autocast."""
    b = random_batch(seed=3, vocab=VOCAB, max_response=12)
    pack = build_train_pack(b, np.zeros(b.num_responses, np.float32))
    return pack, *_bf16_forward_backward(tiny_chat_path, "sdpa", pack)


@pytest.mark.parametrize("version", vs.VERSIONS)
def test_bf16_autocast_reaches_the_kernel_in_one_half_dtype(tiny_chat_path, sdpa_bf16, monkeypatch, version) -> None:
    """fp32 masters under bf16 autocast: RMSNorm hands q, k over fp32 and v bf16;
    the kernel gets all three bf16, K/V repeated only where the signature has no
    enable_gqa, and log-probs and gradients agree with the sdpa path."""
    calls: list = []
    monkeypatch.setattr(tv, "varlen_attn", vs.make(version, calls))
    pack, lp_s, g_s = sdpa_bf16
    lp_v, g_v = _bf16_forward_backward(tiny_chat_path, "varlen", pack)
    heads = (4, 2) if version == "2.13" else (4, 4)
    assert calls and all(c["dtype"] == torch.bfloat16 and c["heads"] == heads for c in calls)
    torch.testing.assert_close(lp_v, lp_s, atol=2e-2, rtol=0)
    for n in g_s:
        assert rel_err(g_v[n], g_s[n]) < 3e-2, n  # two bf16 paths: measured <= 1.3%


@pytest.mark.parametrize("version", vs.VERSIONS)
def test_a_model_scale_other_than_rsqrt_d_reaches_every_kernel(monkeypatch, version) -> None:
    """Gemma-type models scale by 1/sqrt(query_pre_attn_scalar), not 1/sqrt(D):
    passed as `scale` where the kernel takes one, pre-applied to q where not."""
    calls: list = []
    monkeypatch.setattr(tv, "varlen_attn", vs.make(version, calls))
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, h, 12, 16, generator=g) for h in (4, 2, 2))
    cu = torch.tensor([0, 5, 12], dtype=torch.int32)
    scale = 0.5  # 2x the kernel's default 1/sqrt(16): a clear difference
    with BF16:
        out, _ = attention.varlen(None, q, k, v, scaling=scale, cu_seq_lens_q=cu, max_length_q=7)
    want = torch.cat([F.scaled_dot_product_attention(q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], is_causal=True,
                                                      scale=scale, enable_gqa=True)
                      for a, b in ((0, 5), (5, 12))], dim=2).transpose(1, 2)
    assert out.dtype == torch.bfloat16 and out.shape == (1, 12, 4, 16)
    torch.testing.assert_close(out.float(), want, atol=3e-2, rtol=3e-2)
    assert calls[0]["scale"] == (None if version == "2.10" else scale)


def test_fp32_inputs_outside_autocast_are_refused_by_name() -> None:
    q = torch.randn(1, 2, 4, 8)
    with pytest.raises(ValueError, match="varlen attention needs fp16/bf16 inputs"):
        attention.varlen(None, q, q, q, cu_seq_lens_q=torch.tensor([0, 4], dtype=torch.int32), max_length_q=4)


def _one_step(path, monkeypatch, impl: str, strategy: str) -> tuple[dict, dict]:
    """One optimizer step of a bf16 rank in this process; its metrics and weights."""
    monkeypatch.setattr(worker, "resolve_attn_implementation", lambda cfg: impl)
    with local_worker(path, monkeypatch, lr=1e-3, dtype="bfloat16", strategy=strategy) as w:
        assert w.wrapped.strategy == ("single" if strategy == "auto" else strategy)
        assert next(w.hf.parameters()).dtype == torch.float32  # fp32 masters, bf16 autocast
        writer = PackWriter()
        try:
            (h,) = writer.write(make_split(1, num_minibatches=1))
            step = w.cmd_train(h)["steps"][0]
        finally:
            writer.close()
        return step, full_state(w)


@pytest.mark.parametrize("strategy", ["auto", "ddp"])
def test_bf16_train_step_through_varlen_matches_sdpa(tiny_chat_path, monkeypatch, strategy) -> None:
    """The GPU's one-rank (`auto` -> single) and DDP branches in bf16: a whole
    optimizer step through torch 2.11's varlen (the H200's torch) against the
    same step through sdpa."""
    calls: list = []
    monkeypatch.setattr(tv, "varlen_attn", vs.make("2.11", calls))
    got_v, state_v = _one_step(tiny_chat_path, monkeypatch, "varlen", strategy)
    assert calls, "the varlen kernel never ran"
    got_s, state_s = _one_step(tiny_chat_path, monkeypatch, "sdpa", strategy)
    for key in ("loss", "grad_norm", "entropy"):
        assert got_v[key] == pytest.approx(got_s[key], rel=3e-2, abs=1e-3), key
    for n in state_s:
        torch.testing.assert_close(state_v[n], state_s[n], atol=2e-3, rtol=0, msg=n)
