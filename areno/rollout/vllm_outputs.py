"""vLLM's RequestOutputs -> one flat RolloutBatch, with no Python object per token."""

from __future__ import annotations

from collections.abc import Sequence
from itertools import chain
from typing import TYPE_CHECKING, Any

import numpy as np

from areno.rollout.batch import FINISH_ABORT, FINISH_LENGTH, FINISH_STOP, RolloutBatch, offsets_from_lengths

try:  # vLLM >= 0.11.1
    from vllm.logprobs import FlatLogprobs
except ImportError:  # pragma: no cover - older vLLM
    FlatLogprobs = None  # type: ignore[assignment,misc]

if TYPE_CHECKING:
    from vllm.outputs import RequestOutput

_FINISH = {"stop": FINISH_STOP, "length": FINISH_LENGTH}


def batch_from_request_outputs(
    outputs: Sequence["RequestOutput"], prompt_ids: np.ndarray, prompt_offsets: np.ndarray, n: int
) -> RolloutBatch:
    """vLLM RequestOutputs (one per prompt, in prompt order, n samples each) ->
    RolloutBatch.

    Python work is O(responses): the per-sequence token-id lists and flat
    log-prob lists (vLLM's own objects) are chained into ONE np.fromiter call
    each, which reads them in C; no Python object is created per token and no
    per-sequence array is allocated.
    """
    num_prompts = prompt_offsets.size - 1
    if len(outputs) != num_prompts:
        raise RuntimeError(f"vLLM returned {len(outputs)} outputs for {num_prompts} prompts")
    seqs = [c for out in outputs for c in out.outputs]
    n_resp = num_prompts * n
    if len(seqs) != n_resp:
        raise RuntimeError(f"vLLM returned {len(seqs)} samples for {num_prompts} prompts x n={n}")
    tok_lists = [c.token_ids for c in seqs]
    lp_lists = [_sampled_logprobs(c.logprobs, c.token_ids) for c in seqs]
    lengths = np.fromiter(map(len, tok_lists), dtype=np.int64, count=n_resp)
    lp_lengths = np.fromiter(map(len, lp_lists), dtype=np.int64, count=n_resp)
    if not np.array_equal(lengths, lp_lengths):
        i = int(np.flatnonzero(lengths != lp_lengths)[0])
        raise RuntimeError(f"vLLM returned {lp_lengths[i]} log-probs for {lengths[i]} tokens (response {i})")
    total = int(lengths.sum())
    return RolloutBatch(
        prompt_ids=prompt_ids,
        prompt_offsets=prompt_offsets,
        response_ids=np.fromiter(chain.from_iterable(tok_lists), dtype=np.int32, count=total),
        response_offsets=offsets_from_lengths(lengths),
        response_logprobs=np.fromiter(chain.from_iterable(lp_lists), dtype=np.float32, count=total),
        group_index=np.repeat(np.arange(num_prompts, dtype=np.int64), n),
        finish_reason=np.fromiter(
            (_FINISH.get(c.finish_reason, FINISH_ABORT) for c in seqs), dtype=np.uint8, count=n_resp
        ),
    )


def _sampled_logprobs(logprobs: Any, token_ids: Sequence[int]) -> Sequence[float]:
    """One sequence's sampled-token log-probs. With logprobs=0 a FlatLogprobs
    holds exactly one entry per position (the sampled token): its float list
    is returned as is."""
    if logprobs is None:
        raise RuntimeError("vLLM returned no log-probs (was logprobs=0 dropped?)")
    if FlatLogprobs is not None and isinstance(logprobs, FlatLogprobs):
        return logprobs.logprobs
    # Older vLLM: one dict per position; the sampled token is always present.
    return np.fromiter((d[t].logprob for d, t in zip(logprobs, token_ids)), dtype=np.float32,
                       count=len(token_ids))
