"""The loop of split placement (--rollout-world-size M): with --off-policy-steps
K >= 1 the engine processes generate the rollouts of steps k+1..k+K (queued on
them, back to back) while the ranks train step k; with K = 0 the next rollout
waits for the update, as the colocated loop's (trainer.train_step) does, and
samples what it would (tests/test_split_placement.py).

One step, as the controller runs it (docs/DESIGN.md, "The timeline of a step"):

    collect rollout k           (the ranks wait here only if the engines are slower;
                                 its parts were decoded and scored as they came)
    start rollouts k+1..        (each once admitted: its weights <= K versions behind)
    score k, pack, train k      (the engines generate meanwhile; their parts are
                                 read, decoded and scored while the ranks train)
    publish weights k           (a shared-memory region; the engines load it at the
                                 start of the next rollout sent, never inside one)
    start rollouts ..k+K+1      (those the new weights admit; K = 0: k+1, now)

Versions count updates: the trainer's weights are version u after u updates,
and a rollout sampled with version v and trained at version u has policy lag
u - v. Admission (`admitted`) starts a rollout only when its lag will be <= K,
and it samples with the newest published weights, decided when it is sent:
which weights a rollout samples with depends on the loop's order, not on
timing, so a seeded run is reproducible and a resume exact. In steady state
every rollout lags exactly K (the lag sequence 0, 1, .., K, K, ..).

Why the engines queue the rollouts rather than the controller holding them
back until an engine is free: the next rollout is there the moment one ends
(no bubble while the controller packs or scores), and its weights are fixed at
admission either way. A version's region must outlive the rollouts queued
before the one that loads it: the regions rotate over K + 1 slots, so version
v is rewritten by v + K + 1, published only after the rollout carrying v was
collected (K + 1 copies of the weights in /dev/shm).

Checkpoints: a save (periodic, or the interrupt's) waits for every rollout in
flight and saves each one (`inflight.npz`), so the resumed run trains on the
very samples the uninterrupted one did. An interrupt waits at most
INTERRUPT_WAIT_S for them: one still generating then is dropped with every
later one, their prompts go back (trainer.settle_interrupted_step), and the
resumed run samples them again from the checkpoint's weights with the step's
seed (deterministic, with a smaller lag).
"""

from __future__ import annotations

import json
import time
import zipfile
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import numpy as np

from areno.procs.errors import BackendError
from areno.data.prompts import select
from areno.errors import UserError, one_line
from areno.metrics import policy_lag_metrics, wait_metrics
from areno.rewards import RewardResult
from areno.rollout.batch import RolloutBatch
from areno.rundir.checkpoint import STATE_FILE
from areno.scoring import PartScorer, score
from areno.timing import PhaseTimer

INFLIGHT_FILE = "inflight.npz"  # each rollout's RolloutBatch and prompt indices
INFLIGHT_META = "inflight.json"  # each one's step, weight version, the sampler before its prompts
INTERRUPT_WAIT_S = 5.0  # how long a Ctrl-C waits for the rollouts in flight before dropping them


def admitted(updates_at_train: int, version: int, k: int) -> bool:
    """Whether a rollout sampled with weights `version` may be trained once the
    trainer holds `updates_at_train` updates: its lag is at most k."""
    return updates_at_train - version <= k


def weight_slots(k: int) -> int:
    """Weight regions the loop rotates over at --off-policy-steps k (module docstring)."""
    return max(2, k + 1)


@dataclass
class Inflight:
    """A rollout for `step`: started (pending), whole (batch), scored (scored)."""

    step: int
    prompt_idx: np.ndarray          # int64 [P]
    sampler_before: dict            # the sampler's state before these prompts were drawn
    version: int                    # the weights it samples with
    pending: Any = None             # rank_engines.PendingRollout while it runs
    sink: Any = None                # its rank_engines.Parts (a PartScorer with --overlap-rewards)
    timer: PhaseTimer = field(default_factory=lambda: PhaseTimer(keep_spans=True))  # its decode, reward
    batch: RolloutBatch | None = None
    scored: RewardResult | None = None
    info: dict = field(default_factory=dict)  # PendingRollout.collect's: idle_s, sync_load_s
    wait_s: float = 0.0             # how long the controller waited for it


