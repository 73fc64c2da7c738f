"""--rollout-engine where vLLM does not import (issue 26, 4): given explicitly,
vllm is a one-line error with exit code 2; only the default falls back to
transformers, and the start-up line says so. vLLM is made unimportable in the
ranks the CLI spawns (the engines are built there; the controller never imports
vLLM: test_engines.py) by a sitecustomize that sets sys.modules["vllm"] = None
(`import vllm` then raises ModuleNotFoundError, an ImportError)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

from inprocess import run_here


def run_without_vllm(tmp_path: Path, tiny_arith_path: Path, *flags: str) -> subprocess.CompletedProcess:
    """`areno train` (in this process: run_here) whose ranks cannot import vLLM."""
    blocker = tmp_path / "no_vllm"
    blocker.mkdir()
    (blocker / "sitecustomize.py").write_text("import sys\nsys.modules['vllm'] = None\n")
    data = tmp_path / "d.jsonl"
    data.write_text('{"prompt": "1+1=", "answer": "2"}\n')
    args = ["train", "--ckpt", str(tiny_arith_path), "--dataset-path", str(data), "--reward-fn-path",
            "builtin:arith", "--no-chat-template", "--batch-size", "1", "--n-samples", "2",
            "--max-new-tokens", "2", "--reward-workers", "0", "--max-steps", "1", "--no-save",
            "--output-dir", str(tmp_path / "run"), *flags]
    return run_here(args, env={"PYTHONPATH": os.pathsep.join([str(blocker), os.environ["PYTHONPATH"]])})


def test_the_blocker_makes_vllm_unimportable(tmp_path: Path) -> None:
    blocker = tmp_path / "b"
    blocker.mkdir()
    (blocker / "sitecustomize.py").write_text("import sys\nsys.modules['vllm'] = None\n")
    proc = subprocess.run([sys.executable, "-c", "import vllm"], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join([str(blocker), os.environ["PYTHONPATH"]])})
    assert proc.returncode == 1 and "import of vllm halted; None in sys.modules" in proc.stderr


def test_explicit_vllm_that_does_not_import_is_one_line_exit_2(tmp_path: Path, tiny_arith_path: Path) -> None:
    proc = run_without_vllm(tmp_path, tiny_arith_path, "--rollout-engine", "vllm")
    err = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(err) == 1, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert err[0].startswith("areno: error: --rollout-engine vllm: vLLM does not import here "), err
    assert "--rollout-engine hf" in err[0] and "Traceback" not in proc.stdout + proc.stderr


def test_the_default_engine_falls_back_and_the_start_up_line_says_so(tmp_path: Path,
                                                                     tiny_arith_path: Path) -> None:
    proc = run_without_vllm(tmp_path, tiny_arith_path)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    (start,) = [line for line in proc.stdout.splitlines() if line.startswith("areno: ") and " run dir " in line]
    assert "sampling with the hf engine: vLLM does not import here (fell back;" in start, start


def test_tensor_parallel_with_the_transformers_engine_is_one_line_exit_2(files, monkeypatch, capsys) -> None:
    """Every rank of a TP group would generate the same prompts with transformers."""
    from helpers import refused

    data = ["--dataset-path", files["dataset_path"], "--reward-fn-path", files["reward_fn_path"]]
    line = refused([*data, "--world-size", "2", "--rollout-engine", "hf", "--tensor-parallel-size", "2"], capsys)
    assert "--rollout-engine hf with --tensor-parallel-size 2: the transformers engine has no " \
        "tensor parallelism" in line
    monkeypatch.setitem(sys.modules, "vllm", None)  # the default engine then falls back to hf
    line = refused([*data, "--world-size", "2", "--tensor-parallel-size", "2"], capsys)
    assert "--tensor-parallel-size 2: vLLM is not installed, and the transformers engine" in line
    from areno.config.train import TrainConfig

    # vLLM given, or TP 1 with transformers: nothing refused at config time
    assert TrainConfig.from_sources(None, {**files, "tensor_parallel_size": 1}).rollout_engine is None
    monkeypatch.delitem(sys.modules, "vllm")
    if importlib.util.find_spec("vllm") is not None:
        assert TrainConfig.from_sources(None, {**files, "tensor_parallel_size": 2}).tensor_parallel_size == 2


def test_a_broken_vllm_with_tensor_parallel_is_refused_not_replaced(monkeypatch) -> None:
    """Installed (the config passed) but not importable: the ranks refuse rather than fall back."""
    from areno.errors import UserError
    from areno.rollout.factory import EngineSpec, make_engine

    monkeypatch.setitem(sys.modules, "vllm", None)
    # areno's adapter too: imported before in this process, it would not import vllm again (and
    # vllm's logging config, set up then, names vllm's formatter: unresolvable with vllm None).
    monkeypatch.setitem(sys.modules, "areno.rollout.vllm", None)
    with pytest.raises(UserError, match="--tensor-parallel-size 2: vLLM does not import here .* "
                                        "no tensor parallelism"):
        make_engine(EngineSpec(tensor_parallel_size=2), "unused")
