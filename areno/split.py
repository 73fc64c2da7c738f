"""TrainPack -> SplitPack: which mini-batch, rank and micro-batch each sequence goes to.

A step's sequences are cut into K mini-batches (contiguous, equal-count
chunks), each balanced over R data-parallel ranks by tokens (longest-first
greedy), and each rank's share packed into micro-batches of at most
`max_tokens` tokens (first-fit decreasing). The pack is then built once, already
in that order (rank-major), so a rank's data is one contiguous range and every
micro-batch is a zero-copy view. Loss weights per sequence are normalised over
the whole mini-batch, so the update does not depend on the split.

Python loops only over sequences here (the planner), never over tokens.
"""

from __future__ import annotations

import heapq
import typing
from dataclasses import dataclass, field

import numpy as np
import torch

from areno.choices import LossAgg
from areno.pack import TrainPack, Workspace, build_train_pack
from areno.rollout.batch import RolloutBatch

LOSS_AGG_MODES: tuple[str, ...] = typing.get_args(LossAgg)


@dataclass(frozen=True)
class SplitPlan:
    """Where each sequence goes. Sequences are laid out rank-major:
    for rank r, mini-batch k, micro-batch m, in that nesting order, so that all
    of a rank's data is one contiguous range of the reordered pack.

    seq_order:   [S] int64, original sequence index at each new slot
    micro_seqs:  [R, K, M, 2] int64 [start, stop) of each micro-batch in new slots
                 (M = max micro-batches over ranks per mini-batch; all ranks run
                 the same count so collectives line up; extra ones are empty)
    minibatch:   [S] int64 mini-batch of each new slot
    rank_tokens: [R] int64 tokens per rank (all mini-batches)
    """

    seq_order: np.ndarray
    micro_seqs: np.ndarray
    minibatch: np.ndarray
    rank_tokens: np.ndarray
    seq_lengths: np.ndarray = field(repr=False)

    @property
    def imbalance(self) -> float:
        """max rank tokens / mean rank tokens (1.0 = perfect)."""
        mean = self.rank_tokens.mean()
        return float(self.rank_tokens.max() / mean) if mean > 0 else 1.0


def plan_split(
    seq_lengths: np.ndarray,
    world_size: int,
    max_tokens: int,
    *,
    num_minibatches: int = 1,
) -> SplitPlan:
    """Deterministic split of S sequences into K mini-batches x R ranks x M micro-batches.

    Mini-batches are contiguous, equal-count chunks of the sequences (groups
    stay mostly together). Within one, ranks get sequences by longest-first
    greedy on tokens (LPT), and each rank packs its share into micro-batches of
    at most `max_tokens` by first-fit decreasing (a longer sequence gets a
    micro-batch of its own). O(S log S) Python over sequences, none over tokens.
    """
    if world_size < 1:
        raise ValueError("world_size must be >= 1")
    if max_tokens < 1:
        raise ValueError("max_tokens must be >= 1")
    lengths = np.asarray(seq_lengths, dtype=np.int64)
    S = lengths.size
    K = max(1, min(num_minibatches, S)) if S else 1
    chunks = np.array_split(np.arange(S, dtype=np.int64), K)
    R = world_size
    # per (k, r): list of micro-batches, each a list of original seq indices
    layout: list[list[list[list[int]]]] = []
    for chunk in chunks:
        by_len = chunk[np.argsort(-lengths[chunk], kind="stable")]
        heap = [(0, r) for r in range(R)]
        per_rank: list[list[int]] = [[] for _ in range(R)]
        for s in by_len.tolist():  # O(sequences)
            load, r = heapq.heappop(heap)
            per_rank[r].append(s)
            heapq.heappush(heap, (load + int(lengths[s]), r))
        layout.append([_first_fit(seqs, lengths, max_tokens) for seqs in per_rank])
    M = max((len(mbs) for k_layout in layout for mbs in k_layout), default=0)
    M = max(M, 1)
    micro = np.zeros((R, K, M, 2), dtype=np.int64)
    order: list[int] = []
    minibatch: list[int] = []
    rank_tokens = np.zeros(R, dtype=np.int64)
    for r in range(R):
        for k in range(K):
            mbs = layout[k][r]
            for m in range(M):
                seqs = mbs[m] if m < len(mbs) else []
                micro[r, k, m] = (len(order), len(order) + len(seqs))
                order.extend(seqs)
                minibatch.extend([k] * len(seqs))
                rank_tokens[r] += int(lengths[seqs].sum()) if seqs else 0
    return SplitPlan(
        seq_order=np.asarray(order, dtype=np.int64),
        micro_seqs=micro,
        minibatch=np.asarray(minibatch, dtype=np.int64),
        rank_tokens=rank_tokens,
        seq_lengths=lengths,
    )


