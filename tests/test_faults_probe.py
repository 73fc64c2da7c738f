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
