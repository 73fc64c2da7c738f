"""In-flight weight updates at the engine level, on the real tiny model: new
weights loaded at a step boundary in the middle of a generation keep every
request; the tokens before the swap are those of the old weights alone, the
tokens after carry the new version and the new model's log-probs on their prefix
(the cache of the old tokens is recomputed: rollout/hf_inflight.py)."""

from __future__ import annotations

import copy

import numpy as np
import pytest

from areno.rollout.engine import SamplingConfig

PROMPTS = [[5, 6, 7, 8, 9], [10, 11], [12, 13, 14, 15, 16, 17, 18]]
SWAP_AT = 5  # tokens sampled with the old weights
MAX_TOKENS = 14


@pytest.fixture(scope="module", params=["hf", "vllm"])
def engine(request, tiny_chat_path):
    if request.param == "hf":
        from areno.rollout.hf import HFEngine

        eng = HFEngine(tiny_chat_path, dtype="float32", seed=0, max_model_len=128)
    else:
        pytest.importorskip("vllm")
        from areno.rollout.vllm import VLLMEngine

        eng = VLLMEngine(tiny_chat_path, dtype="float32", seed=0, max_model_len=128,
                         kv_cache_memory_bytes=16 << 20)
    yield eng
    eng.shutdown()


def _swap_at(engine, step: int, state: dict, version: int):
    def hook(done: int) -> None:
        if done == step:
            engine.update_weights_inflight(state.items(), version)
    return hook


@pytest.mark.parametrize("n", [1, 2])
def test_engine_takes_new_weights_mid_generation_without_dropping_requests(
        engine, n, tiny_chat_model, perturbed_state, ref_logprobs, make_prompts):
    old = {k: v.clone() for k, v in tiny_chat_model.state_dict().items()}
    new = perturbed_state(old, seed=1, scale=0.2)
    new_model = copy.deepcopy(tiny_chat_model)
    new_model.load_state_dict(new)
    ids, off = make_prompts(PROMPTS)
    s = SamplingConfig(temperature=1.0, max_tokens=MAX_TOKENS, ignore_eos=True, seed=7)
    engine.update_weights_inflight(old.items(), 3)  # between generates: version 3
    engine.step_hook = lambda done: None  # the boundary runs, nothing loaded
    ref = engine.generate(ids, off, n, s)
    engine.step_hook = _swap_at(engine, SWAP_AT, new, 4)
    try:
        got = engine.generate(ids, off, n, s)
    finally:
        engine.step_hook = None
        engine.update_weights_inflight(old.items(), 3)
    assert_swapped_mid_generation(got, ref, n, ref_logprobs(new_model, got))


def assert_swapped_mid_generation(got, ref, n: int, new_logprobs: np.ndarray) -> None:
    """got: a generate of PROMPTS x n whose weights went from version 3 to 4 at
    decode step SWAP_AT; ref: the same generate on version 3 alone; new_logprobs:
    [T] of got's tokens under version 4's model (conftest's ref_logprobs)."""
    assert got.num_responses == ref.num_responses == 3 * n
    assert np.all(got.response_lengths == MAX_TOKENS)  # every request ran to the end
    np.testing.assert_array_equal(got.group_index, ref.group_index)
    assert ref.token_version.tolist() == [3] * ref.num_response_tokens
    before = got.token_version == 3
    after = got.token_version == 4
    assert np.all(before | after)
    for i in range(got.num_responses):  # each response: old tokens, then new ones, both there
        v = got.token_version[got.response_offsets[i]:got.response_offsets[i + 1]]
        k = int((v == 3).sum())
        assert 0 < k < MAX_TOKENS and np.all(v[:k] == 3), v
    # tokens before the swap: the old weights' alone (same seed, same stream)
    np.testing.assert_array_equal(got.response_ids[before], ref.response_ids[before])
    np.testing.assert_allclose(got.response_logprobs[before], ref.response_logprobs[before], atol=1e-4)
    # tokens after: sampled by the new weights on the whole prefix (recomputed cache)
    assert not np.array_equal(got.response_ids[after], ref.response_ids[after])
    np.testing.assert_allclose(got.response_logprobs[after], new_logprobs[after], atol=1e-4)


def test_a_generate_without_a_version_carries_none(engine, make_prompts):
    ids, off = make_prompts(PROMPTS)
    engine.weight_version = None
    b = engine.generate(ids, off, 1, SamplingConfig(max_tokens=4, seed=1))
    assert b.token_version is None


