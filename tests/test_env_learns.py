"""The embedded multi-turn demo (examples/guess) masters its game: the reward
rises from the one-in-ten first guess to nearly 1 only by reading the env's answer.
The run ends once its last 20 steps hold 0.85 (--stop-at-reward): step 84 at seed 0
on a quiet host (0.98 over the last 20 of a 200-step run)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from areno.cli import main

GUESS = Path(__file__).resolve().parents[1] / "examples" / "guess" / "env.py"


@pytest.mark.learning
@pytest.mark.timeout(1200)
def test_the_tiny_model_learns_to_read_the_environment(tmp_path):
    out = tmp_path / "run"
    rc = main(["train", "--env-path", str(GUESS), "--max-turns", "2", "--max-steps", "200", "--lr", "1e-3",
               "--reward-workers", "0", "--output-dir", str(out), "--no-save", "--stop-at-reward", "0.85"])
    assert rc in (0, None)
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    first = sum(r["reward/mean"] for r in rows[:10]) / 10
    last = sum(r["reward/mean"] for r in rows[-20:]) / 20
    assert first < 0.4, first  # blind guessing, before it learned to copy the answer
    # 0.98 on a quiet host; 0.898 once in CI beside another xdist worker: the ranks'
    # thread count follows the host's load (backend/launch.py), which changes the
    # float order and with it the seeded curve. 0.85 is still far from blind (0.18).
    assert len(rows) <= 200 and last >= 0.85, last  # --stop-at-reward 0.85 ended it once it held
    assert rows[-1]["env/turns_mean"] > 1.5  # mostly on turn 2: from the env's answer
