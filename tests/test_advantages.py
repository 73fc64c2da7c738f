import numpy as np
import pytest

from areno.advantages import group_advantages
from helpers import random_batch, random_rewards


def reference_advantages(rewards, group_index, mode, eps=1e-6):
    """Per-sample loop reference."""
    out = np.zeros(len(rewards))
    for i in range(len(rewards)):
        members = [j for j in range(len(rewards)) if group_index[j] == group_index[i]]
        vals = [float(rewards[j]) for j in members]
        G = len(vals)
        if G == 1 or max(vals) == min(vals):
            out[i] = 0.0
            continue
        mean = sum(vals) / G
        if mode == "grpo":
            std = (sum((v - mean) ** 2 for v in vals) / (G - 1)) ** 0.5  # ddof=1
            out[i] = (rewards[i] - mean) / (std + eps)
        elif mode == "drgrpo":
            out[i] = rewards[i] - mean
        else:
            others = [float(rewards[j]) for j in members if j != i]
            out[i] = rewards[i] - sum(others) / len(others)
    return out


@pytest.mark.parametrize("mode", ["grpo", "drgrpo", "rloo"])
@pytest.mark.parametrize("seed", range(5))
def test_matches_loop_reference(mode, seed):
    b = random_batch(seed=seed, num_prompts=9)
    r = random_rewards(b, seed=seed, zero_var_groups=2)
    r = r + np.random.default_rng(seed).normal(0, 0.1, r.size).astype(np.float32) * (b.group_index > 1)
    got = group_advantages(r, b.group_index, mode=mode)
    assert got.dtype == np.float32
    np.testing.assert_allclose(got, reference_advantages(r, b.group_index, mode), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("mode", ["grpo", "drgrpo", "rloo"])
def test_singleton_and_constant_groups_are_exactly_zero(mode):
    r = np.array([0.7, 0.3, 0.3, 0.3, 1e9 + 0.1, 1e9 + 0.1, 2.0, 0.0], dtype=np.float64)
    g = np.array([0, 1, 1, 1, 2, 2, 3, 3])
    adv = group_advantages(r, g, mode=mode)
    assert np.all(adv[:6] == 0.0)
    assert np.all(np.isfinite(adv))
    assert adv[6] > 0 > adv[7]


def test_unequal_group_sizes_and_unused_groups():
    r = np.array([1.0, 0.0, 1.0, 0.0, 0.0])
    g = np.array([0, 0, 2, 2, 2])  # group 1 has no members
    adv = group_advantages(r, g, mode="drgrpo", num_groups=3)
    np.testing.assert_allclose(adv, [0.5, -0.5, 2 / 3, -1 / 3, -1 / 3], rtol=1e-6)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_reward_names_the_index(bad):
    r = np.array([0.0, 1.0, bad, 0.5])
    with pytest.raises(ValueError, match="response index 2"):
        group_advantages(r, np.array([0, 0, 1, 1]))


def test_bad_mode_and_shapes():
    with pytest.raises(ValueError, match="mode"):
        group_advantages(np.zeros(2), np.zeros(2, np.int64), mode="ppo")
    with pytest.raises(ValueError, match="equal 1-D shapes"):
        group_advantages(np.zeros(3), np.zeros(2, np.int64))
    assert group_advantages(np.zeros(0), np.zeros(0, np.int64)).shape == (0,)


@pytest.mark.parametrize("n", [2, 3, 8])
def test_grpo_divides_by_the_unbiased_group_std(n):
    """(r - mean) / (std(ddof=1) + eps), as verl (torch.std) and TRL (nanstd) do."""
    import torch

    rng = np.random.default_rng(n)
    r = rng.random(2 * n)
    g = np.repeat([0, 1], n)
    got = group_advantages(r, g, mode="grpo", eps=1e-6)
    want = np.concatenate([(x - x.mean()) / (x.std(ddof=1) + 1e-6) for x in r.reshape(2, n)])
    np.testing.assert_allclose(got, want, rtol=1e-5)
    t = torch.tensor(r).view(2, n)  # verl: torch.std is unbiased by default
    verl = (t - t.mean(-1, keepdim=True)) / (t.std(-1, keepdim=True) + 1e-6)
    np.testing.assert_allclose(got, verl.flatten().numpy(), rtol=1e-5)
    if n == 2:  # one reward above, one below: +-1/sqrt(2), not +-1 as with ddof=0
        np.testing.assert_allclose(np.abs(got), 2 ** -0.5, rtol=1e-3)


def test_advantages_and_keep_skips_invalid_filters_zero_variance_and_masks_overlong():
    from areno.advantages import advantages_and_keep

    # groups: 0 = {1, 1} constant, 1 = {0, 1, NaN skipped}, 2 = {NaN skipped} only
    r = np.array([1.0, 1.0, 0.0, 1.0, np.nan, np.nan], dtype=np.float32)
    valid = np.isfinite(r)
    g = np.array([0, 0, 1, 1, 1, 2])
    truncated = np.array([False, False, True, False, False, False])
    adv, keep, n_zv = advantages_and_keep(r, valid, g, 3, truncated)
    np.testing.assert_allclose(adv, np.r_[0.0, 0.0, group_advantages(r[2:4], [0, 0]), 0.0, 0.0])
    assert keep.tolist() == valid.tolist() and n_zv == 1  # the empty group 2 is not counted
    _, keep, _ = advantages_and_keep(r, valid, g, 3, truncated, filter_zero_variance=True)
    assert keep.tolist() == [False, False, True, True, False, False]
    _, keep, _ = advantages_and_keep(r, valid, g, 3, truncated, filter_zero_variance=True,
                                     mask_overlong=True)
    assert keep.tolist() == [False, False, False, True, False, False]


def test_advantages_and_keep_all_valid_is_group_advantages_bit_for_bit():
    """The all-valid step (no masked copies) gives exactly group_advantages and
    the same keep and zero-variance count as the general path."""
    from areno.advantages import advantages_and_keep

    rng = np.random.default_rng(7)
    g = np.repeat(np.arange(9, dtype=np.int64), 4)
    r = rng.choice([0.0, 0.5, 1.0], g.size).astype(np.float32)
    r[:4] = 1.0  # a constant group
    valid, trunc = np.ones(g.size, dtype=bool), np.zeros(g.size, dtype=bool)
    adv, keep, nz = advantages_and_keep(r, valid, g, 9, trunc, filter_zero_variance=True)
    assert adv.dtype == np.float32 and np.array_equal(adv, group_advantages(r, g, num_groups=9))
    r2, valid2 = np.append(r, np.nan).astype(np.float32), np.append(valid, False)
    adv2, keep2, nz2 = advantages_and_keep(r2, valid2, np.append(g, 8), 9, np.append(trunc, False),
                                           filter_zero_variance=True)
    assert np.array_equal(adv2[:-1], adv) and adv2[-1] == 0.0
    assert np.array_equal(keep2[:-1], keep) and not keep2[-1] and nz2 == nz >= 1 and not keep[:4].any()
