"""Ctrl-C / SIGTERM during `areno train`: exit 130 within seconds, a complete
checkpoint of the last finished step, one line with the exact --resume command,
and that command continues the run."""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from areno.rundir.checkpoint import latest_checkpoint, read_state
from areno.rundir.lock import LOCK_FILE
from areno.errors import UserError
from areno.runtime.interrupt import interrupted, resume_command
from areno.procs.signals import interrupts_raise
from test_faults import assert_complete, wait_for
from test_resume import HF1, REPO, cli_env, popen_train, read_metrics, wait_group_gone


def interrupt_after(proc: subprocess.Popen, out: Path, steps: int, sig: int,
                    group: bool = False) -> tuple[str, str]:
    """Send `sig` (to the whole process group, as a terminal's Ctrl-C does, if
    `group`) once `steps` more steps are in metrics.jsonl; -> (stdout, stderr)."""
    path = out / "metrics.jsonl"
    done = len(read_metrics(out)) if path.is_file() else 0
    wait_for(lambda: path.is_file() and len(path.read_text().splitlines()) >= done + steps, proc)
    (os.killpg if group else os.kill)(proc.pid, sig)
    stdout, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 130, stderr[-3000:]
    assert "Traceback" not in stderr, stderr[-3000:]
    assert wait_group_gone(proc.pid) == [], "processes left after the interrupt"
    return stdout, stderr


def resume_line(stderr: str) -> str:
    lines = [ln for ln in stderr.splitlines() if ln.startswith("areno: interrupted")]
    assert len(lines) == 1, stderr[-3000:]
    return lines[0]


@pytest.mark.timing
def test_sigint_then_sigterm_save_the_last_finished_step_and_print_a_working_resume_command(
        tmp_path, areno_cache):
    out = tmp_path / "run"
    # far more steps than the test waits for (~15 ms each): both signals land mid-run
    proc = popen_train([*HF1, "--max-steps", "5000", "--output-dir", str(out)], areno_cache)
    _, err = interrupt_after(proc, out, 2, signal.SIGINT, group=True)
    line = resume_line(err)
    ckpt = latest_checkpoint(out / "checkpoints")
    assert ckpt is not None, err[-3000:]
    assert_complete(ckpt)
    stopped_at = int(read_state(ckpt)["step"])
    assert stopped_at >= 2 and f"after step {stopped_at} of 5000" in line
    assert max(r["step"] for r in read_metrics(out)) == stopped_at  # nothing half-done kept
    cmd = shlex.split(line.split("continue with: ", 1)[1])
    assert cmd[:2] == ["areno", "train"] and cmd[-2:] == ["--resume", str(ckpt)]

    # The printed command, as it is (areno = python -m areno.cli), then SIGTERM.
    proc = subprocess.Popen([sys.executable, "-m", "areno.cli", *cmd[1:]], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=REPO, env=cli_env(areno_cache),
                            start_new_session=True)
    stdout, err = interrupt_after(proc, out, 1, signal.SIGTERM)
    assert f"resumed at step {stopped_at}" in stdout
    line = resume_line(err)
    assert "(SIGTERM)" in line
    again = latest_checkpoint(out / "checkpoints")
    assert int(read_state(again)["step"]) > stopped_at, line
    assert_complete(again)


def test_interrupt_inside_a_backend_command_names_the_previous_checkpoint(tmp_path, capsys):
    """The backend aborted (the interrupt came mid-command): step 5 cannot be saved."""
    (tmp_path / "checkpoints" / "step_000004").mkdir(parents=True)
    (tmp_path / "checkpoints" / "step_000004" / "trainer_state.json").write_text("{}")

    def save(step: int) -> None:
        raise UserError("cannot save checkpoint: backend is closed")

    run = SimpleNamespace(cfg=SimpleNamespace(save_path=None, no_save=False), output_dir=tmp_path,
                          step=5, total_steps=9, save=save)
    with pytest.raises(SystemExit) as e:
        interrupted(run)
    assert e.value.code == 130
    err = capsys.readouterr().err.strip()
    assert err.startswith("areno: interrupted (SIGINT) after step 5 of 9; step 5 could not be saved")
    assert err.endswith(f"--resume {tmp_path / 'checkpoints' / 'step_000004'}")


