"""Golden tests of the off-policy corrections (issue 27, 4) against peers' code,
transcribed on small padded arrays: verl's rollout correction
(verl/trainer/ppo/rollout_corr_helper.py: compute_rollout_correction_weights,
compute_rollout_rejection_mask), AReaL's decoupled loss with its behaviour
weight cap (areal/utils/functional.py: ppo_actor_loss_fn) and DAPO's soft
overlong punishment (verl/workers/reward_manager/dapo.py). Each reference is
written in the peer's own shape, [B, T] with a response mask, and compared with
areno's packed [L] functions."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import float64_default  # noqa: F401 (autouse: this module's references are float64)

from areno.advantages import overlong_penalty
from areno.losses import LossConfig, LossInputs, behaviour_weights, compute_loss

SAFETY_BOUND = 20.0  # verl's


def padded_case(seed: int, B: int = 6, T: int = 8, sd: float = 0.5):
    """[B, T] prox and behav log-probs and a response mask (rows of 1..T tokens);
    row 0 is far off-policy (its summed log-ratio is over verl's safety bound)."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    lengths[0] = T
    mask = torch.arange(T)[None, :] < lengths[:, None]
    behav = -torch.rand(B, T, generator=g) * 3
    prox = behav + sd * torch.randn(B, T, generator=g)
    prox[0] = behav[0] + 3.0  # sum 24 > 20
    return prox, behav, mask


# -- verl, transcribed (masked_sum / masked_mean over the last axis) ------------
def masked_sum(x, mask):
    return (x * mask).sum(-1)


def masked_mean(x, mask):
    return masked_sum(x, mask) / mask.sum(-1).clamp_min(1)


def verl_level_weights(log_ratio, mask, level):
    """The weights both verl functions form before truncating or masking."""
    if level == "token":
        return torch.exp(torch.clamp(log_ratio, -SAFETY_BOUND, SAFETY_BOUND))
    agg = masked_sum(log_ratio, mask) if level == "sequence" else masked_mean(log_ratio, mask)
    return torch.exp(torch.clamp(agg[:, None], -SAFETY_BOUND, SAFETY_BOUND)).expand_as(log_ratio)


def verl_correction_weights(log_ratio, mask, level, threshold):
    """compute_rollout_correction_weights: truncated IS (rollout_is = token | sequence)."""
    w = verl_level_weights(log_ratio, mask, level) * mask
    return w.clamp(max=threshold)


def verl_rejection_mask(log_ratio, mask, level, upper, lower):
    """compute_rollout_rejection_mask: 1 inside [lower, upper] (rollout_rs = token |
    sequence | geometric), and its rollout_rs_masked_fraction."""
    w = verl_level_weights(log_ratio, mask, level)
    keep = ((w >= lower) & (w <= upper)).to(log_ratio.dtype)
    masked_fraction = masked_sum(1 - keep, mask).sum() / mask.sum()
    return mask * keep, w, masked_fraction


# -- areno on the same data, packed ---------------------------------------------
def areno_weights(prox, behav, mask, **cfg):
    B, T = mask.shape
    flat_mask = mask.reshape(-1)
    log_w = torch.where(flat_mask, (prox - behav).reshape(-1), torch.zeros(B * T))
    seq_index = torch.arange(B).repeat_interleave(T)
    iw, over = behaviour_weights(log_w, flat_mask, seq_index, B, LossConfig(**cfg))
    return iw.reshape(B, T) * mask, over.reshape(B, T)


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("level", ["token", "sequence"])
def test_truncated_weights_equal_verls_rollout_is(level, seed):
    prox, behav, mask = padded_case(seed)
    want = verl_correction_weights(prox - behav, mask, level, threshold=2.0)
    got, over = areno_weights(prox, behav, mask, tis_cap=2.0, is_level=level)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=0)
    assert 0 < int(over.sum()) < int(mask.sum())  # some capped, some not: the cap is exercised
    if level == "token":  # verl's rollout_is_ratio_fraction_high, as a token count
        assert int(over.sum()) == int(((verl_level_weights(prox - behav, mask, level) > 2.0)
                                       & mask).sum())


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("level", ["token", "sequence", "geometric"])
def test_masked_weights_equal_verls_rejection_band_times_its_weight(level, seed):
    """areno's mask mode keeps w inside [low, cap], 0 outside: verl's rollout_rs
    mask at that level times the weight it thresholds (as rollout_is at that
    level with a threshold >= cap would give it)."""
    prox, behav, mask = padded_case(seed, sd=0.8)
    upper, lower = 1.6, 1 / 1.6  # verl's default lower edge: 1 / upper
    keep, w, masked_fraction = verl_rejection_mask(prox - behav, mask, level, upper, lower)
    got, dropped = areno_weights(prox, behav, mask, tis_cap=upper, is_level=level, is_mode="mask",
                                 is_mask_low=lower)
    torch.testing.assert_close(got, keep * w, rtol=1e-12, atol=0)
    assert 0 < int(dropped.sum()) < int(mask.sum())
    assert float(dropped.sum() / mask.sum()) == pytest.approx(float(masked_fraction), abs=1e-15)
    if level != "token":  # a rejected sequence loses every token
        per_row = dropped.sum(-1)
        assert bool(((per_row == 0) | (per_row == mask.sum(-1))).all())


