"""Shared-memory hand-off of a SplitPack from the controller to its ranks.

The controller copies each step's pack ONCE into one POSIX shared-memory
segment, laid out rank-major: rank r's region holds its own token range of
every per-token field and its own sequences' per-sequence fields, starting on a
page boundary. Each rank then receives only a small `RankHandoff` (segment
name, region offset/size, field offsets, its micro-batch boundaries as a
[K, M, 2] int64 array) and mmaps exactly its region: no per-token Python
object is built or pickled anywhere, and no rank reads another rank's share.

The segment is reused across steps and only replaced when a bigger pack comes
(grown by 25% of headroom), so a steady run pays the creation cost once. The
controller owns every segment (created with `SharedMemory(create=True)`, so
multiprocessing's resource tracker unlinks them even if the controller is
SIGKILLed); ranks open `/dev/shm/<name>` read-only with plain `mmap`, which
never registers them with a tracker that would unlink them on rank exit.

Remote ranks (torchrun on another node, see docs/BACKEND.md) get the same
region as one raw bytes message instead (`RankHandoff.segment is None`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from areno.pack import PACKED_TOKEN_FIELDS, TrainPack
from areno.procs.segment import PAGE as _PAGE, ShmSegment, map_region, round_up as _round_up
from areno.split import SplitPack

SEQ_FIELDS: tuple[str, ...] = ("cu_seqlens", "seq_weights", "sample_index")
_ALIGN = 64  # field alignment inside a region (cache line)
@dataclass(frozen=True)
class FieldSpec:
    name: str
    dtype: str       # torch dtype name, e.g. "int32"
    offset: int      # bytes from the region start
    numel: int


@dataclass(frozen=True)
class RankHandoff:
    """What one rank receives for one step (small; pickled through its pipe)."""

    segment: str | None   # shm name; None when the region follows as a bytes message
    offset: int           # byte offset of the region in the segment (page aligned)
    nbytes: int
    fields: tuple[FieldSpec, ...]
    micro_seqs: np.ndarray  # [K, M, 2] int64 micro-batch [start, stop) in rank-local seqs
    num_tokens: int
    num_seqs: int


def _dtype(name: str) -> torch.dtype:
    return getattr(torch, name)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _region_fields(pack: TrainPack, n_tok: int, n_seq: int) -> tuple[list[FieldSpec], int]:
    specs, off = [], 0
    for name in PACKED_TOKEN_FIELDS + SEQ_FIELDS:
        t = getattr(pack, name)
        numel = n_seq + 1 if name == "cu_seqlens" else (n_seq if name in SEQ_FIELDS else n_tok)
        specs.append(FieldSpec(name, _dtype_name(t.dtype), off, numel))
        off = _round_up(off + numel * t.element_size(), _ALIGN)
    return specs, off


class PackWriter:
    """Controller side: writes a SplitPack into one reusable segment, per-rank regions."""

    def __init__(self, tag: str = "pack") -> None:
        self.segment = ShmSegment(tag)
        self.grew = 0  # how many times the segment was (re)created

    def layout(self, split: SplitPack) -> list[tuple[int, int, int, int, list[FieldSpec], int]]:
        """Per rank: (seq0, seq1, tok0, tok1, fields, region bytes)."""
        cu = split.pack.cu_seqlens
        out = []
        for r in range(split.world_size):
            s0, s1 = split.rank_seq_range(r)
            t0, t1 = int(cu[s0]), int(cu[s1])
            fields, nbytes = _region_fields(split.pack, t1 - t0, s1 - s0)
            out.append((s0, s1, t0, t1, fields, nbytes))
        return out

    def write(self, split: SplitPack) -> list[RankHandoff]:
        """Copy the pack into shared memory (one copy per field per rank range)."""
        lay = self.layout(split)
        offsets, total = [], 0
        for *_, nbytes in lay:
            offsets.append(total)
            total = _round_up(total + nbytes, _PAGE)
        if self.segment.ensure(max(total, 1)):
            self.grew += 1
        pack = split.pack
        out = []
        for r, (s0, s1, t0, t1, fields, nbytes) in enumerate(lay):
            base = offsets[r]
            for f in fields:
                src = getattr(pack, f.name)
                if f.name == "cu_seqlens":
                    src = src[s0 : s1 + 1] - src[s0]
                elif f.name in SEQ_FIELDS:
                    src = src[s0:s1]
                else:
                    src = src[t0:t1]
                # numpy's copy is a plain single-threaded memcpy: torch's copy_ would open
                # an OpenMP region, which stalls for whole scheduler slices on a busy host
                dst = np.frombuffer(self.segment.buf, dtype=src.numpy().dtype, count=f.numel,
                                    offset=base + f.offset)
                np.copyto(dst, src.numpy())
            out.append(RankHandoff(
                segment=self.segment.name, offset=base, nbytes=nbytes, fields=tuple(fields),
                micro_seqs=np.ascontiguousarray(split.plan.micro_seqs[r] - s0),
                num_tokens=t1 - t0, num_seqs=s1 - s0,
            ))
        return out

    def region_bytes(self, h: RankHandoff) -> memoryview:
        """The bytes of one rank's region (for ranks that cannot map the segment)."""
        return self.segment.buf[h.offset : h.offset + h.nbytes]

    def close(self) -> None:
        self.segment.unlink()


class LocalPack:
    """Rank side: this rank's share of a step, as zero-copy tensor views.

    pack:       TrainPack of this rank's sequences (rank-local seq numbering)
    micro_seqs: [K, M, 2] int64
    """

    def __init__(self, h: RankHandoff, payload: bytes | bytearray | None = None) -> None:
        if payload is not None:
            buf, skew = payload, 0
        else:
            assert h.segment is not None, "handoff has no segment and no payload"
            buf = map_region(h.segment, h.offset, h.nbytes)
            skew = h.offset % _PAGE
        self._buf = buf
        views = {}
        for f in h.fields:
            dt = _dtype(f.dtype)
            views[f.name] = (
                torch.frombuffer(buf, dtype=dt, count=f.numel, offset=skew + f.offset)
                if f.numel else torch.empty(0, dtype=dt)
            )
        self.pack = TrainPack(**views)
        self.micro_seqs = h.micro_seqs

    @property
    def num_minibatches(self) -> int:
        return int(self.micro_seqs.shape[0])

    @property
    def num_micro(self) -> int:
        return int(self.micro_seqs.shape[1])

    def micro(self, k: int, m: int) -> TrainPack:
        a, b = self.micro_seqs[k, m]
        return self.pack.slice_seqs(int(a), int(b))


