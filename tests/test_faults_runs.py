"""Run directories, model directories, checkpoints and option values a user gets
wrong, each through `areno train` on the tiny arith model with the shared fault
harness (tests/faults.py; issue 18, items 1-4, 8 and 9): exit code 2, one areno line
naming the culprit, no traceback, no leftover process or /dev/shm segment, a
consistent run directory, and nothing of an earlier run lost. Most cases fail
before any rank starts."""

from __future__ import annotations

import json
import os
import shutil
import signal
import struct
import subprocess
from pathlib import Path

import pytest
import yaml

from areno.rundir.checkpoint import dir_bytes, checkpoint_bytes, list_checkpoints
from areno.config.train import TrainConfig
from areno.errors import UserError
from areno.models.directory import check_model_dir
from areno.rundir.lock import LOCK_FILE
from faults import (B, FaultRun, Run, assert_clean, assert_no_leftovers, run_train, write_arith_data,
                    write_plugin)

pytestmark = pytest.mark.faults

PLUGIN = "def reward_fn(record):\n    return float(record.completion.strip()[:1] == record.answer)\n"


def one_error(res: FaultRun, *culprits: str, ckpt_root: Path | None = None) -> str:
    """The harness's checks for a refused run: exit 2, one `areno: error:` line naming
    every culprit, nothing trained."""
    assert_clean(res, 2, ["areno: error: ", *culprits], ckpt_root=ckpt_root)
    assert "step 1/" not in res.stdout
    return res.message


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("files")
    return {"plugin": write_plugin(d / "p.py", PLUGIN), "data": write_arith_data(d / "arith.jsonl")}


def train(model: Path, files: dict[str, Path], out: Path, cache: Path, *extra: str) -> FaultRun:
    """The issue's B command (tests/faults.py) with `extra` flags, to its end."""
    return run_train(B(model, files["data"], files["plugin"], out, *extra), cache, out)


@pytest.fixture(scope="module")
def saved_run(tiny_arith_path, files, areno_cache, tmp_path_factory) -> tuple[Path, Path]:
    """(run dir, save path) of a 2-step run that saved steps 1 and 2 in a --save-path of its own."""
    d = tmp_path_factory.mktemp("saved")
    out, save = d / "run", d / "elsewhere"
    res = train(tiny_arith_path, files, out, areno_cache, "--save-interval", "1", "--save-path", str(save))
    assert_clean(res, 0, None, ckpt_root=save)
    return out, save


def copy_run(saved_run: tuple[Path, Path], dest: Path) -> tuple[Path, Path]:
    """A copy of saved_run whose config.yaml records the copy's save path."""
    out, save = dest / "run", dest / "elsewhere"
    shutil.copytree(saved_run[0], out)
    shutil.copytree(saved_run[1], save)
    config = yaml.safe_load((out / "config.yaml").read_text())
    (out / "config.yaml").write_text(yaml.safe_dump({**config, "save_path": str(save)}))
    return out, save


# -- 1. one run per directory -------------------------------------------------


def test_a_second_run_a_resume_or_a_save_path_in_its_checkpoints_is_refused_naming_its_pid(
        tiny_arith_path, files, areno_cache, tmp_path):
    out = tmp_path / "run"
    args = B(tiny_arith_path, files["data"], files["plugin"], out, "--max-steps", "2000", "--epochs",
             "1000", "--save-interval", "1")
    first = Run(args, areno_cache, out)
    try:
        first.wait_for(lambda: list_checkpoints(out / "checkpoints"))
        for extra in ([], ["--resume", "latest", "--max-steps", "400"]):
            res = train(tiny_arith_path, files, out, areno_cache, *extra)
            # Not assert_clean: the run directory is the live first run's, mid-write.
            assert "Traceback" not in res.stderr and res.returncode == 2, res.tail()
            assert f"--output-dir {out} is in use by another areno run (pid {first.proc.pid})" \
                in res.message
            assert_no_leftovers(res)
        # A run elsewhere whose --save-path is the first run's default checkpoints
        # directory: both would write and prune it, and a resume of either would
        # continue from the other's steps.
        ckpts = out / "checkpoints"
        res = train(tiny_arith_path, files, tmp_path / "other", areno_cache, "--save-path", str(ckpts))
        assert "Traceback" not in res.stderr and res.returncode == 2, res.tail()
        assert f"--save-path {ckpts} is in use by another areno run (pid {first.proc.pid})" in res.message
        assert_no_leftovers(res)
        assert first.proc.poll() is None  # the first run goes on
        first.proc.send_signal(signal.SIGTERM)  # and stops as a SIGTERM stops a run: saved, clean
        assert_clean(first.finish(), 130, ["interrupted (SIGTERM)"])
    finally:
        if first.proc.poll() is None:
            os.killpg(first.proc.pid, signal.SIGKILL)