def areal_ppo_actor_loss(logprobs, proximal, old, adv, loss_mask, eps_clip, cap):
    """AReaL's ppo_actor_loss_fn, token level, decoupled, no dual clip: the clipped
    ratio against the proximal policy, times the behaviour weight, which is 0 for a
    token over behav_imp_weight_cap; summed over the mask / its count."""
    ratio = torch.where(loss_mask, torch.exp(logprobs - proximal), 0)
    clipped = torch.clamp(ratio, 1.0 - eps_clip, 1.0 + eps_clip)
    pg_loss = torch.max(-adv * ratio, -adv * clipped)
    behav_imp_weight = (proximal - old).exp()
    behav_mask = (behav_imp_weight <= cap).logical_and(loss_mask)
    behav_imp_weight = torch.where(behav_mask, behav_imp_weight, 0.0)
    pg_loss = pg_loss * behav_imp_weight
    return torch.where(loss_mask, pg_loss, 0).sum() / (loss_mask.count_nonzero() or 1)


@pytest.mark.parametrize("seed", [0, 3])
def test_token_mask_is_areals_behaviour_weight_cap_in_the_loss(seed):
    prox, behav, mask = padded_case(seed, sd=0.6)
    B, T = mask.shape
    g = torch.Generator().manual_seed(100 + seed)
    logp = prox + 0.3 * torch.randn(B, T, generator=g)
    adv = torch.randn(B, 1, generator=g).expand(B, T)
    want = areal_ppo_actor_loss(logp, prox, behav, adv, mask, 0.2, cap=1.5)
    flat = mask.reshape(-1)
    inp = LossInputs(logprobs=logp.reshape(-1), old_logprobs=prox.reshape(-1),
                     advantages=adv.reshape(-1), loss_mask=flat,
                     seq_weights=torch.full((B,), 1.0 / float(flat.sum())),  # token-mean
                     seq_index=torch.arange(B).repeat_interleave(T),
                     rollout_logprobs=behav.reshape(-1))
    out = compute_loss(inp, LossConfig(tis_cap=1.5, is_mode="mask"))
    assert out.loss.item() == pytest.approx(want.item(), rel=1e-12)
    over = ((prox - behav).exp() > 1.5) & mask
    assert 0 < int(over.sum()) and out.metrics["is_masked_frac"].item() == int(over.sum())
    assert out.metrics["tis_capped_frac"].item() == 0  # nothing is truncated in mask mode
    # today's default, truncation, differs exactly where a token is over the cap
    trunc = compute_loss(inp, LossConfig(tis_cap=1.5)).loss.item()
    assert trunc != pytest.approx(want.item(), rel=1e-6)


def test_default_is_todays_token_truncation():
    prox, behav, mask = padded_case(4)
    got, _ = areno_weights(prox, behav, mask, tis_cap=2.0)
    want = ((prox - behav).exp().clamp(max=2.0)) * mask
    torch.testing.assert_close(got, want, rtol=1e-12, atol=0)


def verl_dapo_overlong(valid_response_length: int, max_resp_len: int, buffer_len: int,
                       penalty_factor: float) -> float:
    """DAPORewardManager.__call__'s overlong_buffer branch, for one response."""
    expected_len = max_resp_len - buffer_len
    exceed_len = valid_response_length - expected_len
    return min(-exceed_len / buffer_len * penalty_factor, 0)


@pytest.mark.parametrize("buffer,factor", [(4, 1.0), (16, 0.5), (32, 2.0)])
def test_overlong_penalty_equals_dapos_reward_manager(buffer, factor):
    max_new = 32
    lengths = np.arange(0, max_new + 1)
    want = [verl_dapo_overlong(int(n), max_new, buffer, factor) for n in lengths]
    got = overlong_penalty(lengths, max_new, buffer, factor)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
    assert got[-1] == pytest.approx(-factor) and got[max_new - buffer] == 0
    assert not overlong_penalty(lengths, max_new, 0, factor).any()  # off by default
