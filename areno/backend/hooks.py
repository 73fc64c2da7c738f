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

Calls per rollout command on every engine process of split placement
(EngineWorker in engine_proc.py builds its hooks the same way; its
cmd_generate, and cmd_rollout after loading the weights it was sent):
  rollout_begin(peer)      the engine is about to generate this command's prompts
  rollout_end(peer, tokens)
                           generation is done (`tokens` response tokens written);
                           the reply's generate_s includes the time spent here
scripts/arenobench/async_loop.py is the user: its hooks make each train command and each
rollout take a fixed time (sleeping the remainder), stand-ins of given cost.

Any command the controller sends that the worker has no cmd_<name> for:
  command(name) -> fn or None
                           fn(worker, **kwargs) runs it (the suite's fault
                           injection and state reads, tests/rank_test_hooks.py)

Once per engine process, at startup (EngineWorker.__init__, before any command):
  make_engine(cfg, device) -> (engine, kind) or None
                           None (the base): the engine rollout.factory.make_engine
                           builds from cfg.engine; a benchmark may return its own
                           RolloutEngine instead (scripts/arenobench/longcot/ranks.py: the
                           long-CoT bench's synthetic engine, so its modelled
                           generation runs inside the engine process at K = 1)
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from areno.backend.config import BackendConfig
    from areno.backend.handoff import LocalPack
    from areno.backend.step import Micro

RANK_HOOKS_ENV = "ARENO_RANK_HOOKS"


class RankHooks:
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

    def rollout_begin(self, peer: int) -> None:
        """An engine process starts generating (split placement; `peer` = N + i)."""

    def rollout_end(self, peer: int, tokens: int) -> None:
        """The engine process finished generating: `tokens` response tokens."""

    def command(self, name: str) -> Callable[..., Any] | None:
        """A command these hooks add to the rank or engine process (the suite's
        'debug' and 'full_state', tests/rank_test_hooks.py), called as
        fn(worker, **kwargs) when the worker has no cmd_<name>; None: none (the base)."""
        return None

    def make_engine(self, cfg: BackendConfig, device: torch.device) -> tuple[Any, str] | None:
        """An engine process's rollout engine and its kind (the hello's "engine"),
        or None for the one cfg.engine names (the base)."""
        return None


def load_rank_hooks() -> RankHooks:
    """The hooks ARENO_RANK_HOOKS names, built here; the no-op base when unset."""
    spec = os.environ.get(RANK_HOOKS_ENV, "")
    if not spec:
        return RankHooks()
    module, sep, attr = spec.partition(":")
    if not sep or not module or not attr:
        raise ValueError(f"{RANK_HOOKS_ENV}={spec!r}: expected 'module:attr'")
    hooks = getattr(importlib.import_module(module), attr)()
    if not isinstance(hooks, RankHooks):
        raise TypeError(f"{RANK_HOOKS_ENV}={spec!r} built a {type(hooks).__name__}, not a RankHooks")
    return hooks
