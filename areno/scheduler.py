"""The rollout scheduler: every run has one (`Rollouts`), with a depth
K = --off-policy-steps >= 0. It holds the rounds in flight, their admission,
the weight versions the engines were sent, the checkpoint of work in flight
and what an interrupt does to it. A round is --batch-size prompts generated
and scored (producers.py: single-turn or multi-turn, on engines in the ranks
or in engine processes); a step trains on one round, or with
--dynamic-sampling on as many as fill its batch with informative groups
(dynsample.fill_batch: a refill is one more round under the same admission),
or under --partial-rollouts on --batch-size groups from any round in flight:
those due, then the first to finish, taken until the filter kept enough
(first_finished.py).

One step, as the trainer runs it (docs/DESIGN.md, "The timeline of a step"):

    next_batch(step)   take the oldest round in flight (or start one now),
                       then the next ones while the filter wants more (or its
                       groups: first_finished.next_groups); each take admits
                       the rounds the trainer's version allows
    (the ranks learn)  engine processes generate the admitted rounds meanwhile
    publish(step)      the new weights: colocated engines load them now (they
                       slept while the ranks trained); engine processes get
                       them with the next round sent, never inside one (under
                       --partial-rollouts also offered to the rounds in
                       flight, loaded between decode steps:
                       fleet/inflight_loads.py); then the rounds they admit start

Colocated engines live in the ranks, so colocated runs are depth 0 and a round
runs when it is taken (producers.NowPending); K >= 1 needs engine processes.

Versions count updates: the trainer's weights are version u after u updates,
and a round sampled with version v and trained at version u has policy lag
u - v. A round is tagged with the step it serves if every step takes one round;
admission (`admitted`) starts it only when its lag at that step is <= K. A
step that takes more rounds (a refill) trains the later ones earlier than
their tag, never later, so the bound holds. It samples with the newest
published weights, decided when it is sent: which weights a round samples with
depends on the loop's order, not on timing, so a seeded run is reproducible and
a resume exact (not under --partial-rollouts: there the tokens sampled after an
offered version reached the engine carry it, and when it reached it is timing's). In steady state every round lags exactly K (0, 1, .., K, K, ..).

Why the engines queue the rounds rather than the controller holding them back
until an engine is free: the next round is there the moment one ends (no bubble
while the controller packs or scores), and its weights are fixed at admission
either way. A version's region must outlive the rounds queued before the one
that loads it: the regions rotate over K + 1 slots, so version v is rewritten by
v + K + 1, published only after the round carrying v was collected (K + 1
copies of the weights in /dev/shm).

Checkpoints: a save (periodic, or the interrupt's) waits for every round in
flight and saves each one's untrained groups (`inflight.npz`; a multi-turn
round with its environment's rewards, which cannot be computed again), so the
resumed run trains on the very samples the uninterrupted one did. An interrupt waits at
most INTERRUPT_WAIT_S for them (under --partial-rollouts, for all of them): one still generating then is dropped with
every later one, their prompts go back, and the resumed run samples them again
from the checkpoint's weights (deterministic, with a smaller lag).
"""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from areno.procs.errors import BackendError
from areno.config.offpolicy import partial_on, weight_slots
from areno.config.env import multi_turn
from areno.continuation import any_halted
from areno.envs.driver import episode_spec
from areno.dynsample import Filled, Round, fill_batch, informative_groups
from areno import first_finished
from areno.inflight import Inflight, admitted, check_oldest, lag_metrics
from areno.inflight_file import save_inflight
from areno.metrics import wait_metrics
from areno.producers import Data, Producer
from areno.rollout.batch import with_version
from areno.data.sampler import batches_drawn
from areno.scoring import score
from areno.timing import PhaseTimer

INTERRUPT_WAIT_S = 5.0  # how long a Ctrl-C waits for the rounds in flight before dropping them


