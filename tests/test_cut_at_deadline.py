"""--cut-at-deadline (issue 39): under --partial-rollouts a sample still
generating when its group must train (its round's version K updates behind the
trainer's) ends at its engine's next decode step, finish "length", instead of
the trainer waiting for it. The engines' side on both engines is
tests/test_inflight_weights.py's; here the refusal and the whole loop."""

from __future__ import annotations

import numpy as np
import pytest

from helpers import refused


@pytest.mark.parametrize("args", [[], ["--rollout-world-size", "1", "--off-policy-steps", "1", "--whole-rounds"]],
                         ids=["colocated", "whole-rounds"])
def test_the_cut_is_refused_without_partial_rollouts(args, capsys):
    assert "--cut-at-deadline needs --partial-rollouts" in refused(["--cut-at-deadline", *args], capsys)


def test_the_cut_is_refused_for_an_agent_whose_conversation_the_engines_cannot_end(capsys):
    args = ["--cut-at-deadline", "--rollout-world-size", "1", "--off-policy-steps", "1",
            "--agent-path", "examples/agents/guess.py"]
    assert "--cut-at-deadline with --agent-path: an agent's conversation lives in its own program" in \
        refused(args, capsys)


def test_a_k1_run_cuts_the_round_due_at_the_next_step_and_trains_its_samples_as_cut(tmp_path, areno_cache):
    """The whole loop, in-process, split placement at K = 1: rounds 1 and 2 start
    with version 0, every sample running to its 16-token cap; the gated engine
    (cut_gate_hooks.py) holds round 2 at its first decode step until step 1
    (round 1) has published version 1, whose offer says rounds of version 0 are
    due. Round 2's 16 samples end there, one token each, finish "length"
    (rollout/cut_samples), step 2 trains them without a token past lag 1, and
    the run goes on to its end."""
    import json

    from inprocess import run_here
    from test_resume import HF1, ok, train_steps

    out = tmp_path / "run"
    ok(run_here(["train", *HF1, "--rollout-world-size", "1", "--off-policy-steps", "1", "--cut-at-deadline",
                 "--max-new-tokens", "16", "--max-steps", "3", "--seed", "0", "--no-save", "--log-completions", "16",
                 "--output-dir", str(out)], areno_cache, env={"ARENO_RANK_HOOKS": "cut_gate_hooks:CutGate"}))
    steps = train_steps(out)
    assert sorted(steps) == [1, 2, 3]
    assert [steps[s]["rollout/cut_samples"] for s in (1, 2)] == [0, 16]
    logged = [json.loads(line) for line in (out / "completions.jsonl").read_text().splitlines()]
    assert {c["finish_reason"] for c in logged if c["step"] == 2} == {"length"}
    assert {len(c["completion"]) <= 8 for c in logged if c["step"] == 2} == {True}  # one token each
    assert all(steps[s]["rollout/token_lag_max"] <= 1 for s in steps)
    assert np.isfinite([steps[s]["train/loss"] for s in steps]).all()


SLOW_ONE = """
import time
def step(state, completion):
    state.data["moves"] = state.data.get("moves", 0) + 1
    if state.index == 7:  # a round's last trajectory waits on its environment
        time.sleep(2.0)
    return "move", 1.0, state.data["moves"] >= 2
"""


def test_a_multi_turn_rounds_trajectories_waiting_on_their_environment_end_at_its_deadline(
        tmp_path, areno_cache, monkeypatch):
    """K = 1, --env-path, 4 groups x 2 trajectories a round: each round's last
    trajectory waits 2 s on every environment step; the others end after two
    moves (reward 2, finish stop). Rounds 1 and 2 (version 0) are due once step
    1 published version 1: the trajectories still waiting end between turns
    (envs/rounds.py, cut_due), finish length with the reward their environment
    gave so far, and train at their deadline; nothing lags more than K."""
    import json

    from test_compose import SPLIT, train

    env = tmp_path / "env.py"
    env.write_text(SLOW_ONE)
    out = tmp_path / "run"
    steps = train(out, areno_cache, monkeypatch, "--env-path", str(env), "--max-turns", "3",
                  "--reward-workers", "4", "--n-samples", "2", *SPLIT, "--off-policy-steps", "1",
                  "--cut-at-deadline", "--log-completions", "8", "--no-save", steps=3)
    assert sorted(steps) == [1, 2, 3]
    assert sum(steps[s]["rollout/cut_samples"] for s in steps) >= 2
    assert max(steps[s]["rollout/token_lag_max"] for s in steps) <= 1
    logged = [json.loads(line) for line in (out / "completions.jsonl").read_text().splitlines()]
    cut = [c for c in logged if c["finish_reason"] == "length"]
    assert cut and all(c["reward"] in (0.0, 1.0) for c in cut)  # cut before its first or second answer
    assert all(c["reward"] == 2.0 for c in logged if c["finish_reason"] == "stop")
