"""ARENO_RANK_HOOKS=offer_gate_hooks:OfferGate (tests/test_partial_rollouts.py): an
engine process's engine, wrapped so that from its second partial round on, at
decode step GATE_STEP of its first generate call, it waits (at most
gated_engine.WAIT_S) until the controller has offered newer weights
(fleet/inflight_loads.py), and before it takes none (an offer that comes earlier
waits for that step). A round thus spans a publish whatever the timing: its
first GATE_STEP tokens are sampled by the version it started with, the rest by
the offered one."""

from __future__ import annotations

from typing import Any, Callable

from areno.rollout.factory import make_engine
from gated_engine import StepGatedEngine, wait_until
from rank_test_hooks import TestRankHooks

GATE_STEP = 2


class OfferGatedEngine(StepGatedEngine):
    """The real engine; its step hook waits once a round for an offer at GATE_STEP."""

    def gate(self, hook: Callable[[int], None], loads: Any) -> Callable[[int], None]:
        state = {"gated": self.rounds >= 2}  # once a round (a multi-turn one generates per turn)

        def gated(steps: int) -> None:
            if state["gated"] and steps < GATE_STEP:
                return  # an offer that came early waits: the first GATE_STEP tokens are the start version's
            if state["gated"] and steps == GATE_STEP:
                state["gated"] = False
                wait_until(lambda: loads._offer is not None)
            hook(steps)
        return gated


class OfferGate(TestRankHooks):  # keeps the suite's commands
    def make_engine(self, cfg, device):
        engine, kind = make_engine(cfg.engine, cfg.model_path, device)
        return OfferGatedEngine(engine), kind
