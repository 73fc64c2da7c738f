"""ARENO_RANK_HOOKS=offer_gate_hooks:OfferGate (tests/test_partial_rollouts.py): an
engine process's engine, wrapped so that from its second partial round on (a
round under --partial-rollouts installs the step hook once: InflightLoads.begin),
at decode step GATE_STEP of its first generate call, it waits (at most WAIT_S)
until the controller has offered newer weights (fleet/inflight_loads.py), and
before it takes none (an offer that comes earlier waits for that step). A
round thus spans a publish whatever the timing: its first GATE_STEP tokens are
sampled by the version it started with, the rest by the offered one."""

from __future__ import annotations

import time
from typing import Any

from areno.rollout.factory import make_engine
from rank_test_hooks import TestRankHooks

GATE_STEP = 2
WAIT_S = 60.0


class OfferGatedEngine:
    """The real engine; its step hook waits once a round for an offer at GATE_STEP."""

    def __init__(self, inner: Any) -> None:
        object.__setattr__(self, "inner", inner)
        object.__setattr__(self, "rounds", 0)
        object.__setattr__(self, "gated", False)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def __setattr__(self, name: str, value: Any) -> None:
        if name == "step_hook" and value is not None:  # a partial round begins
            object.__setattr__(self, "rounds", self.rounds + 1)
            object.__setattr__(self, "gated", self.rounds >= 2)
            value = self._gate(value)
        setattr(self.inner, name, value)

    def _gate(self, hook: Any) -> Any:
        loads = hook.__self__  # InflightLoads.step, bound

        def gated(steps: int) -> None:
            if self.gated and steps < GATE_STEP:
                return  # an offer that came early waits: the first GATE_STEP tokens are the start version's
            if self.gated and steps == GATE_STEP:  # once a round (a multi-turn one generates per turn)
                object.__setattr__(self, "gated", False)
                deadline = time.monotonic() + WAIT_S
                while loads._offer is None and time.monotonic() < deadline:
                    time.sleep(0.01)
            hook(steps)
        return gated


class OfferGate(TestRankHooks):  # keeps the suite's commands
    def make_engine(self, cfg, device):
        engine, kind = make_engine(cfg.engine, cfg.model_path, device)
        return OfferGatedEngine(engine), kind
