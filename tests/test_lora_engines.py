"""Serving a trained LoRA adapter (issue 19, the engine side), on real engines.

A peft LoRA model of tiny "chat" is built in-test with random, non-zero A and B
(B is zero at peft's init: the adapter would change nothing). For both engines,
fp32 and bf16: after `sync_adapter` the engine's prompt log-probs equal the peft
model's forward within the probe's bound, its adapter fingerprint equals the
trainer's exactly, and a sync that leaves the engine on the base model or on the
previous adapter fails the check. One engine per (kind, dtype) serves the
module; adapter versions only grow on it (`bump`).
"""

from __future__ import annotations

import copy
import itertools

import numpy as np
import pytest
import torch

from areno.fleet.adapter_sync import load_adapter
from areno.rollout.engine import SamplingConfig
from areno.rollout.lora import adapter_fingerprint_of, adapter_nbytes, lora_scaling
from areno.rollout.probe import (WeightSyncError, check_fingerprint, check_logprobs, fingerprint_mismatch,
                                 probe_logprobs, probe_tolerance, reduction_length, rounding_unit)
from helpers import loaded_lora_ids

MAX_MODEL_LEN = 128
PROBE_IDS = np.arange(3, 40, dtype=np.int32)
RANK = 4
# k_proj and gate_proj left out: vLLM's packed qkv / gate_up slots then hold one
# projection zero (sums must still pair up); alpha/r = 1.25 makes B·scaling round in bf16.
TARGETS = ["q_proj", "v_proj", "o_proj", "up_proj", "down_proj"]
ALPHA = 5
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
CASES = [("hf", "float32"), ("hf", "bfloat16"), ("vllm", "float32"), ("vllm", "bfloat16")]


def case_id(case: tuple[str, str]) -> str:
    return f"{case[0]}-{case[1]}"


def only(kind: str) -> pytest.MarkDecorator:
    """An engine-specific test runs on that kind's cases only (the module's same
    engines: the fixture is keyed by the case's value)."""
    return pytest.mark.parametrize("engine", [c for c in CASES if c[0] == kind], indirect=True, ids=case_id)


def adapter_tensors(peft_model, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """The in-test peft model's adapter as peft saves it (names of adapter_model.safetensors)."""
    from peft.utils import get_peft_model_state_dict

    return {n: t.detach().to(dtype or t.dtype, copy=True)
            for n, t in get_peft_model_state_dict(peft_model, save_embedding_layers=False).items()}

def lora_config(**kw):
    from peft import LoraConfig

    return LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=list(TARGETS), lora_dropout=0.1, **kw)


def randomize(peft_model, seed: int, scale: float = 0.2) -> None:
    """New random A and B (a training step's worth of change)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_" in name:
                p.copy_(scale * torch.randn(p.shape, generator=g))


@pytest.fixture(scope="module")
def trainer(tiny_chat_model):
    """The trainer's side: an fp32 peft model of tiny chat, eval mode (no dropout)."""
    from peft import get_peft_model

    model = get_peft_model(copy.deepcopy(tiny_chat_model), lora_config())
    randomize(model, seed=1)
    return model.eval()


@pytest.fixture(scope="module", params=CASES, ids=case_id)
def engine(request, tiny_chat_path):
    kind, dtype = request.param
    if kind == "hf":
        from areno.rollout.hf import HFEngine

        eng = HFEngine(tiny_chat_path, dtype=dtype, seed=0, max_model_len=MAX_MODEL_LEN, max_lora_rank=RANK)
    else:
        pytest.importorskip("vllm")
        from areno.rollout.vllm import VLLMEngine

        eng = VLLMEngine(tiny_chat_path, dtype=dtype, seed=0, max_model_len=MAX_MODEL_LEN,
                         kv_cache_memory_bytes=16 << 20, max_lora_rank=RANK)
    eng.kind, eng.dtype_name, eng.versions = kind, dtype, itertools.count(1)
    yield eng
    eng.shutdown()


def bump(engine) -> int:
    return next(engine.versions)


def as_engine_dtype(model, engine):
    """The trainer's model in the engine's dtype: what the engine must compute."""
    return copy.deepcopy(model).to(DTYPES[engine.dtype_name]) if engine.dtype_name != "float32" else model


class Probe:
    """The trainer-side probe of `model` for `engine`: its log-probs in the engine's
    dtype and the uncalibrated bound (rollout.probe.probe_tolerance)."""

    def __init__(self, model, engine) -> None:
        m = as_engine_dtype(model, engine)
        self.ref, scale = probe_logprobs(m, PROBE_IDS, with_scale=True)
        self.tolerance = probe_tolerance(rounding_unit(engine.dtype_name, scale, reduction_length(m.config)), None)


def probe_for(model, engine) -> Probe:
    return Probe(model, engine)


