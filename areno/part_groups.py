"""A round in flight as groups (--partial-rollouts, first_finished.py): when each
of its groups came complete, and any of them taken out of the streamed parts
as one batch with their rewards, the rest left for a later step. Parts hold
whole groups (an engine sends a group once all its samples are done), so a
group lies in exactly one part."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np

from areno.rewards import RewardCounts, RewardResult
from areno.rollout.batch import RolloutBatch


def arrival(positions: list[np.ndarray], arrived: list[float], num_groups: int) -> np.ndarray:
    """Each kept part's prompt positions ([p_i] int64) and the time it was kept ->
    [num_groups] float64: when each group came complete (inf: not yet)."""
    out = np.full(num_groups, np.inf)
    for q, t in zip(positions, arrived):
        out[q] = t
    return out


def groups_of_parts(sink: Any, groups: np.ndarray, counted: set[int]) -> tuple[RolloutBatch, RewardResult | None]:
    """The groups at prompt positions `groups` ([g] int64, each complete) of a
    sink's parts (fleet/rollouts.Parts: .parts, .positions, .result(i)) -> (their
    batch, group p = groups[p]; their rewards, None when a part was not scored
    there). counted: the parts whose reward counts an earlier take reported (a
    part's failures are counted once; updated)."""
    groups = np.asarray(groups, dtype=np.int64)
    need = [i for i, q in enumerate(sink.positions) if np.isin(q, groups).any()]
    qs = [sink.positions[i] for i in need]
    have = np.sort(np.concatenate(qs))
    if not np.isin(groups, have).all():
        raise ValueError(f"groups {np.setdiff1d(groups, have).tolist()} have not arrived")
    batch, perm = RolloutBatch.merge_parts([sink.parts[i] for i in need],
                                           [np.searchsorted(have, q) for q in qs])
    sub, resp = batch.take_groups(np.searchsorted(have, groups))
    results = [sink.result(i) for i in need]
    if any(r is None for r in results):
        return sub, None
    results = [r if i not in counted else replace(r, counts=RewardCounts(), messages=())
               for i, r in zip(need, results)]
    counted.update(need)
    merged = RewardResult.concat(results)
    return sub, merged.take(perm[resp])
