"""HFEngine tests that build their own engines, and the engine-independent parts
of areno.rollout.engine (SamplingConfig), areno.rollout.factory (make_engine) and areno.rollout.probe.
The RolloutEngine contract (generation, log-probs, weights, probe) runs against
every engine in test_engine_contract.py."""

from __future__ import annotations

import builtins

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from areno.rollout.engine import SamplingConfig
from areno.rollout.factory import EngineSpec, make_engine
from areno.rollout.hf import HFEngine

MAX_MODEL_LEN = 128
PROMPTS = [[5, 6, 7, 8, 9], [10, 11]]


def test_unseeded_rollouts_follow_the_engine_seed(tiny_chat_path, make_prompts):
    ids, off = make_prompts(PROMPTS[:2])
    twin = HFEngine(tiny_chat_path, dtype="float32", seed=0, max_model_len=MAX_MODEL_LEN)
    fresh = HFEngine(tiny_chat_path, dtype="float32", seed=0, max_model_len=MAX_MODEL_LEN)
    s = SamplingConfig(max_tokens=6, ignore_eos=True)
    a1, a2 = twin.generate(ids, off, 2, s), twin.generate(ids, off, 2, s)
    b1 = fresh.generate(ids, off, 2, s)
    np.testing.assert_array_equal(a1.response_ids, b1.response_ids)
    assert not np.array_equal(a1.response_ids, a2.response_ids)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(temperature=-1.0), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_k=-2), "top_k"),
        (dict(max_tokens=0), "max_tokens"),
    ],
)
def test_sampling_config_rejects_bad_values(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingConfig(**kwargs)


def test_make_engine_falls_back_to_hf_without_vllm(tiny_chat_path, monkeypatch):
    real_import = builtins.__import__

    def no_vllm(name, *args, **kwargs):
        if name == "vllm" or name.startswith("vllm."):
            raise ImportError("No module named 'vllm'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_vllm)
    with pytest.warns(UserWarning, match="sampling with the transformers engine"):
        eng, kind = make_engine(EngineSpec(kind="vllm", max_model_len=64), str(tiny_chat_path))
    assert isinstance(eng, HFEngine) and kind == "hf"
    with pytest.raises(ValueError, match="valid: vllm, hf"):
        EngineSpec(kind="sglang")


def test_a_groups_samples_share_its_prompt_prefill(tiny_chat_path, make_prompts, monkeypatch):
    """The n samples of a prompt reuse one prefill (a KV cache repeated n times):
    the same tokens and log-probs as generating from n copies of the prompt."""
    ids, off = make_prompts(PROMPTS)
    engine = HFEngine(tiny_chat_path, dtype="float32", seed=0, max_model_len=MAX_MODEL_LEN)
    s = SamplingConfig(max_tokens=6, ignore_eos=True, seed=11)
    shared = engine.generate(ids, off, 4, s)
    monkeypatch.setattr(engine, "_shared_prefix", lambda x, m, n, carried=0: (None, x.repeat_interleave(n, dim=0),
                                                               m.repeat_interleave(n, dim=0)))
    rows = engine.generate(ids, off, 4, s)
    np.testing.assert_array_equal(shared.response_ids, rows.response_ids)
    np.testing.assert_allclose(shared.response_logprobs, rows.response_logprobs, atol=1e-5)


class _LargestVocabTensor(TorchDispatchMode):
    """The most elements of any new op output whose last dimension is the
    vocabulary (logits, scores, log-softmax), while active: a torch-level
    stand-in for the CUDA allocator's peak, which CPU lacks. Views of an input
    (a weight's transpose) allocate nothing and are not counted."""

    def __init__(self, vocab: int) -> None:
        super().__init__()
        self.vocab, self.numel = vocab, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        leaves = torch.utils._pytree.tree_leaves((args, kwargs))
        inputs = {t.untyped_storage().data_ptr() for t in leaves if isinstance(t, torch.Tensor)}
        for t in torch.utils._pytree.tree_leaves(out):
            if (isinstance(t, torch.Tensor) and t.dim() and t.shape[-1] == self.vocab
                    and t.untyped_storage().data_ptr() not in inputs):
                self.numel = max(self.numel, t.numel())
        return out


def _largest_vocab_tensor(engine, ids, off, n, steps) -> int:
    with _LargestVocabTensor(engine.vocab_size) as probe:
        engine.generate(ids, off, n, SamplingConfig(max_tokens=steps, ignore_eos=True, seed=3))
    return probe.numel


def test_generation_memory_does_not_grow_with_vocab_times_steps(tiny_chat_path, make_prompts):
    """Sampled-token log-probs are taken step by step: the largest tensor over
    the vocabulary is one step's [rows, vocab], at 2 steps and at 24 (today's
    stacked scores were [rows, steps, vocab], three times over), and the
    shared prefill asks for no prompt logits."""
    ids, off = make_prompts(PROMPTS)
    engine = HFEngine(tiny_chat_path, dtype="float32", seed=0, max_model_len=MAX_MODEL_LEN)
    rows = 4 * len(PROMPTS)
    assert _largest_vocab_tensor(engine, ids, off, 4, 2) == rows * engine.vocab_size
    assert _largest_vocab_tensor(engine, ids, off, 4, 24) == rows * engine.vocab_size
    # n=1: 2 rows, while a prefill of full prompt logits would be [2, 4, vocab]
    assert _largest_vocab_tensor(engine, ids, off, 1, 4) == len(PROMPTS) * engine.vocab_size


def test_prompts_of_three_lengths_share_one_generate_call(tiny_chat_path, make_prompts, ref_logprobs,
                                                          tiny_chat_model):
    """Left padding puts every prompt length into one `generate`, and each row's
    log-probs still equal an unpadded forward's."""
    ids, off = make_prompts([[5, 6, 7, 8, 9], [10, 11], [12, 13, 14]])
    engine = HFEngine(tiny_chat_path, dtype="float32", seed=0, max_model_len=MAX_MODEL_LEN)
    calls = []
    real = engine.model.generate
    engine.model.generate = lambda **kw: calls.append(kw["input_ids"].shape) or real(**kw)
    b = engine.generate(ids, off, 3, SamplingConfig(max_tokens=8, ignore_eos=True, seed=5, temperature=0.8,
                                                    top_k=20))
    assert calls == [(9, 5)]
    np.testing.assert_allclose(b.response_logprobs, ref_logprobs(tiny_chat_model, b, 0.8, 20), atol=1e-4)


def test_a_response_the_context_cuts_is_sampled_apart_to_its_own_limit(tiny_chat_path, make_prompts):
    """A prompt whose context leaves fewer steps than max_tokens gets its own
    generate call, with exactly the steps left (the others are not cut short)."""
    ids, off = make_prompts([[5, 6, 7, 8, 9, 10, 11, 12], [10, 11]])
    engine = HFEngine(tiny_chat_path, dtype="float32", seed=0, max_model_len=12)
    b = engine.generate(ids, off, 2, SamplingConfig(max_tokens=8, ignore_eos=True, seed=5))
    assert np.diff(b.response_offsets).tolist() == [4, 4, 8, 8]
