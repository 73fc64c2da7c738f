"""The RolloutEngine contract, run against every engine with the tiny fp32 model:
batch layout, finish reasons, stop tokens, log-probs against a transformers
forward, seeds, weight loads and their check (fleet/weight_sync.py), sleep/wake,
input checks.

One engine per kind serves the whole module (the `engine` fixture is module
scoped and parametrised, so pytest runs every hf test, then every vllm test);
tests that push weights restore the original ones before they return. The vllm
param is skipped where vLLM is not installed. Engine-specific tests sit at the
end, each parametrised over its one engine (the same shared instance).
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from areno.rollout.batch import FINISH_LENGTH, FINISH_STOP
from areno.rollout.engine import RolloutEngine, SamplingConfig
from areno.fleet.weight_sync import WeightStream, check_engine_names, reports_fingerprint
from areno.fleet.weight_sync import ProbeRef, SyncCheck
from areno.rollout.probe import PROBE_ROUNDING_UNITS, WeightSyncError, probe_logprobs

MAX_MODEL_LEN = 128
PROMPTS = [[5, 6, 7, 8, 9], [10, 11], [12, 13, 14, 15, 16, 17, 18], [19, 20, 21], [22, 23]]
PROBE_IDS = np.arange(3, 40, dtype=np.int32)
ENGINES = ["hf", "vllm"]


def new_engine(kind: str, path, **kw):
    if kind == "hf":
        from areno.rollout.hf import HFEngine

        return HFEngine(path, dtype="float32", seed=0, max_model_len=MAX_MODEL_LEN, **kw)
    pytest.importorskip("vllm")
    from areno.rollout.vllm import VLLMEngine

    return VLLMEngine(path, dtype="float32", seed=0, max_model_len=MAX_MODEL_LEN,
                      kv_cache_memory_bytes=16 << 20, **kw)


@pytest.fixture(scope="module", params=ENGINES)
def engine(request, tiny_chat_path):
    eng = new_engine(request.param, tiny_chat_path)
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def original_state(tiny_chat_model):
    return {k: v.clone() for k, v in tiny_chat_model.state_dict().items()}


@pytest.fixture
def restore_weights(engine, original_state):
    yield
    engine.load_weights(original_state.items())


@pytest.fixture(scope="module")
def eos_ids(tiny_chat_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_chat_path)
    return tok.convert_tokens_to_ids("<|im_end|>"), tok.convert_tokens_to_ids("<|endoftext|>")


def without(weights: dict, name: str) -> dict:
    """A set of weights minus `name`."""
    return {k: v for k, v in weights.items() if k != name}


def probe_ref(model, tolerance: float) -> ProbeRef:
    """The trainer's side of the probe from `model`, with an uncalibrated tolerance
    of `tolerance` (SyncCheck's bound is PROBE_ROUNDING_UNITS units)."""
    return ProbeRef(PROBE_IDS, probe_logprobs(model, PROBE_IDS), tolerance / PROBE_ROUNDING_UNITS, 1.0)


def sent(state: dict):
    """The fingerprint of `state` as the trainer's WeightStream computes it."""
    stream = WeightStream(iter(state.items()), torch.float32)
    for _ in stream:
        pass
    return stream.fingerprint()


# -- generation --------------------------------------------------------------------


def test_is_a_rollout_engine(engine):
    assert isinstance(engine, RolloutEngine)


def test_batch_layout_groups_prompts_of_mixed_lengths(engine, make_prompts, eos_ids):
    ids, off = make_prompts(PROMPTS)  # lengths 5, 2, 7, 3, 2: four length groups
    b = engine.generate(ids, off, 3, SamplingConfig(max_tokens=10, seed=1))
    assert b.num_prompts == 5 and b.num_responses == 15
    np.testing.assert_array_equal(b.prompt_ids, ids)
    np.testing.assert_array_equal(b.prompt_offsets, off)
    np.testing.assert_array_equal(b.group_index, np.repeat(np.arange(5), 3))
    lengths = b.response_lengths
    assert lengths.min() >= 1 and lengths.max() <= 10
    stopped = b.finish_reason == FINISH_STOP
    last = b.response_ids[b.response_offsets[1:] - 1]
    assert np.all(np.isin(last[stopped], eos_ids))
    assert np.all(lengths[~stopped] == 10) and np.all(b.finish_reason[~stopped] == FINISH_LENGTH)
    # no eos before the last token of any response
    body = np.ones(b.num_response_tokens, bool)
    body[b.response_offsets[1:] - 1] = False
    assert not np.any(np.isin(b.response_ids[body], eos_ids))
    assert np.all(b.response_logprobs <= 0) and np.all(np.isfinite(b.response_logprobs))


def test_max_tokens_finishes_with_length(engine, make_prompts):
    ids, off = make_prompts(PROMPTS[:2])
    b = engine.generate(ids, off, 3, SamplingConfig(max_tokens=5, ignore_eos=True))
    np.testing.assert_array_equal(b.response_lengths, np.full(6, 5))
    assert np.all(b.finish_reason == FINISH_LENGTH)


def test_eos_finishes_with_stop_and_later_tokens_dropped(engine, make_prompts, original_state, always_eos_state,
                                                         eos_ids, restore_weights):
    engine.load_weights(always_eos_state(original_state, eos_ids[0]).items())
    ids, off = make_prompts(PROMPTS)
    b = engine.generate(ids, off, 2, SamplingConfig(max_tokens=8))
    np.testing.assert_array_equal(b.response_lengths, np.ones(10))
    np.testing.assert_array_equal(b.response_ids, np.full(10, eos_ids[0]))
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
    ids, off = make_prompts(PROMPTS)
    s = SamplingConfig(max_tokens=8, seed=7)
    a, b = engine.generate(ids, off, 2, s), engine.generate(ids, off, 2, s)
    np.testing.assert_array_equal(a.response_ids, b.response_ids)
    np.testing.assert_array_equal(a.response_logprobs, b.response_logprobs)
    ids, off = make_prompts([[7, 8, 9]] * 3)
    s = SamplingConfig(max_tokens=10, seed=11, ignore_eos=True)
    a, b = engine.generate(ids, off, 2, s), engine.generate(ids, off, 2, s)
    np.testing.assert_array_equal(a.response_ids, b.response_ids)
    first = a.response_ids.reshape(6, 10)[::2]  # sample 0 of each (identical) prompt
    assert not np.array_equal(first[0], first[1]) and not np.array_equal(first[1], first[2])


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


# -- weights, probe, sleep ---------------------------------------------------------


def test_loaded_weights_pass_the_sync_check_and_change_the_logprobs(engine, tiny_chat_model, original_state,
                                                                     perturbed_state, ref_logprobs, make_prompts,
                                                                     restore_weights):
    new_model = copy.deepcopy(tiny_chat_model)
    new_model.load_state_dict(perturbed_state(original_state, seed=1))
    before = engine.prompt_logprobs(PROBE_IDS)
    engine.load_weights(new_model.state_dict().items())
    out = SyncCheck(reports_fingerprint(engine), 0).check(engine, sent(new_model.state_dict()),
                                                          probe_ref(new_model, 1e-4))
    assert out["probe_diff"] <= out["probe_tolerance"] == pytest.approx(1e-4)
    assert np.abs(engine.prompt_logprobs(PROBE_IDS) - before).max() > 1e-2
    ids, off = make_prompts(PROMPTS)
    b = engine.generate(ids, off, 2, SamplingConfig(temperature=0.9, max_tokens=12))
    np.testing.assert_allclose(b.response_logprobs, ref_logprobs(new_model, b, 0.9), atol=1e-4, rtol=0)


def test_a_load_missing_a_tensor_fails_the_sync_check(engine, original_state, perturbed_state, restore_weights):
    new = perturbed_state(original_state, seed=2)
    check = SyncCheck(reports_fingerprint(engine), 0)
    with pytest.raises(WeightSyncError, match=r"missing 1 .*model.norm.weight|\(model: sum of squares"):
        engine.load_weights((n, t) for n, t in new.items() if n != "model.norm.weight")
        check.check(engine, sent(new), None)


def test_an_engine_keeps_no_reference_to_what_it_loads(engine, original_state, perturbed_state, restore_weights):
    """The sync copies each tensor once (weight_sync.WeightStream yields the trainer's
    own tensor when the dtype matches; load_region hands over views of a region the
    next sync rewrites): an engine must copy what it is given into its own
    storage. Overwriting the sources after a load must change nothing it holds,
    through either transport's source."""
    from areno.fleet.weight_sync import WeightLayout, region_tensors

    new = perturbed_state(original_state, seed=4)
    live = {n: t.clone() for n, t in new.items()}  # the stream's source: the tensors themselves
    engine.load_weights(WeightStream(iter(live.items()), torch.float32))
    held, lp = engine.weights_fingerprint().sums, engine.prompt_logprobs(PROBE_IDS)
    for t in live.values():
        t.mul_(2.0)
    assert engine.weights_fingerprint().sums == held
    np.testing.assert_array_equal(engine.prompt_logprobs(PROBE_IDS), lp)
    layout = WeightLayout.build((n, "float32", tuple(t.shape)) for n, t in new.items())
    buf = bytearray(layout.nbytes)
    layout.write(buf, new.items())
    engine.load_weights(region_tensors(buf, layout))
    assert engine.weights_fingerprint().sums == held
    buf[:] = bytes(len(buf))  # the next sync rewrites the region
    assert engine.weights_fingerprint().sums == held
    np.testing.assert_array_equal(engine.prompt_logprobs(PROBE_IDS), lp)


def test_unknown_tensor_names_are_refused_up_front(engine, original_state):
    with pytest.raises(ValueError, match="model.bogus.weight"):
        check_engine_names(engine, list(original_state) + ["model.bogus.weight"])


def test_a_hub_id_is_name_checked_from_its_snapshot_in_the_hf_cache(tiny_chat_path, tmp_path, monkeypatch):
    """`--ckpt org/name` (every README command): vLLM loaded it from the HF cache,
    where the checkpoint's tensor names are read for the up-front check."""
    pytest.importorskip("vllm")
    import shutil
    import types

    import huggingface_hub.constants
    from transformers import AutoConfig

    from areno.rollout.vllm_fingerprint import checkpoint_names

    repo = tmp_path / "hub" / "models--areno-test--tiny-chat"
    shutil.copytree(tiny_chat_path, repo / "snapshots" / "abc123")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("abc123")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    hf = AutoConfig.from_pretrained(tiny_chat_path)
    local = checkpoint_names(types.SimpleNamespace(model=str(tiny_chat_path), hf_config=hf))
    from_hub = checkpoint_names(types.SimpleNamespace(model="areno-test/tiny-chat", hf_config=hf))
    assert from_hub == local and local[0], from_hub
    assert checkpoint_names(types.SimpleNamespace(model="areno-test/not-cached", hf_config=hf))[0] is None


def test_probe_catches_a_load_that_silently_drops_a_tensor(engine, tiny_chat_model, original_state,
                                                           perturbed_state, restore_weights):
    new_model = copy.deepcopy(tiny_chat_model)
    new_model.load_state_dict(perturbed_state(original_state, seed=3))
    probe = probe_ref(new_model, 1e-4)
    check = SyncCheck(False, 0)  # the probe alone, as for an engine without a fingerprint
    # the lm_head keeps its old values: an update that dropped it
    dropped = {n: (t if n != "lm_head.weight" else original_state[n]) for n, t in new_model.state_dict().items()}
    engine.load_weights(dropped.items())
    with pytest.raises(WeightSyncError, match=r"probe failed.*max \d"):
        check.check(engine, None, probe)
    engine.load_weights(original_state.items())  # the whole update ignored
    with pytest.raises(WeightSyncError, match="probe failed"):
        check.check(engine, None, probe)


def test_the_probe_check_returns_the_max_diff(engine, tiny_chat_model):
    tol = 1e-5 if type(engine).__name__ == "HFEngine" else 1e-4  # the HF forward is the reference's own
    probe = probe_ref(tiny_chat_model, tol)
    assert SyncCheck(False, 0).check(engine, None, probe)["probe_diff"] <= tol
    shifted = ProbeRef(probe.ids, probe.ref + np.float32(0.5), 0.1 / PROBE_ROUNDING_UNITS, 1.0)
    with pytest.raises(WeightSyncError, match=r"max 0\.5"):
        SyncCheck(False, 0).check(engine, None, shifted)


def test_sleep_wake_round_trip(engine, original_state):
    """Sleep frees the weights where supported (both engines: the next sync
    overwrites them all), so after wake_up only a full load makes the engine
    usable again, and then it computes what it did before."""
    before = engine.prompt_logprobs(PROBE_IDS)
    engine.sleep()
    if engine.supports_sleep:
        with pytest.raises(RuntimeError, match="asleep"):
            engine.prompt_logprobs(PROBE_IDS)
    engine.wake_up()
    if engine.supports_sleep:
        with pytest.raises(RuntimeError, match="load a full set"):
            engine.prompt_logprobs(PROBE_IDS)
        engine.load_weights(original_state.items())
    np.testing.assert_allclose(engine.prompt_logprobs(PROBE_IDS), before, atol=1e-6)


# -- engine-specific (the shared engine of one kind) ---------------------------------


@pytest.mark.parametrize("engine", ["hf"], indirect=True)
def test_hf_eos_ids_come_from_the_generation_config(engine, eos_ids):
    assert set(engine.eos_token_ids) == set(eos_ids)  # <|im_end|>, <|endoftext|>


@pytest.mark.parametrize("engine", ["hf"], indirect=True)
def test_hf_sleep_is_supported_on_cuda_only_by_default(engine):
    assert engine.supports_sleep == (engine.device.type == "cuda")


def test_hf_sleep_frees_the_weights_and_a_load_restores_them(tiny_chat_path, original_state, make_prompts):
    """The GPU branch, on CPU (sleep=True): every weight's storage is empty while
    asleep (no host copy is kept), sampling refuses until a full load, and the
    loaded engine samples exactly what it did before sleeping."""
    from areno.rollout.hf import HFEngine

    eng = HFEngine(tiny_chat_path, dtype="float32", seed=0, max_model_len=MAX_MODEL_LEN, sleep=True)
    ids, off = make_prompts(PROMPTS)
    s = SamplingConfig(max_tokens=6, ignore_eos=True, seed=4)
    before = eng.generate(ids, off, 2, s)
    eng.sleep()
    assert all(p.untyped_storage().nbytes() == 0 for p in eng.model.parameters())
    eng.wake_up()
    with pytest.raises(RuntimeError, match="load a full set"):
        eng.generate(ids, off, 2, s)
    with pytest.raises(WeightSyncError, match="missing"):
        eng.load_weights(without(original_state, "model.norm.weight").items())
    with pytest.raises(RuntimeError, match="load a full set"):  # a partial load does not count
        eng.generate(ids, off, 2, s)
    eng.load_weights(original_state.items())
    after = eng.generate(ids, off, 2, s)
    np.testing.assert_array_equal(after.response_ids, before.response_ids)
    np.testing.assert_array_equal(after.response_logprobs, before.response_logprobs)


@pytest.mark.parametrize("engine", ["vllm"], indirect=True)
def test_vllm_asks_for_flat_logprobs_and_reads_them(engine, make_prompts, monkeypatch):
    """Requests ask for vLLM's flat log-prob format, and what comes back is
    read as flat: one float per sampled token (no dict per position), equal to
    the batch's log-probs; prompt log-probs likewise."""
    from vllm.logprobs import FlatLogprobs

    from areno.rollout import vllm as av

    assert av.HAS_FLAT_LOGPROBS and "FlatLogprobs" in av.flat_logprobs_facility()
    seen = []
    generate = engine.llm.generate

    def spy(prompts, params, **kw):
        outs = generate(prompts, params, **kw)
        seen.append((params, outs))
        return outs

    monkeypatch.setattr(engine.llm, "generate", spy)
    ids, off = make_prompts(PROMPTS[:3])
    b = engine.generate(ids, off, 2, SamplingConfig(max_tokens=6, seed=2))
    (params, outs), = seen
    assert all(p.flat_logprobs and p.logprobs == 0 for p in params)
    seqs = [c for o in outs for c in o.outputs]
    assert all(isinstance(c.logprobs, FlatLogprobs) and len(c.logprobs.logprobs) == len(c.token_ids)
               for c in seqs)
    np.testing.assert_array_equal(b.response_logprobs,
                                  np.concatenate([c.logprobs.logprobs for c in seqs]).astype(np.float32))
    engine.prompt_logprobs(PROBE_IDS)
    params, outs = seen[-1]
    assert params.flat_logprobs and isinstance(outs[0].prompt_logprobs, FlatLogprobs)


@pytest.mark.parametrize("engine", ["vllm"], indirect=True)
def test_vllm_sleeps_at_level_2_and_wakes_weights_then_loads_then_kv_cache(engine, original_state, make_prompts,
                                                                            monkeypatch):
    """The GPU branch on the real engine object (CPU vLLM has no sleep mode, so
    only its LLM's sleep/wake_up are recorded instead of run): level 2 frees the
    weights, wake_up brings back only the weights, the load then reloads them
    and wakes the KV cache, and sampling refuses in between."""
    calls = []
    llm = engine.llm
    monkeypatch.setattr(engine, "supports_sleep", True)
    monkeypatch.setattr(llm, "sleep", lambda level: calls.append(("sleep", level)))
    monkeypatch.setattr(llm, "wake_up", lambda tags=None: calls.append(("wake_up", tags)))
    real_rpc = llm.collective_rpc
    monkeypatch.setattr(llm, "collective_rpc",
                        lambda method, **kw: calls.append((method,)) or real_rpc(method, **kw))
    ids, off = make_prompts(PROMPTS)
    engine.sleep()
    engine.wake_up()
    with pytest.raises(RuntimeError, match="load a full set"):
        engine.generate(ids, off, 1, SamplingConfig(max_tokens=2))
    engine.load_weights(original_state.items())
    assert calls == [("sleep", 2), ("wake_up", ["weights"]), ("reload_weights",), ("wake_up", ["kv_cache"])]
    assert engine.generate(ids, off, 1, SamplingConfig(max_tokens=2)).num_responses == len(PROMPTS)


@pytest.mark.parametrize("engine", ["vllm"], indirect=True)
def test_vllm_on_cpu_prefills_whole_so_seeded_prompts_past_its_token_budget_sample(engine, make_prompts):
    """More prompt tokens than one engine step takes (vLLM's budget: 4096). With
    chunked prefill a seeded request's prompt was split across steps, and vLLM's
    CPU sampler died rewinding its generator ("CPU Generator does not use offset")."""
    sched = engine.llm.llm_engine.vllm_config.scheduler_config
    rng = np.random.default_rng(0)
    prompts = [rng.integers(5, 300, 120).tolist() for _ in range(48)]
    assert 48 * 120 > sched.max_num_batched_tokens
    ids, off = make_prompts(prompts)
    b = engine.generate(ids, off, 1, SamplingConfig(max_tokens=4, seed=3))
    assert b.num_prompts == 48 and (b.response_lengths > 0).all() and not sched.enable_chunked_prefill
