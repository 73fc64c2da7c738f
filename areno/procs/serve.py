"""A peer's command loop, the same for a rank and an engine process: report
ready, then run `cmd_<name>` of the worker for each command until shutdown or
EOF. Messages from the controller are small tuples (command, kwargs); replies
are ("ok", result), ("part", meta) mid-command, or ("err", index, message,
traceback) (procs/replies.py reads them)."""

from __future__ import annotations

import functools
import os
import queue
import sys
import threading
import traceback
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

from areno.procs.lifecycle import start_up
from areno.procs.signals import peer_ignores
from areno.timing import startup_mark


def quiet_peer() -> None:
    """Process hygiene of a peer, first thing (its threads inherit the signal mask).
    Ctrl-C, a scheduler's SIGTERM, a closed terminal's SIGHUP reach the whole
    job; the controller owns shutdown (procs/signals.py). Library output
    (weight-loading bars, engine logs) goes to RUN_DIR/run.log, or to the
    terminal with --verbose (areno/rundir/log.py), so it is not silenced here."""
    peer_ignores()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def serve_worker(make: Callable[[], Any], conn: Connection, index: int, queued: bool = False) -> None:
    """Build the worker (`make()`), send its hello, then serve its commands. index:
    how its errors name it (a rank, or engine process i); queued: commands read by
    a thread of their own as they come (queued_commands: an engine process)."""
    try:
        with start_up():  # the model, its engine (vLLM's import and build)
            worker = make()
        worker.emit = lambda part: conn.send(("part", part))
        startup_mark("peer ready")
        conn.send(("ok", worker.hello()))
    except BaseException as e:  # noqa: BLE001 - reported, then exit
        reply_error(conn, index, e)
        _end(1)
    recv = queued_commands(conn, getattr(worker, "immediate", {})) if queued else conn.recv
    if queued:  # a rollout may take the ones queued behind it, and reply to them itself (tail fill)
        worker.inbox, worker.reply = recv, lambda result: conn.send(("ok", result))
    while True:
        try:
            cmd, kwargs = recv()
        except (EOFError, OSError):  # controller gone
            os._exit(4)
        if cmd == "shutdown":
            worker.close()
            conn.send(("ok", None))
            _end(0)
        try:
            if kwargs.pop("payload", False):
                buf = bytearray(kwargs["handoff"].nbytes)
                conn.recv_bytes_into(buf)
                kwargs["payload"] = buf
            result = command_of(worker, cmd)(**kwargs)
            conn.send(("ok", result))
        except BaseException as e:  # noqa: BLE001
            reply_error(conn, index, e)


def _end(code: int) -> None:
    """How a peer ends: its output flushed, then os._exit. Nothing is left to clean
    up, and the interpreter's teardown is slow and would finalize the frozen
    start-up (procs.lifecycle.start_up: nanobind's leak report in run.log)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def command_of(worker: Any, cmd: str) -> Callable[..., Any]:
    """worker.cmd_<cmd>, else the command its hooks add (hooks.command)."""
    fn = getattr(worker, f"cmd_{cmd}", None)
    if fn is not None:
        return fn
    extra = worker.hooks.command(cmd)
    if extra is None:
        raise AttributeError(f"{type(worker).__name__} has no command {cmd!r}")
    return functools.partial(extra, worker)


def queued_commands(conn: Connection, immediate: dict[str, Callable[..., None]] | None = None,
                    ) -> "CommandInbox":
    """An engine process's commands, read by a thread of their own as they come ->
    the inbox whose call takes the next: the controller queues rollouts there while
    one runs (scheduler.py), and a command bigger than the pipe's buffer must not
    hold the controller's send until this rollout ends (while its parts fill
    the other direction). Reading and sending on one pipe from two threads is
    safe: the two directions share no state. immediate: commands run on the
    reader thread as they come, with no reply (an engine process's "offer" of
    weights mid-round: fleet/inflight_loads.py)."""
    immediate = immediate or {}
    inbox = CommandInbox()

    def read() -> None:
        while True:
            try:
                msg = conn.recv()
                if isinstance(msg, tuple) and msg[0] in immediate:
                    immediate[msg[0]](**msg[1])
                    continue
                inbox.put(msg)
            except (EOFError, OSError) as e:
                inbox.put(e)
                return

    threading.Thread(target=read, name="areno-engine-commands", daemon=True).start()
    return inbox


class CommandInbox:
    """The commands read, in order: `inbox()` takes the next (blocking); `pop_if`
    takes the next only when it is there and `want(cmd, kwargs)` says so, which is
    how a running rollout takes the one queued behind it (fleet/tail_fill.py)."""

    def __init__(self) -> None:
        self._q: queue.Queue = queue.Queue()

    def put(self, item: Any) -> None:
        self._q.put(item)

    def __call__(self) -> tuple:
        item = self._q.get()
        if isinstance(item, BaseException):
            raise item
        return item

    def __len__(self) -> int:
        return self._q.qsize()

    def pop_if(self, want: Callable[[str, dict], bool]) -> tuple | None:
        """The next command, taken, if one is queued and `want` it; else None."""
        with self._q.mutex:  # the reader thread only appends: the head cannot change under us
            head = self._q.queue[0] if self._q.queue else None
            if not isinstance(head, tuple) or not want(*head):
                return None
            return self._q.queue.popleft()


def reply_error(conn: Connection, index: int, e: BaseException) -> None:
    try:
        conn.send(("err", index, f"{type(e).__name__}: {e}", traceback.format_exc()))
    except (OSError, EOFError):
        pass
