"""The fault-injection suite of issue 18: every case runs the real `areno
train` (the issue's B command: tiny arith model, 16 rows, --rollout-engine hf)
through tests/faults.py and asserts its exit code, its one-line message, no
traceback, no leftover process or /dev/shm segment, and a consistent run dir.

All cases share one tiny model and one data set (session fixtures)."""

from __future__ import annotations

from pathlib import Path

import pytest

from faults import B, assert_clean, run_train, write_arith_data, write_plugin

pytestmark = pytest.mark.slow

FIRST_DIGIT = """
def reward_fn(record):
    return 1.0 if record.completion.strip()[:1] == record.answer else 0.0
"""


@pytest.fixture(scope="session")
def fault_data(tmp_path_factory) -> Path:
    """16 rows of the demo task, shared by every case."""
    return write_arith_data(tmp_path_factory.mktemp("faultdata") / "arith.jsonl")


@pytest.fixture
def b_cmd(tiny_arith_path, fault_data, tmp_path):
    """b_cmd(plugin_source, *extra) -> (args, run_dir): the B command with a plugin file."""
    def make(source: str = FIRST_DIGIT, *extra: str) -> tuple[list[str], Path]:
        plugin = write_plugin(tmp_path / "plugin.py", source)
        out = tmp_path / "run"
        return B(tiny_arith_path, fault_data, plugin, out, *extra), out

    return make


def test_the_plain_b_run_is_clean(b_cmd, areno_cache):
    """The baseline the harness measures every fault against: rc 0, no areno
    line on stderr, every step in strict JSON."""
    args, out = b_cmd()
    res = run_train(args, areno_cache, out)
    records = assert_clean(res, 0, message=None)
    assert [r["step"] for r in records if "reward/mean" in r] == [1, 2]


# -- item 5: rewards are bounded --------------------------------------------------
HUGE = """
def reward_fn(record):
    return {0: 1e300, 1: 1e38, 2: -1e38}.get(record.index, 0.5)
"""


def test_a_reward_beyond_the_limit_is_one_line_under_fail(b_cmd, areno_cache):
    args, out = b_cmd(HUGE)
    res = run_train(args, areno_cache, out)
    assert_clean(res, 2, ["reward plugin", "beyond the limit of +-1e+06", "scale it down"])


def test_rewards_beyond_the_limit_never_reach_metrics_jsonl_under_zero(b_cmd, areno_cache):
    """±1e38 used to write Infinity (strict JSON refuses it) and show nan±nan."""
    args, out = b_cmd(HUGE, "--on-reward-error", "zero")
    res = run_train(args, areno_cache, out)
    records = assert_clean(res, 0, message=None)
    steps = [r for r in records if "reward/mean" in r]
    assert [r["reward/nan"] for r in steps] == [3.0, 3.0] and all(r["reward/std"] < 1 for r in steps)
    assert "nan" not in res.stdout and "(3/16 failed)" in res.stdout
