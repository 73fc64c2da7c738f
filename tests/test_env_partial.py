"""Multi-turn rounds on an engine process under --partial-rollouts: each group
streams back as soon as its trajectories end (envs/driver.py's _Driver.stream),
so a slow trajectory holds back its own group only and a step may take the
others first (first_finished.py); a round queued behind starts while the
running one's trajectories wait on their envs (fleet/episode_rounds.py).
In-process, split placement, a real engine process."""

from __future__ import annotations

import pytest

ENV = '''
def reset(state):
    state.data["moves"] = 0
def step(state, completion):
    state.data["moves"] += 1
    done = state.data["moves"] >= (1 if state.index < 2 else 2)  # group 0 (n = 2) ends first
    return f"move {state.data['moves']}", 1.0 if done else 0.0, done
'''


def test_a_multi_turn_rounds_groups_reach_the_controller_as_each_one_ends(tmp_path, areno_cache, monkeypatch):
    """K = 1, --partial-rollouts: every round of 4 groups x 2 trajectories, where
    group 0 ends after one move and the others after two, arrives in two parts,
    group 0 first; each step trains 4 whole groups with their turns (1.75 a
    trajectory) and every round's env/* counted once."""
    from areno.producers import EpisodeParts
    from test_compose import SPLIT, train

    env = tmp_path / "env.py"
    env.write_text(ENV)
    parts: dict[int, list[list[int]]] = {}
    sinks: list = []  # held, so that no round's sink is freed and its id given to the next one's
    keep = EpisodeParts.keep

    def spied(sink, pos, part, meta=None):
        if not any(s is sink for s in sinks):
            sinks.append(sink)
        parts.setdefault(id(sink), []).append(sorted(pos.tolist()))
        return keep(sink, pos, part, meta)
    monkeypatch.setattr(EpisodeParts, "keep", spied)
    steps = train(tmp_path / "run", areno_cache, monkeypatch, "--env-path", str(env), "--max-turns", "3",
                  "--reward-workers", "0", "--n-samples", "2", *SPLIT, "--off-policy-steps", "1",
                  "--partial-rollouts", steps=3)
    assert sorted(steps) == [1, 2, 3]
    assert list(parts.values()) == [[[0], [1, 2, 3]]] * 3
    assert all(steps[s]["env/turns_mean"] == 1.75 for s in steps)
    assert sum(steps[s]["env/rounds"] for s in steps) == 3 * 2  # two generate calls a round, each counted once


SLOW = '''
import time
def step(state, completion):
    state.data["n"] = state.data.get("n", 0) + 1
    time.sleep(0.3)
    return f"seen {state.data['n']}", float(len(completion) % 2), state.data["n"] >= 2
'''


@pytest.mark.slow  # a run with slow envs; test_env_driver holds the loop in the default tier
def test_queued_multi_turn_rounds_start_while_the_running_ones_wait_on_their_envs(
        tmp_path, areno_cache, monkeypatch):
    """K = 2: the three start-up rounds queue on the one engine process; each
    env step takes 0.3 s, so the engine would idle through every step of a
    round; instead the rounds queued behind join it (rollout/tail_filled counts
    their trajectories), every step trains 4 whole groups of two-turn
    trajectories, and no token lags more than K."""
    from test_compose import SPLIT, train

    env = tmp_path / "env.py"
    env.write_text(SLOW)
    steps = train(tmp_path / "run", areno_cache, monkeypatch, "--env-path", str(env), "--max-turns", "3",
                  "--reward-workers", "2", "--n-samples", "2", *SPLIT, "--off-policy-steps", "2",
                  "--partial-rollouts", steps=3)
    assert sorted(steps) == [1, 2, 3]
    assert sum(steps[s]["rollout/tail_filled"] for s in steps) > 0
    assert all(steps[s]["env/turns_mean"] == 2.0 for s in steps)
    assert max(steps[s]["rollout/token_lag_max"] for s in steps) <= 2


def test_an_environment_failing_on_the_engine_process_ends_the_run_in_one_line(tmp_path, areno_cache):
    """--on-reward-error fail, K = 1, --partial-rollouts: every trajectory's first
    step raises in the engine process's workers, so no group of either round in
    flight ever arrives. The rounds' replies carry the error, and the run ends
    with it, exit 2, one line naming the environment, not a traceback (the
    scheduler read the replies only once every group had arrived, and
    called the wait a scheduler bug)."""
    from inprocess import run_here
    from test_compose import HF1, SPLIT

    env = tmp_path / "env.py"
    env.write_text("def step(state, completion):\n    raise ValueError('no such move')\n")
    res = run_here(["train", *HF1, "--max-steps", "2", "--seed", "0", "--output-dir", str(tmp_path / "run"),
                    "--env-path", str(env), "--max-turns", "3", "--reward-workers", "1", *SPLIT,
                    "--off-policy-steps", "1", "--partial-rollouts"], areno_cache)
    assert res.returncode == 2, res.stderr[-3000:]
    assert "Traceback" not in res.stderr
    last = res.stderr.strip().splitlines()[-1]
    assert last.startswith("areno: error: environment ") and "no such move" in last, last
