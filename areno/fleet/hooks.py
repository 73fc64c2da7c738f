"""EngineHooks: an optional observer of an engine process's rollouts, for
benchmarks, and the commands the suite adds (backend/hooks.py's RankHooks
extends it for the ranks; ARENO_RANK_HOOKS names one class for both).

Calls per rollout command on every engine process of split placement
(fleet/engine_proc.py's cmd_generate, and cmd_rollout after loading the weights
it was sent):
  rollout_begin(index)     the engine is about to generate this command's prompts
  rollout_end(index, tokens)
                           generation is done (`tokens` response tokens written);
                           the reply's generate_s includes the time spent here
scripts/arenobench/async_loop.py is the user: its hooks make each rollout take a
fixed time (sleeping the remainder), a stand-in of given cost.

Any command the controller sends that the worker has no cmd_<name> for:
  command(name) -> fn or None
                           fn(worker, **kwargs) runs it (the suite's fault
                           injection and state reads, tests/rank_test_hooks.py)

Once per engine process, at startup (EngineWorker.__init__, before any command):
  make_engine(cfg, device) -> (engine, kind) or None
                           None (the base): the engine rollout.factory.make_engine
                           builds from cfg.engine (an EngineProcsConfig); a
                           benchmark may return its own RolloutEngine instead
                           (scripts/arenobench/longcot/ranks.py)
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    import torch

    from areno.fleet.engine_procs import EngineProcsConfig

RANK_HOOKS_ENV = "ARENO_RANK_HOOKS"
H = TypeVar("H", bound="EngineHooks")


class EngineHooks:
    """No-op base: subclass (RankHooks) and name it in ARENO_RANK_HOOKS."""

    def rollout_begin(self, index: int) -> None:
        """Engine process `index` starts generating (split placement)."""

    def rollout_end(self, index: int, tokens: int) -> None:
        """The engine process finished generating: `tokens` response tokens."""

    def command(self, name: str) -> Callable[..., Any] | None:
        """A command these hooks add to the rank or engine process (the suite's
        'debug' and 'full_state', tests/rank_test_hooks.py), called as
        fn(worker, **kwargs) when the worker has no cmd_<name>; None: none (the base)."""
        return None

    def make_engine(self, cfg: EngineProcsConfig, device: torch.device) -> tuple[Any, str] | None:
        """An engine process's rollout engine and its kind (the hello's "engine"),
        or None for the one cfg.engine names (the base)."""
        return None


def load_hooks(base: type[H]) -> H:
    """The hooks ARENO_RANK_HOOKS names, built here (a `base`); base() when unset."""
    spec = os.environ.get(RANK_HOOKS_ENV, "")
    if not spec:
        return base()
    module, sep, attr = spec.partition(":")
    if not sep or not module or not attr:
        raise ValueError(f"{RANK_HOOKS_ENV}={spec!r}: expected 'module:attr'")
    hooks = getattr(importlib.import_module(module), attr)()
    if not isinstance(hooks, base):
        raise TypeError(f"{RANK_HOOKS_ENV}={spec!r} built a {type(hooks).__name__}, not a {base.__name__}")
    return hooks