def _first_fit(seqs: list[int], lengths: np.ndarray, max_tokens: int) -> list[list[int]]:
    """First-fit decreasing bins of capacity max_tokens (seqs already longest-first)."""
    bins: list[list[int]] = []
    loads: list[int] = []
    for s in seqs:
        n = int(lengths[s])
        for i, load in enumerate(loads):
            if load + n <= max_tokens:
                bins[i].append(s)
                loads[i] += n
                break
        else:
            bins.append([s])
            loads.append(n)
    return bins


def aggregation_weights(
    loss_tokens: np.ndarray,
    plan: SplitPlan,
    loss_agg: LossAgg,
    norm_len: int | None = None,
) -> np.ndarray:
    """[S] float32 weight per loss token of each (reordered) sequence.

    The loss of a mini-batch is sum over its loss tokens of w_seq * l_token,
    with w normalised over the WHOLE mini-batch (all ranks, all micro-batches),
    so the update does not depend on how it is split:

      token-mean:              w = 1 / (loss tokens in the mini-batch)
      seq-mean-token-mean:     w = 1 / (len_s * sequences in the mini-batch)
      seq-mean-token-sum-norm: w = 1 / (norm_len * sequences in the mini-batch)
                               (Dr. GRPO: a constant, e.g. max new tokens)

    loss_tokens: [S] int64 response tokens of each sequence, in plan order.
    """
    if loss_agg not in LOSS_AGG_MODES:
        raise ValueError(f"loss_agg: expected one of {LOSS_AGG_MODES}, got {loss_agg!r}")
    n = np.asarray(loss_tokens, dtype=np.float64)
    K = int(plan.micro_seqs.shape[1])
    mb = plan.minibatch
    tok_per_mb = np.bincount(mb, weights=n, minlength=K)
    seq_per_mb = np.bincount(mb, weights=(n > 0).astype(np.float64), minlength=K)
    if loss_agg == "token-mean":
        w = 1.0 / np.maximum(tok_per_mb[mb], 1.0)
    elif loss_agg == "seq-mean-token-mean":
        w = 1.0 / (np.maximum(n, 1.0) * np.maximum(seq_per_mb[mb], 1.0))
    else:
        if not norm_len or norm_len < 1:
            raise ValueError("seq-mean-token-sum-norm needs norm_len >= 1 (e.g. max new tokens)")
        w = 1.0 / (float(norm_len) * np.maximum(seq_per_mb[mb], 1.0))
    return np.where(n > 0, w, 0.0).astype(np.float32)


@dataclass(frozen=True)
class SplitPack:
    """A pack reordered rank-major with its plan; micro-batches are views."""

    pack: TrainPack
    plan: SplitPlan

    @property
    def world_size(self) -> int:
        return int(self.plan.micro_seqs.shape[0])

    @property
    def num_minibatches(self) -> int:
        return int(self.plan.micro_seqs.shape[1])

    @property
    def num_micro(self) -> int:
        return int(self.plan.micro_seqs.shape[2])

    def micro(self, rank: int, k: int, m: int) -> TrainPack:
        a, b = self.plan.micro_seqs[rank, k, m]
        return self.pack.slice_seqs(int(a), int(b))

    def rank_seq_range(self, rank: int) -> tuple[int, int]:
        """[start, stop) of rank's sequences; its tokens are one contiguous range."""
        ms = self.plan.micro_seqs[rank]
        return int(ms[0, 0, 0]), int(ms[-1, -1, 1])


def build_split_pack(
    batch: RolloutBatch,
    advantages: np.ndarray,
    *,
    world_size: int,
    max_tokens: int,
    num_minibatches: int = 1,
    loss_agg: LossAgg = "token-mean",
    norm_len: int | None = None,
    keep: np.ndarray | None = None,
    workspace: Workspace | None = None,
) -> SplitPack:
    """Plan the split from lengths, then build the pack once, already in plan order.

    keep: optional [N] bool; responses with False (or empty) are not packed.
    workspace: optional reusable buffers (see Workspace).
    """
    r_len = batch.response_lengths
    use = r_len > 0
    if keep is not None:
        use &= np.asarray(keep, dtype=bool)
    resp = np.flatnonzero(use)
    seq_len = batch.prompt_lengths[batch.group_index[resp]] + r_len[resp] - 1
    plan = plan_split(seq_len, world_size, max_tokens, num_minibatches=num_minibatches)
    pack = build_train_pack(batch, advantages, order=resp[plan.seq_order], workspace=workspace)
    # loss tokens: the sampled ones (a multi-turn trajectory's observations are not)
    weights = aggregation_weights(batch.policy_lengths[resp][plan.seq_order], plan, loss_agg, norm_len)
    return SplitPack(pack.with_seq_weights(torch.from_numpy(weights)), plan)
