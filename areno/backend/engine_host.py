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
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from areno.rollout.engine import SamplingConfig, check_weight_names
from areno.rollout.probe import Fingerprint, sum_squares


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


class WeightStream:
    """The trainer's gathered full tensors as fresh copies in the engine's dtype on
    their device, one at a time (an engine may keep what it is given: vLLM's
    in-place reload on CPU does), with each one's fp64 sum of squares kept on
    the device when `fingerprint` is on (read once after the load; an engine
    that cannot report its own has no use for it)."""

    def __init__(self, named: Iterator[tuple[str, torch.Tensor]], dtype: torch.dtype,
                 fingerprint: bool = True) -> None:
        self._named, self._dtype, self._fingerprint = named, dtype, fingerprint
        self.names: list[str] = []
        self._sums: list[tuple[str, torch.Tensor, int]] = []
        self._bytes = 0

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name, t in self._named:
            c = t.detach().to(self._dtype, copy=True)
            if self._fingerprint:
                self._sums.append((name, sum_squares(c), c.numel()))
            self.names.append(name)
            self._bytes += c.numel() * c.element_size()
            yield name, c

    @property
    def nbytes(self) -> int:
        """Bytes sent so far, in the engine's dtype."""
        return self._bytes

    def fingerprint(self) -> Fingerprint:
        """What was sent, grouped as engines report it (one device read)."""
        if not self._sums:
            return Fingerprint({}, {})
        values = torch.stack([s for _, s, _ in self._sums]).cpu().tolist()
        return Fingerprint.of((n, v, k) for (n, _, k), v in zip(self._sums, values))


def reports_fingerprint(engine: Any) -> bool:
    """Whether `engine` can report an exact fingerprint of what it holds (decided
    once: it turns on the stream's sums, the exact check and the probe schedule)."""
    return hasattr(engine, "weights_fingerprint") and getattr(engine, "fingerprint_exact", True)


@contextmanager
def logit_scale_of(hf: torch.nn.Module) -> Iterator[list[float]]:
    """Within: every forward of `hf.model` appends max |logit| of its last hidden
    states through `hf.lm_head` (the probe's rounding scale). Read inside the
    forward, where FSDP2 has gathered the lm_head and autocast is on."""
    scales: list[float] = []

    def grab(_module, _args, out) -> None:
        h = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]
        with torch.no_grad():
            scales.append(float(torch.nn.functional.linear(h, hf.lm_head.weight).abs().max()))

    handle = hf.model.register_forward_hook(grab)
    try:
        yield scales
    finally:
        handle.remove()
