"""The rollout engine's memory budget beside the trainer (areno.rollout.budget):
pure arithmetic at GPU sizes, the footprint of a real tiny model, and the
start-up error a rank turns into one line with exit code 2."""

from __future__ import annotations

import pytest
import torch

from areno.errors import UserError
from areno.rollout.budget import (
    ADAM_STATES,
    GIB,
    RESERVE_BYTES,
    TrainerFootprint,
    check_cpu_budget,
    check_gpu_budget,
    footprint,
    max_engine_fraction,
)

H200 = 143771 * (1 << 20)  # torch.cuda.mem_get_info total of an H200 (140.4 GiB)


def fp32_policy(params: float) -> TrainerFootprint:
    return TrainerFootprint(trainable=int(params * 4), frozen=0)


def test_an_8b_fp32_policy_and_half_an_h200_do_not_fit_and_the_fix_is_named():
    """32 GB weights + 64 GB AdamW + 0.5 x 140 GiB exceed the GPU, though vLLM's
    own start-up check (before the AdamW states exist) passes."""
    trainer = fp32_policy(8e9)
    with pytest.raises(UserError) as e:
        check_gpu_budget(H200, trainer, 0.5, engine_weights=16 * 10**9, where="cuda:0")
    msg = str(e.value)
    room = max_engine_fraction(H200, trainer)
    assert f"use --gpu-memory-utilization {int(room * 100) / 100:.2f} or less" in msg
    assert "--gpu-memory-utilization 0.5 asks for 70.2 GiB of cuda:0's 140.4 GiB" in msg
    assert "the trainer keeps 89.4 GiB" in msg
    check_gpu_budget(H200, trainer, int(room * 100) / 100, 16 * 10**9, "cuda:0")  # the suggestion fits


def test_the_budget_counts_weights_adam_states_frozen_weights_and_the_reserve():
    trainer = TrainerFootprint(trainable=10 * GIB, frozen=5 * GIB)
    assert trainer.resident == 10 * GIB * (1 + ADAM_STATES) + 5 * GIB
    total = 100 * GIB
    assert max_engine_fraction(total, trainer) == pytest.approx((100 - 35 - RESERVE_BYTES / GIB) / 100)
    check_gpu_budget(total, trainer, 0.63, GIB, "cuda:0")
    with pytest.raises(UserError):
        check_gpu_budget(total, trainer, 0.64, GIB, "cuda:0")


def test_a_small_policy_fits_the_default_share():
    check_gpu_budget(H200, fp32_policy(0.6e9), 0.5, engine_weights=int(1.2e9), where="cuda:0")


def test_when_not_even_the_engines_weights_fit_more_gpus_are_suggested():
    with pytest.raises(UserError, match="not even the engine's weights .* use more GPUs with --strategy fsdp2"):
        check_gpu_budget(H200, fp32_policy(11e9), 0.5, engine_weights=22 * 10**9, where="cuda:0")


def test_cpu_ranks_share_the_host_and_the_kv_cache_flag_is_named():
    trainer = TrainerFootprint(trainable=GIB, frozen=0)
    check_cpu_budget(16 * GIB, trainer, GIB // 2, GIB, ranks_here=2)  # 2 x (3 + 1 + 0.5) + 2 <= 16
    with pytest.raises(UserError, match=r"--kv-cache-gb 4: 2 rank\(s\).* use --kv-cache-gb 3\.00 or less"):
        check_cpu_budget(16 * GIB, trainer, 4 * GIB, GIB, ranks_here=2)


def test_footprint_of_a_real_model_counts_a_tied_weight_once_and_frozen_apart(tiny_chat_model):
    import copy

    model = copy.deepcopy(tiny_chat_model)
    model.config.tie_word_embeddings = True
    model.lm_head.weight = model.get_input_embeddings().weight
    params = {id(p): p for p in model.parameters()}.values()
    full = sum(p.numel() * p.element_size() for p in params)
    assert footprint(model) == TrainerFootprint(trainable=full, frozen=0)
    model.get_input_embeddings().requires_grad_(False)
    emb = model.get_input_embeddings().weight
    ref = copy.deepcopy(tiny_chat_model).requires_grad_(False).to(torch.bfloat16)
    ref_bytes = sum(p.numel() * 2 for p in ref.parameters())
    got = footprint(model, ref)
    assert got.frozen == emb.numel() * 4 + ref_bytes and got.trainable == full - emb.numel() * 4


def test_an_engine_that_cannot_fit_is_one_line_at_start_up(tmp_path, tiny_arith_path, capsys):
    """The rank budgets before it builds its engine; its UserError reaches the
    CLI as the rank's one line, exit 2 (CPU: the host's RAM and --kv-cache-gb)."""
    pytest.importorskip("vllm")
    from areno.cli import main

    data = tmp_path / "d.jsonl"
    data.write_text('{"prompt": "1+1=", "answer": "2"}\n')
    rc = main(["train", "--ckpt", str(tiny_arith_path), "--dataset-path", str(data), "--reward-fn-path",
               "builtin:arith", "--no-chat-template", "--batch-size", "1", "--n-samples", "2",
               "--max-new-tokens", "4", "--rollout-engine", "vllm", "--kv-cache-gb", "1000000",
               "--reward-workers", "0", "--max-steps", "1", "--output-dir", str(tmp_path / "run")])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1, err
    assert err[0].startswith("areno: error: --kv-cache-gb 1e+06: 1 rank(s)") and "this host has" in err[0], err
