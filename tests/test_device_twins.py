"""GPU branches taken on CPU (issue 26, 5): the device condition is forced
(torch.cuda.is_available / device_count patched, a torch.device("cuda", i)
object, which touches nothing) and the call that would reach CUDA is recorded,
so each test asserts what the GPU would get. The inventory of every device
branch and the test that takes it is docs/BACKEND.md, "Device branches"
(guarded by tests/test_device_branches.py)."""

from __future__ import annotations

import re

import pytest
import torch

from areno.errors import UserError

GPU = torch.device("cuda", 0)


@pytest.fixture
def four_gpus(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)


def test_the_run_resolves_cuda_and_places_ranks_on_the_visible_gpus(four_gpus, files) -> None:
    from areno.runtime import placement as run
    from areno.config.train import TrainConfig

    cfg = TrainConfig.from_sources(None, files)
    assert run.visible_gpus() == 4 and run.resolve_device(cfg) == "cuda"
    assert run.ranks_for(cfg, "cuda") == (4, 4)
    assert run.ranks_for(TrainConfig.from_sources(None, {**files, "rollout_world_size": 1}), "cuda") == (3, 3)
    with pytest.raises(UserError, match="--tensor-parallel-size 8: more than the run's 4 rank"):
        run.check_tensor_parallel(8, 4, 4, "cuda")
    with pytest.raises(UserError, match="only 4 GPU"):
        run.check_tensor_parallel(8, 8, 8, "cuda")


def test_colocated_ranks_above_the_visible_gpus_are_one_line(four_gpus, files) -> None:
    """The extra ranks would die in set_device ("invalid device ordinal")."""
    from areno.runtime import placement
    from areno.config.train import TrainConfig

    cfg = TrainConfig.from_sources(None, {**files, "world_size": 8})
    with pytest.raises(UserError, match=r"8 rank\(s\) on this node .* only 4 GPU\(s\) visible"):
        placement.check_placement(cfg, 8, 8, "cuda")
    placement.check_placement(cfg, 4, 4, "cuda")
    placement.check_placement(cfg, 8, 8, "cpu")  # CPU ranks share the cores


@pytest.mark.parametrize("driver,refused", [((12, 4), True), ((13, 0), False), ((13, 2), False), (None, False)])
def test_a_torch_built_for_a_newer_cuda_than_the_driver_stops_train_and_fails_check(
        four_gpus, files, monkeypatch, driver, refused) -> None:
    """NVML counts the GPUs (no CUDA context), but the ranks could not start CUDA:
    `areno train` and `areno check` say the same line."""
    from areno.cli.check import collect
    from areno.config.train import TrainConfig
    from areno.runtime import placement

    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(placement, "driver_cuda_version", lambda: driver)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i: "NVIDIA H200")
    cfg = TrainConfig.from_sources(None, files)
    status, detail = {c: (s, d) for s, c, d in collect()}["cuda"]
    if not refused:
        assert placement.resolve_device(cfg) == "cuda" and status == "OK"
        return
    line = (r"4 GPU\(s\) visible, but torch .* is built for CUDA 13.0 and the NVIDIA driver supports "
            r"CUDA 12.4 at most: upgrade the driver, or install a torch built for CUDA 12.x")
    with pytest.raises(UserError, match=line):
        placement.resolve_device(cfg)
    assert status == "FAIL" and re.match(line, detail)


def test_gpu_settings_bf16_nccl_and_the_optimizer(files) -> None:
    from areno.backend.config import BackendConfig
    from areno.backend.step import adamw_kwargs
    from areno.settings import resolved_dtype
    from areno.config.train import TrainConfig

    assert resolved_dtype(TrainConfig.from_sources(None, files), "cuda") == "bfloat16"
    assert BackendConfig(model_path="m", device="cuda").dist_backend == "nccl"
    # CUDA: foreach (host-side step counters), CPU: fused (device-side, no .item())
    assert adamw_kwargs(GPU) == {"foreach": True} and adamw_kwargs(torch.device("cpu")) == {"fused": True}


def test_a_rank_checkpoints_and_restores_its_gpus_rng(monkeypatch) -> None:
    from areno.rundir.rng import rng_state, set_rng_state

    cuda_state = torch.tensor([7], dtype=torch.uint8)
    asked, restored = [], []
    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda d: asked.append(d) or cuda_state)
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda s, d: restored.append((s, d)))
    s = rng_state(GPU)
    assert asked == [GPU] and s["cuda"] is cuda_state
    set_rng_state(s, GPU)
    assert restored == [(cuda_state, GPU)]
    assert rng_state(torch.device("cpu"))["cuda"] is None


def test_the_engine_budget_reads_the_gpus_memory_and_names_the_device(monkeypatch) -> None:
    from areno.rollout.budget import TrainerFootprint, check_engine_budget
    from areno.rollout.factory import EngineSpec

    asked = []
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda d: asked.append(d) or (10 << 30, 80 << 30))
    trainer = TrainerFootprint(trainable=60 << 30, frozen=0)
    with pytest.raises(UserError, match=r"--gpu-memory-utilization 0.5 asks for 40.0 GiB of cuda:0's 80.0 GiB"):
        check_engine_budget(EngineSpec(dtype="bfloat16"), GPU, trainer, num_params=1 << 20)
    assert asked == [GPU]


def test_check_lists_the_gpus(four_gpus, monkeypatch) -> None:
    from areno.cli.check import collect

    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i: f"NVIDIA H200 #{i}")
    rows = {c: (s, d) for s, c, d in collect()}
    assert rows["cuda"][0] == "OK" and "4 GPU(s): NVIDIA H200 #0, NVIDIA H200 #1" in rows["cuda"][1]
    assert "nccl" in rows
    # what auto runs on the GPUs: torch's varlen without flash-attn (not "SDPA")
    assert rows["attention"] == ("OK", f"cuda, bfloat16: torch {torch.__version__}'s varlen_attn (flash)")


def test_check_says_what_packed_attention_runs_and_flags_an_unknown_varlen(four_gpus, monkeypatch) -> None:
    from torch.nn.attention import varlen as tv

    from areno.backend import attention
    from areno.cli.check import attention_row, collect

    assert attention_row("cpu") == ("OK", "attention", "cpu, float32: one causal sdpa call per sequence length")
    monkeypatch.setattr(attention, "has_flash_attn", lambda: False)

    def varlen_attn_next(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
                         window_size=(-1, -1), enable_gqa=False, softcap=0.0):
        raise AssertionError("not called")

    monkeypatch.setattr(tv, "varlen_attn", varlen_attn_next)
    status, _, detail = attention_row("cuda")
    assert status == "WARN" and detail.endswith("varlen_attn (flash): a signature areno was not tested with")
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i: "NVIDIA H200")
    assert {c: s for s, c, _ in collect()}["attention"] == "WARN"


def test_the_hf_engine_returns_cached_gpu_memory_on_shutdown(tiny_chat_path, monkeypatch) -> None:
    from areno.rollout.hf import HFEngine

    engine = HFEngine(tiny_chat_path, dtype="float32", device="cpu", max_model_len=64)
    emptied = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: emptied.append(1))
    engine.shutdown()
    assert emptied == [1]
