"""LoRA on lm_head (--lora-target-modules all-linear,lm_head; issue 26, 3): the
demo's LoRA preset. The tiny model's frozen final norm and lm_head cap decoder-only
adapters at an expected reward of 0.31 (scripts/lora_capacity.py); an adapter on
an untied lm_head lifts that cap, and both engines serve it exactly.

Checked here: the trainer's chunked log-probs (which multiply by a weight, not
call lm_head) are peft's forward of the adapted model; with the adapters off they
are the base model's; both engines (transformers, vLLM; fp32) serve the adapter
with the exact fingerprint and the probe's bound; a tied lm_head, and dropout on
lm_head, are refused in one line.
"""

from __future__ import annotations

import copy

import pytest
import torch

from areno.backend.lora import adapters_disabled, apply_lora, head_weight, lora_plan
from areno.backend.config import LoraSpec
from areno.backend.model import PolicyModule
from areno.rollout.lora import adapter_fingerprint_of
from areno.rollout.probe import fingerprint_mismatch
from test_lora_engines import (MAX_MODEL_LEN, adapter_tensors, probe_for, randomize, sync_adapter,
                               verify_probe)

HEAD_TARGETS = ("all-linear", "lm_head")
SPEC = LoraSpec(rank=4, alpha=5.0, target_modules=HEAD_TARGETS)


@pytest.fixture(scope="module")
def adapted(tiny_chat_path, tiny_chat_model):
    """areno's own LoRA policy of tiny chat (every decoder linear and lm_head), random A and B."""
    model = apply_lora(copy.deepcopy(tiny_chat_model), SPEC, str(tiny_chat_path))
    randomize(model.areno_peft, seed=3)
    return model.eval()


def test_lm_head_is_adapted_and_counted(adapted, tiny_chat_path) -> None:
    named = dict(adapted.named_parameters())
    assert {n for n, p in named.items() if p.requires_grad and "lm_head" in n} == {
        "lm_head.lora_A.default.weight", "lm_head.lora_B.default.weight"}
    trainable, _ = lora_plan(str(tiny_chat_path), SPEC)
    assert trainable == sum(p.numel() for p in named.values() if p.requires_grad)


def test_trainer_logprobs_are_peft_forward_of_the_adapted_head(adapted) -> None:
    """PolicyModule's log-probs (head_weight, chunked) equal log_softmax of the peft
    model's own logits; the adapter's lm_head part moves them; adapters off: base."""
    ids = torch.arange(3, 40)[None]
    pos = torch.arange(ids.shape[1])[None]
    targets = torch.roll(ids, -1, dims=1)
    policy = PolicyModule(adapted, chunk_size=7)
    with torch.no_grad():
        got, _ = policy(ids, pos, targets)
        want = adapted(input_ids=ids).logits.float().log_softmax(-1).gather(-1, targets[..., None])[..., 0]
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        head = adapted.lm_head
        assert not torch.equal(head_weight(head), head.weight)  # the adapter is on lm_head
        with adapters_disabled(adapted):
            assert head_weight(head) is head.weight
            off, _ = policy(ids, pos, targets)
            base = adapted(input_ids=ids).logits.float().log_softmax(-1).gather(-1, targets[..., None])[..., 0]
        torch.testing.assert_close(off, base, atol=1e-5, rtol=1e-5)
        assert (off - got).abs().max() > 1e-2


def test_lm_head_adapter_gets_gradients(adapted) -> None:
    ids = torch.arange(3, 20)[None]
    logp, _ = PolicyModule(adapted, chunk_size=5)(ids, torch.arange(17)[None], torch.roll(ids, -1, 1))
    logp.sum().backward()
    head = adapted.lm_head
    for part in (head.lora_A, head.lora_B):
        g = part["default"].weight.grad
        assert g is not None and g.abs().max() > 0
    adapted.zero_grad(set_to_none=True)