def verify_probe(engine, probe: Probe) -> float:
    """max |engine - trainer| log-prob; WeightSyncError ('probe failed') beyond the bound."""
    return check_logprobs(engine.prompt_logprobs(PROBE_IDS), probe.ref, probe.tolerance)


def sync_adapter(engine, named, config, version: int, rank: int = 0) -> dict:
    """What a rank's SyncCheck does with an adapter: load it, then the exact check."""
    want, info = load_adapter(engine, named, config, version)
    if want is not None:
        check_fingerprint(engine.adapter_fingerprint(), want, rank)
    return info


# -- the checks fail when the engine does not serve the adapter sent -------------------

def test_engine_on_the_base_model_fails_the_check(engine, trainer, tiny_chat_model, monkeypatch):
    """First on the fresh engine: nothing loaded yet. A sync whose load never
    happens leaves the base model served: the fingerprint check fails, and so
    would the probe (the adapter moves the log-probs far beyond its bound)."""
    assert engine.adapter_fingerprint().sums == {}
    monkeypatch.setattr(engine, "load_adapter", lambda *a, **k: None)
    with pytest.raises(WeightSyncError, match="rank 3"):
        sync_adapter(engine, adapter_tensors(trainer).items(), lora_config(), bump(engine), rank=3)
    with pytest.raises(WeightSyncError, match="probe failed"):
        verify_probe(engine, probe_for(trainer, engine))
    # the base is what the engine scores
    verify_probe(engine, probe_for(tiny_chat_model, engine))


def test_sync_serves_the_adapter_exactly(engine, trainer):
    out = sync_adapter(engine, adapter_tensors(trainer).items(), lora_config(), bump(engine))
    dtype = DTYPES[engine.dtype_name]
    sent = adapter_tensors(trainer, dtype)
    assert out["adapter_bytes"] == adapter_nbytes(sent) > 0 and out["adapter_tensors"] == len(sent)
    got, want = engine.adapter_fingerprint(), adapter_fingerprint_of(sent, lora_config())
    # a sum of squares per (parent module, A | B) and a projection per (target, A | B),
    # the same keys on both sides (vLLM's packed slots named by their sub-module), compared one by one
    assert set(got.sums) == set(want.sums)
    squares = {g for g in want.sums if not g.endswith(" projection")}
    assert {g.rsplit(".", 1)[-1] for g in squares} == {"lora_A", "lora_B"}
    assert len(squares) == 2 * 2 * 2  # 2 layers x (self_attn, mlp) x (A, B)
    assert len(want.sums) - len(squares) == 2 * len(TARGETS) * 2  # 2 layers x targets x (A, B)
    assert fingerprint_mismatch(got, want) is None
    rel = max(abs(got.sums[g] - want.sums[g]) / want.sums[g] for g in want.sums)
    assert rel < 1e-13


def test_prompt_logprobs_follow_the_adapter(engine, trainer):
    """The probe, run on the adapted model: within the uncalibrated bound."""
    sync_adapter(engine, adapter_tensors(trainer).items(), lora_config(), bump(engine))
    diff = verify_probe(engine, probe_for(trainer, engine))
    assert diff <= probe_for(trainer, engine).tolerance


def test_generate_follows_the_adapter(engine, trainer, ref_logprobs, make_prompts):
    """Sampled tokens' log-probs are the peft model's (fp32: 1e-4, as the
    engine contract; bf16: the probe's bound)."""
    sync_adapter(engine, adapter_tensors(trainer).items(), lora_config(), bump(engine))
    ids, off = make_prompts([[5, 6, 7, 8, 9], [10, 11], [12, 13, 14]])
    batch = engine.generate(ids, off, 2, SamplingConfig(max_tokens=8, seed=4, ignore_eos=True))
    ref = ref_logprobs(as_engine_dtype(trainer, engine), batch)
    atol = 1e-4 if engine.dtype_name == "float32" else probe_for(trainer, engine).tolerance
    np.testing.assert_allclose(batch.response_logprobs, ref, atol=atol, rtol=0)
    streamed = list(engine.generate_stream(ids, off, 1, SamplingConfig(max_tokens=4, seed=4)))
    for pos, part in streamed:
        sub = ref_logprobs(as_engine_dtype(trainer, engine), part)
        np.testing.assert_allclose(part.response_logprobs, sub, atol=atol, rtol=0)


