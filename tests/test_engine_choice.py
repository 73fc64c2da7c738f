"""--rollout-engine where vLLM does not import (issue 26, 4): given explicitly,
vllm is a one-line error with exit code 2; only the default falls back to
transformers, and the start-up line says so. vLLM is made unimportable in the
CLI's subprocess and in the ranks it spawns by a sitecustomize that sets
sys.modules["vllm"] = None (`import vllm` then raises ModuleNotFoundError, an ImportError)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def run_without_vllm(tmp_path: Path, tiny_arith_path: Path, *flags: str) -> subprocess.CompletedProcess:
    blocker = tmp_path / "no_vllm"
    blocker.mkdir()
    (blocker / "sitecustomize.py").write_text("import sys\nsys.modules['vllm'] = None\n")
    data = tmp_path / "d.jsonl"
    data.write_text('{"prompt": "1+1=", "answer": "2"}\n')
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(blocker), os.environ["PYTHONPATH"]]), "COLUMNS": "500",
           "PYTHONUNBUFFERED": "1"}
    args = ["train", "--ckpt", str(tiny_arith_path), "--dataset-path", str(data), "--reward-fn-path",
            "builtin:arith", "--no-chat-template", "--batch-size", "1", "--n-samples", "2",
            "--max-new-tokens", "2", "--reward-workers", "0", "--max-steps", "1", "--no-save",
            "--output-dir", str(tmp_path / "run"), *flags]
    return subprocess.run([sys.executable, "-m", "areno.cli", *args], capture_output=True, text=True,
                          timeout=300, cwd=REPO, env=env)


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
