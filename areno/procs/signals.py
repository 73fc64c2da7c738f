"""Ctrl-C, SIGTERM and SIGHUP: every handler areno installs, over ONE list of
signals (HELD), and the four ways it holds them.

1. Start-up (`held`, `take`, `release`). Start-up imports take seconds (torch,
   numpy, transformers), and a KeyboardInterrupt raised inside one leaves the
   module half-initialised: a later import of it fails with a traceback ("CPU
   dispatcher tracer already initialized", a circular import in accelerate),
   and one raised while a C extension runs Python code makes CPython end by
   SIGINT after areno's own clean exit (status -2, not 130). So from `main()`
   on, the signals are only recorded until the command takes them: `train` at
   the start of its run (`raise_held`, which stops at once with the start-up
   message if one came), the other commands as they start (`release`).
2. The run (`interrupts_raise`, `defer_interrupts`/`release_interrupts`,
   `raise_dropped`). Each signal raises SignalInterrupt in the main thread
   (SIGTERM normally kills the process without a word, SIGHUP comes from a
   closed terminal or ssh session); once a step's update has started the first
   one only marks the step, which then ends whole; one Python drops (raised in
   a finalizer) is raised again at the next step (areno/runtime/interrupt.py
   says what the run does next).
3. A pipe message (`signals_held`): held across one write or read of the
   command pipes, so that an interrupt can never split one.
4. The run's other processes (`spawning`, `peer_ignores`): a scheduler stops a
   job by signalling all of it (`timeout`, a Slurm time limit or scancel,
   `systemctl stop`, a closed terminal: the process group or the cgroup), so
   ranks, engine processes and reward/env workers ignore every HELD signal and
   leave the stop to the controller, which saves through them first and then
   ends them (a "shutdown" message, then SIGKILL: STOP_SIGNAL). They start
   with HELD blocked (`spawning`, the mask crosses fork and exec) until they
   ignore them, so one that comes while they start is dropped, not fatal.

Standard library only (and areno.errors): areno.cli imports it before anything
heavy, so the start-up hold begins at once.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

from areno.errors import SignalInterrupt

HELD = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
# How the controller ends a rank, engine process or worker that did not exit on
# its "shutdown" message: they ignore HELD (section 4), so SIGTERM would not.
STOP_SIGNAL = signal.SIGKILL
# `nohup areno train ...` starts areno with SIGHUP ignored so that a logout does
# not stop it: an ignore inherited at start stays (areno.cli imports this first).
_KEPT_IGNORED = frozenset(s for s in (signal.SIGHUP,) if signal.getsignal(s) is signal.SIG_IGN)


def handled() -> tuple[signal.Signals, ...]:
    """The HELD signals areno installs handlers for: all but an inherited ignore."""
    return tuple(s for s in HELD if s not in _KEPT_IGNORED)


_received: list[str] = []  # the names of the signals the run has seen, newest last


def last_signal() -> str:
    """The name of the newest signal that stopped the run ("SIGINT" if none was seen)."""
    return _received[-1] if _received else "SIGINT"


def _in_main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


# --- 1. start-up ----------------------------------------------------------------

_pending: list[str] = []  # the held signals' names, oldest first
_holding = [False]


def _record(signum: int, _frame: object) -> None:
    _pending.append(signal.Signals(signum).name)


@contextlib.contextmanager
def held() -> Iterator[None]:
    """Record HELD signals instead of acting on them until `take()`/`release()`;
    the handlers in place before are back at the end (main() called in-process)."""
    if not _in_main_thread():
        yield
        return
    old = {s: signal.signal(s, _record) for s in handled()}
    _pending.clear()
    _holding[0] = True
    try:
        yield
    finally:
        _holding[0] = False
        for s, h in old.items():
            signal.signal(s, h)


def take() -> list[str]:
    """End the hold: the held signals' names (oldest first), emptied. The caller
    installs its own handlers next and acts on what came meanwhile."""
    _holding[0] = False
    got, _pending[:] = list(_pending), []
    return got


def release() -> None:
    """End the hold for a command without handlers of its own: Ctrl-C raises
    KeyboardInterrupt again (now, if one came meanwhile), the others kill."""
    if not _holding[0]:
        return
    got = take()
    for s in handled():
        signal.signal(s, signal.default_int_handler if s == signal.SIGINT else signal.SIG_DFL)
    if got:
        raise KeyboardInterrupt


def raise_held() -> None:
    """Raise the interrupt that came while start-up held the signals, if one
    did; from here on they are the run's (interrupts_raise)."""
    came = take()
    if came:
        _received.extend(came)
        raise SignalInterrupt


# --- 2. the run -----------------------------------------------------------------

_deferred: dict[str, bool] = {"on": False, "hit": False}


def _note(signum: int, _frame: Any) -> None:
    _received.append(signal.Signals(signum).name)


def _raise(signum: int, frame: Any) -> None:
    _note(signum, frame)
    if _deferred["on"] and not _deferred["hit"]:  # a second one raises at once
        _deferred["hit"] = True
        return
    raise SignalInterrupt


_dropped = [False]  # Python dropped a SignalInterrupt (see raise_dropped)


