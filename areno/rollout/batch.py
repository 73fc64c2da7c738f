"""RolloutBatch: one step's rollouts as flat arrays with offsets (CSR layout).

Nothing here holds a per-token Python object: every transform is a vectorized
pass over the flat arrays, and Python loops (if any) run over sequences.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import numpy as np

FINISH_STOP = 0
FINISH_LENGTH = 1
FINISH_ABORT = 2
FINISH_REASONS = ("stop", "length", "abort")


def _check_offsets(name: str, offsets: np.ndarray, n_values: int) -> None:
    if offsets.ndim != 1 or offsets.size < 1:
        raise ValueError(f"{name}: must be a 1-D array of at least one offset")
    if offsets[0] != 0:
        raise ValueError(f"{name}: must start at 0, got {int(offsets[0])}")
    if offsets.size > 1 and np.any(np.diff(offsets) < 0):
        bad = int(np.flatnonzero(np.diff(offsets) < 0)[0])
        raise ValueError(f"{name}: not monotone at index {bad}")
    if offsets[-1] != n_values:
        raise ValueError(
            f"{name}: last offset {int(offsets[-1])} != length of the values ({n_values})"
        )


def _check_dtype(name: str, arr: Any, dtype: np.dtype) -> None:
    if not isinstance(arr, np.ndarray):
        raise ValueError(f"{name}: expected a numpy array, got {type(arr).__name__}")
    if arr.dtype != dtype:
        raise ValueError(f"{name}: expected dtype {np.dtype(dtype)}, got {arr.dtype}")
    if arr.ndim != 1:
        raise ValueError(f"{name}: expected a 1-D array, got shape {arr.shape}")


@dataclass(frozen=True)
class RolloutBatch:
    """N responses to P unique prompts, every token in one flat array.

    prompt_ids:        [sum prompt lens] int32, unique prompts concatenated
    prompt_offsets:    [P+1] int64, prompt p is prompt_ids[off[p]:off[p+1]]
    response_ids:      [T] int32, all responses concatenated
    response_offsets:  [N+1] int64
    response_logprobs: [T] float32, sampler log-prob of each response token
    group_index:       [N] int64, the prompt (0..P-1) response i answers
    finish_reason:     [N] uint8, 0 stop / 1 length / 2 abort
    response_mask:     [T] uint8 or None: 1 where the policy sampled the token, 0
                       for an environment's observation token inside a multi-turn
                       trajectory (areno/envs); None: every token was sampled
    turn_cut:          [N] bool or None: a multi-turn trajectory whose last sampled
                       turn the engine cut at its token cap (the model was still
                       talking; its finish_reason `length` may instead say that
                       --max-turns or the token budget ended it); None: single-turn,
                       finish_reason == length says it
    token_version:     [T] int32 or None: the weight version that sampled each token
                       (an observation token: the version of the turn before it);
                       tokens sampled after an in-flight weight update carry the new
                       one. None: not recorded by the engine (the scheduler stamps a
                       round's version on it, `with_version`)
    """

    prompt_ids: np.ndarray
    prompt_offsets: np.ndarray
    response_ids: np.ndarray
    response_offsets: np.ndarray
    response_logprobs: np.ndarray
    group_index: np.ndarray
    finish_reason: np.ndarray
    response_mask: np.ndarray | None = None
    turn_cut: np.ndarray | None = None
    token_version: np.ndarray | None = None

    def __post_init__(self) -> None:
        _check_dtype("prompt_ids", self.prompt_ids, np.int32)
        _check_dtype("prompt_offsets", self.prompt_offsets, np.int64)
        _check_dtype("response_ids", self.response_ids, np.int32)
        _check_dtype("response_offsets", self.response_offsets, np.int64)
        _check_dtype("response_logprobs", self.response_logprobs, np.float32)
        _check_dtype("group_index", self.group_index, np.int64)
        _check_dtype("finish_reason", self.finish_reason, np.uint8)
        _check_offsets("prompt_offsets", self.prompt_offsets, self.prompt_ids.size)
        _check_offsets("response_offsets", self.response_offsets, self.response_ids.size)
        if self.response_logprobs.size != self.response_ids.size:
            raise ValueError(
                f"response_logprobs: length {self.response_logprobs.size} != "
                f"response_ids length {self.response_ids.size}"
            )
        n = self.num_responses
        if self.group_index.size != n:
            raise ValueError(f"group_index: length {self.group_index.size} != {n} responses")
        if self.finish_reason.size != n:
            raise ValueError(f"finish_reason: length {self.finish_reason.size} != {n} responses")
        if n and (self.group_index.min() < 0 or self.group_index.max() >= self.num_prompts):
            raise ValueError(f"group_index: values must lie in [0, {self.num_prompts})")
        if self.response_mask is not None:
            _check_dtype("response_mask", self.response_mask, np.uint8)
            if self.response_mask.size != self.response_ids.size:
                raise ValueError(f"response_mask: length {self.response_mask.size} != "
                                 f"response_ids length {self.response_ids.size}")
        if self.token_version is not None:
            _check_dtype("token_version", self.token_version, np.int32)
            if self.token_version.size != self.response_ids.size:
                raise ValueError(f"token_version: length {self.token_version.size} != "
                                 f"response_ids length {self.response_ids.size}")
        if self.turn_cut is not None:
            _check_dtype("turn_cut", self.turn_cut, np.bool_)
            if self.turn_cut.size != n:
                raise ValueError(f"turn_cut: length {self.turn_cut.size} != {n} responses")
        if n and self.finish_reason.max() > FINISH_ABORT:
            raise ValueError("finish_reason: values must be 0 (stop), 1 (length) or 2 (abort)")

    # -- sizes -------------------------------------------------------------
    @property
    def num_prompts(self) -> int:
        return self.prompt_offsets.size - 1

    @property
    def num_responses(self) -> int:
        return self.response_offsets.size - 1

    @property
    def num_response_tokens(self) -> int:
        return int(self.response_ids.size)

    @property
    def prompt_lengths(self) -> np.ndarray:
        """[P] int64"""
        return np.diff(self.prompt_offsets)

    @property
    def response_lengths(self) -> np.ndarray:
        """[N] int64"""
        return np.diff(self.response_offsets)

    @property
    def policy_mask(self) -> np.ndarray:
        """[T] bool: the tokens the policy sampled (all of them without a response_mask)."""
        if self.response_mask is None:
            return np.ones(self.response_ids.size, dtype=bool)
        return self.response_mask.astype(bool)

    @property
    def policy_lengths(self) -> np.ndarray:
        """[N] int64 sampled tokens per response (observation tokens left out)."""
        if self.response_mask is None:
            return self.response_lengths
        return segment_sums(self.response_mask, self.response_offsets)

    def response_tokens(self, i: int) -> np.ndarray:
        """View of response i's token ids (for tests and debugging)."""
        return self.response_ids[self.response_offsets[i] : self.response_offsets[i + 1]]

    def prompt_tokens(self, p: int) -> np.ndarray:
        return self.prompt_ids[self.prompt_offsets[p] : self.prompt_offsets[p + 1]]

    def take_groups(self, groups: np.ndarray) -> tuple["RolloutBatch", np.ndarray]:
        """Groups `groups` (distinct prompt indices) as a batch of their own, new prompt
        p = old prompt groups[p], responses in group then original order. Returns
        (batch, resp_idx) with resp_idx [N'] the old index of each new response.
        One gather per array (csr_take)."""
        groups = np.asarray(groups, dtype=np.int64)
        rank = np.full(self.num_prompts, -1, dtype=np.int64)
        rank[groups] = np.arange(groups.size)
        new_group = rank[self.group_index]
        resp = np.flatnonzero(new_group >= 0)
        resp = resp[np.argsort(new_group[resp], kind="stable")]
        prompt_ids, prompt_offsets = csr_take(self.prompt_ids, self.prompt_offsets, groups)
        response_ids, response_offsets = csr_take(self.response_ids, self.response_offsets, resp)
        logprobs, _ = csr_take(self.response_logprobs, self.response_offsets, resp)
        mask = None if self.response_mask is None else csr_take(self.response_mask, self.response_offsets, resp)[0]
        version = None if self.token_version is None else \
            csr_take(self.token_version, self.response_offsets, resp)[0]
        return RolloutBatch(token_version=version,prompt_ids=prompt_ids, prompt_offsets=prompt_offsets,
                            response_ids=response_ids, response_offsets=response_offsets,
                            response_logprobs=logprobs, group_index=new_group[resp],
                            finish_reason=self.finish_reason[resp], response_mask=mask,
                            turn_cut=None if self.turn_cut is None else self.turn_cut[resp]), resp

    # -- construction ------------------------------------------------------
    @staticmethod
    def merge_parts(parts: list["RolloutBatch"], positions: list[np.ndarray],
                    ) -> tuple["RolloutBatch", np.ndarray]:
        """Streamed parts back into one batch in prompt order: part i's prompt j
        becomes prompt positions[i][j] (the positions of all parts together: a
        permutation of 0..P-1). Returns (batch, resp_perm) with resp_perm [N]
        the index of each new response in the parts concatenated. Equals
        concatenating the parts, then reordering the groups (tests/helpers.py,
        `concat` and `take_prompts`), but copies the token arrays once: the
        destination is cut into runs of responses contiguous in one part (a
        group, usually), found with vectorized passes, and each array is one
        np.concatenate of the runs' views. O(parts + runs) Python, runs <= responses."""
        positions = _checked_positions(parts, positions)
        pos_all = np.concatenate(positions)
        P = pos_all.size
        # responses: new group of each (in concat order), stable sort by it
        new_group = np.concatenate([q[b.group_index] for b, q in zip(parts, positions)])
        if np.array_equal(pos_all, np.arange(P)):  # already in order: kept as is
            resp_perm = np.arange(new_group.size, dtype=np.int64)
        else:
            resp_perm = np.argsort(new_group, kind="stable")
        part_of = np.repeat(np.arange(len(parts)), [b.num_responses for b in parts])[resp_perm]
        src_a = np.concatenate([b.response_offsets[:-1] for b in parts])[resp_perm]
        src_b = np.concatenate([b.response_offsets[1:] for b in parts])[resp_perm]
        # runs: consecutive new responses from one part whose tokens follow on
        brk = np.flatnonzero((part_of[1:] != part_of[:-1]) | (src_a[1:] != src_b[:-1])) + 1
        first = np.concatenate([[0], brk]) if resp_perm.size else brk
        last = np.concatenate([brk - 1, [resp_perm.size - 1]]) if resp_perm.size else brk
        runs = list(zip(part_of[first].tolist(), src_a[first].tolist(), src_b[last].tolist()))
        r_len = src_b - src_a
        # prompts: new prompt p is the prompt of part k with position p
        p_part = np.repeat(np.arange(len(parts)), [b.num_prompts for b in parts])
        p_a = np.concatenate([b.prompt_offsets[:-1] for b in parts])
        p_b = np.concatenate([b.prompt_offsets[1:] for b in parts])
        inv = np.empty(P, np.int64)
        inv[pos_all] = np.arange(P)
        prompt_views = [parts[k].prompt_ids[a:z]
                        for k, a, z in zip(p_part[inv].tolist(), p_a[inv].tolist(), p_b[inv].tolist())]

        mask, version = _optional_token_arrays(parts, runs)
        cuts = [b.turn_cut for b in parts]
        cut = None if all(c is None for c in cuts) else np.concatenate(
            [overlong_mask(b) for b in parts])[resp_perm]
        batch = RolloutBatch(
            response_mask=mask, turn_cut=cut, token_version=version,
            prompt_ids=_cat(prompt_views, np.int32),
            prompt_offsets=_offsets(p_b[inv] - p_a[inv]),
            response_ids=_cat([parts[k].response_ids[a:z] for k, a, z in runs], np.int32),
            response_offsets=_offsets(r_len),
            response_logprobs=_cat([parts[k].response_logprobs[a:z] for k, a, z in runs], np.float32),
            group_index=new_group[resp_perm],
            finish_reason=np.concatenate([b.finish_reason for b in parts])[resp_perm],
        )
        return batch, resp_perm


def _cat(views: list[np.ndarray], dtype) -> np.ndarray:
    return np.concatenate(views) if views else np.zeros(0, dtype)


def _optional_token_arrays(parts: list[RolloutBatch], runs: list[tuple[int, int, int]],
                           ) -> tuple[np.ndarray | None, np.ndarray | None]:
    """merge_parts' per-token arrays that a batch may lack: (response_mask uint8,
    token_version int32) of the runs (part, start, end) in order; a mask is
    None only if every part's is (a part without one: its policy mask), a
    version must be on every part or none."""
    masks = [b.response_mask for b in parts]
    mask = None
    if any(m is not None for m in masks):
        full = [b.policy_mask.astype(np.uint8) if m is None else m for b, m in zip(parts, masks)]
        mask = _cat([full[k][a:z] for k, a, z in runs], np.uint8)
    versions = [b.token_version for b in parts]
    if any(v is None for v in versions) and not all(v is None for v in versions):
        raise ValueError("merge_parts: some parts carry token_version and some do not "
                         "(stamp them first: with_version)")
    version = None if versions[0] is None else _cat([versions[k][a:z] for k, a, z in runs], np.int32)
    return mask, version


def _checked_positions(parts: list["RolloutBatch"], positions: list[np.ndarray]) -> list[np.ndarray]:
    """merge_parts' positions as int64 arrays, one per part and together a
    permutation of 0..P-1; ValueError otherwise."""
    if not parts or len(parts) != len(positions):
        raise ValueError(f"merge_parts: {len(parts)} parts, {len(positions)} position arrays")
    positions = [np.asarray(q, dtype=np.int64) for q in positions]
    for b, q in zip(parts, positions):
        if q.shape != (b.num_prompts,):
            raise ValueError(f"merge_parts: {q.size} positions for a part of {b.num_prompts} prompts")
    pos_all = np.concatenate(positions)
    P = pos_all.size
    if P and (pos_all.min() < 0 or pos_all.max() >= P or np.bincount(pos_all, minlength=P).max() > 1):
        raise ValueError("merge_parts: the positions are not a permutation of 0..P-1")
    return positions


def _offsets(lengths: np.ndarray) -> np.ndarray:
    out = np.zeros(lengths.size + 1, dtype=np.int64)
    np.cumsum(lengths, out=out[1:])
    return out


def offsets_from_lengths(lengths: np.ndarray) -> np.ndarray:
    """[n] lengths -> [n+1] int64 offsets starting at 0."""
    return _offsets(np.asarray(lengths, dtype=np.int64))


def segment_sums(values: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    """[T] values, [N+1] offsets -> [N] int64 sum of each row (0 for an empty row):
    one cumulative sum, no per-row Python."""
    c = np.zeros(values.size + 1, dtype=np.int64)
    np.cumsum(values, out=c[1:])
    return c[offsets[1:]] - c[offsets[:-1]]


def segment_gather(src_start: np.ndarray, seg_len: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Segments k = 0.. (src_start[k], seg_len[k] long, [S] int64 each) laid end
    to end -> ([sum seg_len] int64 indices that read them in order, [S+1] int64
    offsets of the segments in the result). O(segments) index math."""
    out_off = offsets_from_lengths(seg_len)
    return np.repeat(src_start - out_off[:-1], seg_len) + np.arange(out_off[-1]), out_off


def csr_take(values: np.ndarray, offsets: np.ndarray, idx: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Rows idx of a CSR array (values [T], offsets [R+1]) -> (values', offsets'):
    one gather, O(rows) index math, no per-token Python."""
    idx = np.asarray(idx, dtype=np.int64)
    gather, out_off = segment_gather(offsets[idx], np.diff(offsets)[idx])
    return values[gather], out_off


def with_version(batch: RolloutBatch, version: int) -> RolloutBatch:
    """The batch with every token stamped `version` where the engine recorded
    none (token_version None); a batch that carries its versions is returned as is."""
    if batch.token_version is not None:
        return batch
    return replace(batch, token_version=np.full(batch.response_ids.size, version, dtype=np.int32))


def oldest_version(batch: RolloutBatch) -> np.ndarray:
    """[N] int64: the oldest weight version among each response's sampled tokens
    (policy_mask); a response without one: int64 max (it bounds nothing).
    The batch must carry token_version (with_version)."""
    if batch.token_version is None:
        raise ValueError("oldest_version: the batch carries no token_version (with_version first)")
    none = np.iinfo(np.int64).max
    v = np.where(batch.policy_mask, batch.token_version.astype(np.int64), none)
    lengths = batch.response_lengths
    out = np.full(batch.num_responses, none, dtype=np.int64)
    has = lengths > 0
    if has.any():  # reduceat over the non-empty rows only (an empty row would read its neighbour)
        out[has] = np.minimum.reduceat(v, batch.response_offsets[:-1][has])
    return out


def overlong_mask(batch: RolloutBatch) -> np.ndarray:
    """[N] bool: responses the engine cut at their token cap (finish_reason ==
    length); a multi-turn trajectory: its last sampled turn was (turn_cut), not
    --max-turns or the token budget ending it after a turn that stopped."""
    if batch.turn_cut is not None:
        return batch.turn_cut
    return batch.finish_reason == FINISH_LENGTH


def turn_segments(batch: RolloutBatch, i: int) -> list[tuple[int, np.ndarray]]:
    """Response i of a batch as (1 sampled | 0 observation, ids) runs of its mask."""
    ids = batch.response_tokens(i)
    if batch.response_mask is None:
        return [(1, ids)] if ids.size else []
    m = batch.response_mask[batch.response_offsets[i]:batch.response_offsets[i + 1]]
    cut = np.flatnonzero(np.diff(m)) + 1
    return [(int(mm[0]), a) for a, mm in zip(np.split(ids, cut), np.split(m, cut)) if a.size]


def decode_one(tokenizer: Any, ids: np.ndarray) -> str:
    """[k] token ids -> their text, decoded as decode_completions decodes a response."""
    return _batch_decode(tokenizer, np.asarray(ids), np.array([0, len(ids)]), True)[0]


def _batch_decode(tokenizer: Any, ids: np.ndarray, offsets: np.ndarray, skip_special_tokens: bool) -> list[str]:
    """One batched decode of the CSR sequences ids[offsets[i]:offsets[i+1]].

    transformers' `batch_decode` loops over sequences in Python, so a fast
    tokenizer is decoded with the Rust `decode_batch` (one call, parallel).
    The ids cross into Rust as lists: the binding needs them, they live only
    for that call, and lists convert faster than numpy scalars (measured).
    """
    if offsets.size <= 1:
        return []
    pieces = [p.tolist() for p in np.split(ids, offsets[1:-1])]
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        return backend.decode_batch(pieces, skip_special_tokens=skip_special_tokens)
    return tokenizer.batch_decode(pieces, skip_special_tokens=skip_special_tokens)


def decode_completions(tokenizer: Any, batch: RolloutBatch, skip_special_tokens: bool = True) -> list[str]:
    """Decode every response in ONE batched tokenizer call -> N strings."""
    return _batch_decode(tokenizer, batch.response_ids, batch.response_offsets, skip_special_tokens)
