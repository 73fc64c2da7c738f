"""What a resume may change (areno/config/resume.py), and starting again a run that
stopped before its first checkpoint (its leftover shared memory removed)."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest
import yaml

from areno.config.train import TrainConfig
from areno.errors import UserError
from areno.config.resume import resume_config
from test_checkpoint import make_ckpt
from test_leftovers import dead_pid
from inprocess import run_here
from test_resume import HF1, ok, train_steps


def saved_run(tmp_path, **saved) -> TrainConfig:
    """A checkpoint whose trainer_state.json holds the config of a run with `saved`."""
    ckpt = make_ckpt(tmp_path / "checkpoints", "step_000002")
    config = TrainConfig.from_sources(None, saved).to_dict()
    (ckpt / "trainer_state.json").write_text(json.dumps({"step": 2, "config": config}))
    return ckpt


def test_resume_keeps_the_saved_options_and_applies_only_those_that_may_change(tmp_path, capsys):
    saved_run(tmp_path, lr=1e-5, batch_size=4, max_steps=2, seed=7)
    given = {"resume": "latest", "output_dir": str(tmp_path), "max_steps": 5, "keep_last": 0}
    cfg = resume_config(TrainConfig.from_sources(None, given), set(given))
    # not given: the checkpoint's (not the defaults); given and allowed: applied
    assert (cfg.lr, cfg.batch_size, cfg.seed) == (1e-5, 4, 7)
    assert (cfg.max_steps, cfg.keep_last, cfg.output_dir) == (5, 0, str(tmp_path))
    assert capsys.readouterr().out.strip() == (
        "areno: resuming with --max-steps 2 -> 5, --keep-last 2 -> 0")

    bad = {**given, "lr": 1e-4, "batch_size": 8}
    with pytest.raises(UserError, match=r"^--resume: --batch-size 4 -> 8, --lr 1e-05 -> 0.0001: "
                                        r"these options cannot change when resuming"):
        resume_config(TrainConfig.from_sources(None, bad), set(bad))


@pytest.mark.alone
def test_restart_before_a_checkpoint_then_a_longer_max_steps_gets_the_longer_runs_lr(
        tmp_path, areno_cache):
    out = tmp_path / "run"
    out.mkdir()
    (out / "metrics.jsonl").write_text('{"step": 1, "reward/mean": 0.5}\n')  # killed in step 2
    # ... by SIGKILL, leaving its hand-off segment behind
    segment = Path("/dev/shm") / f"areno-bk-{dead_pid()}-{os.getpid():08x}-pack"
    segment.write_bytes(b"x" * 4096)
    res = ok(run_here(["train", *HF1, "--max-steps", "2", "--output-dir", str(out)], areno_cache))
    assert "stopped before its first checkpoint (its metrics kept as metrics.1.jsonl): starting it " \
        "again from step 0" in res.stdout
    assert not segment.exists() and segment.name in res.stdout  # removed at the start
    assert sorted(train_steps(out)) == [1, 2]

    # Only --max-steps given: the rest (engine, batch shape, LR) is the checkpoint's.
    res = ok(run_here(["train", "--output-dir", str(out), "--resume", "latest", "--max-steps", "4"],
                      areno_cache))
    assert "areno: resuming with --max-steps 2 -> 4" in res.stdout
    config = yaml.safe_load((out / "config.yaml").read_text())
    assert (config["max_steps"], config["batch_size"], config["rollout_engine"]) == (4, 4, "hf")
    from areno.backend.config import BackendConfig
    from areno.backend.step import lr_lambda

    # What a run started with --max-steps 4 uses at every step (the demo: lr 3e-4, floor 0.1).
    f = lr_lambda(BackendConfig(model_path="x", total_steps=4, min_lr_ratio=0.1))
    steps = train_steps(out)
    assert sorted(steps) == [1, 2, 3, 4]
    for k in (3, 4):
        assert math.isclose(steps[k]["train/lr"], 3e-4 * f(k - 1), rel_tol=1e-6), k

    res = run_here(["train", "--output-dir", str(out), "--resume", "latest", "--lr", "1e-5"], areno_cache)
    assert res.returncode == 2 and res.stderr.count("\n") == 1, res.stderr
    assert res.stderr.startswith("areno: error: --resume: --lr 0.0003 -> 1e-05: this option cannot")
