"""Held-out evaluation through the rollout engine and the reward plugin.

  eval/pass@1       fraction of prompts whose greedy completion scores >= 1
  eval/reward@1     mean reward of the greedy completions
  eval/mean@k       mean reward over k samples per prompt at the training
                    temperature (with --eval-n k > 1)
  eval/pass@k       fraction of prompts with at least one of k samples >= 1
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np

from areno.data.prompts import PromptSet, select
from areno.rewards import RewardScorer, reward_records
from areno.rollout.batch import decode_completions
from areno.rollout.engine import SamplingConfig
from areno.data.rows import RowSet


def _score(engine: Any, tokenizer: Any, scorer: RewardScorer, rows: RowSet, prompts: PromptSet,
           n: int, sampling: SamplingConfig) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """-> rewards [N] (NaN where skipped), valid [N], group_index [N]."""
    idx = np.arange(len(prompts), dtype=np.int64)
    ids, offsets = select(prompts, idx)
    batch = engine.generate(ids, offsets, n, sampling)
    completions = decode_completions(tokenizer, batch)
    scored = scorer.score(reward_records(rows, prompts, idx, batch, completions))
    return scored.rewards, scored.valid, batch.group_index


def evaluate(engine: Any, tokenizer: Any, scorer: RewardScorer, rows: RowSet, prompts: PromptSet,
             sampling: SamplingConfig, k: int = 1) -> dict[str, float]:
    """Greedy pass@1 (and mean@k / pass@k for k > 1) on every prompt of `prompts`."""
    greedy = replace(sampling, temperature=0.0, top_p=1.0, top_k=-1)
    r, valid, _ = _score(engine, tokenizer, scorer, rows, prompts, 1, greedy)
    out = {
        "eval/pass@1": float(np.mean(np.where(valid, r, 0.0) >= 1.0)),
        "eval/reward@1": float(np.mean(np.where(valid, r, 0.0))),
        "eval/prompts": float(len(prompts)),
    }
    if k > 1:
        r, valid, g = _score(engine, tokenizer, scorer, rows, prompts, k, sampling)
        r = np.where(valid, r, 0.0)
        passed = np.zeros(len(prompts), dtype=bool)
        np.logical_or.at(passed, g, r >= 1.0)
        out[f"eval/mean@{k}"] = float(r.mean())
        out[f"eval/pass@{k}"] = float(passed.mean())
    return out
