"""One weight-sync mechanism: a source, two transports, one check.

Source: the trainer's gathered full tensors (`weights.iter_full_state`) in the
engine's dtype with their fingerprint (`WeightStream`; copied only to convert).
Under LoRA the engines hold the frozen base from their start and the source is
the adapter alone (backend.adapter_sync), on both transports.

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

import os

from collections.abc import Mapping, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from areno.fleet.adapter_sync import load_adapter
from areno.rollout.engine import check_weight_names
from areno.rollout.probe import (
    Fingerprint, check_fingerprint, check_logprobs, probe_due, probe_tolerance, sum_squares,
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
    reference when this sync runs the probe. Under LoRA the region holds the
    adapter only (peft's saved names): `adapter` is its peft LoraConfig and
    `version` the adapter's version on the engines (the publish count, strictly
    increasing); the fingerprint is then the adapter's (rollout.lora)."""

    segment: str
    layout: WeightLayout
    fingerprint: Fingerprint | None
    probe: ProbeRef | None
    adapter: Any = None
    version: int = 0


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
    """The region's tensors as zero-copy views, one at a time. No host clone: the
    engine's load is the one copy (into vLLM's or transformers' own storage, on
    its device; neither keeps a view, tests/test_engine_contract.py), so the
    next sync may rewrite the region."""
    yield from layout.views(buf)


def load_region(engine: Any, region: WeightRegion, check: SyncCheck, version: int | None = None,
                probe: bool = True) -> dict:
    """Reader side of the shared-memory transport: load every tensor of `region`
    into `engine` (under LoRA: the adapter, as a colocated rank loads it,
    adapter_sync.load_adapter), then run `check` -> its result. An adapter is
    checked against the sender's fingerprint, so a region damaged in between
    fails the check as a full one does. version: an in-flight load of that
    weight version (update_weights_inflight, between two decode steps:
    fleet/inflight_loads.py); probe False: the fingerprint only."""
    from areno.procs.segment import map_region

    mem = map_region(region.segment, 0, region.layout.nbytes)
    tensors = region_tensors(mem, region.layout)
    try:
        if region.adapter is not None:  # the base is in the engine since its start
            load_adapter(engine, tensors, region.adapter, region.version, fingerprint=False, inflight=version)
        elif version is not None:
            engine.update_weights_inflight(tensors, version)
        else:
            engine.load_weights(tensors)
    finally:
        tensors.close()  # drops its last view: the map closes
        mem.close()
    return check.check(engine, region.fingerprint, region.probe if probe else None,
                       held=region_held(engine, region, check))


def region_held(engine: Any, region: WeightRegion, check: SyncCheck) -> Any:
    """What `engine` reports holding of `region` when that is not its full weights:
    under LoRA the adapter it serves (None otherwise: SyncCheck reads the weights')."""
    return engine.adapter_fingerprint() if region.adapter is not None and check.fingerprinted else None


def check_engine_names(engine: Any, names: Iterable[str]) -> None:
    """Fail at start-up, not at the first sync, if the trainer's tensor names and
    the engine's disagree."""
    expected = getattr(engine, "_weight_names", None)
    if expected is not None:
        check_weight_names(names, expected, getattr(engine, "_optional_names", set()))


class WeightStream:
    """The trainer's gathered full tensors in the engine's dtype on their device,
    one at a time, with each one's fp64 sum of squares kept on the device when
    `fingerprint` is on (read once after the load; an engine that cannot report
    its own has no use for it).

    Copy once: a tensor already in the engine's dtype is yielded as gathered
    (under `single`/DDP the live parameter itself), one in another dtype is
    converted once on its device (the engine's rounding, which the fingerprint
    must see). No engine keeps what it is given past `load_weights`: both copy
    it into their own storage (tests/test_engine_contract.py mutates the
    sources after a load), so a defensive copy here would be a second one."""

    def __init__(self, named: Iterator[tuple[str, torch.Tensor]], dtype: torch.dtype,
                 fingerprint: bool = True) -> None:
        self._named, self._dtype, self._fingerprint = named, dtype, fingerprint
        self.names: list[str] = []
        self._sums: list[tuple[str, torch.Tensor, int]] = []
        self._bytes = 0

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name, t in self._named:
            c = t.detach()
            if c.dtype != self._dtype:
                c = c.to(self._dtype)
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


def sync_line(index: int, timings: Mapping[str, float]) -> str:
    """One run.log line per weight sync (the controller's): the probe's diff against
    its tolerance when it ran (the first sync, then when due: rollout/probe.py),
    the bytes one engine loaded and every phase's seconds. A first GPU run's bf16
    kernels meet the calibrated tolerance here for the first time."""
    probe = (f"probe_diff {timings['probe_diff']:.4g} (tolerance {timings['probe_tolerance']:.4g})"
             if "probe_diff" in timings else "probe not due (fingerprint checked)")
    size = f", {timings['sync_mb']:.1f} MiB" if "sync_mb" in timings else ""
    times = ", ".join(f"{k} {v:.3f}" for k, v in timings.items() if k.endswith("_s"))
    return f"areno: weight sync {index}: {probe}{size}; {times}"


def log_sync(index: int, timings: dict[str, float]) -> dict[str, float]:
    """Write sync `index`'s line (sync_line) to run.log -> timings. fd 2, not
    sys.stderr: during a run fd 2 is run.log and sys.stderr the terminal (rundir/log.py)."""
    os.write(2, (sync_line(index, timings) + "\n").encode())
    return timings


def reports_fingerprint(engine: Any) -> bool:
    """Whether `engine` can report an exact fingerprint of what it holds (decided
    once: it turns on the stream's sums, the exact check and the probe schedule)."""
    return hasattr(engine, "weights_fingerprint") and getattr(engine, "fingerprint_exact", True)
