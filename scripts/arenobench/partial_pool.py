"""Admitting groups one by one and retiring those past the lag bound, the
policy `bench_async.py --partial` simulates beside what the run does
(arenobench/partial_sim.py; docs/PERFORMANCE.md): the engines take a group as
a slot frees, within (v + K + 1) batches while they hold version v (AReaL's
staleness control), a batch is the first groups to finish, and an update
retires the groups whose oldest token could no longer be trained. areno's
scheduler admits whole rounds instead (areno/first_finished.py), so it
retires nothing; this stays a benchmark's model of the alternative."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from areno.partial import first_finished


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
