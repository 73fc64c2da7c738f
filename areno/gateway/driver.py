"""The agent rollout: every trajectory is one agent run in a worker process,
talking to the gateway; the driver's thread owns the engine and the
trajectories, and answers the runs' calls with generated turns.

An agent is an environment whose observations come over HTTP: a call's new
messages are the observation (conversation.AgentTrajectory lays them onto the
sampled tokens), and its answer is the next sampled turn. Schedules as the env
driver's (--env-schedule): `turns` waits until every run still going has a
call waiting, then generates them together in trajectory order (a seeded run
with deterministic agents repeats); `eager` generates whatever waits as soon as
the engines are free.
"""

from __future__ import annotations

import queue
import secrets
import threading
import time
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from areno.envs.driver import EnvBounds, EnvRollout
from areno.envs.plugin import EnvState
from areno.envs.pool import EnvPool
from areno.gateway.app import MODEL_NAME, Call, GatewayError, GatewayServer, error_body
from areno.gateway.conversation import AgentTrajectory, ChatRenderer, common_prefix
from areno.gateway.plugin import SCORE_LATER, AgentTask
from areno.gateway.tools import ToolCallParser
from areno.metrics import agent_metrics
from areno.rewards.plugin import RewardCounts, RewardRecord, RewardResult
from areno.rollout.batch import (FINISH_ABORT, FINISH_LENGTH, FINISH_REASONS, FINISH_STOP, RolloutBatch,
                                 offsets_from_lengths)
from areno.rollout.engine import SamplingConfig, prompt_seeds

_FINISH = {FINISH_STOP: "stop", FINISH_LENGTH: "length", FINISH_ABORT: "stop"}


@dataclass
class AgentRollout(EnvRollout):
    """An EnvRollout with the gateway's counts (metrics.AGENT_METRICS)."""

    calls: int = 0
    branches: int = 0
    dropped_turns: int = 0
    refused: int = 0  # calls answered without sampling (limits) or refused (400)
    sampled: list = field(default_factory=list)  # [N] each turn's sampled ids, as the engine gave them

    def metrics(self) -> dict[str, float]:
        return super().metrics() | agent_metrics(self.calls, self.branches, self.dropped_turns, self.refused)


@dataclass
class _Waiting:
    call: Call
    run: int
    cap: int  # max tokens of this turn


