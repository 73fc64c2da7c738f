"""areno/perf.py: training FLOPs, the bf16 peak table and MFU."""

from __future__ import annotations

import numpy as np
import pytest

from areno.perf import FlopShape, default_micro_tokens, flop_shape, peak_bf16_flops, train_flops, train_perf


def test_train_flops_hand_computed() -> None:
    shape = FlopShape(matmul_params=1000, num_layers=2, attn_dim=8)
    # 6*N*(3+5) + 6*layers*d*(9+25)
    assert train_flops(shape, np.array([3, 5])) == 6 * 1000 * 8 + 6 * 2 * 8 * 34


def test_flop_shape_counts_lm_head_once_and_skips_the_embedding(tiny_chat_model) -> None:
    hf = tiny_chat_model
    cfg = hf.config
    s = flop_shape(hf)
    embed = hf.get_input_embeddings().weight.numel()
    total = sum(p.numel() for p in hf.parameters())
    tied = hf.get_output_embeddings().weight is hf.get_input_embeddings().weight
    assert s.matmul_params == (total if tied else total - embed)
    assert s.num_layers == cfg.num_hidden_layers
    assert s.attn_dim == cfg.num_attention_heads * cfg.head_dim


@pytest.mark.parametrize("name, tflops", [
    ("NVIDIA H200", 989), ("NVIDIA H200 NVL", 835.5), ("NVIDIA H100 NVL", 835.5),
    ("NVIDIA H100 80GB HBM3", 989), ("NVIDIA H100 PCIe", 756),
    ("NVIDIA A100-SXM4-80GB", 312), ("NVIDIA B200", 2250),
])
def test_peak_table(name: str, tflops: float) -> None:
    assert peak_bf16_flops(name) == tflops * 1e12


def test_mfu_only_on_a_known_gpu() -> None:
    assert train_perf(1000, 1e12, 2.0, 1, None) == {"perf/train_tokens_per_s": 500.0}
    assert "perf/mfu" not in train_perf(1000, 1e12, 2.0, 1, "NVIDIA GeForce GTX 1080")
    out = train_perf(1000, 989e12, 2.0, 2, "NVIDIA H200")
    assert out["perf/mfu"] == pytest.approx(0.25)
    assert train_perf(1000, 1.0, 0.0, 1, None) == {}


def test_default_micro_tokens_per_device() -> None:
    assert default_micro_tokens("cpu") > 0 and default_micro_tokens("cuda") >= default_micro_tokens("cpu")


def test_controller_perf_counts_every_epoch_and_rank() -> None:
    """The controller's per-call figures (from the ranks' hello: no CUDA in the controller)."""
    from areno.perf import pack_train_perf
    from areno.split import build_split_pack
    from helpers import random_batch

    b = random_batch(seed=2, num_prompts=5, max_response=30)
    split = build_split_pack(b, np.zeros(b.num_responses, np.float32), world_size=2, max_tokens=64)
    shape = FlopShape(matmul_params=10_000, num_layers=3, attn_dim=32)
    out = pack_train_perf(split.pack.seq_lengths, 2, 0.5, 2, shape, "NVIDIA H200")
    tokens = float(split.pack.num_tokens)
    assert out["perf/train_tokens_per_s"] == pytest.approx(2 * tokens / 0.5)
    want = 2 * train_flops(shape, split.pack.seq_lengths) / (0.5 * 2 * 989e12)
    assert out["perf/mfu"] == pytest.approx(want)
    assert "perf/mfu" not in pack_train_perf(split.pack.seq_lengths, 1, 0.5, 1, shape, None)
