"""EnvPool: environment calls on the reward pool's worker processes.

One job per call (a trajectory's reset or step), so a slow environment holds
back its own trajectory only; the pool's timeout, on_error policy and
process-group kill are the reward plugin's (rewards/pool.py, kind "env").
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from areno.envs.plugin import EnvCall, EnvReply, EnvState
from areno.rewards.plugin import RewardCounts
from areno.rewards.pool import RewardScorer


@dataclass(frozen=True)
class Outcome:
    """A finished call: reply None when it failed (on_error zero or skip ended it)."""

    reward: float  # 0.0 under on_error "zero"; NaN when skipped
    valid: bool  # False: skipped (the trajectory's sample is dropped)
    reply: EnvReply | None
    counts: RewardCounts
    messages: tuple[str, ...]


class EnvPool:
    """submit(state, completion) -> ticket; done(tickets) -> the finished ones."""

    def __init__(self, path: str, *, workers: int = 2, timeout: float = 10.0, on_error: str = "fail",
                 kind: str = "env", concurrency: int = 1) -> None:
        self.scorer = RewardScorer(path, workers=workers, timeout=timeout, on_error=on_error,  # type: ignore[arg-type]
                                   chunk_size=1, kind=kind, concurrency=concurrency)
        self.path = path

    def submit(self, state: EnvState, completion: str | None) -> int:
        """A reset (completion None) or a step of one trajectory."""
        return self.scorer.submit([EnvCall(state, completion, state.index)])

    def submit_call(self, call: object) -> int:
        """One call of another kind's plugin (an agent run: gateway/plugin.AgentTask)."""
        return self.scorer.submit([call])

    def wait_any(self, tickets: list[int], timeout: float | None = None) -> list[int]:
        """The tickets whose calls finished; waits for at least one (timeout None),
        or at most timeout s (0: returns at once). Blocks until a call finishes."""
        return self.scorer.wait_any(tickets, timeout)

    def warm(self, timeout: float = 60.0) -> None:
        """Wait until every worker has imported the environment (benchmarks, tests)."""
        t_end = time.monotonic() + timeout
        while self.scorer.workers_ready() < self.scorer.workers and time.monotonic() < t_end:
            time.sleep(0.01)

    def result(self, ticket: int) -> Outcome:
        """The call's outcome (raises RewardError under on_error 'fail')."""
        r = self.scorer.collect(ticket)
        reply = r.payloads[0] if r.payloads and r.counts.failures == 0 else None
        return Outcome(float(r.rewards[0]), bool(r.valid[0]), reply, r.counts, r.messages)

    def close(self) -> None:
        self.scorer.close()

    def __enter__(self) -> "EnvPool":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
