"""Reward plugins and parallel, fault-isolated scoring.

  plugin.py  the plugin contract, loading, calling it on one sample or a batch,
             RewardRecord / RewardResult, and `reward_records` (a step's records)
  pool.py    RewardScorer: worker processes, timeouts, the on_error policy
  jobs.py    the scorer's books: jobs, chunks, how failures are counted
  worker.py  the worker process and the controller's handle on it
"""

from areno.rewards.plugin import (
    FAILURE_KINDS,
    ON_ERROR,
    RewardCounts,
    RewardError,
    RewardPlugin,
    RewardRecord,
    RewardResult,
    load_reward_plugin,
    reward_records,
)
from areno.rewards.pool import MAX_CHUNK, STARTUP_TIMEOUT_S, RewardScorer

__all__ = [
    "FAILURE_KINDS", "MAX_CHUNK", "ON_ERROR", "STARTUP_TIMEOUT_S", "RewardCounts", "RewardError",
    "RewardPlugin", "RewardRecord", "RewardResult", "RewardScorer", "load_reward_plugin",
    "reward_records",
]
