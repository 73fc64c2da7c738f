"""Shared memory left behind by areno processes that died without cleaning up.

Every areno segment or directory in /dev/shm is named `areno-<kind>-<pid>-...`
after the process that made it (`areno-bk-*`: the backend's hand-off segments;
`areno-weights-*`: the rollout engine's weight files). A SIGKILLed controller
cannot unlink them, and they hold RAM until reboot. At start-up each run
removes those of its user whose owner is gone.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

SHM_DIR = Path("/dev/shm")
NAME = re.compile(r"^areno-[a-z]+-(\d+)-")
CLOCK_SLACK_S = 2.0  # process start times and mtimes have coarse, different clocks


def owner_alive(pid: int, made_at: float) -> bool:
    """pid is a live process that existed when the segment was last written (a
    pid reused by a later process is not the owner)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process: alive, and not ours to judge
    import psutil

    try:
        proc = psutil.Process(pid)
        return proc.status() != psutil.STATUS_ZOMBIE and proc.create_time() <= made_at + CLOCK_SLACK_S
    except psutil.Error:
        return False


def remove_dead_segments(shm_dir: Path = SHM_DIR) -> list[tuple[Path, int]]:
    """Remove this user's areno entries in shm_dir whose owner is dead; returns
    (path, bytes) of each one removed."""
    removed = []
    try:
        entries = list(Path(shm_dir).iterdir())
    except OSError:
        return removed
    for p in entries:
        m = NAME.match(p.name)
        if not m:
            continue
        try:
            st = p.lstat()
            if st.st_uid != os.getuid() or owner_alive(int(m.group(1)), st.st_mtime):
                continue
            size = _size(p)
            if p.is_dir() and not p.is_symlink():
                shutil.rmtree(p)
            else:
                p.unlink()
        except OSError:  # gone meanwhile, or not ours to remove
            continue
        removed.append((p, size))
    return removed


def _size(p: Path) -> int:
    if not p.is_dir():
        return p.lstat().st_size
    return sum(f.lstat().st_size for f in p.rglob("*") if f.is_file())


def clean_leftovers() -> None:
    """remove_dead_segments() on /dev/shm, said in one line when it found any."""
    removed = remove_dead_segments()
    if removed:
        total = sum(n for _, n in removed)
        print(f"areno: removed {len(removed)} shared-memory segment(s) left by dead areno "
              f"processes ({total / 2**20:.1f} MiB): {', '.join(p.name for p, _ in removed)}",
              flush=True)
