"""Tail fill on the transformers engine (rollout/hf_rounds.py): a queued round
joins the running one at a step boundary; the loop is a chain of generates, and
every token it returns is the model's own sample on its prefix. The real tiny
engine, in process."""

from __future__ import annotations

import numpy as np
import pytest

from areno.rollout.batch import FINISH_ABORT, FINISH_LENGTH
from areno.rollout.engine import RoundRequest, SamplingConfig
from areno.rollout.probe import probe_logprobs

LONG = 56  # cut at max_model_len (64): 8 tokens, round 0's short samples
ROUND0 = (np.concatenate([3 + np.arange(LONG) % 40, [5, 12, 3]]).astype(np.int32), np.array([0, LONG, LONG + 3]))
ROUND1 = (np.array([7, 8, 9, 10, 11, 12, 13], dtype=np.int32), np.array([0, 2, 5, 7]))


@pytest.fixture(scope="module")
def engine(tiny_chat_path):
    from areno.rollout.hf import HFEngine

    return HFEngine(tiny_chat_path, dtype="float32", max_model_len=64, seed=0)


def rounds_of(engine, admit_at: int = 1):
    """Round 0 (12 tokens, the long prompt 8) with round 1 (4 tokens) queued:
    admit hands it over at the admit_at-th step boundary where fewer samples
    run than it adds -> [(round, positions, part)] in yield order, the calls."""
    queued = [RoundRequest(*ROUND1, 2, SamplingConfig(max_tokens=4, seed=4, ignore_eos=True))]
    calls: list[int] = []

    def admit(running: int):
        calls.append(running)
        return queued.pop() if queued and len(calls) >= admit_at and running < 6 else None

    first = RoundRequest(*ROUND0, 2, SamplingConfig(max_tokens=12, seed=3, ignore_eos=True))
    return list(engine.generate_rounds(first, admit)), calls


def test_a_queued_round_joins_and_finishes_first_each_token_the_models_own(engine):
    out, calls = rounds_of(engine)
    assert calls[0] == 4  # round 0's 4 samples run; round 1 adds 6: it joins at the first boundary
    assert [(k, p.tolist()) for k, p, _ in out] == [(1, [0, 1, 2]), (0, [0, 1])]  # round 1 ends first
    (_, _, b1), (_, _, b0) = out
    np.testing.assert_array_equal(np.diff(b0.response_offsets), [64 - LONG] * 2 + [12] * 2)
    np.testing.assert_array_equal(np.diff(b1.response_offsets), [4] * 6)
    assert (b0.finish_reason == FINISH_LENGTH).all()  # the context, the budget
    for b in (b0, b1):
        for i in range(b.num_responses):
            p, r = b.prompt_tokens(int(b.group_index[i])), b.response_tokens(i)
            want = probe_logprobs(engine.model, np.concatenate([p, r]))[p.size - 1:]  # the whole context
            # Segments restarted at steps 1 and 5 of round 0: a carried sample's next
            # token comes from a fresh prefill, the same distribution to float rounding.
            np.testing.assert_allclose(b.response_logprobs[b.response_offsets[i]:b.response_offsets[i + 1]],
                                       want, atol=2e-4)


def test_without_a_queued_round_it_is_one_generate_like_the_default(engine):
    out, calls = rounds_of(engine, admit_at=10 ** 6)
    assert [(k, p.tolist()) for k, p, _ in out] == [(0, [0, 1])]
    np.testing.assert_array_equal(np.diff(out[0][2].response_offsets), [8, 8, 12, 12])
    assert len(calls) == 11  # asked at every boundary while samples ran, never handed one


def test_a_halt_ends_every_round_running_with_its_tokens(engine):
    steps: list[int] = []

    def hook(step: int) -> None:
        steps.append(step)
        engine.halt = len(steps) == 3  # the third boundary: segment 2's second step

    engine.step_hook = hook
    try:
        out, _ = rounds_of(engine)
    finally:
        engine.step_hook, engine.halt = None, False
    by_round = {k: b for k, _, b in out}
    assert sorted(by_round) == [0, 1]
    assert (by_round[1].finish_reason == FINISH_ABORT).all() and (np.diff(by_round[1].response_offsets) == 2).all()
    assert (by_round[0].finish_reason == FINISH_ABORT).all() and (np.diff(by_round[0].response_offsets) == 3).all()


def test_a_round_sampling_otherwise_is_refused(engine):
    first = RoundRequest(*ROUND0, 1, SamplingConfig(max_tokens=4, seed=3))
    other = RoundRequest(*ROUND1, 1, SamplingConfig(max_tokens=4, temperature=0.5))
    with pytest.raises(ValueError, match="other warpers"):
        list(engine.generate_rounds(first, lambda running: other))
