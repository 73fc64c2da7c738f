"""Hold Ctrl-C/SIGTERM across a pipe read or write, so that an interrupt can
never split one: a message half sent, or read but not yet counted as the
rank's reply, leaves the controller waiting for a reply that will not come,
and the interrupt's save then finds the backend aborted ("step N could not be
saved", issue 17). The held signal is re-delivered, to the handler that was
there, as soon as the block ends."""

from __future__ import annotations

import contextlib
import signal
import threading
from typing import Any, Iterator

HELD = (signal.SIGINT, signal.SIGTERM)


@contextlib.contextmanager
def signals_held() -> Iterator[None]:
    """SIGINT/SIGTERM that arrive in the block run their Python handler when it
    ends, in arrival order (only the main thread runs handlers: elsewhere a no-op).
    Handlers that are not Python callables (SIG_IGN, SIG_DFL) stay as they are."""
    if threading.current_thread() is not threading.main_thread():
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
