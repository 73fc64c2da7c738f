"""Test helpers for multi-turn rollouts: an engine wrapper that records every
request and what it sampled, and the check that the trajectories are exactly
those tokens (tests/test_env_driver.py, the real-model tests)."""

from __future__ import annotations

from typing import Any

import numpy as np

from areno.rollout.batch import turn_segments
from areno.pack import build_train_pack


class TracingEngine:
    """An engine whose generate_stream calls are recorded: (prompts [list of
    int lists], sampled [list of (ids, logprobs)]) per request, in order."""

    def __init__(self, engine: Any) -> None:
        self.engine, self.max_model_len = engine, engine.max_model_len
        self.requests: list[tuple[list[int], np.ndarray, np.ndarray]] = []

    def generate_stream(self, ids, offsets, n, sampling, min_groups=1):
        prompts = [p.tolist() for p in np.split(ids, offsets[1:-1])]
        for pos, part in self.engine.generate_stream(ids, offsets, n, sampling, min_groups=min_groups):
            for j, p in enumerate(pos.tolist()):
                a, b = part.response_offsets[j], part.response_offsets[j + 1]
                self.requests.append((prompts[p], part.response_ids[a:b].copy(), part.response_logprobs[a:b].copy()))
            yield pos, part


def assert_token_in_token_out(trace: TracingEngine, out: Any, fmt: Any) -> int:
    """Every trajectory of out.batch is its sampled turns and observation tokens
    exactly; each turn was requested with the prompt + trajectory so far; the
    trained tokens (pack targets on the loss mask) are the sampled ones. -> turns checked."""
    batch = out.batch
    by_context: dict[tuple, list] = {}  # a group's first turns share their context
    for p, ids, lps in trace.requests:
        by_context.setdefault(tuple(p), []).append((ids, lps))
    checked = 0
    for i in range(batch.num_responses):
        prompt = batch.prompt_tokens(int(batch.group_index[i])).tolist()
        context, k = list(prompt), 0
        segs = turn_segments(batch, i)
        for m, ids in segs:
            if m == 1:  # a turn: requested with exactly this context, sampled exactly these ids
                a = batch.response_offsets[i] + len(context) - len(prompt)
                got = (ids.tolist(), batch.response_logprobs[a:a + ids.size].tolist())
                cands = [(x.tolist(), y.tolist()) for x, y in by_context[tuple(context)]]
                assert got in cands, "a turn is not what the engine sampled for its context"
                del by_context[tuple(context)][cands.index(got)]
                checked += 1
            else:  # an observation: the format's tokens for that text, once
                last = context[-1]
                assert ids.tolist() == fmt.tokens(out.observations[i][k], last).tolist()
                k += 1
            context += ids.tolist()
    pack = build_train_pack(batch, np.ones(batch.num_responses, np.float32))
    trained = pack.targets[pack.loss_mask].numpy()
    want = np.concatenate([ids for i in pack.sample_index.tolist() for m, ids in turn_segments(batch, i) if m == 1])
    assert np.array_equal(trained, want)
    assert np.array_equal(pack.old_logprobs[pack.loss_mask].numpy(), batch.response_logprobs[batch.policy_mask])
    return checked
