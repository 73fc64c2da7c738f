"""The rollout engine that lives inside a rank process, beside the policy it samples.

Placement (see docs/DESIGN.md, "Engines beside the ranks"): every training rank
builds one engine on its own device (`rollout.factory.make_engine`: vLLM with
`external_launcher`, as TRL's colocate mode; transformers where vLLM cannot run). `tensor_parallel_size` k
groups k consecutive ranks into one engine: all of them run the same prompts
(vLLM's TP collectives need every member), only the group's first rank writes
results. New weights go from the rank's own (sharded) model straight into its
engine, one gathered tensor at a time, without leaving the device.

Results go back as flat arrays: the controller owns one shared-memory segment
per step and gives each engine group a region of it (`OutRegion`); the leader
writes each finished part's token ids and log-probs at a running cursor and
sends only per-sequence metadata (O(sequences)) over its pipe. A rank on
another host sends the part's arrays inline instead (still whole buffers).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from areno.rollout.engine import SamplingConfig


@dataclass(frozen=True)
class OutRegion:
    """Where an engine group writes its results: `capacity` int32 token ids at
    `offset`, then `capacity` float32 log-probs (segment None: send inline)."""

    segment: str | None
    offset: int
    capacity: int

    @property
    def nbytes(self) -> int:
        return self.capacity * 8


def generate_into(engine: Any, ids: np.ndarray, offsets: np.ndarray, n: int, sampling: SamplingConfig,
                  out: OutRegion, emit: Callable[[dict], None] | None) -> int:
    """Generate n samples per prompt, streaming each finished part to `emit` as
    {positions [p] int64 (into ids/offsets), lengths [p*n] int64, finish [p*n]
    uint8, start (token cursor in the region)} (+ ids/logprobs inline when the
    region has no segment; + versions [t] int32, each token's weight version,
    when the engine was told its version: --partial-rollouts). emit None: a
    non-leader TP rank (runs, reports nothing). Returns the tokens written."""
    writer = PartWriter(out, emit is not None)
    try:
        for pos, part in engine.generate_stream(ids, offsets, n, sampling, min_groups=1):
            if emit is not None:
                emit(writer.write(pos, part))
    finally:
        writer.close()
    return writer.cursor


class PartWriter:
    """One command's OutRegion, written part after part at a running cursor:
    write(pos, part) -> the part's message (generate_into says what it holds)."""

    def __init__(self, out: OutRegion, leader: bool = True) -> None:
        from areno.procs.segment import map_region

        self.out = out
        self.region = map_region(out.segment, out.offset, out.nbytes, writable=True) \
            if leader and out.segment else None
        self.skew = out.offset % 4096 if self.region is not None else 0
        self.cursor = 0

    def write(self, pos: np.ndarray, part: Any) -> dict:
        t, cursor = part.response_ids.size, self.cursor
        if cursor + t > self.out.capacity:
            raise RuntimeError(f"engine wrote {cursor + t} tokens into a region of {self.out.capacity}")
        meta = dict(positions=pos, lengths=np.diff(part.response_offsets),
                    finish=part.finish_reason, start=cursor)
        if part.token_version is not None:  # the engine was told its version (--partial-rollouts)
            meta["versions"] = part.token_version
        if self.region is not None:
            _write(self.region, self.skew + 4 * cursor, part.response_ids)
            _write(self.region, self.skew + 4 * (self.out.capacity + cursor), part.response_logprobs)
        else:
            meta.update(ids=part.response_ids, logprobs=part.response_logprobs)
        self.cursor += t
        return meta

    def close(self) -> None:
        if self.region is not None:
            self.region.close()
            self.region = None


def _write(region: Any, at: int, a: np.ndarray) -> None:
    if a.size:
        np.frombuffer(region, dtype=np.uint8, count=a.nbytes, offset=at)[:] = a.view(np.uint8)
