"""Split placement's GPU branch, taken on CPU (issue 26, 1).

An engine process on a GPU must (a) see only its own GPU, N + i of the
controller's, because vLLM takes device 0 whatever torch.cuda.set_device says;
(b) build an in-process vLLM engine, or the first load_region raises "needs an
in-process engine"; (c) take most of its GPU, not the colocated half. Its
start-up is the CPU code path up to the device call: these tests run it with
the device condition forced (torch.cuda.is_available and device_count patched
to true/1, torch.cuda.set_device recorded) and stop it where CUDA would be
touched (vLLM's engine constructor), asserting the environment and the
arguments the GPU would get.
"""

from __future__ import annotations

import os
from dataclasses import replace

import pytest
import torch

from areno.backend.config import BackendConfig
from areno.backend.launch import peer_env
from areno.fleet.engine_procs import engine_env
from areno import settings
from areno.config.train import TrainConfig
from areno.errors import UserError


class ReachedTheDevice(Exception):
    """Raised where the engine would first touch CUDA, carrying what it would get."""


def gpu_cfg(model_path: str, n: int, m: int, **train) -> BackendConfig:
    """The backend config the CLI builds for a split run on GPU (N ranks, M engine processes)."""
    tcfg = TrainConfig(rollout_world_size=m, **train)
    spec = settings.engine_spec(tcfg, "cuda", max_prompt_len=32)
    return settings.backend_config(tcfg, model_path, model_path, n, "cuda", 10, spec)


@pytest.fixture
def fake_gpu(monkeypatch):
    """torch reports one CUDA device; set_device calls are recorded, not made."""
    import areno.rollout.vllm  # noqa: F401  (imported for real, as on CPU, before CUDA is faked)

    calls: list[torch.device] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_device", calls.append)
    return calls


def test_each_engine_process_sees_only_its_own_gpu() -> None:
    cfg = gpu_cfg("m", n=2, m=2)
    shape = cfg.engine_procs().shape
    assert engine_env(shape, 0, None) == {"ARENO_ENGINE_INDEX": "0", "CUDA_VISIBLE_DEVICES": "2"}
    assert engine_env(shape, 1, None)["CUDA_VISIBLE_DEVICES"] == "3"
    # the controller's own restriction: engine 1 takes the 4th GPU it sees
    assert engine_env(shape, 1, "4,5,GPU-aa,7")["CUDA_VISIBLE_DEVICES"] == "7"
    assert engine_env(shape, 0, "4,5,GPU-aa,7")["CUDA_VISIBLE_DEVICES"] == "GPU-aa"
    assert "CUDA_VISIBLE_DEVICES" not in peer_env(cfg, 0, 1234)  # ranks see every GPU (cuda:LOCAL_RANK)
    assert engine_env(replace(shape, engine_gpus=(0, 0)), 1, "4,5")["CUDA_VISIBLE_DEVICES"] == "4"
    assert "CUDA_VISIBLE_DEVICES" not in engine_env(replace(shape, device="cpu"), 0, None)


def test_engine_process_start_up_on_a_gpu(tiny_chat_path, fake_gpu, monkeypatch) -> None:
    import areno.rollout.vllm as vllm_mod
    from areno.fleet.engine_proc import EngineWorker

    cfg = gpu_cfg(str(tiny_chat_path), n=2, m=1).engine_procs()
    for k, v in engine_env(cfg.shape, 0, "4,5,6").items():  # as engine_proc.spawn_main applies it
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")  # a GPU host's default: separate engine core

    def at_the_device(model, **kw):
        raise ReachedTheDevice(model, kw, os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"],
                               os.environ["CUDA_VISIBLE_DEVICES"])

    monkeypatch.setattr(vllm_mod, "VLLMEngine", at_the_device)
    with pytest.raises(ReachedTheDevice) as reached:
        EngineWorker(cfg)
    model, kw, multiprocessing, visible = reached.value.args
    assert fake_gpu == [torch.device("cuda", 0)]  # its one visible GPU: the controller's 6
    assert visible == "6" and multiprocessing == "0" and model == str(tiny_chat_path)
    assert kw == dict(tensor_parallel_size=1, dtype="bfloat16", seed=0, max_model_len=1056, max_lora_rank=0,
                      gpu_memory_utilization=0.9, enable_sleep_mode=True)


def test_engine_gpu_memory_defaults_by_placement_unless_given() -> None:
    def share(**kw) -> float:
        return settings.engine_spec(TrainConfig(**kw), "cuda", 32).gpu_memory_utilization

    assert share() == 0.5 and share(rollout_world_size=1) == 0.9
    assert share(rollout_world_size=1, gpu_memory_utilization=0.7) == 0.7 == share(gpu_memory_utilization=0.7)


def test_one_gpu_placement_for_checks(fake_gpu, monkeypatch) -> None:
    """ARENO_ENGINE_GPUS=0 puts the engine process beside rank 0 on the one GPU
    (scripts/gpu_check.sh); without it 1 + 1 processes need 2 GPUs."""
    from areno.runtime.placement import check_placement

    tcfg = TrainConfig(rollout_world_size=1)
    with pytest.raises(UserError, match="need 2 GPUs, 1 visible"):
        check_placement(tcfg, 1, 1, "cuda")
    monkeypatch.setenv("ARENO_ENGINE_GPUS", "1")
    with pytest.raises(UserError, match="ARENO_ENGINE_GPUS=1: --rollout-world-size 1 needs 1 GPU"):
        check_placement(tcfg, 1, 1, "cuda")
    monkeypatch.setenv("ARENO_ENGINE_GPUS", "0")
    check_placement(tcfg, 1, 1, "cuda")
    cfg = gpu_cfg("m", n=1, m=1)
    assert cfg.engine_gpus == (0,) and engine_env(cfg.engine_procs().shape, 0, None)["CUDA_VISIBLE_DEVICES"] == "0"
