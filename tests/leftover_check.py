"""A suite-wide check, after each test module, that nothing the module started
is still alive: no descendant process of this pytest process (or xdist worker)
and no areno shared-memory segment in /dev/shm made by one.

Every process the suite starts inherits ARENO_TEST_TAG (set once per worker),
so a grandchild that escaped its session is still found by its environment
(the fault harness's `tagged_pids`). A background thread records every tagged
pid it sees, which is how a segment left by a process that has since died is
traced back to this worker and not to the other one running beside it.
"""

from __future__ import annotations

import os
import shutil
import signal
import threading
import time
import uuid

import pytest

from areno.runtime.leftovers import NAME as SHM_NAME
from areno.runtime.leftovers import SHM_DIR
from faults import tagged_pids

TAG_VAR = "ARENO_TEST_TAG"
GRACE_S = 8.0  # a killed process needs a moment to be reaped; a closing rank to unlink
# Helpers this pytest process starts for itself and keeps for the session.
OWN_HELPERS = ("multiprocessing.resource_tracker", "multiprocessing.forkserver")


class Watch:
    """The tagged pids seen so far, recorded every 0.3 s by a daemon thread."""

    def __init__(self) -> None:
        self.tag = os.environ.setdefault(TAG_VAR, uuid.uuid4().hex)
        self.seen: set[int] = set()
        threading.Thread(target=self._poll, name="leftover-watch", daemon=True).start()

    def _poll(self) -> None:
        while True:
            self.seen |= set(tagged_pids(self.tag))
            time.sleep(0.3)

    def alive(self) -> dict[int, str]:
        """Live tagged processes other than this one and its own helpers."""
        me = os.getpid()
        return {p: c for p, c in tagged_pids(self.tag).items()
                if p != me and not any(h in c for h in OWN_HELPERS)}

    def segments(self) -> set[str]:
        """/dev/shm entries named after this process or a tagged pid seen."""
        owners = self.seen | {os.getpid()}
        try:
            names = os.listdir(SHM_DIR)
        except OSError:
            return set()
        return {n for n in names if (m := SHM_NAME.match(n)) and int(m.group(1)) in owners}


_watch: Watch | None = None


def watch() -> Watch:
    global _watch
    if _watch is None:
        _watch = Watch()
    return _watch


@pytest.fixture(scope="module", autouse=True)
def nothing_left_behind():
    """Fail the module's last test when a process or segment it made outlives it."""
    w = watch()
    before = w.segments()
    yield
    deadline = time.monotonic() + GRACE_S
    while True:
        procs, segs = w.alive(), w.segments() - before
        if not (procs or segs):
            return
        if time.monotonic() > deadline:
            break
        time.sleep(0.2)
    for pid in procs:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    for name in segs:
        shutil.rmtree(SHM_DIR / name, ignore_errors=True)
        (SHM_DIR / name).unlink(missing_ok=True)
    lines = [f"process {p}: {c[:200]}" for p, c in procs.items()] + [f"/dev/shm/{n}" for n in sorted(segs)]
    pytest.fail("left behind by this module:\n  " + "\n  ".join(lines), pytrace=False)