class AgentDriver:
    """The books of one agent rollout (see rollout_agents)."""

    def __init__(self, engine: Any, pool: EnvPool, server: GatewayServer, renderer: ChatRenderer,
                 parser: ToolCallParser, states: list[EnvState], sampling: SamplingConfig,
                 bounds: EnvBounds, budget: int, group_index: np.ndarray, scorer: Any = None) -> None:
        self.groups, self.scorer = group_index, scorer  # scorer: --reward-fn-path's, for None returns
        self.engine, self.pool, self.server, self.renderer, self.parser = engine, pool, server, renderer, parser
        self.states, self.sampling, self.bounds, self.budget = states, sampling, bounds, budget
        n = len(states)
        self.traj = [AgentTrajectory(renderer) for _ in range(n)]
        self.keys = [secrets.token_hex(12) for _ in range(n)]
        self.run_of = {k: i for i, k in enumerate(self.keys)}
        self.reward = np.zeros(n, np.float64)
        self.valid = np.ones(n, bool)
        self.finish = np.full(n, FINISH_STOP, np.uint8)
        self.busy: set[int] = set()  # runs with a call waiting for its turn
        self.limited = np.zeros(n, bool)  # a turn or token limit ended it: calls answered empty
        self.cut = np.zeros(n, bool)
        self.later = np.zeros(n, bool)  # agent() returned None: the reward plugin scores the conversation
        self.counts, self.messages = RewardCounts(), []
        self.events: "queue.Queue[tuple[str, Any]]" = queue.Queue()
        self.out = AgentRollout(batch=None, scored=None, turns=np.zeros(n, np.int64),  # type: ignore[arg-type]
                                completions=[[] for _ in range(n)], observations=[[] for _ in range(n)],
                                sampled=[[] for _ in range(n)])

    def run(self) -> AgentRollout:
        self.server.keys.update(self.keys)
        tickets = {}
        for i, s in enumerate(self.states):
            task = AgentTask(s.prompt, s.answer, s.solutions, s.row, s.index, self.server.base_url(self.keys[i]),
                             self.keys[i], MODEL_NAME, reward_fn=self.scorer is not None)
            tickets[self.pool.submit_call(task)] = i
        stop = threading.Event()
        watcher = threading.Thread(target=self._watch, args=(list(tickets), stop), daemon=True,
                                   name="areno-agent-watch")
        forward = threading.Thread(target=self._forward, args=(stop,), daemon=True, name="areno-agent-calls")
        watcher.start()
        forward.start()
        try:
            self._loop(tickets)
        finally:
            stop.set()
            self.server.keys.difference_update(self.keys)
            watcher.join(timeout=2.0)
            forward.join(timeout=2.0)
        return self._finish()

    def _watch(self, tickets: list[int], stop: threading.Event) -> None:
        """Post ("done", ticket) as agent runs end (pool.wait_any wakes on each)."""
        while tickets and not stop.is_set():
            for t in self.pool.wait_any(tickets, timeout=0.2):
                tickets.remove(t)
                self.events.put(("done", t))

    def _forward(self, stop: threading.Event) -> None:
        """Move the gateway's calls into the driver's one event queue."""
        while not stop.is_set():
            try:
                self.events.put(("call", self.server.calls.get(timeout=0.2)))
            except queue.Empty:
                pass

    def _loop(self, tickets: dict[int, int]) -> None:
        live, ready = set(tickets.values()), []
        while live:
            t0 = time.perf_counter()
            kind, x = self.events.get()
            self.out.engine_idle_s += time.perf_counter() - t0
            while True:
                if kind == "done":
                    i = tickets.pop(x)
                    live.discard(i)
                    self._settle(i, self.pool.result(x))
                else:
                    w = self._take(x)
                    if w is not None:
                        ready.append(w)
                try:
                    kind, x = self.events.get_nowait()
                except queue.Empty:
                    break
            # turns: generate once every run in flight waits on a call. At most the pool's
            # capacity runs at once (workers x --agent-concurrency for an async agent, workers
            # for a sync one); the rest are queued.
            in_flight = min(len(live), self.pool.scorer.capacity)
            if ready and (self.bounds.eager or len({w.run for w in ready}) >= in_flight):
                ready.sort(key=lambda w: w.run)
                self._generate(ready)
                ready = []

    def _take(self, call: Call) -> _Waiting | None:
        """A call -> a turn to generate, or answered at once (a limit, a bad request)."""
        i = self.run_of.get(call.key)
        if i is None:  # a key of a rollout already over
            call.reply(401, error_body("this agent run is over", "authentication_error"))
            return None
        self.out.calls += 1
        try:
            return self._prepare(i, call)
        except GatewayError as e:
            self.out.refused += 1
            call.reply(e.status, error_body(str(e)))
        except Exception as e:  # noqa: BLE001 - a template that cannot render the request
            self.out.refused += 1
            call.reply(400, error_body(f"cannot render the request: {type(e).__name__}: {e}"))
        return None

    def _prepare(self, i: int, call: Call) -> _Waiting | None:
        b, tr = call.body, self.traj[i]
        if int(b.get("n", 1) or 1) != 1:
            raise GatewayError(400, "n must be 1: each agent call samples one turn of its trajectory")
        if i in self.busy:  # one trajectory, one turn at a time: a second call would fork it
            raise GatewayError(409, "this agent run already has a call waiting: one call at a time per run "
                                    "(each run is one trajectory; start a run per conversation)")
        if self.limited[i]:
            self.out.refused += 1
            call.reply(200, self._response(call, "", [], "length", 0))
            return None
        if call.kind == "chat":
            if not isinstance(b.get("messages"), list) or not b["messages"]:
                raise GatewayError(400, "messages must be a non-empty list")
            ext = tr.request(b["messages"], b.get("tools"))
        else:
            prompt = b.get("prompt")
            if not isinstance(prompt, str):
                raise GatewayError(400, "prompt must be one string (a list of prompts is n > 1)")
            ext = tr.request_text(prompt)
        if ext.observation.size and not ext.rebased:
            self.out.observations[i].append(self.renderer.tokenizer.decode(ext.observation))
        room = min(self.budget - tr.length, self.engine.max_model_len - tr.context().size)
        if tr.turns >= self.bounds.max_turns or room < 1:
            self._limit(i, token=room < 1)
            self.out.refused += 1
            call.reply(200, self._response(call, "", [], "length", 0))
            return None
        asked = b.get("max_completion_tokens") or b.get("max_tokens") or self.sampling.max_tokens
        self.busy.add(i)
        return _Waiting(call, i, int(max(1, min(int(asked), self.sampling.max_tokens, room))))

    def _limit(self, i: int, token: bool) -> None:
        self.limited[i] = True
        self.finish[i] = FINISH_LENGTH
        self.out.token_limit += token
        self.out.turn_limit += not token

    def _generate(self, ready: list[_Waiting]) -> None:
        """One turn of every waiting call, one engine call per token cap."""
        t0 = time.perf_counter()
        caps = np.array([w.cap for w in ready])
        for c in np.unique(caps).tolist():
            sub = [w for w in ready if w.cap == c]
            ids = [self.traj[w.run].context() for w in sub]
            flat = np.concatenate(ids).astype(np.int32)
            off = offsets_from_lengths(np.array([a.size for a in ids], np.int64))
            seed = self.sampling.seed  # each generate call its own stream, as the env driver's
            seed = None if seed is None else int(prompt_seeds(seed, self.out.rounds + 1)[-1])
            s = replace(self.sampling, max_tokens=int(c), seed=seed)
            self.out.rounds += 1
            for pos, part in self.engine.generate_stream(flat, off, 1, s, min_groups=1):
                for j, p in enumerate(np.asarray(pos).tolist()):
                    self._answer(sub[p], part, j)
        self.out.generate_s += time.perf_counter() - t0

    def _answer(self, w: _Waiting, part: RolloutBatch, j: int) -> None:
        """Record the sampled turn on its trajectory and answer the call."""
        a, b = part.response_offsets[j], part.response_offsets[j + 1]
        ids, lps = part.response_ids[a:b].copy(), part.response_logprobs[a:b].copy()
        i, tr, body = w.run, self.traj[w.run], w.call.body
        self.busy.discard(i)
        eos = getattr(self.renderer.tokenizer, "eos_token_id", None)
        stopped = bool(ids.size) and eos is not None and int(ids[-1]) == int(eos)
        text = self.renderer.tokenizer.decode(ids, skip_special_tokens=True)
        reason = "length" if part.finish_reason[j] == FINISH_LENGTH else "stop"
        self.cut[i] = reason == "length"
        if w.call.kind == "chat":
            content, calls = self.parser.parse(text, body.get("tools"), f"call_{i}_{tr.turns}")
            reply = {"role": "assistant", "content": content}
            if calls:
                reply["tool_calls"] = calls
            tr.answer(body["messages"], body.get("tools"), reply, ids, lps, stopped)
        else:
            calls = []
            tr.answer_text(body["prompt"], text, ids, lps)
        self.out.sampled[i].append(ids)
        self.out.completions[i].append(text)
        finish = "tool_calls" if calls and reason == "stop" else reason
        shown = text if w.call.kind != "chat" else content
        w.call.reply(200, self._response(w.call, shown, calls, finish, int(ids.size),
                                         int(tr.context().size) - int(ids.size)))

    def _response(self, call: Call, text: str | None, calls: list, finish: str, n_out: int,
                  n_in: int = 0) -> dict:
        usage = {"prompt_tokens": n_in, "completion_tokens": n_out, "total_tokens": n_in + n_out}
        head = {"id": f"areno-{secrets.token_hex(6)}", "created": int(time.time()), "model": MODEL_NAME,
                "usage": usage}
        if call.kind == "chat":
            msg: dict = {"role": "assistant", "content": text}
            if calls:
                msg["tool_calls"] = calls
            return head | {"object": "chat.completion", "choices": [
                {"index": 0, "message": msg, "finish_reason": finish, "logprobs": None}]}
        return head | {"object": "text_completion", "choices": [
            {"index": 0, "text": text or "", "finish_reason": finish, "logprobs": None}]}

    def _settle(self, i: int, o: Any) -> None:
        """An agent run ended: its reward (or its failure under on_error zero/skip)."""
        self.counts = self.counts + o.counts
        self.messages.extend(o.messages)
        self.reward[i] = o.reward
        self.later[i] = o.reply == SCORE_LATER
        if o.counts.failures:
            self.valid[i] &= o.valid
            self.finish[i] = FINISH_ABORT
        if not self.traj[i].turns:  # no turn sampled: nothing to train on
            self.valid[i] = False
            self.reward[i] = np.nan

    def _finish(self) -> AgentRollout:
        n, out = len(self.traj), self.out
        out.turns = np.array([t.turns for t in self.traj], np.int64)
        out.branches = sum(t.branches for t in self.traj)
        out.dropped_turns = sum(t.dropped_turns for t in self.traj)
        out.batch, exact = trajectories_batch(self.traj, self.groups, self.finish, self.cut)
        self.valid &= exact
        self.reward[~exact] = np.nan
        self._score_later(out.batch)
        out.scored = RewardResult(self.reward.astype(np.float32), self.valid, self.counts,
                                  tuple(self.messages[:5]))
        assert out.batch.num_responses == n
        return out


    def _score_later(self, batch: RolloutBatch) -> None:
        """The runs whose agent() returned None, scored by --reward-fn-path on their
        final conversation: the row's prompt, and as the completion the whole
        trajectory after the group's prompt as text (sampled turns and observations,
        special tokens dropped), so the answer the agent ended on is its end. Its
        failures follow --on-reward-error as a single-turn reward's (fail raises)."""
        todo = np.flatnonzero(self.later & self.valid)
        if not todo.size:
            return
        tok, st = self.renderer.tokenizer, self.states
        lengths, reasons = batch.response_lengths, batch.finish_reason
        records = [RewardRecord(prompt=st[i].prompt, completion=tok.decode(batch.response_tokens(i),
                                                                           skip_special_tokens=True),
                                answer=st[i].answer, solutions=st[i].solutions, row=st[i].row,
                                num_tokens=int(lengths[i]), finish_reason=FINISH_REASONS[int(reasons[i])],
                                index=st[i].index) for i in todo.tolist()]
        r = self.scorer.score(records)
        self.reward[todo] = r.rewards
        self.valid[todo] &= r.valid
        self.counts = self.counts + r.counts
        self.messages.extend(r.messages)


