"""Faults end to end, one test each, through `areno train` in a subprocess:

* SIGKILL of the trainer mid-step, and of the whole process group mid-save:
  no orphan process, no incomplete checkpoint listed, `--resume latest`
  continues from the last complete one with the same data order;
* a reward function that hangs: killed at --reward-timeout, then zero / skip
  (the run goes on) or fail (one clear line);
* a training rank SIGKILLed: the run stops within seconds with one line naming
  the rank and the checkpoint to resume from, leaves no process, resumes;
* disk full while saving (a real 5 MiB tmpfs when mount works, else ENOSPC
  injected into the controller's write): one clear line, previous checkpoint
  intact and loadable;
* malformed dataset rows: one line naming row and field, or skipped and
  counted with --skip-bad-rows.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from areno.rundir.checkpoint import latest_checkpoint, list_checkpoints, read_state
from areno.rundir.lock import LOCK_FILE
from faults import is_peer
from inprocess import run_here
from test_resume import (
    HF1,
    REPO,
    cli_env,
    expected_prompt_hashes,
    ok,
    popen_train,
    read_metrics,
    train_steps,
    wait_group_gone,
)

pytestmark = pytest.mark.faults


def wait_for(predicate, proc: subprocess.Popen, timeout: float = 120, every: float = 0.02):
    """Poll until predicate() is truthy; fail with the trainer's output if it exits first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = predicate()
        if got:
            return got
        if proc.poll() is not None:
            out, err = proc.communicate()
            pytest.fail(f"trainer exited ({proc.returncode}) first:\n{out[-2000:]}\n{err[-2000:]}")
        time.sleep(every)
    proc.kill()
    pytest.fail("timed out waiting for the trainer")


def one_error_line(stderr: str) -> str:
    assert "Traceback" not in stderr, stderr[-3000:]
    lines = [line for line in stderr.splitlines() if line.startswith("areno: error:")]
    assert len(lines) == 1, stderr[-3000:]
    return lines[0]


def rank_pids(controller: int) -> list[int]:
    """The controller's spawned children that are training ranks (not the
    multiprocessing resource tracker, nor reward workers: each of those leads a
    session of its own)."""
    pids = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            fields = (d / "stat").read_text().rsplit(")", 1)[1].split()
            ppid, session = int(fields[1]), int(fields[3])
            cmd = (d / "cmdline").read_bytes().decode(errors="replace")
        except OSError:
            continue
        if ppid == controller and is_peer(cmd) and session != int(d.name):
            pids.append(int(d.name))
    return pids


def assert_complete(ckpt: Path) -> None:
    for f in ("config.json", "model.safetensors", "tokenizer.json", "trainer_state.json",
              "backend/trainer.pt"):
        assert (ckpt / f).is_file(), ckpt / f


# -- SIGKILL -----------------------------------------------------------------
def test_sigkill_mid_step_resumes_from_the_last_complete_checkpoint(tmp_path, areno_cache):
    """Kill only the controller (as the OOM killer would): its rank and helper
    processes go too; the resumed run draws the prompts the killed one would have."""
    out = tmp_path / "run"
    flags = [*HF1, "--max-steps", "3", "--save-interval", "1", "--output-dir", str(out)]
    proc = popen_train(flags, areno_cache)
    root = out / "checkpoints"
    wait_for(lambda: (root / "step_000002").is_dir(), proc)
    os.kill(proc.pid, signal.SIGKILL)  # step 3 is under way
    proc.communicate()
    assert wait_group_gone(proc.pid) == [], "orphan processes after the trainer was killed"
    ckpts = list_checkpoints(root)
    assert [p.name for p in ckpts] == ["step_000001", "step_000002"]
    for p in ckpts:
        assert_complete(p)

    res = ok(run_here(["train", *flags, "--resume", "latest"], areno_cache))
    assert "resumed at step 2" in res.stdout
    steps = train_steps(out)
    assert [r["step"] for r in read_metrics(out) if "reward/mean" in r] == [1, 2, 3]  # no repeats
    expected = expected_prompt_hashes(range(1, 4), batch_size=4)
    assert {s: r["data/prompt_hash"] for s, r in steps.items()} == expected


