"""checkpoint.py without processes: which directories count as checkpoints, the
atomic save (temp dir + rename), pruning, failed saves, and what a save adds
on top of the backend's files (source generation settings, controller RNG).

The backend is a fake that writes files the way TorchBackend does; the real
backend is exercised end to end in test_resume.py and test_faults.py."""

from __future__ import annotations

import errno
import json
import random
import struct
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest
import torch

from areno.procs.errors import BackendError
from areno.rundir.checkpoint import (
    STATE_FILE,
    latest_checkpoint,
    list_checkpoints,
    read_state,
    restore_controller_rng,
    save_checkpoint,
    save_controller_rng,
)
from areno.config.train import TrainConfig
from areno.errors import UserError


def make_ckpt(root: Path, name: str, complete: bool = True) -> Path:
    """A checkpoint directory with the files --resume checks (complete) or without its state."""
    p = root / name
    (p / "backend" / "optim").mkdir(parents=True)
    (p / "model.safetensors").write_bytes(struct.pack("<Q", 2) + b"{}")  # a header, no tensors
    (p / "config.json").write_text('{"model_type": "llama"}')
    (p / "tokenizer.json").write_text("{}")
    (p / "backend" / "optim" / ".metadata").write_bytes(b"")
    (p / "backend" / "trainer.pt").write_bytes(b"")
    if complete:
        (p / STATE_FILE).write_text(json.dumps({"step": 1}))
    return p


@dataclass
class FakeBackend:
    """Writes what TorchBackend writes: HF files (config with use_cache off, a
    generation_config derived from it) and a backend/ state directory."""

    fail_on: str | None = None  # "save_pretrained" | "save_state"
    error: BaseException | None = None
    tag: str = "a"

    def save_pretrained(self, path: Path) -> None:
        if self.fail_on == "save_pretrained":
            raise self.error
        path.mkdir(parents=True)
        (path / "model.safetensors").write_text(self.tag)
        (path / "config.json").write_text(json.dumps({"model_type": "qwen3", "use_cache": False}))
        (path / "generation_config.json").write_text(json.dumps({"eos_token_id": 2}))

    def save_state(self, path: Path) -> None:
        path.mkdir(parents=True)
        (path / "trainer.pt").write_text(self.tag)
        if self.fail_on == "save_state":
            raise self.error


class FakeTokenizer:
    def save_pretrained(self, path: str) -> None:
        (Path(path) / "tokenizer.json").write_text("{}")


class FakeSampler:
    def state_dict(self) -> dict:
        return {"epoch": 3, "position": 8, "seed": 0, "num_prompts": 55, "batch_size": 4}


@dataclass
class FakeRun:
    output_dir: Path
    model_path: str
    keep_last: int = 2
    backend: FakeBackend = field(default_factory=FakeBackend)
    tokenizer: FakeTokenizer = field(default_factory=FakeTokenizer)
    sampler: FakeSampler = field(default_factory=FakeSampler)

    def __post_init__(self) -> None:
        self.cfg = TrainConfig(keep_last=self.keep_last, output_dir=str(self.output_dir))


@pytest.fixture
def run(tmp_path) -> FakeRun:
    return FakeRun(tmp_path / "run", model_path=str(tmp_path / "no-such-model"))


def entries(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir())


def test_temp_old_and_incomplete_dirs_are_never_listed(tmp_path):
    good = make_ckpt(tmp_path, "step_000001")
    make_ckpt(tmp_path, ".tmp-step_000002-123")  # a save in progress (even with its state file)
    make_ckpt(tmp_path, "..tmp-step_000002-123.tmp-ab12")  # the backend's own temp dir
    make_ckpt(tmp_path, ".old-step_000001-9")  # a replaced checkpoint on its way out
    make_ckpt(tmp_path, "step_000003", complete=False)  # no trainer_state.json
    make_ckpt(tmp_path, "step_x")
    (tmp_path / "step_000004").write_text("a file")
    assert list_checkpoints(tmp_path) == [good]
    assert latest_checkpoint(tmp_path) == good
    assert list_checkpoints(tmp_path / "missing") == [] and latest_checkpoint(tmp_path / "missing") is None


