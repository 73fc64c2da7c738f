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


def test_embedded_demo_masters_its_task(tmp_path):
    run_dir = tmp_path / "demo"
    res = subprocess.run(
        [sys.executable, "-m", "areno.cli", "train", "--seed", "0", "--no-save",
         "--output-dir", str(run_dir)],
        capture_output=True, text=True, timeout=1500, cwd=REPO, env=dict(os.environ),
    )
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    reward = np.array([s["reward/mean"] for s in steps if "reward/mean" in s])
    assert reward.size == 600  # the demo preset's --max-steps
    early, late = reward[:WINDOW].mean(), reward[-WINDOW:].mean()
    assert early < 0.2 and late >= MASTERED, f"reward {early:.3f} -> {late:.3f}"
