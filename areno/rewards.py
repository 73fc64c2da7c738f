"""Reward plugins and parallel, fault-isolated scoring.

A reward plugin is one Python file (`--reward-fn-path`) that defines either

    def reward_fn(record: RewardRecord) -> float           # one sample
    def reward_fn_batch(records: list[RewardRecord]) -> list[float]

and either may be `async def`. If both are defined, `reward_fn_batch` is used.

`RewardScorer` runs the plugin in `workers` processes (started with 'spawn';
each imports the plugin once) so that a plugin that hangs, crashes its
process (os._exit, a segfault) or leaks cannot take the trainer down:

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
interpreter exit) ends them, they are daemon processes, and on Linux each
asks the kernel to SIGKILL it when the trainer dies (PR_SET_PDEATHSIG), even
by SIGKILL. As with any 'spawn' pool, workers import the main script: a
script that builds a RewardScorer needs an `if __name__ == "__main__":` guard.
"""

from __future__ import annotations

import asyncio
import atexit
import collections
import inspect
import math
import multiprocessing as mp
import multiprocessing.connection
import numbers
import os
import signal
import threading
import time
import weakref
from dataclasses import dataclass, fields
from typing import Any, Callable

import numpy as np

from areno.errors import UserError, _one_line, import_user_file, user_frame
from areno.procs import die_with_parent, exit_text
from areno.runlog import redirect_child_output

ON_ERROR = ("fail", "zero", "skip")
FAILURE_KINDS = ("errors", "timeouts", "nan", "worker_crashes")
STARTUP_TIMEOUT_S = 120.0  # a worker must import the plugin within this
MAX_CHUNK = 64  # samples per chunk, per-sample plugins (batch plugins: 4x)
_MAX_MESSAGES = 5  # failure messages kept in a RewardResult
_PENDING, _OK, _ERROR = 0, 1, 2  # per-sample status in shared memory


@dataclass(frozen=True)
class RewardRecord:
    """What a reward function sees for one sample."""

    prompt: str  # the rendered prompt text
    completion: str  # the decoded response
    answer: str | None  # the row's reference answer, if any
    solutions: list | None  # the row's reference solutions, if any
    row: dict  # the normalized source row (see areno.data)
    num_tokens: int  # response length in tokens
    finish_reason: str  # "stop" | "length" | "abort"
    index: int  # sample index in the step


class RewardError(UserError):
    """A reward plugin failed on a sample under on_error='fail' (or could not run)."""


@dataclass(frozen=True)
class RewardPlugin:
    path: str
    fn: Callable  # reward_fn or reward_fn_batch
    batch: bool  # fn takes a list of records
    is_async: bool


def load_reward_plugin(path: str) -> RewardPlugin:
    """Import and check a plugin file; every problem is a UserError naming it."""
    module = import_user_file(path, what="--reward-fn-path plugin")
    for name, batch in (("reward_fn_batch", True), ("reward_fn", False)):
        fn = getattr(module, name, None)
        if fn is None:
            continue
        if not callable(fn):
            raise UserError(f"reward plugin {path}: '{name}' is a {type(fn).__name__}, not a function")
        return RewardPlugin(str(path), fn, batch, inspect.iscoroutinefunction(fn))
    raise UserError(
        f"reward plugin {path}: defines neither reward_fn(record) -> float "
        "nor reward_fn_batch(records) -> list[float]"
    )


@dataclass(frozen=True)
class RewardCounts:
    """Failures by kind (errors/timeouts/nan/worker_crashes) and what on_error did."""

    errors: int = 0  # raised, or returned a non-number
    timeouts: int = 0
    nan: int = 0  # returned NaN or +-inf
    worker_crashes: int = 0
    skipped: int = 0
    zeroed: int = 0

    def __add__(self, other: "RewardCounts") -> "RewardCounts":
        return RewardCounts(**{f.name: getattr(self, f.name) + getattr(other, f.name) for f in fields(self)})

    @property
    def failures(self) -> int:
        return self.errors + self.timeouts + self.nan + self.worker_crashes


@dataclass(frozen=True)
class RewardResult:
    """rewards: [N] float32 (NaN where not valid); valid: [N] bool."""

    rewards: np.ndarray
    valid: np.ndarray
    counts: RewardCounts
    messages: tuple[str, ...] = ()  # the first few failure messages, for the log

    @staticmethod
    def concat(results: list["RewardResult"]) -> "RewardResult":
        counts = RewardCounts()
        for r in results:
            counts = counts + r.counts
        return RewardResult(
            rewards=np.concatenate([r.rewards for r in results] or [np.zeros(0, np.float32)]),
            valid=np.concatenate([r.valid for r in results] or [np.zeros(0, bool)]),
            counts=counts,
            messages=tuple(m for r in results for m in r.messages)[:_MAX_MESSAGES],
        )