def test_resume_command_replaces_the_resume_flag():
    argv = ["train", "--lr", "1e-5", "--resume", "latest", "--output-dir", "my run"]
    assert resume_command(Path("/r/step_000002"), argv) == (
        "areno train --lr 1e-5 --output-dir 'my run' --resume /r/step_000002")
    assert resume_command(None, ["train", "--resume=latest"]) == "areno train"


def test_ctrl_c_before_training_starts_exits_130(monkeypatch, capsys):
    """typer turns KeyboardInterrupt into status 130; main used to return 0."""
    import areno.trainer
    from areno.cli import main

    def boom(cfg, **_):
        raise KeyboardInterrupt

    monkeypatch.setattr(areno.trainer, "run_training", boom)
    assert main(["train", "--max-steps", "1"]) == 130
    assert "areno: interrupted" in capsys.readouterr().err


def test_an_interrupt_during_an_update_waits_for_the_step_a_second_one_does_not():
    from areno.procs.signals import defer_interrupts, release_interrupts

    with interrupts_raise():
        defer_interrupts()
        os.kill(os.getpid(), signal.SIGINT)  # marked, not raised: the update goes on
        with pytest.raises(KeyboardInterrupt):
            release_interrupts()  # the step is whole: now it stops
        defer_interrupts()
        os.kill(os.getpid(), signal.SIGINT)
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)  # the second one raises at once
        release_interrupts(raise_pending=False)
        release_interrupts()  # nothing pending: no raise


@pytest.mark.parametrize("where", ["resolve_device", "load_tokenizer"])
def test_an_interrupt_during_start_up_says_what_was_written(where, tmp_path, monkeypatch, capsys):
    """Before the run dir exists nothing was written; after it, config.yaml was
    (and no checkpoint): either way the line says how to start again."""
    import areno.run
    from areno.config.train import TrainConfig
    from areno.trainer import run_training

    def interrupt(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(areno.run, where, interrupt)
    monkeypatch.setattr(sys, "argv", ["areno", "train", "--output-dir", str(tmp_path / "run")])
    cfg = TrainConfig.from_sources(overrides={"output_dir": str(tmp_path / "run")})
    with interrupts_raise(), pytest.raises(SystemExit) as e:
        run_training(cfg)
    assert e.value.code == 130
    err = capsys.readouterr().err.strip()
    assert err.startswith("areno: interrupted (SIGINT) during start-up: "), err
    assert err.endswith(f"start again with the same command: areno train --output-dir {tmp_path / 'run'}")
    if where == "resolve_device":
        assert "nothing was written yet" in err and not (tmp_path / "run").exists()
    else:
        assert f"run dir {tmp_path / 'run'} has config.yaml" in err and "no checkpoint" in err
        assert (tmp_path / "run" / "config.yaml").is_file()


@pytest.mark.timing
def test_sigint_while_the_ranks_start_names_the_run_dir_and_exits_130(tmp_path, areno_cache):
    out = tmp_path / "run"
    proc = popen_train([*HF1, "--max-steps", "5000", "--output-dir", str(out)], areno_cache)
    # run.log opens before the tokenizer loads and the ranks spawn: seconds of start-up
    wait_for(lambda: (out / "run.log").is_file(), proc, every=0.005)
    os.killpg(proc.pid, signal.SIGINT)
    stdout, err = proc.communicate(timeout=60)
    assert proc.returncode == 130 and "Traceback" not in err, err[-3000:]
    assert wait_group_gone(proc.pid) == [], "processes left after the interrupt"
    line = err.strip().splitlines()[-1]
    assert line.startswith(f"areno: interrupted (SIGINT) during start-up: run dir {out} has "
                           "config.yaml, run.log, no checkpoint (no step ran); start again with the "
                           "same command: areno train "), err[-3000:]
    # the pre-flight check may have made checkpoints/ (locked) to try writing there: no step in it
    assert [p.name for p in out.glob("checkpoints/*")] in ([], [LOCK_FILE]), list(out.glob("checkpoints/*"))
