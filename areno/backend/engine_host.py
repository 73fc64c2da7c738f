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

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from areno.rollout.engine import SamplingConfig, check_weight_names
from areno.rollout.probe import WeightSyncError

# Largest acceptable max |engine - trainer| probe log-prob difference, by the
# dtype both sides compute in. fp32 agrees to ~1e-6. In bf16 the two sides run
# different kernels: a correct sync measured 0.002 (transformers) and 0.004 (vLLM)
# on the tiny model, one optimizer step of staleness at the demo's lr 0.014-0.03.
# A 1% error in one layer is below bf16's resolution (0.4%) on log-probs, so
# engines that can (transformers) also compare an exact weight fingerprint.
PROBE_TOLERANCE = {"float32": 1e-3, "bfloat16": 1e-2}
# Where the engine also reports an exact fingerprint of what it holds, that
# check proves every sync's weights; the probe then checks the engine's
# numerics (kernels, dtype, tied weights), which do not change from one sync to
# the next: it runs at the first sync and every PROBE_EVERY_FINGERPRINTED-th.
# Elsewhere (vLLM) the probe is the only check and runs at every sync. (The
# demo's sync: 6 ms with a probe every step, 2.5 ms without.)
PROBE_EVERY_FINGERPRINTED = 50


def probe_due(sync_index: int, fingerprinted: bool) -> bool:
    """Whether sync number `sync_index` (0 = the first) runs the probe."""
    return not fingerprinted or sync_index % PROBE_EVERY_FINGERPRINTED == 0


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
    region has no segment). emit None: a non-leader TP rank (runs, reports
    nothing). Returns the tokens written."""
    from areno.backend.handoff import map_region

    region = map_region(out.segment, out.offset, out.nbytes, writable=True) \
        if emit is not None and out.segment else None
    skew = out.offset % 4096 if region is not None else 0
    cursor = 0
    try:
        for pos, part in engine.generate_stream(ids, offsets, n, sampling, min_groups=1):
            if emit is None:
                continue
            t = part.response_ids.size
            if cursor + t > out.capacity:
                raise RuntimeError(f"engine wrote {cursor + t} tokens into a region of {out.capacity}")
            meta = dict(positions=pos, lengths=np.diff(part.response_offsets),
                        finish=part.finish_reason, start=cursor)
            if region is not None:
                _write(region, skew + 4 * cursor, part.response_ids)
                _write(region, skew + 4 * (out.capacity + cursor), part.response_logprobs)
            else:
                meta.update(ids=part.response_ids, logprobs=part.response_logprobs)
            cursor += t
            emit(meta)
    finally:
        if region is not None:
            region.close()
    return cursor


def _write(region: Any, at: int, a: np.ndarray) -> None:
    if a.size:
        np.frombuffer(region, dtype=np.uint8, count=a.nbytes, offset=at)[:] = a.view(np.uint8)


def check_engine_names(engine: Any, names: Iterable[str]) -> None:
    """Fail at start-up, not at the first sync, if the trainer's tensor names and
    the engine's disagree."""
    expected = getattr(engine, "_weight_names", None)
    if expected is not None:
        check_weight_names(names, expected, getattr(engine, "_optional_names", set()))


def verify_probe_logprobs(got: np.ndarray, ref: np.ndarray, tolerance: float, rank: int) -> float:
    """max |got - ref|; WeightSyncError (naming the rank) beyond `tolerance`."""
    diff = np.abs(got.astype(np.float64) - ref.astype(np.float64))
    worst = float(np.max(diff)) if diff.size and np.all(np.isfinite(diff)) else float("inf")
    if not worst <= tolerance:
        pos = int(np.argmax(np.nan_to_num(diff, nan=np.inf)))
        raise WeightSyncError(
            f"weight sync probe failed on rank {rank}: engine log-probs differ from the trainer's "
            f"by max {worst:.3g} (tolerance {tolerance:g}, worst at position {pos + 1} of "
            f"{ref.size + 1}); the engine is not serving the trained weights")
    return worst


class WeightStream:
    """The trainer's gathered full tensors as fresh copies in the engine's dtype on
    their device, one at a time (an engine may keep what it is given: vLLM's
    in-place reload on CPU does), with a running fp64 sum of squares per name
    kept on the device when `fingerprint` is on (read once after the load; an
    engine that cannot report its own has no use for it)."""

    def __init__(self, named: Iterator[tuple[str, torch.Tensor]], dtype: torch.dtype,
                 fingerprint: bool = True) -> None:
        self._named, self._dtype, self._fingerprint = named, dtype, fingerprint
        self.names: list[str] = []
        self._sumsq: torch.Tensor | None = None

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name, t in self._named:
            c = t.detach().to(self._dtype, copy=True)
            if self._fingerprint:
                s = c.double().square().sum()
                self._sumsq = s if self._sumsq is None else self._sumsq + s
            self.names.append(name)
            yield name, c

    def fingerprint(self) -> float:
        return float(self._sumsq) if self._sumsq is not None else 0.0


def verify_fingerprint(engine: Any, stream: WeightStream, rank: int) -> None:
    """Exact check for an engine that can report what it holds (`weights_fingerprint`):
    the fp64 sum of squares of every loaded tensor must equal the trainer's (same
    bf16/fp32 bytes)."""
    got, want = engine.weights_fingerprint(stream.names), stream.fingerprint()
    if not abs(got - want) <= 1e-9 * max(abs(want), 1.0):
        raise WeightSyncError(
            f"weight sync check failed on rank {rank}: the engine's weights (sum of squares "
            f"{got:.9g}) are not the trainer's ({want:.9g}); the engine is not serving the "
            "trained weights")
