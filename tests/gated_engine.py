"""The engine wrapper that tests/halt_gate_hooks.py and tests/offer_gate_hooks.py
share: the real engine, whose step hook (installed once per partial round by
InflightLoads.begin) a subclass wraps to wait at a chosen decode step, so a
round meets a halt or an offer at that step whatever the timing."""

from __future__ import annotations

import time
from typing import Any, Callable

WAIT_S = 60.0


def wait_until(ready: Callable[[], bool], limit_s: float = WAIT_S) -> None:
    """Poll `ready` every 10 ms until it holds or `limit_s` pass."""
    deadline = time.monotonic() + limit_s
    while not ready() and time.monotonic() < deadline:
        time.sleep(0.01)


class StepGatedEngine:
    """The real engine; `gate(hook, loads)` wraps each partial round's step hook
    (InflightLoads.step, bound: `loads` is its InflightLoads). `rounds` counts
    the partial rounds begun."""

    def __init__(self, inner: Any) -> None:
        object.__setattr__(self, "inner", inner)
        object.__setattr__(self, "rounds", 0)

    def __getattr__(self, name: str) -> Any:
        if name == "generate_rounds":
            # No tail fill: a round that joins another's loop sets no step hook of
            # its own, so the gate could not hold it at its step. Each round runs
            # as its own command (test_tail_fill.py holds tail fill).
            raise AttributeError(name)
        return getattr(self.inner, name)

    def __setattr__(self, name: str, value: Any) -> None:
        if name == "step_hook" and value is not None:  # a partial round begins
            object.__setattr__(self, "rounds", self.rounds + 1)
            value = self.gate(value, value.__self__)
        setattr(self.inner, name, value)

    def gate(self, hook: Callable[[int], None], loads: Any) -> Callable[[int], None]:
        raise NotImplementedError
