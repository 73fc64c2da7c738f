"""Tests that must run with no other test beside them (`@pytest.mark.alone`),
under pytest-xdist: a readers-writer lock on one file that all workers share.

Every test holds the lock shared while it runs; an `alone` test holds it
exclusively. A turnstile lock taken first keeps a waiting `alone` test from
being starved by the other worker's stream of shared holders (flock has no
writer preference of its own). Without xdist there is one process and the
locks never wait.

The lock is held around the whole test protocol (setup, call, teardown), not
by a fixture: a module-scoped fixture is set up before any function-scoped
one, so a fixture lock let a module's training run (test_resume's, 2 minutes)
run beside an `alone` test.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

import pytest


def _lock_dir(config: pytest.Config) -> Path:
    root = config._tmp_path_factory.getbasetemp()  # type: ignore[attr-defined]  # pytest's tmp_path plugin
    return root.parent if os.environ.get("PYTEST_XDIST_WORKER") else root


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    d = _lock_dir(item.config)
    alone = item.get_closest_marker("alone") is not None
    with open(d / ".areno-turnstile.lock", "a") as turn, open(d / ".areno-tests.lock", "a") as main:
        fcntl.flock(turn, fcntl.LOCK_EX)
        try:
            fcntl.flock(main, fcntl.LOCK_EX if alone else fcntl.LOCK_SH)
        finally:
            if not alone:
                fcntl.flock(turn, fcntl.LOCK_UN)
        try:
            yield
        finally:
            fcntl.flock(main, fcntl.LOCK_UN)
            if alone:
                fcntl.flock(turn, fcntl.LOCK_UN)
