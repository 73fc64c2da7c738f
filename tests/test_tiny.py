"""The tiny local model: deterministic, loadable as is, chat template renders."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from areno.models.tiny import CHAT_TEMPLATE, VARIANTS, tiny_model_path


def test_two_builds_are_identical(tmp_path, areno_cache):
    for variant in VARIANTS:
        a = tiny_model_path(variant, cache_dir=tmp_path / "a")
        b = tiny_model_path(variant, cache_dir=tmp_path / "b")
        assert a.name == b.name
        wa, wb = load_file(a / "model.safetensors"), load_file(b / "model.safetensors")
        assert wa.keys() == wb.keys()
        assert all(torch.equal(wa[k], wb[k]) for k in wa)
        assert (a / "tokenizer.json").read_bytes() == (b / "tokenizer.json").read_bytes()
        # and the session cache (maybe built earlier, maybe by another process) agrees
        c = tiny_model_path(variant, cache_dir=areno_cache)
        assert c.name == a.name
        assert (c / "tokenizer.json").read_bytes() == (a / "tokenizer.json").read_bytes()


def test_second_call_reuses_the_cache(tmp_path):
    p = tiny_model_path("arith", cache_dir=tmp_path)
    mtime = (p / "model.safetensors").stat().st_mtime_ns
    assert tiny_model_path("arith", cache_dir=tmp_path) == p
    assert (p / "model.safetensors").stat().st_mtime_ns == mtime
    assert [q.name for q in tmp_path.iterdir()] == [p.name]  # no temp dir left behind


def test_unknown_variant_names_the_valid_ones(tmp_path):
    with pytest.raises(ValueError, match="chat, arith"):
        tiny_model_path("huge", cache_dir=tmp_path)


def test_chat_model_loads_in_transformers(tiny_chat_path, tiny_chat_model):
    from transformers import AutoTokenizer

    cfg = json.loads((tiny_chat_path / "config.json").read_text())
    assert cfg["model_type"] == "qwen3" and cfg["head_dim"] == 32 and cfg["hidden_size"] == 128
    assert cfg["tie_word_embeddings"] is False
    n_params = sum(p.numel() for p in tiny_chat_model.parameters())
    assert 300_000 <= n_params <= 2_000_000
    assert "lm_head.weight" in load_file(tiny_chat_path / "model.safetensors")
    tok = AutoTokenizer.from_pretrained(tiny_chat_path)
    assert 300 <= len(tok) <= 512
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"
    gen = json.loads((tiny_chat_path / "generation_config.json").read_text())
    assert sorted(gen["eos_token_id"]) == sorted(tok.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"]))
    ids = tok("The answer is 7.", return_tensors="pt").input_ids
    assert tok.decode(ids[0]) == "The answer is 7."
    with torch.no_grad():
        logits = tiny_chat_model(input_ids=ids).logits
    assert logits.shape == (1, ids.shape[1], cfg["vocab_size"]) and logits.dtype == torch.float32


def test_chat_template_renders_qwen_style(tiny_chat_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_chat_path)
    assert tok.chat_template == CHAT_TEMPLATE
    msgs = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 3 + 4?"},
        {"role": "assistant", "content": "7"},
    ]
    text = tok.apply_chat_template(msgs, tokenize=False)
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nWhat is 3 + 4?<|im_end|>\n"
        "<|im_start|>assistant\n7<|im_end|>\n"
    )
    prompt = tok.apply_chat_template(msgs[:2], tokenize=False, add_generation_prompt=True)
    assert prompt.endswith("<|im_start|>assistant\n")
    ids = tok(prompt).input_ids
    assert ids.count(tok.convert_tokens_to_ids("<|im_start|>")) == 3  # specials stay single tokens


def test_arith_vocabulary_is_the_demo_alphabet(tiny_arith_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_arith_path)
    assert len(tok) == 17
    ids = tok("3+4=7").input_ids
    assert len(ids) == 5 and tok.decode(ids) == "3+4=7"
    assert tok.decode(tok("12: 5+5=10").input_ids) == "12: 5+5=10"
    assert tok.decode(tok("hi 3\n").input_ids) == " 3"  # outside the alphabet: dropped
    cfg = json.loads((tiny_arith_path / "config.json").read_text())
    assert cfg["vocab_size"] == 17


def test_config_has_what_vllm_reads(tiny_chat_path, tiny_chat_model):
    """vLLM itself loads the model in test_engine_contract; here only the config fields."""
    cfg = json.loads((tiny_chat_path / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen3ForCausalLM"]
    assert cfg["max_position_embeddings"] == 2048
    assert cfg.get("dtype", cfg.get("torch_dtype")) == "float32"
    assert all(bool(torch.isfinite(p.detach()).all()) for p in tiny_chat_model.parameters())
