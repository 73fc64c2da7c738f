"""Held-out evaluation through the run's scheduler: the eval set is one round
of the same producer as training (producers.py), so it samples on the same
engines, single-turn or multi-turn (--env-path: greedy trajectories through the
episode driver, scored by the environment).

  eval/pass@1       fraction of prompts whose greedy completion scores >= 1
  eval/reward@1     mean reward of the greedy completions
  eval/mean@k       mean reward over k samples per prompt at the training
                    temperature (with --eval-n k > 1)
  eval/pass@k       fraction of prompts with at least one of k samples >= 1
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Callable

import numpy as np

from areno.rollout.engine import SamplingConfig


def evaluate(run_round: Callable[[Any, int, SamplingConfig], Any], data: Any, sampling: SamplingConfig,
             k: int = 1) -> dict[str, float]:
    """Greedy pass@1 (and mean@k / pass@k for k > 1) on every prompt of `data`
    (producers.Data); run_round(data, n, sampling) -> the scored dynsample.Round."""
    greedy = replace(sampling, temperature=0.0, top_p=1.0, top_k=-1)
    num = len(data.prompts)
    r = run_round(data, 1, greedy).scored
    rewards = np.where(r.valid, r.rewards, 0.0)
    out = {
        "eval/pass@1": float(np.mean(rewards >= 1.0)),
        "eval/reward@1": float(np.mean(rewards)),
        "eval/prompts": float(num),
    }
    if k > 1:
        rnd = run_round(data, k, sampling)
        rewards = np.where(rnd.scored.valid, rnd.scored.rewards, 0.0)
        passed = np.zeros(num, dtype=bool)
        np.logical_or.at(passed, rnd.batch.group_index, rewards >= 1.0)
        out[f"eval/mean@{k}"] = float(rewards.mean())
        out[f"eval/pass@{k}"] = float(passed.mean())
    return out
