"""Every token knows the weight version that sampled it: RolloutBatch.token_version
survives every transform of the flat layout, a checkpoint of the rounds in
flight, and the scheduler counts the lag per token and bounds a trajectory's
oldest token by K."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import numpy as np
import pytest

from areno.data.sampler import PromptSampler
from areno.rewards import RewardCounts, RewardResult
from areno.rollout.batch import RolloutBatch, oldest_version, with_version
from areno.inflight_file import load_inflight
from areno.scheduler import Inflight, Rollouts
from areno.timing import PhaseTimer
from tests.helpers import random_batch


def _versioned(seed: int, base: int = 3) -> RolloutBatch:
    """A random batch whose tokens span versions base..base+2 (a swap mid-response)."""
    b = random_batch(seed, num_prompts=5)
    rng = np.random.default_rng(seed + 100)
    v = (base + rng.integers(0, 3, b.num_response_tokens)).astype(np.int32)
    return replace(b, token_version=v)


def _per_response(b: RolloutBatch) -> list[list[int]]:
    return [b.token_version[b.response_offsets[i]:b.response_offsets[i + 1]].tolist()
            for i in range(b.num_responses)]


def test_token_version_follows_its_token_through_take_groups_and_merge_parts() -> None:
    a, b = _versioned(0), _versioned(1, base=7)
    sub, resp = a.take_groups(np.array([3, 0]))
    assert _per_response(sub) == [_per_response(a)[i] for i in resp.tolist()]
    merged, perm = RolloutBatch.merge_parts([a, b], [np.arange(5) * 2, np.arange(5) * 2 + 1])
    both = _per_response(a) + _per_response(b)
    assert _per_response(merged) == [both[i] for i in perm.tolist()]
    assert merged.token_version.dtype == np.int32
    with pytest.raises(ValueError, match="some parts carry token_version"):
        RolloutBatch.merge_parts([a, replace(b, token_version=None)], [np.arange(5), np.arange(5) + 5])
    with pytest.raises(ValueError, match="token_version: expected dtype int32"):
        replace(a, token_version=a.token_version.astype(np.int64))


def test_oldest_version_skips_observation_tokens_and_empty_responses() -> None:
    b = RolloutBatch(
        prompt_ids=np.array([1, 2], np.int32), prompt_offsets=np.array([0, 1, 2]),
        response_ids=np.arange(6, dtype=np.int32), response_offsets=np.array([0, 3, 3, 6]),
        response_logprobs=np.zeros(6, np.float32), group_index=np.array([0, 0, 1]),
        finish_reason=np.zeros(3, np.uint8), response_mask=np.array([1, 1, 1, 0, 1, 1], np.uint8),
        token_version=np.array([4, 5, 5, 2, 6, 7], np.int32))
    # response 2's version-2 token is an observation: its oldest sampled one is 6
    assert oldest_version(b).tolist() == [4, np.iinfo(np.int64).max, 6]
    stamped = with_version(replace(b, token_version=None), 9)
    assert stamped.token_version.tolist() == [9] * 6 and with_version(b, 9) is b


def _run(k: int, total_steps: int) -> SimpleNamespace:
    return SimpleNamespace(cfg=SimpleNamespace(off_policy_steps=k, dynamic_sampling="off", batch_size=5),
                           sampler=PromptSampler(50, 5, seed=0), total_steps=total_steps,
                           rows=None, prompts=None)


def _scored(b: RolloutBatch) -> RewardResult:
    return RewardResult(np.ones(b.num_responses, np.float32), np.ones(b.num_responses, bool), RewardCounts())


def _saved(step: int, version: int, batch: RolloutBatch) -> Inflight:
    return Inflight(step, np.arange(batch.num_prompts, dtype=np.int64), {}, version,
                    saved=(batch, _scored(batch)))


def test_checkpoint_of_rounds_in_flight_keeps_every_tokens_version(tmp_path) -> None:
    a = _versioned(2)
    r = Rollouts(_run(2, 10), SimpleNamespace(background=True), 5, [_saved(6, 3, a)])
    r.checkpoint_state(tmp_path)
    (back,) = load_inflight(tmp_path, expected=1)
    np.testing.assert_array_equal(back.saved[0].token_version, a.token_version)


def test_the_lag_is_counted_per_token_and_per_trajectory_by_its_oldest_token() -> None:
    # Trainer at version 5, K = 2: a round started at 3 whose tokens span 3..5.
    a = _versioned(3)
    r = Rollouts(_run(2, 4), SimpleNamespace(background=True), 5, [_saved(4, 3, a)])
    filled, metrics = r.next_batch(4, PhaseTimer())
    tok_lag = 5 - a.token_version.astype(np.int64)
    assert metrics["rollout/token_lag_mean"] == pytest.approx(tok_lag.mean())
    assert metrics["rollout/token_lag_max"] == tok_lag.max() == 2
    assert [metrics[f"rollout/token_lag_{lag}"] for lag in range(3)] == np.bincount(tok_lag).tolist()
    oldest = 5 - np.array([min(v) for v in _per_response(a)])
    assert [metrics[f"rollout/policy_lag_{lag}"] for lag in range(3)] == \
        np.bincount(oldest, minlength=3).tolist()


def test_a_round_without_versions_is_stamped_with_its_own() -> None:
    a = random_batch(4, num_prompts=5)
    r = Rollouts(_run(1, 4), SimpleNamespace(background=True), 5, [_saved(4, 4, a)])
    filled, metrics = r.next_batch(4, PhaseTimer())
    assert metrics["rollout/token_lag_1"] == a.num_response_tokens and metrics["rollout/token_lag_mean"] == 1


def test_a_trajectory_whose_oldest_token_lags_more_than_k_is_not_trained() -> None:
    # The round's version says 4 (lag 1 <= K), but some tokens came from version 3.
    a = _versioned(5, base=3)
    r = Rollouts(_run(1, 4), SimpleNamespace(background=True), 5, [_saved(4, 4, a)])
    with pytest.raises(AssertionError, match="oldest token is of version 3, 2 behind"):
        r.next_batch(4, PhaseTimer())
