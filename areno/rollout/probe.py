"""Weight-sync probe: prove that the rollout engine serves the weights just pushed.

A weight update that the engine silently ignores (a dropped tensor, a renamed
parameter, a stale prefix cache) does not crash anything: training goes on
against a policy that no longer matches the sampler, and the importance ratios
quietly lie. So after each push the trainer sends a probe: a short token
sequence and the log-probs its *new* weights give it (fp32 forward). The engine
scores the same tokens; any disagreement beyond `tolerance` raises.

The probe is scored at temperature 1 (the model's raw distribution): prompt
log-probs skip the sampler's processors in vLLM, and `probe_logprobs` does the
same.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    import torch


class WeightSyncError(RuntimeError):
    """The rollout engine does not serve the weights that were pushed to it."""


@dataclass(frozen=True)
class Probe:
    """token_ids: [L] int32 (L >= 2); expected_logprobs: [L-1] float32, the
    log-prob of token i+1 given tokens 0..i under the new weights;
    tolerance: largest acceptable max |engine - expected| (fp32 engines agree
    to ~1e-5; a bf16 engine needs ~0.1)."""

    token_ids: np.ndarray
    expected_logprobs: np.ndarray
    tolerance: float = 1e-3

    def __post_init__(self) -> None:
        ids, exp = self.token_ids, self.expected_logprobs
        if not isinstance(ids, np.ndarray) or ids.dtype != np.int32 or ids.ndim != 1 or ids.size < 2:
            raise ValueError("Probe.token_ids: expected a 1-D int32 array of at least 2 tokens")
        if not isinstance(exp, np.ndarray) or exp.dtype != np.float32 or exp.shape != (ids.size - 1,):
            raise ValueError(
                f"Probe.expected_logprobs: expected float32 of shape ({ids.size - 1},), "
                f"got {getattr(exp, 'dtype', type(exp))} {getattr(exp, 'shape', '')}"
            )
        if not np.all(np.isfinite(exp)):
            raise ValueError("Probe.expected_logprobs: not all finite")
        if not self.tolerance > 0:
            raise ValueError(f"Probe.tolerance: must be > 0, got {self.tolerance}")

    @classmethod
    def from_model(cls, model: "torch.nn.Module", token_ids: Any, tolerance: float = 1e-3) -> "Probe":
        """Build the probe from the trainer's model (after the optimizer step)."""
        ids = np.ascontiguousarray(token_ids, dtype=np.int32)
        return cls(ids, probe_logprobs(model, ids), tolerance)


def probe_logprobs(model: "torch.nn.Module", ids: np.ndarray) -> np.ndarray:
    """[L] token ids -> [L-1] float32: log p(ids[i+1] | ids[:i+1]) from one
    transformers forward; logits are cast to fp32 before the log-softmax (bf16
    logsumexp loses ~1e-2)."""
    import torch

    ids = np.asarray(ids)
    if ids.ndim != 1 or ids.size < 2:
        raise ValueError(f"probe ids: need a 1-D sequence of at least 2 tokens, got shape {ids.shape}")
    device = next(model.parameters()).device
    x = torch.from_numpy(ids.astype(np.int64, copy=False)).to(device)[None]
    with torch.no_grad():
        logits = model(input_ids=x).logits[0, :-1].float()
        lp = torch.log_softmax(logits, dim=-1).gather(-1, x[0, 1:, None])[:, 0]
    return lp.cpu().numpy().astype(np.float32, copy=False)


def verify_probe(engine: Any, probe: Probe) -> float:
    """Score `probe` with `engine.prompt_logprobs`; return max |diff|, or raise
    WeightSyncError when it exceeds probe.tolerance."""
    got = np.asarray(engine.prompt_logprobs(probe.token_ids), dtype=np.float32)
    if got.shape != probe.expected_logprobs.shape:
        raise WeightSyncError(
            f"weight sync probe: engine returned {got.shape[0]} log-probs for "
            f"{probe.token_ids.size} tokens (expected {probe.expected_logprobs.size})"
        )
    diff = np.abs(got.astype(np.float64) - probe.expected_logprobs)
    worst = float(np.max(diff)) if np.all(np.isfinite(diff)) else float("inf")
    if not worst <= probe.tolerance:
        pos = int(np.argmax(np.nan_to_num(diff, nan=np.inf)))
        raise WeightSyncError(
            f"weight sync probe failed: engine log-probs differ from the trainer's by "
            f"max {worst:.3g} (tolerance {probe.tolerance:g}, worst at position {pos + 1} "
            f"of {probe.token_ids.size}); the engine is not serving the pushed weights"
        )
    return worst
