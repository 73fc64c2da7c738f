"""Where a round of rollouts comes from: one protocol over every placement and
every kind of episode, so the scheduler (scheduler.py) never asks which.

A round is --batch-size prompts, n samples each, generated and scored: a
`dynsample.Round`. Every rollout is an episode: single-turn (a completion,
scored by the reward plugin: a one-step environment) or multi-turn (the
episode driver, envs/driver.py, stepping the environment between turns).
Where the engines live decides when a round runs:

  colocated (engines in the ranks)    the round runs when collected: the
                                      engines sleep while the ranks train,
                                      so nothing overlaps it (depth 0)
  split (engine processes)            the round is sent at start and runs
                                      while the controller does anything
                                      else; single-turn parts are decoded and
                                      scored as they come (scoring.PartScorer),
                                      multi-turn rounds run the episode driver
                                      in each engine process, beside its engine
                                      (EngineWorker.cmd_episodes), and come back
                                      scored

`Pending` is a round started and not yet collected; the scheduler holds them.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from areno.continuation import any_halted, continuation_prompts, halted, splice
from areno.data.prompts import PromptSet, select
from areno.data.sampler import batches_drawn
from areno.data.rows import RowSet
from areno.dynsample import Round
from areno.envs.driver import EpisodeSpec, env_states, observation_format, rollout_multiturn
from areno.envs.resume import continue_episodes
from areno.part_groups import arrival, groups_of_parts
from areno.rewards import RewardCounts, RewardError, RewardResult
from areno.rollout.batch import RolloutBatch
from areno.rollout.engine import SamplingConfig
from areno.scoring import PartScorer, score
from areno.timing import PhaseTimer


@dataclass(frozen=True)
class Data:
    """The rows and prompts a round draws from (the training set or the eval set)."""

    rows: RowSet
    prompts: PromptSet


class Producer:
    """The run's engines as the scheduler sees them, wherever they live: start a
    round (-> Pending: stream, wait with a deadline, collect, drop), publish the
    weights of version v, load a published version now. background: rounds run
    while the controller does other work (engine processes); else at collect."""

    def __init__(self, run: Any, episodes: EpisodeSpec | None) -> None:
        self.run, self.episodes = run, episodes
        self.background = run.engine.background  # engine processes: their rounds run while the ranks train

    def publish(self, version: int, slot: int) -> tuple[Any, dict[str, float]]:
        """The trainer's weights of `version` for the engines -> (the region engine
        processes load with their next round, None when colocated engines loaded
        and checked them now; that sync's figures)."""
        return self.run.engine.publish(slot)

    def load(self, region: Any) -> None:
        """Engine processes load a published region now, checked (before an eval)."""
        self.run.engine.load(region)

    def offer(self, region: Any, version: int, cut: int | None = None) -> None:
        """--partial-rollouts: engine processes may load a published region between
        two decode steps of the rounds they generate, and cut the due ones
        (--cut-at-deadline; EngineView.offer)."""
        self.run.engine.offer(region, version, cut)

    def halt(self) -> None:
        """--partial-rollouts, Ctrl-C: the rounds in flight (an agent's excepted) end at
        their engines' next decode step with the tokens they have (EngineView.halt)."""
        self.run.engine.halt()

    def continue_halted(self, saved: list[Any], now: int) -> None:
        """The checkpoint's rounds (scheduler Inflight: `saved` (batch, rewards), its
        tokens of `version` where the batch records none) with their halted
        samples continued now, by the engines holding version `now`: each from its
        prompt and tokens so far, up to the cap left to it, with a stream of its
        own (areno/continuation.py); a multi-turn round's halted trajectories by
        drivers of their own, every such round in one loop (envs/resume.py)."""
        episodes = []  # multi-turn: their drivers go on, all in one loop (envs/resume.py)
        for cur in saved:
            if cur.saved is None or not any_halted(*cur.saved):
                continue
            (batch, scored), sampling = cur.saved, self.run.sampling_for(1 + batches_drawn(cur.sampler_before))
            if sampling.seed is not None:  # a stream of its own
                sampling = replace(sampling, seed=int(np.random.SeedSequence([sampling.seed, 1]).generate_state(
                    1, np.uint64)[0] >> np.uint64(1)))
            if batch.response_mask is not None:
                episodes.append((cur, (batch, scored, sampling, cur.version)))
                continue
            which = np.flatnonzero(halted(batch))
            ids, offsets, budget = continuation_prompts(batch, which, sampling.max_tokens)
            cont = self.run.engine.generate(ids, offsets, 1, replace(sampling, max_tokens=int(budget.max())))
            cur.saved = (splice(batch, which, cont, budget, cur.version, now), scored)
        if episodes:
            done = continue_episodes(self.run.engine, self.episodes, [r for _, r in episodes], now)
            for (cur, _), whole in zip(episodes, done):
                cur.saved = whole

    def start(self, data: Data, prompt_idx: np.ndarray, n: int, sampling: SamplingConfig,
              region: Any = None, overlap: bool = True, version: int | None = None) -> "Pending":
        """Round of prompts `prompt_idx` of `data`, n samples each; region: the
        weights engine processes load first (None: those they hold); overlap:
        score single-turn parts as they come (--overlap-rewards); version
        (--partial-rollouts): the weights' version after region, newer ones
        offered while it runs."""
        if not self.background:
            return NowPending(self, data, prompt_idx, n, sampling, overlap)
        return SentPending(self, data, prompt_idx, n, sampling, region, overlap, version)


