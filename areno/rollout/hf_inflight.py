"""In-flight weight updates for the transformers engine: new weights between
two decode steps of a `generate`, the requests it holds kept.

`generate` calls a stopping criterion after every sampled token and before the
next forward: that is the step boundary. There `StepBoundary` runs the engine's
`step_hook` (where a caller may load new weights: HFEngine.update_weights_inflight),
and when the weights changed it recomputes the KV cache of every row (prompt and
the tokens sampled so far) under the new weights, in place, before the next token
is sampled.

Why recompute and not keep the old version's KV (vLLM's keep-mode pause): with
the old keys and values the next token's distribution is neither policy's on
its prefix, so its behaviour log-prob names no model the trainer could
recompute; after the recompute every token sampled past the swap is exactly
the new policy's sample on its prefix (its log-prob matches a plain forward of
the new weights), which is what the decoupled objective assumes of a token
tagged with the new version. The price is one prefill of the rows held, once
per version, while decoding costs one forward per token.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from transformers.cache_utils import DynamicCache
from transformers.generation.stopping_criteria import StoppingCriteria


class StepBoundary(StoppingCriteria):
    """The step boundary of one `generate`: runs engine.step_hook(tokens sampled
    so far), recomputes the cache when the weights changed there, and records
    (step, version) of each swap. Stops every row only when the hook set
    engine.halt (an interrupted run saves its rounds mid-generation).

    engine: HFEngine; cache: the DynamicCache generate fills; mask: [B, L] int64
    the rows' attention mask at the start (L: the left-padded prompt width)."""

    def __init__(self, engine: Any, cache: DynamicCache, mask: torch.Tensor) -> None:
        self.engine, self.cache, self.mask = engine, cache, mask
        self.steps = 0
        self.swaps: list[tuple[int, int]] = []

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor, **kwargs: Any) -> torch.BoolTensor:
        self.steps += 1
        eng = self.engine
        if eng.step_hook is not None:
            eng.step_hook(self.steps)
        if eng.halt:  # the run is saving: every row ends here, its tokens kept (finish "abort")
            return torch.ones(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
        if eng.kv_stale:
            recompute_cache(eng.model, self.cache, input_ids, self.mask)
            eng.kv_stale = False
            self.swaps.append((self.steps, eng.weight_version))
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

    def column_versions(self, width: int, start: int | None) -> np.ndarray:
        """[width] int32: the version that sampled each new-token column (column j
        is sampled at step j for every row); start: the version before any swap."""
        out = np.full(width, -1 if start is None else start, dtype=np.int32)
        for step, version in self.swaps:
            out[step:] = version
        return out


def recompute_cache(model: Any, cache: DynamicCache, input_ids: torch.Tensor, mask: torch.Tensor) -> None:
    """Replace `cache`'s keys and values (of input_ids[:, :-1]: the last token is
    the next forward's input) by the current weights' own, in place: generate
    keeps its reference to the cache object. Positions follow generate's rule
    for left padding (the prompt's mask, then one per sampled token)."""
    seq = input_ids[:, :-1]
    ones = torch.ones(seq.shape[0], seq.shape[1] - mask.shape[1], dtype=mask.dtype, device=mask.device)
    fresh = prefill(model, seq, torch.cat([mask, ones], dim=1))
    for live, new in zip(cache.layers, fresh.layers, strict=True):
        live.keys, live.values = new.keys, new.values


def prefill(model: Any, x: torch.Tensor, mask: torch.Tensor) -> DynamicCache:
    """The KV cache of [B, L] rows x under their [B, L] attention mask, positions
    by generate's rule for left padding; no logits asked for (logits_to_keep=1:
    one position, not [B, L, vocab])."""
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids=x, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0),
              past_key_values=cache, use_cache=True, logits_to_keep=1)
    return cache


def stack_rows(top: DynamicCache, bottom: DynamicCache) -> DynamicCache:
    """`top` with `bottom`'s rows after its own (both of one width) -> top."""
    for a, b in zip(top.layers, bottom.layers, strict=True):
        a.keys, a.values = torch.cat([a.keys, b.keys]), torch.cat([a.values, b.values])
    return top
