"""Reward plugins: the contract, loading, calling one, and the result types.

A reward plugin is one Python file (`--reward-fn-path`) that defines either

    def reward_fn(record: RewardRecord) -> float           # one sample
    def reward_fn_batch(records: list[RewardRecord]) -> list[float]

and either may be `async def`. If both are defined, `reward_fn_batch` is used.
`reward_records` builds the records of a step; `areno.rewards.pool.RewardScorer`
runs the plugin on them, in worker processes or inline.
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
import math
import numbers
import threading
import typing
from dataclasses import dataclass, fields
from typing import Any, Awaitable, Callable

import numpy as np

from areno.choices import OnError
from areno.errors import UserError, one_line, import_user_file, is_signal_interrupt, user_frame
from areno.rollout.batch import FINISH_REASONS

ON_ERROR: tuple[str, ...] = typing.get_args(OnError)
FAILURE_KINDS = ("errors", "timeouts", "nan", "worker_crashes")
# The largest reward magnitude accepted. A larger one (1e300, 1e38) is a bug
# in the plugin, not a score: its group's std overflows float32 and every
# advantage and reward metric of the step would turn inf/NaN. It is a failure
# of kind `nan`, handled by --on-reward-error like NaN (README, "Rewards").
REWARD_LIMIT = 1e6
MAX_MESSAGES = 5  # failure messages kept in a RewardResult
STATUS_PENDING, STATUS_OK, STATUS_ERROR = 0, 1, 2  # per-sample status (in shared memory under workers)
IMPORT_TIMEOUT_S = 120.0  # a plugin's import must finish within this (load_bounded; a worker's too)
STATUS_TIMEOUT = 3  # a run the worker cancelled itself past the timeout (rewards/concurrent.py)


@dataclass(frozen=True)
class RewardRecord:
    """What a reward function sees for one sample."""

    prompt: str  # the rendered prompt text
    completion: str  # the decoded response
    answer: str | None  # the row's reference answer, if any
    solutions: list | None  # the row's reference solutions, if any
    row: dict  # the normalized source row (see areno.data.rows)
    num_tokens: int  # response length in tokens
    finish_reason: str  # "stop" | "length" | "abort"
    index: int  # sample index in the step


class RewardError(UserError):
    """A reward plugin failed on a sample under on_error='fail' (or could not run)."""


@dataclass(frozen=True)
class RewardPlugin:
    path: str
    fn: Callable  # reward_fn or reward_fn_batch
    batch: bool  # fn takes a list of records
    is_async: bool


def load_reward_plugin(path: str) -> RewardPlugin:
    """Import and check a plugin file; every problem is a UserError naming it."""
    module = import_user_file(path, what="reward plugin")
    for name, batch in (("reward_fn_batch", True), ("reward_fn", False)):
        fn = getattr(module, name, None)
        if fn is None:
            continue
        if not callable(fn):
            raise UserError(f"reward plugin {path}: '{name}' is a {type(fn).__name__}, not a function")
        return RewardPlugin(str(path), fn, batch, inspect.iscoroutinefunction(fn))
    raise UserError(
        f"reward plugin {path}: defines neither reward_fn(record) -> float "
        "nor reward_fn_batch(records) -> list[float]"
    )


@dataclass(frozen=True)
class RewardCounts:
    """Failures by kind (errors/timeouts/nan/worker_crashes) and what on_error did."""

    errors: int = 0  # raised, or returned a non-number
    timeouts: int = 0
    nan: int = 0  # returned NaN, +-inf, or a value beyond +-REWARD_LIMIT
    worker_crashes: int = 0
    skipped: int = 0
    zeroed: int = 0

    def __add__(self, other: "RewardCounts") -> "RewardCounts":
        return RewardCounts(**{f.name: getattr(self, f.name) + getattr(other, f.name) for f in fields(self)})

    def __sub__(self, other: "RewardCounts") -> "RewardCounts":
        """The counts since `other` (an earlier total of the same rollout)."""
        return RewardCounts(**{f.name: getattr(self, f.name) - getattr(other, f.name) for f in fields(self)})

    @property
    def failures(self) -> int:
        return self.errors + self.timeouts + self.nan + self.worker_crashes


@dataclass(frozen=True)
class RewardResult:
    """rewards: [N] float32 (NaN where not valid); valid: [N] bool."""

    rewards: np.ndarray
    valid: np.ndarray
    counts: RewardCounts
    messages: tuple[str, ...] = ()  # the first few failure messages, for the log
    payloads: list | None = None  # [N] what a plugin kind returns beside the value (None: rewards)

    @staticmethod
    def concat(results: list["RewardResult"]) -> "RewardResult":
        counts = RewardCounts()
        for r in results:
            counts = counts + r.counts
        payloads = None
        if any(r.payloads is not None for r in results):
            payloads = [p for r in results for p in (r.payloads or [None] * r.rewards.size)]
        return RewardResult(
            rewards=np.concatenate([r.rewards for r in results] or [np.zeros(0, np.float32)]),
            valid=np.concatenate([r.valid for r in results] or [np.zeros(0, bool)]),
            counts=counts,
            messages=tuple(m for r in results for m in r.messages)[:MAX_MESSAGES],
            payloads=payloads,
        )

    def take(self, idx: np.ndarray) -> "RewardResult":
        """Samples idx ([m] int64) of it, in that order (counts and messages kept)."""
        idx = np.asarray(idx, dtype=np.int64)
        payloads = None if self.payloads is None else [self.payloads[i] for i in idx.tolist()]
        return RewardResult(self.rewards[idx], self.valid[idx], self.counts, self.messages, payloads)


# -- calling the plugin (shared by the workers and workers=0) ----------------


def _as_reward(out: Any) -> tuple[int, float, str]:
    if isinstance(out, (numbers.Real, np.bool_)):
        return STATUS_OK, float(out), ""
    return STATUS_ERROR, math.nan, f"returned {type(out).__name__} {short_repr(out)}, not a number"


def out_of_range(vals: np.ndarray) -> np.ndarray:
    """[n] float64 rewards -> [n] bool: NaN, +-inf, or |r| > REWARD_LIMIT."""
    with np.errstate(invalid="ignore"):
        return ~(np.abs(vals) <= REWARD_LIMIT)


def short_repr(x: Any) -> str:
    """repr(x) cut to 60 characters, for a one-line error about a plugin's value."""
    try:
        text = repr(x)
    except Exception:  # noqa: BLE001
        return "(unprintable)"
    return text if len(text) <= 60 else text[:57] + "..."


