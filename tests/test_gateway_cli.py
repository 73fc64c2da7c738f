"""`areno train --agent-path`: mistakes refused in one line with exit 2 before
anything starts, and a run of the demo's guess game as an OpenAI-client agent."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers import refused

GOOD = "def agent(task):\n    return 1.0\n"
GUESS = Path(__file__).resolve().parents[1] / "examples" / "agents" / "guess.py"


@pytest.fixture
def agent(tmp_path):
    p = tmp_path / "agent.py"
    p.write_text(GOOD)
    return str(p)


@pytest.mark.parametrize("source,extra,message", [
    (None, [], "--agent-path: file not found"),
    ("x = 1\n", [], "defines no agent(task)"),
    ("agent = 3\n", [], "'agent' is a int, not a function"),
    ("def agent(:\n", [], "syntax error at line 1"),
    (GOOD, ["--reward-workers", "0"], "--reward-workers 0"),
    (GOOD, ["--max-trajectory-tokens", "1"], "below --max-new-tokens"),
    (GOOD, ["--agent-tool-parser", "nosuch"], "--agent-tool-parser nosuch: vLLM has no such tool parser"),
])
def test_agent_mistakes_are_one_line(tmp_path, capsys, monkeypatch, source, extra, message):
    p = tmp_path / "agent.py"
    if source is not None:
        p.write_text(source)
    monkeypatch.chdir(tmp_path)
    line = refused(["--agent-path", str(p), *extra], capsys)
    assert message in line, line
    assert not (tmp_path / "runs").exists()  # refused before the run directory is made


def test_agent_with_an_env_and_its_options_alone_are_refused(agent, tmp_path, capsys):
    env = tmp_path / "env.py"
    env.write_text("def step(state, completion):\n    return '', 1.0, True\n")
    assert "give one of them" in refused(["--agent-path", agent, "--env-path", str(env)], capsys)
    assert "--agent-tool-parser needs --agent-path" in refused(["--agent-tool-parser", "llama3_json"], capsys)
    assert "--agent-concurrency needs --agent-path" in refused(["--agent-concurrency", "4"], capsys)


def test_the_demo_trains_the_guess_game_as_an_openai_client_agent(tmp_path):
    """Two steps of examples/agents/guess.py on the embedded demo through the CLI,
    with dynamic sampling and eval (rounds of the same producer): the completions
    file shows whole conversations, the metrics the gateway's counts."""
    from areno.cli import main

    out, evalset, agent = tmp_path / "run", tmp_path / "eval.jsonl", tmp_path / "agent.py"
    evalset.write_text('{"prompt": "1+2=", "answer": "3"}\n{"prompt": "4+4=", "answer": "8"}\n')
    # The agent's conversation opens with its own words: the completions file shows them.
    agent.write_text(GUESS.read_text().replace("prompt = task.prompt\n", 'prompt = "9:" + task.prompt\n'))
    rc = main(["train", "--agent-path", str(agent), "--max-turns", "2", "--max-steps", "2", "--batch-size", "4",
               "--reward-workers", "4", "--log-completions", "4", "--output-dir", str(out), "--no-save",
               "--eval-dataset-path", str(evalset), "--eval-interval", "2"])
    assert rc in (0, None)
    steps = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert any("eval/pass@1" in m for m in steps)
    recs = [json.loads(x) for x in (out / "completions.jsonl").read_text().splitlines()]
    assert any("[env: :" in r["completion"] for r in recs), recs  # a wrong first guess, then the secret
    assert recs and all(r["prompt"].replace(" ", "").startswith("9:") for r in recs), recs
    m = [m for m in steps if "agent/calls" in m][-1]  # the last training step (eval lines follow)
    assert m["agent/calls"] >= 32 and m["agent/branches"] == 0 and 1.0 <= m["env/turns_mean"] <= 2.0


def test_dynamic_sampling_takes_rounds_of_agent_runs(tmp_path):
    from areno.cli import main

    out = tmp_path / "run"
    rc = main(["train", "--agent-path", str(GUESS), "--max-turns", "2", "--max-steps", "1", "--batch-size", "4",
               "--reward-workers", "4", "--output-dir", str(out), "--no-save", "--dynamic-sampling", "reward"])
    assert rc in (0, None)
    m = json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])
    assert m["sampling/rounds"] >= 1 and m["sampling/groups_kept"] >= 1


def test_a_gateway_without_fastapi_or_uvicorn_is_one_line(monkeypatch):
    import sys

    from areno.errors import UserError
    from areno.gateway.app import GatewayServer

    monkeypatch.setitem(sys.modules, "uvicorn", None)  # as where vLLM (which brings it) is absent
    with pytest.raises(UserError, match="the gateway needs fastapi and uvicorn"):
        GatewayServer()
