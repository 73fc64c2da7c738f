"""A tied-embedding model's checkpoint stores the embedding matrix once (issue
18: SmolLM2-135M's was 651 MB against its source's 538 MB, lm_head.weight
written again) and still loads, tied, in transformers and in vLLM."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open

from areno.backend.weights import hf_state_names, iter_full_state, save_hf_dir


@pytest.fixture(scope="module")
def tied_src(tiny_chat_path, tmp_path_factory) -> Path:
    """The tiny chat model with tie_word_embeddings=True (random, seeded), saved
    by transformers (which writes the tied matrix once), with its tokenizer."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.from_pretrained(tiny_chat_path)
    cfg.tie_word_embeddings = True
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    out = tmp_path_factory.mktemp("tied") / "src"
    model.save_pretrained(out)
    for f in Path(tiny_chat_path).iterdir():
        if f.is_file() and not f.name.startswith(("model", "config")):
            shutil.copy2(f, out / f.name)
    return out


def _gathered(hf) -> list[tuple[str, torch.Tensor]]:
    """What a rank hands save_hf_dir: one tensor per name, as FSDP2's
    full_tensor() gathers them (the tied pair arrives as two copies)."""
    return [(n, t.clone()) for n, t in iter_full_state(hf, hf_state_names(hf))]


def _keys(d: Path) -> set[str]:
    with safe_open(str(d / "model.safetensors"), "pt") as f:
        return set(f.keys())


def test_a_tied_models_checkpoint_stores_the_embedding_once_and_loads_tied(tied_src, tmp_path):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tied_src, dtype=torch.float32).eval()
    assert "lm_head.weight" in hf_state_names(hf)  # the export to engines still names it
    out = tmp_path / "ckpt"
    save_hf_dir(hf.config, iter(_gathered(hf)), out, tied_src)
    assert "lm_head.weight" not in _keys(out) and _keys(out) == _keys(tied_src)
    size = (out / "model.safetensors").stat().st_size
    assert size <= (tied_src / "model.safetensors").stat().st_size + 4096

    back = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert back.lm_head.weight.data_ptr() == back.model.embed_tokens.weight.data_ptr()
    ids = torch.arange(1, 9)[None]
    with torch.no_grad():
        torch.testing.assert_close(back(input_ids=ids).logits, hf(input_ids=ids).logits)


def test_vllm_loads_a_tied_checkpoint_as_transformers_does(tied_src, tmp_path, ref_logprobs):
    pytest.importorskip("vllm")
    from transformers import AutoModelForCausalLM

    from areno.rollout.engine import SamplingConfig
    from areno.rollout.vllm import VLLMEngine

    hf = AutoModelForCausalLM.from_pretrained(tied_src, dtype=torch.float32).eval()
    out = tmp_path / "ckpt"
    save_hf_dir(hf.config, iter(_gathered(hf)), out, tied_src)
    engine = VLLMEngine(out, dtype="float32", seed=0, max_model_len=64, kv_cache_memory_bytes=16 << 20)
    try:
        ids = np.arange(3, 9, dtype=np.int32)
        batch = engine.generate(ids, np.array([0, 6]), 2, SamplingConfig(max_tokens=4, seed=1))
    finally:
        engine.shutdown()
    back = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    np.testing.assert_allclose(batch.response_logprobs, ref_logprobs(back, batch), atol=2e-4)