def _run(plugin: RewardPlugin, arg: Any, loop: asyncio.AbstractEventLoop | None) -> Any:
    out = plugin.fn(arg)
    if inspect.isawaitable(out):
        out = (loop or asyncio.new_event_loop()).run_until_complete(out)
    return out


def _raised(e: BaseException, plugin: RewardPlugin) -> str:
    if is_signal_interrupt(e):  # a Ctrl-C; a plugin's own KeyboardInterrupt is its error
        raise e
    return f"raised {one_line(e)}{user_frame(e, plugin.path)}"


def score_one(plugin: RewardPlugin, rec: Any, loop: Any) -> tuple[int, float, str]:
    try:
        return _as_reward(_run(plugin, rec, loop))
    except BaseException as e:  # noqa: BLE001 - SystemExit is the plugin's error too
        return STATUS_ERROR, math.nan, _raised(e, plugin)


def score_batch(plugin: RewardPlugin, recs: list, loop: Any) -> tuple[list, str]:
    """-> ([(status, value, msg)] per record, chunk-level error message or '')."""
    try:
        out = _run(plugin, list(recs), loop)
    except BaseException as e:  # noqa: BLE001
        return [], _raised(e, plugin)
    if isinstance(out, np.ndarray):
        out = out.tolist()
    if not isinstance(out, (list, tuple)) or len(out) != len(recs):
        got = f"{type(out).__name__} of length {len(out)}" if hasattr(out, "__len__") else type(out).__name__
        return [], f"reward_fn_batch returned {got} for {len(recs)} records"
    return [_as_reward(x) for x in out], ""


