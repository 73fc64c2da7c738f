"""A reward worker: the process that runs the plugin, and the controller's handle on it.

The worker writes "sample i of this chunk started at t" and each result into
shared memory (`progress`, `values`, `status`), so the controller knows which
sample a worker is on and since when with no message per sample; messages go
only per chunk ("done"), per failure ("err") and at start ("ready"/"fatal").
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import os
import signal
import time
from typing import TYPE_CHECKING, Any

import numpy as np

from areno.errors import UserError, one_line
from areno.procs.lifecycle import die_with_parent, set_title
from areno.procs.signals import peer_ignores, spawning
from areno.rewards.plugin import STATUS_ERROR, plugin_kind, score_batch
from areno.rewards.concurrent import serve_concurrent
from areno.rundir.log import redirect_child_output

if TYPE_CHECKING:
    from areno.rewards.jobs import Chunk


def _worker_main(path: str, conn: Any, progress: Any, values: Any, status: Any, parent_pid: int,
                 kind_name: str = "reward", slots: int = 1, timeout: float = 0.0) -> None:
    peer_ignores()  # a stop of the whole job is the controller's (procs/signals.py)
    # A session (and process group) of its own, before the plugin runs: every
    # process the plugin starts (a compiler, a test binary, a fork) joins it,
    # and Worker.stop kills the whole group with the worker, as does this
    # process when the controller dies, even by SIGKILL (die_with_parent).
    os.setsid()
    die_with_parent(parent_pid, group=True)
    set_title(f"areno: {kind_name} worker of run {parent_pid}", f"areno-{kind_name}")
    redirect_child_output()  # third-party output to RUN_DIR/run.log (see areno/rundir/log.py)
    # The controller starts workers as daemons (ended with it); inside, let the
    # plugin start processes of its own (multiprocessing refuses in a daemon).
    mp.current_process()._config["daemon"] = False
    try:
        kind = plugin_kind(kind_name)
        plugin = kind.load(path)
    except BaseException as e:  # noqa: BLE001
        conn.send(("fatal", str(e) if isinstance(e, UserError) else one_line(e)))
        return
    conn.send(("ready",))
    vals = np.frombuffer(values, dtype=np.float64)
    stat = np.frombuffer(status, dtype=np.int8)
    if slots > 1:  # many async runs at once (the pool chose it: RewardScorer.slots)
        serve_concurrent(kind, plugin, conn, progress, vals, stat, slots, timeout)
        return
    loop = asyncio.new_event_loop() if plugin.is_async else None
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return
        if msg is None:
            return
        seq, recs = msg[0], msg[1]  # msg[2]: the slot, always 0 here
        # Write order matters: start time, then position, then chunk seq; the
        # controller reads seq, position, time (so never a stale time).
        progress[2] = time.monotonic()
        progress[1] = 0
        progress[0] = seq
        if plugin.batch:
            _serve_batch(plugin, recs, loop, conn, seq, vals, stat)
        else:
            _serve_calls(kind, plugin, recs, loop, conn, seq, progress, vals, stat)
        conn.send(("done", seq))


def _serve_batch(plugin: Any, recs: list, loop: Any, conn: Any, seq: int, vals: np.ndarray,
                 stat: np.ndarray) -> None:
    """A chunk scored by reward_fn_batch: one call; its raise fails every record."""
    results, err = score_batch(plugin, recs, loop)
    if err:
        conn.send(("err", seq, -1, err))  # before the status, so status => message sent
        stat[: len(recs)] = STATUS_ERROR
        return
    for i, (s, v, m) in enumerate(results):
        if s == STATUS_ERROR:
            conn.send(("err", seq, i, m))
        vals[i] = v
        stat[i] = s


def _serve_calls(kind: Any, plugin: Any, recs: list, loop: Any, conn: Any, seq: int, progress: Any,
                 vals: np.ndarray, stat: np.ndarray) -> None:
    """A chunk called record by record, each one's clock in `progress`."""
    for i, rec in enumerate(recs):
        if i:
            progress[2] = time.monotonic()
            progress[1] = i
        s, v, m, payload = kind.call(plugin, rec, loop)
        if s == STATUS_ERROR:
            conn.send(("err", seq, i, m))
        elif payload is not None:  # before the status, as errors: status => message sent
            conn.send(("out", seq, i, payload))
        vals[i] = v
        stat[i] = s


class Worker:
    """The pool's handle on one worker process: `slots` chunks at a time (1 but
    for concurrent async runs, rewards/concurrent.py), each slot with its progress
    triple (chunk seq, position, start time) at 3*slot and its values and
    statuses at slot*max_chunk in shared memory."""

    def __init__(self, ctx: Any, path: str, max_chunk: int, kind_name: str = "reward", slots: int = 1,
                 timeout: float = 0.0) -> None:
        self.slots, self.max_chunk = slots, max_chunk
        self.progress = ctx.RawArray("d", 3 * slots)
        for s in range(slots):
            self.progress[3 * s] = -1
        self.values = ctx.RawArray("d", max_chunk * slots)
        self.status = ctx.RawArray("b", max_chunk * slots)
        self.conn, child = ctx.Pipe(duplex=True)
        self.proc = ctx.Process(
            target=_worker_main,
            args=(path, child, self.progress, self.values, self.status, os.getpid(), kind_name, slots, timeout),
            daemon=True,
            name="areno-reward-worker",
        )
        with spawning():
            self.proc.start()
        child.close()
        self.started = time.monotonic()
        self.ready = False
        self.fatal = ""
        self.chunks: list[Chunk | None] = [None] * slots  # the chunk each slot is scoring

    def stat(self, slot: int, n: int) -> np.ndarray:
        """[n] int8 view: the statuses of slot's chunk."""
        return np.frombuffer(self.status, np.int8, n, slot * self.max_chunk)

    def vals(self, slot: int, n: int) -> np.ndarray:
        """[n] float64 view: the values of slot's chunk."""
        return np.frombuffer(self.values, np.float64, n, 8 * slot * self.max_chunk)

    def clock(self, slot: int) -> tuple[float, float, float]:
        """Slot's (chunk seq, position, start time), read in the order the worker never tears."""
        p = 3 * slot
        return self.progress[p], self.progress[p + 1], self.progress[p + 2]

    def slot_of(self, seq: int) -> int | None:
        return next((s for s, c in enumerate(self.chunks) if c is not None and c.seq == seq), None)

    @property
    def busy(self) -> bool:
        return any(c is not None for c in self.chunks)

    def stop(self, kill: bool) -> None:
        """Kill (or wait for) the process, then what is left of its process group
        (the plugin's children); the pipe stays open to be drained."""
        if kill and self.proc.is_alive():
            _kill_group(self.proc.pid)  # SIGKILL: a hung plugin gets no say
            self.proc.kill()  # not yet in its own group (still starting)
        self.proc.join(timeout=2.0)
        # The leader is gone (or, slow to exit, goes now) but its group lives on
        # while a member does, and Linux hands out no pid that is a live group's id.
        _kill_group(self.proc.pid)
        if self.proc.is_alive():
            self.proc.join(timeout=1.0)


def _kill_group(pgid: int) -> None:
    """SIGKILL process group pgid; nothing when it has no member left."""
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
