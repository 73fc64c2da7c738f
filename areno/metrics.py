"""The metrics of an optimizer step, declared once, with how each is reduced.

A rank accumulates every device metric of an optimizer step over its
micro-batches and then over the ranks, as its `reduce` says:

  sum         added up (the weighted loss, token and sequence counts)
  token_mean  added up as a sum over loss tokens, divided by `loss_tokens`
              after the step's one device-to-host readback
  max         the largest (ratio_max; grad_norm and lr, equal on every rank)
  host        no device value: the rank computes it on the host after the
              readback (so every rank gets the same)

The trainer reduces the optimizer steps of one areno step by `over_steps`
(mean, last or sum) and logs the `logged` ones under their `key`
(`train/<name>` unless the row names another: the behaviour/proximal
mismatch of decoupled PPO is `offpolicy/*`).
`source` says who produces a metric: `loss` (losses.compute_loss, once per
micro-batch), `batch` (the micro-batch's counts), `optimizer` (once per
optimizer step, after clipping) or `host`.

`LOOP_METRICS` are the asynchronous loop's own (--off-policy-steps K >= 1):
measured by the controller once per step, never on a device.

No torch here: the controller imports this module.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np

Source = Literal["loss", "batch", "optimizer", "host"]
Reduce = Literal["sum", "token_mean", "max", "host"]
OverSteps = Literal["mean", "last", "sum"]


@dataclass(frozen=True)
class Metric:
    """One row of the table: a metric and its reductions."""

    name: str
    source: Source
    reduce: Reduce               # over micro-batches and ranks, within one optimizer step
    over_steps: OverSteps | None = "mean"  # over a step's optimizer steps; None: the rank keeps it
    logged: bool = True          # written to metrics.jsonl under `key`
    help: str = ""
    log_key: str | None = None   # the metrics.jsonl key; None: train/<name>

    @property
    def key(self) -> str:
        return self.log_key or f"train/{self.name}"


# Logged rows first, in the order of their keys in metrics.jsonl.
_ROWS: tuple[Metric, ...] = (
    Metric("loss", "loss", "sum", help="the mini-batch's weighted policy loss (losses.py)"),
    Metric("clip_frac", "loss", "token_mean", help="fraction of loss tokens whose ratio was clipped"),
    Metric("ratio_mean", "loss", "token_mean", help="mean importance ratio exp(logp - old_logp)"),
    Metric("ratio_std", "host", "host", help="std of the ratio, from ratio_sq and ratio_mean"),
    Metric("ratio_max", "loss", "max", help="largest ratio of a loss token"),
    Metric("kl", "loss", "token_mean", help="KL estimate to the reference (0 when off)"),
    Metric("entropy", "loss", "token_mean", help="policy entropy per token (when computed)"),
    Metric("logprob_diff", "loss", "token_mean",
           help="mean |train logp - rollout logp| before the update"),
    Metric("tis_weight", "loss", "token_mean", help="mean truncated-IS weight (1 when off)"),
    Metric("offpolicy_kl", "loss", "token_mean", log_key="offpolicy/kl",
           help="k3 estimate of KL(behaviour || proximal) per loss token: the sampler's "
                "log-probs against the trainer's recomputed ones (0 without "
                "--recompute-logprobs)"),
    Metric("tis_capped_frac", "loss", "token_mean", log_key="offpolicy/tis_capped_frac",
           help="fraction of loss tokens whose proximal/behaviour weight exceeded --tis-cap "
                "and was capped (0 when off or with --is-mode mask)"),
    Metric("is_masked_frac", "loss", "token_mean", log_key="offpolicy/masked_frac",
           help="fraction of loss tokens dropped by --is-mode mask: their weight (at "
                "--is-level) fell outside [--is-mask-low, --tis-cap] (0 unless mask)"),
    Metric("loss_tokens", "loss", "sum", help="tokens in the loss: the token_mean denominator"),
    Metric("grad_norm", "optimizer", "max", help="gradient norm before clipping"),
    Metric("lr", "optimizer", "max", over_steps="last",
           help="learning rate; the last one is what the run continues with"),
    Metric("nan_skipped", "host", "host", over_steps="sum",
           help="1 when the step was skipped for a non-finite loss or grad norm"),
    Metric("ratio_sq", "loss", "token_mean", over_steps=None, logged=False,
           help="mean squared ratio: only an input of ratio_std, never reported"),
    Metric("num_tokens", "batch", "sum", logged=False, help="packed tokens (prompt + response)"),
    Metric("num_seqs", "batch", "sum", logged=False, help="packed sequences"),
    Metric("step", "host", "host", logged=False, help="optimizer steps the rank has taken"),
    Metric("epoch", "host", "host", logged=False, help="PPO epoch of the optimizer step"),
    Metric("minibatch", "host", "host", logged=False, help="mini-batch of the optimizer step"),
    Metric("step_time_s", "host", "host", logged=False, help="the rank's wall time of the step"),
)
METRICS: dict[str, Metric] = {m.name: m for m in _ROWS}

# Derived views of the table, in table order.
LOSS_METRICS: tuple[str, ...] = tuple(m.name for m in _ROWS if m.source == "loss")
DEVICE_SUMS: tuple[str, ...] = tuple(m.name for m in _ROWS if m.reduce in ("sum", "token_mean"))
DEVICE_MAXES: tuple[str, ...] = tuple(m.name for m in _ROWS if m.reduce == "max")
# The stacked vector a rank all-gathers and reads back: sums, then maxima.
DEVICE_METRICS: tuple[str, ...] = DEVICE_SUMS + DEVICE_MAXES
REPORTED: tuple[str, ...] = tuple(m.name for m in _ROWS if m.over_steps is not None)
TRAIN_METRICS: tuple[str, ...] = tuple(m.name for m in _ROWS if m.logged)


def finalize_step(values: dict[str, float]) -> dict[str, float]:
    """Read-back device values of one optimizer step (sums and maxima over its
    micro-batches and ranks) -> what the rank reports: token_mean metrics
    divided by loss_tokens, ratio_std from ratio_sq and ratio_mean, rank-only
    metrics dropped. The rank adds its host metrics to the result."""
    n = max(values.get("loss_tokens", 0.0), 1.0)
    means = {k: (v / n if METRICS[k].reduce == "token_mean" else v) for k, v in values.items()}
    out = {k: v for k, v in means.items() if METRICS[k].over_steps is not None}
    if "ratio_sq" in means and "ratio_mean" in means:  # Var = E[r^2] - E[r]^2, clamped at 0
        out["ratio_std"] = math.sqrt(max(means["ratio_sq"] - means["ratio_mean"] ** 2, 0.0))
    return out


def reduce_opt_steps(opt_steps: list[dict[str, float]]) -> dict[str, float]:
    """The optimizer steps of one areno step -> one value per metric, by over_steps."""
    if not opt_steps:
        return {}
    out = {}
    for k in opt_steps[0]:
        vals = [s[k] for s in opt_steps]
        how = METRICS[k].over_steps
        if how == "last":
            out[k] = vals[-1]
        elif how == "sum":
            out[k] = float(sum(vals))
        else:
            out[k] = float(np.mean(vals))
    return out


def train_metrics(opt_steps: list[dict[str, float]]) -> dict[str, float]:
    """{key: value} of every logged metric (0.0 when no optimizer step ran)."""
    reduced = reduce_opt_steps(opt_steps)
    return {METRICS[k].key: float(reduced.get(k, 0.0)) for k in TRAIN_METRICS}


# -- the asynchronous loop's metrics (--off-policy-steps K >= 1) -----------------
@dataclass(frozen=True)
class LoopMetric:
    """A per-step metric of the asynchronous loop: its metrics.jsonl key, and how
    the step's values (one per sample, or one per wait) become one."""

    key: str
    reduce: Literal["mean", "max", "sum"]
    help: str


