"""The README's main command: `areno train` with no model and no dataset trains
the locally built tiny model on the built-in addition task until it masters it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.learning

REPO = Path(__file__).resolve().parents[1]
WINDOW = 20
MASTERED = 0.9  # mean reward of the last 20 steps (issue 12: seeds 0, 1 and 2)
STOP = ["--stop-at-reward", str(MASTERED)]  # a learning run ends once it holds the bar


def assert_learned(reward: np.ndarray, most: int, bar: float = MASTERED, early_bar: float = 0.2,
                   early: int = WINDOW) -> None:
    """reward: float [steps], a run under --stop-at-reward `bar` of at most `most`
    steps: it started below early_bar and its last WINDOW steps hold the bar."""
    assert 0 < reward.size <= most, reward.size
    first, late = reward[:early].mean(), reward[-WINDOW:].mean()
    assert first < early_bar and late >= bar, f"reward {first:.3f} -> {late:.3f} in {reward.size} steps"


def test_embedded_demo_masters_its_task(tmp_path):
    """The README's command (plus --stop-at-reward: the run ends once mastered)."""
    run_dir = tmp_path / "demo"
    res = subprocess.run(
        [sys.executable, "-m", "areno.cli", "train", "--seed", "0", "--no-save", *STOP,
         "--output-dir", str(run_dir)],
        capture_output=True, text=True, timeout=1500, cwd=REPO, env=dict(os.environ),
    )
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    reward = np.array([s["reward/mean"] for s in steps if "reward/mean" in s])
    assert_learned(reward, 600)  # the demo preset's --max-steps
