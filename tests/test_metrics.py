"""The metric table (areno/metrics.py): every metric a step produces is declared
once, and each reduction does what the table says."""

from __future__ import annotations

import math
import subprocess
import sys

import numpy as np
import pytest
import torch
from helpers import random_batch

from areno.backend.step import ACCUMULATED, accumulate
from areno.losses import LossConfig, LossInputs, compute_loss
from areno.metrics import (
    DEVICE_MAXES,
    DEVICE_METRICS,
    DEVICE_SUMS,
    LOOP,
    groups_ahead_metrics,
    LOOP_METRICS,
    LOSS_METRICS,
    METRICS,
    REPORTED,
    TRAIN_METRICS,
    WAIT_PHASES,
    finalize_step,
    inflight_metrics,
    lag_count_key,
    policy_lag_metrics,
    reduce_opt_steps,
    rounds_metrics,
    train_metrics,
    wait_metrics,
)
from areno.rewards import RewardResult
from areno.rewards.plugin import RewardCounts
from areno.trainer import StepResult, step_metrics


def _inputs(with_optional: bool) -> LossInputs:
    lp = torch.tensor([-1.0, -2.0, -0.5])
    opt = dict(rollout_logprobs=lp - 0.1, ref_logprobs=lp + 0.2, entropy=torch.ones(3)) \
        if with_optional else {}
    return LossInputs(logprobs=lp, old_logprobs=lp - 0.05, advantages=torch.tensor([1.0, 1.0, -1.0]),
                      loss_mask=torch.tensor([True, True, False]), seq_weights=torch.tensor([0.5]),
                      seq_index=torch.zeros(3, dtype=torch.long), **opt)


@pytest.mark.parametrize("with_optional", [False, True])
def test_compute_loss_emits_exactly_the_tables_loss_metrics(with_optional: bool) -> None:
    cfg = LossConfig(kl_coef=0.1, tis_cap=2.0) if with_optional else LossConfig()
    out = compute_loss(_inputs(with_optional), cfg)
    assert set(out.metrics) == set(LOSS_METRICS)


def test_table_is_consistent() -> None:
    assert set(DEVICE_SUMS).isdisjoint(DEVICE_MAXES)
    assert DEVICE_METRICS == DEVICE_SUMS + DEVICE_MAXES
    for name, m in METRICS.items():
        assert m.name == name and m.help, name
        assert (m.source == "host") == (m.reduce == "host"), name  # host values never reach the device
        assert m.over_steps is not None or not m.logged, name      # a rank-only metric is not logged
    # what the rank accumulates per micro-batch, plus what the optimizer sets once
    assert set(ACCUMULATED) | {"grad_norm", "lr"} == set(DEVICE_METRICS)
    assert set(TRAIN_METRICS) <= set(REPORTED)
    keys = [METRICS[k].key for k in TRAIN_METRICS]
    assert len(set(keys)) == len(keys)  # one metrics.jsonl key per logged metric


def test_metrics_module_needs_no_torch() -> None:
    code = "import sys, areno.metrics; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.stdout.strip() == "False", out.stdout + out.stderr


def test_accumulate_sums_and_takes_maxima_as_declared() -> None:
    micro = [{k: torch.tensor(float(i + 1)) for k in LOSS_METRICS} for i in range(3)]
    micro[1]["ratio_max"] = torch.tensor(7.0)
    acc = {k: torch.zeros(()) for k in ACCUMULATED}
    for mb in micro:
        accumulate(acc, mb)
    for k in LOSS_METRICS:
        want = 7.0 if METRICS[k].reduce == "max" else 1.0 + 2.0 + 3.0
        assert acc[k].item() == want, k


def test_finalize_step() -> None:
    """(moved from test_stats: finalize_loss_metrics is now metrics.finalize_step)"""
    out = finalize_step(
        {"loss_tokens": 4.0, "clip_frac": 1.0, "ratio_mean": 4.4, "ratio_sq": 5.0, "ratio_max": 1.3, "loss": -0.2}
    )
    assert out["clip_frac"] == 0.25 and out["ratio_mean"] == pytest.approx(1.1)
    assert out["ratio_std"] == pytest.approx(math.sqrt(5.0 / 4 - 1.21))
    assert out["ratio_max"] == 1.3 and out["loss"] == -0.2


def test_finalize_step_divides_token_means_only_and_drops_rank_only_metrics() -> None:
    values = {k: 8.0 for k in DEVICE_METRICS}
    values["loss_tokens"] = 4.0
    out = finalize_step(values)
    assert "ratio_sq" not in out and out.keys() == set(DEVICE_METRICS) - {"ratio_sq"} | {"ratio_std"}
    for k in DEVICE_METRICS:
        if k == "ratio_sq":
            continue
        want = 2.0 if METRICS[k].reduce == "token_mean" else values[k]
        assert out[k] == want, k
    assert out["ratio_std"] == 0.0  # E[r^2] - E[r]^2 = 2 - 4 < 0, clamped
    assert finalize_step({"loss_tokens": 0.0, "kl": 3.0})["kl"] == 3.0  # no loss token: / 1


