"""The weight-sync check's pure parts (rollout/probe.py): the fingerprint is
invariant to vLLM's layouts and nothing else, and the probe's tolerance is
derived from dtype, scale and calibration. The engines' side runs in
tests/test_engines.py (probe_scenarios.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from areno.rollout.probe import (
    PROBE_FLOOR_UNITS,
    PROBE_MARGIN,
    PROBE_ROUNDING_UNITS,
    Fingerprint,
    WeightSyncError,
    check_fingerprint,
    check_logprobs,
    fingerprint_mismatch,
    probe_scale,
    probe_tolerance,
    rounding_unit,
    sum_squares,
)


def _fp(named: dict[str, torch.Tensor]) -> Fingerprint:
    return Fingerprint.of((n, float(sum_squares(t)), t.numel()) for n, t in named.items())


def _hf_layer(dtype: torch.dtype, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shapes = {"q_proj": (64, 32), "k_proj": (16, 32), "v_proj": (16, 32), "o_proj": (32, 64)}
    out = {f"model.layers.0.self_attn.{k}.weight": torch.randn(s, generator=g).to(dtype) for k, s in shapes.items()}
    out["model.embed_tokens.weight"] = torch.randn(50, 32, generator=g).to(dtype)
    return out


def _vllm_layout(hf: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """What vLLM holds for the same weights: fused qkv, o stored transposed, the
    vocabulary padded to 64 rows with zeros."""
    a = "model.layers.0.self_attn."
    qkv = torch.cat([hf[a + f"{k}_proj.weight"] for k in "qkv"])
    emb = hf["model.embed_tokens.weight"]
    pad = torch.cat([emb, emb.new_zeros(64 - emb.shape[0], emb.shape[1])])
    return {a + "qkv_proj.weight": qkv, a + "o_proj.weight": hf[a + "o_proj.weight"].t().contiguous(),
            "model.embed_tokens.weight": pad}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fingerprint_is_invariant_to_fused_transposed_and_padded_layouts(dtype):
    hf = _hf_layer(dtype)
    assert fingerprint_mismatch(_fp(_vllm_layout(hf)), _fp(hf)) is None
    # what it must still see: one tensor x1.01, a stale layer, a dropped part of a fused one
    name = "model.layers.0.self_attn.o_proj.weight"
    scaled = dict(hf, **{name: hf[name] * 1.01})
    assert "model.layers.0.self_attn:" in fingerprint_mismatch(_fp(_vllm_layout(scaled)), _fp(hf))
    stale = _hf_layer(dtype, seed=1)
    assert fingerprint_mismatch(_fp(_vllm_layout(stale)), _fp(hf)) is not None
    k = "model.layers.0.self_attn.k_proj.weight"
    assert fingerprint_mismatch(_fp(_vllm_layout(dict(hf, **{k: torch.zeros_like(hf[k])}))), _fp(hf))


def test_fingerprint_slack_is_fp64_rounding_only():
    # one bf16 ulp of one element of a 1e5-element group is far above the slack
    t = torch.full((100_000,), 0.5, dtype=torch.bfloat16)
    bumped = t.clone()
    bumped[7] = 0.50390625  # the next bf16 above 0.5
    assert fingerprint_mismatch(_fp({"m.a.weight": bumped}), _fp({"m.a.weight": t})) is not None
    assert fingerprint_mismatch(_fp({"m.a.weight": t.flip(0)}), _fp({"m.a.weight": t})) is None


def test_renamed_module_paths_fall_back_to_the_totals():
    hf = _hf_layer(torch.float32)
    renamed = {n.replace("model.", "language_model.model."): t for n, t in hf.items()}
    assert fingerprint_mismatch(_fp(renamed), _fp(hf)) is None
    name = "language_model.model.layers.0.self_attn.q_proj.weight"
    renamed[name] = renamed[name] * 1.01
    assert fingerprint_mismatch(_fp(renamed), _fp(hf)).startswith("all tensors:")
    with pytest.raises(WeightSyncError, match="rank 3.*all tensors"):
        check_fingerprint(_fp(renamed), _fp(hf), rank=3)


def test_probe_tolerance_is_the_rounding_bound_until_calibrated_then_a_multiple_of_it():
    lp = np.array([-2.0, -9.0], dtype=np.float32)
    scale = probe_scale(25.0, lp)  # a real model's logits: 25 > |log p| 9
    assert scale == 25.0 and probe_scale(0.5, lp) == 9.0
    # bf16: the stored value's rounding; fp32: the sums' (K = 1536: 40 roundings of 2^-24)
    unit = rounding_unit("bfloat16", scale, 1536)
    assert unit == pytest.approx(25.0 / 256, rel=1e-3)
    assert rounding_unit("float32", scale, 1536) == pytest.approx(25.0 * 2.0**-24 * (1 + 1536**0.5))
    assert probe_tolerance(unit, None) == PROBE_ROUNDING_UNITS * unit
    assert probe_tolerance(unit, 2 * unit) == PROBE_MARGIN * 2 * unit
    assert probe_tolerance(unit, 0.0) == PROBE_FLOOR_UNITS * unit  # a lucky first diff
    assert probe_tolerance(unit, 10 * unit) == PROBE_ROUNDING_UNITS * unit  # never looser
    with pytest.raises(ValueError, match="float64"):
        rounding_unit("float64", 1.0, 1)


def test_check_logprobs_names_the_worst_position_and_the_tolerance():
    ref = np.zeros(5, np.float32)
    assert check_logprobs(ref + 0.01, ref, 0.02) == pytest.approx(0.01)
    got = ref.copy()
    got[3] = 0.5
    with pytest.raises(WeightSyncError, match=r"failed on rank 1.*max 0\.5 \(tolerance 0\.02, worst at position 4"):
        check_logprobs(got, ref, 0.02, " on rank 1")
    got[3] = np.nan
    with pytest.raises(WeightSyncError, match="max inf"):
        check_logprobs(got, ref, 0.02)