# time/<phase> of the waits, in the order `areno plot` draws them with the phases.
WAIT_PHASES: tuple[str, ...] = ("wait_batch", "wait_weights")
LOOP_METRICS: tuple[LoopMetric, ...] = (
    LoopMetric("rollout/policy_lag_mean", "mean",
               "weight versions between the policy that sampled a trained sample's oldest "
               "token and the one it updates, averaged over the step's samples (0 when synchronous)"),
    LoopMetric("rollout/policy_lag_max", "max", "the step's largest policy lag (<= K: admission's bound)"),
    LoopMetric("rollout/policy_lag_<l>", "sum",
               "samples the step trained at policy lag l, one key for each l in 0..K: summed "
               "over the steps, the run's lag histogram"),
    LoopMetric("rollout/token_lag_mean", "mean",
               "the policy lag of each sampled token the step trained (its own version: after "
               "an in-flight weight update a trajectory's tokens span versions), averaged"),
    LoopMetric("rollout/token_lag_max", "max", "the step's largest token lag (<= the policy lag)"),
    LoopMetric("rollout/token_lag_<l>", "sum",
               "sampled tokens the step trained at lag l, one key for each l in 0..K: summed "
               "over the steps, the run's per-token lag histogram"),
    LoopMetric("time/wait_batch", "sum",
               "seconds the training ranks waited for the step's batch from the engines"),
    LoopMetric("time/wait_weights", "sum",
               "seconds the rollout engines waited for new weights (at most K versions behind)"),
    LoopMetric("rollout/inflight_loads", "sum",
               "--partial-rollouts: weight versions the engines loaded between two decode steps "
               "of the step's rounds (summed over the engines)"),
    LoopMetric("rollout/inflight_checks", "sum",
               "--partial-rollouts: of those loads, the ones whose exact fingerprint was checked "
               "(every one, on an engine that reports a fingerprint)"),
    LoopMetric("rollout/tail_filled", "sum",
               "--partial-rollouts: sequences of the step's rounds that an engine started inside "
               "the previous round's generation loop, as its tail drained (tail fill, vLLM)"),
    LoopMetric("rollout/cut_samples", "sum",
               "--cut-at-deadline: samples the engines ended at their group's deadline (finish length), "
               "so that the trainer did not wait for them"),
    LoopMetric("rollout/groups_ahead", "sum",
               "--partial-rollouts: groups the step trained from rounds other than the oldest in flight "
               "(their groups finished first: first_finished.py)"),
)
LOOP: dict[str, LoopMetric] = {m.key: m for m in LOOP_METRICS}


