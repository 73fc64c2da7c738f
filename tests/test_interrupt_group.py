"""A job stopped as schedulers stop it: SIGTERM or SIGHUP to the whole process
group (`timeout`, Slurm's time limit and scancel, `systemctl stop`, a closed
terminal). The ranks, engine processes and reward workers hold the signal, so
the controller saves the last finished step through them and prints the resume
command, exit 130; two interrupts 10 ms apart end in one line as well.

Each case runs the real `areno train` (tests/faults.py: the B command) in a
session of its own and signals that session with os.killpg."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest

from areno.rundir.checkpoint import TMP_PREFIX, latest_checkpoint, read_state
from faults import B, Run, assert_clean, write_arith_data, write_plugin

pytestmark = pytest.mark.faults

FIRST_DIGIT = """
def reward_fn(record):
    return 1.0 if record.completion.strip()[:1] == record.answer else 0.0
"""
SPLIT = ("--rollout-world-size", "1", "--off-policy-steps", "1")


@pytest.fixture
def group_run(tiny_arith_path, tmp_path, areno_cache):
    """group_run(*extra) -> (Run, run dir): the B command, long enough to be signalled mid-run."""
    data = write_arith_data(tmp_path / "arith.jsonl")
    plugin = write_plugin(tmp_path / "plugin.py", FIRST_DIGIT)
    out = tmp_path / "run"

    def start(*extra: str) -> tuple[Run, Path]:
        args = B(tiny_arith_path, data, plugin, out, "--max-steps", "500", "--epochs", "200", *extra)
        return Run(args, areno_cache, out), out

    return start


def steps_logged(out: Path) -> int:
    path = out / "metrics.jsonl"
    return len(path.read_text().splitlines()) if path.is_file() else 0


def saving(out: Path) -> bool:
    """A checkpoint is being written (its temporary directory exists)."""
    root = out / "checkpoints"
    return root.is_dir() and any(e.startswith(TMP_PREFIX) for e in os.listdir(root))


# Pairwise: each signal with each placement and each moment.
CASES = [(signal.SIGTERM, (), "steady"), (signal.SIGTERM, SPLIT, "save"),
         (signal.SIGHUP, (), "save"), (signal.SIGHUP, SPLIT, "steady")]


@pytest.mark.parametrize("sig,placement,moment", CASES,
                         ids=[f"{s.name}-{'split' if p else 'colocated'}-{m}" for s, p, m in CASES])
def test_a_signal_to_the_whole_group_saves_the_last_finished_step(group_run, sig, placement, moment):
    interval = "1" if moment == "save" else "100"
    run, out = group_run("--save-interval", interval, *placement)
    run.wait_for(lambda: steps_logged(out) >= 3)
    if moment == "save":
        run.wait_for(lambda: saving(out), every=0.002)
    os.killpg(run.proc.pid, sig)
    res = run.finish(timeout=120)
    assert_clean(res, 130, [f"interrupted ({sig.name})", "continue with: areno train", "--resume"])
    ckpt = latest_checkpoint(out / "checkpoints")
    assert ckpt is not None and str(ckpt) in res.message
    last = max(json.loads(ln)["step"] for ln in (out / "metrics.jsonl").read_text().splitlines() if ln.strip())
    assert int(read_state(ckpt)["step"]) == last  # the last finished step, saved


@pytest.mark.parametrize("second", [signal.SIGINT, signal.SIGTERM], ids=lambda s: s.name)
def test_two_interrupts_10ms_apart_under_split_placement_end_in_one_line(group_run, second):
    """The second used to find the backend it aborted torn down mid-wait: a
    traceback, exit 1, no resume line. The one line names the second signal
    when it came before the line, the first when it came after (in the close,
    where it used to print a second line: signals.run_ending)."""
    run, out = group_run("--save-interval", "1", *SPLIT)
    run.wait_for(lambda: steps_logged(out) >= 3)
    os.killpg(run.proc.pid, signal.SIGINT)
    time.sleep(0.01)
    os.killpg(run.proc.pid, second)
    res = run.finish(timeout=120)
    assert_clean(res, 130, ["interrupted (SIG"])
    assert f"interrupted ({second.name})" in res.message or "interrupted (SIGINT)" in res.message
    ckpt = latest_checkpoint(out / "checkpoints")
    assert ckpt is not None and f"checkpoint {ckpt}; continue with: " in res.message, res.message


def test_a_signal_during_the_final_save_ends_with_it_saved_and_the_resume_line(group_run):
    """After the loop, the last step's save used to be outside the interrupt's
    handling: a bare "areno: interrupted" and no resume line."""
    run, out = group_run("--max-steps", "3", "--save-interval", "100")
    run.wait_for(lambda: saving(out), every=0.002)  # the only save: the final one
    os.killpg(run.proc.pid, signal.SIGTERM)
    res = run.finish(timeout=120)
    ckpt = out / "checkpoints" / "step_000003"
    assert_clean(res, 130, ["interrupted (SIGTERM) after step 3 of 3", f"checkpoint {ckpt}; continue with: "])
