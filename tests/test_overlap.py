"""Rewards overlapped with generation give exactly the step that scoring after
the whole rollout gives: same batch, same rewards, same advantages and pack."""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from areno.advantages import advantages_and_keep
from areno.data.prompts import tokenize_prompts
from areno.rewards import RewardScorer
from areno.rollout.batch import overlong_mask
from areno.rollout.engine import SamplingConfig
from areno.data.rows import normalize_rows
from areno.data.sampler import PromptSampler
from areno.split import build_split_pack
from areno.producers import Data, Producer
from areno.timing import PhaseTimer
from helpers import InProcessEngines, concat, take_prompts


@dataclass
class _Cfg:
    n_samples: int = 4
    adv_mode: str = "grpo"
    filter_zero_variance_groups: bool = False
    mask_overlong: bool = False


def _run(engine, tokenizer, tmp_path, workers):
    from areno.data.tasks import arith

    rows = normalize_rows(arith.rows(), source="arith")
    prompts = tokenize_prompts(rows, tokenizer, use_chat_template=False, max_prompt_len=16)
    plugin = tmp_path / "r.py"
    plugin.write_text(
        "def reward_fn(r):\n"
        "    return float(len(r.completion)) + 0.25 * (r.finish_reason == 'stop') + 0.01 * r.index\n"
    )
    scorer = RewardScorer(str(plugin), workers=workers, timeout=30)
    run = SimpleNamespace(cfg=_Cfg(), engine=InProcessEngines(engine), tokenizer=tokenizer, rows=rows,
                          prompts=prompts, scorer=scorer)
    return run, PromptSampler(len(prompts), 12, seed=3).next_batch()


def _assert_same(a, b):
    (ba, sa), (bb, sb) = a, b
    for f in ("prompt_ids", "prompt_offsets", "response_ids", "response_offsets",
              "response_logprobs", "group_index", "finish_reason"):
        np.testing.assert_array_equal(getattr(ba, f), getattr(bb, f), err_msg=f)
    np.testing.assert_array_equal(sa.rewards, sb.rewards)
    np.testing.assert_array_equal(sa.valid, sb.valid)


def check_engine(engine, tokenizer, tmp_path):
    run, idx = _run(engine, tokenizer, tmp_path, workers=1)
    sampling = SamplingConfig(temperature=1.0, max_tokens=3, seed=11)
    producer, data = Producer(run, None), Data(run.rows, run.prompts)
    try:
        plain = producer.start(data, idx, 4, sampling, overlap=False).collect(PhaseTimer()).astuple()[1:]
        overlapped = producer.start(data, idx, 4, sampling, overlap=True).collect(PhaseTimer()).astuple()[1:]
    finally:
        run.scorer.close()
    _assert_same(plain, overlapped)
    # the sample index a reward function sees is the response's index in the step
    (b, s) = plain
    rest = (s.rewards - 0.01 * np.arange(b.num_responses)) / 0.25  # integer iff index matched
    np.testing.assert_allclose(rest, np.round(rest), atol=1e-3)
    packs = []
    for batch, scored in (plain, overlapped):
        c = run.cfg
        adv, keep, _ = advantages_and_keep(
            scored.rewards, scored.valid, batch.group_index, batch.num_prompts, overlong_mask(batch),
            mode=c.adv_mode, filter_zero_variance=c.filter_zero_variance_groups,
            mask_overlong=c.mask_overlong)
        packs.append(build_split_pack(batch, adv, world_size=2, max_tokens=64, keep=keep).pack)
    for f in ("input_ids", "targets", "loss_mask", "old_logprobs", "advantages", "seq_weights"):
        assert torch.equal(getattr(packs[0], f), getattr(packs[1], f)), f
    assert b.num_responses == len(idx) * 4


def test_overlap_equals_plain_hf(tiny_arith_path, tmp_path):
    from transformers import AutoTokenizer

    from areno.rollout.hf import HFEngine

    engine = HFEngine(tiny_arith_path, dtype="float32", seed=0, max_model_len=64)
    check_engine(engine, AutoTokenizer.from_pretrained(tiny_arith_path), tmp_path)


@pytest.fixture(scope="module")
def vllm_engine(tiny_arith_path):
    """One in-process vLLM engine for this module's vLLM tests (each samples with a seed)."""
    pytest.importorskip("vllm")
    from areno.rollout.vllm import VLLMEngine

    engine = VLLMEngine(tiny_arith_path, dtype="float32", seed=0, max_model_len=64)
    yield engine
    engine.shutdown()


def test_overlap_equals_plain_vllm(vllm_engine, tiny_arith_path, tmp_path):
    from transformers import AutoTokenizer

    check_engine(vllm_engine, AutoTokenizer.from_pretrained(tiny_arith_path), tmp_path)


def test_vllm_stream_parts_cover_every_prompt_once(vllm_engine):
    """generate_stream's parts, put back in order, equal generate()."""
    engine = vllm_engine
    rng = np.random.default_rng(0)
    lengths = rng.integers(2, 6, 10)
    ids = rng.integers(0, 14, lengths.sum()).astype(np.int32)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    s = SamplingConfig(max_tokens=4, seed=5)
    whole = engine.generate(ids, offsets, 3, s)
    parts = list(engine.generate_stream(ids, offsets, 3, s, min_groups=3))
    pos = np.concatenate([p for p, _ in parts])
    assert sorted(pos.tolist()) == list(range(10))
    got, _ = take_prompts(concat([b for _, b in parts]), np.argsort(pos))
    np.testing.assert_array_equal(got.response_ids, whole.response_ids)
    np.testing.assert_array_equal(got.prompt_ids, whole.prompt_ids)
    np.testing.assert_allclose(got.response_logprobs, whole.response_logprobs, atol=1e-5)