def test_latest_is_the_highest_step_number_not_the_last_name(tmp_path):
    make_ckpt(tmp_path, "step_000009")
    make_ckpt(tmp_path, "step_000010")
    big = make_ckpt(tmp_path, "step_1000000")  # past the 6-digit padding
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_000009", "step_000010", "step_1000000"]
    assert latest_checkpoint(tmp_path) == big


def test_save_is_complete_renamed_and_pruned_to_keep_last(run):
    for step in (1, 2, 3):
        save_checkpoint(run, step)
    root = run.output_dir / "checkpoints"
    assert entries(root) == ["step_000002", "step_000003"]  # no temp dir, step 1 pruned
    ck = root / "step_000003"
    state = read_state(ck)
    assert state["step"] == 3 and state["sampler"]["epoch"] == 3 and state["sampler"]["position"] == 8
    assert state["config"]["keep_last"] == 2 and state["model_path"] == run.model_path
    for f in ("model.safetensors", "config.json", "tokenizer.json", "controller_rng.pt",
              "backend/trainer.pt"):
        assert (ck / f).is_file(), f


def test_keep_last_zero_keeps_every_checkpoint(tmp_path):
    run = FakeRun(tmp_path / "run", model_path=str(tmp_path / "none"), keep_last=0)
    for step in (1, 2, 3):
        save_checkpoint(run, step)
    assert len(list_checkpoints(run.output_dir / "checkpoints")) == 3


def test_save_path_overrides_the_run_directory(tmp_path):
    run = FakeRun(tmp_path / "run", model_path=str(tmp_path / "none"))
    run.cfg.save_path = str(tmp_path / "elsewhere")
    assert save_checkpoint(run, 5) == tmp_path / "elsewhere" / "step_000005"
    assert not (run.output_dir / "checkpoints").exists()


@pytest.mark.parametrize("fail_on, error, why", [
    ("save_state", OSError(errno.ENOSPC, "No space left on device"), "No space left on device"),
    ("save_pretrained", OSError(errno.EACCES, "Permission denied"), "Permission denied"),
    ("save_state", BackendError("save_state: rank 0 failed: OSError: [Errno 28] No space left on "
                                "device: '/ck/backend/optim/__0_0.distcp'", rank=0),
     "No space left on device (on rank 0)"),
])
def test_failed_save_is_one_clear_error_and_leaves_the_previous_checkpoint(run, fail_on, error, why):
    save_checkpoint(run, 1)
    run.backend = FakeBackend(fail_on=fail_on, error=error, tag="b")
    with pytest.raises(UserError) as info:
        save_checkpoint(run, 2)
    msg = str(info.value)
    root = run.output_dir / "checkpoints"
    assert "\n" not in msg and "step_000002" in msg and why in msg
    assert f"the previous checkpoint {root / 'step_000001'} is intact" in msg
    assert entries(root) == ["step_000001"]  # no temp dir left behind
    assert (root / "step_000001" / "model.safetensors").read_text() == "a"


def test_a_rank_that_dies_mid_save_is_a_runtime_failure_not_a_user_error(run):
    """A dead or frozen rank is no fault of the disk: BackendError (exit 1, the loop
    names the checkpoint to resume from), and no temp dir is left behind."""
    save_checkpoint(run, 1)
    run.backend = FakeBackend(fail_on="save_pretrained", tag="b",
                              error=BackendError("save_pretrained: rank 1 died (killed by SIGKILL)", rank=1))
    with pytest.raises(BackendError) as info:
        save_checkpoint(run, 2)
    assert not isinstance(info.value, UserError)
    assert "cannot save checkpoint" in str(info.value) and "rank 1 died" in str(info.value)
    assert entries(run.output_dir / "checkpoints") == ["step_000001"]


