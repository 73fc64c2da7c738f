"""ARENO_RANK_HOOKS=halt_gate_hooks:HaltGate (tests/test_halt_resume.py): an engine
process's engine, wrapped so that in its second partial round, at decode step
HALT_STEP, it waits (at most gated_engine.WAIT_S) until the controller has sent
the interrupt's halt (fleet/inflight_loads.py). The round is thus halted exactly
at that step whatever the timing: each of its samples holds HALT_STEP tokens, or
fewer where it stopped by itself."""

from __future__ import annotations

from typing import Any, Callable

from areno.rollout.factory import make_engine
from gated_engine import StepGatedEngine, wait_until
from rank_test_hooks import TestRankHooks

HALT_STEP = 2


class HaltGatedEngine(StepGatedEngine):
    """The real engine; its step hook waits in round 2 for the halt at HALT_STEP."""

    def gate(self, hook: Callable[[int], None], loads: Any) -> Callable[[int], None]:
        if self.rounds != 2:
            return hook

        def gated(steps: int) -> None:
            if steps == HALT_STEP:
                wait_until(lambda: loads._halt)
            hook(steps)
        return gated


class HaltGate(TestRankHooks):  # keeps the suite's commands
    def make_engine(self, cfg, device):
        engine, kind = make_engine(cfg.engine, cfg.model_path, device)
        return HaltGatedEngine(engine), kind
