"""scripts/bench_handoff.py stays runnable: a small pack, 2 ranks, one step."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from arenobench.lib import child_env

ROOT = Path(__file__).resolve().parents[1]


def test_bench_handoff_runs_and_reports_both_transports(tmp_path: Path) -> None:
    out = tmp_path / "handoff.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "bench_handoff.py"), "--tokens", "30000", "--ranks", "2",
         "--repeats", "2", "--out", str(out)],
        capture_output=True, text=True, timeout=240, cwd=ROOT, env=child_env(),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = json.loads(out.read_text())["runs"]["2"]
    for kind in ("shm", "pickle"):
        assert run[kind]["ready_s"] > 0 and run[kind]["first_wait_s"] >= 0
    assert run["segment_creations"] == 1
    assert "ratio pickle/shm" in proc.stdout
