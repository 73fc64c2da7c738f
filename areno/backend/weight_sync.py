"""One weight-sync mechanism: a source, two transports, one check.

Source: the trainer's gathered full tensors (`weights.iter_full_state`), as fresh
copies in the engine's dtype with their fingerprint (`engine_host.WeightStream`).

Transports:
- in-process (colocated engines, `RankWorker.cmd_sync_weights`): every rank
  streams the tensors straight into its own engine, on its device;
- shared memory (engines in other processes, `RankWorker.cmd_publish_weights`):
  rank 0 writes the stream into a controller-owned region laid out by
  `WeightLayout` (the one layout its writer and its readers use) and returns a
  `WeightRegion`; a reader in another process maps it and loads from it
  (`load_region`).

Check (both transports, `SyncCheck`): the engine's fingerprint of what it holds
must equal that of what was sent (exact), and, when due, the engine's log-probs
of the fixed probe sequence must match the trainer's (`ProbeRef`) within the
tolerance of rollout/probe.py.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from areno.rollout.probe import (
    Fingerprint, check_fingerprint, check_logprobs, probe_due, probe_tolerance,
)

_ALIGN = 64
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class WeightEntry:
    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int

    @property
    def numel(self) -> int:
        return int(np.prod(self.shape)) if self.shape else 1


@dataclass(frozen=True)
class WeightLayout:
    """Where each tensor lives in a weight region: 64-byte aligned slots in export order."""

    entries: tuple[WeightEntry, ...]
    nbytes: int

    @staticmethod
    def build(meta: Iterable[tuple[str, str, tuple[int, ...]]]) -> "WeightLayout":
        """meta: (name, dtype, global shape) per tensor (`weights.state_meta`)."""
        entries, off = [], 0
        for name, dtype, shape in meta:
            entries.append(WeightEntry(name, dtype, tuple(shape), off))
            n = int(np.prod(shape)) if shape else 1
            off += -(-n * _DTYPES[dtype].itemsize // _ALIGN) * _ALIGN
        return WeightLayout(tuple(entries), off)

    def views(self, buf: Any) -> Iterator[tuple[str, torch.Tensor]]:
        """Zero-copy (name, tensor) views of a buffer written with this layout."""
        for e in self.entries:
            t = torch.frombuffer(buf, dtype=_DTYPES[e.dtype], count=e.numel, offset=e.offset)
            yield e.name, t.view(e.shape)

    def write(self, buf: Any, named: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy each (name, tensor), in layout order, into its slot of `buf`."""
        slots = iter(self.views(buf))
        for name, t in named:
            slot_name, slot = next(slots)
            assert slot_name == name, f"weight region: got {name!r} where the layout has {slot_name!r}"
            slot.copy_(t.reshape(slot.shape))


@dataclass(frozen=True)
class ProbeRef:
    """The trainer's side of the probe: ids [L] int32, ref [L-1] float32 log-probs
    under the new weights, unit (rollout.probe.rounding_unit) and scale."""

    ids: np.ndarray
    ref: np.ndarray
    unit: float
    scale: float


@dataclass(frozen=True)
class WeightRegion:
    """A published set of weights: the segment rank 0 wrote, its layout, the
    fingerprint of what was written (None: not fingerprinted) and the probe
    reference when this sync runs the probe."""

    segment: str
    layout: WeightLayout
    fingerprint: Fingerprint | None
    probe: ProbeRef | None


class SyncCheck:
    """An engine's weight-sync checks across syncs: the exact fingerprint every
    sync (when the engine reports one), the probe when due (rollout.probe.probe_due),
    its tolerance calibrated by the first matched sync."""

    def __init__(self, fingerprinted: bool, rank: int) -> None:
        self.fingerprinted, self.rank = fingerprinted, rank
        self.syncs = 0  # weight syncs done
        self.calibration: float | None = None  # the first matched sync's probe diff

    @property
    def probe_due(self) -> bool:
        return probe_due(self.syncs, self.fingerprinted)

    def check(self, engine: Any, sent: Fingerprint | None, probe: ProbeRef | None,
              held: Fingerprint | None = None) -> dict:
        """WeightSyncError unless `engine` holds what was sent (`sent`) and, with a
        probe, scores it as the trainer does -> {probe_diff, probe_tolerance,
        probe_scale, probe_unit} (empty without a probe). held: what the engine
        reports holding, when not its full weights (a LoRA adapter, read by the
        caller with `adapter_fingerprint()`)."""
        if self.fingerprinted:
            assert sent is not None, "a fingerprinted engine needs the sender's fingerprint"
            check_fingerprint(held if held is not None else engine.weights_fingerprint(), sent, self.rank)
        out: dict = {}
        if probe is not None:
            tol = probe_tolerance(probe.unit, self.calibration)
            diff = check_logprobs(engine.prompt_logprobs(probe.ids), probe.ref, tol, f" on rank {self.rank}")
            if self.fingerprinted and self.calibration is None:
                self.calibration = diff  # identical weights: the pair's own noise
            out = {"probe_diff": diff, "probe_tolerance": tol, "probe_scale": probe.scale, "probe_unit": probe.unit}
        self.syncs += 1
        return out


def region_tensors(buf: Any, layout: WeightLayout) -> Iterator[tuple[str, torch.Tensor]]:
    """Copies of the region's tensors, one at a time: an engine may keep what it
    is given (vLLM's in-place reload on CPU does), and the region is rewritten
    by the next sync."""
    for name, t in layout.views(buf):
        yield name, t.clone()


def load_region(engine: Any, region: WeightRegion, check: SyncCheck) -> dict:
    """Reader side of the shared-memory transport: load every tensor of `region`
    into `engine`, then run `check` -> its result."""
    from areno.backend.handoff import map_region

    mem = map_region(region.segment, 0, region.layout.nbytes)
    tensors = region_tensors(mem, region.layout)
    try:
        engine.load_weights(tensors)
    finally:
        tensors.close()  # drops its last view: the map closes
        mem.close()
    return check.check(engine, region.fingerprint, region.probe)
