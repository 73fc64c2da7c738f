"""scripts/gpu_check.sh runs its GPU logic on CPU with a tiny shape (--cpu-smoke),
so the script that cannot run here is at least exercised end to end."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_gpu_check_cpu_smoke_passes(tmp_path: Path) -> None:
    env = dict(os.environ, OUT=str(tmp_path), ARENO_CACHE=str(tmp_path / "cache"))
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh"), "--cpu-smoke"],
                          env=env, capture_output=True, text=True, timeout=600)
    report = (tmp_path / "gpu_check.txt").read_text()
    assert proc.returncode == 0, report + proc.stderr[-3000:]
    for line in ("PASS packed == padded", "PASS all losses", "PASS backend optimizer steps", "ALL PASS"):
        assert line in report
    assert (tmp_path / "gpu_check.json").is_file()
    for col in ("rollout", "host", "handoff", "train", "wsync", "train tok/s"):
        assert col in report
    cli = (tmp_path / "cli.txt").read_text()  # the real CLI: demo in bf16, then the "big" shape
    assert "CLI: ALL PASS" in cli, cli
    assert cli.count("median seconds per steady step") == 2 and "weight_sync" in cli
