"""ARENO_RANK_HOOKS=cut_gate_hooks:CutGate (tests/test_cut_at_deadline.py): an
engine process's engine, tail fill kept, wrapped so that every sample runs to
its token cap (ignore_eos: none ends by itself) and, once its first partial
round has streamed every group, the next decode step waits (at most
gated_engine.WAIT_S) until the controller has offered newer weights. The round
queued behind it (admitted with the same version) is then generating when its
deadline comes with that offer (--cut-at-deadline at K = 1), whatever the
timing: each of its samples is cut after its first token."""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Callable, Iterator

from areno.rollout.factory import make_engine
from gated_engine import StepGatedEngine, wait_until
from rank_test_hooks import TestRankHooks


class CutGatedEngine(StepGatedEngine):
    """The real engine, tail fill kept (generate_rounds, defined here, is found
    before StepGatedEngine's __getattr__ hides it): it counts the first round's
    groups streamed, and the step hook waits once for an offer after the last."""

    def __init__(self, inner: Any) -> None:
        super().__init__(inner)
        object.__setattr__(self, "state", {"first_done": False, "gated": False})

    def gate(self, hook: Callable[[int], None], loads: Any) -> Callable[[int], None]:
        def gated(steps: int) -> None:
            if self.state["first_done"] and not self.state["gated"]:
                self.state["gated"] = True
                wait_until(lambda: loads._offer is not None)
            hook(steps)
        return gated

    def generate_rounds(self, first: Any, admit: Callable[[int], Any]) -> Iterator[Any]:
        def long(req: Any) -> Any:
            return None if req is None else replace(req, sampling=replace(req.sampling, ignore_eos=True))

        left = first.offsets.size - 1
        for k, pos, part in self.inner.generate_rounds(long(first), lambda running: long(admit(running))):
            left -= pos.size if k == 0 else 0
            self.state["first_done"] |= left == 0
            yield k, pos, part


class CutGate(TestRankHooks):  # keeps the suite's commands
    def make_engine(self, cfg, device):
        engine, kind = make_engine(cfg.engine, cfg.model_path, device)
        return CutGatedEngine(engine), kind
