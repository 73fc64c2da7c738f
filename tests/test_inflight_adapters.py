"""In-flight adapter loads (LoRA with --partial-rollouts), at the engine level on
the real tiny model: a new adapter loaded at a step boundary in the middle of a
generation keeps every request; the tokens before the swap are the old
adapter's alone, the tokens after carry the new version and the new adapter's
log-probs on their whole prefix (the held sequences are prefilled again under
it: the transformers engine recomputes its cache, vLLM's requests are moved onto
the new adapter and preempted: rollout/vllm_lora.py)."""

from __future__ import annotations

import copy
import itertools

import pytest

from areno.fleet.adapter_sync import load_adapter
from areno.rollout.engine import SamplingConfig
from test_inflight_weights import MAX_TOKENS, PROMPTS, SWAP_AT, assert_swapped_mid_generation
from test_lora_engines import RANK, adapter_tensors, lora_config, randomize


@pytest.fixture(scope="module", params=["hf", "vllm"])
def engine(request, tiny_chat_path):
    if request.param == "hf":
        from areno.rollout.hf import HFEngine

        eng = HFEngine(tiny_chat_path, dtype="float32", seed=0, max_model_len=128, max_lora_rank=RANK)
    else:
        pytest.importorskip("vllm")
        from areno.rollout.vllm import VLLMEngine

        eng = VLLMEngine(tiny_chat_path, dtype="float32", seed=0, max_model_len=128,
                         kv_cache_memory_bytes=16 << 20, max_lora_rank=RANK)
    eng.versions = itertools.count(1)
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def adapters(tiny_chat_model):
    """(old, new): two peft models of tiny chat with different random adapters, eval mode."""
    from peft import get_peft_model

    old = get_peft_model(copy.deepcopy(tiny_chat_model), lora_config())
    randomize(old, seed=1)
    new = copy.deepcopy(old)
    randomize(new, seed=2)
    return old.eval(), new.eval()


@pytest.mark.parametrize("n", [1, 2])
def test_an_engine_takes_a_new_adapter_mid_generation_without_dropping_requests(
        engine, adapters, n, ref_logprobs, make_prompts):
    old, new = adapters
    cfg = lora_config()
    ids, off = make_prompts(PROMPTS)
    s = SamplingConfig(temperature=1.0, max_tokens=MAX_TOKENS, ignore_eos=True, seed=7)
    load_adapter(engine, adapter_tensors(old).items(), cfg, next(engine.versions), inflight=3)
    ref = engine.generate(ids, off, n, s)
    later = next(engine.versions)

    def hook(done: int) -> None:
        if done == SWAP_AT:
            load_adapter(engine, adapter_tensors(new).items(), cfg, later, inflight=4)
    engine.step_hook = hook
    try:
        got = engine.generate(ids, off, n, s)
    finally:
        engine.step_hook = None
    assert_swapped_mid_generation(got, ref, n, ref_logprobs(new, got))
    if hasattr(engine, "adapters") and hasattr(engine.adapters, "request"):  # vLLM: only the new one is held
        assert engine.adapters.request.lora_name == f"areno-v{later}"