def test_a_lock_left_by_a_dead_run_is_taken_over_and_a_run_that_never_saved_keeps_its_metrics(
        tiny_arith_path, files, areno_cache, tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    dead = subprocess.Popen(["true"])
    dead.wait()
    (out / LOCK_FILE).write_text(f"{dead.pid}\n")
    earlier = '{"step": 1, "reward/mean": 0.5}\n{"step": 2, "reward/mean": 0.25}\n'
    (out / "metrics.jsonl").write_text(earlier)
    res = train(tiny_arith_path, files, out, areno_cache, "--max-steps", "1")
    assert_clean(res, 0, [f"taking over the lock on {out} left by pid {dead.pid}, which no longer runs"])
    assert "kept as metrics.1.jsonl): starting it again from step 0" in res.stdout
    assert (out / "metrics.1.jsonl").read_text() == earlier
    assert [json.loads(ln)["step"] for ln in (out / "metrics.jsonl").read_text().splitlines()] == [1]
    assert "1 step of 4x4" in res.stdout and "done: 1 step;" in res.stdout  # not "1 steps"
    assert (out / LOCK_FILE).read_text() == ""  # released cleanly: no take-over next time


# -- 2. resume finds what the run wrote ----------------------------------------


def test_resume_latest_finds_the_save_path_config_yaml_records(saved_run, areno_cache, tmp_path):
    out, save = copy_run(saved_run, tmp_path)
    res = run_train(["--output-dir", str(out), "--resume", "latest", "--max-steps", "3"], areno_cache, out)
    assert_clean(res, 0, None, ckpt_root=save)
    assert "resumed at step 2" in res.stdout
    assert [p.name for p in list_checkpoints(save)][-1] == "step_000003"  # saved where it saves
    assert not (out / "checkpoints").exists()


def test_a_fresh_run_over_a_run_that_saved_elsewhere_is_refused_and_keeps_its_metrics(
        saved_run, tiny_arith_path, files, areno_cache, tmp_path):
    out, save = copy_run(saved_run, tmp_path)
    before = (out / "metrics.jsonl").read_text()
    res = train(tiny_arith_path, files, out, areno_cache)
    one_error(res, f"checkpoint {save / 'step_000002'}", "--resume latest", ckpt_root=save)
    assert (out / "metrics.jsonl").read_text() == before


# -- 3. what the run will write, checked before the first step ----------------


@pytest.mark.parametrize("where", ["--save-path", "--output-dir"])
def test_an_unwritable_save_path_is_refused_before_the_first_step(where, tiny_arith_path, files,
                                                                  areno_cache, tmp_path):
    """A --save-path of its own under a file (found when it is locked), or the default
    <output-dir>/checkpoints taken by a file (found by the pre-flight write)."""
    out = tmp_path / "run"
    if where == "--save-path":
        blocker = tmp_path / "a-file"
        root, extra = blocker / "ckpts", ["--save-path", str(blocker / "ckpts")]
    else:
        blocker = root = out / "checkpoints"
        extra = []
    blocker.parent.mkdir(parents=True, exist_ok=True)
    blocker.write_text("")
    res = train(tiny_arith_path, files, out, areno_cache, *extra)
    one_error(res, f"{where} {root}: ", "cannot", "there", ckpt_root=tmp_path / "none")


def sparse_model(src: Path, dest: Path, elements: int) -> Path:
    """src's config and tokenizer with a model.safetensors declaring one float32 tensor
    of `elements`: a sparse file, as long as its header says, that takes no disk."""
    dest.mkdir()
    for f in src.iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, dest)
    header = json.dumps({"w": {"dtype": "F32", "shape": [elements], "data_offsets": [0, 4 * elements]}})
    with open(dest / "model.safetensors", "wb") as f:
        f.write(struct.pack("<Q", len(header)) + header.encode())
        f.truncate(8 + len(header) + 4 * elements)
    return dest


def test_a_save_path_without_room_for_one_checkpoint_is_refused_before_the_first_step(
        tiny_arith_path, files, areno_cache, tmp_path):
    model = sparse_model(tiny_arith_path, tmp_path / "huge", 1 << 38)  # 1 TiB of float32
    res = train(model, files, tmp_path / "run", areno_cache)
    one_error(res, f"--output-dir {tmp_path / 'run' / 'checkpoints'}", "MiB free", "--no-save")


def test_the_checkpoint_estimate_covers_a_real_checkpoint_closely(saved_run):
    ckpt = list_checkpoints(saved_run[1])[-1]
    weights = check_model_dir(ckpt, "--resume", "")
    estimate = checkpoint_bytes(weights.params, weights.nbytes, 4)  # the CPU run trains in float32
    assert dir_bytes(ckpt) <= estimate <= 1.2 * dir_bytes(ckpt)


# -- 4. bad model directories and checkpoints ----------------------------------


def _empty(d: Path, src: Path) -> None:
    pass


def _config_only(d: Path, src: Path) -> None:
    shutil.copy(src / "config.json", d)


def _tokenizer_only(d: Path, src: Path) -> None:
    for f in src.glob("tokenizer*"):
        shutil.copy(f, d)