def trajectories_batch(traj: list[AgentTrajectory], group_index: np.ndarray, finish: np.ndarray,
                       cut: np.ndarray) -> tuple[RolloutBatch, np.ndarray]:
    """The agent runs as one RolloutBatch: each group's prompt is the longest
    token prefix its runs' bases share (a group's runs usually send the same first
    conversation: then it is all of it); the rest of a base leads its response
    as observation tokens (mask 0), then the sampled and observation segments.
    -> (batch, exact [N] bool): False for a run whose base does not start with its
    group's prompt (runs that disagree on the very first token; the prompt must
    be one token at least), which would train on a context the engine never saw."""
    groups = int(group_index.max()) + 1 if group_index.size else 0
    prompts, resp = [], []
    exact = np.ones(len(traj), bool)
    for g in range(groups):
        members = np.flatnonzero(group_index == g).tolist()
        bases = [traj[i].base for i in members if traj[i].base.size]
        keep = max(1, common_prefix(bases)) if bases else 1
        head = bases[0][:keep] if bases else np.zeros(1, np.int32)  # a group with no call: never trained
        prompts.append(head)
        for i in members:
            exact[i] = traj[i].base.size >= keep and np.array_equal(traj[i].base[:keep], head)
            rest = traj[i].base[keep:]  # empty for a run that made no call
            ids, lp, m = traj[i].arrays()
            resp.append((np.concatenate([rest, ids]), np.concatenate([np.zeros(rest.size, np.float32), lp]),
                         np.concatenate([np.zeros(rest.size, np.uint8), m])))
    order = np.argsort(group_index, kind="stable")
    ordered = [resp[k] for k in np.argsort(order, kind="stable")]
    cat = lambda k, dt: np.concatenate([r[k] for r in ordered]).astype(dt) if ordered else np.zeros(0, dt)  # noqa: E731
    return RolloutBatch(
        prompt_ids=np.concatenate(prompts).astype(np.int32) if prompts else np.zeros(0, np.int32),
        prompt_offsets=offsets_from_lengths(np.array([p.size for p in prompts], np.int64)),
        response_ids=cat(0, np.int32),
        response_offsets=offsets_from_lengths(np.array([r[0].size for r in ordered], np.int64)),
        response_logprobs=cat(1, np.float32), group_index=np.asarray(group_index, np.int64),
        finish_reason=np.asarray(finish, np.uint8), response_mask=cat(2, np.uint8),
        turn_cut=np.asarray(cut, bool)), exact


def rollout_agents(engine: Any, pool: EnvPool, server: GatewayServer, renderer: ChatRenderer,
                   parser: ToolCallParser, states: list[EnvState], n: int, sampling: SamplingConfig,
                   bounds: EnvBounds, scorer: Any = None) -> AgentRollout:
    """len(states) = P*n agent runs (run i answers prompt i // n) -> their
    AgentRollout. bounds: --max-turns (sampled turns per run), --max-trajectory-tokens
    (response tokens, observation included; 0: the engine's context), the schedule.
    A run's reward is its agent's return value; a run that failed under on_error
    zero/skip finishes abort, one that made no call is not valid. scorer: a
    RewardScorer (--reward-fn-path) for the runs whose agent returned None."""
    budget = bounds.max_tokens if bounds.max_tokens > 0 else engine.max_model_len
    group_index = np.repeat(np.arange(len(states) // n, dtype=np.int64), n)
    return AgentDriver(engine, pool, server, renderer, parser, states, sampling, bounds, budget, group_index,
                       scorer).run()
