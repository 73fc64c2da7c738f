"""Does the rollout engine fit next to the trainer on one device? (issue 17, 2e)

vLLM's `gpu_memory_utilization` is a share of the device's TOTAL memory, checked
once when the engine starts: the rank has loaded its policy by then but its
AdamW states (two more copies of every trainable parameter) come only at the
first optimizer step. A run that passes that check can fail at its first
wake-up (8B fp32 on one H200: 32 GB weights + 64 GB Adam + 0.5 x 141 GB).
So each rank budgets before it builds its engine, from what it holds:

    trainer  = local trainable param bytes x (1 + ADAM_STATES) + frozen bytes
    engine   = gpu_memory_utilization x total          (GPU)
             = engine weights + KV cache bytes         (CPU: --kv-cache-gb)
    need     = trainer + engine + RESERVE <= total

Gradients are freed before rollouts (zero_grad(set_to_none=True)) and the
engine frees all its memory while the trainer runs (level-2 sleep; under LoRA
its KV cache only, the base staying on the device), so neither phase's
transient memory is counted against the other.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from areno.errors import UserError

GIB = 1 << 30
ADAM_STATES = 2  # exp_avg, exp_avg_sq: each the parameter's size and dtype
# CUDA context, cuBLAS/NCCL workspaces and allocator slack outside both budgets.
RESERVE_BYTES = 2 * GIB


@dataclass(frozen=True)
class TrainerFootprint:
    """Bytes one rank's trainer keeps resident while its engine samples."""

    trainable: int  # local shards of the policy's trainable parameters
    frozen: int     # the policy's frozen parameters and the reference model

    @property
    def resident(self) -> int:
        return self.trainable * (1 + ADAM_STATES) + self.frozen


def footprint(*modules: torch.nn.Module) -> TrainerFootprint:
    """Trainable / frozen parameter bytes of these modules on this rank (DTensor
    shards count their local part only; a tied weight counts once)."""
    trainable = frozen = 0
    seen: set[int] = set()
    for module in modules:
        for p in module.parameters():
            local = p.to_local() if hasattr(p, "to_local") else p
            key = local.untyped_storage().data_ptr() if local.numel() else id(p)
            if key in seen:
                continue
            seen.add(key)
            nbytes = local.numel() * local.element_size()
            if p.requires_grad:
                trainable += nbytes
            else:
                frozen += nbytes
    return TrainerFootprint(trainable, frozen)


def max_engine_fraction(total: int, trainer: TrainerFootprint) -> float:
    """The largest share of `total` bytes an engine can take beside `trainer`."""
    return max(0.0, (total - trainer.resident - RESERVE_BYTES) / total)


def check_gpu_budget(total: int, trainer: TrainerFootprint, fraction: float, engine_weights: int,
                     where: str) -> None:
    """UserError unless `fraction` x `total` (vLLM's share) fits beside `trainer`.
    engine_weights: bytes of the engine's copy of the weights, which its share
    must hold besides a KV cache."""
    room = max_engine_fraction(total, trainer)
    if fraction <= room:
        return
    have = (f"the trainer keeps {trainer.resident / GIB:.1f} GiB ({trainer.trainable / GIB:.1f} GiB "
            f"trainable weights + {ADAM_STATES}x that in AdamW states + {trainer.frozen / GIB:.1f} GiB "
            f"frozen) and {RESERVE_BYTES / GIB:.0f} GiB is reserved")
    if room * total <= engine_weights:
        fix = ("not even the engine's weights "
               f"({engine_weights / GIB:.1f} GiB) fit beside it; use more GPUs with --strategy fsdp2 "
               "or a smaller model")
    else:
        fix = f"use --gpu-memory-utilization {int(room * 100) / 100:.2f} or less"
    raise UserError(f"--gpu-memory-utilization {fraction:g} asks for {fraction * total / GIB:.1f} GiB of "
                    f"{where}'s {total / GIB:.1f} GiB, but {have}; {fix}")


def check_cpu_budget(total: int, trainer: TrainerFootprint, kv_cache_bytes: int, engine_weights: int,
                     ranks_here: int) -> None:
    """UserError unless every rank on this host fits its trainer, its engine's
    weights and its --kv-cache-gb into the host's `total` bytes of RAM."""
    per_rank = trainer.resident + engine_weights + kv_cache_bytes
    need = ranks_here * per_rank + RESERVE_BYTES
    if need <= total:
        return
    room = (total - RESERVE_BYTES) // max(ranks_here, 1) - trainer.resident - engine_weights
    fix = (f"use --kv-cache-gb {int(room / GIB * 100) / 100:.2f} or less" if room >= GIB // 100
           else "use a smaller model or fewer ranks")
    raise UserError(f"--kv-cache-gb {kv_cache_bytes / GIB:g}: {ranks_here} rank(s) each keeping "
                    f"{trainer.resident / GIB:.1f} GiB of trainer state, {engine_weights / GIB:.1f} GiB of "
                    f"engine weights and that KV cache need {need / GIB:.1f} GiB, but this host has "
                    f"{total / GIB:.1f} GiB; {fix}")


def device_total_bytes(device: torch.device) -> int:
    """The device's total memory: the GPU's, or the host's RAM on CPU (the one
    device query; everything else here is arithmetic)."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[1])
    import os

    return int(os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))


def check_engine_budget(spec, device: torch.device, trainer: TrainerFootprint, num_params: int,
                        ranks_here: int = 1) -> None:
    """What a rank calls before it builds its engine (`spec`: an EngineSpec).
    num_params: the full model's parameter count (the engine holds all of it,
    split over tensor_parallel_size GPUs)."""
    bytes_per = 2 if spec.dtype in ("bfloat16", "float16") else 4
    engine_weights = num_params * bytes_per // max(spec.tensor_parallel_size, 1)
    total = device_total_bytes(device)
    if device.type == "cuda":
        where = f"cuda:{device.index if device.index is not None else torch.cuda.current_device()}"
        check_gpu_budget(total, trainer, spec.gpu_memory_utilization, engine_weights, where)
    else:
        kv = spec.kv_cache_bytes if spec.kind == "vllm" else 0
        check_cpu_budget(total, trainer, kv, engine_weights, ranks_here)
