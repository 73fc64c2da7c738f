"""RolloutBatch + advantages -> TrainPack: the packed tensors the backend trains on.

Layout (packed): sequence s is prompt ++ response[:-1] as input, with targets
prompt[1:] ++ response (shifted by one), so every position has a target and
position j of sequence s predicts input j+1. Sequences sit back to back:

    input_ids     [L] int32   token at each position
    targets       [L] int32   the next token (the one whose log-prob is trained)
    position_ids  [L] int32   0..len-1, restarting per sequence
    loss_mask     [L] bool    true where the target is a response token the policy
                              sampled (not a multi-turn observation token)
    old_logprobs  [L] float32 rollout log-prob of the target (0 off the mask)
    advantages    [L] float32 the sequence's advantage on its loss tokens, else 0
    seq_index     [L] int32   which sequence (0..S-1 in this pack) a position is in
    cu_seqlens    [S+1] int32 sequence boundaries (flash-attn varlen convention)
    seq_weights   [S] float32 weight of each loss token of sequence s in the loss
                              (set by the aggregation mode; see losses.py)
    sample_index  [S] int64   the response (0..N-1 of the RolloutBatch) of sequence s

Every per-token array is built by one vectorized pass or two: np.repeat over
(context, response) runs for the masks and advantages, masked stores for the
targets and log-probs, the targets shifted by one for the inputs, one cumsum for
the positions; gathers only for what is not already in order (a reordered
split, the prompt's tokens). A single-turn batch pays nothing for multi-turn
observation masks. Python only loops over sequences, in the split planner (split.py).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import torch

from areno.rollout.batch import RolloutBatch

PACKED_TOKEN_FIELDS: tuple[str, ...] = (
    "input_ids", "targets", "position_ids", "loss_mask", "old_logprobs", "advantages", "seq_index",
)


class Workspace:
    """Reusable host buffers for `build_train_pack`.

    A fresh 1M-token pack touches ~30 MB of new pages, and glibc returns freed
    large blocks to the OS, so every step would pay thousands of page faults
    (measured: about a third of the pack time). Building into buffers kept
    across steps pays them once. Arrays built with a workspace stay valid until
    the next build with the same workspace.
    """

    def __init__(self) -> None:
        self._bufs: dict[str, np.ndarray] = {}

    def get(self, name: str, n: int, dtype: type | np.dtype) -> np.ndarray:
        """An uninitialised [n] array of dtype, reusing `name`'s buffer when it fits."""
        buf = self._bufs.get(name)
        if buf is None or buf.dtype != np.dtype(dtype) or buf.size < n:
            buf = np.empty(n + n // 4, dtype=dtype)  # headroom: lengths vary per step
            self._bufs[name] = buf
        return buf[:n]


def _empty(ws: Workspace | None, name: str, n: int, dtype: type | np.dtype) -> np.ndarray:
    return ws.get(name, n, dtype) if ws is not None else np.empty(n, dtype=dtype)


@dataclass(frozen=True)
class TrainPack:
    """Packed training tensors (CPU, usually zero-copy views of numpy arrays)."""

    input_ids: torch.Tensor
    targets: torch.Tensor
    position_ids: torch.Tensor
    loss_mask: torch.Tensor
    old_logprobs: torch.Tensor
    advantages: torch.Tensor
    seq_index: torch.Tensor
    cu_seqlens: torch.Tensor
    seq_weights: torch.Tensor
    sample_index: torch.Tensor

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.numel())

    @property
    def num_seqs(self) -> int:
        return int(self.cu_seqlens.numel()) - 1

    @property
    def seq_lengths(self) -> np.ndarray:
        """[S] int64 sequence lengths (positions)."""
        return np.diff(self.cu_seqlens.numpy()).astype(np.int64)

    @property
    def max_seqlen(self) -> int:
        return int(self.seq_lengths.max()) if self.num_seqs else 0

    def local_seq_index(self) -> torch.Tensor:
        """seq_index rebased to 0..S-1 (a micro-batch view keeps its parent's numbering)."""
        if self.num_tokens == 0:
            return self.seq_index
        return self.seq_index - self.seq_index[0]

    def slice_seqs(self, start: int, stop: int) -> "TrainPack":
        """Zero-copy view of sequences [start, stop) (contiguous positions)."""
        cu = self.cu_seqlens
        a, b = int(cu[start]), int(cu[stop])
        return TrainPack(
            **{f: getattr(self, f)[a:b] for f in PACKED_TOKEN_FIELDS},
            cu_seqlens=cu[start : stop + 1] - cu[start],
            seq_weights=self.seq_weights[start:stop],
            sample_index=self.sample_index[start:stop],
        )

    def with_seq_weights(self, seq_weights: torch.Tensor) -> "TrainPack":
        return replace(self, seq_weights=seq_weights)