def test_a_load_between_generates_is_no_swap_inside_the_next(engine, tiny_chat_model, make_prompts,
                                                              monkeypatch):
    """Weights loaded before a generate: every token carries their version, and
    the transformers engine recomputes no cache (it was built with them)."""
    import areno.rollout.hf_inflight as hf_inflight

    recomputed: list[int] = []
    real = hf_inflight.recompute_cache
    monkeypatch.setattr(hf_inflight, "recompute_cache", lambda *a: recomputed.append(1) or real(*a))
    old = {k: v.clone() for k, v in tiny_chat_model.state_dict().items()}
    ids, off = make_prompts(PROMPTS)
    engine.update_weights_inflight(old.items(), 8)
    steps: list[int] = []
    engine.step_hook = steps.append
    try:
        b = engine.generate(ids, off, 2, SamplingConfig(max_tokens=6, ignore_eos=True, seed=2))
    finally:
        engine.step_hook = None
    assert set(b.token_version.tolist()) == {8} and steps[:3] == [1, 2, 3]
    assert recomputed == []


def test_a_halt_ends_every_request_at_the_step_boundary_with_the_tokens_it_sampled(engine, make_prompts):
    """engine.halt set by the step hook (the run saving, fleet/inflight_loads.py):
    every request ends there, finish "abort", holding exactly the tokens and
    log-probs the unhalted generate sampled up to that step (same seed), each
    with its version; the engine then serves whole generates again."""
    from areno.rollout.batch import FINISH_ABORT

    ids, off = make_prompts(PROMPTS)
    s = SamplingConfig(temperature=1.0, max_tokens=MAX_TOKENS, ignore_eos=True, seed=7)
    engine.weight_version = 3
    engine.step_hook = lambda done: None
    try:
        ref = engine.generate(ids, off, 2, s)

        def hook(done: int) -> None:
            engine.halt = done == SWAP_AT
        engine.step_hook = hook
        got = engine.generate(ids, off, 2, s)
    finally:
        engine.step_hook, engine.halt, engine.weight_version = None, False, None
    assert got.num_responses == 6 and np.all(got.finish_reason == FINISH_ABORT)
    assert np.all(got.response_lengths == SWAP_AT)
    np.testing.assert_array_equal(got.group_index, ref.group_index)
    first = np.concatenate([np.arange(a, a + SWAP_AT) for a in ref.response_offsets[:-1]])
    np.testing.assert_array_equal(got.response_ids, ref.response_ids[first])
    np.testing.assert_allclose(got.response_logprobs, ref.response_logprobs[first], atol=1e-4)
    assert got.token_version.tolist() == [3] * got.num_response_tokens
    again = engine.generate(ids, off, 2, s)
    assert np.all(again.response_lengths == MAX_TOKENS)


def test_a_due_rounds_running_samples_end_at_the_cut_with_their_tokens_the_next_round_runs_on(
        engine, make_prompts):
    """--cut-at-deadline at the engine (rollout.engine.due): in a tail-filled loop
    (generate_rounds), round 1 (admitted with version 0) and round 2 (version 1,
    joined at the first step boundary) run until the step hook, at its SWAP_AT-th
    call, says rounds of version 0 are due (engine.cut_version, as
    InflightLoads.step does after an offer). Round 1's samples end there, each
    with exactly the SWAP_AT tokens it sampled, finish "length", counted in
    engine.cut_samples; round 2's run on to their cap."""
    from dataclasses import replace

    from areno.rollout.batch import FINISH_LENGTH, RolloutBatch
    from areno.rollout.engine import RoundRequest

    ids, off = make_prompts(PROMPTS)
    s = SamplingConfig(temperature=1.0, max_tokens=MAX_TOKENS, ignore_eos=True, seed=7)
    later = RoundRequest(*make_prompts(PROMPTS[:2]), 2, replace(s, seed=8), version=1)
    queue, calls = [later], []

    def hook(done: int) -> None:
        calls.append(done)
        engine.cut_version = 0 if len(calls) >= SWAP_AT else None

    engine.weight_version, engine.step_hook = 1, hook
    try:
        parts = list(engine.generate_rounds(RoundRequest(ids, off, 2, s, version=0),
                                            lambda running: queue.pop() if queue else None))
        cut = engine.cut_samples
    finally:
        engine.step_hook, engine.cut_version, engine.cut_samples, engine.weight_version = None, None, 0, None
    rounds = {k: RolloutBatch.merge_parts([p for j, _, p in parts if j == k],
                                          [pos for j, pos, _ in parts if j == k])[0] for k in (0, 1)}
    assert {k: sum(pos.size for j, pos, _ in parts if j == k) for k in (0, 1)} == {0: 3, 1: 2}
    assert cut == 6 and np.all(rounds[0].response_lengths == SWAP_AT)
    assert np.all(rounds[0].finish_reason == FINISH_LENGTH)
    assert np.all(rounds[1].response_lengths == MAX_TOKENS) and np.all(rounds[1].finish_reason == FINISH_LENGTH)
    for b in rounds.values():
        assert np.isfinite(b.response_logprobs).all() and (b.response_logprobs <= 0).all()
