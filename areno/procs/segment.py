"""Shared-memory segments: the controller creates and owns them (`ShmSegment`,
created with `SharedMemory(create=True)`, so multiprocessing's resource tracker
unlinks them even if the controller is SIGKILLed); peers map a region of one
with plain `mmap` (`map_region`), which never registers it with a tracker that
would unlink it when the peer exits. Names start with SHM_PREFIX and the owner's
pid, so the leftovers of a dead run can be found (runtime/leftovers.py)."""

from __future__ import annotations

import mmap
import os
import secrets
from multiprocessing import shared_memory

SHM_PREFIX = "areno-bk-"
SHM_DIR = "/dev/shm"
PAGE = mmap.ALLOCATIONGRANULARITY


def round_up(n: int, a: int) -> int:
    return (n + a - 1) // a * a


def shm_name(tag: str) -> str:
    """A fresh segment name `areno-bk-<pid>-<random>-<tag>` (pid: whose it is)."""
    return f"{SHM_PREFIX}{os.getpid()}-{secrets.token_hex(4)}-{tag}"


class ShmSegment:
    """A controller-owned shared-memory segment that grows on demand."""

    def __init__(self, tag: str) -> None:
        self.tag = tag
        self._shm: shared_memory.SharedMemory | None = None

    @property
    def name(self) -> str:
        assert self._shm is not None, "segment not allocated"
        return self._shm.name.lstrip("/")

    @property
    def size(self) -> int:
        return self._shm.size if self._shm is not None else 0

    @property
    def buf(self) -> memoryview:
        assert self._shm is not None, "segment not allocated"
        return self._shm.buf

    def ensure(self, nbytes: int, headroom: float = 0.25) -> bool:
        """Make the segment at least nbytes; returns True when it was (re)created."""
        if self._shm is not None and self._shm.size >= nbytes:
            return False
        self.unlink()
        size = round_up(max(int(nbytes * (1.0 + headroom)), PAGE), PAGE)
        check_room(size)
        self._shm = shared_memory.SharedMemory(name=shm_name(self.tag), create=True, size=size)
        return True

    def unlink(self) -> None:
        """Close and unlink (idempotent). Views handed out must be dropped first;
        if one is still alive, the name is unlinked anyway and the memory goes
        when the last view does."""
        shm, self._shm = self._shm, None
        if shm is None:
            return
        try:
            shm.unlink()
        except FileNotFoundError:
            pass
        try:
            shm.close()
        except BufferError:  # a view still exports the buffer; freed with it
            pass


def check_room(size: int) -> None:
    """A too-small /dev/shm (docker's default is 64 MB) would SIGBUS on the first
    write past its end; fail with a clear message instead."""
    try:
        st = os.statvfs(SHM_DIR)
    except OSError:
        return
    free = st.f_bavail * st.f_frsize
    if free < size:
        raise OSError(
            f"{SHM_DIR} has {free / 2**20:.0f} MiB free, the backend needs {size / 2**20:.0f} MiB "
            "for one shared-memory segment; enlarge it (docker: --shm-size=16g)"
        )


def map_region(segment: str, offset: int, nbytes: int, *, writable: bool = False) -> mmap.mmap:
    """Map [offset, offset+nbytes) of /dev/shm/<segment>, page-aligned start.

    Read side: copy-on-write (reads share the controller's pages; the tensors
    built on it are writable without touching the controller's copy).
    writable=True: a shared writable mapping (rank 0 writing exported weights).
    """
    start = offset - offset % PAGE
    fd = os.open(os.path.join(SHM_DIR, segment), os.O_RDWR if writable else os.O_RDONLY)
    try:
        access = mmap.ACCESS_WRITE if writable else mmap.ACCESS_COPY
        return mmap.mmap(fd, max(offset - start + nbytes, 1), access=access, offset=start)
    finally:
        os.close(fd)
