"""The fault-injection suite of issue 18: every case runs the real `areno
train` (the issue's B command: tiny arith model, 16 rows, --rollout-engine hf)
through tests/faults.py and asserts its exit code, its one-line message, no
traceback, no leftover process or /dev/shm segment, and a consistent run dir.

All cases share one tiny model and one data set (session fixtures)."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from faults import B, Run, assert_clean, is_peer, run_train, write_arith_data, write_plugin

pytestmark = pytest.mark.faults

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


# -- item 6: a reward worker's process group dies with it ---------------------------
SPAWNS_SLEEP = """
import subprocess

def reward_fn(record):
    if record.index == 0:
        subprocess.run(["sleep", "1000"])  # killed with its worker at --reward-timeout
    return 0.5
"""
FORKS = """
import os, time

def reward_fn(record):
    if os.fork() == 0:  # a child per sample that outlives the call
        time.sleep(1000)
        os._exit(0)
    return 0.5
"""


def test_a_plugin_child_dies_with_its_timed_out_worker(b_cmd, areno_cache):
    """`sleep 1000` used to outlive the killed worker and the run (issue 18)."""
    args, out = b_cmd(SPAWNS_SLEEP, "--reward-timeout", "2", "--on-reward-error", "zero",
                      "--max-steps", "1")
    res = run_train(args, areno_cache, out)
    records = assert_clean(res, 0, message=None)
    assert [r["reward/timeouts"] for r in records if "reward/mean" in r] == [1.0]


def test_a_forking_plugin_leaves_no_process_when_the_run_ends(b_cmd, areno_cache):
    args, out = b_cmd(FORKS)
    res = run_train(args, areno_cache, out)
    assert_clean(res, 0, message=None)


HANGS = """
import time

def reward_fn(record):
    time.sleep(1000)
"""


def test_a_users_plugin_on_the_demo_is_scored_in_workers_so_its_timeout_holds(areno_cache, tmp_path):
    """The demo preset scores in-process (--reward-workers 0); a user's plugin
    there used to hang the run for 200+ s despite --reward-timeout 2."""
    plugin = write_plugin(tmp_path / "hangs.py", HANGS)
    out = tmp_path / "run"
    res = run_train(["--reward-fn-path", str(plugin), "--reward-timeout", "1", "--max-steps", "1",
                     "--batch-size", "2", "--n-samples", "2", "--output-dir", str(out)],
                    areno_cache, out, timeout=120)
    assert_clean(res, 2, ["hangs.py", "timed out after 1 s"])


def test_a_timeout_that_in_process_scoring_cannot_enforce_is_one_line(b_cmd, areno_cache):
    args, out = b_cmd(HANGS, "--reward-workers", "0", "--reward-timeout", "2")
    res = run_train(args, areno_cache, out, timeout=60)
    assert_clean(res, 2, ["--reward-timeout 2.0 cannot be enforced with --reward-workers 0"])


# -- item 7: a stuck rank is detected ---------------------------------------------------
def _rank_pids(run: Run) -> list[int]:
    """The training ranks: the controller's spawned children (rewards in-process here)."""
    return [p for p, cmd in run.children().items() if is_peer(cmd)]


def test_a_stopped_rank_stops_the_run_within_seconds_of_the_heartbeat_bound(b_cmd, areno_cache):
    """SIGSTOP used to hang the run silently for 90 s and more (issue 18)."""
    bound = 4
    args, out = b_cmd(FIRST_DIGIT, "--max-steps", "500", "--save-interval", "1", "--reward-workers",
                      "0", "--rank-heartbeat-timeout", str(bound))
    run = Run(args, areno_cache, out)
    run.wait_for(lambda: (out / "checkpoints" / "step_000001").is_dir())
    ranks = _rank_pids(run)
    assert len(ranks) == 1, run.children()
    os.kill(ranks[0], signal.SIGSTOP)
    stopped = time.monotonic()
    res = run.finish(timeout=120)
    took = time.monotonic() - stopped
    assert bound < took < bound + 30, took  # detection <= 1 s after the bound; the rest is shutdown
    assert_clean(res, 1, ["rank 0", "no heartbeat", f"bound {bound}s", "--resume", "step_0000"])


# -- item 9: the smaller runtime cases ---------------------------------------------------
OWN_KEYBOARD_INTERRUPT = """
def reward_fn(record):
    if record.index == 3:
        raise KeyboardInterrupt("plugin gave up")
    return 0.5
"""


def test_a_plugins_own_keyboard_interrupt_is_its_error_not_a_ctrl_c(b_cmd, areno_cache):
    """In-process, where it used to be taken for a Ctrl-C (interrupted, exit 130)."""
    args, out = b_cmd(OWN_KEYBOARD_INTERRUPT, "--reward-workers", "0")
    res = run_train(args, areno_cache, out)
    assert_clean(res, 2, ["sample 3", "raised KeyboardInterrupt: plugin gave up"])


FAILS_IN_STEP_3 = """
calls = [0]


def reward_fn(record):
    calls[0] += 1
    if calls[0] > 32:  # 16 samples a step
        raise ValueError("judge unreachable")
    return 0.5
"""


def test_a_failing_reward_plugin_names_the_checkpoint_to_resume_from(b_cmd, areno_cache):
    """As a backend failure does; it used to say only what failed."""
    args, out = b_cmd(FAILS_IN_STEP_3, "--reward-workers", "0", "--max-steps", "4", "--save-interval", "1")
    res = run_train(args, areno_cache, out)
    assert_clean(res, 2, ["judge unreachable",
                          f"continue from the last complete checkpoint with --resume {out / 'checkpoints' / 'step_000002'}"])


def test_sighup_saves_the_last_step_and_prints_the_resume_command(b_cmd, areno_cache):
    """A closed terminal (SIGHUP) used to end the run with no save."""
    args, out = b_cmd(FIRST_DIGIT, "--max-steps", "500", "--save-interval", "100")
    run = Run(args, areno_cache, out)
    run.wait_for(lambda: '"step": 2' in (out / "metrics.jsonl").read_text()
                 if (out / "metrics.jsonl").is_file() else False)
    os.kill(run.proc.pid, signal.SIGHUP)
    res = run.finish(timeout=120)
    assert_clean(res, 130, ["interrupted (SIGHUP)", "--resume", "step_0000"])
    assert [p.name for p in (out / "checkpoints").iterdir()]  # the last finished step, saved


def test_a_closed_stdout_stops_the_run_as_an_interrupt_with_a_checkpoint(b_cmd, areno_cache):
    """`areno train ... | head -3` used to exit 1 with no word and no checkpoint:
    now it stops as a Unix command does at a closed pipe, but saving first."""
    args, out = b_cmd(FIRST_DIGIT, "--max-steps", "500", "--epochs", "200", "--save-interval", "100",
                      "--log-completions", "0")  # three lines of steps, no sample line between
    run = Run(args, areno_cache, out)
    head = [run.proc.stdout.readline() for _ in range(3)]
    run.proc.stdout.close()  # what head does after its 3 lines
    res = run.finish(timeout=120)
    assert head[1].startswith("step 1/500") and head[2].startswith("step 2/500"), head
    assert_clean(res, 130, ["interrupted (SIGPIPE)", "--resume", "step_0000"])
    assert list((out / "checkpoints").iterdir())
