"""Where a run's processes go, checked before any rank starts: the device, the
ranks on this node and in the run, the engines' placement (in the ranks, with
--tensor-parallel-size, or --rollout-world-size processes of their own). GPUs are
counted through NVML: the controller never makes a CUDA context."""

from __future__ import annotations

import os

from areno.config.train import TrainConfig
from areno.errors import UserError


def visible_gpus() -> int:
    """GPUs this process could use, counted through NVML: no CUDA context is made
    (the controller never holds one; ranks and engines own the GPUs)."""
    import torch  # here: runtime/early.py counts ranks before the controller imports torch

    os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")  # torch reads it per call
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def driver_cuda_version() -> tuple[int, int] | None:
    """(major, minor) of the newest CUDA the NVIDIA driver supports, read through
    NVML (no CUDA context), or None where NVML cannot say."""
    import ctypes

    try:
        nvml = ctypes.CDLL("libnvidia-ml.so.1")
    except OSError:
        return None
    version = ctypes.c_int()
    try:
        if nvml.nvmlInit_v2() != 0:
            return None
        rc = nvml.nvmlSystemGetCudaDriverVersion_v2(ctypes.byref(version))
        nvml.nvmlShutdown()
    except AttributeError:  # an NVML too old to have these calls
        return None
    return (version.value // 1000, version.value % 1000 // 10) if rc == 0 else None


def cuda_runtime_problem(gpus: int) -> str | None:
    """Why the ranks could not start CUDA although NVML counts `gpus` GPUs: a torch
    built for a CUDA major version newer than the driver supports (CUDA's minor
    version compatibility covers a newer minor). None when they can, or no GPU."""
    import torch

    built, driver = torch.version.cuda, driver_cuda_version() if gpus else None
    if not built or driver is None or int(built.split(".")[0]) <= driver[0]:
        return None
    return (f"{gpus} GPU(s) visible, but torch {torch.__version__} is built for CUDA {built} and the "
            f"NVIDIA driver supports CUDA {driver[0]}.{driver[1]} at most: upgrade the driver, or "
            f"install a torch built for CUDA {driver[0]}.x (--device cpu trains on the CPU)")


def resolve_device(cfg: TrainConfig) -> str:
    gpus = visible_gpus() if cfg.device != "cpu" else 0
    if cfg.device == "cuda" and not gpus:
        raise UserError("--device cuda: no CUDA GPU is visible")
    if gpus and (problem := cuda_runtime_problem(gpus)):
        raise UserError(problem)  # the ranks would die in set_device, where `areno check` says so too
    return "cuda" if gpus else "cpu"


def check_placement(cfg: TrainConfig, nproc: int, world_size: int, device: str) -> None:
    """Where the engines go, checked before any rank starts: in the ranks
    (check_tensor_parallel), or --rollout-world-size processes of their own."""
    m = cfg.rollout_world_size
    if not m:
        check_tensor_parallel(cfg.tensor_parallel_size, nproc, world_size, device)
        return
    flag = f"--rollout-world-size {m}"
    if cfg.nnodes > 1:
        raise UserError(f"{flag}: engine processes run beside the controller; use it with --nnodes 1")
    if device != "cuda":
        return
    from areno.backend.config import ENGINE_GPUS_ENV, engine_gpus_from_env  # imports torch: GPU hosts only

    gpus = visible_gpus()
    try:
        placed = engine_gpus_from_env(os.environ)  # a check's lever (backend/config.py)
    except ValueError as e:
        raise UserError(str(e)) from None
    if placed:
        if len(placed) != m or max(placed) >= gpus:
            raise UserError(f"{ENGINE_GPUS_ENV}={','.join(map(str, placed))}: {flag} needs {m} "
                            f"GPU index(es) below the {gpus} visible")
    elif world_size + m > gpus:
        raise UserError(f"{flag}: {world_size} rank(s) + {m} engine process(es) need "
                        f"{world_size + m} GPUs, {gpus} visible; lower it")


def check_tensor_parallel(tp: int, nproc: int, world_size: int, device: str) -> None:
    """--tensor-parallel-size against the ranks (an engine spans tp consecutive ranks of
    one node) and the GPUs that would hold them: one line, before any rank starts."""
    flag = f"--tensor-parallel-size {tp}"
    if tp > world_size:
        raise UserError(f"{flag}: more than the run's {world_size} rank(s); lower it, or raise "
                        "--world-size (one rank per GPU)")
    if nproc % tp:
        raise UserError(f"{flag} must divide the {nproc} rank(s) per node (an engine's ranks share "
                        "a node); pick a divisor")
    gpus = visible_gpus() if device == "cuda" else 0
    if device == "cuda" and nproc > gpus:  # one GPU per rank: the rest would die in set_device
        raise UserError(f"{nproc} rank(s) on this node (--world-size / --nproc-per-node) but only "
                        f"{gpus} GPU(s) visible; lower it to {gpus} or less (one rank per GPU)")


def ranks_for(cfg: TrainConfig, device: str) -> tuple[int, int]:
    """(ranks on this node, ranks in the run): --nproc-per-node and --world-size, or
    what they default to (every visible GPU the --rollout-world-size engine
    processes leave, 1 on CPU)."""
    if cfg.nproc_per_node:
        nproc = cfg.nproc_per_node
    elif cfg.world_size:
        nproc = cfg.world_size // cfg.nnodes
    else:
        nproc = max(1, visible_gpus() - cfg.rollout_world_size) if device == "cuda" else 1
    return nproc, cfg.world_size or cfg.nnodes * nproc
