"""LoRA dropout (issue 26, 3): on inside the update's forward only, off wherever
the trainer's log-probs must equal the engine's (the sync probe, recompute, the
KL reference, resume, eval-only), whatever train/eval mode the model is in."""

from __future__ import annotations

import pytest
import torch

from areno.backend.config import LoraSpec
from areno.backend.lora import dropout_active, lora_layers
from areno.backend.step import no_grad_logprobs
from test_backend_units import local_worker, make_split, train_once
from test_lora import micros_of

DROPOUT = LoraSpec(rank=8, alpha=16.0, dropout=0.1)


def test_the_probe_after_resuming_a_dropout_adapter_passes(tiny_chat_path, monkeypatch, tmp_path) -> None:
    """A real RankWorker with its hf engine, fp32: the start-up sync of an adapter
    trained with dropout 0.1 (the first sync after --resume / --eval-only, before
    any update) passes the fingerprint and the probe, twice in a row."""
    from areno.backend.weights import probe_ids
    from areno.rollout.factory import EngineSpec
    from areno.rollout.probe import PROBE_EVERY_FINGERPRINTED

    with local_worker(tiny_chat_path, monkeypatch, lr=3e-2, lora=DROPOUT) as worker:
        for _ in range(2):
            train_once(worker, make_split(1))
        worker.cmd_save_pretrained(str(tmp_path))
    spec = LoraSpec(rank=8, alpha=16.0, dropout=0.1, adapter_path=str(tmp_path))
    engine = EngineSpec(kind="hf", dtype="float32", max_model_len=64, max_lora_rank=8)
    with local_worker(tiny_chat_path, monkeypatch, lora=spec, engine=engine) as worker:
        ids = probe_ids(worker.vocab_size)
        first = worker.cmd_sync_weights(ids)
        assert first["probe_diff"] <= first["probe_tolerance"], first  # it raises beyond it
        worker.sync_check.syncs = PROBE_EVERY_FINGERPRINTED  # the next probe (calibrated)
        again = worker.cmd_sync_weights(ids)
        assert again["probe_diff"] <= again["probe_tolerance"], again


def test_dropout_is_on_in_the_update_only_whatever_the_module_mode(tiny_chat_path, monkeypatch) -> None:
    """no_grad log-probs (recompute, probe) are deterministic and equal with the
    model in train mode (as --grad-checkpointing puts it) or eval mode; inside
    dropout_active the adapters' output is random (dropout really acts)."""
    split = make_split(1)
    writer, micros = micros_of(split)
    try:
        with local_worker(tiny_chat_path, monkeypatch, lr=3e-2, lora=DROPOUT) as worker:
            train_once(worker, split)  # B != 0: the adapters change the output
            lp = lambda: torch.cat(sum(no_grad_logprobs(worker.wrapped, worker.cfg, micros), []))  # noqa: E731
            want = lp()
            worker.hf.train()
            assert torch.equal(lp(), want), "train mode must not switch the adapters' dropout on"
            worker.hf.eval()
            assert torch.equal(lp(), want)
            with dropout_active(worker.hf, True):
                a, b = lp(), lp()
            assert not torch.equal(a, want) and not torch.equal(a, b), "dropout must act in the update"
            assert torch.equal(lp(), want), "and be off again after it"
            drops = [d for m in lora_layers(worker.hf).values() for d in m.lora_dropout.values()]
            assert len(drops) == 14 and not any(getattr(d, "active", True) for d in drops)
    finally:
        writer.close()


@pytest.mark.faults  # three CLI runs; the probe after a dropout resume is checked in-process above
def test_cli_resume_of_a_dropout_run_with_recompute_is_exact(tmp_path, areno_cache) -> None:
    """`--lora-dropout 0.1 --recompute-logprobs`: 2 steps (`--max-steps 2
    --save-interval 2`), resumed (`--resume latest --max-steps 3`) exits 0 (the start-up probe passes) and step 3 repeats the uninterrupted
    run's step 3 (every metric to 1e-5 relative; bitwise in practice) and its adapter
    bitwise: the dropout masks come from the rank's RNG, which the checkpoint restores."""
    from safetensors.numpy import load_file

    import numpy as np
    from inprocess import run_here
    from test_resume import assert_same_steps, ok, train_steps

    flags = ["--lora-rank", "8", "--lora-dropout", "0.1", "--recompute-logprobs", "--batch-size", "4",
             "--n-samples", "4", "--rollout-engine", "hf", "--world-size", "1", "--seed", "3",
             "--save-interval", "2", "--min-lr-ratio", "1"]  # a flat LR: 2 + 1 steps is 3 steps
    full, cut = tmp_path / "full", tmp_path / "cut"
    ok(run_here(["train", *flags, "--max-steps", "3", "--output-dir", str(full)], areno_cache))
    ok(run_here(["train", *flags, "--max-steps", "2", "--output-dir", str(cut)], areno_cache))
    res = ok(run_here(["train", *flags, "--max-steps", "3", "--resume", "latest", "--output-dir", str(cut)],
                      areno_cache))
    assert "resumed at step 2" in res.stdout
    a, b = train_steps(full), train_steps(cut)
    assert_same_steps(a, b, [1, 2, 3])
    assert a[3]["train/loss"] == b[3]["train/loss"] and a[3]["train/grad_norm"] == b[3]["train/grad_norm"]
    x = load_file(full / "checkpoints/step_000003/adapter_model.safetensors")
    y = load_file(cut / "checkpoints/step_000003/adapter_model.safetensors")
    for k in x:
        np.testing.assert_array_equal(x[k], y[k], err_msg=k)