def _truncated(d: Path, src: Path) -> None:
    shutil.copytree(src, d, dirs_exist_ok=True)
    with open(d / "model.safetensors", "r+b") as f:
        f.truncate(os.path.getsize(d / "model.safetensors") // 2)


def _bad_config(d: Path, src: Path) -> None:
    shutil.copytree(src, d, dirs_exist_ok=True)
    (d / "config.json").write_text('{"hidden_size": 8,')


@pytest.mark.parametrize("make, says", [
    (_empty, "the directory is empty"),
    (_config_only, "no tokenizer files"),
    (_tokenizer_only, "no config.json"),
    (_truncated, "model.safetensors is truncated"),
    (_bad_config, "config.json is not valid JSON"),
])
def test_a_bad_model_directory_is_one_line(make, says, tiny_arith_path, files, areno_cache, tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    make(model, tiny_arith_path)
    line = one_error(train(model, files, tmp_path / "run", areno_cache), f"--ckpt {model}", says, "pass a Hugging Face model directory")
    assert "sentencepiece" not in line
    assert not (tmp_path / "run").exists()  # refused before the run directory is made


def _truncate_weights(ckpt: Path) -> None:
    with open(ckpt / "model.safetensors", "r+b") as f:
        f.truncate(1000)


def _drop_optim(ckpt: Path) -> None:
    shutil.rmtree(ckpt / "backend" / "optim")


@pytest.mark.parametrize("damage, says", [
    (_truncate_weights, "model.safetensors is truncated"),
    (_drop_optim, "the optimizer state (backend/optim) is missing"),
])
def test_resume_from_a_damaged_checkpoint_is_one_line_naming_another(damage, says, saved_run, areno_cache,
                                                                     tmp_path):
    out, save = copy_run(saved_run, tmp_path)
    damage(save / "step_000002")
    res = run_train(["--output-dir", str(out), "--resume", "latest"], areno_cache, out)
    one_error(res, f"--resume {save / 'step_000002'}", says, f"--resume {save / 'step_000001'}",
              ckpt_root=save)


# -- 8. one line instead of a traceback -----------------------------------------


def test_a_negative_seed_is_refused_at_config_time(tiny_arith_path, files, areno_cache, tmp_path):
    one_error(train(tiny_arith_path, files, tmp_path / "run", areno_cache, "--seed", "-1"),
              "--seed must be >= 0")


def test_a_tensor_parallel_size_the_ranks_cannot_serve_is_refused_before_ranks_start(
        tiny_arith_path, files, areno_cache, tmp_path):
    # The vLLM engine: the transformers engine has no tensor parallelism at all (refused first).
    one_error(train(tiny_arith_path, files, tmp_path / "run", areno_cache, "--tensor-parallel-size", "2",
                    "--rollout-engine", "vllm"), "--tensor-parallel-size 2", "1 rank")


def test_yaml_numbers_pyyaml_reads_as_strings_are_accepted_for_float_options(tmp_path, files):
    f = tmp_path / "run.yaml"
    f.write_text("lr: 1e-5\noptimization:\n  weight_decay: 1E-2\n")
    assert yaml.safe_load(f.read_text())["lr"] == "1e-5"  # what PyYAML gives
    cfg = TrainConfig.from_sources(str(f), {})
    assert (cfg.lr, cfg.weight_decay) == (1e-5, 1e-2)
    f.write_text("lr: fast\n")
    with pytest.raises(UserError, match="--lr: expected a number; got 'fast'"):
        TrainConfig.from_sources(str(f), {})


def test_a_yaml_option_under_the_wrong_group_is_refused_naming_the_right_one(areno_cache, tmp_path):
    f = tmp_path / "run.yaml"
    f.write_text("rollout:\n  lr: 0.001\n")
    one_error(run_train(["--config", str(f)], areno_cache, tmp_path), "'lr' is not a Rollout option",
              "under 'optimization'")


@pytest.mark.parametrize("mode", ["grpo", "drgrpo", "rloo"])
def test_a_group_of_one_is_refused_for_every_advantage_mode(mode, areno_cache, tmp_path):
    one_error(run_train(["--adv-mode", mode, "--n-samples", "1"], areno_cache, tmp_path),
              "--n-samples must be >= 2", f"--adv-mode {mode}")


# -- 9. smaller -----------------------------------------------------------------


def test_a_malformed_csv_is_one_line_naming_the_file_and_its_line(tiny_arith_path, files, areno_cache,
                                                                  tmp_path):
    data = tmp_path / "bad.csv"
    data.write_text('prompt,answer\n"1+1=",2\n3+3=,6,7\n')
    res = train(tiny_arith_path, {**files, "data": data}, tmp_path / "run", areno_cache)
    one_error(res, f"dataset {data}: not valid CSV", "Expected 2 fields in line 3")


def test_all_empty_prompts_are_not_told_to_raise_max_prompt_len(tiny_arith_path, files, areno_cache,
                                                                 tmp_path):
    data = tmp_path / "empty.jsonl"
    data.write_text('{"prompt": "", "answer": "1"}\n{"prompt": "", "answer": "2"}\n')
    line = one_error(train(tiny_arith_path, {**files, "data": data}, tmp_path / "run", areno_cache),
                     "every prompt is empty", "prompt field")
    assert "--max-prompt-len" not in line
