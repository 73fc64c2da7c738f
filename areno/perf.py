"""Training throughput: tokens/s, model FLOPs and MFU. Pure math, no CUDA
(the controller computes these from what the ranks reported at start-up).

FLOPs of one training pass (forward + backward = 3x forward) over packed
sequences of lengths n_s:

    6 * N * sum_s n_s  +  6 * layers * (heads * head_dim) * sum_s n_s^2

N counts the parameters that multiply activations: every weight except the
input embedding (a lookup), plus lm_head (counted even when tied to the
embedding). The attention term is the QK^T and PV matmuls, 4 * n^2 * d per
layer forward, halved for causal attention, times 3 for forward + backward.
MFU divides by the device's dense bf16 peak (no sparsity), from PEAK_BF16_TFLOPS.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

# Dense bf16 tensor-core peaks (TFLOP/s, no 2:4 sparsity), NVIDIA datasheets.
# Matched by substring of torch.cuda.get_device_name(), first match wins, so a
# variant comes before its family. The NVL (PCIe, NVLink bridge) boards list
# 1,671 TFLOPS bf16 "with sparsity", i.e. 835.5 dense, for both H100 NVL and
# H200 NVL (https://www.nvidia.com/en-us/data-center/h100/ and .../h200/).
PEAK_BF16_TFLOPS: tuple[tuple[str, float], ...] = (
    ("A100", 312.0),
    ("H100 NVL", 835.5),
    ("H100 PCIe", 756.0),
    ("H100", 989.0),   # SXM / HBM3
    ("H200 NVL", 835.5),
    ("H200", 989.0),   # SXM
    ("B200", 2250.0),
)


# --max-tokens-per-micro when unset. Measured with scripts/bench_train.py
# (docs/PERFORMANCE.md, "Micro-batch budget"): CPU on the 2-core box; CUDA from
# the H200 kernel figures of issue 11 (not re-measured here, no GPU).
DEFAULT_MICRO_TOKENS: dict[str, int] = {"cpu": 4096, "cuda": 16384}


def default_micro_tokens(device: str) -> int:
    return DEFAULT_MICRO_TOKENS[device]


@dataclass(frozen=True)
class FlopShape:
    """What the FLOP count needs from a model (reported by rank 0 at start-up)."""

    matmul_params: int   # N above
    num_layers: int
    attn_dim: int        # num_attention_heads * head_dim


def flop_shape(hf) -> FlopShape:
    """From an HF causal LM (any device; reads shapes only)."""
    cfg = hf.config.get_text_config()
    embed, head = hf.get_input_embeddings().weight, hf.get_output_embeddings().weight
    total = sum(p.numel() for p in hf.parameters())  # tied weights counted once
    n = total - embed.numel() + (head.numel() if head is embed else 0)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return FlopShape(int(n), int(cfg.num_hidden_layers), int(cfg.num_attention_heads * head_dim))


def train_flops(shape: FlopShape, seq_lengths: np.ndarray) -> float:
    """FLOPs of one forward + backward over sequences of `seq_lengths` ([S] int)."""
    n = np.asarray(seq_lengths, dtype=np.float64)
    return 6.0 * shape.matmul_params * n.sum() + 6.0 * shape.num_layers * shape.attn_dim * (n * n).sum()


def peak_bf16_flops(device_name: str | None) -> float | None:
    """Dense bf16 FLOP/s of one device, or None for CPU / an unknown device."""
    if not device_name:
        return None
    for key, tflops in PEAK_BF16_TFLOPS:
        if key in device_name:
            return tflops * 1e12
    return None


def train_perf(tokens: float, flops: float, seconds: float, world_size: int,
               device_name: str | None) -> dict[str, float]:
    """{'perf/train_tokens_per_s', 'perf/mfu' (only on a known GPU)} of one train call:
    `tokens`/`flops` summed over every optimizer step and rank, `seconds` its wall time."""
    if seconds <= 0:
        return {}
    out = {"perf/train_tokens_per_s": tokens / seconds}
    peak = peak_bf16_flops(device_name)
    if peak is not None:
        out["perf/mfu"] = flops / (seconds * world_size * peak)
    return out


def pack_train_perf(seq_lengths: np.ndarray, epochs: int, seconds: float, world_size: int,
                    shape: FlopShape, device_name: str | None) -> dict[str, float]:
    """`train_perf` of one train call over a pack: every epoch trains every
    sequence ([S] int lengths) once."""
    flops = epochs * train_flops(shape, seq_lengths)
    return train_perf(epochs * float(np.sum(seq_lengths)), flops, seconds, world_size, device_name)
