"""Resume end to end: a run stopped at a checkpoint and resumed continues
exactly as the uninterrupted run did (same prompts, same metrics), and its
checkpoints load as they are in transformers and in vLLM.

The pair of runs uses the real default path (vLLM rollouts, 2 gloo ranks): the
resumed run loads its model into vLLM and both ranks straight from the
checkpoint directory. Helpers here are shared by test_faults.py and
test_eval_plot.py."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from areno.rundir.lock import LOCK_FILE
from inprocess import run_here

# Two vLLM runs on 2 ranks (~2.5 min on 2 busy cores): the fault tier. The default
# tier resumes exactly too, with the transformers engine (test_async_loop,
# test_lora, test_checkpoint).
pytestmark = pytest.mark.faults

REPO = Path(__file__).resolve().parents[1]
# The embedded demo (tiny arith model, builtin task), small and quick.
SMALL = ["--batch-size", "4", "--n-samples", "4"]
HF1 = [*SMALL, "--rollout-engine", "hf", "--world-size", "1"]
DEMO_PROMPTS = 55  # areno.data.tasks.arith: a+b < 10
EVAL_ROWS = [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a, b in
             [(1, 2), (3, 4), (0, 5), (2, 2), (6, 1)]]
# 1 for the right digit, 0.5 for another digit, 0 otherwise: graded, so the
# untrained demo model scores something and pass@1 != reward@1.
DIGIT_REWARD = """
def reward_fn(record):
    first = record.completion.strip()[:1]
    return 1.0 if first == record.answer else 0.5 if first.isdigit() else 0.0
"""
# Metrics that measure time, not what was computed.
UNTIMED = ("time/", "perf/")


def cli(args: list[str], cache: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    """`python -m areno.cli ARGS` with the test session's tiny-model cache."""
    return subprocess.run([sys.executable, "-m", "areno.cli", *args], capture_output=True,
                          text=True, timeout=timeout, cwd=REPO, env=cli_env(cache))


def cli_env(cache: Path) -> dict:
    # COLUMNS: rich would wrap the console lines at 80 columns in a pipe.
    return {**os.environ, "ARENO_CACHE": str(cache), "PYTHONUNBUFFERED": "1", "COLUMNS": "500"}


