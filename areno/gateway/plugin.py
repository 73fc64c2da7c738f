"""Agent plugins (--agent-path): the contract, loading, calling one in a worker.

An agent is one Python file that defines

    def agent(task: AgentTask) -> float | None   # may be async

It runs however it likes against the OpenAI-compatible endpoint at
`task.base_url` (key `task.api_key`: any OpenAI client, `OPENAI_BASE_URL`;
`task.client()` / `task.async_client()` give one bound to the run over the
worker's shared connections),
and returns the run's reward, or None when the run has --reward-fn-path
(`task.reward_fn`): that plugin then scores the final conversation
(gateway/driver.py, AgentDriver._score_later). Each call of `agent` is one trajectory: its own
base URL, so concurrent runs never mix. It runs on the reward pool's worker
processes (rewards/pool.py, kind "agent"): --reward-timeout bounds a whole run,
--on-reward-error handles a raise, a timeout or a crash, and a timeout or
crash kills the worker's process group. An async agent runs up to
--agent-concurrency runs at once per worker (rewards/concurrent.py): a run past
the timeout is cancelled there, and only a run that blocks the worker's event
loop (or a crash) costs the kill, and with it the worker's other runs.
"""

from __future__ import annotations

import asyncio
import inspect
import math
import numbers
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from areno.errors import UserError, import_user_file, is_signal_interrupt, one_line, user_frame
from areno.gateway.clients import async_client, sync_client
from areno.rewards.plugin import STATUS_ERROR, STATUS_OK, STATUS_TIMEOUT, PluginKind, short_repr


SCORE_LATER = "reward_fn"  # a run's payload when agent() returned None: the reward plugin scores it


@dataclass(frozen=True)
class AgentTask:
    """What an agent run gets: its dataset row and its own endpoint."""

    prompt: str  # the row's rendered prompt text (the agent may build its own messages)
    answer: str | None  # the row's reference answer, if any
    solutions: list | None
    row: dict  # the normalized source row
    index: int  # trajectory (sample) index in the step
    base_url: str  # http://127.0.0.1:PORT/runs/<key>/v1: this run's OpenAI endpoint
    api_key: str  # the same run's key (also accepted on /v1 as a Bearer token)
    model: str = "policy"  # any model name is accepted
    reward_fn: bool = False  # agent() may return None: --reward-fn-path scores the final conversation

    def client(self) -> Any:
        """An `openai.OpenAI` bound to this run, sharing the worker's connections
        (gateway/clients.py: far cheaper than making one per run)."""
        return sync_client(self.base_url, self.api_key)

    def async_client(self) -> Any:
        """An `openai.AsyncOpenAI` bound to this run (call it inside the agent's
        coroutine), sharing the worker's connections."""
        return async_client(self.base_url, self.api_key)


@dataclass(frozen=True)
class AgentPlugin:
    path: str
    fn: Callable
    is_async: bool
    batch: bool = False  # the pool's batch mode is for reward_fn_batch only


def load_agent_plugin(path: str) -> AgentPlugin:
    """Import and check an agent file; every problem is a UserError naming it."""
    module = import_user_file(path, what="agent")
    fn = getattr(module, "agent", None)
    if fn is None:
        raise UserError(f"agent {path}: defines no agent(task) -> reward (the function the run calls "
                        "once per trajectory)")
    if not callable(fn):
        raise UserError(f"agent {path}: 'agent' is a {type(fn).__name__}, not a function")
    return AgentPlugin(str(path), fn, inspect.iscoroutinefunction(fn))


def call_agent(plugin: AgentPlugin, task: AgentTask, loop: Any) -> tuple[int, float, str, Any]:
    """One agent run -> (status, reward, message, None)."""
    try:
        out = plugin.fn(task)
        if inspect.isawaitable(out):
            out = (loop or asyncio.new_event_loop()).run_until_complete(out)
    except BaseException as e:  # noqa: BLE001 - SystemExit is the agent's error too
        if is_signal_interrupt(e):
            raise
        return _raised(plugin, e)
    return _reward(out, task)


async def acall_agent(plugin: AgentPlugin, task: AgentTask, timeout: float) -> tuple[int, float, str, Any]:
    """One run of an async agent among others on one worker's event loop
    (--agent-concurrency, rewards/concurrent.py): past `timeout` it is cancelled
    (STATUS_TIMEOUT), and neither that nor a raise touches the other runs."""
    try:
        out = await asyncio.wait_for(plugin.fn(task), timeout)
    except asyncio.TimeoutError:
        return STATUS_TIMEOUT, math.nan, f"timed out after {timeout:g} s (this run cancelled)", None
    except Exception as e:  # noqa: BLE001 - the agent's error; a cancel of the worker's loop passes
        return _raised(plugin, e)
    return _reward(out, task)


def _raised(plugin: AgentPlugin, e: BaseException) -> tuple[int, float, str, Any]:
    return STATUS_ERROR, math.nan, f"raised {one_line(e)}{user_frame(e, plugin.path)}", None


def _reward(out: Any, task: AgentTask) -> tuple[int, float, str, Any]:
    """A run's return -> its status, reward and payload (SCORE_LATER: None under --reward-fn-path)."""
    if out is None and task.reward_fn:
        return STATUS_OK, 0.0, "", SCORE_LATER
    if not isinstance(out, (numbers.Real, np.bool_)):
        hint = "" if task.reward_fn else " or None with --reward-fn-path"
        return STATUS_ERROR, math.nan, f"agent returned {short_repr(out)}, not a reward (a number{hint})", None
    return STATUS_OK, float(out), "", None


KIND = PluginKind("agent", load_agent_plugin, call_agent, acall_agent)
