"""HFEngine (transformers generate) with the tiny fp32 model, plus the
engine-independent parts of areno.rollout.engine (SamplingConfig, make_engine)."""

from __future__ import annotations

import builtins
import copy

import numpy as np
import pytest
import torch

from areno.rollout.batch import FINISH_LENGTH, FINISH_STOP
from areno.rollout.engine import RolloutEngine, SamplingConfig
from areno.rollout.factory import EngineSpec, make_engine
from areno.rollout.hf import HFEngine
from areno.rollout.probe import Probe, WeightSyncError, probe_logprobs, verify_probe

MAX_MODEL_LEN = 128
PROMPTS = [[5, 6, 7, 8, 9], [10, 11], [12, 13, 14, 15, 16, 17, 18], [19, 20, 21], [22, 23]]
PROBE_IDS = np.arange(3, 40, dtype=np.int32)


@pytest.fixture(scope="module")
def engine(tiny_chat_path):
    eng = HFEngine(tiny_chat_path, dtype="float32", seed=0, max_model_len=MAX_MODEL_LEN)
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def original_state(tiny_chat_model):
    return {k: v.clone() for k, v in tiny_chat_model.state_dict().items()}


@pytest.fixture
def restore_weights(engine, original_state):
    yield
    engine.update_weights(original_state.items())


def test_is_a_rollout_engine(engine):
    assert isinstance(engine, RolloutEngine)
    assert engine.eos_token_ids  # from generation_config: <|im_end|>, <|endoftext|>


def test_batch_layout_groups_prompts_of_mixed_lengths(engine, make_prompts):
    ids, off = make_prompts(PROMPTS)  # lengths 5, 2, 7, 3, 2: four length groups
    b = engine.generate(ids, off, 3, SamplingConfig(max_tokens=10, seed=1))
    assert b.num_prompts == 5 and b.num_responses == 15
    np.testing.assert_array_equal(b.prompt_ids, ids)
    np.testing.assert_array_equal(b.group_index, np.repeat(np.arange(5), 3))
    stopped = b.finish_reason == FINISH_STOP
    last = b.response_ids[b.response_offsets[1:] - 1]
    assert np.all(np.isin(last[stopped], engine.eos_token_ids))
    assert np.all(b.response_lengths[~stopped] == 10) and np.all(b.finish_reason[~stopped] == FINISH_LENGTH)
    # no eos before the last token of any response
    body = np.ones(b.num_response_tokens, bool)
    body[b.response_offsets[1:] - 1] = False
    assert not np.any(np.isin(b.response_ids[body], engine.eos_token_ids))


def test_max_tokens_finishes_with_length(engine, make_prompts):
    ids, off = make_prompts(PROMPTS[:2])
    b = engine.generate(ids, off, 2, SamplingConfig(max_tokens=6, ignore_eos=True))
    np.testing.assert_array_equal(b.response_lengths, np.full(4, 6))
    assert np.all(b.finish_reason == FINISH_LENGTH)


def test_eos_finishes_with_stop_and_later_tokens_dropped(engine, make_prompts, original_state, always_eos_state,
                                                         restore_weights):
    eos = engine.eos_token_ids[0]
    engine.update_weights(always_eos_state(original_state, eos).items())
    ids, off = make_prompts(PROMPTS)
    b = engine.generate(ids, off, 2, SamplingConfig(max_tokens=8))
    np.testing.assert_array_equal(b.response_lengths, np.ones(10))
    np.testing.assert_array_equal(b.response_ids, np.full(10, eos))
    assert np.all(b.finish_reason == FINISH_STOP)
    b = engine.generate(ids, off, 2, SamplingConfig(max_tokens=4, ignore_eos=True))
    np.testing.assert_array_equal(b.response_lengths, np.full(b.num_responses, 4))
    assert np.all(b.finish_reason == FINISH_LENGTH)


@pytest.mark.parametrize("temperature,top_k", [(1.0, -1), (0.7, -1), (1.3, 20)])
def test_logprobs_match_transformers_forward(engine, tiny_chat_model, ref_logprobs, make_prompts,
                                             temperature, top_k):
    ids, off = make_prompts(PROMPTS)
    b = engine.generate(ids, off, 2, SamplingConfig(temperature=temperature, top_k=top_k, max_tokens=16, seed=3))
    ref = ref_logprobs(tiny_chat_model, b, temperature, max(top_k, 0))
    np.testing.assert_allclose(b.response_logprobs, ref, atol=1e-4, rtol=0)


def test_seed_reproducible(engine, make_prompts):
    ids, off = make_prompts(PROMPTS)
    s = SamplingConfig(max_tokens=8, seed=7)
    a, b = engine.generate(ids, off, 2, s), engine.generate(ids, off, 2, s)
    np.testing.assert_array_equal(a.response_ids, b.response_ids)
    np.testing.assert_array_equal(a.response_logprobs, b.response_logprobs)