def popen_train(args: list[str], cache: Path) -> subprocess.Popen:
    """`areno train ARGS` in the background, in a session (process group) of its own."""
    return subprocess.Popen([sys.executable, "-m", "areno.cli", "train", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO,
                            env=cli_env(cache), start_new_session=True)


def ok(res: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return res


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def train_steps(run_dir: Path) -> dict[int, dict]:
    """step -> training record (eval records left out)."""
    return {r["step"]: r for r in read_metrics(run_dir) if "reward/mean" in r}


def expected_prompt_hashes(steps: range, batch_size: int, seed: int = 0,
                           num_prompts: int = DEMO_PROMPTS) -> dict[int, float]:
    """The data order an uninterrupted run draws, straight from PromptSampler."""
    from areno.data.sampler import PromptSampler
    from areno.trainer import prompt_hash

    sampler = PromptSampler(num_prompts, batch_size, seed)
    out = {}
    for step in range(1, steps.stop):
        idx = sampler.next_batch()
        if step in steps:
            out[step] = prompt_hash(idx)
    return out


def assert_same_steps(a: dict, b: dict, steps, rel: float = 1e-5) -> None:
    """Same prompts exactly; every computed metric equal within `rel` (CPU fp32
    with per-step seeds is deterministic, so in practice they are identical)."""
    for s in steps:
        assert a[s]["data/prompt_hash"] == b[s]["data/prompt_hash"], f"step {s}: other prompts"
        keys = [k for k in a[s] if not k.startswith(UNTIMED)]
        assert sorted(keys) == sorted(k for k in b[s] if not k.startswith(UNTIMED))
        for k in keys:
            assert math.isclose(a[s][k], b[s][k], rel_tol=rel, abs_tol=1e-7), (s, k, a[s][k], b[s][k])


def pgroup_alive(pgid: int) -> list[int]:
    """Live (non-zombie) processes of process group pgid."""
    alive = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            fields = (d / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            alive.append(int(d.name))
    return alive


def wait_group_gone(pgid: int, seconds: float = 10.0) -> list[int]:
    import time

    deadline = time.monotonic() + seconds
    while (left := pgroup_alive(pgid)) and time.monotonic() < deadline:
        time.sleep(0.1)
    return left


# ---------------------------------------------------------------------------
# vLLM (the default outside the demo): its seeded sampling must survive a resume too
FLAGS = [*SMALL, "--rollout-engine", "vllm", "--world-size", "2", "--max-steps", "4", "--save-interval", "2",
         "--seed", "3", "--eval-interval", "2", "--eval-n", "2"]


@pytest.fixture(scope="module")
def eval_flags(tmp_path_factory) -> list[str]:
    """A held-out set and a graded reward (eval mean@2 samples: its seed must survive a resume)."""
    d = tmp_path_factory.mktemp("evalset")
    (d / "eval.jsonl").write_text("".join(json.dumps(r) + "\n" for r in EVAL_ROWS))
    (d / "digit.py").write_text(DIGIT_REWARD)
    return ["--eval-dataset-path", str(d / "eval.jsonl"), "--reward-fn-path", str(d / "digit.py")]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, areno_cache, eval_flags) -> Path:
    """4 steps, checkpoints at 2 and 4 (all kept), eval at 0, 2, 4, vLLM rollouts, 2 ranks."""
    out = tmp_path_factory.mktemp("uninterrupted")
    ok(run_here(["train", *FLAGS, *eval_flags, "--keep-last", "0", "--output-dir", str(out)],
                areno_cache))
    return out


def test_resumed_run_repeats_the_uninterrupted_runs_steps(uninterrupted, tmp_path, areno_cache,
                                                          eval_flags):
    assert_resume_repeats(uninterrupted, tmp_path / "resumed", [*FLAGS, *eval_flags], areno_cache)


def assert_resume_repeats(uninterrupted: Path, out: Path, flags: list[str], cache: Path) -> None:
    """Resumed from uninterrupted's step-2 checkpoint with the same flags, the run
    repeats steps 3 and 4 (prompts, metrics, the step-4 eval) and writes the same model."""
    ckpt = uninterrupted / "checkpoints" / "step_000002"
    res = ok(run_here(["train", *flags, "--resume", str(ckpt), "--output-dir", str(out)], cache))
    assert "resumed at step 2" in res.stdout
    full, resumed = train_steps(uninterrupted), train_steps(out)
    assert sorted(full) == [1, 2, 3, 4] and sorted(resumed) == [3, 4]
    assert_same_steps(full, resumed, [3, 4])
    expected = expected_prompt_hashes(range(1, 5), batch_size=4, seed=3)
    assert {s: full[s]["data/prompt_hash"] for s in full} == expected
    # the step-4 eval, greedy and sampled, is the same too
    evals = [{r["step"]: r for r in read_metrics(d) if "eval/pass@1" in r} for d in (uninterrupted, out)]
    assert sorted(evals[0]) == [0, 2, 4] and sorted(evals[1]) == [4]
    assert evals[0][4] == evals[1][4]
    assert any(r["eval/reward@1"] > 0 or r["eval/mean@2"] > 0 for r in evals[0].values())
    # ... and the same model comes out.
    from safetensors.numpy import load_file

    a = load_file(uninterrupted / "checkpoints/step_000004/model.safetensors")
    b = load_file(out / "checkpoints/step_000004/model.safetensors")
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_allclose(a[k], b[k], rtol=1e-5, atol=1e-6, err_msg=k)


def test_checkpoint_is_a_plain_hf_directory_with_the_trainer_state(uninterrupted, tiny_arith_path):
    """transformers loads it as it is (vLLM does too: the resumed run above starts
    its engine from the checkpoint directory)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    ckpt = uninterrupted / "checkpoints" / "step_000004"
    assert [p.name for p in (uninterrupted / "checkpoints").iterdir()
            if p.name.startswith(".") and p.name != LOCK_FILE] == []  # no temp dirs left (the run's lock stays)
    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(ckpt)
    assert tok("1+2=")["input_ids"] == AutoTokenizer.from_pretrained(tiny_arith_path)("1+2=")["input_ids"]
    base = AutoModelForCausalLM.from_pretrained(tiny_arith_path, dtype=torch.float32)
    assert model.generation_config.eos_token_id == base.generation_config.eos_token_id
    assert any(not torch.equal(p, q) for p, q in zip(model.parameters(), base.parameters()))
    state = json.loads((ckpt / "trainer_state.json").read_text())
    assert state["step"] == 4 and state["config"]["seed"] == 3
    assert {"epoch", "position", "seed"} <= state["sampler"].keys()
    backend = ckpt / "backend"
    assert (backend / "trainer.pt").is_file()
    assert sorted(p.name for p in backend.glob("rng_rank*.pt")) == ["rng_rank0.pt", "rng_rank1.pt"]
    assert (ckpt / "controller_rng.pt").is_file()
