"""RewardScorer: parallel, fault-isolated scoring of RewardRecords with a plugin.

`RewardScorer` runs the plugin (see areno/rewards/plugin.py) in `workers`
processes (started with 'spawn'; each imports the plugin once) so that a plugin
that hangs, crashes its process (os._exit, a segfault) or leaks cannot take the
trainer down:

  * Work goes out in chunks (one message per chunk, not per sample). A worker
    writes "sample i of this chunk started at t" and each result into shared
    memory, so the controller knows which sample a worker is on and since
    when, with no message per sample. A sample running longer than `timeout`
    seconds gets its worker SIGKILLed and respawned; the samples after it in
    the chunk go to the next free worker. A batch plugin gets its chunk in one
    call with a timeout of `timeout * len(chunk)`.
  * A worker that dies charges the sample it was on (worker_crashes) and is
    respawned.
  * A reward that raises (SystemExit included), times out, crashes its worker,
    returns NaN/inf (counted as `nan`) or a non-number is handled by
    `on_error`: "fail" -> `RewardError` naming the sample's `index` and the
    error; "zero" -> reward 0.0, counted in `zeroed`; "skip" -> `valid` False
    and reward NaN (so a skipped sample cannot be used by accident), counted
    in `skipped`.

`workers=0` scores in the calling thread: easy to debug (pdb, prints), but no
timeout can be enforced and a crashing plugin takes the process with it.
Under workers, the plugin runs in each worker's main thread, so libraries
that time out with signals (math-verify's SIGALRM) work there.

Workers never outlive the scorer: close() (also on `with` exit and at
interpreter exit) ends them, they are daemon processes, and each leads a
process group (a session) of its own: a timeout, a crash or close() SIGKILLs
the whole group, so what the plugin started (a compiler, a test binary, a
fork) goes with it, and a worker whose trainer died, even by SIGKILL, kills
its group within 0.5 s (procs/lifecycle.die_with_parent). At workers=0, close()
kills what the plugin started in-process. A child that starts a session of
its own is out of reach. As with any 'spawn' pool, workers import the main script: a
script that builds a RewardScorer needs an `if __name__ == "__main__":` guard.
"""

from __future__ import annotations

import asyncio
import atexit
import math
import multiprocessing as mp
import multiprocessing.connection
from multiprocessing import resource_tracker
import os
import threading
import time
import weakref
from typing import Any

import numpy as np

from areno.errors import UserError, one_line
from areno.procs.lifecycle import descendants, exit_text, kill_new_descendants
from areno.rewards.jobs import JobBook, Chunk
from areno.rewards.plugin import (IMPORT_TIMEOUT_S, ON_ERROR, STATUS_ERROR, STATUS_PENDING, OnError, RewardCounts,
                                  RewardError, RewardResult, load_bounded, plugin_kind, score_batch)
from areno.rewards.worker import Worker

STARTUP_TIMEOUT_S = IMPORT_TIMEOUT_S  # a worker must import the plugin within this
KILL_GRACE_S = 5.0  # concurrent runs: past its timeout a run is cancelled; its worker killed this much later
MAX_CHUNK = 64  # samples per chunk, per-sample plugins (batch plugins: 4x)

_LIVE: "weakref.WeakSet[RewardScorer]" = weakref.WeakSet()


@atexit.register
def _close_all() -> None:
    for scorer in list(_LIVE):
        scorer.close()


