"""The multi-turn rollout: every trajectory goes generate -> env -> generate on
its own, and the engines generate whichever trajectories are ready while the
environment workers step the others (docs/DESIGN.md, "Multi-turn environments").

The engine is anything with `generate_stream` (a RolloutEngine, or the loop's
EngineView over the ranks' engines): each ready trajectory is one request of
n = 1 whose prompt is its prompt and its trajectory so far, token for token.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from collections.abc import Callable
from typing import Any, Literal

import numpy as np

from areno.data.tasks import resolve_plugin_path
from areno.data.tokenizer import load_tokenizer
from areno.envs.halted import MID_TURN, NEXT_TURN, RESET_DUE, STEP_DUE, Halted
from areno.envs.plugin import EnvState
from areno.envs.pool import EnvPool, Outcome
from areno.envs.trajectory import ObservationFormat, Trajectories
from areno.metrics import env_metrics
from areno.rewards.plugin import RewardCounts, RewardResult
from areno.rollout.batch import (FINISH_ABORT, FINISH_LENGTH, FINISH_STOP, RolloutBatch, csr_take,
                                 decode_completions, decode_one)
from areno.rollout.engine import SamplingConfig, prompt_seeds

EnvReward = Literal["sum", "last"]


@dataclass(frozen=True)
class EnvBounds:
    """max_turns: completions per trajectory (>= 1). max_tokens: response tokens
    (sampled + observation) per trajectory; 0: the engine's context less the prompt.
    reward: a trajectory's reward, the sum of its steps' rewards or the last one's.
    eager: see run(); False (turns) makes the rollout a function of the seed alone."""

    max_turns: int = 4
    max_tokens: int = 0
    reward: EnvReward = "sum"
    eager: bool = False  # --env-schedule eager: generate a trajectory as soon as its env answers


@dataclass
class EnvRollout:
    """A multi-turn rollout: the batch (with response_mask), its rewards, what it cost."""

    batch: RolloutBatch
    scored: RewardResult
    turns: np.ndarray  # [N] int64 completions per trajectory
    turn_limit: int = 0  # trajectories ended by max_turns
    token_limit: int = 0  # trajectories ended by the token budget
    long_observations: int = 0  # of those, by an observation longer than the whole room left
    engine_idle_s: float = 0.0  # waiting on environments with nothing to generate
    generate_s: float = 0.0  # inside the engines' generate calls
    rounds: int = 0  # generate calls
    completions: list[list[str]] = field(default_factory=list)  # [N] each turn's text (display)
    observations: list[list[str]] = field(default_factory=list)  # [N] each observation's text
    positions: np.ndarray | None = None  # [g] int64 a streamed part's groups (None: all, in order)

    def metrics(self) -> dict[str, float]:
        return env_metrics(float(self.turns.mean()) if self.turns.size else 0.0, self.turn_limit,
                           self.token_limit, self.long_observations, self.engine_idle_s, self.generate_s,
                           self.rounds)


class _Driver:
    """The books of one multi-turn rollout (see rollout_multiturn)."""

    def __init__(self, engine: Any, pool: EnvPool, tokenizer: Any, fmt: ObservationFormat,
                 traj: Trajectories, states: list[EnvState], sampling: SamplingConfig,
                 bounds: EnvBounds, budget: np.ndarray, emit: Callable[[EnvRollout], None] | None = None) -> None:
        self.engine, self.pool, self.tokenizer, self.fmt, self.emit = engine, pool, tokenizer, fmt, emit
        self.traj, self.states, self.sampling, self.bounds, self.budget = traj, states, sampling, bounds, budget
        n = len(traj)
        self.reward = np.zeros(n, np.float64)
        self.valid = np.ones(n, bool)
        self.finish = np.full(n, FINISH_STOP, np.uint8)
        self.cut = np.zeros(n, bool)  # the last turn hit its token cap (--mask-overlong)
        self.ended = np.zeros(n, bool)  # the trajectory has ended (settle)
        self.sent = np.zeros(int(traj.group_index.max(initial=-1)) + 1, bool)  # groups emitted
        self.reported = (RewardCounts(), 0, EnvRollout(None, None, traj.turns))  # type: ignore[arg-type]
        self.counts, self.messages = RewardCounts(), []
        self.pending: dict[int, tuple[int, bool]] = {}  # ticket -> (trajectory, is a step)
        self.last_token = np.zeros(n, np.int64)
        self.halted = np.zeros(n, np.uint8)  # a Ctrl-C's halt ended it: how (envs/halted.py), 0: not
        self.turn_tokens = np.zeros(n, np.int64)  # tokens its turn in progress has (a continued one: resume)
        self.restored: list[Halted | None] = [None] * n  # its books as saved: it goes on where it stopped (resume)
        self.ready: list[int] = []
        self.out = EnvRollout(batch=None, scored=None, turns=traj.turns,  # type: ignore[arg-type]
                              completions=[[] for _ in range(n)], observations=[[] for _ in range(n)])

    def run(self) -> EnvRollout:
        self.start()
        return self.loop()

    def loop(self) -> EnvRollout:
        """Until every trajectory has ended -> the rollout."""
        # turns: wait for every env call out, then generate every ready trajectory in
        # index order, so which requests share a generate call (and their seeds) never
        # depends on when calls return. eager: generate whatever is ready as soon as
        # the engines are free (the engines wait only when every trajectory waits).
        while self.active:
            self.harvest(wait=not self.ready, every=not self.bounds.eager)
            self.stream()
            self.generate_ready()
        return self.result()

    def start(self) -> None:
        """Every trajectory's env reset goes out; a restored one (envs/resume.py) is
        ready for its turn, or has its due step (or reset) asked again."""
        for i, s in enumerate(self.states):
            r = self.restored[i]
            if r is not None and r.kind == STEP_DUE:
                self.out.completions[i].append(r.completion)
                self.pending[self.pool.submit(s, r.completion)] = (i, True)
            elif r is not None and r.kind != RESET_DUE:
                self.ready.append(i)
            else:
                self.pending[self.pool.submit(s, None)] = (i, False)

    @property
    def active(self) -> bool:
        """Some trajectory waits on its env or is ready for its next turn."""
        return bool(self.pending or self.ready)

    def generate_ready(self) -> None:
        """The next turn of every ready trajectory, in index order."""
        if self.ready:
            idx, self.ready = np.sort(np.array(self.ready, np.int64)), []
            self.generate(idx)

    def result(self) -> EnvRollout:
        """Every trajectory ended: the rest streamed, the whole rollout."""
        self.stream()
        self.out.batch = self.traj.to_batch(self.finish, self.cut)
        self.out.scored = RewardResult(self.reward.astype(np.float32), self.valid, self.counts,
                                       tuple(self.messages[:5]), self.halt_records(np.arange(self.valid.size)))
        return self.out

    def stream(self) -> None:
        """emit: the groups whose every trajectory has ended, not sent yet, as one
        part (an EnvRollout with their positions; its counts and seconds those
        since the last part), so a slow trajectory holds back its own group only."""
        if self.emit is None:
            return
        open_ = np.bincount(self.traj.group_index, weights=~self.ended, minlength=self.sent.size)
        groups = np.flatnonzero((open_ == 0) & ~self.sent)
        if not groups.size:
            return
        self.sent[groups] = True
        sub, resp = self.traj.to_batch(self.finish, self.cut).take_groups(groups)
        counts, n_msg, last = self.reported
        delta = {f: getattr(self.out, f) - getattr(last, f) for f in
                 ("turn_limit", "token_limit", "long_observations", "engine_idle_s", "generate_s", "rounds")}
        self.reported = (self.counts, len(self.messages), replace(self.out))
        self.emit(EnvRollout(sub, RewardResult(self.reward[resp].astype(np.float32), self.valid[resp],
                                               self.counts - counts, tuple(self.messages[n_msg:][:5]),
                                               self.halt_records(resp)),
                             self.traj.turns[resp].copy(), positions=groups, **delta))

    def halt_records(self, resp: np.ndarray) -> list | None:
        """Trajectories resp's Halted records ([m], None where not halted), None when none was."""
        if not self.halted[resp].any():
            return None
        return [Halted(int(self.halted[i]), int(self.traj.turns[i]), int(self.turn_tokens[i]), self.states[i],
                       self.out.completions[i][-1] if self.halted[i] == STEP_DUE else None)
                if self.halted[i] else None for i in resp.tolist()]

    def generate(self, idx: np.ndarray) -> None:
        """One turn of trajectories idx; each finished one goes to its env at once."""
        ids, offsets = self.traj.context(idx)
        room = np.minimum(self.budget[idx] - self.traj.length[idx], self.engine.max_model_len - np.diff(offsets))
        cap = np.minimum(np.maximum(self.sampling.max_tokens - self.turn_tokens[idx], 1), room)
        t0 = time.perf_counter()
        for c in np.unique(cap).tolist():  # one request set per token cap (one but near the budget)
            sub = np.flatnonzero(cap == c)
            seed = None if self.sampling.seed is None else int(prompt_seeds(self.sampling.seed, self.out.rounds + 1)[-1])
            s = replace(self.sampling, max_tokens=int(c), seed=seed)
            self.out.rounds += 1
            sub_ids, sub_off = csr_take(ids, offsets, sub)
            for pos, part in self.engine.generate_stream(sub_ids, sub_off, 1, s, min_groups=1):
                self.take(idx[sub[pos]], part)
                if self.bounds.eager:
                    self.harvest(wait=False)
        self.out.generate_s += time.perf_counter() - t0

    def take(self, who: np.ndarray, part: RolloutBatch) -> None:
        """The turn of trajectories `who` (part's responses, in order): append, step the env."""
        texts = decode_completions(self.tokenizer, part)
        for j, i in enumerate(who.tolist()):
            a, b = part.response_offsets[j], part.response_offsets[j + 1]
            piece = (part.response_ids[a:b], part.response_logprobs[a:b],
                     None if part.token_version is None else part.token_version[a:b])
            halted = part.finish_reason[j] == FINISH_ABORT  # the engine halted it (Ctrl-C)
            if self.turn_tokens[i]:  # the rest of a turn a halt cut (envs/resume.py)
                self.traj.extend_turn(i, *piece)
            elif b > a or not halted:
                self.traj.add_turn(i, *piece)
            if b > a or not self.turn_tokens[i]:
                self.last_token[i] = part.response_ids[b - 1] if b > a else -1
            if halted:  # saved with its state; a resumed run continues it
                self.turn_tokens[i] += b - a
                self.halted[i] = MID_TURN if self.turn_tokens[i] else NEXT_TURN
                self.end(i, FINISH_ABORT)
                continue
            if self.turn_tokens[i]:  # the whole turn's text goes to the environment
                texts[j] = decode_one(self.tokenizer, self.traj.tail(i, int(self.turn_tokens[i]) + b - a))
                self.turn_tokens[i] = 0
            self.cut[i] = part.finish_reason[j] == FINISH_LENGTH
            self.out.completions[i].append(texts[j])
            st = self.states[i]
            st.turn = int(self.traj.turns[i]) - 1
            self.pending[self.pool.submit(st, texts[j])] = (i, True)

    def harvest(self, wait: bool, every: bool = False) -> None:
        """Take every finished env call (wait: for at least one first; every: for all)."""
        if not self.pending:
            return
        t0 = time.perf_counter()
        if every:
            done = list(self.pending)
            for t in done:
                self.pool.wait_any([t], timeout=None)
        else:
            done = self.pool.wait_any(list(self.pending), timeout=None if wait else 0.0)
        if wait or every:
            self.out.engine_idle_s += time.perf_counter() - t0
        for t in done:
            i, is_step = self.pending.pop(t)
            self.settle(i, is_step, self.pool.result(t))

    def settle(self, i: int, is_step: bool, o: Outcome) -> None:
        self.counts = self.counts + o.counts
        self.messages.extend(o.messages)
        if is_step:
            self.reward[i] = self.reward[i] + o.reward if self.bounds.reward == "sum" else o.reward
        if o.reply is None:  # failed under on_error zero / skip: the trajectory ends here
            self.valid[i] &= o.valid
            if not o.valid:
                self.reward[i] = np.nan
            self.end(i, FINISH_ABORT)
            return
        self.states[i].data = o.reply.data
        if o.reply.done:
            self.end(i, FINISH_STOP)
            return
        if is_step and self.traj.turns[i] >= self.bounds.max_turns:
            self.end(i, FINISH_LENGTH)
            self.out.turn_limit += 1
            return
        if is_step:
            # Room for the observation and one more sampled token, in the budget and the context.
            room = min(self.budget[i] - self.traj.length[i],
                       self.engine.max_model_len - self.traj.prompt(i).size - self.traj.length[i]) - 1
            if self.fmt.min_tokens(o.reply.observation) > room:  # refused before it is tokenized
                self.out.long_observations += 1
                self._too_long(i)
                return
            obs = self.fmt.tokens(o.reply.observation, int(self.last_token[i]))
            if obs.size > room:
                self._too_long(i)
                return
            self.traj.add_observation(i, obs)
            self.out.observations[i].append(o.reply.observation)
        self.ready.append(i)

    def _too_long(self, i: int) -> None:
        """The observation does not fit: the trajectory ends `length`, its env reward counted."""
        self.end(i, FINISH_LENGTH)
        self.out.token_limit += 1

    def end(self, i: int, finish: int) -> None:
        self.finish[i], self.ended[i] = finish, True


