"""One run per directory: an advisory lock on --output-dir and on the directory
its checkpoints go to (--save-path, or the default <output-dir>/checkpoints,
which another run's --save-path may name), held by the controller for the
run's whole life.

The lock is `fcntl.flock` on `DIR/.areno.lock`, which also names the holder's pid.
The kernel releases a flock when its holder dies, however it dies, so a second
run never waits on a dead one; the pid left in the file is how a take-over is
told apart from a clean start (a run that ends cleanly empties the file). Two
runs in one directory would interleave metrics.jsonl and race on checkpoints,
and a resume while the first run lives would delete checkpoints it is writing.

Multi-node runs lock on node 0 only: it alone runs the controller, which owns
the run directory (multinode.py).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import sys
from pathlib import Path
from typing import Iterator

from areno.errors import UserError

LOCK_FILE = ".areno.lock"


def _holder(fd: int) -> int | None:
    """The pid the lock file names (None: empty, a clean release)."""
    os.lseek(fd, 0, os.SEEK_SET)
    text = os.read(fd, 64).decode(errors="replace").strip()
    return int(text) if text.isdigit() else None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's process
    return True


def acquire(directory: Path, flag: str) -> int:
    """Lock `directory` (made if missing) for this process; returns the lock's fd.
    UserError naming the holder's pid when a live run holds it, or when the
    directory cannot be written (flag: the option that named it)."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
        fd = os.open(directory / LOCK_FILE, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    except OSError as e:
        raise UserError(f"{flag} {directory}: cannot write there ({e.strerror})") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        pid = _holder(fd)
        os.close(fd)
        who = f"pid {pid}" if pid is not None else "another process"
        raise UserError(f"{flag} {directory} is in use by another areno run ({who}): wait for it "
                        f"to end (or stop it), or choose another {flag}") from None
    left = _holder(fd)
    if left is not None and left != os.getpid():
        state = "no longer runs" if not _alive(left) else "no longer holds it"
        print(f"areno: taking over the lock on {directory} left by pid {left}, which {state}",
              file=sys.stderr, flush=True)
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd


def release(fd: int) -> None:
    """Empty the lock file (a clean end: the next run starts without a take-over), unlock."""
    with contextlib.suppress(OSError):
        os.ftruncate(fd, 0)
        # Explicitly: a forked child (a reward worker) shares the open file, and
        # closing only our descriptor would leave the lock held in its name.
        fcntl.flock(fd, fcntl.LOCK_UN)
    os.close(fd)


@contextlib.contextmanager
def hold(directories: list[tuple[Path, str]]) -> Iterator[None]:
    """Lock each (directory, flag) in turn, the same directory once; release on exit."""
    fds: list[int] = []
    seen: set[Path] = set()
    try:
        for directory, flag in directories:
            key = directory.expanduser().resolve()
            if key not in seen:
                seen.add(key)
                fds.append(acquire(directory, flag))
        yield
    finally:
        for fd in reversed(fds):
            release(fd)
