"""scripts/gpu_check.sh runs its GPU logic on CPU with tiny shapes (--cpu-smoke),
so the script that cannot run here is at least exercised end to end: the real
CLI on the default path (with vLLM, datasets and math-verify blocked, as on the
GPU machine), the engine's memory check, and the JSON it leaves under $OUT."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.bench
def test_gpu_check_cpu_smoke_passes(tmp_path: Path) -> None:
    env = dict(os.environ, OUT=str(tmp_path), ARENO_CACHE=str(tmp_path / "cache"), PYTHON=sys.executable)
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh"), "--cpu-smoke"],
                          env=env, capture_output=True, text=True, timeout=1500)
    report = (tmp_path / "gpu_check.txt").read_text()
    cli = (tmp_path / "cli.txt").read_text()
    assert proc.returncode == 0, report + cli + proc.stderr[-3000:]
    for line in ("PASS packed == padded", "PASS engine sampled every token", "ALL PASS"):
        assert line in report
    assert json.loads((tmp_path / "gpu_check.json").read_text())["engine"]["new_tokens"] == 16
    assert "CLI: ALL PASS" in cli, cli
    assert cli.count("median seconds per steady step") == 8 and "weight_sync" in cli
    runs = (("cli_demo", 3), ("cli_split", 3), ("cli_split_k1", 3), ("cli_resume", 5), ("cli_env", 2),
            ("cli_qwen3", 2), ("cli_qwen3_ckpt", 2), ("cli_qwen3_lora8", 2))
    for name, steps in runs:
        run = json.loads((tmp_path / f"{name}.json").read_text())
        assert run["ok"] and run["weight_sync_check"] == dict(run["weight_sync_check"], passed=True, syncs=steps)
    steps = [json.loads(line) for line in (tmp_path / "steps.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps][:10] == ["build", "engine", *(name for name, _ in runs)]
    # eval at the demo's end; the resumed run went on from step 3 (resume.log: only its own steps)
    assert set(json.loads((tmp_path / "cli_demo.json").read_text())["eval"]) >= {"eval/pass@1", "eval/reward@1"}
    assert "resumed at step 3" in (tmp_path / "runs" / "resume.log").read_text()
    # step 1's K = 0 ratio: the trainer's old log-probs (bf16 default) give exactly 1, the sampler's not
    trainer, sampler = (json.loads((tmp_path / f"cli_{n}.json").read_text())["step1"]
                        for n in ("qwen3", "qwen3_ckpt"))
    assert (trainer["train/ratio_std"], trainer["train/ratio_max"]) == (0.0, 1.0)
    assert sampler["train/ratio_std"] > 0 and sampler["train/logprob_diff"] == trainer["train/logprob_diff"]
    assert all(s["rc"] == 0 for s in steps), steps
    # each step printed one line; the whole wrote one table
    for s in steps:
        assert f"step {s['step']:<18} ok" in proc.stderr + cli, s
    table = (tmp_path / "gpu_check_table.md").read_text()
    assert all(f"| {s['step']} | 0 |" in table for s in steps) and table.rstrip().endswith("ALL PASS")
    assert "grad checkpointing: no GPU peak memory (CPU)" in table
    assert "K = 0 ratio at step 1: trainer's old log-probs clip_frac 0, ratio_std 0, ratio_max 1" in table
    # what the runs were: split placement (an engine process beside the rank), K = 1, checkpointing
    split_log = (tmp_path / "runs" / "split_k1.log").read_text()
    assert "--off-policy-steps 1 turns on" in split_log
    for name, flag in (("split", "rollout_world_size: 1"), ("split_k1", "off_policy_steps: 1"),
                       ("qwen3_ckpt", "grad_checkpointing: true")):
        assert flag in (tmp_path / "runs" / name / "config.yaml").read_text(), name


def test_a_failed_sync_check_in_the_runs_output_fails_the_summary(tmp_path: Path) -> None:
    """The verdict comes from the run, not a constant: its log's WeightSyncError
    line, or fewer steps than asked, fail it."""
    from arenobench.gpu_check_cli import sync_check

    steps = [{"time/step": 1.0}, {"time/step": 1.0}]
    log = tmp_path / "run.log"
    log.write_text("areno: step 1 ...\n")
    assert sync_check(steps, log, 2)["passed"]
    assert not sync_check(steps, log, 3)["passed"]
    log.write_text("areno: error: training stopped in step 1: sync_weights: rank 0 failed: WeightSyncError: "
                   "weight sync probe failed on rank 0: engine log-probs differ\n")
    bad = sync_check(steps[:1], log, 2)
    assert not bad["passed"] and "WeightSyncError" in bad["verdict"]


def test_every_gpu_step_has_a_limit_and_they_fit_one_450s_call() -> None:
    """Each step runs under `timeout --kill-after` (the `step` function), and the
    GPU limits plus their kill-after grace add up to at most 450 s."""
    import re

    text = (ROOT / "scripts" / "gpu_check.sh").read_text()
    kill_after = int(re.search(r"^KILL_AFTER=(\d+)$", text, re.M).group(1))
    limits = [int(n) for n in re.findall(r"^\s*(?:step|qwen_run|demo_run) [a-z0-9_]+ (\d+) ", text, re.M)]
    assert len(limits) == 11 and sum(limits) + kill_after * len(limits) <= 450, limits
    assert 'timeout --signal=TERM --kill-after=$KILL_AFTER "$limit"' in text