def test_engine_left_on_the_previous_adapter_fails_the_check(engine, trainer, monkeypatch):
    """Version k served; the trainer steps and sends k+1. An engine that keeps k
    (the load skipped, or the old tensors loaded under the new version) fails."""
    sync_adapter(engine, adapter_tensors(trainer).items(), lora_config(), bump(engine))
    stale = adapter_tensors(trainer)
    stepped = copy.deepcopy(trainer)
    randomize(stepped, seed=7, scale=0.21)
    real_load = engine.load_adapter
    monkeypatch.setattr(engine, "load_adapter", lambda *a, **k: None)
    with pytest.raises(WeightSyncError, match="not the trainer's"):
        sync_adapter(engine, adapter_tensors(stepped).items(), lora_config(), bump(engine))
    monkeypatch.setattr(engine, "load_adapter", lambda t, c, v: real_load(stale, c, v))
    with pytest.raises(WeightSyncError, match="not the trainer's"):
        sync_adapter(engine, adapter_tensors(stepped).items(), lora_config(), bump(engine))
    monkeypatch.undo()
    sync_adapter(engine, adapter_tensors(stepped).items(), lora_config(), bump(engine))  # a real load of k+1 passes
    verify_probe(engine, probe_for(stepped, engine))


def test_one_element_off_by_one_ulp_fails(engine, trainer):
    sent = adapter_tensors(trainer, DTYPES[engine.dtype_name])
    engine.load_adapter(sent, lora_config(), bump(engine))
    name = next(n for n in sent if n.endswith("v_proj.lora_A.weight"))  # A: no scaling to round it away
    off = dict(sent)
    off[name] = sent[name].clone()
    x = off[name].view(-1)
    i = int(torch.argmax(x.abs()))
    x[i] = x[i] + x[i].abs() * torch.finfo(x.dtype).eps  # at least one ulp up, in the engine's dtype
    assert not torch.equal(off[name], sent[name])
    assert fingerprint_mismatch(engine.adapter_fingerprint(), adapter_fingerprint_of(sent, lora_config())) is None
    bad = fingerprint_mismatch(engine.adapter_fingerprint(), adapter_fingerprint_of(off, lora_config()))
    assert bad is not None and "self_attn.lora_A" in bad


def test_adapter_names_are_checked_strictly(engine, trainer):
    sent = adapter_tensors(trainer)
    engine.load_adapter(sent, lora_config(), bump(engine))  # the engine knows its adapter's names now
    missing = {k: v for k, v in sent.items() if "layers.1.mlp.up_proj.lora_" not in k}
    with pytest.raises(WeightSyncError, match="missing"):
        engine.load_adapter(missing, lora_config(), bump(engine))
    half = {k: v for k, v in sent.items() if "layers.1.mlp.up_proj.lora_B" not in k}
    with pytest.raises(WeightSyncError, match="only one of lora_A"):
        engine.load_adapter(half, lora_config(), bump(engine))
    foreign = dict(sent, **{"base_model.model.model.layers.0.self_attn.k_proj.lora_A.weight":
                            sent["base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"],
                            "base_model.model.model.layers.0.self_attn.k_proj.lora_B.weight":
                            torch.zeros(64, RANK)})
    with pytest.raises(ValueError, match="does not have"):
        engine.load_adapter(foreign, lora_config(), bump(engine))
    with pytest.raises(ValueError, match="not a LoRA A/B weight"):
        engine.load_adapter(dict(sent, **{"base_model.model.lm_head.weight": torch.zeros(1)}),
                            lora_config(), bump(engine))
    v = bump(engine)
    engine.load_adapter(sent, lora_config(), v)
    with pytest.raises(ValueError, match="strictly increase"):
        engine.load_adapter(sent, lora_config(), v)
    with pytest.raises(ValueError, match="max_lora_rank"):
        from peft import LoraConfig

        engine.load_adapter(sent, LoraConfig(r=64, lora_alpha=ALPHA, target_modules=TARGETS), bump(engine))
    want = adapter_fingerprint_of(sent, lora_config(), DTYPES[engine.dtype_name])
    assert fingerprint_mismatch(engine.adapter_fingerprint(), want) is None


def test_a_base_weight_push_keeps_the_adapter(engine, trainer, tiny_chat_model):
    """Under LoRA the base is not resent, but a full push must still work and
    leave the adapter served (vLLM's reload removes every adapter: re-added)."""
    sync_adapter(engine, adapter_tensors(trainer).items(), lora_config(), bump(engine))
    base = {k: v.clone() for k, v in tiny_chat_model.state_dict().items()}
    engine.load_weights(base.items())
    assert fingerprint_mismatch(engine.adapter_fingerprint(),
                                adapter_fingerprint_of(adapter_tensors(trainer, DTYPES[engine.dtype_name]),
                                                       lora_config())) is None
    verify_probe(engine, probe_for(trainer, engine))


# -- engine specifics --------------------------------------------------------------------

@only("vllm")
def test_vllm_adapter_names_are_versioned_and_old_ones_removed(engine, trainer):
    seen = []
    for _ in range(3):
        v = bump(engine)
        sync_adapter(engine, adapter_tensors(trainer).items(), lora_config(), v)
        req = engine.adapters.request
        assert req.lora_name == f"areno-v{v}" and req.lora_int_id == v + 1
        assert loaded_lora_ids(engine) == {v + 1}  # list_loras: the previous version is gone
        assert [p.name for p in engine.adapters._root.iterdir()] == [f"v{v}"]
        seen.append(req.lora_name)
    assert len(set(seen)) == 3


