"""Near-limit references: the host functions written with the fewest passes numpy
allows over the arrays' sizes, so a ratio against them says how far areno's
functions are from what their inputs and outputs cost.

Rules they keep: one allocation per output array; one np.repeat or cumsum per
transform; no index array over all L packed positions where a boolean mask or
a shifted copy does; no Python loop over sequences or tokens; no input checks.
They handle the layout the benchmark feeds them (every non-empty response
packed, in order, single-turn) and compute exactly what areno computes
(checked by listref's compare_* before timing).

  nl_advantages  GRPO group advantages: 3 bincounts over N, one exact
                 constant-group test (a representative per group, one compare).
  nl_pack        the packed TrainPack fields: targets are the response tokens
                 (a masked store) and the prompt's tokens 1..p-1 (a gather over
                 the prompt positions only); input_ids are the targets shifted
                 by one (one copy) with each sequence's first prompt token.
  nl_padded      the [S, Lmax] padded fields straight from the batch: the
                 masks from broadcast compares, the same stores into the grid.
"""

from __future__ import annotations

import numpy as np
import torch

from areno.pack import runs_index
from areno.rollout.batch import RolloutBatch


def nl_advantages(rewards: np.ndarray, group_index: np.ndarray, num_groups: int,
                  eps: float = 1e-6) -> np.ndarray:
    """[N] float64 rewards, [N] int64 group ids -> [N] float32 GRPO advantages."""
    g, G = group_index, num_groups
    count = np.bincount(g, minlength=G).astype(np.float64)
    mean = np.bincount(g, weights=rewards, minlength=G) / np.maximum(count, 1.0)
    centered = rewards - mean[g]
    var = np.bincount(g, weights=centered * centered, minlength=G) / np.maximum(count - 1.0, 1.0)
    rep = np.empty(G)
    rep[g] = rewards  # any member; the group is constant iff every member equals it
    differs = np.bincount(g[rewards != rep[g]], minlength=G)
    scale = 1.0 / (np.sqrt(var) + eps)
    scale[(differs == 0) | (count <= 1.0)] = 0.0
    return (centered * scale[g]).astype(np.float32)


def _geometry(b: RolloutBatch) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """-> (order [S], prompt lengths [S], response lengths [S], prompt starts [S])."""
    r_all = np.diff(b.response_offsets)
    order = np.flatnonzero(r_all > 0)
    g = b.group_index[order]
    return order, np.diff(b.prompt_offsets)[g], r_all[order], b.prompt_offsets[g]


def nl_pack(b: RolloutBatch, adv: np.ndarray) -> dict[str, torch.Tensor]:
    """The packed TrainPack fields of every non-empty response, in order."""
    order, p, r, a = _geometry(b)
    S = order.size
    seq = p + r - 1
    cu = np.zeros(S + 1, dtype=np.int64)
    np.cumsum(seq, out=cu[1:])
    runs = np.stack([p - 1, r], axis=1).reshape(-1)
    loss_mask = np.repeat(np.tile(np.array([False, True]), S), runs)
    targets = np.empty(loss_mask.size, dtype=np.int32)
    targets[loss_mask] = b.response_ids
    targets[~loss_mask] = b.prompt_ids[runs_index(a + 1, p - 1, int(p.sum()) - S)]
    input_ids = np.empty_like(targets)
    input_ids[1:] = targets[:-1]
    input_ids[cu[:-1]] = b.prompt_ids[a]
    position_ids = np.ones(loss_mask.size, dtype=np.int32)
    position_ids[cu[1:-1]] = 1 - seq[:-1]
    position_ids[0] = 0
    np.cumsum(position_ids, out=position_ids)
    adv_runs = np.zeros(2 * S, dtype=np.float32)
    adv_runs[1::2] = adv[order]
    old_lp = np.zeros(loss_mask.size, dtype=np.float32)
    old_lp[loss_mask] = b.response_logprobs
    t = torch.from_numpy
    return {"input_ids": t(input_ids), "targets": t(targets), "position_ids": t(position_ids),
            "loss_mask": t(loss_mask), "old_logprobs": t(old_lp), "advantages": t(np.repeat(adv_runs, runs)),
            "seq_index": t(np.repeat(np.arange(S, dtype=np.int32), seq)), "cu_seqlens": t(cu.astype(np.int32)),
            "sample_index": t(order)}


def nl_padded(b: RolloutBatch, adv: np.ndarray, pad_id: int) -> dict[str, torch.Tensor]:
    """The [S, Lmax] right-padded fields of every non-empty response, in order."""
    order, p, r, a = _geometry(b)
    S = order.size
    seq = p + r - 1
    Lmax = int(seq.max()) if S else 0
    j = np.arange(Lmax, dtype=np.int32)
    attention = j < seq[:, None]
    prompt_target = j < (p - 1)[:, None]
    loss_mask = attention & ~prompt_target
    targets = np.full((S, Lmax), pad_id, dtype=np.int32)
    targets[loss_mask] = b.response_ids
    targets[prompt_target] = b.prompt_ids[runs_index(a + 1, p - 1, int(p.sum()) - S)]
    input_ids = np.full((S, Lmax), pad_id, dtype=np.int32)
    input_ids[:, 0] = b.prompt_ids[a]
    np.copyto(input_ids[:, 1:], targets[:, :-1], where=attention[:, 1:])
    old_lp = np.zeros((S, Lmax), dtype=np.float32)
    old_lp[loss_mask] = b.response_logprobs
    t = torch.from_numpy
    return {"input_ids": t(input_ids), "targets": t(targets), "position_ids": t(j * attention),
            "attention_mask": t(attention), "loss_mask": t(loss_mask), "old_logprobs": t(old_lp),
            "advantages": t(np.where(loss_mask, adv[order, None], np.float32(0.0)))}
