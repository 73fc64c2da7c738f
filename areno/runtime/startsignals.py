"""Ctrl-C during the first seconds of `areno`, held until a command can handle it.

Start-up imports take seconds (torch, numpy, transformers), and a
KeyboardInterrupt raised inside one leaves the module half-initialised: a later
import of it fails with a traceback ("CPU dispatcher tracer already
initialized", a circular import in accelerate), and one raised while a C
extension runs Python code makes CPython end by SIGINT after areno's own clean
exit (status -2, not 130). So from `main()` on, SIGINT, SIGTERM and SIGHUP are
only recorded until the command takes them: `train` at the start of its run
(`interrupt.interrupts_raise`, which stops at once with the start-up message
if one came), the other commands as they start (`release`).
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator

HELD = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
_pending: list[str] = []  # the held signals' names, oldest first
_holding = [False]


def _record(signum: int, _frame: object) -> None:
    _pending.append(signal.Signals(signum).name)


@contextlib.contextmanager
def held() -> Iterator[None]:
    """Record HELD signals instead of acting on them until `take()`/`release()`;
    the handlers in place before are back at the end (main() called in-process)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    old = {s: signal.signal(s, _record) for s in HELD}
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
    KeyboardInterrupt again (now, if one came meanwhile), SIGTERM and SIGHUP kill."""
    if not _holding[0]:
        return
    got = take()
    signal.signal(signal.SIGINT, signal.default_int_handler)
    for s in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(s, signal.SIG_DFL)
    if got:
        raise KeyboardInterrupt
