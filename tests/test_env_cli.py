"""`areno train --env-path`: the options through the config, and every mistake
refused in one line with exit 2 before anything starts."""

from __future__ import annotations

import numpy as np
import pytest

from areno.config.env import max_policy_tokens, trajectory_tokens
from areno.config.train import TrainConfig
from tests.helpers import refused

GOOD = "def step(state, completion):\n    return '', 1.0, True\n"


@pytest.fixture
def env(tmp_path):
    p = tmp_path / "env.py"
    p.write_text(GOOD)
    return str(p)


def test_env_options_reach_the_config_and_replace_the_reward_plugin(env):
    cfg = TrainConfig.from_sources(overrides=dict(env_path=env, max_turns=3, env_reward="last"))
    assert (cfg.env_path, cfg.max_turns, cfg.env_reward, cfg.reward_fn_path) == (env, 3, "last", None)
    assert trajectory_tokens(cfg) == 2 * 3 * cfg.max_new_tokens
    cfg = TrainConfig.from_sources(overrides=dict(env_path=env, max_trajectory_tokens=50))
    assert trajectory_tokens(cfg) == 50


def test_dr_grpo_normalises_a_trajectory_by_its_sampled_token_room(env):
    """seq-mean-token-sum-norm's constant under --env-path: a trajectory whose turns
    all ran to --max-new-tokens weighs what a full single completion does (sum 1 per
    sequence), not --max-turns times it."""
    from areno.envs.trajectory import Trajectories
    from areno.split import build_split_pack

    cfg = TrainConfig.from_sources(overrides=dict(env_path=env, max_turns=3, max_new_tokens=4,
                                                  loss_agg="seq-mean-token-sum-norm"))
    assert max_policy_tokens(cfg) == 12  # the default budget leaves room for all three turns
    small = TrainConfig.from_sources(overrides=dict(env_path=env, max_turns=3, max_new_tokens=4,
                                                    max_trajectory_tokens=10))
    assert max_policy_tokens(small) == 10
    single = TrainConfig.from_sources(overrides=dict(max_new_tokens=4))
    assert max_policy_tokens(single) == 4
    t = Trajectories(np.array([1, 2, 3], np.int32), np.array([0, 3], np.int64), np.zeros(2, np.int64))
    for i in range(2):
        for turn in range(3):
            t.add_turn(i, np.arange(4, dtype=np.int32) + 10, np.full(4, -1.0, np.float32))
            if turn < 2:
                t.add_observation(i, np.array([7, 8], np.int32))
    batch = t.to_batch(np.zeros(2, np.uint8), np.zeros(2, bool))
    sp = build_split_pack(batch, np.ones(2, np.float32), world_size=1, max_tokens=64,
                          loss_agg=cfg.loss_agg, norm_len=max_policy_tokens(cfg))
    w_tok = sp.pack.seq_weights[sp.pack.seq_index.long()] * sp.pack.loss_mask
    assert w_tok.sum().item() == pytest.approx(1.0, rel=1e-6)


@pytest.mark.parametrize("source,extra,message", [
    (None, [], "--env-path: file not found"),
    ("x = 1\n", [], "defines no step(state, completion)"),
    ("def step(:\n", [], "syntax error at line 1"),
    (GOOD, ["--max-turns", "0"], "--max-turns"),
    (GOOD, ["--env-reward", "mean"], "--env-reward"),
    (GOOD, ["--max-trajectory-tokens", "1"], "below --max-new-tokens"),
    (GOOD, ["--max-turns", "2", "--max-new-tokens", "8", "--max-trajectory-tokens", "20",
            "--overlong-buffer", "21"], "exceeds the trajectory budget (--max-trajectory-tokens) 20"),
    (GOOD, ["--env-schedule", "soon"], "--env-schedule"),
])
def test_env_mistakes_are_one_line(tmp_path, capsys, source, extra, message):
    p = tmp_path / "env.py"
    if source is not None:
        p.write_text(source)
    line = refused(["--env-path", str(p), *extra], capsys)
    assert message in line, line


def test_env_options_without_env_and_with_a_reward_plugin_are_refused(env, tmp_path, capsys):
    assert "needs --env-path" in refused(["--max-turns", "3"], capsys)
    assert "--env-schedule eager needs --env-path" in refused(["--env-schedule", "eager"], capsys)
    plugin = tmp_path / "r.py"
    plugin.write_text("def reward_fn(r):\n    return 1.0\n")
    assert "drop --reward-fn-path" in refused(["--env-path", env, "--reward-fn-path", str(plugin)], capsys)


def test_a_multi_turn_run_logs_whole_trajectories_with_turns_told_apart(tmp_path):
    """`areno train --env-path` end to end (2 steps of the guess demo): the terminal
    sample and completions.jsonl show the turns with [env: ...] between them."""
    import json
    from pathlib import Path

    from areno.cli import main

    guess = Path(__file__).resolve().parents[1] / "examples" / "guess" / "env.py"
    out = tmp_path / "run"
    rc = main(["train", "--env-path", str(guess), "--max-turns", "2", "--max-steps", "2", "--batch-size", "4",
               "--reward-workers", "0", "--log-completions", "4", "--output-dir", str(out), "--no-save"])
    assert rc in (0, None)
    recs = [json.loads(x) for x in (out / "completions.jsonl").read_text().splitlines()]
    two_turns = [r for r in recs if "[env: :" in r["completion"]]
    assert two_turns, recs
    from areno.rundir.reporting import format_sample_line

    assert "[env: :" in format_sample_line(two_turns[0])  # the terminal sample's line
    m = json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])
    assert 1.0 <= m["env/turns_mean"] <= 2.0 and m["env/rounds"] >= 1