class Pending:
    """A round started: `collect` -> the scored Round (waits for it); `wait`,
    `batch` and `drop` serve checkpoints and interrupts."""

    prompt_idx: np.ndarray
    info: dict          # from the engines: idle_s, sync_load_s
    wait_s: float = 0.0  # how long collect waited for the engines

    def engines_done(self) -> None:
        """Wait until the engines have finished it (at once where it runs at collect)."""

    def collect(self, timer: PhaseTimer) -> Round:
        raise NotImplementedError

    def wait(self, until: float) -> bool:
        """Whole by time.monotonic() `until` (True), or not yet (False)."""
        return True

    @property
    def generating(self) -> bool:
        """Some engine still owes it a part or its final reply (here: it runs at collect)."""
        return False

    def batch(self) -> tuple[RolloutBatch, RewardResult | None]:
        """The whole batch, waited for (a checkpoint saves it), and its rewards when
        they cannot be computed again from it (an environment's)."""
        raise NotImplementedError

    def drop(self) -> None:
        """Leave it (Ctrl-C): its engines take no more commands."""

    def settle_whole(self) -> None:
        """Every group arrived, or the engines replied without some (an environment
        failed under `fail`: its error is raised here): read the engines' final
        reply now if not read yet (engine processes under --partial-rollouts,
        first_finished.py)."""


class NowPending(Pending):
    """Colocated: the round runs when collected, on the engines in the ranks."""

    def __init__(self, producer: Producer, data: Data, prompt_idx: np.ndarray, n: int,
                 sampling: SamplingConfig, overlap: bool) -> None:
        self.producer, self.data, self.prompt_idx = producer, data, prompt_idx
        self.n, self.sampling, self.overlap, self.info = n, sampling, overlap, {}

    def collect(self, timer: PhaseTimer) -> Round:
        run, data, idx = self.producer.run, self.data, self.prompt_idx
        ids, offsets = select(data.prompts, idx)
        spec = self.producer.episodes
        if spec is not None:  # multi-turn: the driver on the controller, the engines in the ranks
            states = env_states(data.rows, data.prompts, idx, self.n)
            with timer("rollout"):  # generation and the env calls overlap: one phase
                if run.agents is not None:  # agents: their calls to the gateway are the observations
                    out = run.agents.run(run.engine, states, self.n, self.sampling, spec.bounds)
                else:
                    out = rollout_multiturn(run.engine, run.envs, run.tokenizer,
                                            observation_format(run.tokenizer, spec.chat_template),
                                            ids, offsets, states, self.n, self.sampling, spec.bounds)
            return Round(idx, out.batch, out.scored, out.metrics())
        if not self.overlap:  # generate everything, decode in one call, then score
            with timer("rollout"):
                batch = run.engine.generate(ids, offsets, self.n, self.sampling)
            return Round(idx, batch, score(run, data, idx, batch, timer))
        # Every finished group goes out at once: the last part, whose scoring cannot
        # hide behind generation, stays as small as possible.
        scorer = PartScorer(run, data, idx, timer, self.n)
        with timer("rollout"):
            for pos, part in run.engine.generate_stream(ids, offsets, self.n, self.sampling, min_groups=1):
                scorer.add(pos, part)
        return Round(idx, *scorer.finish(timer))


