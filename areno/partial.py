"""Partial rollouts as a policy: which groups a step trains, when the engines
take more work, and which trajectories an in-flight weight update retires.

With partial rollouts the engines never wait for a round's slowest sample: the
engines take new weights between decode steps (rollout/hf_inflight.py,
rollout/vllm_inflight.py), and a training batch is made of groups (a prompt's n
samples, all done: the group advantage needs all of them) from any round in
flight, not one whole round. All rules are pure (arrays in, arrays out):

  deadline_first  the batch the run's scheduler trains (first_finished.py):
                  the groups that must train now for every group to train
                  within K updates of its round's version (earliest deadline
                  first), the rest of --batch-size the first complete groups
  first_finished  the complete groups in order of completion
  admission_room  how many groups may be submitted now: at most
                  (v + K + 1) * batch_size in all while the engines hold
                  version v (AReaL's staleness control)
  retired         at an update to version v, the groups whose oldest token
                  is more than K behind v (never trainable)

`PartialPool` holds groups submitted one by one under the last three; the
benchmark (scripts/arenobench/partial_sim.py) drives it with simulated engines.
The run's scheduler submits whole rounds (round admission is the same bound)
and forms batches with deadline_first, so it needs no retirement.
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


def must_take(oldest: np.ndarray, updates: int, k: int, batch_size: int) -> int:
    """[G] int64 the version each untrained group's round started with -> how many
    of the most urgent ones this step (the trainer holding `updates`) must take.
    A group of version o trains at latest at step offset o + k - updates (one
    update a step; a skipped one only lowers the lag), and at most batch_size
    groups train a step, so by offset j the groups due by j need (j + 1) slots:
    m = max_j #(due by j) - j * batch_size, at least 0. A group already past its
    deadline, or m > batch_size, is a scheduler bug (AssertionError)."""
    due = np.asarray(oldest, dtype=np.int64) + k - updates
    if not due.size:
        return 0
    if due.min() < 0:
        raise AssertionError(f"a group of version {int(due.min()) - k + updates} is past its deadline: "
                             f"{updates} updates, K = {k} (scheduler bug)")
    by = np.cumsum(np.bincount(due)) - batch_size * np.arange(int(due.max()) + 1)
    m = max(0, int(by.max()))
    if m > batch_size:
        raise AssertionError(f"{m} groups must train at {updates} updates to meet their deadlines, "
                             f"more than --batch-size {batch_size} (scheduler bug: admission let too many in)")
    return m


def deadline_first(oldest: np.ndarray, done_at: np.ndarray, updates: int, k: int,
                   batch_size: int) -> np.ndarray | None:
    """[G] int64 version each untrained group's round started with, [G] float64
    its completion order (inf: a sample still running) -> [batch_size] int64 the
    groups to train now: the must_take most urgent ones (lowest version; among
    equals, complete ones first, in order of completion), then the first complete
    ones of the rest in order of completion. None: the step must wait (an urgent
    group is running, or too few are complete)."""
    oldest = np.asarray(oldest, dtype=np.int64)
    done_at = np.asarray(done_at, dtype=np.float64)
    m = must_take(oldest, updates, k, batch_size)
    urgent = np.lexsort((np.arange(oldest.size), done_at, oldest))[:m]
    if not np.isfinite(done_at[urgent]).all():
        return None
    rest = np.ones(oldest.size, bool)
    rest[urgent] = False
    done_at = np.where(rest, done_at, np.inf)
    out = np.concatenate([urgent, first_finished(done_at, batch_size - m)]).astype(np.int64)
    return out if out.size == batch_size else None


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