class RolloutsAhead:
    """The loop state of split placement: the rollouts in flight (oldest first),
    the newest published weights, the version the engines were last sent.
    `updates`: the trainer's version."""

    def __init__(self, run: Any, updates: int, saved: list[Inflight] | None = None) -> None:
        self.run, self.k = run, run.cfg.off_policy_steps
        self.updates = updates
        self.engine_version = updates  # the engine processes start from the checkpoint's weights
        self.published: tuple[int, Any] | None = None  # (version, WeightRegion) not sent yet
        self.inflight: list[Inflight] = list(saved or [])
        self.current: Inflight | None = None  # the rollout the step in progress trains on
        self.updates_at_train = updates

    # -- the loop ------------------------------------------------------------------
    def take(self, step: int, timer: PhaseTimer | None = None) -> Inflight:
        """Step's rollout, whole and scored (the seam for a caller that needs a
        step's rollout: its batch, rewards and prompts); the rollouts it admits
        are started before the wait for its outstanding rewards. Its decode and
        reward time, wherever it ran, is added to `timer`."""
        if not self.inflight or self.inflight[0].step != step:
            self.start(step)
        cur = self.collect(self.inflight[0])
        self.current = self.inflight.pop(0)  # back in flight if the step's update does not land
        self.updates_at_train = self.updates  # the version this batch trains
        self.admit(step)
        self.finish(cur)
        if timer is not None:
            timer.absorb(cur.timer)
        return cur

    def after_update(self, step: int, cur: Inflight) -> dict[str, float]:
        """Once step's update is in (or skipped): start the rollouts the new weights
        admit; the loop metrics of the step."""
        self.admit(step + 1)
        lag = np.full(cur.batch.num_responses, self.updates_at_train - cur.version)
        return policy_lag_metrics(lag, self.k) | wait_metrics([cur.wait_s], [cur.info.get("idle_s", 0.0)])

    def admit(self, at_step: int) -> None:
        """Start every rollout after those in flight that is admitted while the
        trainer is at `at_step` holding self.updates updates (one update a step
        from here on: a skipped one only lowers the lag)."""
        nxt = self.inflight[-1].step + 1 if self.inflight else at_step + 1
        while nxt <= self.run.total_steps and admitted(self.updates + nxt - at_step, self.newest, self.k):
            self.start(nxt)
            nxt += 1

    def publish(self) -> None:
        """The update is in: publish version updates + 1 for the next rollouts sent,
        into the slot that no rollout in flight still has to load (module docstring)."""
        self.updates += 1
        be = self.run.backend
        region = be.publish_weights(fingerprinted=be.engine_procs_fingerprinted,
                                    slot=self.updates % weight_slots(self.k))
        self.published = (self.updates, region)

    def take_published(self) -> Any:
        """The published region for the next rollout sent or load (None: the engines
        have the newest weights); from here on they count as holding its version."""
        if self.published is None:
            return None
        (self.engine_version, region), self.published = self.published, None
        return region

    @property
    def newest(self) -> int:
        return self.published[0] if self.published else self.engine_version

    def start(self, step: int) -> None:
        """Draw step's prompts and send its rollout, with the newest weights when the
        engines were not sent them yet; its parts are scored as they come
        (PartScorer) with --overlap-rewards."""
        run = self.run
        before = run.sampler.state_dict()
        prompt_idx = run.sampler.next_batch()
        region = self.take_published()
        cur = Inflight(step, prompt_idx, before, self.engine_version)
        if run.cfg.overlap_rewards:
            cur.sink = PartScorer(run, prompt_idx, cur.timer)
        ids, offsets = select(run.prompts, prompt_idx)
        cur.pending = run.engine.start_rollout(ids, offsets, run.cfg.n_samples, run.sampling_for(step), region,
                                               cur.sink)
        cur.sink = cur.pending.sink
        self.inflight.append(cur)

    def extra_round(self, step: int, sampling: Any) -> tuple[np.ndarray, RolloutBatch]:
        """A refill round of `step` for dynamic sampling (dynsample.py): fresh prompts,
        generated now and waited for, with the weights the engines hold (K = 0 only:
        the next rollout has not started, so the engines are free and the lag stays 0)."""
        run = self.run
        prompt_idx = run.sampler.next_batch()
        ids, offsets = select(run.prompts, prompt_idx)
        pending = run.engine.start_rollout(ids, offsets, run.cfg.n_samples, sampling, None)
        pending.collect()
        return prompt_idx, pending.sink.merge()[0]

    def collect(self, cur: Inflight) -> Inflight:
        """Wait for a rollout in flight to be whole (at once when it is already)."""
        if cur.pending is not None:
            t0 = time.perf_counter()
            cur.info = cur.pending.collect()
            cur.wait_s, cur.pending = time.perf_counter() - t0, None
            if not isinstance(cur.sink, PartScorer):
                cur.batch = cur.sink.merge()[0]
        return cur

    def finish(self, cur: Inflight) -> None:
        """A whole rollout's rewards: the outstanding ones of its parts, or (saved
        in a checkpoint, or without --overlap-rewards) the whole batch scored now."""
        if cur.scored is not None:
            return
        if isinstance(cur.sink, PartScorer):
            cur.batch, cur.scored = cur.sink.finish(cur.timer)
        else:
            cur.scored = score(self.run, cur.prompt_idx, cur.batch, cur.timer)
        cur.sink = None

    # -- around the loop -------------------------------------------------------------
    def ready_for_eval(self) -> None:
        """The engines free and holding the newest weights: every rollout in flight
        is collected (and kept for its step), the published weights loaded."""
        for cur in self.inflight:
            self.collect(cur)
        if (region := self.take_published()) is not None:
            self.run.backend.load_engine_procs(region)

    def settle_interrupt(self, after_step: int, wait_s: float = INTERRUPT_WAIT_S) -> dict | None:
        """After an interrupt, with step `after_step` the last one finished: keep the
        rollouts in flight for after_step + 1, + 2, .. that are whole within
        wait_s (a second Ctrl-C: none more), drop the others (left to run; their
        engines take no more commands) -> the sampler state before the first
        one dropped, or None when none was or its prompts are back already."""
        until, kept = time.monotonic() + wait_s, 0
        for cur in self.inflight:
            if cur.step != after_step + 1 + kept:
                break
            try:
                if cur.pending is not None and not cur.pending.wait(until):
                    break
                self.collect(cur)
            except (KeyboardInterrupt, BackendError):  # a second interrupt, or the backend it aborted
                break
            kept += 1
        dropped, self.inflight = self.inflight[kept:], self.inflight[:kept]
        for cur in dropped:
            if cur.pending is not None:
                cur.pending.drop()
        first = dropped[0] if dropped else None
        return first.sampler_before if first is not None and first.step == after_step + 1 + kept else None

    def put_back(self, step: int) -> None:
        """The rollout of `step`, whose update did not land, in flight again (whole)."""
        cur = self.current
        if cur is not None and cur.step == step and not (self.inflight and self.inflight[0].step <= step):
            self.inflight.insert(0, cur)
        self.current = None

    def checkpoint_state(self, path: Path) -> dict:
        """Save every rollout in flight into checkpoint dir `path`, waiting for each
        -> the sampler state to save (after the prompts of the last one)."""
        arrays = {}
        for i, cur in enumerate(self.inflight):
            self.collect(cur)
            batch = cur.batch if cur.batch is not None else cur.sink.merge()[0]  # its rewards may be out
            arrays |= {f"{i}/{f.name}": getattr(batch, f.name) for f in fields(RolloutBatch)
                       if getattr(batch, f.name) is not None}  # response_mask: multi-turn only
            arrays[f"{i}/prompt_idx"] = cur.prompt_idx
        if self.inflight:
            np.savez(path / INFLIGHT_FILE, **arrays)
            (path / INFLIGHT_META).write_text(json.dumps({"rollouts": [
                {"step": c.step, "version": c.version, "sampler_before": c.sampler_before}
                for c in self.inflight]}))
        return self.run.sampler.state_dict()