class SentPending(Pending):
    """Split placement: sent to the engine processes at once; its parts are read
    during every wait of the controller (fleet/engines.py, PendingRollout)."""

    def __init__(self, producer: Producer, data: Data, prompt_idx: np.ndarray, n: int,
                 sampling: SamplingConfig, region: Any, overlap: bool, version: int | None = None) -> None:
        run = producer.run
        self.producer, self.data, self.prompt_idx, self.n, self.info = producer, data, prompt_idx, n, {}
        self.timer = PhaseTimer(keep_spans=True)  # its decode and rewards, wherever they ran
        ids, offsets = select(data.prompts, prompt_idx)
        episodes = None
        if producer.episodes is not None:
            self.sink: Any = EpisodeParts()
            episodes = EpisodeShare(producer.episodes, env_states(data.rows, data.prompts, prompt_idx, n), n)
        else:
            self.sink = PartScorer(run, data, prompt_idx, self.timer, n) if overlap else None
        self.pending = run.engine.start_rollout(ids, offsets, n, sampling, region, self.sink, episodes=episodes,
                                                version=version)
        self.sink = self.pending.sink
        self.whole_batch: RolloutBatch | None = None
        self.counted: set[int] = set()  # parts whose reward counts a take reported (take)

    def engines_done(self) -> None:
        """Wait for the engines; an environment's failure there (fail) is raised here."""
        if self.pending is not None:
            t0 = time.perf_counter()
            self.info = self.pending.collect()
            self.wait_s, self.pending = time.perf_counter() - t0, None
            if "reward_error" in self.info:
                raise RewardError(self.info["reward_error"])

    def collect(self, timer: PhaseTimer) -> Round:
        self.engines_done()
        if isinstance(self.sink, PartScorer):
            batch, scored = self.sink.finish(self.timer)
            extra: dict = {}
        elif isinstance(self.sink, EpisodeParts):
            batch, scored, extra = self.sink.merge_scored()
        else:
            batch = self.whole_batch or self.sink.merge()[0]
            scored, extra = score(self.producer.run, self.data, self.prompt_idx, batch, self.timer), {}
        timer.absorb(self.timer)
        return Round(self.prompt_idx, batch, scored, extra)

    def wait(self, until: float) -> bool:
        return self.pending is None or self.pending.wait(until)

    def batch(self) -> tuple[RolloutBatch, RewardResult | None]:
        self.engines_done()
        if isinstance(self.sink, EpisodeParts):
            batch, scored, _ = self.sink.merge_scored()
            return batch, scored
        self.whole_batch = self.whole_batch or self.sink.merge()[0]
        return self.whole_batch, None

    def drop(self) -> None:
        if self.pending is not None:
            self.pending.drop()

    # -- its groups one by one (--partial-rollouts: first_finished.py) ----------------
    def settle_whole(self) -> None:
        # Whole with groups missing: an environment failed (fail), its error in the reply.
        if self.pending is not None and (self.pending.whole or np.isfinite(self.arrived()).all()):
            self.engines_done()

    @property
    def generating(self) -> bool:
        """Some engine still owes it a part or its final reply."""
        return self.pending is not None and not self.pending.whole

    def arrived(self) -> np.ndarray:
        """[P] float64: when each group came complete (time.monotonic; inf: not yet)."""
        return arrival(self.sink.positions, self.sink.arrived, self.prompt_idx.size)

    def poll(self, since: float) -> None:
        """Read the parts that come within about a second (every round's); past the
        command timeout counted from `since`: BackendError."""
        if self.pending is not None:
            self.pending.poll(since)

    def take(self, groups: np.ndarray, timer: PhaseTimer) -> Round:
        """Its complete groups at positions `groups` [g] int64, scored (rewards of the
        parts they came in, waited for; plain parts: scored now), as a Round; the
        rest stay for later takes."""
        fresh = [i for i, q in enumerate(self.sink.positions) if i not in self.counted and np.isin(q, groups).any()]
        batch, scored = groups_of_parts(self.sink, groups, self.counted)
        idx = self.prompt_idx[groups]
        if scored is None:
            scored = score(self.producer.run, self.data, idx, batch, self.timer)
        # env/* of the parts it takes first (a part's counts and seconds once)
        extra = env_totals([self.sink.metrics[i] for i in fresh]) if isinstance(self.sink, EpisodeParts) else {}
        timer.absorb(self.timer, move=True)  # what it ran since the last take: decode, rewards
        return Round(idx, batch, scored, extra)