def test_sigkill_during_a_save_leaves_the_previous_checkpoint_and_no_visible_partial(
        tmp_path, areno_cache):
    """Kill the whole process group the moment step 2's temp directory appears."""
    out = tmp_path / "run"
    flags = [*HF1, "--max-steps", "2", "--save-interval", "1", "--output-dir", str(out)]
    proc = popen_train(flags, areno_cache)
    root = out / "checkpoints"

    def saving_step_2():
        return root.is_dir() and [e for e in os.listdir(root) if "tmp-step_000002" in e]

    wait_for(saving_step_2, proc, every=0.002)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.communicate()
    assert wait_group_gone(proc.pid) == []
    assert any("tmp-step_000002" in e for e in os.listdir(root)), "killed after the save, not during"
    assert [p.name for p in list_checkpoints(root)] == ["step_000001"]
    assert latest_checkpoint(root) == root / "step_000001"
    assert_complete(root / "step_000001")

    res = ok(run_here(["train", *flags, "--resume", "latest"], areno_cache))
    assert "resumed at step 1" in res.stdout
    # leftovers cleaned up; the lock file is the run's (rundir/lock.py: the save path is locked)
    assert sorted(os.listdir(root)) == [LOCK_FILE, "step_000001", "step_000002"]
    assert_complete(root / "step_000002")
    expected = expected_prompt_hashes(range(1, 3), batch_size=4)
    assert {s: r["data/prompt_hash"] for s, r in train_steps(out).items()} == expected


# -- a hanging reward function ----------------------------------------------------
HANG = """
import time

def reward_fn(record):
    if record.index == 0:
        time.sleep(3600)
    return 1.0 if record.completion.strip()[:1] == record.answer else 0.0
"""


@pytest.mark.parametrize("policy", ["zero", "skip", "fail"])
def test_hanging_reward_is_killed_at_the_timeout_and_handled_by_policy(policy, tmp_path, areno_cache):
    plugin = tmp_path / "hang.py"
    plugin.write_text(HANG)
    out = tmp_path / "run"
    t0 = time.monotonic()
    res = run_here(["train", *HF1, "--max-steps", "1", "--no-save", "--output-dir", str(out),
                    "--reward-fn-path", str(plugin), "--reward-workers", "1", "--reward-timeout", "1",
                    "--on-reward-error", policy], areno_cache)
    assert time.monotonic() - t0 < 120
    if policy == "fail":
        assert res.returncode == 2, res.stdout[-2000:] + res.stderr[-2000:]
        line = one_error_line(res.stderr)
        assert "timed out" in line and "sample 0" in line, line
        return
    ok(res)
    assert "(1/16 failed)" in res.stdout  # on the step line, not only in metrics.jsonl
    steps = train_steps(out)
    assert sorted(steps) == [1]
    for m in steps.values():
        assert m["reward/timeouts"] == 1.0
        if policy == "zero":
            assert m["reward/zeroed"] == 1.0 and m["reward/valid"] == 16.0
        else:
            assert m["reward/skipped"] == 1.0 and m["reward/valid"] == 15.0


# -- a dying rank ---------------------------------------------------------------------
def test_killed_rank_stops_the_run_within_seconds_cleanly_and_resumably(tmp_path, areno_cache):
    out = tmp_path / "run"
    flags = [*HF1[:-1], "2", "--max-steps", "4", "--save-interval", "1", "--output-dir", str(out)]
    assert flags[flags.index("--world-size") + 1] == "2"
    proc = popen_train(flags, areno_cache)
    wait_for(lambda: (out / "checkpoints" / "step_000002").is_dir(), proc)
    ranks = rank_pids(proc.pid)
    assert len(ranks) == 2, ranks
    killed = time.monotonic()
    os.kill(ranks[1], signal.SIGKILL)
    _, err = proc.communicate(timeout=60)
    assert time.monotonic() - killed < 15
    assert proc.returncode == 1, err[-3000:]
    line = one_error_line(err)
    assert "rank" in line and "--resume" in line and "step_00000" in line, line
    assert wait_group_gone(proc.pid, 5) == [], "orphan processes after a rank died"

    res = ok(run_here(["train", *flags, "--resume", "latest"], areno_cache))
    assert "resumed at step" in res.stdout
    assert sorted(train_steps(out)) == [1, 2, 3, 4]


