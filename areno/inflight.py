"""A round in flight (`Inflight`, the scheduler's record of it) and the depth-K
bound every run's scheduler keeps, pure: `admitted` (a round's lag when it
trains), `check_oldest` (the same bound on every trained token) and
`lag_metrics` (what the step's batch lagged). Apart from
scheduler.py so that first_finished.py, which takes rounds group by group under
--partial-rollouts, shares them without importing the scheduler."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from areno.dynsample import Round
from areno.metrics import policy_lag_metrics
from areno.producers import Pending
from areno.rewards import RewardResult
from areno.rollout.batch import RolloutBatch, oldest_version


def admitted(updates_at_train: int, version: int, k: int) -> bool:
    """Whether a round sampled with weights `version` may be trained once the
    trainer holds `updates_at_train` updates: its lag is at most k."""
    return updates_at_train - version <= k


def check_oldest(batch: RolloutBatch, updates_at_train: int, k: int) -> None:
    """Admission's bound, per token: no trajectory trains whose oldest sampled
    token (token_version) lags the trainer's `updates_at_train` by more than k.
    Admission at start guarantees it for whole rounds; a round whose tokens came
    from older weights than its version says is a scheduler bug (AssertionError)."""
    oldest = oldest_version(batch)
    if oldest.size and not admitted(updates_at_train, int(oldest.min()), k):
        bad = int(np.argmin(oldest))
        raise AssertionError(f"response {bad}: its oldest token is of version {int(oldest[bad])}, "
                             f"{updates_at_train - int(oldest[bad])} behind the trainer's "
                             f"{updates_at_train} (K = {k})")


def lag_metrics(updates: int, k: int, batches: list[RolloutBatch]) -> dict[str, float]:
    """rollout/policy_lag_* (per response: its oldest sampled token; one without a
    sampled token has none) and rollout/token_lag_* of the batches trained at
    `updates` updates (each carries token_version)."""
    oldest = np.concatenate([oldest_version(b) for b in batches])
    lag = updates - oldest[oldest < np.iinfo(np.int64).max]
    tokens = updates - np.concatenate([b.token_version[b.policy_mask] for b in batches]).astype(np.int64)
    return policy_lag_metrics(lag, k) | policy_lag_metrics(tokens, k, "token")


@dataclass
class Inflight:
    """A round: started (pending), or whole from a checkpoint (saved), or taken (round)."""

    step: int                        # its tag: the step it serves if every step takes one round
    prompt_idx: np.ndarray           # int64 [P]
    sampler_before: dict             # the sampler's state before these prompts were drawn
    version: int                     # the weights it samples with
    pending: Pending | None = None
    saved: tuple[RolloutBatch, RewardResult | None] | None = None  # read from a checkpoint
    round: Round | None = None       # collected and scored
    left: np.ndarray | None = None   # [P] bool its groups not trained yet (None: all; first_finished.py)
