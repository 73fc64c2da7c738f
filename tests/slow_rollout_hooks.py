"""ARENO_RANK_HOOKS=slow_rollout_hooks:SlowRollouts (tests/test_async_loop.py): from
an engine process's third rollout on, every rollout takes a minute, so a test
can interrupt the loop while it waits for one."""

from __future__ import annotations

import time

from rank_test_hooks import TestRankHooks

SLOW_FROM, SLOW_S = 3, 60.0


class SlowRollouts(TestRankHooks):  # keeps the suite's commands
    def __init__(self) -> None:
        self.rollouts = 0

    def rollout_end(self, peer: int, tokens: int) -> None:
        self.rollouts += 1
        if self.rollouts >= SLOW_FROM:
            time.sleep(SLOW_S)
