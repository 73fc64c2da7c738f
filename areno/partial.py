"""Partial rollouts as a policy: which groups a step trains, when the engines
take more work, and which trajectories an in-flight weight update retires.

With partial rollouts the engines never wait for a round's slowest sample:
groups (a prompt's n samples) are submitted one by one as capacity frees, the
engines take new weights between decode steps (rollout/hf_inflight.py,
rollout/vllm_inflight.py), and a training batch is the first --batch-size
groups to *finish* (all n samples done: the group advantage needs all of them),
not the groups submitted together. Three rules, all pure (arrays in, arrays out):

  first_finished  the batch: the complete groups in order of completion
  admission_room  how many groups may be submitted now: at most
                  (v + K + 1) * batch_size in all while the engines hold
                  version v (AReaL's staleness control), so the queue never
                  runs more than K steps ahead of the trainer
  retired         at an update to version v, the groups whose oldest token
                  (the version they started with) is more than K behind v:
                  they can never be trained (scheduler.check_oldest), so the
                  engines drop them now and their prompts are submitted again

`PartialPool` holds the groups of a run in flight under these rules; the
benchmark (scripts/arenobench/partial_sim.py) drives it with simulated
engines. Wiring it to engine processes needs them to take weights between
steps (areno/fleet), which this module does not assume.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


def first_finished(done_at: np.ndarray, batch_size: int) -> np.ndarray:
    """[G] float64 completion time of each group (inf: a sample still running)
    -> [<= batch_size] int64 the complete groups that finished first, in order
    of completion (ties: lower index first). Fewer than batch_size: not enough
    groups are complete yet."""
    done = np.flatnonzero(np.isfinite(done_at))
    order = done[np.argsort(done_at[done], kind="stable")]
    return order[:batch_size].astype(np.int64)


def group_done_at(sample_done_at: np.ndarray, group_index: np.ndarray, num_groups: int) -> np.ndarray:
    """[N] completion time of each sample (inf: running), [N] its group ->
    [G] the group's: its last sample's (inf while any runs; a group with no
    sample: inf)."""
    out = np.full(num_groups, -np.inf)
    np.maximum.at(out, group_index, sample_done_at)
    out[out == -np.inf] = np.inf
    return out


def admission_room(submitted: int, version: int, k: int, batch_size: int) -> int:
    """Groups that may be submitted now, `submitted` groups having been in all,
    the engines holding weights `version`: (version + k + 1) * batch_size - submitted."""
    return max(0, (version + k + 1) * batch_size - submitted)


def retired(start_version: np.ndarray, version: int, k: int) -> np.ndarray:
    """[G] int version each group in flight started with -> [G] bool: more than
    k behind `version`, the weights the engines take now (never trainable)."""
    return version - np.asarray(start_version, dtype=np.int64) > k


@dataclass
class PartialPool:
    """The groups of a partially rolled-out run in flight, by id: when each started
    (the engines' version), when each finished (inf: running). The caller
    submits (`room` says how many), marks finishes, takes batches, and tells
    it of each update the engines take (-> the ids retired)."""

    batch_size: int
    k: int
    version: int = 0
    submitted: int = 0
    start: dict[int, int] = field(default_factory=dict)
    done_at: dict[int, float] = field(default_factory=dict)

    def room(self) -> int:
        return admission_room(self.submitted, self.version, self.k, self.batch_size)

    def submit(self, gid: int) -> None:
        self.start[gid] = self.version
        self.done_at[gid] = np.inf
        self.submitted += 1

    def finish(self, gid: int, t: float) -> None:
        self.done_at[gid] = t

    def take(self, updates: int) -> list[int] | None:
        """The next batch for a trainer holding `updates` updates: the first
        batch_size groups finished among those it may train (oldest token at
        most k behind), removed from the pool; None while fewer are complete."""
        ids = np.fromiter(self.done_at, np.int64, len(self.done_at))
        t = np.fromiter(self.done_at.values(), np.float64, len(self.done_at))
        starts = np.fromiter(self.start.values(), np.int64, len(self.start))
        t[retired(starts, updates, self.k)] = np.inf
        pick = first_finished(t, self.batch_size)
        if pick.size < self.batch_size:
            return None
        out = ids[pick].tolist()
        for gid in out:
            del self.done_at[gid], self.start[gid]
        return out

    def update(self, version: int) -> list[int]:
        """The engines take weights `version` -> the ids retired (removed, and their
        room given back: the caller submits their prompts again)."""
        self.version = version
        ids = np.fromiter(self.start, np.int64, len(self.start))
        old = ids[retired(np.fromiter(self.start.values(), np.int64, len(self.start)), version, self.k)]
        for gid in old.tolist():
            del self.done_at[gid], self.start[gid]
        self.submitted -= old.size  # never trained: their room goes to the prompts submitted again
        return old.tolist()
