"""Many runs of an async agent per worker process (--agent-concurrency,
rewards/concurrent.py): the runs of one worker are in flight together, and a
run that raises or times out follows --on-reward-error while the others on
the same worker go on."""

from __future__ import annotations

import textwrap

import numpy as np
import pytest

from areno.envs.pool import EnvPool
from areno.gateway.plugin import AgentTask
from areno.rewards import RewardError

# Each run waits until two runs are in flight in its own process: one run at a
# time, the first would wait until its timeout.
TOGETHER = """
import asyncio

in_flight = 0
both = None


async def agent(task):
    global in_flight, both
    both = both or asyncio.Event()
    in_flight += 1
    if in_flight >= 2:
        both.set()
    await both.wait()
    return float(task.index)
"""

# Two slots. Run 0 hangs and is cancelled past the timeout (4 s); run 1 raises
# halfway there, which frees its slot for run 2; run 2 returns once run 0 was
# cancelled, which it sees only if it is still running beside it then.
ONE_FAILS = """
import asyncio

cancelled = None


async def agent(task):
    global cancelled
    cancelled = cancelled or asyncio.Event()
    if task.index == 0:
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            cancelled.set()
            raise
    if task.index == 1:
        await asyncio.sleep(2)
        raise ValueError("no tool for that")
    await cancelled.wait()
    return 7.0
"""


def tasks(n: int) -> list[AgentTask]:
    return [AgentTask(f"{i}+1=", None, None, {}, i, "http://127.0.0.1:9/v1", "key") for i in range(n)]


def run_all(tmp_path, source: str, n: int, **kw) -> list:
    """n agent runs on one worker -> each run's Outcome (or the RewardError it raised)."""
    path = tmp_path / "agent.py"
    path.write_text(textwrap.dedent(source))
    with EnvPool(str(path), workers=1, kind="agent", **kw) as pool:
        tickets = [pool.submit_call(t) for t in tasks(n)]
        out = []
        for t in tickets:
            try:
                out.append(pool.result(t))
            except RewardError as e:
                out.append(e)
        return out


def test_the_runs_of_one_worker_are_in_flight_together(tmp_path):
    out = run_all(tmp_path, TOGETHER, 4, concurrency=2, timeout=60, on_error="fail")
    assert [o.reward for o in out] == [0.0, 1.0, 2.0, 3.0]
    assert all(o.counts.failures == 0 for o in out)


def test_a_sync_agent_or_concurrency_1_runs_one_at_a_time(tmp_path):
    path = tmp_path / "agent.py"
    path.write_text("def agent(task):\n    return 1.0\n")
    with EnvPool(str(path), workers=2, kind="agent", concurrency=8) as pool:
        assert pool.scorer.capacity == 2  # a sync agent: one run per worker
    path.write_text(TOGETHER)
    with EnvPool(str(path), workers=2, kind="agent", concurrency=8) as pool:
        assert pool.scorer.capacity == 16


@pytest.mark.parametrize("on_error", ["zero", "skip"])
def test_a_raise_or_a_timeout_fails_its_run_alone(tmp_path, on_error):
    late, raised, fine = run_all(tmp_path, ONE_FAILS, 3, concurrency=2, timeout=4, on_error=on_error)
    assert raised.counts.errors == 1 and "raised ValueError: no tool for that" in raised.messages[0]
    assert late.counts.timeouts == 1 and "timed out after 4 s" in late.messages[0]
    assert fine.reward == 7.0 and fine.counts.failures == 0  # it outlived the cancel beside it
    if on_error == "zero":
        assert raised.reward == 0.0 and late.reward == 0.0 and raised.valid and late.valid
    else:
        assert np.isnan(raised.reward) and not raised.valid and not late.valid


def test_under_fail_the_failed_run_raises_and_the_others_finish(tmp_path):
    late, raised, fine = run_all(tmp_path, ONE_FAILS, 3, concurrency=2, timeout=4, on_error="fail")
    assert isinstance(raised, RewardError) and "no tool for that" in str(raised)
    assert isinstance(late, RewardError) and "timed out after 4 s" in str(late)
    assert fine.reward == 7.0


# Run 0 blocks its worker's event loop (a sync sleep in an async agent): nothing
# in the worker can cancel it, so the pool kills the worker past the timeout
# plus the grace, charging both runs then on it; run 2 goes to the new worker.
BLOCKS = """
import asyncio
import time


async def agent(task):
    if task.index == 0:
        time.sleep(3600)
    if task.index == 1:
        await asyncio.sleep(3600)
    return 5.0
"""


def test_a_run_that_blocks_its_worker_costs_the_worker_and_the_runs_on_it(tmp_path):
    blocked, beside, after = run_all(tmp_path, BLOCKS, 3, concurrency=2, timeout=1, on_error="zero")
    assert blocked.counts.failures == 1 and blocked.reward == 0.0 and "worker killed" in blocked.messages[0]
    assert beside.counts.failures == 1 and beside.reward == 0.0
    assert after.reward == 5.0 and after.counts.failures == 0
