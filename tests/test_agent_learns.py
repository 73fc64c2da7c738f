"""The guess game as an OpenAI-client agent (examples/agents/guess.py): the tiny
demo model learns it through the gateway as it does as an environment. 100 of
the example's 200 steps: a gateway step costs ~2.5 s on 2 cores (every agent
call is an HTTP round trip), so the suite runs the first half of the curve."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from areno.cli import main

GUESS = Path(__file__).resolve().parents[1] / "examples" / "agents" / "guess.py"


@pytest.mark.learning
@pytest.mark.timeout(1800)
def test_the_tiny_model_learns_to_read_the_agents_reply(tmp_path):
    out = tmp_path / "run"
    rc = main(["train", "--agent-path", str(GUESS), "--max-turns", "2", "--max-steps", "100", "--lr", "1e-3",
               "--reward-workers", "8", "--output-dir", str(out), "--no-save"])
    assert rc in (0, None)
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    first = sum(r["reward/mean"] for r in rows[:10]) / 10
    last = sum(r["reward/mean"] for r in rows[-20:]) / 20
    assert first < 0.4, first  # blind guessing
    assert last >= 0.75, last  # 0.825 measured (lr decays over 100 steps); 0.98 at 200 (the example)
    assert rows[-1]["agent/branches"] == 0  # the agent only ever extends its prompt