@pytest.mark.parametrize("kind", ["hf", "vllm"])
def test_engines_serve_an_lm_head_adapter_exactly(kind, adapted, tiny_chat_path) -> None:
    """The adapter with lm_head, synced as a rank syncs it: the engine's fingerprint
    equals the trainer's exactly (vLLM: lm_head's slot in LogitsProcessorWithLoRA
    read too) and its prompt log-probs are the peft model's within the probe's bound."""
    peft_model = adapted.areno_peft
    config = peft_model.peft_config["default"]  # what save_adapter writes: targets incl. lm_head
    named = adapter_tensors(peft_model)
    assert any(n.startswith("base_model.model.lm_head.") for n in named)
    if kind == "hf":
        from areno.rollout.hf import HFEngine

        engine = HFEngine(tiny_chat_path, dtype="float32", seed=0, max_model_len=MAX_MODEL_LEN, max_lora_rank=4)
    else:
        pytest.importorskip("vllm")
        from areno.rollout.vllm import VLLMEngine

        engine = VLLMEngine(tiny_chat_path, dtype="float32", seed=0, max_model_len=MAX_MODEL_LEN,
                            kv_cache_memory_bytes=16 << 20, max_lora_rank=4)
    engine.dtype_name = "float32"
    try:
        sync_adapter(engine, named.items(), config, 1)  # the exact check, as a rank runs it
        held, want = engine.adapter_fingerprint(), adapter_fingerprint_of(named, config)
        assert {"lm_head.lora_A projection", "lm_head.lora_B projection"} <= set(held.sums)
        assert set(held.sums) == set(want.sums) and fingerprint_mismatch(held, want) is None
        verify_probe(engine, probe_for(peft_model, engine))
        with adapters_disabled(adapted):  # the engine is not on the base model's head
            base_probe = probe_for(peft_model, engine)
        with pytest.raises(Exception, match="probe"):
            verify_probe(engine, base_probe)
    finally:
        engine.shutdown()


def test_a_tied_lm_head_is_refused(tiny_chat_path, tmp_path) -> None:
    """A model whose lm_head is its input embedding: one line naming lm_head."""
    import json
    import shutil

    from areno.errors import UserError

    tied = tmp_path / "tied"
    shutil.copytree(tiny_chat_path, tied)
    cfg = json.loads((tied / "config.json").read_text())
    (tied / "config.json").write_text(json.dumps({**cfg, "tie_word_embeddings": True}))
    with pytest.raises(UserError, match="ties lm_head to its input embeddings"):
        lora_plan(str(tied), SPEC)
    lora_plan(str(tied), LoraSpec(rank=4, alpha=5.0))  # decoder linears only: served


@pytest.mark.parametrize("targets,msg", [
    ("all-linear,lm_head --lora-dropout 0.1", "--lora-dropout with lm_head"),
    ("all-linear,q_proj", "give it alone or with lm_head"),
])
def test_bad_head_targets_are_one_line_user_errors(targets, msg, areno_cache, tmp_path) -> None:
    from inprocess import run_here

    args = ["--lora-rank", "8", "--lora-target-modules", *targets.split(" ")]
    res = run_here(["train", *args, "--max-steps", "1", "--output-dir", str(tmp_path / "run")], areno_cache)
    assert res.returncode == 2, res.stdout[-2000:] + res.stderr[-2000:]
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and msg in lines[0], res.stderr


def test_merged_state_holds_the_adapted_head(adapted, tiny_chat_model) -> None:
    """--save-merged with lm_head adapted: merged lm_head.weight is W0 + scaling B A,
    the weight the trainer computes with; the embeddings stay the base model's."""
    from areno.backend.lora import merged_state
    from areno.backend.weights import hf_state_names

    merged = dict(merged_state(adapted, hf_state_names(tiny_chat_model)))
    with torch.no_grad():
        torch.testing.assert_close(merged["lm_head.weight"], head_weight(adapted.lm_head), atol=0, rtol=0)
    assert not torch.equal(merged["lm_head.weight"], tiny_chat_model.lm_head.weight)
    assert torch.equal(merged["model.embed_tokens.weight"], tiny_chat_model.model.embed_tokens.weight)
