"""Group-relative advantages, vectorized over all groups at once.

Every mode works from per-group sums gathered with `np.bincount` (no Python
loop over groups), so groups may differ in size.

  grpo:   A_i = (r_i - mean_g) / (std_g + eps)          (Shao et al. 2024, DeepSeekMath)
          std_g = sqrt(sum_{j in g} (r_j - mean_g)^2 / (G - 1))
  drgrpo: A_i = r_i - mean_g                            (Liu et al. 2025, Dr. GRPO:
          dividing by std up-weights easy/hard prompts)
  rloo:   A_i = r_i - mean_{j in g, j != i} r_j         (Ahmadian et al. 2024)
          = G/(G-1) * (r_i - mean_g)

std is the unbiased sample std (ddof=1), as in verl (`compute_grpo_outcome_advantage`,
torch.std) and TRL (`nanstd`); the population std (ddof=0) would make advantages
sqrt(G/(G-1)) larger (7% at G=8, 41% at G=2).
A group of one, or one whose rewards are all equal, gets advantage 0 exactly.
"""

from __future__ import annotations

import typing

import numpy as np

from areno.choices import AdvantageMode

ADVANTAGE_MODES: tuple[str, ...] = typing.get_args(AdvantageMode)
EPS = 1e-6  # grpo: added to the group std


def group_advantages(
    rewards: np.ndarray,
    group_index: np.ndarray,
    *,
    mode: AdvantageMode = "grpo",
    eps: float = EPS,
    num_groups: int | None = None,
) -> np.ndarray:
    """[N] rewards, [N] int64 group ids -> [N] float32 advantages."""
    return _advantages_and_zero_variance(rewards, group_index, mode, eps, num_groups)[0]


def _advantages_and_zero_variance(rewards: np.ndarray, group_index: np.ndarray, mode: AdvantageMode,
                                  eps: float, num_groups: int | None) -> tuple[np.ndarray, np.ndarray]:
    """group_advantages, and the [G] bool zero_variance_groups it found on the way."""
    if mode not in ADVANTAGE_MODES:
        raise ValueError(f"mode: expected one of {ADVANTAGE_MODES}, got {mode!r}")
    r = np.asarray(rewards, dtype=np.float64)
    g = np.asarray(group_index, dtype=np.int64)
    if r.ndim != 1 or g.shape != r.shape:
        raise ValueError(f"rewards {r.shape} and group_index {g.shape} must be equal 1-D shapes")
    if r.size == 0:
        return np.zeros(0, dtype=np.float32), np.ones(int(num_groups or 0), dtype=bool)
    if not np.isfinite(r).all():
        i = int(np.flatnonzero(~np.isfinite(r))[0])
        raise ValueError(f"rewards: non-finite reward {r[i]} at response index {i}")
    if g.min() < 0:
        raise ValueError("group_index: negative group id")
    G = int(num_groups) if num_groups is not None else int(g.max()) + 1

    count = np.bincount(g, minlength=G).astype(np.float64)
    inv_count = 1.0 / np.maximum(count, 1.0)
    mean = np.bincount(g, weights=r, minlength=G) * inv_count
    centered = r - mean[g]
    var = np.bincount(g, weights=centered * centered, minlength=G) * inv_count
    # A constant group centres to rounding noise (~1e-16 |mean|), not exact
    # zeros: it is found by max == min instead, so it gives 0, not noise/eps.
    zero_var = zero_variance_groups(r, g, G)
    no_signal = (count <= 1.0) | zero_var

    if mode == "grpo":  # unbiased std: sum of squares / (G - 1)
        std = np.sqrt(var * count / np.maximum(count - 1.0, 1.0))
        per_group = 1.0 / (std + eps)
    elif mode == "drgrpo":
        per_group = np.ones(G)
    else:  # rloo: r_i - mean of the others = G/(G-1) (r_i - mean_g)
        per_group = count / np.maximum(count - 1.0, 1.0)
    per_group[no_signal] = 0.0
    return (centered * per_group[g]).astype(np.float32), zero_var


def zero_variance_groups(rewards: np.ndarray, group_index: np.ndarray, num_groups: int) -> np.ndarray:
    """[P] bool: groups whose rewards are all equal (max == min), groups of one
    and empty groups included. Such groups carry no group-relative signal."""
    rewards = np.asarray(rewards, dtype=np.float64)
    gmax = np.full(num_groups, -np.inf)
    gmin = np.full(num_groups, np.inf)
    np.maximum.at(gmax, group_index, rewards)
    np.minimum.at(gmin, group_index, rewards)
    return gmax <= gmin


def overlong_penalty(response_lengths: np.ndarray, max_new_tokens: int, buffer: int,
                     factor: float = 1.0) -> np.ndarray:
    """DAPO's soft overlong punishment (Yu et al. 2025, eq. 13; verl's DAPO reward
    manager, overlong_buffer): [N] int lengths -> [N] float32 penalty <= 0,

        p_i = min(-(len_i - (max_new_tokens - buffer)) / buffer * factor, 0)

    0 up to max_new_tokens - buffer tokens, then falling linearly to -factor at
    max_new_tokens. buffer 0: no penalty (off)."""
    lengths = np.asarray(response_lengths, dtype=np.float64)
    if buffer <= 0:
        return np.zeros(lengths.shape, dtype=np.float32)
    exceed = lengths - (max_new_tokens - buffer)
    return np.minimum(-exceed / buffer * factor, 0.0).astype(np.float32)


def advantages_and_keep(
    rewards: np.ndarray,
    valid: np.ndarray,
    group_index: np.ndarray,
    num_groups: int,
    truncated: np.ndarray,
    *,
    mode: AdvantageMode = "grpo",
    filter_zero_variance: bool = False,
    mask_overlong: bool = False,
) -> tuple[np.ndarray, np.ndarray, int]:
    """A step's advantages and which responses to train on.

    rewards [N] float32 (NaN where not valid), valid [N] bool, group_index [N]
    int64, truncated [N] bool (cut by the length limit) ->
    ([N] float32 advantages, 0 where not valid; [N] bool keep; the number of
    zero-variance groups with a valid member). Skipped (not valid) samples take
    no part in their group's baseline and are never kept; filter_zero_variance
    drops groups whose valid rewards are all equal (DAPO's dynamic sampling
    filter), mask_overlong drops truncated responses (DAPO's overlong mask).
    """
    all_valid = bool(valid.all())
    r, g = (rewards, group_index) if all_valid else (rewards[valid], group_index[valid])
    adv_valid, zero_var = _advantages_and_zero_variance(r, g, mode, EPS, num_groups)
    if all_valid:  # the usual step: no masked copies
        adv = adv_valid
    else:
        adv = np.zeros(group_index.size, dtype=np.float32)
        adv[valid] = adv_valid
    has_members = np.bincount(g, minlength=num_groups) > 0
    keep = valid.copy()
    if filter_zero_variance:
        keep &= ~zero_var[group_index]
    if mask_overlong:
        keep &= ~truncated
    return adv, keep, int((zero_var & has_members).sum())