def rollout_multiturn(engine: Any, pool: EnvPool, tokenizer: Any, fmt: ObservationFormat,
                      prompt_ids: np.ndarray, prompt_offsets: np.ndarray, states: list[EnvState],
                      n: int, sampling: SamplingConfig, bounds: EnvBounds,
                      emit: Callable[[EnvRollout], None] | None = None) -> EnvRollout:
    """P prompts (CSR), n trajectories each (states: [P*n], trajectory i answers
    prompt i // n) -> their EnvRollout. Rewards: the env's, summed or last
    (bounds.reward); a failed env call (on_error zero/skip) ends its trajectory
    with finish_reason abort. emit: called with each part of groups as they
    end (_Driver.stream); the parts together are the EnvRollout returned."""
    return driver(engine, pool, tokenizer, fmt, prompt_ids, prompt_offsets, states, n, sampling, bounds,
                  emit).run()


def driver(engine: Any, pool: EnvPool, tokenizer: Any, fmt: ObservationFormat, prompt_ids: np.ndarray,
           prompt_offsets: np.ndarray, states: list[EnvState], n: int, sampling: SamplingConfig,
           bounds: EnvBounds, emit: Callable[[EnvRollout], None] | None = None) -> _Driver:
    """rollout_multiturn's driver, not started (envs/rounds.py runs several in one loop)."""
    P = int(np.asarray(prompt_offsets).size - 1)
    assert len(states) == P * n, (len(states), P, n)
    traj = Trajectories(prompt_ids, prompt_offsets, np.repeat(np.arange(P, dtype=np.int64), n))
    p_len = np.diff(np.asarray(prompt_offsets, np.int64))[traj.group_index]
    context_room = engine.max_model_len - p_len
    budget = context_room if bounds.max_tokens <= 0 else np.minimum(bounds.max_tokens, context_room)
    return _Driver(engine, pool, tokenizer, fmt, traj, states, sampling, bounds, budget, emit)


