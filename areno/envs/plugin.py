"""Environment plugins: the contract, loading, calling one in a worker.

An environment is one Python file (`--env-path`) that defines

    def step(state: EnvState, completion: str) -> tuple[str, float, bool]
        # -> (observation, reward, done)
    def reset(state: EnvState) -> None        # optional

either may be `async def`. `reset` runs once per trajectory before its first
turn and may fill `state.data`; `step` gets each turn's decoded completion.
`state.data` is the plugin's: it travels with the trajectory (pickled to the
worker that takes the next call, and back), so any worker can take any call
and a killed one loses nothing. The calls run on the reward pool's workers
(rewards/pool.py, kind "env"): timeouts, on_error and the process-group kill
are the reward plugin's.
"""

from __future__ import annotations

import asyncio
import inspect
import math
import numbers
import pickle
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from areno.errors import UserError, import_user_file, is_signal_interrupt, one_line, user_frame
from areno.rewards.plugin import STATUS_ERROR, STATUS_OK, PluginKind, short_repr


@dataclass
class EnvState:
    """What an environment sees of one trajectory."""

    prompt: str  # the rendered prompt text
    answer: str | None  # the row's reference answer, if any
    solutions: list | None  # the row's reference solutions, if any
    row: dict  # the normalized source row
    index: int  # trajectory (sample) index in the step
    turn: int = 0  # 0-based: the turn whose completion step() is given
    data: dict = field(default_factory=dict)  # the plugin's own, carried between calls


@dataclass(frozen=True)
class EnvCall:
    """One call for a worker: reset (completion None) or step."""

    state: EnvState
    completion: str | None
    index: int  # the sample index, for the pool's messages


@dataclass(frozen=True)
class EnvReply:
    """What a call returned beside the reward (the pool's payload)."""

    observation: str
    done: bool
    data: dict


@dataclass(frozen=True)
class EnvPlugin:
    path: str
    step: Callable
    reset: Callable | None
    is_async: bool
    batch: bool = False  # the pool's batch mode is for reward_fn_batch only


def load_env_plugin(path: str) -> EnvPlugin:
    """Import and check an environment file; every problem is a UserError naming it."""
    module = import_user_file(path, what="environment")
    fns = {}
    for name in ("step", "reset"):
        fn = getattr(module, name, None)
        if fn is not None and not callable(fn):
            raise UserError(f"environment {path}: '{name}' is a {type(fn).__name__}, not a function")
        fns[name] = fn
    if fns["step"] is None:
        raise UserError(f"environment {path}: defines no step(state, completion) -> "
                        "(observation, reward, done)")
    is_async = any(inspect.iscoroutinefunction(f) for f in fns.values() if f is not None)
    return EnvPlugin(str(path), fns["step"], fns["reset"], is_async)


def _run(fn: Callable, args: tuple, loop: asyncio.AbstractEventLoop | None) -> Any:
    out = fn(*args)
    if inspect.isawaitable(out):
        out = (loop or asyncio.new_event_loop()).run_until_complete(out)
    return out


def call_env(plugin: EnvPlugin, call: EnvCall, loop: Any) -> tuple[int, float, str, Any]:
    """One reset or step -> (status, reward, message, EnvReply or None)."""
    state = call.state
    try:
        if call.completion is None:
            if plugin.reset is not None:
                _run(plugin.reset, (state,), loop)
            return _carried(STATUS_OK, 0.0, "", EnvReply("", False, state.data), "reset")
        out = _run(plugin.step, (state, call.completion), loop)
    except BaseException as e:  # noqa: BLE001 - SystemExit is the plugin's error too
        if is_signal_interrupt(e):
            raise
        what = "reset" if call.completion is None else "step"
        return STATUS_ERROR, math.nan, f"{what} raised {one_line(e)}{user_frame(e, plugin.path)}", None
    ok = (isinstance(out, tuple) and len(out) == 3 and isinstance(out[0], (str, type(None)))
          and isinstance(out[1], (numbers.Real, np.bool_)) and isinstance(out[2], (bool, np.bool_, int)))
    if not ok:
        return (STATUS_ERROR, math.nan, f"step returned {short_repr(out)}, not (observation: str, "
                "reward: float, done: bool)", None)
    return _carried(STATUS_OK, float(out[1]), "", EnvReply(out[0] or "", bool(out[2]), state.data), "step")


def _carried(status: int, reward: float, msg: str, reply: EnvReply, what: str) -> tuple[int, float, str, Any]:
    """The call's result, unless state.data cannot travel to the next call's worker
    (pickled, even in-process, so a run behaves the same at any --reward-workers):
    then the call fails, saying so, instead of its worker dying on the way back."""
    try:
        pickle.dumps(reply.data)
    except Exception as e:  # noqa: BLE001 - whatever the plugin put there
        return (STATUS_ERROR, math.nan, f"{what} left state.data that cannot be pickled "
                f"(it travels between workers): {one_line(e)}", None)
    return status, reward, msg, reply


KIND = PluginKind("environment", load_env_plugin, call_env)
