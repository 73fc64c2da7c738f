"""ARENO_RANK_HOOKS=gated_rollout_hooks:GatedParts (tests/test_async_loop.py): an
engine process's hf engine, wrapped so that a rollout yields one part per prompt
and, after the first, waits for the controller to have taken that part (the
file GATE_ENV names appears) before it generates the rest. Parts that reached
the controller only with the rollout's final reply would never open the gate
(the engine gives up after gated_engine.WAIT_S and the test fails)."""

from __future__ import annotations

import os
from pathlib import Path

from areno.backend.hooks import RankHooks
from areno.rollout.batch import csr_take
from areno.rollout.factory import make_engine
from gated_engine import wait_until

GATE_ENV = "ARENO_TEST_PART_GATE"


class GatedEngine:
    """The real engine, one prompt at a time, gated after the first."""

    def __init__(self, inner) -> None:
        self.inner = inner

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def generate_stream(self, ids, offsets, n, sampling, min_groups=1):
        gate = Path(os.environ[GATE_ENV])
        for p in range(offsets.size - 1):
            if p == 1:
                wait_until(gate.exists)
            sub_ids, sub_off = csr_take(ids, offsets, [p])
            for pos, part in self.inner.generate_stream(sub_ids, sub_off, n, sampling, min_groups):
                yield pos + p, part


class GatedParts(RankHooks):
    def make_engine(self, cfg, device):
        engine, kind = make_engine(cfg.engine, cfg.model_path, device)
        return GatedEngine(engine), kind
