"""ARENO_RANK_HOOKS=halt_gate_hooks:HaltGate (tests/test_halt_resume.py): an engine
process's engine, wrapped so that in its second partial round (a round under
--partial-rollouts installs the step hook once: InflightLoads.begin), at decode
step HALT_STEP, it waits (at most WAIT_S) until the controller has sent the
interrupt's halt (fleet/inflight_loads.py). The round is thus halted exactly at
that step whatever the timing: each of its samples holds HALT_STEP tokens, or
fewer where it stopped by itself."""

from __future__ import annotations

import time
from typing import Any

from areno.rollout.factory import make_engine
from rank_test_hooks import TestRankHooks

HALT_STEP = 2
WAIT_S = 60.0


class HaltGatedEngine:
    """The real engine; its step hook waits in round 2 for the halt at HALT_STEP."""

    def __init__(self, inner: Any) -> None:
        object.__setattr__(self, "inner", inner)
        object.__setattr__(self, "rounds", 0)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def __setattr__(self, name: str, value: Any) -> None:
        if name == "step_hook" and value is not None:  # a partial round begins
            object.__setattr__(self, "rounds", self.rounds + 1)
            if self.rounds == 2:
                value = self._gate(value)
        setattr(self.inner, name, value)

    def _gate(self, hook: Any) -> Any:
        loads = hook.__self__  # InflightLoads.step, bound

        def gated(steps: int) -> None:
            if steps == HALT_STEP:
                deadline = time.monotonic() + WAIT_S
                while not loads._halt and time.monotonic() < deadline:
                    time.sleep(0.01)
            hook(steps)
        return gated


class HaltGate(TestRankHooks):  # keeps the suite's commands
    def make_engine(self, cfg, device):
        engine, kind = make_engine(cfg.engine, cfg.model_path, device)
        return HaltGatedEngine(engine), kind
