"""The loop of split placement (--rollout-world-size M): with --off-policy-steps
K = 1 the engine processes generate step k+1's rollout while the ranks train
step k; with K = 0 the next rollout waits for the update, as the colocated loop's
(trainer.train_step) does, and samples what it would (tests/test_split_placement.py).

One step, as the controller runs it (docs/DESIGN.md, "The timeline of a step"):

    collect rollout k           (the ranks wait here only if the engines are slower)
    start rollout k+1           (if admitted: its weights are <= K versions behind)
    score k, pack, train k      (the engines generate k+1 meanwhile)
    publish weights k           (a shared-memory region; the engines load it at the
                                 start of their next rollout, never inside one)
    start rollout k+1           (K = 0: now, with weights k)

Versions count updates: the trainer's weights are version u after u updates,
and a rollout sampled with version v and trained at version u has policy lag
u - v. Admission (`admitted`) starts a rollout early only when its lag will
be <= K; the loop keeps at most one rollout ahead, so K is 0 or 1.

Checkpoints: a periodic save waits for the rollout in flight and saves it
(`inflight.npz`), so the resumed run trains on the very samples the
uninterrupted one did. An interrupt does not wait: its checkpoint puts the
in-flight rollout's prompts back (trainer.settle_interrupted_step), and the
resumed run generates that rollout again, from the checkpoint's weights and
with the step's seed (deterministic, one step with lag 0).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import numpy as np

from areno.metrics import policy_lag_metrics, wait_metrics
from areno.data.prompts import select
from areno.rollout.batch import RolloutBatch

INFLIGHT_FILE = "inflight.npz"  # its RolloutBatch and prompt indices
INFLIGHT_META = "inflight.json"  # its step, weight version, the sampler before its prompts


def admitted(updates_at_train: int, version: int, k: int) -> bool:
    """Whether a rollout sampled with weights `version` may be trained once the
    trainer holds `updates_at_train` updates: its lag is at most k."""
    return updates_at_train - version <= k


@dataclass
class Inflight:
    """A rollout for `step`, started (pending) or collected (batch)."""

    step: int
    prompt_idx: np.ndarray          # int64 [P]
    sampler_before: dict            # the sampler's state before these prompts were drawn
    version: int                    # the weights it samples with
    pending: Any = None             # rank_engines.PendingRollout while it runs
    batch: RolloutBatch | None = None
    info: dict = field(default_factory=dict)  # PendingRollout.collect's: idle_s, sync_load_s
    wait_s: float = 0.0             # how long the controller waited for it


class RolloutsAhead:
    """The loop state of split placement (K = 0 or 1): the rollout in flight, the
    newest published weights, the version the engines hold. `updates`: the
    trainer's version."""

    def __init__(self, run: Any, updates: int, saved: Inflight | None = None) -> None:
        self.run, self.k = run, run.cfg.off_policy_steps
        self.updates = updates
        self.engine_version = updates  # the engine processes start from the checkpoint's weights
        self.published: tuple[int, Any] | None = None  # (version, WeightRegion) not loaded yet
        self.inflight = saved
        self.updates_at_train = updates

    # -- the loop ------------------------------------------------------------------
    def take(self, step: int) -> Inflight:
        """Step's rollout, collected; the next one started when admitted."""
        if self.inflight is None or self.inflight.step != step:
            self.start(step)
        cur = self.collect()
        self.inflight = None
        self.updates_at_train = self.updates  # the version this batch trains
        if step < self.run.total_steps and admitted(self.updates + 1, self.newest, self.k):
            self.start(step + 1)
        return cur

    def after_update(self, step: int, cur: Inflight) -> dict[str, float]:
        """Once step's update is in (or skipped): start the next rollout if it had
        to wait for these weights; the loop metrics of the step."""
        if step < self.run.total_steps and self.inflight is None:
            self.start(step + 1)
        lag = np.full(cur.batch.num_responses, self.updates_at_train - cur.version)
        return policy_lag_metrics(lag) | wait_metrics([cur.wait_s], [cur.info.get("idle_s", 0.0)])

    def publish(self) -> None:
        """The update is in: publish version updates + 1 for the engines' next rollout,
        into the region the engines are not reading (they may be loading the last one)."""
        self.updates += 1
        be = self.run.backend
        region = be.publish_weights(fingerprinted=be.engine_procs_fingerprinted, slot=self.updates % 2)
        self.published = (self.updates, region)

    def take_published(self) -> Any:
        """The published region the engines are about to load (None: they hold the
        newest weights); from here on they count as holding its version."""
        if self.published is None:
            return None
        (self.engine_version, region), self.published = self.published, None
        return region

    @property
    def newest(self) -> int:
        return self.published[0] if self.published else self.engine_version

    def start(self, step: int) -> None:
        """Draw step's prompts and send its rollout, with the newest weights when the
        engines do not hold them yet."""
        run = self.run
        before = run.sampler.state_dict()
        prompt_idx = run.sampler.next_batch()
        region = self.take_published()
        ids, offsets = select(run.prompts, prompt_idx)
        pending = run.engine.start_rollout(ids, offsets, run.cfg.n_samples, run.sampling_for(step), region)
        self.inflight = Inflight(step, prompt_idx, before, self.engine_version, pending)

    def extra_round(self, step: int, sampling: Any) -> tuple[np.ndarray, RolloutBatch]:
        """A refill round of `step` for dynamic sampling (dynsample.py): fresh prompts,
        generated now and waited for, with the weights the engines hold (K = 0 only:
        the next rollout has not started, so the engines are free and the lag stays 0)."""
        run = self.run
        prompt_idx = run.sampler.next_batch()
        ids, offsets = select(run.prompts, prompt_idx)
        batch, _ = run.engine.start_rollout(ids, offsets, run.cfg.n_samples, sampling, None).collect()
        return prompt_idx, batch

    def collect(self) -> Inflight:
        """Wait for the rollout in flight (at once when it was collected already)."""
        cur = self.inflight
        if cur.batch is None:
            t0 = time.perf_counter()
            cur.batch, cur.info = cur.pending.collect()
            cur.wait_s, cur.pending = time.perf_counter() - t0, None
        return cur

    # -- around the loop -------------------------------------------------------------
    def ready_for_eval(self) -> None:
        """The engines free and holding the newest weights: the rollout in flight is
        collected (and kept for its step), the published weights loaded."""
        if self.inflight is not None:
            self.collect()
        if (region := self.take_published()) is not None:
            self.run.backend.load_engine_procs(region)

    def checkpoint_state(self, path: Path) -> dict:
        """Save the rollout in flight into checkpoint dir `path`, waiting for it ->
        the sampler state to save (an interrupt has dropped it already: then the
        sampler is back before its prompts, trainer.settle_interrupted_step)."""
        cur = self.inflight
        if cur is not None:
            self.collect()
            np.savez(path / INFLIGHT_FILE, prompt_idx=cur.prompt_idx,
                     **{f.name: getattr(cur.batch, f.name) for f in fields(RolloutBatch)})
            (path / INFLIGHT_META).write_text(json.dumps(
                {"step": cur.step, "version": cur.version, "sampler_before": cur.sampler_before}))
        return self.run.sampler.state_dict()


def load_inflight(ckpt: Path | None) -> Inflight | None:
    """The rollout a checkpoint saved in flight (checkpoint_state), or None."""
    if ckpt is None or not (ckpt / INFLIGHT_FILE).is_file():
        return None
    meta = json.loads((ckpt / INFLIGHT_META).read_text())
    with np.load(ckpt / INFLIGHT_FILE) as z:
        batch = RolloutBatch(**{f.name: z[f.name] for f in fields(RolloutBatch)})
        prompt_idx = z["prompt_idx"]
    return Inflight(meta["step"], prompt_idx, meta["sampler_before"], meta["version"], batch=batch)
