"""Rank heartbeats: is every rank process still running?

A rank that dies is seen at once (its process sentinel); one that is stopped
(SIGSTOP, a debugger, a frozen container) or whose interpreter cannot run any
more is not: its pipe just stays quiet, and a command may legitimately take
an hour. So each spawned rank runs a thread that writes `time.monotonic()`
(one clock for every process of the host) into its slot of a shared float64
array every BEAT_S seconds, and the controller checks the slots while it waits
on the ranks and between commands. A rank silent for longer than the bound is
stuck: the run stops with one line naming it, and the rank is SIGKILLed (the
one signal a stopped process cannot ignore).

The bound is `timeout_s` when given (> 0), else max(AUTO_FLOOR_S, AUTO_FACTOR x
the longest gap between two beats seen so far): a rank whose thread is often
held up (a long C call holding the GIL) gets more room, a healthy one 30 s.
Ranks started by torchrun on other hosts share no memory and are not watched.
"""

from __future__ import annotations

import threading
import time
from typing import Any

BEAT_S = 0.5  # how often a rank beats
AUTO_FLOOR_S = 30.0
AUTO_FACTOR = 3.0


def start_beating(slots: Any, rank: int) -> None:
    """In a rank process: write the time into slots[rank] every BEAT_S, for ever
    (a daemon thread; it dies with the process)."""
    def beat() -> None:
        while True:
            slots[rank] = time.monotonic()
            time.sleep(BEAT_S)

    threading.Thread(target=beat, name="areno-heartbeat", daemon=True).start()


class HeartbeatWatch:
    """Controller side: the shared slots ([world_size] float64 monotonic times,
    0 = no beat yet) and the bound."""

    def __init__(self, world_size: int, timeout_s: float = 0.0) -> None:
        import multiprocessing as mp

        self.slots = mp.get_context("spawn").RawArray("d", world_size)
        self.timeout_s = float(timeout_s)
        self.longest_gap = 0.0
        self._seen = [0.0] * world_size

    def bound(self) -> float:
        """Seconds of silence after which a rank counts as stuck."""
        if self.timeout_s > 0:
            return self.timeout_s
        return max(AUTO_FLOOR_S, AUTO_FACTOR * self.longest_gap)

    def silent(self, now: float | None = None) -> tuple[int, float] | None:
        """(rank, seconds silent) of the first rank silent past the bound, else None."""
        now = time.monotonic() if now is None else now
        for r in range(len(self._seen)):
            t = self.slots[r]
            if t != self._seen[r]:
                if self._seen[r]:
                    self.longest_gap = max(self.longest_gap, t - self._seen[r])
                self._seen[r] = t
        bound = self.bound()
        for r, t in enumerate(self._seen):
            if t and now - t > bound:
                return r, now - t
        return None


def stuck_rank_error(watch: "HeartbeatWatch | None", procs: list, what: str, label=lambda r: f"rank {r}"):
    """The BackendError for a rank silent past the bound, after SIGKILLing it
    (it may be stopped: SIGTERM would wait for a SIGCONT); None when all beat."""
    import os
    import signal

    from areno.procs.errors import BackendError

    found = watch.silent() if watch is not None else None
    if found is None:
        return None
    r, gap = found
    pid = procs[r].pid
    try:
        os.kill(pid, signal.SIGKILL)
    except OSError:
        pass
    return BackendError(f"{what}: {label(r)} (pid {pid}) sent no heartbeat for {gap:.0f}s (bound "
                        f"{watch.bound():g}s, --rank-heartbeat-timeout): stopped or frozen, so it "
                        "was killed", rank=r)
