"""Tail fill (issue 39, fleet/tail_fill.py): under --partial-rollouts an engine
process starts the rollout queued behind the one it runs inside the same
generation loop as the running one's tail drains; each round keeps its own
parts, reply and weights bound. The real tiny engines (vLLM, transformers), in
an engine process."""

from __future__ import annotations

import time

import numpy as np
import pytest

LONG = 56  # a prompt this long is cut at max_model_len (64): 8 tokens, the round's short samples
ROUND1 = (np.concatenate([3 + np.arange(LONG) % 40, [5, 12, 3]]).astype(np.int32), np.array([0, LONG, LONG + 3]))


def test_the_rule_fills_once_the_engine_holds_less_than_the_next_round():
    from areno.fleet.tail_fill import fill_now, fillable

    assert fill_now(3, 4) and not fill_now(4, 4) and not fill_now(9, 4)
    offsets = np.array([0, 2, 4])
    assert fillable("rollout", {"version": 1, "offsets": offsets})
    assert not fillable("rollout", {"version": None, "offsets": offsets})  # not --partial-rollouts
    assert not fillable("episodes", {"version": 1, "offsets": offsets})  # multi-turn: never filled in
    assert not fillable("rollout", {"version": 1, "offsets": offsets, "payload": True})
    assert not fillable("rollout", {"version": 1, "offsets": np.array([0])})


@pytest.mark.parametrize("kind", ["hf", pytest.param("vllm", marks=pytest.mark.slow)])
def test_a_queued_round_starts_inside_the_long_tail_of_the_running_one(tiny_chat_path, kind):
    """Round 1 (version 0) has a long tail: its long prompt's samples stop at 8
    tokens, its short one's run to 12. Round 2 (version 1, published meanwhile)
    is queued behind it (the engine holds round 1 until both are there); it joins
    round 1's loop at the first step boundary, after loading version 1 in flight,
    so round 2's 4-token samples finish and stream before round 1 replies (vLLM:
    requests added between steps; transformers: a chain of generates, hf_rounds). Both
    batches come back whole, each token tagged with a version >= its round's."""
    from areno.rollout.engine import SamplingConfig
    from test_async_loop import collected
    from test_backend_units import make_split
    from test_partial_rollouts import engine_config
    from test_split_placement import PROMPTS, split_placement

    if kind == "vllm":
        pytest.importorskip("vllm")
    s1 = SamplingConfig(max_tokens=12, seed=3, ignore_eos=True)
    s2 = SamplingConfig(max_tokens=4, seed=4, ignore_eos=True)
    with split_placement(engine_config(tiny_chat_path, kind)) as (be, fleet, engines):
        be.train(make_split(1))
        region = be.publish_weights(slot=1)  # version 1: round 2's
        hold = fleet.open_stream("hold", lane="hold", detach=True, background=True)
        hold.send(0, "hold_until_queued", count=2)
        first = engines.start_rollout(*ROUND1, 2, s1, None, version=0)
        second = engines.start_rollout(*PROMPTS, 2, s2, region, version=1)
        out1, info1 = collected(first)
        early = len(second.sink.parts) + sum(kind == "part" for _, kind, _ in second.stream.inbox)
        out2, info2 = collected(second)
        assert hold.wait(time.monotonic() + 60)

    assert early > 0  # round 2's parts came before round 1's reply
    assert info1["tail_filled"] == 0 and info2["tail_filled"] == 3 * 2  # every sequence of round 2
    assert info1["inflight_loads"] + info2["inflight_loads"] == 1  # version 1, once, checked
    assert info1["inflight_checks"] + info2["inflight_checks"] == 1

    # Whole: every prompt's 2 samples, in prompt order, at their lengths.
    np.testing.assert_array_equal(np.diff(out1.response_offsets), [64 - LONG] * 2 + [12] * 2)
    np.testing.assert_array_equal(np.diff(out2.response_offsets), [4] * 6)
    np.testing.assert_array_equal(out2.prompt_ids, PROMPTS[0])
    np.testing.assert_array_equal(out1.prompt_ids, ROUND1[0])
    for out in (out1, out2):
        assert np.isfinite(out.response_logprobs).all() and (out.response_logprobs <= 0).all()
    # Round 2 samples only with its own weights; round 1 starts with 0 and gets fresher.
    assert (out2.token_version == 1).all()
    first_tokens = out1.token_version[out1.response_offsets[:-1]]
    assert (first_tokens == 0).all() and set(out1.token_version.tolist()) == {0, 1}
    for a, b in zip(out1.response_offsets[:-1], out1.response_offsets[1:]):
        assert (np.diff(out1.token_version[a:b]) >= 0).all()  # versions never go back in a response