def env_states(rows: Any, prompts: Any, prompt_idx: np.ndarray, n: int) -> list[EnvState]:
    """One EnvState per trajectory of a step (trajectory i answers prompt i // n)."""
    row_of_prompt = prompts.row_index[prompt_idx].tolist()
    out = []
    for i in range(len(row_of_prompt) * n):
        g = i // n
        row = rows[row_of_prompt[g]]
        out.append(EnvState(prompt=prompts.texts[prompt_idx[g]], answer=row.get("answer"),
                            solutions=row.get("solutions"), row=row, index=i))
    return out


@dataclass(frozen=True)
class EpisodeSpec:
    """What a host of the driver needs besides the engine: the environment's
    workers (the reward pool's options), the tokenizer, whether observations go
    through the chat template, the bounds. Picklable: engine processes of split
    placement get it in their `episodes` command and run the driver themselves."""

    env_path: str
    workers: int
    timeout: float
    on_error: str
    tokenizer_path: str
    chat_template: bool
    bounds: EnvBounds
    agent: bool = False  # env_path is an --agent-path file: the gateway's driver (gateway/host.py)
    tool_parser: str = "hermes"  # --agent-tool-parser
    concurrency: int = 1  # --agent-concurrency
    reward_fn_path: str | None = None  # an agent's --reward-fn-path (resolved): scores its None returns


