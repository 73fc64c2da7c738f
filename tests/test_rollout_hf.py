"""HFEngine tests that build their own engines, and the engine-independent parts
of areno.rollout.engine (SamplingConfig), areno.rollout.factory (make_engine) and areno.rollout.probe.
The RolloutEngine contract (generation, log-probs, weights, probe) runs against
every engine in test_engine_contract.py."""

from __future__ import annotations

import builtins

import numpy as np
import pytest

from areno.rollout.engine import SamplingConfig
from areno.rollout.factory import EngineSpec, make_engine
from areno.rollout.hf import HFEngine
from areno.rollout.probe import Probe

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


def test_probe_rejects_malformed_arrays():
    with pytest.raises(ValueError, match="int32"):
        Probe(np.arange(4), np.zeros(3, np.float32), 1e-3)
    with pytest.raises(ValueError, match=r"shape \(3,\)"):
        Probe(np.arange(4, dtype=np.int32), np.zeros(4, np.float32), 1e-3)


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
    monkeypatch.setattr(engine, "_shared_prefix", lambda x, n: (None, x.repeat_interleave(n, dim=0)))
    rows = engine.generate(ids, off, 4, s)
    np.testing.assert_array_equal(shared.response_ids, rows.response_ids)
    np.testing.assert_allclose(shared.response_logprobs, rows.response_logprobs, atol=1e-5)