def lag_count_key(lag: int, unit: str = "policy") -> str:
    """The key of rollout/<unit>_lag_<l> (unit: policy, per sample; token):
    samples (tokens) trained at lag l."""
    return f"rollout/{unit}_lag_{lag}"


def policy_lag_metrics(lags: Sequence[int] | np.ndarray, k: int = 0, unit: str = "policy") -> dict[str, float]:
    """rollout/<unit>_lag_mean, _max and the count at each lag 0..max(k, the largest)
    of one step: lags[i] = the trainer's weight version when it trains on sample
    (unit "policy") or sampled token (unit "token") i minus the version that sampled it."""
    a = np.asarray(lags, dtype=np.int64)
    counts = np.bincount(a, minlength=k + 1) if a.size else np.zeros(k + 1, dtype=np.int64)
    return {f"rollout/{unit}_lag_mean": float(a.mean()) if a.size else 0.0,
            f"rollout/{unit}_lag_max": float(a.max()) if a.size else 0.0,
            **{lag_count_key(lag, unit): float(c) for lag, c in enumerate(counts)}}


# What an engine's rollout reply counts under --partial-rollouts, summed over the
# engines (PendingRollout.collect) and over a step's rounds (inflight_metrics).
INFLIGHT_COUNTS = ("inflight_loads", "inflight_checks", "tail_filled", "cut_samples")


def inflight_metrics(infos: Sequence[dict]) -> dict[str, float]:
    """rollout/inflight_loads, _checks, tail_filled and cut_samples of one step
    (--partial-rollouts): summed over its rounds' engine replies (PendingRollout.collect's info)."""
    return {f"rollout/{k}": float(sum(i.get(k, 0) for i in infos)) for k in INFLIGHT_COUNTS}


def groups_ahead_metrics(ahead: int) -> dict[str, float]:
    """rollout/groups_ahead of one step (--partial-rollouts): its groups from rounds
    other than the oldest in flight."""
    return {"rollout/groups_ahead": float(ahead)}


def wait_metrics(wait_batch_s: Sequence[float], wait_weights_s: Sequence[float]) -> dict[str, float]:
    """time/wait_batch and time/wait_weights of one step: every wait summed."""
    return {"time/wait_batch": float(sum(wait_batch_s)),
            "time/wait_weights": float(sum(wait_weights_s))}