# --------------------------------------------------------------------------
# calling the plugin (shared by the workers and workers=0)


def _as_reward(out: Any) -> tuple[int, float, str]:
    if isinstance(out, (numbers.Real, np.bool_)):
        return _OK, float(out), ""
    return _ERROR, math.nan, f"returned {type(out).__name__} {_short(out)}, not a number"


def _short(x: Any) -> str:
    try:
        text = repr(x)
    except Exception:  # noqa: BLE001
        return "(unprintable)"
    return text if len(text) <= 60 else text[:57] + "..."


def _run(plugin: RewardPlugin, arg: Any, loop: asyncio.AbstractEventLoop | None) -> Any:
    out = plugin.fn(arg)
    if inspect.isawaitable(out):
        out = (loop or asyncio.new_event_loop()).run_until_complete(out)
    return out


def _raised(e: BaseException, plugin: RewardPlugin) -> str:
    if isinstance(e, KeyboardInterrupt):
        raise e
    return f"raised {_one_line(e)}{user_frame(e, plugin.path)}"


def _score_one(plugin: RewardPlugin, rec: Any, loop: Any) -> tuple[int, float, str]:
    try:
        return _as_reward(_run(plugin, rec, loop))
    except BaseException as e:  # noqa: BLE001 - SystemExit is the plugin's error too
        return _ERROR, math.nan, _raised(e, plugin)


def _score_batch(plugin: RewardPlugin, recs: list, loop: Any) -> tuple[list, str]:
    """-> ([(status, value, msg)] per record, chunk-level error message or '')."""
    try:
        out = _run(plugin, list(recs), loop)
    except BaseException as e:  # noqa: BLE001
        return [], _raised(e, plugin)
    if isinstance(out, np.ndarray):
        out = out.tolist()
    if not isinstance(out, (list, tuple)) or len(out) != len(recs):
        got = f"{type(out).__name__} of length {len(out)}" if hasattr(out, "__len__") else type(out).__name__
        return [], f"reward_fn_batch returned {got} for {len(recs)} records"
    return [_as_reward(x) for x in out], ""


# --------------------------------------------------------------------------
# the worker process


def _worker_main(path: str, conn: Any, progress: Any, values: Any, status: Any, parent_pid: int) -> None:
    die_with_parent(parent_pid)
    redirect_child_output()  # third-party output to RUN_DIR/run.log (see areno/runlog.py)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the controller's to handle
    # The controller starts workers as daemons (ended with it); inside, let the
    # plugin start processes of its own (multiprocessing refuses in a daemon).
    mp.current_process()._config["daemon"] = False
    try:
        plugin = load_reward_plugin(path)
    except BaseException as e:  # noqa: BLE001
        conn.send(("fatal", str(e) if isinstance(e, UserError) else _one_line(e)))
        return
    conn.send(("ready",))
    loop = asyncio.new_event_loop() if plugin.is_async else None
    vals = np.frombuffer(values, dtype=np.float64)
    stat = np.frombuffer(status, dtype=np.int8)
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return
        if msg is None:
            return
        seq, recs = msg
        # Write order matters: start time, then position, then chunk seq; the
        # controller reads seq, position, time (so never a stale time).
        progress[2] = time.monotonic()
        progress[1] = 0
        progress[0] = seq
        if plugin.batch:
            results, err = _score_batch(plugin, recs, loop)
            if err:
                conn.send(("err", seq, -1, err))  # before the status, so status => message sent
                stat[: len(recs)] = _ERROR
            else:
                for i, (s, v, m) in enumerate(results):
                    if s == _ERROR:
                        conn.send(("err", seq, i, m))
                    vals[i] = v
                    stat[i] = s
        else:
            for i, rec in enumerate(recs):
                if i:
                    progress[2] = time.monotonic()
                    progress[1] = i
                s, v, m = _score_one(plugin, rec, loop)
                if s == _ERROR:
                    conn.send(("err", seq, i, m))
                vals[i] = v
                stat[i] = s
        conn.send(("done", seq))


# --------------------------------------------------------------------------
# the controller side


class _Job:
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
        self.error: BaseException | None = None
        self.done = threading.Event()
        if n == 0:
            self.done.set()


@dataclass
class _Chunk:
    job: _Job
    pos: np.ndarray  # [n] int64 positions in the job
    records: list
    seq: int
    attempts: int = 0
    errors: dict | None = None  # chunk index (-1: all) -> message


