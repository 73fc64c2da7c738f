"""The suite's rank-side commands, installed in every rank and engine process the
tests start through ARENO_RANK_HOOKS (set in tests/conftest.py; see
areno/backend/hooks.py): fault injection ('debug'), a read of the full weights
('full_state') and whether the collector is on ('gc_state'). Nothing in a run has them."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from areno.backend.hooks import RankHooks


def cmd_debug(worker: Any, action: str, seconds: float = 0.0) -> None:
    """'sleep' (a long command), 'raise' (a failing one), 'barrier' (ranks only), 'noop'."""
    if action == "sleep":
        time.sleep(seconds)
    elif action == "raise":
        where = f"rank {worker.rank}" if hasattr(worker, "rank") else f"engine process {worker.index}"
        raise RuntimeError(f"debug failure requested on {where}")
    elif action == "barrier" and hasattr(worker, "rank"):
        import torch.distributed as dist

        dist.barrier()


def hold_until_queued(worker: Any, count: int, wait_s: float = 60.0) -> None:
    """An engine process waits (at most wait_s) until `count` commands are queued
    behind this one, so a test's rollouts are all there when the first starts
    (tests/test_tail_fill.py)."""
    deadline = time.monotonic() + wait_s
    while len(worker.inbox) < count and time.monotonic() < deadline:
        time.sleep(0.01)


def gc_state(worker: Any) -> bool:
    """Whether the cyclic collector is on: again, after the peer's start-up paused
    it (procs.lifecycle.start_up)."""
    import gc

    return gc.isenabled()


def full_state(worker: Any) -> dict | None:
    """Every exported tensor of a RankWorker, gathered to CPU (rank 0; None elsewhere)."""
    out = {n: t.to("cpu", copy=True) for n, t in worker.full_state()}
    return out if worker.rank == 0 else None


class TestRankHooks(RankHooks):
    __test__ = False  # not a pytest class

    COMMANDS: dict[str, Callable[..., Any]] = {"debug": cmd_debug, "full_state": full_state,
                                                "hold_until_queued": hold_until_queued, "gc_state": gc_state}

    def command(self, name: str) -> Callable[..., Any] | None:
        return self.COMMANDS.get(name)


def full_state_dict(be: Any) -> dict:
    """A running backend's full weights, from rank 0 (the 'full_state' command)."""
    return be.command("full_state")[0]
