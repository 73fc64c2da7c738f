"""PhaseTimer: the wall time of a step's phases (time/<phase> metrics), and the
spans benchmarks read."""

from __future__ import annotations

import os
import time
from contextlib import contextmanager
from typing import Iterator


class PhaseTimer:
    """Wall time per phase of one step: `times[phase]`, seconds summed over the
    phase's intervals (the step's time/<phase> metrics).

    The timing hook for benchmarks (scripts/bench_longcot.py): pass
    `PhaseTimer(keep_spans=True)` to `train_step` and read `spans` afterwards,
    one (phase, start, end, cpu_s) per interval, start/end on time.monotonic
    (one clock for the controller and its child processes), cpu_s the calling
    thread's CPU time in it. Spans include the sub-phases `span()` marks inside
    a phase (advantages and pack in materialize, ...); those add nothing to
    `times`, whose phases already hold their time."""

    def __init__(self, keep_spans: bool = False) -> None:
        self.times: dict[str, float] = {}
        self.spans: list[tuple[str, float, float, float]] | None = [] if keep_spans else None

    @contextmanager
    def __call__(self, phase: str) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            with self.span(phase):
                yield
        finally:
            self.times[phase] = self.times.get(phase, 0.0) + time.perf_counter() - t0

    @contextmanager
    def span(self, phase: str) -> Iterator[None]:
        """A sub-phase: kept in `spans` (when kept), not added to `times`."""
        if self.spans is None:
            yield
            return
        c0, t0 = time.thread_time(), time.monotonic()
        try:
            yield
        finally:
            self.spans.append((phase, t0, time.monotonic(), time.thread_time() - c0))

    def absorb(self, other: "PhaseTimer", move: bool = False) -> None:
        """Add `other`'s phases and spans (a rollout's own timer: the decode and
        reward it ran while it streamed in, during earlier steps too); move:
        `other` starts afresh (a rollout taken over several steps counts each once)."""
        for phase, t in other.times.items():
            self.times[phase] = self.times.get(phase, 0.0) + t
        if self.spans is not None and other.spans is not None:
            self.spans.extend(other.spans)
        if move:
            other.times.clear()
            if other.spans is not None:
                other.spans.clear()


STARTUP_TRACE_ENV = "ARENO_STARTUP_TRACE"


def startup_mark(label: str) -> None:
    """Append `<unix time> <pid> <label>` to $ARENO_STARTUP_TRACE, if set: the
    start-up milestones of the controller and its ranks, which
    scripts/bench_startup.py lays out as a table (one clock for all processes)."""
    path = os.environ.get(STARTUP_TRACE_ENV)
    if path:
        with open(path, "a") as f:
            f.write(f"{time.time():.4f} {os.getpid()} {label}\n")