class Rollouts:
    """The scheduler of a run (module docstring). `updates`: the trainer's version
    (the checkpoint's); saved: the rounds a checkpoint held in flight."""

    def __init__(self, run: Any, producer: Producer, updates: int, saved: list[Inflight] | None = None) -> None:
        self.run, self.producer, self.k = run, producer, run.cfg.off_policy_steps
        self.data = Data(run.rows, run.prompts)
        self.updates = updates
        self.engine_version = updates  # engine processes start from the checkpoint's weights
        self.published: tuple[int, Any] | None = None  # (version, WeightRegion) not sent yet
        self.inflight: list[Inflight] = list(saved or [])
        self.taken: list[Inflight] = []  # the rounds of the step in progress (put back if it is undone)
        self.updates_at_train = updates
        # --partial-rollouts: each version published is also offered to the rounds in
        # flight, which load it between decode steps (fleet/inflight_loads.py), and
        # a step trains the groups that finish first, from any round, the filter's
        # too (first_finished.py).
        self.partial = partial_on(run.cfg)
        self.halted = any(c.saved is not None and any_halted(*c.saved) for c in self.inflight)

    # -- the step ------------------------------------------------------------------
    def next_batch(self, step: int, timer: PhaseTimer) -> tuple[Filled, dict[str, float]]:
        """Step's batch: its round, or rounds until --dynamic-sampling fills it ->
        (the Filled batch, the loop's metrics: lag and waits under engine processes)."""
        cfg = self.run.cfg
        informative = None if cfg.dynamic_sampling == "off" else self.informative
        if self.halted:  # a checkpoint's samples halted mid-generation: finished first
            self.producer.continue_halted(self.inflight, self.updates)
            self.halted = False
        if self.partial:
            return first_finished.next_groups(self, step, timer, informative)
        self.taken, self.updates_at_train = [], self.updates
        if informative is None:
            filled = Filled.whole(self.take(step, timer))
        else:
            filled = fill_batch(lambda: self.take(step, timer), cfg.batch_size,
                                cfg.max_sampling_rounds, informative)
        return filled, self.loop_metrics()

    def informative(self, r: Round) -> np.ndarray:
        """[P] bool: the groups of `r` --dynamic-sampling keeps (the rewards the
        advantages see: the plugin's plus the overlong shaping)."""
        return informative_groups(r.scored.rewards + self.run.shaping(r.batch), r.scored.valid,
                                  r.batch.group_index, r.batch.num_prompts, self.run.cfg.dynamic_sampling)

    def take(self, step: int, timer: PhaseTimer) -> Round:
        """The next round of `step`: the oldest in flight, else one started now; the
        rounds its collection admits start before its outstanding rewards are
        waited for."""
        cur = self.inflight.pop(0) if self.inflight else self.start(step)
        self.taken.append(cur)  # an interrupt from here on puts it back
        if cur.round is None:
            if cur.pending is not None:
                cur.pending.engines_done()
            self.admit(step)
            if cur.saved is not None:
                batch, scored = cur.saved
                cur.round = Round(cur.prompt_idx, batch, scored if scored is not None else
                                  score(self.run, self.data, cur.prompt_idx, batch, timer))
            else:
                cur.round = cur.pending.collect(timer)
            # Every token carries its version from here on: a refill's rounds are
            # merged into one batch, and the lag is counted per token.
            cur.round = replace(cur.round, batch=with_version(cur.round.batch, cur.version))
            check_oldest(cur.round.batch, self.updates_at_train, self.k)
        return cur.round

    def publish(self, step: int, updated: bool) -> dict[str, float]:
        """After step's update (updated: an optimizer step ran): the new weights to
        the engines -> the sync's figures (colocated), and the rounds they admit
        start (engine processes: the weights go with the next one sent)."""
        synced: dict[str, float] = {}
        if updated:
            self.updates += 1
            region, synced = self.producer.publish(self.updates, self.updates % weight_slots(self.k))
            if region is not None:
                self.published = (self.updates, region)
                if self.partial:  # --cut-at-deadline: rounds of version updates - K are due now
                    self.producer.offer(region, self.updates,
                                        self.updates - self.k if self.run.cfg.cut_at_deadline else None)
            else:
                self.engine_version = self.updates
        self.taken = []
        # A step that took refills trained rounds tagged for later steps: each round
        # left serves at latest the step its place says, so the tags come down to
        # that bound (admission stays safe and keeps K rounds ahead).
        for i, cur in enumerate(self.inflight if not self.partial else []):
            cur.step = min(cur.step, step + 1 + i)
        self.admit(step + 1)
        return synced

    def loop_metrics(self) -> dict[str, float]:
        """The policy lag of every sample the step's whole rounds generated (per
        trajectory under --env-path), the waits: engine processes only (colocated:
        lag 0, no wait; --partial-rollouts: first_finished.next_groups's)."""
        if not self.producer.background:
            return {}
        pend = [c.pending for c in self.taken if c.pending is not None]
        return lag_metrics(self.updates_at_train, self.k, [c.round.batch for c in self.taken]) | \
            wait_metrics([p.wait_s for p in pend], [p.info.get("idle_s", 0.0) for p in pend])

    def admit(self, at_step: int) -> None:
        """Start every round after those in flight that is admitted while the trainer
        is at `at_step` holding self.updates updates (one update a step from here
        on: a skipped one only lowers the lag). Colocated: none (rounds run when taken)."""
        if not self.producer.background:
            return
        if self.partial:  # rounds' worth of untrained groups: the same bound as whole rounds
            nxt = at_step + first_finished.untrained_steps(self.inflight, self.run.cfg.batch_size)
        else:
            nxt = self.inflight[-1].step + 1 if self.inflight else at_step + 1
        while nxt <= self.run.total_steps and admitted(self.updates + nxt - at_step, self.newest, self.k):
            self.inflight.append(self.start(nxt))
            nxt += 1

    @property
    def newest(self) -> int:
        return self.published[0] if self.published else self.engine_version

    def take_published(self) -> Any:
        """The published region for the next round sent or load (None: the engines
        have the newest weights); from here on they count as holding its version."""
        if self.published is None:
            return None
        (self.engine_version, region), self.published = self.published, None
        return region

    def start(self, step: int) -> Inflight:
        """Draw the next batch of prompts and start it as a round tagged `step`, with
        the newest weights when the engines were not sent them yet. It samples
        with the seed of step 1 + the batches drawn before it: the step itself
        where each step draws one batch (a resume samples as the uninterrupted
        run), its own when --dynamic-sampling's refills draw more (at K >= 1 the
        rounds admitted after a refill carry tags a round already sampled with:
        publish lowers them)."""
        run = self.run
        before = run.sampler.state_dict()
        prompt_idx = run.sampler.next_batch()
        region = self.take_published()
        pending = self.producer.start(self.data, prompt_idx, run.cfg.n_samples,
                                      run.sampling_for(1 + batches_drawn(before)), region,
                                      overlap=run.cfg.overlap_rewards,
                                      version=self.engine_version if self.partial else None)
        return Inflight(step, prompt_idx, before, self.engine_version, pending)

    # -- around the loop -------------------------------------------------------------
    def ready_for_eval(self) -> None:
        """The engines free and holding the newest weights: every round in flight is
        waited for (and kept for its step), the published weights loaded."""
        for cur in self.inflight:
            if cur.pending is not None:
                cur.pending.engines_done()
        if (region := self.take_published()) is not None:
            self.producer.load(region)

    def run_round(self, data: Data, n: int, sampling: Any) -> Round:
        """Every prompt of `data`, n samples each, now, with the weights the engines
        hold (eval: called after ready_for_eval)."""
        idx = np.arange(len(data.prompts), dtype=np.int64)
        return self.producer.start(data, idx, n, sampling, None, overlap=False).collect(PhaseTimer())

    def put_back(self) -> None:
        """The step in progress did not update the weights (interrupted): its rounds
        are taken again by the next step (colocated: its prompts drawn again)."""
        if self.partial:
            return first_finished.put_back(self)
        taken, self.taken = self.taken, []
        if not taken:
            return
        if self.producer.background:
            self.inflight[:0] = taken
        else:
            self.run.sampler.load_state_dict(taken[0].sampler_before)

    def settle_interrupt(self, after_step: int, wait_s: float | None = None) -> dict | None:
        """After an interrupt, with step `after_step` the last one finished: keep the
        rounds in flight that are whole within wait_s (a second Ctrl-C: none more),
        drop the others (left to run; their engines take no more commands) -> the
        sampler state before the first one dropped, or None when none was.
        wait_s None: INTERRUPT_WAIT_S, and under --partial-rollouts no limit: every
        round is waited for and saved, so no generated token is lost (a dropped
        one could not be sampled again as it was: which tokens a version sampled
        there depended on timing); all but an agent's are halted first, so the
        wait is one decode step, or an environment call (areno/continuation.py,
        envs/resume.py)."""
        self.taken = []
        if wait_s is None:
            wait_s = float("inf") if self.partial else INTERRUPT_WAIT_S
        if wait_s == float("inf"):
            self._halt_or_wait()
        until, kept = time.monotonic() + wait_s, 0
        for cur in self.inflight:
            try:
                if cur.pending is not None and cur.round is None:
                    if not cur.pending.wait(until):
                        break
                    cur.pending.engines_done()
            except (KeyboardInterrupt, BackendError):  # a second interrupt, or the backend it aborted
                break
            kept += 1
        dropped, self.inflight = self.inflight[kept:], self.inflight[:kept]
        for cur in dropped:
            if cur.pending is not None:
                cur.pending.drop()
        return dropped[0].sampler_before if dropped else None

    def _halt_or_wait(self) -> None:
        """The rounds generating now are halted (their tokens saved, and an
        environment's states: continued on resume); an agent's are waited for. One
        line on stdout says which (stderr keeps the run's one closing line)."""
        busy = sum(cur.pending is not None and cur.round is None and cur.pending.generating for cur in self.inflight)
        if not busy:
            return
        if self.producer.episodes is None or not self.producer.episodes.agent:
            self.producer.halt()
            what = (f"halting the {busy} rollout(s) in flight at their next decode step: the checkpoint keeps "
                    "their tokens" + ("" if self.producer.episodes is None else
                                      " and their environments' states (a call out is asked again)")
                    + " and a resume continues them")
        else:
            what = f"waiting for the {busy} agent rollout(s) in flight to finish, so that no sampled token is lost"
        print(f"areno: {what} (--partial-rollouts); Ctrl-C again drops them", flush=True)  # stderr: the end's

    def checkpoint_state(self, path: Path) -> dict:
        """Save every round in flight into checkpoint dir `path`, waiting for each
        -> the sampler state to save (after the prompts of the last one)."""
        save_inflight(path, self.inflight)
        return self.run.sampler.state_dict()


def rollouts_for(run: Any, updates: int, saved: list[Inflight], tokenizer_path: str) -> Rollouts:
    """A run's scheduler over its engines (multi-turn under --env-path), with a
    checkpoint's rounds in flight (`saved`, load_inflight; `updates`: its weight
    version) kept, or, at K = 0 (a K = 0 save holds one sampled with the
    checkpoint's weights), sampled again."""
    cfg = run.cfg
    producer = Producer(run, episode_spec(cfg, tokenizer_path) if multi_turn(cfg) else None)
    if saved and not cfg.off_policy_steps:
        run.sampler.load_state_dict(saved[0].sampler_before)
        saved = []
    return Rollouts(run, producer, updates, saved)
