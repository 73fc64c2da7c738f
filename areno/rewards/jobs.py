"""The scorer's books: jobs (one per submit), their chunks, and the on_error policy.

Every method runs under the scorer's lock; nothing here touches a process.
"""

from __future__ import annotations

import collections
import threading
from dataclasses import dataclass, fields

import numpy as np

from areno.rewards.plugin import (MAX_MESSAGES, REWARD_LIMIT, STATUS_ERROR, STATUS_OK, STATUS_TIMEOUT, RewardCounts,
                                  RewardError, out_of_range)


class Job:
    """One submit(): results land here by position."""

    def __init__(self, ticket: int, records: list) -> None:
        n = len(records)
        self.ticket = ticket
        self.sample_index = np.fromiter((getattr(r, "index", i) for i, r in enumerate(records)), np.int64, n)
        self.rewards = np.full(n, np.nan, dtype=np.float32)
        self.valid = np.ones(n, dtype=bool)
        self.remaining = n
        self.counts = {f.name: 0 for f in fields(RewardCounts)}
        self.messages: list[str] = []
        self.payloads: list = [None] * n  # a plugin kind's per-record payload (environments)
        self.error: BaseException | None = None
        self.done = threading.Event()
        if n == 0:
            self.done.set()


@dataclass
class Chunk:
    job: Job
    pos: np.ndarray  # [n] int64 positions in the job
    records: list
    seq: int
    attempts: int = 0
    slot: int = 0  # which of its worker's concurrent slots runs it (rewards/concurrent.py)
    errors: dict | None = None  # chunk index (-1: all) -> message
    payloads: dict | None = None  # chunk index -> payload, for kinds that return one


class JobBook:
    """Outstanding jobs by ticket and the chunks waiting for a worker."""

    def __init__(self, path: str, on_error: str, workers: int, batch: bool, max_chunk: int,
                 what: str = "reward plugin", *, lock: threading.Lock) -> None:
        self.path = path
        # notified as any job finishes (under the scorer's lock, which every method runs under)
        self.finished = threading.Condition(lock)
        self.what = what
        self.on_error = on_error
        self.workers = workers
        self.batch = batch  # the plugin scores a chunk in one call
        self.max_chunk = max_chunk
        self.jobs: dict[int, Job] = {}
        self.pending: collections.deque[Chunk] = collections.deque()
        self.next_ticket = 0
        self.seq = 0  # last chunk number handed out

    def add(self, records: list) -> tuple[int, list[Chunk]]:
        """A new job for `records`: (its ticket, its chunks)."""
        ticket = self.next_ticket
        self.next_ticket += 1
        job = self.jobs[ticket] = Job(ticket, records)
        return ticket, self.chunks(job, np.arange(len(records), dtype=np.int64), records)

    def chunks(self, job: Job, pos: np.ndarray, records: list, attempts: int = 0) -> list[Chunk]:
        """Split records into chunks of up to max_chunk, ~4 per worker (1 for batch plugins)."""
        n = len(records)
        per = max(1, self.workers) * (1 if self.batch else 4)
        size = min(self.max_chunk, max(1, -(-n // per)))
        out = []
        for lo in range(0, n, size):
            self.seq += 1
            out.append(Chunk(job, pos[lo : lo + size], records[lo : lo + size], self.seq, attempts))
        return out

    def fail(self, job: Job, pos: np.ndarray, kind: str, text: str) -> None:
        """Apply the on_error policy to failed samples `pos` of `job`."""
        if job.done.is_set() or pos.size == 0:
            return
        k = int(pos.size)
        more = f" (and {k - 1} more)" if k > 1 else ""
        msg = f"sample {int(job.sample_index[pos[0]])}{more}: {text}"
        job.counts[kind] += k
        if self.on_error == "fail":
            job.error = RewardError(
                f"{self.what} {self.path}: {msg} (on_error 'fail'; 'zero' or 'skip' keep going)"
            )
            self._finish(job)
            return
        if self.on_error == "zero":
            job.rewards[pos] = 0.0
            job.counts["zeroed"] += k
        else:
            job.valid[pos] = False
            job.counts["skipped"] += k
        if len(job.messages) < MAX_MESSAGES:
            job.messages.append(msg)
        self._settle(job, k)

    def _settle(self, job: Job, k: int) -> None:
        job.remaining -= k
        if job.remaining == 0:
            self._finish(job)

    def _finish(self, job: Job) -> None:
        job.done.set()
        self.finished.notify_all()
        if any(c.job is job for c in self.pending):
            self.pending = collections.deque(c for c in self.pending if c.job is not job)

    def abort_all(self, error: BaseException) -> None:
        for job in self.jobs.values():
            if not job.done.is_set():
                job.error = error
                job.done.set()
        self.finished.notify_all()
        self.pending.clear()

    def record(self, chunk: Chunk, stat: np.ndarray, vals: np.ndarray) -> None:
        """Take the finished samples (status != pending) of a chunk."""
        job = chunk.job
        if job.done.is_set():
            return
        ok = stat == STATUS_OK
        wild = out_of_range(vals)
        fine = ok & ~wild
        good = chunk.pos[fine]
        job.rewards[good] = vals[fine]
        if chunk.payloads:
            for i, at in zip(np.flatnonzero(fine).tolist(), good.tolist()):
                job.payloads[at] = chunk.payloads.get(i)
        self._settle(job, int(good.size))
        bad = np.flatnonzero(ok & wild)
        if bad.size:
            v = float(vals[bad[0]])
            why = "" if np.isnan(v) or np.isinf(v) else f", beyond the limit of +-{REWARD_LIMIT:g}"
            self.fail(job, chunk.pos[bad], "nan", f"returned {v:g}{why} (rewards must be finite "
                      f"and within +-{REWARD_LIMIT:g}: scale it down)")
        errors = chunk.errors or {}
        for i in np.flatnonzero((stat == STATUS_ERROR) | (stat == STATUS_TIMEOUT)):
            text = errors.get(int(i)) or errors.get(-1) or "raised an exception"
            kind = "timeouts" if stat[i] == STATUS_TIMEOUT else "errors"
            self.fail(job, chunk.pos[i : i + 1], kind, text)
