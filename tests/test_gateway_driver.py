"""Agents through the gateway, end to end in-process: an agent written against
the `openai` client makes tool-result turns and edits its history; the batch
holds exactly the tokens the engine sampled, each for the context it was
sampled from, observation tokens carry no loss, and the edit is a counted branch."""

from __future__ import annotations

import numpy as np
import pytest

from areno.envs.driver import EnvBounds
from areno.envs.plugin import EnvState
from areno.envs.pool import EnvPool
from areno.gateway.app import GatewayServer
from areno.gateway.conversation import ChatRenderer
from areno.gateway.driver import rollout_agents
from areno.gateway.tools import ToolCallParser
from areno.metrics import AGENT_METRICS, ENV_METRICS
from areno.pack import build_train_pack
from areno.rewards.plugin import RewardError
from areno.rollout.batch import turn_segments
from areno.rollout.engine import SamplingConfig
from tests.env_trace import TracingEngine

AGENT = '''
from openai import OpenAI

TOOLS = [{"type": "function", "function": {"name": "add", "description": "Add two numbers.",
          "parameters": {"type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}}}}}]


def parallel(task, client):
    """Two calls of one run at once: the second is refused (409), the first answered."""
    import openai
    from concurrent.futures import ThreadPoolExecutor

    msgs = [{"role": "user", "content": task.row["q"]}]
    if task.index == 1:  # under turns, run 0's first call waits for this one's: meanwhile its second comes
        import time
        time.sleep(1.0)
        client.chat.completions.create(model=task.model, messages=msgs, max_tokens=3)
        return 0.0
    def one(_):
        try:
            client.chat.completions.create(model=task.model, messages=msgs, max_tokens=3)
            return 0
        except openai.ConflictError:
            return 1
    with ThreadPoolExecutor(2) as ex:
        return float(sum(ex.map(one, range(2))))


def agent(task):
    client = OpenAI(base_url=task.base_url, api_key=task.api_key, max_retries=0)
    if task.row.get("parallel"):
        return parallel(task, client)
    msgs = [{"role": "system", "content": "You can call add."}, {"role": "user", "content": task.row["q"]}]
    for k in range(3):  # three turns, each answered with a tool result
        r = client.chat.completions.create(model=task.model, messages=msgs, tools=TOOLS, max_tokens=5)
        msgs.append(r.choices[0].message)  # the client's own message object, sent back as it serializes it
        msgs.append({"role": "tool", "tool_call_id": f"c{k}", "content": str(10 + k)})
    if task.row.get("edit"):  # drop the last turn and its result, ask again from there
        msgs = msgs[:-2] + [{"role": "user", "content": "Once more."}]
        client.chat.completions.create(model=task.model, messages=msgs, tools=TOOLS, max_tokens=5)
    if task.row.get("fail") and task.index == 1:
        raise ValueError("agent broke")
    return float(task.index % 2)
'''


# The same three tool turns with the async client: one worker holds every run.
ASYNC_AGENT = '''
async def agent(task):
    client = task.async_client()  # the worker's shared connections, bound to this run
    msgs = [{"role": "user", "content": task.row["q"]}]
    for k in range(3):
        r = await client.chat.completions.create(model=task.model, messages=msgs, max_tokens=5)
        msgs.append(r.choices[0].message)
        msgs.append({"role": "tool", "tool_call_id": f"c{k}", "content": str(10 + k)})
    return 1.0
'''


# Returns None (the reward plugin scores the conversation), but run 1 its own number.
NONE_AGENT = '''
def agent(task):
    client = task.client()
    msgs = [{"role": "user", "content": task.row["q"]}]
    r = client.chat.completions.create(model=task.model, messages=msgs, max_tokens=5)
    msgs += [r.choices[0].message, {"role": "tool", "tool_call_id": "c0", "content": "42"}]
    client.chat.completions.create(model=task.model, messages=msgs, max_tokens=5)
    return 0.25 if task.index == 1 else None
'''

# 1 when the conversation it gets holds the tool's answer; sample 2 it cannot score.
SCORE_CONVERSATION = '''
def reward_fn(record):
    if record.index == 2:
        raise ValueError("cannot score this one")
    return 1.0 if "tool\\n42" in record.completion and record.finish_reason == "stop" else 0.0
'''