# -- plugin kinds: what a worker loads and calls (rewards, environments) -------


@dataclass(frozen=True)
class PluginKind:
    """How the worker pool loads a plugin file and calls it on one record.

    call(plugin, record, loop) -> (status, value, message, payload): value is the
    float the pool's shared memory carries; payload (None for rewards) goes back
    to the caller in one message per record, beside it. acall(plugin, record,
    timeout): the same awaited, the run cancelled past `timeout` (STATUS_TIMEOUT),
    for kinds whose async plugins run many at once in one worker (agents)."""

    what: str  # names the plugin in messages: "reward plugin", "environment"
    load: Callable[[str], Any]
    call: Callable[[Any, Any, Any], tuple[int, float, str, Any]]
    acall: Callable[[Any, Any, float], Awaitable[tuple[int, float, str, Any]]] | None = None


def _call_reward(plugin: RewardPlugin, rec: Any, loop: Any) -> tuple[int, float, str, Any]:
    return (*score_one(plugin, rec, loop), None)


KIND = PluginKind("reward plugin", load_reward_plugin, _call_reward)
# by name, so a spawned worker finds its kind: each module defines KIND
KIND_MODULES = {"reward": "areno.rewards.plugin", "env": "areno.envs.plugin", "agent": "areno.gateway.plugin"}


def plugin_kind(name: str) -> PluginKind:
    return importlib.import_module(KIND_MODULES[name]).KIND


def load_bounded(kind: Any, path: str) -> Any:
    """kind.load(path) (the plugin's import and checks), bounded by IMPORT_TIMEOUT_S,
    as a worker's own import is: a plugin that waits on something at import (a
    server, a lock, input()) is a RewardError naming it, not a silent hang. The
    import runs in a thread the process leaves behind if it never returns."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["plugin"] = kind.load(path)
        except BaseException as e:  # noqa: BLE001 - raised again in the caller's thread
            box["error"] = e

    t = threading.Thread(target=run, name="areno-plugin-import", daemon=True)
    t.start()
    t.join(IMPORT_TIMEOUT_S)
    if t.is_alive():
        raise RewardError(f"{kind.what} {path}: its import did not finish within {IMPORT_TIMEOUT_S:g} s "
                          "(does it wait on something at import time?)")
    if "error" in box:
        raise box["error"]
    return box["plugin"]


# -- the records of a step ----------------------------------------------------


def reward_records(rows: Any, prompts: Any, prompt_idx: np.ndarray, batch: Any,
                   completions: list[str], index: np.ndarray | None = None) -> list[RewardRecord]:
    """One RewardRecord per sample of `batch` (a RolloutBatch whose prompt p is
    prompts[prompt_idx[p]]): O(N) Python, the only per-sample objects of a step.
    index: [N] sample index in the step of each response (default 0..N-1)."""
    row_of_prompt = prompts.row_index[prompt_idx].tolist()
    texts = prompts.texts
    lengths = batch.response_lengths.tolist()
    reasons = batch.finish_reason.tolist()
    sample = range(len(completions)) if index is None else index.tolist()
    out = []
    for i, (g, text) in enumerate(zip(batch.group_index.tolist(), completions)):
        row = rows[row_of_prompt[g]]
        out.append(RewardRecord(
            prompt=texts[prompt_idx[g]], completion=text, answer=row.get("answer"),
            solutions=row.get("solutions"), row=row, num_tokens=lengths[i],
            finish_reason=FINISH_REASONS[reasons[i]], index=sample[i],
        ))
    return out