@dataclass(frozen=True)
class PaddedPack:
    """The same data as a TrainPack, one row per sequence, right-padded to [S, Lmax]
    (`build_padded_pack`): the layout padded attention takes, which the packed
    one must equal (tests, the GPU check, the benchmarks; no run trains on it).

    attention_mask [S, Lmax] bool marks real positions; every other field has
    the packed meaning. Padding positions have loss_mask False.
    """

    input_ids: torch.Tensor
    targets: torch.Tensor
    position_ids: torch.Tensor
    attention_mask: torch.Tensor
    loss_mask: torch.Tensor
    old_logprobs: torch.Tensor
    advantages: torch.Tensor
    seq_weights: torch.Tensor
    sample_index: torch.Tensor


# -- building ----------------------------------------------------------------
def runs_index(starts: np.ndarray, lengths: np.ndarray, total: int,
                out: np.ndarray | None = None) -> np.ndarray:
    """Concatenation of ranges [starts[k], starts[k]+lengths[k]) as one int64 array.

    One cumsum over a jump array: 1 everywhere, and at the first slot of each
    run the jump from the previous run's last value to this run's start.
    """
    keep = lengths > 0
    starts, lengths = starts[keep], lengths[keep]
    if out is None:
        out = np.empty(total, dtype=np.int64)
    out.fill(1)
    if starts.size == 0:
        return out[:0]
    first = np.zeros(starts.size, dtype=np.int64)
    np.cumsum(lengths[:-1], out=first[1:])
    jumps = np.empty(starts.size, dtype=np.int64)
    jumps[0] = starts[0]
    jumps[1:] = starts[1:] - (starts[:-1] + lengths[:-1] - 1)
    out[first] = jumps
    return np.cumsum(out, out=out)


def build_train_pack(
    batch: RolloutBatch,
    advantages: np.ndarray,
    *,
    order: np.ndarray | None = None,
    workspace: Workspace | None = None,
) -> TrainPack:
    """Pack every non-empty response (prompt ++ response) back to back.

    advantages: [N] float32, one per response.
    order:      optional [S] int64 response indices giving which responses to
                pack and in what order (default: all non-empty, in order).
    workspace:  optional reusable buffers (see Workspace).
    seq_weights are 0; `SplitPack`/`aggregation_weights` (split.py) set them.
    """
    adv, order, p_len, r = _selection(batch, advantages, order)
    seq_len = p_len + r - 1
    cu = np.zeros(order.size + 1, dtype=np.int64)
    np.cumsum(seq_len, out=cu[1:])

    contiguous = _contiguous(batch, order, r)
    loss_mask, tok_adv = _response_runs(adv[order], p_len, r)
    input_ids, targets = _inputs_and_targets(batch, order, p_len, r, cu, loss_mask, contiguous, workspace)
    old_lp = _old_logprobs(batch, order, r, loss_mask, tok_adv, contiguous, workspace)
    t = torch.from_numpy
    return TrainPack(
        input_ids=t(input_ids),
        targets=t(targets),
        position_ids=t(_position_ids(cu, workspace)),
        loss_mask=t(loss_mask),
        old_logprobs=t(old_lp),
        advantages=t(tok_adv),
        seq_index=t(np.repeat(np.arange(order.size, dtype=np.int32), seq_len)),
        cu_seqlens=t(cu.astype(np.int32)),
        seq_weights=torch.zeros(order.size, dtype=torch.float32),
        sample_index=t(order.copy()),
    )


