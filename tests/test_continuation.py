"""areno/continuation.py: halted samples' continuation prompts and the splice
that makes each one whole again, on arrays."""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from areno.continuation import continuation_prompts, halted, splice
from areno.rollout.batch import FINISH_ABORT, FINISH_LENGTH, FINISH_STOP, RolloutBatch, offsets_from_lengths
from helpers import random_batch

CAP = 12


def halted_batch() -> tuple[RolloutBatch, np.ndarray]:
    b = random_batch(seed=3, num_prompts=4, group_sizes=[2, 3, 1, 2], max_response=6)
    which = np.array([1, 2, 5, 7])
    finish = np.full(b.num_responses, FINISH_STOP, np.uint8)
    finish[which] = FINISH_ABORT
    version = np.repeat(np.arange(b.num_responses, dtype=np.int32) % 2, b.response_lengths)
    return replace(b, finish_reason=finish, token_version=version), which


def rows(ids: np.ndarray, off: np.ndarray) -> list[list[int]]:
    return [ids[a:z].tolist() for a, z in zip(off[:-1], off[1:])]


def test_a_halted_samples_continuation_prompt_is_its_prompt_then_its_tokens_with_the_cap_left():
    b, which = halted_batch()
    assert np.flatnonzero(halted(b)).tolist() == which.tolist()
    ids, off, budget = continuation_prompts(b, which, CAP)
    prompts, responses = rows(b.prompt_ids, b.prompt_offsets), rows(b.response_ids, b.response_offsets)
    assert rows(ids, off) == [prompts[b.group_index[i]] + responses[i] for i in which]
    assert budget.tolist() == [CAP - len(responses[i]) for i in which]
    assert ids.dtype == np.int32 and off.dtype == np.int64
    multi = replace(b, response_mask=np.ones(b.num_response_tokens, np.uint8))
    assert not halted(multi).any()  # a multi-turn round is never halted: waited for


def test_the_splice_appends_each_continuation_cut_to_its_budget_with_its_log_probs_and_versions():
    b, which = halted_batch()
    _, _, budget = continuation_prompts(b, which, CAP)
    # continuation j: 3 + 2j tokens (the last longer than its budget), its own finish
    c_len = np.array([3, 5, 7, int(budget[3]) + 2])
    total = int(c_len.sum())
    cont = RolloutBatch(
        prompt_ids=np.zeros(4, np.int32), prompt_offsets=np.arange(5, dtype=np.int64),
        response_ids=np.arange(1000, 1000 + total, dtype=np.int32), response_offsets=offsets_from_lengths(c_len),
        response_logprobs=-np.arange(total, dtype=np.float32), group_index=np.arange(4, dtype=np.int64),
        finish_reason=np.array([FINISH_STOP, FINISH_LENGTH, FINISH_STOP, FINISH_STOP], np.uint8))
    out = splice(b, which, cont, budget, version=9, cont_version=4)
    old, new = rows(b.response_ids, b.response_offsets), rows(out.response_ids, out.response_offsets)
    c = rows(cont.response_ids, cont.response_offsets)
    kept = np.minimum(c_len, budget)
    for i in range(b.num_responses):
        extra = c[which.tolist().index(i)][:kept[which.tolist().index(i)]] if i in which else []
        assert new[i] == old[i] + extra
    assert all(len(new[i]) <= CAP for i in which)
    lp, lp_old = rows(out.response_logprobs, out.response_offsets), rows(b.response_logprobs, b.response_offsets)
    assert all(lp[i][:len(lp_old[i])] == lp_old[i] for i in range(b.num_responses))
    assert lp[which[0]][len(old[which[0]]):] == [-0.0, -1.0, -2.0]
    v, v_old = rows(out.token_version, out.response_offsets), rows(b.token_version, b.response_offsets)
    for i in range(b.num_responses):
        tail = [4] * (len(new[i]) - len(old[i]))
        assert v[i] == v_old[i] + tail
    assert out.finish_reason[which].tolist() == [FINISH_STOP, FINISH_LENGTH, FINISH_STOP, FINISH_LENGTH]
    assert not halted(out).any()
    unversioned = splice(replace(b, token_version=None), which, cont, budget, version=9, cont_version=4)
    assert unversioned.token_version[:b.response_lengths[0]].tolist() == [9] * int(b.response_lengths[0])