def test_unseeded_rollouts_follow_the_engine_seed(tiny_chat_path, make_prompts):
    ids, off = make_prompts(PROMPTS[:2])
    twin = HFEngine(tiny_chat_path, dtype="float32", seed=0, max_model_len=MAX_MODEL_LEN)
    fresh = HFEngine(tiny_chat_path, dtype="float32", seed=0, max_model_len=MAX_MODEL_LEN)
    s = SamplingConfig(max_tokens=6, ignore_eos=True)
    a1, a2 = twin.generate(ids, off, 2, s), twin.generate(ids, off, 2, s)
    b1 = fresh.generate(ids, off, 2, s)
    np.testing.assert_array_equal(a1.response_ids, b1.response_ids)
    assert not np.array_equal(a1.response_ids, a2.response_ids)


def test_update_weights_changes_logprobs_to_new_weights(engine, tiny_chat_model, original_state, perturbed_state,
                                                        ref_logprobs, make_prompts, restore_weights):
    new_model = copy.deepcopy(tiny_chat_model)
    new_model.load_state_dict(perturbed_state(original_state, seed=1))
    before = engine.prompt_logprobs(PROBE_IDS)
    engine.update_weights(new_model.state_dict().items(), probe=Probe.from_model(new_model, PROBE_IDS, 1e-4))
    assert np.abs(engine.prompt_logprobs(PROBE_IDS) - before).max() > 1e-2
    ids, off = make_prompts(PROMPTS)
    b = engine.generate(ids, off, 2, SamplingConfig(temperature=0.9, max_tokens=12))
    np.testing.assert_allclose(b.response_logprobs, ref_logprobs(new_model, b, 0.9), atol=1e-4, rtol=0)


def test_missing_and_unknown_names_raise(engine, original_state):
    partial = {k: v for k, v in original_state.items() if k != "lm_head.weight"}
    with pytest.raises(WeightSyncError, match="lm_head.weight"):
        engine.update_weights(partial.items())
    with pytest.raises(ValueError, match="model.bogus.weight"):
        engine.update_weights(list(original_state.items()) + [("model.bogus.weight", torch.zeros(1))])
    with pytest.raises(ValueError, match="twice"):
        engine.update_weights(list(original_state.items()) + [("lm_head.weight", torch.zeros(1))])


def test_probe_catches_ignored_update(engine, tiny_chat_model, original_state, perturbed_state, monkeypatch,
                                      restore_weights):
    new_model = copy.deepcopy(tiny_chat_model)
    new_model.load_state_dict(perturbed_state(original_state, seed=4))
    probe = Probe.from_model(new_model, PROBE_IDS, 1e-4)
    push = engine._push
    monkeypatch.setattr(engine, "_push", lambda w: push({k: v for k, v in w.items() if k != "lm_head.weight"}))
    with pytest.raises(WeightSyncError, match=r"max \d"):
        engine.update_weights(new_model.state_dict().items(), probe=probe)


def test_verify_probe_returns_max_diff(engine, tiny_chat_model):
    probe = Probe(PROBE_IDS, probe_logprobs(tiny_chat_model, PROBE_IDS), tolerance=1e-5)
    assert verify_probe(engine, probe) <= 1e-5
    shifted = Probe(PROBE_IDS, probe.expected_logprobs + np.float32(0.5), tolerance=0.1)
    with pytest.raises(WeightSyncError, match="max 0.5"):
        verify_probe(engine, shifted)


def test_probe_rejects_malformed_arrays():
    with pytest.raises(ValueError, match="int32"):
        Probe(np.arange(4), np.zeros(3, np.float32))
    with pytest.raises(ValueError, match=r"shape \(3,\)"):
        Probe(np.arange(4, dtype=np.int32), np.zeros(4, np.float32))


def test_sleep_wake_round_trip(engine):
    before = engine.prompt_logprobs(PROBE_IDS)
    engine.sleep()
    engine.wake_up()
    np.testing.assert_array_equal(engine.prompt_logprobs(PROBE_IDS), before)
    assert engine.supports_sleep == (engine.device.type == "cuda")


@pytest.mark.parametrize(
    "prompts,n,match",
    [
        ([[5, 6], [], [7]], 2, "prompt 1 is empty"),
        ([[5], list(range(3, 3 + MAX_MODEL_LEN))], 2, f"prompt 1 has {MAX_MODEL_LEN} tokens.*max_model_len"),
        ([[5, 6]], 0, "n .* must be an integer >= 1"),
        ([[5, 100000]], 1, "prompt 0 has token id 100000"),
    ],
)
def test_bad_input_raises_value_error(engine, make_prompts, prompts, n, match):
    ids, off = make_prompts(prompts)
    with pytest.raises(ValueError, match=match):
        engine.generate(ids, off, n, SamplingConfig(max_tokens=4))


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(temperature=-1.0), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_k=-2), "top_k"),
        (dict(max_tokens=0), "max_tokens"),
    ],
)
def test_sampling_config_rejects_bad_values(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingConfig(**kwargs)


def test_make_engine_falls_back_to_hf_without_vllm(tiny_chat_path, monkeypatch):
    real_import = builtins.__import__

    def no_vllm(name, *args, **kwargs):
        if name == "vllm" or name.startswith("vllm."):
            raise ImportError("No module named 'vllm'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_vllm)
    with pytest.warns(UserWarning, match="sampling with the transformers engine"):
        eng, kind = make_engine(EngineSpec(kind="vllm", max_model_len=64), str(tiny_chat_path))
    assert isinstance(eng, HFEngine) and kind == "hf"
    with pytest.raises(ValueError, match="valid: vllm, hf"):
        EngineSpec(kind="sglang")
