"""Tail fill for the transformers engine: several rounds in one generation loop.

A round is one rollout command's prompts (fleet/tail_fill.py decides when a
queued one joins). transformers' `generate` fixes its rows when it starts, so
the loop is a chain of `generate` segments over the samples still running. A
segment ends at a step boundary (the stopping criterion `_Cut`, after the
engine's own `StepBoundary`):

  - when a round has finished all its samples while others still run: its
    parts stream and its reply goes out now, not with the rounds behind it;
  - when `admit(samples running)` hands over a queued round.

The next segment runs every unfinished sample with its prompt + tokens so far
as its prompt (left-padded), together with the joining round's samples. A
carried sample is prefilled again: the recompute an in-flight weight load
already pays (rollout/hf_inflight.py). Its next token is then sampled from what
the uninterrupted `generate` would have used, up to float rounding, so the
tokens, log-probs and versions keep their meaning. The cost is one prefill of
the running samples per segment, and a round causes at most two segments (its
join and its end), against one forward per token for decoding.

Rounds of a run share temperature, top-k, top-p and stop tokens (settings.py
builds one SamplingConfig; steps differ in the seed): a segment samples them
all with one set of warpers. Each sample keeps its own token budget
(max_tokens, and the context left), checked per row by `_Cut`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from transformers.generation.stopping_criteria import StoppingCriteria

from areno.rollout.batch import FINISH_ABORT, FINISH_LENGTH, FINISH_STOP, RolloutBatch, csr_take, offsets_from_lengths
from areno.rollout.engine import RoundRequest, SamplingConfig, due


@dataclass(eq=False)
class _Sample:
    """One response in the loop: its round and prompt, what it sampled so far
    (int32 tokens, float32 log-probs, int32 versions, one array per segment),
    the tokens it may still take, and its finish once ended (None: running)."""

    round: int
    prompt: np.ndarray
    left: int
    tok: list[np.ndarray] = field(default_factory=list)
    lp: list[np.ndarray] = field(default_factory=list)
    ver: list[np.ndarray] = field(default_factory=list)
    finish: int | None = None


@dataclass
class _Round:
    """A round in the loop: its prompts (CSR), n, its samples (prompt-major,
    [P * n]) and which groups were yielded already."""

    ids: np.ndarray
    offsets: np.ndarray
    n: int
    samples: list[_Sample]
    yielded: np.ndarray
    version: int | None = None  # admitted with (rollout.engine.due)


def _shared(s: SamplingConfig) -> tuple:
    """What every round of one loop must sample with alike."""
    return s.temperature, s.top_k, s.top_p, tuple(s.stop_token_ids), s.ignore_eos


class _Cut(StoppingCriteria):
    """Ends a segment for every row (see the module doc); otherwise marks a row
    done once it sampled a stop token or its budget, or its round is due
    (--cut-at-deadline: rollout.engine.due; cut_at [B] int64 the tokens it
    keeps, max int64 where not cut). limits: [B] int64 tokens each row may
    take; rounds: [B] int64 the round of each row; versions: each round's
    admission version (None: none given)."""

    def __init__(self, engine: Any, limits: np.ndarray, rounds: np.ndarray, versions: list[int | None],
                 stop_ids: tuple[int, ...], admit: Callable[[int], RoundRequest | None]) -> None:
        self.engine, self.admit = engine, admit
        self.limits, self.rounds = torch.from_numpy(limits), torch.from_numpy(rounds)
        self.versions = versions
        self.stop = torch.tensor(stop_ids, dtype=torch.long)
        self.done = torch.zeros(limits.size, dtype=torch.bool)
        self.cut_at = np.full(limits.size, np.iinfo(np.int64).max, dtype=np.int64)
        self.present = int(np.unique(rounds).size)
        self.steps = 0
        self.joiner: RoundRequest | None = None

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor, **kwargs: Any) -> torch.BoolTensor:
        self.steps += 1
        last = input_ids[:, -1].cpu()
        self.done |= torch.isin(last, self.stop) | (self.steps >= self.limits)
        if self.engine.cut_version is not None:
            cut = torch.tensor([due(v, self.engine.cut_version) for v in self.versions])[self.rounds] & ~self.done
            self.cut_at[cut.numpy()] = self.steps
            self.done |= cut
            self.engine.cut_samples += int(cut.sum())
        every = torch.ones_like(self.done, device=input_ids.device)
        if self.engine.halt or bool(self.done.all()):
            return every
        if int(torch.unique(self.rounds[~self.done]).numel()) < self.present:
            return every  # a round has finished: its parts and reply go out now
        self.joiner = self.admit(int((~self.done).sum()))
        return every if self.joiner is not None else self.done.to(input_ids.device)


def stream_rounds(engine: Any, first: RoundRequest, admit: Callable[[int], RoundRequest | None],
                  ) -> Iterator[tuple[int, np.ndarray, RolloutBatch]]:
    """Yield (round k, prompt positions [p] of round k, RolloutBatch of those p
    groups) as groups finish; round 0 is `first`, round k + 1 the k + 1-th
    request admit(samples running) returned. engine: an HFEngine. Ends when
    every admitted round is done, or at a halt (engine.halt: every running
    sample ends "abort" with its tokens)."""
    stop_ids, seed = engine._stops_and_seed(first.sampling)
    segment_seeds = np.random.default_rng(seed)
    rounds: list[_Round] = []
    live: list[_Sample] = []

    def add(req: RoundRequest) -> None:
        if _shared(req.sampling) != _shared(first.sampling):
            raise ValueError("tail fill: a joining round samples with other warpers or stop tokens")
        ids, offsets = engine._validate(req.ids, req.offsets, req.n)
        budget = np.minimum(req.sampling.max_tokens, engine.max_model_len - np.diff(offsets))
        samples = [_Sample(len(rounds), ids[offsets[p]:offsets[p + 1]], int(budget[p]))
                   for p in range(offsets.size - 1) for _ in range(req.n)]
        rounds.append(_Round(ids, offsets, req.n, samples, np.zeros(offsets.size - 1, dtype=bool), req.version))
        live.extend(samples)

    add(first)
    while live:
        cut = _Cut(engine, np.array([s.left for s in live], dtype=np.int64),
                   np.array([s.round for s in live], dtype=np.int64), [r.version for r in rounds], stop_ids, admit)
        _segment(engine, live, rounds[-1].n, first.sampling, stop_ids, int(segment_seeds.integers(1 << 62)), cut)
        live[:] = [s for s in live if s.finish is None]
        for k, r in enumerate(rounds):
            ended = np.array([s.finish is not None for s in r.samples]).reshape(-1, r.n).all(axis=1)
            pos = np.flatnonzero(ended & ~r.yielded)
            if pos.size:
                r.yielded[pos] = True
                yield k, pos, _part(engine, r, pos)
        if cut.joiner is not None and not engine.halt:
            add(cut.joiner)


def _segment(engine: Any, samples: list[_Sample], n: int, s: SamplingConfig, stop_ids: tuple[int, ...],
             seed: int, cut: _Cut) -> None:
    """One `generate` over `samples` (each its prompt + tokens so far, left-padded);
    appends what each sampled and ends those that stopped, ran out of budget,
    or were halted. The samples not started yet (the first or the joining
    round's: the last ones, n per prompt) share their prompt's prefill."""
    from areno.rollout.hf import _left_pad

    carried = sum(1 for x in samples if x.tok)
    seqs = [np.concatenate([x.prompt, *x.tok]) for x in samples[:carried]] + \
        [x.prompt for x in samples[carried::n]]
    offsets = offsets_from_lengths(np.array([q.size for q in seqs], dtype=np.int64))
    rows, mask = _left_pad(np.concatenate(seqs), offsets, np.arange(len(seqs)), engine.pad_token_id)
    limits = cut.limits.numpy()
    tok, lp, ver = engine._sample(rows, mask, n, s, int(limits.max()), stop_ids, seed, extra=(cut,),
                                  carried=carried)
    col = np.arange(tok.shape[1])
    span = np.minimum(np.minimum(limits, tok.shape[1]), cut.cut_at)
    hit = np.isin(tok, np.asarray(stop_ids, dtype=tok.dtype)) & (col < span[:, None]) if stop_ids else \
        np.zeros(tok.shape, dtype=bool)
    stopped = hit.any(axis=1)
    took = np.where(stopped, hit.argmax(axis=1) + 1, span)
    for i, x in enumerate(samples):
        c = int(took[i])
        x.tok.append(tok[i, :c])
        x.lp.append(lp[i, :c])
        x.ver.append(ver[:c])
        x.left -= c
        if stopped[i]:
            x.finish = FINISH_STOP
        elif x.left == 0 or c == cut.cut_at[i]:  # its budget, or its deadline's cut
            x.finish = FINISH_LENGTH
        elif engine.halt:
            x.finish = FINISH_ABORT


def _part(engine: Any, r: _Round, pos: np.ndarray) -> RolloutBatch:
    """The finished groups `pos` of round r -> their RolloutBatch (prompt order)."""
    from areno.rollout.hf import _assemble

    samples = [r.samples[p * r.n + j] for p in pos.tolist() for j in range(r.n)]
    sub_ids, sub_off = csr_take(r.ids, r.offsets, pos)
    return _assemble(
        sub_ids, sub_off, r.n,
        [np.concatenate([t for x in samples for t in x.tok])], [np.concatenate([t for x in samples for t in x.lp])],
        [np.array([sum(t.size for t in x.tok) for x in samples], dtype=np.int64)],
        [np.array([x.finish for x in samples], dtype=np.uint8)],
        [np.repeat(np.arange(pos.size), r.n)], [np.concatenate([t for x in samples for t in x.ver])],
        versioned=engine.weight_version is not None,
    )