def test_reduce_opt_steps_by_over_steps() -> None:
    steps = [{k: float(i) for k in REPORTED} for i in (1, 2, 4)]
    out = reduce_opt_steps(steps)
    for k in REPORTED:
        want = {"mean": 7.0 / 3, "last": 4.0, "sum": 7.0}[METRICS[k].over_steps]
        assert out[k] == pytest.approx(want, rel=1e-15), k
    assert out["lr"] == 4.0 and out["nan_skipped"] == 7.0 and out["loss"] == pytest.approx(7.0 / 3)
    assert reduce_opt_steps([]) == {}


def test_train_metrics_logs_every_train_metric_in_table_order() -> None:
    keys = [METRICS[k].key for k in TRAIN_METRICS]
    assert keys[0] == "train/loss" and "offpolicy/kl" in keys  # train/<name> unless the row says
    assert list(train_metrics([])) == keys
    assert set(train_metrics([]).values()) == {0.0}  # no optimizer step: all zero
    one = train_metrics([{k: 2.0 for k in REPORTED}])
    assert list(one) == keys and set(one.values()) == {2.0}


def test_loop_metrics_are_declared_once_with_their_reductions() -> None:
    keys = [m.key for m in LOOP_METRICS]
    assert keys == ["rollout/policy_lag_mean", "rollout/policy_lag_max", "rollout/policy_lag_<l>",
                    "rollout/token_lag_mean", "rollout/token_lag_max", "rollout/token_lag_<l>",
                    "time/wait_batch", "time/wait_weights", "rollout/inflight_loads",
                    "rollout/inflight_checks", "rollout/tail_filled", "rollout/cut_samples", "rollout/groups_ahead"]
    assert set(keys).isdisjoint(METRICS[k].key for k in TRAIN_METRICS)
    assert all(m.help for m in LOOP_METRICS)
    assert [f"time/{p}" for p in WAIT_PHASES] == keys[6:8]
    # The distribution, not only the maximum: samples per lag 0..K (issue 27).
    assert policy_lag_metrics([0, 2, 1, 1], k=3) == {
        "rollout/policy_lag_mean": 1.0, "rollout/policy_lag_max": 2.0, "rollout/policy_lag_0": 1.0,
        "rollout/policy_lag_1": 2.0, "rollout/policy_lag_2": 1.0, "rollout/policy_lag_3": 0.0}
    assert policy_lag_metrics([], k=1) == {"rollout/policy_lag_mean": 0.0, "rollout/policy_lag_max": 0.0,
                                           "rollout/policy_lag_0": 0.0, "rollout/policy_lag_1": 0.0}
    assert wait_metrics([0.5, 0.25], []) == {"time/wait_batch": 0.75, "time/wait_weights": 0.0}
    fixed = set(policy_lag_metrics([1])) | set(policy_lag_metrics([1], unit="token")) | \
        set(wait_metrics([], [])) | set(inflight_metrics([])) | set(groups_ahead_metrics(0))
    assert inflight_metrics([{"inflight_loads": 2, "inflight_checks": 2}, {"tail_filled": 8, "cut_samples": 3}]) == {
        "rollout/inflight_loads": 2.0, "rollout/inflight_checks": 2.0, "rollout/tail_filled": 8.0,
        "rollout/cut_samples": 3.0}
    counts = {lag_count_key(lag, u) for lag in (0, 1) for u in ("policy", "token")}
    assert fixed - counts | {"rollout/policy_lag_<l>", "rollout/token_lag_<l>"} == set(LOOP)
    from areno.rundir.reporting import PHASES

    assert set(WAIT_PHASES) <= set(PHASES)  # areno plot draws them with the phases


def test_step_metrics_come_from_the_step_result_alone() -> None:
    batch = random_batch(seed=0)
    n = batch.num_responses
    scored = RewardResult(rewards=np.linspace(0.0, 1.5, n).astype(np.float32),
                          valid=np.ones(n, dtype=bool), counts=RewardCounts())
    res = StepResult(batch=batch, scored=scored, prompt_idx=np.arange(batch.num_prompts),
                     pack_tokens=10, rank_imbalance=1.25, zero_var_groups=2,
                     opt_steps=[{k: 1.0 for k in REPORTED}, {k: 3.0 for k in REPORTED}],
                     times={"rollout": 0.5}, elapsed=2.0, data_epoch=1,
                     backend_perf={"perf/train_tokens_per_s": 5.0})
    m = step_metrics(res)
    assert m["train/loss"] == 2.0 and m["train/lr"] == 3.0 and m["train/nan_skipped"] == 4.0
    assert m["batch/pack_tokens"] == 10.0 and m["batch/rank_imbalance"] == 1.25
    assert m["batch/zero_var_groups"] == 2.0 and m["data/epoch"] == 1.0
    assert m["time/rollout"] == 0.5 and m["time/step"] == 2.0
    assert list(m)[-2:] == ["data/prompt_hash", "perf/train_tokens_per_s"]
    assert all(isinstance(v, float) and math.isfinite(v) for v in m.values())


def test_a_steps_turns_mean_weights_only_the_takes_that_report_it():
    """rounds_metrics: a --partial-rollouts take of parts an earlier take reported
    carries no env/* (its counts were counted once): it neither dilutes turns_mean
    nor adds to the sums."""
    a = {"env/turns_mean": 2.0, "env/turn_limit": 1.0}
    b = {"env/turns_mean": 1.0, "env/turn_limit": 2.0}
    out = rounds_metrics([(a, 8), ({}, 4), (b, 8)])
    assert out == {"env/turns_mean": 1.5, "env/turn_limit": 3.0}