# -- dynamic sampling (--dynamic-sampling), once per step, on the controller -------
SAMPLING_METRICS: dict[str, str] = {
    "sampling/rounds": "rollouts of --batch-size prompts generated for the step (1 when off)",
    "sampling/groups_kept": "groups the step trains on (--batch-size unless the bound stopped it)",
    "sampling/groups_dropped": "groups generated but not trained: uninformative, or surplus past "
                               "--batch-size (0 when off)",
    "sampling/gen_tokens_per_kept_group": "response tokens generated over all rounds / groups kept",
    "sampling/bound_hit": "1 when --max-sampling-rounds ended the step with fewer than "
                          "--batch-size informative groups (it trains on those)",
    "sampling/reward_generated": "mean reward of every generated sample, dropped groups too: "
                                 "the policy's reward on fresh prompts (reward/mean is the "
                                 "trained groups', which leave out the all-right ones)",
}


def sampling_metrics(rounds: int, kept: int, generated_groups: int, gen_tokens: int,
                     bound_hit: bool, generated_reward: float) -> dict[str, float]:
    """The SAMPLING_METRICS of one step, in the table's order."""
    values = (rounds, kept, generated_groups - kept, gen_tokens / kept if kept else gen_tokens,
              bound_hit, generated_reward)
    return {k: float(v) for k, v in zip(SAMPLING_METRICS, values, strict=True)}


# -- multi-turn environments (--env-path), once per step (every round it generated), on the controller
ENV_METRICS: dict[str, str] = {
    "env/turns_mean": "completions per trajectory, mean",
    "env/turn_limit": "trajectories ended by --max-turns",
    "env/token_limit": "trajectories ended by the token budget (--max-trajectory-tokens or the "
                       "context): an observation that would leave no room for one more sampled token",
    "env/long_observations": "of those, observations longer than all the room left, refused before "
                             "they were tokenized (a huge observation costs no time)",
    "env/engine_idle_s": "seconds the engines had nothing to generate (every trajectory at its env)",
    "env/generate_s": "seconds inside the engines' generate calls",
    "env/rounds": "generate calls",
}


AGENT_METRICS: dict[str, str] = {
    "agent/calls": "requests the agents sent to the gateway",
    "agent/branches": "times an agent's conversation did not extend its trajectory (a history edit): "
                      "the turns after the point it still extends are not trained",
    "agent/dropped_turns": "sampled turns those branches left out of training",
    "agent/refused": "calls answered without sampling: a limit reached, or a request refused (400)",
}


def agent_metrics(calls: int, branches: int, dropped_turns: int, refused: int) -> dict[str, float]:
    """The AGENT_METRICS of one agent rollout, in the table's order."""
    values = (calls, branches, dropped_turns, refused)
    return {k: float(v) for k, v in zip(AGENT_METRICS, values, strict=True)}


def rounds_metrics(rounds: list[tuple[dict[str, float], int]]) -> dict[str, float]:
    """The ENV/AGENT metrics of a step's rounds (dynamic sampling's refills and
    dropped groups too: what was generated) from (a round's metrics, its
    trajectories): env/turns_mean weighted by trajectories over the rounds that
    report it (a --partial-rollouts take of parts already reported reports
    none), the rest (counts and seconds) summed, a key some round lacks
    counting 0 there."""
    keys = [k for k in (*ENV_METRICS, *AGENT_METRICS) if any(k in m for m, _ in rounds)]
    out = {k: float(sum(m.get(k, 0.0) for m, _ in rounds)) for k in keys}
    if "env/turns_mean" in out:
        turns = [(m["env/turns_mean"], t) for m, t in rounds if "env/turns_mean" in m]
        n = sum(t for _, t in turns)
        out["env/turns_mean"] = sum(x * t for x, t in turns) / n if n else 0.0
    return out


def env_metrics(turns_mean: float, turn_limit: int, token_limit: int, long_observations: int,
                engine_idle_s: float, generate_s: float, rounds: int) -> dict[str, float]:
    """The ENV_METRICS of one multi-turn rollout, in the table's order."""
    values = (turns_mean, turn_limit, token_limit, long_observations, engine_idle_s, generate_s, rounds)
    return {k: float(v) for k, v in zip(ENV_METRICS, values, strict=True)}
