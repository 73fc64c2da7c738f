"""RankHooks: an optional observer of a rank's train command (and of an engine
process's rollout), for benchmarks, and the commands the suite adds to them.

A normal run uses the base class, whose methods do nothing. Set
`ARENO_RANK_HOOKS=module:attr` in the controller's environment and every rank
builds its hooks once at startup by calling `attr()` from `module` (a
RankHooks subclass); spawned ranks inherit the controller's environment and
sys.path (torchrun ranks: its PYTHONPATH), so any module the controller can
import, the benchmarks' (scripts/arenobench/) or the suite's (tests/), imports there.
scripts/arenobench/longcot/ranks.py is the user: it times the ranks' arrival at the first
collective, counts device-to-host readbacks, and bounds the compute of a
1M-token step on CPU ranks, without patching areno.

Calls per train command, in order, on every rank:
  train_begin(rank)        the command started; the pack is not mapped yet
  before_update(micros)    every micro-batch is on the device, nothing has run
                           forward (RankTrainer.train)
  train_end(rank, local, reply)
                           the reply is ready; not called if the command raised

Engine processes (fleet/engine_proc.py) call the hooks of fleet/hooks.py,
which RankHooks extends (rollout_begin/end, command, make_engine): one class
named in ARENO_RANK_HOOKS serves both.

Any command the controller sends that the worker has no cmd_<name> for:
  command(name) -> fn or None
                           fn(worker, **kwargs) runs it (the suite's fault
                           injection and state reads, tests/rank_test_hooks.py)
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from areno.fleet.hooks import RANK_HOOKS_ENV, EngineHooks, load_hooks

if TYPE_CHECKING:
    from areno.backend.handoff import LocalPack
    from areno.backend.step import Micro

__all__ = ["RANK_HOOKS_ENV", "RankHooks", "load_rank_hooks"]


class RankHooks(EngineHooks):
    """No-op base: subclass and name it in ARENO_RANK_HOOKS (see the module docstring)."""

    def train_begin(self, rank: int) -> None:
        """The train command started (before the pack is mapped)."""

    def before_update(self, micros: list[list[Micro]]) -> list[list[Micro]]:
        """Every micro-batch is on the device, [mini-batch][micro]; nothing has run
        forward yet. Every rank reaches this point in every train command, so a
        hook may run a collective here. Returns the micro-batches to train: a
        benchmark may keep a subset of each mini-batch to bound compute (the
        metrics then cover that subset); the base keeps them all."""
        return micros

    def train_end(self, rank: int, local: LocalPack, reply: dict) -> None:
        """The command's reply ({"steps", "map_s", "train_s", ...}) is about to be sent."""


def load_rank_hooks() -> RankHooks:
    """The hooks ARENO_RANK_HOOKS names, built here; the no-op base when unset."""
    return load_hooks(RankHooks)