class _Worker:
    def __init__(self, ctx: Any, path: str, max_chunk: int) -> None:
        self.progress = ctx.RawArray("d", 3)  # chunk seq, position, start time
        self.progress[0] = -1
        self.values = ctx.RawArray("d", max_chunk)
        self.status = ctx.RawArray("b", max_chunk)
        self.conn, child = ctx.Pipe(duplex=True)
        self.proc = ctx.Process(
            target=_worker_main,
            args=(path, child, self.progress, self.values, self.status, os.getpid()),
            daemon=True,
            name="areno-reward-worker",
        )
        self.proc.start()
        child.close()
        self.started = time.monotonic()
        self.ready = False
        self.fatal = ""
        self.chunk: _Chunk | None = None

    def stop(self, kill: bool) -> None:
        """Kill (or wait for) the process; the pipe stays open to be drained."""
        if kill and self.proc.is_alive():
            self.proc.kill()  # SIGKILL: a hung plugin gets no say
        self.proc.join(timeout=2.0)


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
        on_error: str = "fail",
        chunk_size: int | None = None,
    ) -> None:
        if on_error not in ON_ERROR:
            raise UserError(f"--on-reward-error must be one of {', '.join(ON_ERROR)}; got '{on_error}'")
        if workers < 0 or timeout <= 0:
            raise UserError(f"--reward-workers must be >= 0 and --reward-timeout > 0; got {workers} and {timeout}")
        self.plugin = load_reward_plugin(plugin_path)  # validated here, before any worker starts
        self.path = str(plugin_path)
        self.workers = int(workers)
        self.timeout = float(timeout)
        self.on_error = on_error
        self.max_chunk = int(chunk_size or (4 * MAX_CHUNK if self.plugin.batch else MAX_CHUNK))
        self._lock = threading.Lock()
        self._jobs: dict[int, _Job] = {}
        self._pending: collections.deque[_Chunk] = collections.deque()
        self._next_ticket = 0
        self._seq = 0
        self._fatal: BaseException | None = None
        self._closed = False
        self._startup_failures = 0  # workers in a row that died before importing the plugin
        self._loop = asyncio.new_event_loop() if self.plugin.is_async and not workers else None
        if self.workers:
            self._ctx = mp.get_context("spawn")
            self._wake_r, self._wake_w = os.pipe()
            os.set_blocking(self._wake_w, False)
            self._pool: list[_Worker] = []
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
            ticket = self._next_ticket
            self._next_ticket += 1
            job = self._jobs[ticket] = _Job(ticket, records)
            for chunk in self._chunks(job, np.arange(len(records), dtype=np.int64), records):
                if self.workers:
                    self._pending.append(chunk)
                else:
                    self._score_inline(chunk)
        if self.workers:
            self._wake()
        return ticket

    def collect(self, ticket: int | None = None, timeout: float | None = None) -> RewardResult:
        """Wait for `ticket` (None: every outstanding ticket, in submit order)."""
        if ticket is None:
            return RewardResult.concat([self.collect(t, timeout) for t in list(self._jobs)])
        job = self._jobs[ticket]
        if not job.done.wait(timeout):
            raise TimeoutError(f"rewards for ticket {ticket} not ready after {timeout} s")
        with self._lock:
            del self._jobs[ticket]
        if job.error is not None:
            raise job.error
        return RewardResult(job.rewards, job.valid, RewardCounts(**job.counts), tuple(job.messages))

    def ready(self, ticket: int) -> bool:
        return self._jobs[ticket].done.is_set()

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
        with self._lock:
            self._abort_all(self._fatal or RewardError(f"reward scorer for {self.path} was closed"))

    def __enter__(self) -> "RewardScorer":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _wake(self) -> None:
        try:
            os.write(self._wake_w, b"x")
        except BlockingIOError:  # the pipe is full of wake-ups already
            pass

    # -- bookkeeping (under self._lock) ----------------------------------
    def _chunks(self, job: _Job, pos: np.ndarray, records: list, attempts: int = 0) -> list[_Chunk]:
        """Split records into chunks of up to max_chunk, ~4 per worker (1 for batch plugins)."""
        n = len(records)
        per = max(1, self.workers) * (1 if self.plugin.batch else 4)
        size = min(self.max_chunk, max(1, -(-n // per)))
        out = []
        for lo in range(0, n, size):
            self._seq += 1
            out.append(_Chunk(job, pos[lo : lo + size], records[lo : lo + size], self._seq, attempts))
        return out

    def _fail(self, job: _Job, pos: np.ndarray, kind: str, text: str) -> None:
        """Apply the on_error policy to failed samples `pos` of `job`."""
        if job.done.is_set() or pos.size == 0:
            return
        k = int(pos.size)
        more = f" (and {k - 1} more)" if k > 1 else ""
        msg = f"sample {int(job.sample_index[pos[0]])}{more}: {text}"
        job.counts[kind] += k
        if self.on_error == "fail":
            job.error = RewardError(
                f"reward plugin {self.path}: {msg} (--on-reward-error fail; zero or skip keep going)"
            )
            self._finish(job)
            return
        if self.on_error == "zero":
            job.rewards[pos] = 0.0
            job.counts["zeroed"] += k
        else:
            job.valid[pos] = False
            job.counts["skipped"] += k
        if len(job.messages) < _MAX_MESSAGES:
            job.messages.append(msg)
        self._settle(job, k)

    def _settle(self, job: _Job, k: int) -> None:
        job.remaining -= k
        if job.remaining == 0:
            self._finish(job)

    def _finish(self, job: _Job) -> None:
        job.done.set()
        if any(c.job is job for c in self._pending):
            self._pending = collections.deque(c for c in self._pending if c.job is not job)

    def _abort_all(self, error: BaseException) -> None:
        for job in self._jobs.values():
            if not job.done.is_set():
                job.error = error
                job.done.set()
        self._pending.clear()

    def _record(self, chunk: _Chunk, stat: np.ndarray, vals: np.ndarray) -> None:
        """Take the finished samples (status != pending) of a chunk."""
        job = chunk.job
        if job.done.is_set():
            return
        ok = stat == _OK
        finite = ok & np.isfinite(vals)
        good = chunk.pos[finite]
        job.rewards[good] = vals[finite]
        self._settle(job, int(good.size))
        bad = np.flatnonzero(ok & ~finite)
        if bad.size:
            self._fail(job, chunk.pos[bad], "nan", f"returned {vals[bad[0]]}")
        errors = chunk.errors or {}
        for i in np.flatnonzero(stat == _ERROR):
            text = errors.get(int(i)) or errors.get(-1) or "raised an exception"
            self._fail(job, chunk.pos[i : i + 1], "errors", text)

    def _score_inline(self, chunk: _Chunk) -> None:
        """workers=0: score now, in this thread."""
        n = len(chunk.records)
        if self.plugin.batch:
            results, err = _score_batch(self.plugin, chunk.records, self._loop)
            if err:
                results = [(_ERROR, math.nan, err)] * n
        else:
            results = [_score_one(self.plugin, r, self._loop) for r in chunk.records]
        chunk.errors = {i: m for i, (s, _, m) in enumerate(results) if s == _ERROR}
        stat = np.fromiter((s for s, _, _ in results), np.int8, n)
        vals = np.fromiter((v for _, v, _ in results), np.float64, n)
        self._record(chunk, stat, vals)

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
                self._fatal = e if isinstance(e, RewardError) else RuntimeError(f"reward scorer failed: {_one_line(e)}")
                self._fatal.__cause__ = e
                self._abort_all(self._fatal)
        finally:
            for w in self._pool:
                if w.chunk is None and w.proc.is_alive():
                    try:
                        w.conn.send(None)
                    except OSError:
                        pass
            for w in self._pool:
                w.stop(kill=w.chunk is not None)
                w.conn.close()

    def _spawn(self) -> _Worker:
        return _Worker(self._ctx, self.path, self.max_chunk)

    def _dispatch(self) -> None:
        for w in self._pool:
            if not self._pending:
                return
            if w.ready and w.chunk is None:
                chunk = self._pending.popleft()
                n = len(chunk.records)
                np.frombuffer(w.status, np.int8)[:n] = _PENDING
                chunk.errors = {}
                w.chunk = chunk
                w.conn.send((chunk.seq, chunk.records))

    def _limit(self, chunk: _Chunk) -> float:
        return self.timeout * (len(chunk.records) if self.plugin.batch else 1)

    def _next_deadline(self) -> float:
        now = time.monotonic()
        out = now + 1.0
        for w in self._pool:
            if not w.ready:
                out = min(out, w.started + STARTUP_TIMEOUT_S)
            elif w.chunk is not None and w.progress[0] == w.chunk.seq:
                out = min(out, w.progress[2] + self._limit(w.chunk))
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
            elif w.chunk is not None and self._expired(w, now):
                self._retire(slot, "timeouts", f"timed out after {self._limit(w.chunk):g} s (worker killed)")

    def _expired(self, w: _Worker, now: float) -> bool:
        seq, pos, t0 = w.progress[0], w.progress[1], w.progress[2]
        if seq != w.chunk.seq or now <= t0 + self._limit(w.chunk):
            return False
        return (w.progress[0], w.progress[1]) == (seq, pos)  # not moved on meanwhile

    def _drain(self, w: _Worker) -> None:
        try:
            while w.conn.poll(0):
                self._on_message(w, w.conn.recv())
        except (EOFError, OSError):
            pass

    def _on_message(self, w: _Worker, msg: tuple) -> None:
        kind = msg[0]
        if kind == "ready":
            w.ready = True
            self._startup_failures = 0
        elif kind == "fatal":
            w.fatal = msg[1]
        elif kind == "err" and w.chunk is not None and msg[1] == w.chunk.seq:
            w.chunk.errors[msg[2]] = msg[3]
            if self.on_error == "fail":  # fail fast, do not wait for the chunk
                pos = w.chunk.pos if msg[2] < 0 else w.chunk.pos[msg[2] : msg[2] + 1]
                self._fail(w.chunk.job, pos, "errors", msg[3])
        elif kind == "done" and w.chunk is not None and msg[1] == w.chunk.seq:
            n = len(w.chunk.records)
            stat = np.frombuffer(w.status, np.int8)[:n].copy()
            vals = np.frombuffer(w.values, np.float64)[:n].copy()
            chunk, w.chunk = w.chunk, None
            self._record(chunk, stat, vals)

    def _retire(self, slot: int, kind: str, text: str) -> None:
        """Kill worker `slot`, charge the sample it was on, requeue the rest, respawn."""
        w = self._pool[slot]
        w.stop(kill=True)
        self._drain(w)  # messages sent before it died
        w.conn.close()
        if w.fatal:
            raise RewardError(f"reward plugin {self.path} failed to load in a worker process: {w.fatal}")
        if not w.ready:
            self._startup_failures += 1
            if self._startup_failures >= 3:
                raise RewardError(f"reward plugin {self.path}: worker processes keep dying at startup: {text}")
        chunk, w.chunk = w.chunk, None
        if chunk is not None:
            self._salvage(w, chunk, kind, text)
        self._pool[slot] = self._spawn()

    def _salvage(self, w: _Worker, chunk: _Chunk, kind: str, text: str) -> None:
        n = len(chunk.records)
        stat = np.frombuffer(w.status, np.int8)[:n].copy()
        vals = np.frombuffer(w.values, np.float64)[:n].copy()
        self._record(chunk, stat, vals)
        left = stat == _PENDING
        if w.progress[0] == chunk.seq:  # it had started the chunk: charge the culprit
            culprit = left.copy() if self.plugin.batch else np.zeros(n, bool)
            pos = int(w.progress[1])
            if not self.plugin.batch and left[pos]:
                culprit[pos] = True
            self._fail(chunk.job, chunk.pos[culprit], kind, text)
            left &= ~culprit
        if not left.any() or chunk.job.done.is_set():
            return
        idx = np.flatnonzero(left)
        if chunk.attempts >= 2:
            self._fail(chunk.job, chunk.pos[idx], "worker_crashes", "its worker died 3 times before scoring it")
            return
        redo = self._chunks(chunk.job, chunk.pos[idx], [chunk.records[i] for i in idx], chunk.attempts + 1)
        self._pending.extendleft(reversed(redo))


def reward_records(rows: Any, prompts: Any, prompt_idx: np.ndarray, batch: Any,
                   completions: list[str], index: np.ndarray | None = None) -> list[RewardRecord]:
    """One RewardRecord per sample of `batch` (a RolloutBatch whose prompt p is
    prompts[prompt_idx[p]]): O(N) Python, the only per-sample objects of a step.
    index: [N] sample index in the step of each response (default 0..N-1)."""
    from areno.rollout.batch import FINISH_REASONS

    row_of_prompt = prompts.row_index[prompt_idx].tolist()
    texts = prompts.texts
    lengths = batch.response_lengths.tolist()
    reasons = batch.finish_reason.tolist()
    sample = range(len(completions)) if index is None else index.tolist()
    out = []
    for i, (g, text) in enumerate(zip(batch.group_index.tolist(), completions)):
        row = rows[row_of_prompt[g]]
        out.append(RewardRecord(
            prompt=texts[prompt_idx[g]], completion=text, answer=row.get("answer"),
            solutions=row.get("solutions"), row=row, num_tokens=lengths[i],
            finish_reason=FINISH_REASONS[reasons[i]], index=sample[i],
        ))
    return out
