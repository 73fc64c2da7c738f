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
from areno.rundir.log import redirect_child_output

if TYPE_CHECKING:
    from areno.rewards.jobs import Chunk


def _worker_main(path: str, conn: Any, progress: Any, values: Any, status: Any, parent_pid: int,
                 kind_name: str = "reward") -> None:
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
            results, err = score_batch(plugin, recs, loop)
            if err:
                conn.send(("err", seq, -1, err))  # before the status, so status => message sent
                stat[: len(recs)] = STATUS_ERROR
            else:
                for i, (s, v, m) in enumerate(results):
                    if s == STATUS_ERROR:
                        conn.send(("err", seq, i, m))
                    vals[i] = v
                    stat[i] = s
        else:
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
        conn.send(("done", seq))


class Worker:
    def __init__(self, ctx: Any, path: str, max_chunk: int, kind_name: str = "reward") -> None:
        self.progress = ctx.RawArray("d", 3)  # chunk seq, position, start time
        self.progress[0] = -1
        self.values = ctx.RawArray("d", max_chunk)
        self.status = ctx.RawArray("b", max_chunk)
        self.conn, child = ctx.Pipe(duplex=True)
        self.proc = ctx.Process(
            target=_worker_main,
            args=(path, child, self.progress, self.values, self.status, os.getpid(), kind_name),
            daemon=True,
            name="areno-reward-worker",
        )
        with spawning():
            self.proc.start()
        child.close()
        self.started = time.monotonic()
        self.ready = False
        self.fatal = ""
        self.chunk: Chunk | None = None  # the chunk it is scoring

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
