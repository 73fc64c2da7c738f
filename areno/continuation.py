"""Samples halted mid-generation and their continuation on resume, pure.

Under --partial-rollouts a Ctrl-C does not wait for the rounds in flight: the
engines end every single-turn sample at their next decode step with the tokens
it has (fleet/inflight_loads.py's halt; finish "abort"), and the checkpoint
saves them with their behaviour log-probs and versions. The resumed run samples
the rest of each one from its prompt followed by those tokens, with what is
left of the token cap (`continuation_prompts`), and splices it on (`splice`):
the trajectory trains whole, every token with the log-prob and the version that
sampled it, none generated twice, none lost. A multi-turn trajectory is
continued by its own driver (envs/resume.py), and spliced on here too.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from areno.rewards.plugin import RewardResult
from areno.rollout.batch import (
    FINISH_ABORT, FINISH_LENGTH, RolloutBatch, csr_take, offsets_from_lengths, segment_gather,
)


def halted(batch: RolloutBatch) -> np.ndarray:
    """[N] bool: the single-turn samples an engine halted before they finished."""
    if batch.response_mask is not None:
        return np.zeros(batch.num_responses, bool)
    return batch.finish_reason == FINISH_ABORT


def any_halted(batch: RolloutBatch, scored: RewardResult | None) -> bool:
    """Whether a saved round holds samples a halt ended: single-turn ones (finish
    "abort"), or multi-turn trajectories with their Halted records (its
    rewards' payloads: envs/halted.py; an "abort" there may be an environment's
    failure instead)."""
    if batch.response_mask is not None:
        return scored is not None and scored.payloads is not None and any(p is not None for p in scored.payloads)
    return bool(halted(batch).any())


def continuation_prompts(batch: RolloutBatch, which: np.ndarray, max_tokens: int,
                         ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The halted responses `which` [H] int64 -> ([*] int32 ids, [H+1] int64
    offsets: each one's prompt followed by its tokens so far; [H] int64 the
    tokens left to it under the cap `max_tokens`, at least 1: a halted sample
    stopped short of its cap)."""
    prompts = batch.group_index[which]
    p_ids, p_off = csr_take(batch.prompt_ids, batch.prompt_offsets, prompts)
    r_ids, r_off = csr_take(batch.response_ids, batch.response_offsets, which)
    p_len, r_len = np.diff(p_off), np.diff(r_off)
    # Each row: its prompt, then its response: one gather over the two pools.
    pool = np.concatenate([p_ids, r_ids])
    src_start = np.stack([p_off[:-1], p_ids.size + r_off[:-1]], axis=1).ravel()
    seg_len = np.stack([p_len, r_len], axis=1).ravel()
    ids = pool[segment_gather(src_start, seg_len)[0]]
    return ids.astype(np.int32, copy=False), offsets_from_lengths(p_len + r_len), np.maximum(max_tokens - r_len, 1)


def splice(batch: RolloutBatch, which: np.ndarray, cont: RolloutBatch, budget: np.ndarray,
           version: int, cont_version: int) -> RolloutBatch:
    """`batch` with each halted response which[j] followed by cont's response j
    ([H] of them, one per row of continuation_prompts), cut to budget[j] tokens
    (finish "length" there, else cont's finish). Token versions: the batch's
    own (`version`, its round's, where it records none), `cont_version` for the
    continuation's where cont records none."""
    n = batch.num_responses
    old_len = np.diff(batch.response_offsets)
    c_len = np.diff(cont.response_offsets)
    kept = np.minimum(c_len, budget)
    add = np.zeros(n, np.int64)
    add[which] = kept
    t_old = batch.response_ids.size
    # Segments in response order: its own tokens, then its continuation (empty
    # when not halted), gathered from the pool (batch's tokens, cont's tokens).
    c_start = np.zeros(n, np.int64)
    c_start[which] = t_old + cont.response_offsets[:-1]
    src_start = np.stack([batch.response_offsets[:-1], c_start], axis=1).ravel()
    seg_len = np.stack([old_len, add], axis=1).ravel()
    gather, _ = segment_gather(src_start, seg_len)

    def pooled(a: np.ndarray, b: np.ndarray) -> np.ndarray:
        return np.concatenate([a, b])[gather]

    mask = None if batch.response_mask is None else pooled(batch.response_mask, cont.response_mask)
    turn_cut = None if batch.turn_cut is None else batch.turn_cut.copy()
    if turn_cut is not None:
        turn_cut[which] = cont.turn_cut
    own_v = batch.token_version if batch.token_version is not None else \
        np.full(t_old, version, np.int32)
    cont_v = cont.token_version if cont.token_version is not None else \
        np.full(cont.response_ids.size, cont_version, np.int32)
    finish = batch.finish_reason.copy()
    finish[which] = np.where(c_len > budget, FINISH_LENGTH, cont.finish_reason)
    return RolloutBatch(
        prompt_ids=batch.prompt_ids, prompt_offsets=batch.prompt_offsets,
        response_ids=pooled(batch.response_ids, cont.response_ids),
        response_offsets=offsets_from_lengths(old_len + add),
        response_logprobs=pooled(batch.response_logprobs, cont.response_logprobs),
        group_index=batch.group_index, finish_reason=finish,
        token_version=pooled(own_v, cont_v).astype(np.int32, copy=False),
        response_mask=mask, turn_cut=turn_cut,
    )


def tails(batch: RolloutBatch, skip: np.ndarray) -> RolloutBatch:
    """`batch` with each response j without its first skip[j] tokens ([N] int64):
    what a continuation added to the saved responses it started from."""
    off = batch.response_offsets
    gather, out_off = segment_gather(off[:-1] + skip, np.diff(off) - skip)

    def cut(a: np.ndarray | None) -> np.ndarray | None:
        return None if a is None else a[gather]
    return replace(batch, response_ids=batch.response_ids[gather], response_offsets=out_off,
                   response_logprobs=batch.response_logprobs[gather], response_mask=cut(batch.response_mask),
                   token_version=cut(batch.token_version))