def _run(engine, tok, tmp_path, rows, n, on_error="fail", bounds=EnvBounds(max_turns=8), workers=2,
         source=AGENT, concurrency=1, reward_fn=None):
    from areno.rewards.pool import RewardScorer

    path = tmp_path / "agent.py"
    path.write_text(source)
    scorer = None
    if reward_fn is not None:
        (tmp_path / "reward.py").write_text(reward_fn)
        scorer = RewardScorer(str(tmp_path / "reward.py"), workers=1, on_error=on_error)
    states = [EnvState("", None, None, rows[i // n], i) for i in range(len(rows) * n)]
    trace = TracingEngine(engine)
    server = GatewayServer()
    try:
        with EnvPool(str(path), workers=workers, timeout=120, on_error=on_error, kind="agent",
                     concurrency=concurrency) as pool:
            out = rollout_agents(trace, pool, server, ChatRenderer(tok), ToolCallParser("hermes", tok), states, n,
                                 SamplingConfig(max_tokens=8, seed=3), bounds, scorer)
    finally:
        server.close()
        if scorer is not None:
            scorer.close()
    return out, trace


def assert_trained_is_sampled(trace: TracingEngine, out) -> int:
    """Every sampled segment of every trajectory is what the engine sampled for
    exactly the context before it (prompt + the trajectory so far); the pack
    trains those tokens, with their sampler log-probs, and nothing else. -> turns."""
    batch, checked = out.batch, 0
    by_context: dict[tuple, list] = {}
    for p, ids, lps in trace.requests:
        by_context.setdefault(tuple(p), []).append((ids.tolist(), lps.tolist()))
    for i in range(batch.num_responses):
        context = batch.prompt_tokens(int(batch.group_index[i])).tolist()
        start = batch.response_offsets[i]
        for m, ids in turn_segments(batch, i):
            if m == 1:
                a = start + len(context) - batch.prompt_tokens(int(batch.group_index[i])).size
                got = (ids.tolist(), batch.response_logprobs[a:a + ids.size].tolist())
                assert got in by_context.get(tuple(context), []), "a trained turn is not a sampled one"
                checked += 1
            else:
                assert (batch.response_logprobs[start + len(context) - batch.prompt_tokens(
                    int(batch.group_index[i])).size:][:ids.size] == 0).all()
            context += ids.tolist()
    pack = build_train_pack(batch, np.ones(batch.num_responses, np.float32))
    trained = pack.targets[pack.loss_mask].numpy()
    want = np.concatenate([ids for i in pack.sample_index.tolist() for m, ids in turn_segments(batch, i) if m == 1])
    assert np.array_equal(trained, want)  # observation tokens: no loss term, no gradient
    assert int(pack.loss_mask.sum()) == int(batch.response_mask.sum())
    return checked


@pytest.fixture(scope="module")
def chat(tiny_chat_path):
    from transformers import AutoTokenizer

    from areno.rollout.hf import HFEngine

    engine = HFEngine(tiny_chat_path, dtype="float32", device="cpu", max_model_len=512)
    return engine, AutoTokenizer.from_pretrained(tiny_chat_path)


def test_an_openai_client_agent_trains_exactly_the_sampled_tokens_and_a_history_edit_branches(chat, tmp_path):
    engine, tok = chat
    out, trace = _run(engine, tok, tmp_path, [{"q": "2+3?", "edit": True}, {"q": "1+1?"}], 2)
    # row 0's runs: 3 turns, then the edit drops the third and samples a new one; row 1's: 3 turns
    assert out.turns.tolist() == [3, 3, 3, 3]
    assert out.branches == 2 and out.dropped_turns == 2 and out.calls == 14
    assert assert_trained_is_sampled(trace, out) == 12
    assert len(trace.requests) == 14  # every call sampled one turn; the dropped ones are not trained
    m = out.metrics()
    assert list(m) == list(ENV_METRICS) + list(AGENT_METRICS) and m["agent/branches"] == 2
    assert out.scored.rewards.tolist() == [0, 1, 0, 1]
    # the group's prompt is the first call's rendered conversation, whole
    assert tok.decode(out.batch.prompt_tokens(0)).endswith("2+3?<|im_end|>\n<|im_start|>assistant\n")
    text = tok.decode(out.batch.response_tokens(0))
    assert "<|im_start|>tool\n10<|im_end|>" in text and "Once more." in text and "tool\n12" not in text


def test_a_failing_agent_is_the_fail_policys(chat, tmp_path):
    engine, tok = chat
    out, _ = _run(engine, tok, tmp_path, [{"q": "2+3?", "fail": True}], 2, on_error="zero")
    assert out.scored.counts.errors == 1 and out.scored.counts.zeroed == 1
    assert out.scored.rewards.tolist() == [0.0, 0.0] and out.scored.valid.all()
    with pytest.raises(RewardError, match="agent broke"):
        _run(engine, tok, tmp_path, [{"q": "2+3?", "fail": True}], 2)


def test_a_second_call_of_a_run_while_one_waits_is_refused(chat, tmp_path):
    engine, tok = chat
    out, trace = _run(engine, tok, tmp_path, [{"q": "2+3?", "parallel": True}], 2)
    assert out.scored.rewards.tolist() == [1.0, 0.0] and out.turns.tolist() == [1, 1] and out.refused == 1


def test_one_worker_runs_every_async_agent_at_once_and_each_turn_is_one_generate_call(chat, tmp_path):
    """--agent-concurrency 4 on one worker: the four runs are in flight together,
    so under the turns schedule each of their three turns is one generate call
    of all four (run one at a time, that would be twelve calls)."""
    engine, tok = chat
    out, trace = _run(engine, tok, tmp_path, [{"q": "2+3?"}, {"q": "1+1?"}], 2, workers=1,
                      source=ASYNC_AGENT, concurrency=4)
    assert out.turns.tolist() == [3, 3, 3, 3] and out.scored.rewards.tolist() == [1, 1, 1, 1]
    assert out.rounds == 3 and len(trace.requests) == 12
    assert assert_trained_is_sampled(trace, out) == 12


def test_an_agent_that_returns_none_is_scored_on_its_conversation_by_the_reward_plugin(chat, tmp_path):
    """agent() -> None with --reward-fn-path: the plugin gets the final conversation
    (the tool's answer in it); a number still wins; the plugin's failure is
    --on-reward-error's. Without a reward plugin None is the agent's error."""
    engine, tok = chat
    rows = [{"q": "2+3?"}, {"q": "1+1?"}]
    out, _ = _run(engine, tok, tmp_path, rows, 2, on_error="zero", source=NONE_AGENT,
                  reward_fn=SCORE_CONVERSATION)
    assert out.turns.tolist() == [2, 2, 2, 2]
    assert out.scored.rewards.tolist() == [1.0, 0.25, 0.0, 1.0]
    assert out.scored.counts.errors == 1 and out.scored.counts.zeroed == 1
    assert "cannot score this one" in out.scored.messages[0]
    with pytest.raises(RewardError, match=r"agent returned None, not a reward \(a number or None with "
                                          r"--reward-fn-path\)"):
        _run(engine, tok, tmp_path, rows[:1], 2, source=NONE_AGENT)


def test_the_turn_limit_answers_empty_and_ends_the_trajectory_as_length(chat, tmp_path):
    engine, tok = chat
    out, trace = _run(engine, tok, tmp_path, [{"q": "2+3?"}], 2, bounds=EnvBounds(max_turns=2))
    assert out.turns.tolist() == [2, 2] and out.turn_limit == 2 and out.refused >= 2
    assert out.batch.finish_reason.tolist() == [1, 1]  # length
    assert assert_trained_is_sampled(trace, out) == 4


@pytest.mark.realmodel
@pytest.mark.parametrize("kind", ["hf", "vllm"])
def test_trained_tokens_are_the_sampled_tokens_on_smollm2(smol_path, tmp_path, kind):
    """The same agent on SmolLM2's own chat template, through both engines."""
    from transformers import AutoTokenizer

    from tests.test_env_realmodel import _engine

    tok = AutoTokenizer.from_pretrained(smol_path)
    engine = _engine(kind, smol_path)
    try:
        out, trace = _run(engine, tok, tmp_path, [{"q": "What is 2+3?", "edit": True}], 2)
    finally:
        engine.shutdown()
    assert out.turns.tolist() == [3, 3] and out.branches == 2
    assert assert_trained_is_sampled(trace, out) == 6
    assert "SmolLM" not in tok.decode(out.batch.prompt_tokens(0))  # the agent's own system turn


def test_a_tasks_clients_are_bound_to_its_run_and_share_the_workers_connections():
    """task.client() / task.async_client(): each run's own base URL and key, one
    connection pool per worker (per event loop for the async one), no retries."""
    import asyncio

    from areno.gateway.plugin import AgentTask

    tasks = [AgentTask("1+1=", None, None, {}, i, f"http://127.0.0.1:9/runs/k{i}/v1", f"k{i}") for i in range(2)]
    a, b = (t.client() for t in tasks)
    assert (str(a.base_url), a.api_key, a.max_retries) == ("http://127.0.0.1:9/runs/k0/v1/", "k0", 0)
    assert str(b.base_url).endswith("/runs/k1/v1/") and b.api_key == "k1"
    assert a._client is b._client  # one httpx pool

    async def both():
        return [t.async_client() for t in tasks]

    first, again = asyncio.run(both()), asyncio.run(both())
    assert first[0]._client is first[1]._client and first[1].api_key == "k1"
    assert again[0]._client is not first[0]._client  # another loop, another pool