def test_a_killed_engine_process_stops_the_run_within_seconds_cleanly_and_resumably(tmp_path, areno_cache):
    """Split placement: the engine processes are a fleet apart from the backend, with
    their own watchdog; killing one mid-run stops the run with one line naming it
    and the checkpoint to resume from, and leaves no process behind."""
    out = tmp_path / "run"
    flags = [*HF1, "--rollout-world-size", "1", "--max-steps", "4", "--save-interval", "1", "--output-dir", str(out)]
    proc = popen_train(flags, areno_cache)
    wait_for(lambda: (out / "checkpoints" / "step_000002").is_dir(), proc)
    engines = [p for p in rank_pids(proc.pid) if Path(f"/proc/{p}/comm").read_text().startswith("areno-engine")]
    assert len(engines) == 1, engines
    killed = time.monotonic()
    os.kill(engines[0], signal.SIGKILL)
    _, err = proc.communicate(timeout=60)
    assert time.monotonic() - killed < 15
    assert proc.returncode == 1, err[-3000:]
    line = one_error_line(err)
    assert "engine process 0" in line and "--resume" in line and "step_00000" in line, line
    assert wait_group_gone(proc.pid, 5) == [], "orphan processes after an engine process died"

    res = ok(run_here(["train", *flags, "--resume", "latest"], areno_cache))
    assert "resumed at step" in res.stdout
    assert sorted(train_steps(out)) == [1, 2, 3, 4]


# -- disk full while saving ------------------------------------------------------------
INJECT_ENOSPC = """
import errno, sys
import areno.rundir.checkpoint as c

real, calls = c._write_json, []

def full(path, obj):
    if calls:  # the second checkpoint's trainer_state.json
        raise OSError(errno.ENOSPC, "No space left on device")
    calls.append(path)
    real(path, obj)

c._write_json = full
from areno.cli import main
sys.exit(main(sys.argv[1:]))
"""


def try_mount_tmpfs(path: Path, size: str) -> bool:
    path.mkdir()
    res = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                         capture_output=True)
    return res.returncode == 0


def test_disk_full_while_saving_is_one_clear_error_and_keeps_the_previous_checkpoint(
        tmp_path, areno_cache):
    """A checkpoint of the demo model is ~3.7 MiB: a 5 MiB tmpfs holds the first
    and runs out during the second. Without mount privileges, ENOSPC is injected
    into the controller's write of the second checkpoint instead."""
    save = tmp_path / "small-disk"
    mounted = try_mount_tmpfs(save, "5m")
    flags = ["train", *HF1, "--max-steps", "3", "--save-interval", "1",
             "--output-dir", str(tmp_path / "run"), "--save-path", str(save)]
    try:
        if mounted:
            res = run_here(flags, areno_cache)
        else:
            res = subprocess.run([sys.executable, "-c", INJECT_ENOSPC, *flags], capture_output=True,
                                 text=True, timeout=300, cwd=REPO, env=cli_env(areno_cache))
        assert res.returncode == 2, res.stdout[-2000:] + res.stderr[-2000:]
        line = one_error_line(res.stderr)
        assert "cannot save checkpoint" in line and "step_000002" in line, line
        assert "no space left on" in line.lower() and "step_000001 is intact" in line, line
        # nothing half-written left (beside the run's lock, areno/rundir/lock.py)
        assert sorted(set(os.listdir(save)) - {LOCK_FILE}) == ["step_000001"]
        ckpt = save / "step_000001"
        assert_complete(ckpt)
        assert read_state(ckpt)["step"] == 1
        from transformers import AutoModelForCausalLM

        AutoModelForCausalLM.from_pretrained(ckpt)
    finally:
        if mounted:
            subprocess.run(["umount", str(save)], check=False)


