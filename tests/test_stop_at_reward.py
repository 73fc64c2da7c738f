"""--stop-at-reward: a run ends once the mean reward of its last STOP_WINDOW steps
reaches the target, saved and evaluated as at --max-steps; the window travels in
the checkpoint, so a resumed run stops where the uninterrupted one did."""

from __future__ import annotations

import json

import pytest

from areno.rundir.checkpoint import latest_checkpoint
from areno.trainer import reward_reached
from test_compose import train


def test_the_rule_needs_a_full_window_whose_mean_reaches_the_target(monkeypatch):
    monkeypatch.setattr("areno.trainer.STOP_WINDOW", 3)
    assert not reward_reached([1.0, 1.0], 0.5)  # two steps: no window yet
    assert reward_reached([0.0, 0.5, 1.0, 0.5], 2 / 3)  # the last three: 2/3
    assert not reward_reached([1.0, 0.5, 1.0, 0.4], 2 / 3)  # the oldest left the window
    assert not reward_reached([1.0] * 5, None)


@pytest.fixture
def window_of_3(monkeypatch):
    monkeypatch.setattr("areno.trainer.STOP_WINDOW", 3)


def test_a_run_stops_at_the_target_and_a_resume_keeps_the_window(tmp_path, areno_cache, monkeypatch, window_of_3,
                                                               capfd):
    """Every reward is >= -1. A run stopped by --max-steps 2, then resumed for up
    to 10 steps, stops after step 3 (saved there): it does so only if its
    checkpoint held the rewards of steps 1 and 2 (else it would run to step 5)."""
    out = tmp_path / "run"
    train(out, areno_cache, monkeypatch, "--stop-at-reward", "-1", steps=2)
    capfd.readouterr()
    steps = train(out, areno_cache, monkeypatch, "--stop-at-reward", "-1", "--resume", "latest", steps=10)
    assert sorted(steps) == [1, 2, 3]
    assert "reached --stop-at-reward -1" in "".join(capfd.readouterr())
    ckpt = latest_checkpoint(out / "checkpoints")
    assert ckpt is not None and ckpt.name == "step_000003"
    state = json.loads((ckpt / "trainer_state.json").read_text())
    assert state["recent_rewards"] == [steps[s]["sampling/reward_generated"] for s in (1, 2, 3)]
