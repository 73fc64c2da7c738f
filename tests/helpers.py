"""Shared builders for tests: random RolloutBatches with varied shapes."""

from __future__ import annotations

import numpy as np

from areno.rollout.batch import RolloutBatch, offsets_from_lengths


def random_batch(
    seed: int = 0,
    num_prompts: int = 6,
    group_sizes: list[int] | None = None,
    max_prompt: int = 7,
    max_response: int = 9,
    min_response: int = 1,
    vocab: int = 100,
) -> RolloutBatch:
    """Groups of varied size, prompts and responses of varied length."""
    rng = np.random.default_rng(seed)
    if group_sizes is None:
        group_sizes = rng.integers(1, 5, num_prompts).tolist()
    P = len(group_sizes)
    p_len = rng.integers(1, max_prompt + 1, P)
    g = np.repeat(np.arange(P), group_sizes).astype(np.int64)
    N = g.size
    r_len = rng.integers(min_response, max_response + 1, N)
    T = int(r_len.sum())
    return RolloutBatch(
        prompt_ids=rng.integers(0, vocab, int(p_len.sum())).astype(np.int32),
        prompt_offsets=offsets_from_lengths(p_len),
        response_ids=rng.integers(0, vocab, T).astype(np.int32),
        response_offsets=offsets_from_lengths(r_len),
        response_logprobs=(-rng.random(T) * 3).astype(np.float32),
        group_index=g,
        finish_reason=rng.integers(0, 2, N).astype(np.uint8),
    )


def random_rewards(batch: RolloutBatch, seed: int = 0, zero_var_groups: int = 1) -> np.ndarray:
    """Binary-ish rewards; the first `zero_var_groups` groups are constant."""
    rng = np.random.default_rng(seed + 100)
    r = rng.choice([0.0, 0.5, 1.0], size=batch.num_responses)
    for p in range(min(zero_var_groups, batch.num_prompts)):
        r[batch.group_index == p] = 1.0
    return r.astype(np.float32)