# -- malformed dataset rows -------------------------------------------------------------
GOOD = [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a in range(3) for b in range(3)]


def dataset_args(tmp_path: Path, rows: list, ckpt: Path) -> list[str]:
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return ["train", "--ckpt", str(ckpt), "--dataset-path", str(data), "--reward-fn-path",
            "builtin:arith", "--no-chat-template", "--max-new-tokens", "3", "--max-prompt-len", "16",
            "--rollout-engine", "hf", "--batch-size", "4", "--n-samples", "2", "--max-steps", "1",
            "--no-save", "--reward-workers", "0", "--output-dir", str(tmp_path / "run")]


@pytest.mark.parametrize("bad, words", [
    # a key missing from one JSONL row reads as None (the columns are unified)
    ({"answer": "4"}, ["row 2", "field 'prompt'", "NoneType"]),
    ({"prompt": 7, "answer": "5"}, ["row 2", "field 'prompt'", "int"]),
])
def test_malformed_row_is_one_line_naming_row_and_field(bad, words, tmp_path, capsys,
                                                         tiny_arith_path):
    """In-process: the row check comes before any process starts."""
    from areno.cli import main

    assert main(dataset_args(tmp_path, [*GOOD[:2], bad, *GOOD[2:]], tiny_arith_path)) == 2
    line = one_error_line(capsys.readouterr().err)
    assert all(w in line for w in words) and "--skip-bad-rows" in line, line


def test_skip_bad_rows_skips_and_counts_them(tmp_path, areno_cache, tiny_arith_path):
    rows = [*GOOD[:2], {"answer": "4"}, {"prompt": 7, "answer": "5"}, *GOOD[2:]]
    res = ok(run_here([*dataset_args(tmp_path, rows, tiny_arith_path), "--skip-bad-rows"], areno_cache))
    assert f"{len(GOOD)} prompts (0 overlong dropped, 2 malformed rows skipped)" in res.stdout
    assert sorted(train_steps(tmp_path / "run")) == [1]


SLOW_REWARD = """
import os, time

def reward_fn(record):
    if os.path.exists(os.environ["ARENO_TEST_SLOW_FLAG"]):
        time.sleep(60)
    return float(record.completion[:1] == record.answer)
"""


def test_rank_killed_while_the_controller_is_busy_elsewhere_stops_within_seconds(
        tmp_path, areno_cache, monkeypatch):
    """A rank that dies during a long reward (or rollout) phase is noticed by the
    backend's watchdog, not at the next backend call a minute later."""
    plugin = tmp_path / "slow_reward.py"
    plugin.write_text(SLOW_REWARD)
    flag = tmp_path / "slow"
    out = tmp_path / "run"
    flags = [*HF1[:-1], "2", "--max-steps", "4", "--no-save", "--output-dir", str(out),
             "--reward-fn-path", str(plugin), "--reward-timeout", "120"]
    monkeypatch.setenv("ARENO_TEST_SLOW_FLAG", str(flag))
    proc = popen_train(flags, areno_cache)
    wait_for(lambda: (out / "metrics.jsonl").is_file()
             and (out / "metrics.jsonl").read_text().strip(), proc)
    flag.touch()  # from now on every reward call takes a minute
    time.sleep(3)  # the next step is in its reward phase
    ranks = rank_pids(proc.pid)
    assert len(ranks) == 2, ranks
    killed = time.monotonic()
    os.kill(ranks[0], signal.SIGKILL)
    _, err = proc.communicate(timeout=60)
    assert time.monotonic() - killed < 10, "the dead rank was not noticed during the reward phase"
    assert proc.returncode == 1, err[-3000:]
    line = one_error_line(err)
    assert "rank 0" in line and "died" in line, line
    assert wait_group_gone(proc.pid, 5) == [], "orphan processes after a rank died"