def episode_spec(cfg: Any, tokenizer_path: str) -> EpisodeSpec:
    """A run's EpisodeSpec (--env-path or --agent-path, and the options around it)."""
    agent = getattr(cfg, "agent_path", None)  # an agent is an environment too
    return EpisodeSpec(cfg.env_path or agent, cfg.reward_workers, cfg.reward_timeout, cfg.on_reward_error,
                       tokenizer_path, cfg.chat_template,
                       EnvBounds(cfg.max_turns, cfg.max_trajectory_tokens or 0, cfg.env_reward,
                                 cfg.env_schedule == "eager"),
                       agent=agent is not None and not cfg.env_path,
                       tool_parser=getattr(cfg, "agent_tool_parser", "hermes"),
                       concurrency=getattr(cfg, "agent_concurrency", 1),
                       reward_fn_path=resolve_plugin_path(cfg.reward_fn_path) if agent and cfg.reward_fn_path
                       else None)


def observation_format(tokenizer: Any, chat_template: bool) -> ObservationFormat:
    eos = getattr(tokenizer, "eos_token_id", None)
    return ObservationFormat(tokenizer, chat_template, () if eos is None else (int(eos),))


class EpisodeHost:
    """The driver's surroundings where it runs away from the controller (an
    engine process): the environment pool and tokenizer, made at the first
    episodes command and kept for the next ones."""

    def __init__(self) -> None:
        self.spec: EpisodeSpec | None = None
        self.pool: EnvPool | None = None
        self.tokenizer: Any = None
        self.fmt: ObservationFormat | None = None

    def run(self, engine: Any, spec: EpisodeSpec, ids: np.ndarray, offsets: np.ndarray,
            states: list[EnvState], n: int, sampling: SamplingConfig,
            emit: Callable[[EnvRollout], None] | None = None) -> EnvRollout:
        return self.driver(engine, spec, ids, offsets, states, n, sampling, emit).run()

    def driver(self, engine: Any, spec: EpisodeSpec, ids: np.ndarray, offsets: np.ndarray,
               states: list[EnvState], n: int, sampling: SamplingConfig,
               emit: Callable[[EnvRollout], None] | None = None) -> _Driver:
        """The driver of one round (not started), over this host's pool and tokenizer."""
        if spec != self.spec:
            self.close()
            self.tokenizer = load_tokenizer(spec.tokenizer_path)
            self.fmt = observation_format(self.tokenizer, spec.chat_template)
            self.pool = EnvPool(spec.env_path, workers=spec.workers, timeout=spec.timeout, on_error=spec.on_error)
            self.spec = spec
        return driver(engine, self.pool, self.tokenizer, self.fmt, ids, offsets, states, n, sampling,
                      spec.bounds, emit)

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()
        self.pool = self.spec = None
