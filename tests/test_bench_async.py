"""scripts/bench_async.py with tiny costs: the real `areno train` at K = 0 and
K = 1 runs with the fixed-cost stand-ins (RankHooks in the rank and in the
engine process) really applied, and prints the table's row."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from areno.bench.lib import child_env

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "bench_async.py"


def test_bench_async_stand_ins_apply_and_k1_overlaps(tmp_path: Path) -> None:
    R = T = 0.4
    out = tmp_path / "async.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--train-s", str(T), "--ratios", "1", "--steps", "3",
                           "--out", str(out)], cwd=tmp_path, capture_output=True, text=True, timeout=240,
                          env=child_env())
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "| R/T | R | T | K=0 step | K=1 step | sync | ideal | K=1/ideal | K=1/K=0 |" in proc.stdout
    assert "| 1 | 0.4 s | 0.4 s |" in proc.stdout and "targets:" in proc.stdout
    (row,) = json.loads(out.read_text())["rows"]
    # 3 train commands and 3 rollouts per run went through the hooks: the engine
    # process's rollout_begin/rollout_end as well as the rank's train_begin/train_end
    assert row["train_cmds"] == 6 and row["rollout_cmds"] == 6, row
    assert row["max_overrun_s"] <= 0, "the real work took longer than the stand-in's cost"
    assert row["k0_step_s"] >= R + T, row  # synchronous: rollout, then train, each at its stand-in cost
    assert row["k1_step_s"] >= max(R, T), row
    # K = 1 trains while the engine generates: far below R + T even on a loaded machine
    assert row["k1_step_s"] < R + T - 0.15, row