def load_inflight(ckpt: Path | None, expected: int | None = None, instead: str = "") -> list[Inflight]:
    """The rollouts a checkpoint saved in flight (checkpoint_state), oldest first,
    read whole before anything starts: without them the resumed run would train on
    other prompts than the saved one (the sampler's cursor is past theirs), so a
    missing, truncated or short file is a UserError naming it (instead: what to
    pass then). expected: the count the trainer state records (None: a checkpoint
    from before it did; then the files are read when there). A checkpoint of the
    one-rollout loop (one unprefixed rollout) reads too."""
    if ckpt is None:
        return []
    npz, meta_path = ckpt / INFLIGHT_FILE, ckpt / INFLIGHT_META
    if not expected and not npz.exists() and not meta_path.exists():
        return []
    try:
        return _read_inflight(npz, meta_path, expected)
    except _Damaged as e:
        name, problem = e.args
        raise UserError(f"--resume {ckpt}: {name} (the rollouts in flight when it was saved) {problem}; "
                        f"{instead or 'resume from another checkpoint'}") from None


class _Damaged(Exception):
    """An in-flight file's name and what is wrong with it."""


def _read_inflight(npz: Path, meta_path: Path, expected: int | None) -> list[Inflight]:
    for f in (meta_path, npz):
        if not f.is_file():
            raise _Damaged(f.name, "is missing")
    try:
        meta = json.loads(meta_path.read_text())
        rollouts, prefix = (meta["rollouts"], "{}/") if "rollouts" in meta else ([meta], "")
        for m in rollouts:
            m["step"], m["version"], m["sampler_before"]  # noqa: B018  (each one whole)
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise _Damaged(meta_path.name, f"is truncated or unreadable ({one_line(e)})") from None
    if expected is not None and len(rollouts) != expected:
        raise _Damaged(meta_path.name, f"lists {len(rollouts)} rollouts, {STATE_FILE} {expected}")
    out = []
    try:
        with np.load(npz) as z:
            for i, m in enumerate(rollouts):
                p = prefix.format(i)
                # Indexing reads and CRC-checks each array: a cut file fails here.
                batch = RolloutBatch(**{f.name: z[p + f.name] for f in fields(RolloutBatch) if p + f.name in z})
                out.append(Inflight(m["step"], z[p + "prompt_idx"], m["sampler_before"], m["version"], batch=batch))
    except (OSError, ValueError, KeyError, TypeError, EOFError, zipfile.BadZipFile) as e:
        raise _Damaged(npz.name, f"is truncated or unreadable ({one_line(e)})") from None
    return out