class RewardScorer:
    """Scores RewardRecords with a plugin in `workers` processes (see module doc).

    score(records) -> RewardResult, or the overlapped form:
    t = submit(records) ... collect(t) (or collect() for everything submitted).
    """

    def __init__(
        self,
        plugin_path: str,
        *,
        workers: int = 2,
        timeout: float = 10.0,
        on_error: OnError = "fail",
        chunk_size: int | None = None,
        kind: str = "reward",
        concurrency: int = 1,
    ) -> None:
        if on_error not in ON_ERROR:
            raise UserError(f"RewardScorer: on_error must be one of {', '.join(ON_ERROR)}; got '{on_error}'")
        if workers < 0 or timeout <= 0:
            raise UserError(f"RewardScorer: workers must be >= 0 and timeout > 0; got {workers} and {timeout}")
        self.kind_name, self.kind = kind, plugin_kind(kind)  # rewards, or environments (areno/envs)
        self.plugin = load_bounded(self.kind, plugin_path)  # validated here, before any worker starts
        self.path = str(plugin_path)
        self.workers = int(workers)
        self.timeout = float(timeout)
        self.on_error = on_error
        self.max_chunk = int(chunk_size or (4 * MAX_CHUNK if self.plugin.batch else MAX_CHUNK))
        # Chunks a worker runs at once: an async plugin of a kind that can (agents) runs
        # up to `concurrency` in one event loop (rewards/concurrent.py); others one.
        self.slots = max(1, int(concurrency)) if self.kind.acall and self.plugin.is_async and workers else 1
        self._lock = threading.Lock()
        self._book = JobBook(self.path, on_error, self.workers, self.plugin.batch, self.max_chunk,
                             self.kind.what, lock=self._lock)
        self._fatal: BaseException | None = None
        self._closed = False
        self._startup_failures = 0  # workers in a row that died before importing the plugin
        self._loop = asyncio.new_event_loop() if self.plugin.is_async and not workers else None
        # In-process scoring: what the plugin starts is this process's child; close() ends
        # it. multiprocessing's resource tracker, started here if not yet, is not the plugin's.
        if not workers:
            resource_tracker.ensure_running()
        self._before = descendants() if not workers else set()
        if self.workers:
            self._ctx = mp.get_context("spawn")
            self._wake_r, self._wake_w = os.pipe()
            os.set_blocking(self._wake_w, False)
            self._pool: list[Worker] = []
            self._thread = threading.Thread(target=self._pump, name="areno-reward-pump", daemon=True)
            self._thread.start()
        _LIVE.add(self)

    # -- public API ------------------------------------------------------
    def score(self, records: list) -> RewardResult:
        return self.collect(self.submit(records))

    def submit(self, records: list) -> int:
        """Queue records for scoring; returns a ticket for collect()."""
        if self._closed:
            raise RuntimeError("RewardScorer.submit after close()")
        if self._fatal is not None:
            raise self._fatal
        records = list(records)
        with self._lock:
            ticket, chunks = self._book.add(records)
            for chunk in chunks:
                if self.workers:
                    self._book.pending.append(chunk)
                else:
                    self._score_inline(chunk)
        if self.workers:
            self._wake()
        return ticket

    def collect(self, ticket: int | None = None, timeout: float | None = None) -> RewardResult:
        """Wait for `ticket` (None: every outstanding ticket, in submit order)."""
        if ticket is None:
            return RewardResult.concat([self.collect(t, timeout) for t in list(self._book.jobs)])
        job = self._book.jobs[ticket]
        if not job.done.wait(timeout):
            raise TimeoutError(f"rewards for ticket {ticket} not ready after {timeout} s")
        with self._lock:
            del self._book.jobs[ticket]
        if job.error is not None:
            raise job.error
        return RewardResult(job.rewards, job.valid, RewardCounts(**job.counts), tuple(job.messages),
                            job.payloads if self.kind_name != "reward" else None)

    @property
    def capacity(self) -> int:
        """How many records run at once (chunk_size 1: calls in flight)."""
        return max(1, self.workers) * self.slots

    def workers_ready(self) -> int:
        """How many workers have imported the plugin (benchmarks and tests wait for all)."""
        with self._lock:
            return sum(w.ready for w in self._pool) if self.workers else 0

    def ready(self, ticket: int) -> bool:
        return self._book.jobs[ticket].done.is_set()

    def wait_any(self, tickets: list[int], timeout: float | None = None) -> list[int]:
        """The tickets whose jobs finished, in the order given; blocks until one has
        (timeout None), at most timeout s (then maybe none; 0: at once). Woken by
        the books as a job finishes: no polling."""
        jobs = [self._book.jobs[t] for t in tickets]
        with self._book.finished:
            self._book.finished.wait_for(lambda: not jobs or any(j.done.is_set() for j in jobs), timeout)
        return [t for t, j in zip(tickets, jobs) if j.done.is_set()]

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        _LIVE.discard(self)
        if self.workers:
            self._wake()
            self._thread.join(timeout=10.0)
            os.close(self._wake_r)
            os.close(self._wake_w)
        else:
            kill_new_descendants(self._before)
        with self._lock:
            self._book.abort_all(self._fatal or RewardError(f"reward scorer for {self.path} was closed"))

    def __enter__(self) -> "RewardScorer":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _wake(self) -> None:
        try:
            os.write(self._wake_w, b"x")
        except BlockingIOError:  # the pipe is full of wake-ups already
            pass

    def _score_inline(self, chunk: Chunk) -> None:
        """workers=0: score now, in this thread."""
        n = len(chunk.records)
        if self.plugin.batch:
            results, err = score_batch(self.plugin, chunk.records, self._loop)
            if err:
                results = [(STATUS_ERROR, math.nan, err)] * n
        else:
            results = [self.kind.call(self.plugin, r, self._loop) for r in chunk.records]
            chunk.payloads = {i: r[3] for i, r in enumerate(results) if r[3] is not None}
        chunk.errors = {i: r[2] for i, r in enumerate(results) if r[0] == STATUS_ERROR}
        stat = np.fromiter((r[0] for r in results), np.int8, n)
        vals = np.fromiter((r[1] for r in results), np.float64, n)
        self._book.record(chunk, stat, vals)

    # -- the pump thread -------------------------------------------------
    def _pump(self) -> None:
        try:
            for _ in range(self.workers):
                self._pool.append(self._spawn())
            while not self._closed:
                with self._lock:
                    self._dispatch()
                    wait_s = self._next_deadline() - time.monotonic()
                objs = [self._wake_r] + [w.conn for w in self._pool] + [w.proc.sentinel for w in self._pool]
                ready = set(mp.connection.wait(objs, timeout=min(max(wait_s, 0.0), 1.0)))
                if self._wake_r in ready:
                    os.read(self._wake_r, 4096)
                with self._lock:
                    self._service(ready)
        except BaseException as e:  # noqa: BLE001 - reported to every collect()
            with self._lock:
                self._fatal = e if isinstance(e, RewardError) else RuntimeError(f"reward scorer failed: {one_line(e)}")
                self._fatal.__cause__ = e
                self._book.abort_all(self._fatal)
        finally:
            for w in self._pool:
                if not w.busy and w.proc.is_alive():
                    try:
                        w.conn.send(None)
                    except OSError:
                        pass
            for w in self._pool:
                w.stop(kill=w.busy)
                w.conn.close()

    def _spawn(self) -> Worker:
        return Worker(self._ctx, self.path, self.max_chunk, self.kind_name, self.slots, self.timeout)

    def _dispatch(self) -> None:
        for slot in range(self.slots):  # slot 0 of every worker first: the runs spread out
            for w in self._pool:
                if not self._book.pending:
                    return
                if w.ready and w.chunks[slot] is None:
                    chunk = self._book.pending.popleft()
                    w.stat(slot, len(chunk.records))[:] = STATUS_PENDING
                    chunk.errors, chunk.payloads, chunk.slot = {}, {}, slot
                    w.chunks[slot] = chunk
                    w.conn.send((chunk.seq, chunk.records, slot))

    def _limit(self, chunk: Chunk) -> float:
        # Concurrent runs: the worker cancels a late one itself; the kill, a grace later,
        # is for a run that blocks its event loop (and takes the worker's other runs).
        grace = KILL_GRACE_S if self.slots > 1 else 0.0
        return self.timeout * (len(chunk.records) if self.plugin.batch else 1) + grace

    def _next_deadline(self) -> float:
        now = time.monotonic()
        out = now + 1.0
        for w in self._pool:
            if not w.ready:
                out = min(out, w.started + STARTUP_TIMEOUT_S)
            for slot, chunk in enumerate(w.chunks):
                seq, _, t0 = w.clock(slot)
                if chunk is not None and seq == chunk.seq:
                    out = min(out, t0 + self._limit(chunk))
        return out

    def _service(self, ready: set) -> None:
        now = time.monotonic()
        for slot, w in enumerate(self._pool):
            if w.conn in ready or w.proc.sentinel in ready:
                self._drain(w)
            if not w.proc.is_alive():
                code = w.proc.exitcode
                self._retire(slot, "worker_crashes", f"worker process died ({exit_text(code)})")
            elif not w.ready and now > w.started + STARTUP_TIMEOUT_S:
                self._retire(slot, "timeouts", f"worker did not start within {STARTUP_TIMEOUT_S:.0f} s")
            elif late := [s for s, c in enumerate(w.chunks) if c is not None and self._expired(w, s, now)]:
                self._retire(slot, "timeouts", f"timed out after {self._limit(w.chunks[late[0]]):g} s "
                             "(worker killed)", late)

    def _expired(self, w: Worker, slot: int, now: float) -> bool:
        chunk = w.chunks[slot]
        seq, pos, t0 = w.clock(slot)
        if seq != chunk.seq or now <= t0 + self._limit(chunk):
            return False
        return w.clock(slot)[:2] == (seq, pos)  # not moved on meanwhile

    def _drain(self, w: Worker) -> None:
        try:
            while w.conn.poll(0):
                self._on_message(w, w.conn.recv())
        except (EOFError, OSError):
            pass

    def _on_message(self, w: Worker, msg: tuple) -> None:
        kind = msg[0]
        if kind == "ready":
            w.ready = True
            self._startup_failures = 0
        elif kind == "fatal":
            w.fatal = msg[1]
        if kind in ("ready", "fatal") or (slot := w.slot_of(msg[1])) is None:
            return  # None: a chunk already charged (its worker retired)
        chunk = w.chunks[slot]
        if kind == "err":
            chunk.errors[msg[2]] = msg[3]
            if self.on_error == "fail":  # fail fast, do not wait for the chunk
                pos = chunk.pos if msg[2] < 0 else chunk.pos[msg[2] : msg[2] + 1]
                self._book.fail(chunk.job, pos, "errors", msg[3])
        elif kind == "out":
            chunk.payloads[msg[2]] = msg[3]
        elif kind == "done":
            n = len(chunk.records)
            stat, vals = w.stat(slot, n).copy(), w.vals(slot, n).copy()
            w.chunks[slot] = None
            self._book.record(chunk, stat, vals)

    def _retire(self, slot: int, kind: str, text: str, late: list[int] | None = None) -> None:
        """Kill worker `slot`, charge the sample it was on, requeue the rest, respawn.
        Concurrent runs cannot be run again (an agent's calls went out): each one
        in flight is charged, `kind` for the late slots (`late`), a crash for the rest."""
        w = self._pool[slot]
        w.stop(kill=True)
        self._drain(w)  # messages sent before it died
        w.conn.close()
        if w.fatal:
            raise RewardError(f"{self.kind.what} {self.path} failed to load in a worker process: {w.fatal}")
        if not w.ready:
            self._startup_failures += 1
            if self._startup_failures >= 3:
                raise RewardError(f"{self.kind.what} {self.path}: worker processes keep dying at startup: {text}")
        chunks, w.chunks = w.chunks, [None] * w.slots
        if w.slots == 1 and chunks[0] is not None:
            self._salvage(w, chunks[0], kind, text)
        for s, chunk in enumerate(chunks if w.slots > 1 else []):
            if chunk is not None:
                mine = late is None or s in late
                self._lost(w, s, chunk, kind if mine else "worker_crashes",
                           text if mine else f"its worker was killed ({kind}: {text}) while this run was on it")
        self._pool[slot] = self._spawn()

    def _lost(self, w: Worker, slot: int, chunk: Chunk, kind: str, text: str) -> None:
        """A concurrent slot's chunk whose worker is gone: what finished counts, the rest fails."""
        n = len(chunk.records)
        stat = w.stat(slot, n).copy()
        self._book.record(chunk, stat, w.vals(slot, n).copy())
        self._book.fail(chunk.job, chunk.pos[stat == STATUS_PENDING], kind, text)

    def _salvage(self, w: Worker, chunk: Chunk, kind: str, text: str) -> None:
        n = len(chunk.records)
        stat = np.frombuffer(w.status, np.int8)[:n].copy()
        vals = np.frombuffer(w.values, np.float64)[:n].copy()
        self._book.record(chunk, stat, vals)
        left = stat == STATUS_PENDING
        if w.progress[0] == chunk.seq:  # it had started the chunk: charge the culprit
            culprit = left.copy() if self.plugin.batch else np.zeros(n, bool)
            pos = int(w.progress[1])
            if not self.plugin.batch and left[pos]:
                culprit[pos] = True
            self._book.fail(chunk.job, chunk.pos[culprit], kind, text)
            left &= ~culprit
        if not left.any() or chunk.job.done.is_set():
            return
        idx = np.flatnonzero(left)
        if chunk.attempts >= 2:
            self._book.fail(chunk.job, chunk.pos[idx], "worker_crashes", "its worker died 3 times before scoring it")
            return
        redo = self._book.chunks(chunk.job, chunk.pos[idx], [chunk.records[i] for i in idx], chunk.attempts + 1)
        self._book.pending.extendleft(reversed(redo))