def _selection(batch: RolloutBatch, advantages: np.ndarray, order: np.ndarray | None
               ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """-> [N] float32 advantages, [S] int64 the responses packed (default: every
    non-empty one, in order), [S] int64 their prompt and response lengths."""
    adv = np.asarray(advantages, dtype=np.float32)
    if adv.shape != (batch.num_responses,):
        raise ValueError(f"advantages: expected shape ({batch.num_responses},), got {adv.shape}")
    r_len = batch.response_lengths
    if order is None:
        order = np.flatnonzero(r_len > 0)
    else:
        order = np.asarray(order, dtype=np.int64)
        if order.size and r_len[order].min() == 0:
            raise ValueError("order: names an empty response")
    p_len = batch.prompt_lengths[batch.group_index[order]]
    if p_len.size and p_len.min() == 0:
        raise ValueError("prompt_offsets: a packed response has an empty prompt")
    return adv, order, p_len, r_len[order]


def _contiguous(batch: RolloutBatch, order: np.ndarray, r: np.ndarray) -> bool:
    """Whether the responses of `order` are all of the batch's response tokens in
    storage order (every non-empty response, ascending): then per-token response
    arrays are used as they are, with no gather."""
    return int(r.sum()) == batch.response_ids.size and bool(order.size < 2 or (np.diff(order) > 0).all())


def _response_tokens(batch: RolloutBatch, values: np.ndarray, order: np.ndarray, r: np.ndarray,
                     contiguous: bool) -> np.ndarray:
    """[sum r] the per-token response array `values` ([T]) of the responses of `order`, in order."""
    if contiguous:
        return values
    return np.take(values, runs_index(batch.response_offsets[order], r, int(r.sum())))


def _response_runs(seq_adv: np.ndarray, p_len: np.ndarray, r: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """-> [L] bool: the positions whose target is a response token; [L] float32
    advantages (the sequence's on those positions, else 0).

    Both are runs of constants over alternating (context, response) runs: one
    np.repeat each (much faster than a cumsum of deltas or a masked scatter, measured)."""
    S = seq_adv.size
    runs = np.stack([p_len - 1, r], axis=1).reshape(-1)  # context: targets that are prompt tokens
    adv_runs = np.zeros(2 * S, dtype=np.float32)
    adv_runs[1::2] = seq_adv
    return np.repeat(np.tile(np.array([False, True]), S), runs), np.repeat(adv_runs, runs)


def _inputs_and_targets(batch: RolloutBatch, order: np.ndarray, p_len: np.ndarray, r: np.ndarray,
                        cu: np.ndarray, response_target: np.ndarray, contiguous: bool,
                        ws: Workspace | None) -> tuple[np.ndarray, np.ndarray]:
    """-> [L] int32 input_ids and targets (cu: [S+1] int64; response_target: [L] bool).

    Sequence s is full = prompt ++ response; its targets are full[1:] (the
    prompt's tokens 1..p-1, then every response token) and its inputs full[:-1],
    which is the targets shifted by one position, after the prompt's first
    token. So the targets take two masked stores and the inputs one copy: no
    index array over all L positions."""
    L = response_target.size
    a = batch.prompt_offsets[batch.group_index[order]]
    targets = _empty(ws, "targets", L, np.int32)
    targets[response_target] = _response_tokens(batch, batch.response_ids, order, r, contiguous)
    prompt_idx = runs_index(a + 1, p_len - 1, int(p_len.sum()) - order.size)
    targets[~response_target] = np.take(batch.prompt_ids, prompt_idx)
    input_ids = _empty(ws, "input_ids", L, np.int32)
    input_ids[1:] = targets[:-1]
    input_ids[cu[:-1]] = batch.prompt_ids[a]
    return input_ids, targets


def _position_ids(cu: np.ndarray, ws: Workspace | None) -> np.ndarray:
    """[L] int32 0..len-1 per sequence: one cumsum of ones that jumps back at each start."""
    starts, seq_len = cu[:-1], np.diff(cu)
    position_ids = _empty(ws, "position_ids", int(cu[-1]), np.int32)
    position_ids.fill(1)
    if starts.size:
        position_ids[starts[1:]] = 1 - seq_len[:-1]
        position_ids[0] = 0
    return np.cumsum(position_ids, out=position_ids)


def _old_logprobs(batch: RolloutBatch, order: np.ndarray, r: np.ndarray, loss_mask: np.ndarray,
                  tok_adv: np.ndarray, contiguous: bool, ws: Workspace | None) -> np.ndarray:
    """[L] float32 rollout log-probs on the loss positions, else 0.

    loss_mask arrives as every response-target position; a multi-turn batch's
    observation tokens are taken out of it here (in place, with their advantages),
    so a single-turn batch (response_mask None) pays nothing for them."""
    old_lp = _empty(ws, "old_logprobs", loss_mask.size, np.float32)
    old_lp.fill(0.0)
    resp_lp = _response_tokens(batch, batch.response_logprobs, order, r, contiguous)
    if batch.response_mask is None:
        old_lp[loss_mask] = resp_lp
        return old_lp
    sampled = _response_tokens(batch, batch.response_mask, order, r, contiguous).astype(bool)
    loss_mask[loss_mask] = sampled  # observation tokens are not trained
    tok_adv[~loss_mask] = 0.0
    old_lp[loss_mask] = resp_lp[sampled]
    return old_lp


def build_padded_pack(batch: RolloutBatch, advantages: np.ndarray, *, order: np.ndarray | None = None,
                      pad_id: int = 0) -> PaddedPack:
    """The responses of `order` (as build_train_pack) as [S, Lmax] right-padded
    rows, built directly: one fill and one or two masked stores per field, the
    inputs the targets shifted by one (a copy), positions one multiply of the
    grid. seq_weights are 0, as in build_train_pack."""
    adv, order, p_len, r = _selection(batch, advantages, order)
    S, seq_len = order.size, p_len + r - 1
    Lmax = int(seq_len.max()) if S else 0
    j = np.arange(Lmax, dtype=np.int32)
    attention = j < seq_len[:, None]
    context = j < (p_len - 1)[:, None]  # targets that are prompt tokens
    loss_mask = attention & ~context
    contiguous = _contiguous(batch, order, r)
    a = batch.prompt_offsets[batch.group_index[order]]
    targets = np.full((S, Lmax), pad_id, dtype=np.int32)
    targets[loss_mask] = _response_tokens(batch, batch.response_ids, order, r, contiguous)
    targets[context] = np.take(batch.prompt_ids, runs_index(a + 1, p_len - 1, int(p_len.sum()) - S))
    input_ids = np.full((S, Lmax), pad_id, dtype=np.int32)
    if S:
        input_ids[:, 0] = batch.prompt_ids[a]
        np.copyto(input_ids[:, 1:], targets[:, :-1], where=attention[:, 1:])
    resp_lp = _response_tokens(batch, batch.response_logprobs, order, r, contiguous)
    if batch.response_mask is not None:  # observation tokens are not trained
        sampled = _response_tokens(batch, batch.response_mask, order, r, contiguous).astype(bool)
        loss_mask[loss_mask] = sampled
        resp_lp = resp_lp[sampled]
    old_lp = np.zeros((S, Lmax), dtype=np.float32)
    old_lp[loss_mask] = resp_lp
    t = torch.from_numpy
    return PaddedPack(
        input_ids=t(input_ids), targets=t(targets), position_ids=t(j * attention),
        attention_mask=t(attention), loss_mask=t(loss_mask), old_logprobs=t(old_lp),
        advantages=t(np.where(loss_mask, adv[order, None], np.float32(0.0))),
        seq_weights=torch.zeros(S, dtype=torch.float32), sample_index=t(order.copy()),
    )
