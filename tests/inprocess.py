"""`areno ARGS` run in the test's own process (`areno.cli.main`, what `python -m
areno.cli` calls), returned as the subprocess's CompletedProcess would be.

A subprocess pays the CLI's start-up (python, torch, transformers) on every run,
seconds each on 2 busy cores; here the test process has them imported. The ranks
and engine processes are spawned as in any run. What only a real process shows
(signals, a crash, the interpreter's exit, what is left after a kill) stays with
test_resume.cli.

fds 1 and 2 and sys.stdout/sys.stderr point at files for the run (the CLI's own
lines and what third-party code writes before the run log opens), which become
.stdout and .stderr. The environment is put back as it was (a run sets process-wide
defaults, TOKENIZERS_PARALLELISM and the like, which a subprocess would keep to
itself). Afterwards the rest of the process must be as it was: the signal
handlers and mask, the working directory, fds 1 and 2, the standard streams and
no new non-daemon thread. A difference fails the test that ran it (it would
leak into every later test of this worker)."""

from __future__ import annotations

import contextlib
import io
import os
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

from areno.procs.signals import HELD

REPO = Path(__file__).resolve().parents[1]
# COLUMNS: rich would wrap the console lines at 80 columns in a file.
RUN_ENV = {"COLUMNS": "500", "PYTHONUNBUFFERED": "1"}


def run_here(args: list[str], cache: Path | None = None,
             env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """`areno ARGS` in this process, from the repository root, with the session's
    tiny-model cache and `env` added to the environment for the run ->
    CompletedProcess(args, returncode, stdout, stderr)."""
    from areno.cli import main

    extra = {**RUN_ENV, **({"ARENO_CACHE": str(cache)} if cache is not None else {}), **(env or {})}
    before = process_state()
    with _environ(extra), _cwd(REPO), _captured() as (out, err):
        try:
            rc = main(list(args))
        except SystemExit as e:  # as the interpreter would turn it into an exit status
            rc = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    after = process_state()
    leaked = {k: (before[k], after[k]) for k in before if before[k] != after[k]}
    assert not leaked, f"`areno {' '.join(args)}` in-process changed this process: {leaked}"
    return subprocess.CompletedProcess(args, rc if rc is not None else 0, out.read(), err.read())


def process_state() -> dict[str, object]:
    """What a run in this process must leave as it found it."""
    fds = []
    for fd in (1, 2):
        st = os.fstat(fd)
        fds.append((st.st_dev, st.st_ino))
    return {
        "signal handlers": {s.name: signal.getsignal(s) for s in HELD},
        "signal mask": sorted(signal.pthread_sigmask(signal.SIG_BLOCK, [])),
        "cwd": os.getcwd(),
        "fds 1, 2": fds,
        "sys.stdout, sys.stderr": (id(sys.stdout), id(sys.stderr)),
        "non-daemon threads": sorted(t.name for t in threading.enumerate() if not t.daemon),
    }


@contextlib.contextmanager
def _environ(values: dict[str, str]) -> Iterator[None]:
    """os.environ plus `values` in the block; exactly the old one after it."""
    old = dict(os.environ)
    os.environ.update(values)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(old)


@contextlib.contextmanager
def _cwd(path: Path) -> Iterator[None]:
    old = os.getcwd()
    os.chdir(path)
    try:
        yield
    finally:
        os.chdir(old)


@contextlib.contextmanager
def _captured() -> Iterator[tuple[io.TextIOBase, io.TextIOBase]]:
    """fds 1, 2 and sys.stdout, sys.stderr -> two temporary files, yielded as text
    streams that are read from the start once the block ends."""
    files = [tempfile.TemporaryFile(), tempfile.TemporaryFile()]
    old_streams = sys.stdout, sys.stderr
    for s in old_streams:
        s.flush()
    saved = [os.dup(1), os.dup(2)]
    streams = [io.TextIOWrapper(io.FileIO(os.dup(f.fileno()), "w"), encoding="utf-8", errors="replace",
                                line_buffering=True, write_through=True) for f in files]
    readers = [io.StringIO(), io.StringIO()]
    try:
        os.dup2(files[0].fileno(), 1)
        os.dup2(files[1].fileno(), 2)
        sys.stdout, sys.stderr = streams
        yield readers[0], readers[1]
    finally:
        for s in streams:
            s.flush()
        sys.stdout, sys.stderr = old_streams
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for fd in saved:
            os.close(fd)
        for s, f, r in zip(streams, files, readers):
            s.close()
            f.seek(0)
            r.write(f.read().decode("utf-8", errors="replace"))
            r.seek(0)
            f.close()