def test_a_failed_first_save_claims_no_previous_checkpoint(run):
    run.backend = FakeBackend(fail_on="save_pretrained", error=OSError(errno.EACCES, "Permission denied"),
                              tag="b")
    with pytest.raises(UserError) as info:
        save_checkpoint(run, 1)
    assert "intact" not in str(info.value) and "(no checkpoint was saved)" in str(info.value)


def test_leftovers_of_an_interrupted_save_are_removed_by_the_next_save(run):
    root = run.output_dir / "checkpoints"
    make_ckpt(root, ".tmp-step_000002-77")
    make_ckpt(root, "..tmp-step_000002-77.tmp-ab12")
    make_ckpt(root, ".old-step_000001-77")
    save_checkpoint(run, 2)
    assert entries(root) == ["step_000002"]


def test_resaving_a_step_replaces_it_whole(run):
    save_checkpoint(run, 2)
    run.backend = FakeBackend(tag="b")
    save_checkpoint(run, 2)
    root = run.output_dir / "checkpoints"
    assert entries(root) == ["step_000002"]
    assert (root / "step_000002" / "model.safetensors").read_text() == "b"


def test_saved_model_keeps_the_source_models_generation_settings(tmp_path, tiny_arith_path):
    """The arith model stops at eos 2 or pad 0; a checkpoint that forgot 0 would
    sample differently from the model it was saved from (seen as a resumed run
    drifting from an uninterrupted one). The backend's HF writer keeps them."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from areno.backend.weights import save_hf_dir

    config = AutoConfig.from_pretrained(tiny_arith_path)
    config.use_cache = False  # as the training copy has it
    model = AutoModelForCausalLM.from_pretrained(tiny_arith_path)
    out = tmp_path / "saved"
    out.mkdir()
    save_hf_dir(config, iter(model.state_dict().items()), out, tiny_arith_path)
    src_gen = json.loads((tiny_arith_path / "generation_config.json").read_text())
    gen = json.loads((out / "generation_config.json").read_text())
    assert gen["eos_token_id"] == src_gen["eos_token_id"] and len(gen["eos_token_id"]) == 2
    assert json.loads((out / "config.json").read_text())["use_cache"] is True


def test_controller_rng_round_trip(tmp_path):
    save_controller_rng(tmp_path / "rng.pt")
    expected = (random.random(), np.random.rand(), torch.rand(1).item())
    (tmp_path / "ck").mkdir()
    (tmp_path / "rng.pt").rename(tmp_path / "ck" / "controller_rng.pt")
    restore_controller_rng(tmp_path / "ck")
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == expected
    restore_controller_rng(tmp_path / "missing")  # older checkpoints: a no-op


def test_read_state_of_an_incomplete_checkpoint_is_a_user_error(tmp_path):
    make_ckpt(tmp_path, "step_000001", complete=False)
    with pytest.raises(UserError, match="not a complete areno checkpoint"):
        read_state(tmp_path / "step_000001")


def test_resume_latest_skips_temp_dirs_and_says_when_there_is_nothing(tmp_path):
    from areno.rundir.resume import Resume

    cfg = TrainConfig(output_dir=str(tmp_path), resume="latest")
    with pytest.raises(UserError, match="no complete checkpoint under"):
        Resume.find(cfg)
    good = make_ckpt(tmp_path / "checkpoints", "step_000003")
    make_ckpt(tmp_path / "checkpoints", ".tmp-step_000004-1")
    make_ckpt(tmp_path / "checkpoints", "step_000005", complete=False)
    assert Resume.find(cfg).ckpt == good
    assert Resume.find(TrainConfig(resume=str(good))).ckpt == good


def test_a_failed_save_on_a_full_disk_says_so(run, monkeypatch):
    """torch.save reports ENOSPC as "unexpected pos" with no errno; free space tells."""
    import shutil
    from collections import namedtuple

    save_checkpoint(run, 1)
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(5 << 20, (5 << 20) - 4096, 4096))
    run.backend = FakeBackend(fail_on="save_state", error=BackendError(
        "save_state: rank 0 failed: CheckpointException", rank=0,
        remote_traceback="Traceback ...\nRuntimeError: unexpected pos 704 vs 598\n"))
    with pytest.raises(UserError, match=r"no space left on the device of .*0\.0 MiB free.*"
                                        r"unexpected pos 704 vs 598 \(the previous checkpoint"):
        save_checkpoint(run, 2)
    monkeypatch.undo()
    run.backend = FakeBackend(fail_on="save_state", error=OSError(errno.EIO, "I/O error"))
    with pytest.raises(UserError) as info:
        save_checkpoint(run, 2)
    assert "no space" not in str(info.value) and "I/O error" in str(info.value)


def test_resume_drops_checkpoints_of_the_abandoned_continuation(tmp_path):
    from areno.rundir.checkpoint import drop_after

    for s in (1, 2, 3, 4):
        make_ckpt(tmp_path, f"step_00000{s}")
    drop_after(tmp_path, 2)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_000001", "step_000002"]


def test_a_fresh_run_refuses_an_output_dir_that_holds_a_run(tmp_path):
    from areno.rundir.resume import Resume
    from areno.config.train import TrainConfig
    from areno.run import make_output_dir

    out = tmp_path / "run"
    (out / "checkpoints" / "step_000001").mkdir(parents=True)
    (out / "checkpoints" / "step_000001" / "trainer_state.json").write_text("{}")
    (out / "metrics.jsonl").write_text('{"step": 1}\n')
    cfg = TrainConfig.from_sources(None, {"output_dir": str(out)})
    with pytest.raises(UserError, match="already holds a run.*--resume latest"):
        make_output_dir(cfg)
    assert make_output_dir(cfg, Resume(out / "checkpoints" / "step_000001", {"step": 1})) == out


def test_a_run_that_stopped_before_its_first_checkpoint_starts_again(tmp_path, capsys):
    from areno.config.train import TrainConfig
    from areno.run import make_output_dir

    out = tmp_path / "run"
    (out / "checkpoints" / ".tmp-step_000002-123").mkdir(parents=True)  # killed mid-save
    (out / "metrics.jsonl").write_text('{"step": 1}\n')
    assert make_output_dir(TrainConfig.from_sources(None, {"output_dir": str(out)})) == out
    assert not (out / "metrics.jsonl").exists() and list((out / "checkpoints").iterdir()) == []
    assert (out / "metrics.1.jsonl").read_text() == '{"step": 1}\n'  # kept, not overwritten
    assert ("stopped before its first checkpoint (its metrics kept as metrics.1.jsonl): "
            "starting it again" in capsys.readouterr().out)


def test_a_prune_cut_short_never_leaves_a_checkpoint_that_lists_as_complete(tmp_path, monkeypatch):
    """An interrupt (or a kill) in the middle of removing an old checkpoint: its
    state file may still be there while its weights are gone. The listing must
    not offer it for --resume."""
    import areno.rundir.checkpoint as ckpt_mod

    for step in (1, 2, 3):
        make_ckpt(tmp_path, f"step_{step:06d}")

    def cut_short(path, ignore_errors=False):  # the first file goes, then the process stops
        (Path(path) / "tokenizer.json").unlink()
        raise KeyboardInterrupt

    monkeypatch.setattr(ckpt_mod.shutil, "rmtree", cut_short)
    with pytest.raises(KeyboardInterrupt):
        ckpt_mod.prune(tmp_path, keep_last=2)
    listed = list_checkpoints(tmp_path)
    assert [p.name for p in listed] == ["step_000002", "step_000003"]
    assert all((p / "tokenizer.json").is_file() for p in listed)
