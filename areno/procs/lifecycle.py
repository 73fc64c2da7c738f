"""Process helpers shared by the rank processes and the reward workers."""

from __future__ import annotations

import contextlib
import gc
import os
import signal
import sys
import threading
import time
from collections.abc import Iterable, Iterator

from areno.procs.signals import STOP_SIGNAL


@contextlib.contextmanager
def start_up() -> Iterator[None]:
    """A peer's start-up (importing torch, transformers, vLLM; building the model
    and its engine: about 10^6 objects, nearly none of them garbage) without the
    cyclic collector, which would traverse the growing heap again and again: a
    fifth of the imports' CPU time (0.7 s of 4 in a rank). What it built is then
    frozen (gc.freeze), or the first collection after it would traverse it all
    once more; a peer lives as long as it does, and ends in os._exit."""
    gc.disable()
    try:
        yield
    finally:
        gc.freeze()
        gc.enable()


def die_with_parent(parent_pid: int, use_pdeathsig: bool = True, group: bool = False) -> None:
    """Exit if the process that started us goes away: PR_SET_PDEATHSIG (immediate;
    it fires when the spawning *thread* exits, so only safe when that was the main
    thread) and a watchdog thread polling the parent pid (within 0.5 s). group: a
    process that leads a process group of its own by then (a reward worker) takes
    its group with it (SIGKILL), so what a plugin started dies too; the watchdog
    alone does it, since PR_SET_PDEATHSIG would kill this process first."""
    if use_pdeathsig and not group and sys.platform.startswith("linux"):
        try:
            import ctypes

            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG = 1
        except (OSError, AttributeError):
            pass
    if os.getppid() != parent_pid:
        os._exit(3)

    def watch() -> None:
        while True:
            time.sleep(0.5)
            if os.getppid() != parent_pid:
                if group and os.getpgrp() == os.getpid():  # never the group it was started in
                    os.killpg(os.getpid(), signal.SIGKILL)
                os._exit(3)

    threading.Thread(target=watch, name="areno-parent-watch", daemon=True).start()


def allow_children() -> None:
    """Let this process start processes of its own (multiprocessing refuses in a
    daemonic one: "daemonic processes are not allowed to have children"). A peer
    spawned daemonic (an engine process) needs it for its episodes' workers; those
    die with it all the same (die_with_parent, group), and it stops them on close."""
    import multiprocessing

    multiprocessing.current_process()._config["daemon"] = False  # noqa: SLF001 - the flag start() checks


def descendants(pid: int | None = None) -> set[int]:
    """The live descendants of `pid` (this process when None), through
    /proc/PID/task/TID/children (Linux; empty elsewhere)."""
    out: set[int] = set()
    todo = [os.getpid() if pid is None else pid]
    while todo:
        p = todo.pop()
        try:
            tasks = os.listdir(f"/proc/{p}/task")
        except OSError:
            continue
        for t in tasks:
            try:
                with open(f"/proc/{p}/task/{t}/children") as f:
                    kids = [int(c) for c in f.read().split()]
            except OSError:
                continue
            todo += [k for k in kids if k not in out]
            out.update(kids)
    return out


def kill_new_descendants(before: set[int]) -> None:
    """SIGKILL this process's descendants that are not in `before` (what code run
    in-process started meanwhile: an in-process plugin's children), and reap the
    direct children among them."""
    new = descendants() - before
    for pid in new:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    for pid in new:
        try:
            os.waitpid(pid, 0)
        except OSError:  # not our child (a grandchild: init reaps it), or reaped already
            pass


def set_title(title: str, comm: str) -> None:
    """Name this process: `title` where ps and top show the command line, when
    setproctitle is installed (vLLM brings it; areno does not need it otherwise),
    and always `comm` (at most 15 bytes: ps -o comm, top, pgrep) through prctl
    PR_SET_NAME, which needs no package. SPT_NOENV: the title is kept within the
    command line's own bytes, so /proc/PID/environ stays readable (tools and the
    fault harness find a run's processes by their environment)."""
    os.environ.setdefault("SPT_NOENV", "1")
    try:
        import setproctitle
    except ImportError:
        pass
    else:
        setproctitle.setproctitle(title)
    if sys.platform.startswith("linux"):
        try:
            import ctypes

            ctypes.CDLL(None, use_errno=True).prctl(15, comm.encode()[:15])  # PR_SET_NAME = 15
        except (OSError, AttributeError):
            pass


def exit_text(code: int | None) -> str:
    """A process's exit code as words: 'exit code 1', 'killed by SIGKILL'."""
    if code is None:
        return "still running"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def stop_processes(procs: list, conns: list, segments: list) -> None:
    """Stop every process (STOP_SIGNAL: they ignore SIGTERM, procs/signals.py),
    close and forget their pipes, then unlink `segments` (shared memory). Idempotent.
    A caller that can first asks them to exit (a "shutdown" message) and waits."""
    try:
        for p in procs:
            if p.is_alive():
                os.kill(p.pid, STOP_SIGNAL)
        for p in procs:
            p.join(5.0)
        for i, c in enumerate(conns):
            if c is not None:
                try:
                    c.close()
                except OSError:
                    pass
                conns[i] = None
    finally:
        for s in segments:
            s.unlink()


def shut_down(procs: list, conns: list, stale: Iterable[int], grace_s: float) -> None:
    """Ask a group of peers to exit ("shutdown" on each pipe), SIGKILL the stale
    ones (busy with an abandoned rollout, they would read it only after; they
    ignore SIGTERM: procs/signals.py), then wait up to grace_s for all of them."""
    for c in filter(None, conns):
        with contextlib.suppress(OSError, ValueError):
            c.send(("shutdown", {}))
    for i in stale:
        procs[i].kill()
    deadline = time.monotonic() + grace_s
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