@dataclass
class EpisodeShare:
    """A multi-turn round's arguments for engine process g of E: the episode spec,
    the EnvStates of its groups' trajectories, its place (fleet/engines.py, Episodes)."""

    spec: EpisodeSpec
    states: list
    n: int

    def share(self, g: int, num_engines: int, positions: np.ndarray) -> dict:
        traj = (positions[:, None] * self.n + np.arange(self.n)).ravel()
        return {"states": [self.states[i] for i in traj.tolist()], "share": (g, num_engines)}


@dataclass
class EpisodeParts:
    """A multi-turn round's parts from the engine processes, scored there: each
    part's rewards and env/* metrics come in its message (EngineWorker.cmd_episodes)."""

    parts: list = field(default_factory=list)
    positions: list = field(default_factory=list)
    results: list = field(default_factory=list)
    metrics: list = field(default_factory=list)
    arrived: list = field(default_factory=list)  # time.monotonic() each part was kept

    def keep(self, pos: np.ndarray, part: RolloutBatch, meta: dict | None = None) -> None:
        self.parts.append(part)
        self.positions.append(pos)
        self.arrived.append(time.monotonic())
        self.results.append(RewardResult(meta["rewards"], meta["valid"], meta["counts"], meta["messages"],
                                         meta.get("halted")))  # envs/halted.py: a Ctrl-C's
        self.metrics.append((meta["env"], meta["turns"], meta["engine"]))

    def score(self, pos: np.ndarray, part: RolloutBatch) -> None:
        """Scored where it ran."""

    def result(self, i: int) -> RewardResult:
        return self.results[i]

    def merge_scored(self) -> tuple[RolloutBatch, RewardResult, dict[str, float]]:
        batch, perm = RolloutBatch.merge_parts(self.parts, self.positions)
        merged = RewardResult.concat(self.results) if self.results else \
            RewardResult(np.zeros(0, np.float32), np.zeros(0, bool), RewardCounts(), ())
        return batch, merged.take(perm), env_totals(self.metrics)


def env_totals(parts: list[tuple[dict[str, float], np.ndarray, int]]) -> dict[str, float]:
    """The env/* metrics of a round from its engines' parts (env/*, turns, engine):
    counts summed, seconds summed per engine then the slowest engine's (an
    engine streams its groups in several parts, each with the counts and seconds
    since its last), turns_mean over every trajectory."""
    if not parts:
        return {}
    out = {k: sum(m[k] for m, _, _ in parts) for k in parts[0][0]}
    turns = np.concatenate([t for _, t, _ in parts])
    out["env/turns_mean"] = float(turns.mean()) if turns.size else 0.0
    for k in ("env/engine_idle_s", "env/generate_s"):
        per_engine: dict[int, float] = {}
        for m, _, e in parts:
            per_engine[e] = per_engine.get(e, 0.0) + m[k]
        out[k] = max(per_engine.values())
    return out
