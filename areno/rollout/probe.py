"""The weight-sync check: prove that the rollout engine serves the weights just pushed.

A weight update that the engine silently ignores (a dropped tensor, a renamed
parameter, a stale prefix cache) does not crash anything: training goes on
against a policy that no longer matches the sampler, and the importance ratios
quietly lie. Two checks, both here, with the one table of their bounds:

**Exact: the fingerprint.** After a load the engine reports the fp64 sum of
squares of the values it holds, per *module group* (the module path above the
parameter's own module: `model.layers.3.self_attn` holds q/k/v/o and the
norms, `model.layers.3.mlp` gate/up/down, `model` the embedding and final
norm, "" the lm_head). That grouping is what survives vLLM's layouts: fused
qkv_proj / gate_up_proj (one tensor for three or two HF tensors of the same
group), a vocabulary padded with zero rows, weights re-packed for a CPU kernel,
a transposed or blocked storage: a sum of squares is invariant to every
permutation and to added zeros, and each of the values is a bf16 or fp32
number whose fp64 square is exact. The trainer sums what it sent (the same
bf16/fp32 bytes, `WeightStream`). Only the summation order differs, so the
two agree to fp64 rounding, at most n·2^-52 of the group's sum (n elements,
both sides' worst case), and that is the only slack. A group is compared as a
whole so that a failure names it; if the engine's module paths are not the
trainer's (a model vLLM renames), the groups cannot be paired and the totals
are compared instead.

**Numerics: the probe.** The fingerprint proves the bytes, not what the
engine computes with them (dtype, rope, attention kernel, tied head). After a
load both sides score a fixed token sequence (`probe_ids`) and the log-probs
are compared. Two correct forwards of the same weights in different kernels
differ by rounding, which scales with the values rounded: one *unit* is
s·(u + √K·2^-24), with u the dtype's unit roundoff (bf16 2^-8, fp32 2^-24),
K the longest dot product (fp32 sums of K products round ~√K times) and s
the largest |logit| or |log p| at the probed positions (`probe_scale`; real
models' logits reach 20-30: one bf16 unit is then 0.1, ten times the old
fixed 1e-2; a tiny model's |log p| ~ log V dominates its small logits). So:
  - *bound* (no calibration possible): PROBE_ROUNDING_UNITS units. 16:
    correct syncs measured 0.07-1.9 units on the tiny, scaled-logit and
    SmolLM2-135M models, both engines, fp32 and bf16 (docs/DESIGN.md), so 16
    leaves a margin of 8 over the worst; a numerics bug (wrong rope, wrong
    dtype, a head that is not the trainer's) is far beyond it.
  - *calibration*: at the first sync whose fingerprint matched, both sides
    provably hold identical weights, so the diff there (checked against the
    bound) is this engine's and trainer's own rounding noise d0. Later probes
    must stay within PROBE_MARGIN·d0 (the noise moves as the weights change),
    clipped to [PROBE_FLOOR_UNITS, PROBE_ROUNDING_UNITS] units: a lucky small
    d0 (0 happens in fp32) must not make it flaky, and calibration only
    tightens.
The probe is scored at temperature 1 (the model's raw distribution): prompt
log-probs skip the sampler's processors in vLLM, and `probe_logprobs` does the
same.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    import torch

# Unit roundoff of the dtype both sides compute in: the size of one rounding
# error relative to the value (half the spacing of numbers near 1).
UNIT_ROUNDOFF = {"float32": 2.0**-24, "bfloat16": 2.0**-8, "float16": 2.0**-11}
# Probe bound without calibration, in rounding units |z|·u (see the docstring).
PROBE_ROUNDING_UNITS = 16.0
# Calibrated probe tolerance: this multiple of the first matched sync's diff,
# within [PROBE_FLOOR_UNITS, PROBE_ROUNDING_UNITS] rounding units.
PROBE_MARGIN = 4.0
PROBE_FLOOR_UNITS = 4.0
# With a fingerprint, the probe checks numerics, which do not change from one
# sync to the next: it runs at the first sync (calibration) and every
# PROBE_EVERY_FINGERPRINTED-th. An engine without one probes at every sync.
PROBE_EVERY_FINGERPRINTED = 50


class WeightSyncError(RuntimeError):
    """The rollout engine does not serve the weights that were pushed to it."""


# -- exact: the fingerprint ----------------------------------------------------
def sum_squares(t: "torch.Tensor") -> "torch.Tensor":
    """0-d float64 on t's device: sum of t's squares, each value widened to fp64
    inside the kernel (exact squares of bf16/fp32 values, fp64 accumulation).

    One `vector_norm(dtype=float64)`, squared: no fp64 copy of the tensor. The
    copy (`t.double().square().sum()`, as before) touched 4 fresh bytes per
    weight byte: on 2 CPU cores SmolLM2-135M's sum took 7.7 s wall (3.5 s CPU,
    420K page faults), the norm 1.0 s (issue 26, 7; docs/PERFORMANCE.md).
    Squaring the norm back adds ~2^-52 relative, inside the fingerprint's slack
    of n·2^-52 (`fingerprint_mismatch`)."""
    import torch

    return torch.linalg.vector_norm(t.detach().reshape(-1), dtype=torch.float64).square()


def fingerprint_group(name: str) -> str:
    """Tensor name -> its module group: the path above its own module
    ('model.layers.0.self_attn.q_proj.weight' -> 'model.layers.0.self_attn',
    'lm_head.weight' -> ''). HF and vLLM names agree on it (fusing happens
    within a group)."""
    parts = name.split(".")
    return ".".join(parts[:-2])


@dataclass(frozen=True)
class Fingerprint:
    """Per module group: fp64 sum of squares and element count of the values held."""

    sums: Mapping[str, float]
    counts: Mapping[str, int]

    @staticmethod
    def of(items: Iterable[tuple[str, float, int]]) -> "Fingerprint":
        """(tensor name, sum of squares, elements) -> grouped."""
        sums: dict[str, float] = {}
        counts: dict[str, int] = {}
        for name, s, n in items:
            g = fingerprint_group(name)
            sums[g] = sums.get(g, 0.0) + float(s)
            counts[g] = counts.get(g, 0) + int(n)
        return Fingerprint(sums, counts)

    def total(self) -> tuple[float, int]:
        return math.fsum(self.sums.values()), sum(self.counts.values())


def fingerprint_mismatch(got: Fingerprint, want: Fingerprint) -> str | None:
    """None if the engine's fingerprint equals the trainer's to fp64 summation
    rounding; else which group (or the total) differs and by how much."""
    if set(got.sums) == set(want.sums):
        pairs = [(g, got.sums[g], want.sums[g], max(got.counts[g], want.counts[g])) for g in want.sums]
    else:  # module paths the engine renamed: only the totals pair up
        (gs, gn), (ws, wn) = got.total(), want.total()
        pairs = [("all tensors", gs, ws, max(gn, wn))]
    for group, g, w, n in pairs:
        slack = 2.0 * max(n, 1) * 2.0**-53 * max(abs(w), abs(g))
        if not abs(g - w) <= slack:
            return f"{group or 'lm_head'}: sum of squares {g:.10g}, the trainer's {w:.10g}"
    return None


def check_fingerprint(got: Fingerprint, want: Fingerprint, rank: int) -> None:
    """WeightSyncError (naming the rank and the group) unless they match."""
    bad = fingerprint_mismatch(got, want)
    if bad is not None:
        raise WeightSyncError(
            f"weight sync check failed on rank {rank}: the engine's weights are not the trainer's "
            f"({bad}); the engine is not serving the trained weights")


# -- numerics: the probe -------------------------------------------------------
def probe_scale(max_abs_logit: float, logprobs: np.ndarray) -> float:
    """The magnitude whose rounding a probe comparison sees: the largest |logit|
    (the lm_head's output) or |log-prob| (log p = z - logsumexp z: ~log V even
    where logits are small, so it dominates a tiny model's fp32 error)."""
    return max(float(max_abs_logit), float(np.max(np.abs(logprobs))), 1.0)


def reduction_length(config: Any) -> int:
    """The longest dot product of a forward (HF config): max(hidden, intermediate)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return int(max(getattr(text, "hidden_size", 1), getattr(text, "intermediate_size", 1) or 1))


def rounding_unit(dtype: str, scale: float, reduction: int) -> float:
    """s·(u + √K·u32): one rounding error of a value of magnitude `scale`
    (`probe_scale`) computed in `dtype` with fp32 sums of `reduction` (K)
    products. The stored value's rounding dominates in bf16; in fp32 the sums'
    (~√K roundings each): SmolLM2 fp32 measured 24 units of s·u alone."""
    if dtype not in UNIT_ROUNDOFF:
        raise ValueError(f"dtype {dtype!r}: valid: {', '.join(UNIT_ROUNDOFF)}")
    return float(scale) * (UNIT_ROUNDOFF[dtype] + math.sqrt(reduction) * UNIT_ROUNDOFF["float32"])


def probe_tolerance(unit: float, calibration: float | None) -> float:
    """The tolerance of a probe, `unit` its `rounding_unit`: PROBE_ROUNDING_UNITS
    units until a matched sync calibrated it (`calibration`: the diff measured
    there), then PROBE_MARGIN times that, never below the floor (a lucky small
    first diff) nor above the uncalibrated bound (calibration only tightens)."""
    bound = PROBE_ROUNDING_UNITS * unit
    if calibration is None:
        return bound
    return min(max(PROBE_MARGIN * calibration, PROBE_FLOOR_UNITS * unit), bound)


def probe_due(sync_index: int, fingerprinted: bool) -> bool:
    """Whether sync number `sync_index` (0 = the first) runs the probe."""
    return not fingerprinted or sync_index % PROBE_EVERY_FINGERPRINTED == 0


def check_logprobs(got: np.ndarray, ref: np.ndarray, tolerance: float, where: str = "") -> float:
    """got, ref: [L-1] log-probs -> max |got - ref|; WeightSyncError beyond
    `tolerance` (`where`: e.g. ' on rank 0', for the message)."""
    got = np.asarray(got, dtype=np.float64)
    ref = np.asarray(ref, dtype=np.float64)
    if got.shape != ref.shape:
        raise WeightSyncError(f"weight sync probe{where}: engine returned {got.size} log-probs, "
                              f"expected {ref.size}")
    diff = np.abs(got - ref)
    worst = float(np.max(diff)) if diff.size and np.all(np.isfinite(diff)) else float("inf")
    if not worst <= tolerance:
        pos = int(np.argmax(np.nan_to_num(diff, nan=np.inf)))
        raise WeightSyncError(
            f"weight sync probe failed{where}: engine log-probs differ from the trainer's by "
            f"max {worst:.3g} (tolerance {tolerance:.3g}, worst at position {pos + 1} of "
            f"{ref.size + 1}); the engine is not serving the trained weights")
    return worst


def probe_logprobs(model: "torch.nn.Module", ids: np.ndarray, with_scale: bool = False):
    """[L] token ids -> [L-1] float32: log p(ids[i+1] | ids[:i+1]) from one
    transformers forward (and, with_scale, its `probe_scale`); logits
    are cast to fp32 before the log-softmax (bf16 logsumexp loses ~1e-2)."""
    import torch

    ids = np.asarray(ids)
    if ids.ndim != 1 or ids.size < 2:
        raise ValueError(f"probe ids: need a 1-D sequence of at least 2 tokens, got shape {ids.shape}")
    device = next(model.parameters()).device
    x = torch.from_numpy(ids.astype(np.int64, copy=False)).to(device)[None]
    with torch.no_grad():
        logits = model(input_ids=x).logits[0, :-1].float()
        lp = torch.log_softmax(logits, dim=-1).gather(-1, x[0, 1:, None])[:, 0]
    out = lp.cpu().numpy().astype(np.float32, copy=False)
    return (out, probe_scale(float(logits.abs().max()), out)) if with_scale else out
