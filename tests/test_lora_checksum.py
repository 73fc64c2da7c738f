"""The adapter checksum sees layout (issue 26, 3): an adapter served with two
projections' A swapped (q<->k, gate<->up), a block transposed or a block's sign
flipped has the sums of squares of the one sent (the old fingerprint passed
them all) and fails the per-slot projection; an exact copy passes. On the
trainer's function, and on real engines (hf; vLLM, whose packed qkv / gate_up
slots are named by sub-module) loaded with the corrupted tensors."""

from __future__ import annotations

import copy
import itertools

import pytest
import torch

from areno.rollout.lora import adapter_fingerprint_of
from areno.rollout.probe import Fingerprint, fingerprint_mismatch
from test_lora_engines import adapter_tensors, randomize

RANK = 8
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def config():
    from peft import LoraConfig

    return LoraConfig(r=RANK, lora_alpha=16, target_modules=list(TARGETS))


@pytest.fixture(scope="module")
def sent(tiny_chat_model) -> dict[str, torch.Tensor]:
    from peft import get_peft_model

    model = get_peft_model(copy.deepcopy(tiny_chat_model), config())
    randomize(model, seed=3)
    return adapter_tensors(model)


def key(module: str, kind: str = "lora_A", layer: int = 0) -> str:
    parent = "self_attn" if module in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
    return f"base_model.model.model.layers.{layer}.{parent}.{module}.{kind}.weight"


def swapped(t: dict, a: str, b: str) -> dict:
    out = dict(t)
    out[key(a)], out[key(b)] = t[key(b)], t[key(a)]
    return out


def transposed_block(t: dict) -> dict:
    out = dict(t)
    a = t[key("v_proj")].clone()  # [r, hidden]: its first r x r block stored transposed
    a[:, :RANK] = a[:, :RANK].T.clone()
    out[key("v_proj")] = a
    return out


def sign_flipped_block(t: dict) -> dict:
    out = dict(t)
    b = t[key("down_proj", "lora_B", layer=1)].clone()  # [hidden, r]
    b[:16] = -b[:16]
    out[key("down_proj", "lora_B", layer=1)] = b
    return out


CORRUPTIONS = {
    "q<->k lora_A": (lambda t: swapped(t, "q_proj", "k_proj"), "layers.0.self_attn.q_proj.lora_A"),
    "gate<->up lora_A": (lambda t: swapped(t, "gate_proj", "up_proj"), "layers.0.mlp.gate_proj.lora_A"),
    "transposed block": (transposed_block, "layers.0.self_attn.v_proj.lora_A"),
    "sign-flipped block": (sign_flipped_block, "layers.1.mlp.down_proj.lora_B"),
}


def squares_only(f: Fingerprint) -> Fingerprint:
    """The old fingerprint's part: sums of squares per (parent, A | B)."""
    keep = [g for g in f.sums if not g.endswith(" projection")]
    return Fingerprint({g: f.sums[g] for g in keep}, {g: f.counts[g] for g in keep})


@pytest.mark.parametrize("case", list(CORRUPTIONS))
def test_the_checksum_catches_what_a_sum_of_squares_cannot(case, sent) -> None:
    corrupt, where = CORRUPTIONS[case]
    bad = corrupt(sent)
    assert any(not torch.equal(bad[n], sent[n]) for n in sent)
    want, got = adapter_fingerprint_of(sent, config()), adapter_fingerprint_of(bad, config())
    assert fingerprint_mismatch(squares_only(got), squares_only(want)) is None  # the old check: blind
    msg = fingerprint_mismatch(got, want)
    assert msg is not None and where in msg, msg
    copied = {n: t.clone() for n, t in sent.items()}
    assert fingerprint_mismatch(adapter_fingerprint_of(copied, config()), want) is None


@pytest.fixture(scope="module", params=["hf", "vllm"])
def engine(request, tiny_chat_path):
    if request.param == "hf":
        from areno.rollout.hf import HFEngine

        eng = HFEngine(tiny_chat_path, dtype="float32", seed=0, max_model_len=64, max_lora_rank=RANK)
    else:
        from areno.rollout.vllm import VLLMEngine

        eng = VLLMEngine(tiny_chat_path, dtype="float32", seed=0, max_model_len=64,
                         kv_cache_memory_bytes=16 << 20, max_lora_rank=RANK)
    eng.versions = itertools.count(1)
    yield eng
    eng.shutdown()


@pytest.mark.parametrize("case", [*CORRUPTIONS, "exact copy"])
def test_an_engine_serving_a_corrupted_adapter_fails_the_check(case, engine, sent) -> None:
    """The engine loads the corrupted tensors (as a mis-mapped load would leave
    them), the trainer's fingerprint is of what it sent: caught, naming the slot."""
    corrupt, where = CORRUPTIONS.get(case, (dict, None))
    engine.load_adapter({n: t.clone() for n, t in corrupt(sent).items()}, config(), next(engine.versions))
    msg = fingerprint_mismatch(engine.adapter_fingerprint(), adapter_fingerprint_of(sent, config()))
    if where is None:
        assert msg is None, msg
    else:
        assert msg is not None and where in msg, msg