def _unraisable(hook: Callable[[Any], None]) -> Callable[[Any], None]:
    """sys.unraisablehook that marks a dropped SignalInterrupt, silently, and
    passes everything else to `hook`."""
    def marks(u: Any) -> None:
        if isinstance(u.exc_value, SignalInterrupt):
            _dropped[0] = True
        else:
            hook(u)
    return marks


def raise_dropped() -> None:
    """Raise the interrupt Python dropped, if it did. A handler runs wherever the
    main thread is, and one that raises inside a weakref callback, a __del__ or a
    GC run (an import's module-lock callback, during start-up) has its exception
    printed ("Exception ignored in") and lost: the run would go on as if no Ctrl-C
    came. Called where the run can stop whole: as start-up ends, at each step."""
    if _dropped[0]:
        _dropped[0] = False
        raise SignalInterrupt


@contextlib.contextmanager
def interrupts_raise() -> Iterator[None]:
    """HELD signals raise SignalInterrupt (a KeyboardInterrupt) while the block
    runs (only the main thread may set handlers: elsewhere, a no-op); one Python
    drops is kept for raise_dropped."""
    if not _in_main_thread():
        yield
        return
    old = {s: signal.signal(s, _raise) for s in handled()}
    _dropped[0] = False
    hook, sys.unraisablehook = sys.unraisablehook, _unraisable(sys.unraisablehook)
    try:
        yield
    finally:
        sys.unraisablehook = hook
        for s, h in old.items():
            signal.signal(s, h)


def run_ending() -> None:
    """The run has printed its last line (interrupted, stopped): from here a signal
    is only recorded, so the close that follows (each process told to shut down,
    then killed) ends whole and nothing prints a second line (a SIGTERM 10 ms
    after a Ctrl-C used to land in the close and report the interrupt again).
    Only where interrupts_raise's handler is in place: its end restores the rest."""
    if _in_main_thread():
        for s in handled():
            if signal.getsignal(s) is _raise:
                signal.signal(s, _note)


def defer_interrupts() -> None:
    """From here until release_interrupts(), the first signal only marks the
    step: once its update has reached the weights, finishing it (sync, log) is
    the only way to save it as a whole."""
    _deferred.update(on=True, hit=False)


def release_interrupts(*, raise_pending: bool = True) -> None:
    """End the deferral; raise KeyboardInterrupt if an interrupt came meanwhile."""
    hit = _deferred["hit"]
    _deferred.update(on=False, hit=False)
    if hit and raise_pending:
        raise KeyboardInterrupt


@contextlib.contextmanager
def step_window() -> Iterator[Callable[[], None]]:
    """One step's interrupt window, from its update to its end (log, save). Yields
    `update_starts`, which the step calls as its update begins (defer_interrupts):
    from then on the first signal only marks the step, and the block's end raises
    it. Leaving the block by an exception ends the deferral without raising."""
    try:
        yield defer_interrupts
    except BaseException:
        release_interrupts(raise_pending=False)
        raise
    release_interrupts()  # an interrupt during the update or save lands here: the step is whole


def stdout_closed() -> None:
    """stdout's reader went away (`areno train | head -3`): stop as a closed
    pipe stops any Unix command, but as an interrupt (save the last finished
    step, the resume line on stderr). Later writes go to /dev/null, so the
    shutdown's own output cannot fail again."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
    _received.append("SIGPIPE")
    raise SignalInterrupt


# --- 3. a pipe message ----------------------------------------------------------

@contextlib.contextmanager
def signals_held() -> Iterator[None]:
    """HELD signals that arrive in the block run their Python handler when it
    ends, in arrival order: a message half sent, or read but not yet counted as
    the rank's reply, would leave the controller waiting for a reply that will
    not come, and the interrupt's save would then find the backend aborted
    ("step N could not be saved", issue 17). Only the main thread runs handlers
    (elsewhere a no-op); handlers that are not Python callables (SIG_IGN,
    SIG_DFL) stay as they are."""
    if not _in_main_thread():
        yield
        return
    seen: list[tuple[int, Any]] = []
    old = {s: h for s in HELD if callable(h := signal.getsignal(s))}
    for s in old:
        signal.signal(s, lambda signum, frame: seen.append((signum, frame)))
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)
        for signum, frame in seen:
            old[signum](signum, frame)


# --- 4. the run's other processes -------------------------------------------------

@contextlib.contextmanager
def spawning() -> Iterator[None]:
    """Start child processes in the block with HELD blocked (the calling thread's
    mask, which a child inherits through fork and exec); the controller's own
    signals that came meanwhile run their handlers at the end."""
    from multiprocessing import resource_tracker

    # Starting the resource tracker unblocks SIGINT and SIGTERM in this thread:
    # a spawn's first start would do it inside the block.
    resource_tracker.ensure_running()
    old = signal.pthread_sigmask(signal.SIG_BLOCK, HELD)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def peer_ignores() -> None:
    """In a rank, engine process or worker, first thing: ignore HELD (a pending
    one is dropped) and unblock them. A signal to the whole job then leaves the
    controller to save and stop the run; SIGKILL (STOP_SIGNAL) and the parent's
    death (procs/lifecycle.py) still end this process."""
    for s in HELD:
        signal.signal(s, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, HELD)
