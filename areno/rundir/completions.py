"""A few of each step's completions, as the policy wrote them (--log-completions N):
the first thing to look at when a run does not learn. N responses are picked
by index, spread over the batch (so from different prompts); only those N are
decoded (one tokenizer call), so the step pays nothing per token of the rest."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from areno.rollout.batch import FINISH_REASONS, RolloutBatch, csr_take, turn_segments

FILE = "completions.jsonl"  # in the run dir, one JSON object per sampled completion


def sample_indices(num_responses: int, n: int, step: int) -> np.ndarray:
    """[min(n, R)] int64, distinct: n of the step's R responses evenly spaced,
    shifted by the step so that every position in a group comes up over steps."""
    k = min(n, num_responses)
    return (np.arange(k, dtype=np.int64) * num_responses // max(k, 1) + step) % max(num_responses, 1)


def completion_records(step: int, n: int, tokenizer: Any, prompt_texts: list[str] | None,
                       prompt_idx: np.ndarray, batch: RolloutBatch, rewards: np.ndarray,
                       advantages: np.ndarray) -> list[dict[str, Any]]:
    """n records {step, sample, prompt, completion, reward, advantage, finish_reason}.
    rewards: [R] float32 (NaN: not scored -> null); advantages: [R] float32.
    prompt_texts None: each prompt is the batch's own, decoded (an agent's
    conversation chose it, not the dataset row's rendering)."""
    idx = sample_indices(batch.num_responses, n, step)
    if not idx.size:
        return []
    if prompt_texts is None:
        groups = np.unique(batch.group_index[idx])
        po = batch.prompt_offsets
        shown = tokenizer.batch_decode([batch.prompt_ids[po[g]:po[g + 1]].tolist() for g in groups.tolist()])
        prompt_texts, prompt_idx = [""] * batch.num_prompts, np.arange(batch.num_prompts)
        for g, text in zip(groups.tolist(), shown):
            prompt_texts[g] = text
    if batch.response_mask is not None:
        texts = trajectory_texts(tokenizer, batch, idx)
    else:
        ids, offsets = csr_take(batch.response_ids, batch.response_offsets, idx)
        texts = tokenizer.batch_decode([ids[a:b].tolist() for a, b in zip(offsets[:-1], offsets[1:])],
                                       skip_special_tokens=True)
    groups = batch.group_index[idx]
    out = []
    for i, j in enumerate(idx.tolist()):
        r = float(rewards[j])
        out.append({"step": step, "sample": j, "prompt": prompt_texts[int(prompt_idx[groups[i]])],
                    "completion": texts[i], "reward": r if math.isfinite(r) else None,
                    "advantage": float(advantages[j]),
                    "finish_reason": FINISH_REASONS[int(batch.finish_reason[j])]})
    return out


def trajectory_texts(tokenizer: Any, batch: RolloutBatch, idx: np.ndarray) -> list[str]:
    """Multi-turn responses idx as text with the turns told apart: the policy's
    turns as written, each observation as [env: ...]. One decode call for all."""
    segs = [turn_segments(batch, j) for j in idx.tolist()]
    texts = iter(tokenizer.batch_decode([a.tolist() for s in segs for _, a in s], skip_special_tokens=True))
    out = []
    for s in segs:
        parts = [(m, next(texts)) for m, _ in s]
        out.append(" ".join(t.strip() if m else "[env: " + " ".join(t.split()) + "]" for m, t in parts))
    return out