@only("vllm")
def test_vllm_fingerprint_reads_the_slot_not_the_bookkeeping(engine, trainer, monkeypatch):
    """vLLM told to add the new version but not doing it: the request points at
    an adapter in no slot, and the fingerprint (read on the worker) is empty."""
    sync_adapter(engine, adapter_tensors(trainer).items(), lora_config(), bump(engine))
    monkeypatch.setattr(engine.llm.llm_engine, "add_lora", lambda request: True)
    with pytest.raises(WeightSyncError, match="not the trainer's"):
        sync_adapter(engine, adapter_tensors(trainer).items(), lora_config(), bump(engine))
    assert engine.adapter_fingerprint().sums == {}


@only("vllm")
def test_vllm_lora_sleep_frees_only_the_kv_cache_and_keeps_the_base_and_adapter(engine, trainer, monkeypatch):
    """The GPU branch (CPU vLLM has no sleep mode: its LLM's calls are recorded):
    scheduling paused and only the KV cache released (the base, never sent again,
    stays on the device: no level-1 copy out and back each step), then the KV
    cache and scheduling woken; the adapter never left its slot and is served
    without a load or a re-add."""
    sync_adapter(engine, adapter_tensors(trainer).items(), lora_config(), bump(engine))
    calls = []
    monkeypatch.setattr(engine, "supports_sleep", True)
    monkeypatch.setattr(engine.llm, "sleep", lambda level: calls.append(("sleep", level)))
    monkeypatch.setattr(engine.llm, "release_kv_cache_memory", lambda: calls.append(("release_kv_cache",)))
    monkeypatch.setattr(engine.llm, "wake_up", lambda tags=None: calls.append(("wake_up", tags)))
    monkeypatch.setattr(engine.llm.llm_engine, "add_lora", lambda request: calls.append(("add_lora",)) or True)
    engine.sleep()
    with pytest.raises(RuntimeError, match="asleep"):
        engine.prompt_logprobs(PROBE_IDS)
    engine.wake_up()
    assert calls == [("sleep", 0), ("release_kv_cache",), ("wake_up", ["kv_cache"]), ("wake_up", ["scheduling"])]
    assert loaded_lora_ids(engine) == {engine.adapters.request.lora_int_id}
    want = adapter_fingerprint_of(adapter_tensors(trainer, DTYPES[engine.dtype_name]), lora_config())
    assert fingerprint_mismatch(engine.adapter_fingerprint(), want) is None
    verify_probe(engine, probe_for(trainer, engine))


@only("hf")
def test_hf_lora_sleep_keeps_the_base_and_the_adapter(engine, trainer):
    sync_adapter(engine, adapter_tensors(trainer).items(), lora_config(), bump(engine))
    engine.supports_sleep = True
    try:
        engine.sleep()
        with pytest.raises(RuntimeError, match="asleep"):
            engine.prompt_logprobs(PROBE_IDS)
        engine.wake_up()
    finally:
        engine.supports_sleep = False
    verify_probe(engine, probe_for(trainer, engine))  # no load in between: nothing was freed
    assert all(p.numel() > 0 for p in engine.model.parameters())


@only("hf")
def test_hf_adapter_structure_is_fixed_by_the_first_load(engine, trainer):
    from peft import LoraConfig

    sent = adapter_tensors(trainer)
    engine.load_adapter(sent, lora_config(), bump(engine))
    with pytest.raises(ValueError, match="structure changed"):
        engine.load_adapter(sent, LoraConfig(r=RANK, lora_alpha=ALPHA + 1, target_modules=TARGETS), bump(engine))


def test_engine_spec_carries_max_lora_rank(tiny_chat_path):
    from areno.rollout.factory import EngineSpec, make_engine

    with pytest.raises(ValueError, match="max_lora_rank"):
        EngineSpec(max_lora_rank=-1)
    eng, kind = make_engine(EngineSpec(kind="hf", max_lora_rank=8, max_model_len=64), str(tiny_chat_path))
    assert kind == "hf" and eng.adapters is not None and eng.adapters.max_lora_rank == 8
    eng.shutdown()


def test_lora_scaling_and_vllm_ranks():
    from areno.rollout.vllm_lora import vllm_max_lora_rank

    assert lora_scaling(lora_config()) == ALPHA / RANK
    assert lora_scaling(lora_config(use_rslora=True)) == ALPHA / 2
    assert [vllm_max_lora_rank(r) for r in (1, 2, 8, 9, 300)] == [1, 8, 8, 16, 320]
    with pytest.raises(ValueError):
        vllm_max_lora_rank(1024)
