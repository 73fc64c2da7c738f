"""Agents under split placement: each engine process runs the agent driver beside
its engine, with its own agent workers and gateway (gateway/host.py,
AgentEpisodes), and its reply carries the prompts the agents' conversations
chose. Seeded with the turns schedule, K = 0 trains what the colocated run
trains, metric for metric; K = 1 trains a version behind."""

from __future__ import annotations

from pathlib import Path

import pytest

from test_compose import SPLIT, assert_same, train

GUESS = Path(__file__).resolve().parents[1] / "examples" / "agents" / "guess.py"
OPTIONS = ["--max-turns", "2", "--reward-workers", "4", "--lr", "1e-3"]


@pytest.fixture
def agent(tmp_path) -> list[str]:
    """examples/agents/guess.py whose conversation opens with its own words (":0 "
    before the row's prompt): what is trained is the agent's prompt, not the row's."""
    src = GUESS.read_text().replace("prompt = task.prompt\n", 'prompt = ":0 " + task.prompt\n')
    assert '":0 "' in src
    path = tmp_path / "agent.py"
    path.write_text(src)
    return ["--agent-path", str(path), *OPTIONS]


@pytest.mark.slow  # two runs; test_gateway_split's other tests hold split agents in the default tier
def test_agents_under_split_placement_at_k0_are_the_colocated_run_bit_for_bit(tmp_path, areno_cache,
                                                                               monkeypatch, agent):
    """The batches (their prompts are the agents' conversations), rewards, agent/*
    counts and updates are the colocated run's: every metric but the clocks."""
    colocated = train(tmp_path / "colocated", areno_cache, monkeypatch, *agent, steps=3)
    split = train(tmp_path / "split", areno_cache, monkeypatch, *agent, *SPLIT, steps=3)
    assert_same(colocated, split, range(1, 4))
    assert all(split[s]["rollout/policy_lag_max"] == 0 for s in split)
    assert colocated[3]["env/turns_mean"] > 1.0  # a wrong first guess: the agent sent a second call
    assert colocated[3]["agent/calls"] > 16 and colocated[3]["agent/branches"] == 0


@pytest.mark.slow  # K = 1's admission and lag are test_compose's; this is the agent's part in it
@pytest.mark.parametrize("partial", [["--whole-rounds"], ["--partial-rollouts"]], ids=["whole", "partial"])
def test_agents_at_k1_train_a_version_behind(tmp_path, areno_cache, monkeypatch, agent, partial):
    """Whole rounds: every trajectory a version behind from step 2. Partial
    rollouts: an agent round in flight may take the next version between two
    decode steps, so a trajectory lags at most one version by its oldest token."""
    steps = train(tmp_path / "k1", areno_cache, monkeypatch, *agent, *SPLIT, "--off-policy-steps", "1",
                  *partial, steps=3)
    assert sorted(steps) == [1, 2, 3]
    assert max(steps[s]["rollout/policy_lag_max"] for s in steps) == 1
    assert all(steps[s]["agent/calls"] >= 16 for s in steps)
    loads = sum(steps[s].get("rollout/inflight_loads", 0) for s in steps)
    checks = sum(steps[s].get("rollout/inflight_checks", 0) for s in steps)
    assert loads == checks and (loads == 0 if "--whole-rounds" in partial else "rollout/inflight_loads" in steps[3])


@pytest.mark.parametrize("placement", [[], SPLIT], ids=["colocated", "split"])
def test_an_agent_returning_none_is_scored_by_the_reward_plugin_wherever_it_runs(tmp_path, areno_cache,
                                                                                monkeypatch, placement):
    """--reward-fn-path beside --agent-path: a run whose agent() returns None gets
    the plugin's reward for its conversation, in the controller or an engine process."""
    src = GUESS.read_text().replace("            return 1.0\n", "            return None\n")
    src = src.replace("    return 0.0\n", "    return None\n")
    assert "return 1.0" not in src and "return 0.0" not in src
    (tmp_path / "agent.py").write_text(src)
    (tmp_path / "reward.py").write_text("def reward_fn(record):\n    return 0.75 if record.num_tokens else 0.0\n")
    steps = train(tmp_path / "run", areno_cache, monkeypatch, "--agent-path", str(tmp_path / "agent.py"),
                  *OPTIONS, "--reward-fn-path", str(tmp_path / "reward.py"), *placement, steps=1)
    assert steps[1]["reward/mean"] == 0.75 and steps[1]["agent/calls"] >= 16
