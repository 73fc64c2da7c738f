"""Third-party output goes to RUN_DIR/run.log; the terminal shows areno's lines.

vLLM, torch, Triton and transformers print notices, FutureWarnings, NUMA
warnings and progress bars, from Python and from C++, in this process and in
every child (ranks, reward workers, vLLM's engine). While a run is open
(`third_party_to_log`), unless --verbose:

* file descriptors 1 and 2 point at run.log, so C-level writes, handlers bound
  to the old sys.stdout/sys.stderr and every child process (which inherits
  them) write there; children also honour ARENO_RUN_LOG
  (`redirect_child_output`), for those started some other way;
* sys.stdout and sys.stderr are new streams on the terminal: areno's own lines
  (the step line, one-line errors, tracebacks of areno bugs) stay on screen;
* Python warnings, logging without a handler of its own (transformers' and
  vLLM's loggers propagate there) go to run.log, and so do tqdm bars made in
  this process; transformers' and the Hub's progress bars are off.
"""

from __future__ import annotations

import contextlib
import functools
import io
import logging
import os
import sys
import warnings
from pathlib import Path
from typing import Any, Iterator, TextIO

ENV = "ARENO_RUN_LOG"
LOG_NAME = "run.log"
# Set for the whole process (children inherit them): quiet by default.
QUIET_ENV = {"HF_HUB_DISABLE_PROGRESS_BARS": "1", "VLLM_CONFIGURE_LOGGING": "0",
             "TRANSFORMERS_NO_ADVISORY_WARNINGS": "1"}


def redirect_child_output() -> None:
    """In a child process areno starts: fds 1 and 2 to $ARENO_RUN_LOG, if set."""
    path = os.environ.get(ENV)
    if not path:
        return
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    except OSError:  # another host (torchrun), or the directory is gone: keep the terminal
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)


def move_child_output(path: str) -> None:
    """In a child started before the run directory existed (runtime/early.py):
    the lines of its temporary log ($ARENO_RUN_LOG) go to `path`, the run's
    run.log, where fds 1 and 2 then point and its own children write; the
    temporary log is removed. No-op where the log did not change."""
    old = os.environ.get(ENV)
    if not old or old == path or not path:
        return
    sys.stdout.flush()
    sys.stderr.flush()
    with contextlib.suppress(OSError), open(old, "rb") as src, open(path, "ab") as dst:
        dst.write(src.read())
    os.environ[ENV] = path
    redirect_child_output()
    with contextlib.suppress(OSError):
        os.unlink(old)


@contextlib.contextmanager
def third_party_to_log(run_dir: Path, verbose: bool) -> Iterator[Path | None]:
    """While open, third-party output goes to run_dir/run.log (see module doc);
    yields its path, or None with --verbose (nothing changes)."""
    if verbose:
        os.environ.pop(ENV, None)
        yield None
        return
    path = Path(run_dir) / LOG_NAME
    with contextlib.ExitStack() as stack:
        log = stack.enter_context(open(path, "a", buffering=1))
        stack.enter_context(_fds_to(log))
        stack.enter_context(_env({ENV: str(path.absolute()), **QUIET_ENV}))
        stack.enter_context(_python_to(log))
        stack.enter_context(_tqdm_to(log))
        yield path


@contextlib.contextmanager
def _fds_to(log: TextIO) -> Iterator[None]:
    """fds 1, 2 -> log; sys.stdout/sys.stderr -> streams on the old fds 1, 2."""
    old_streams = sys.stdout, sys.stderr
    for s in old_streams:
        s.flush()
    saved = [os.dup(1), os.dup(2)]
    term = [_stream(os.dup(fd), like) for fd, like in zip(saved, old_streams)]
    os.dup2(log.fileno(), 1)
    os.dup2(log.fileno(), 2)
    sys.stdout, sys.stderr = term
    try:
        yield
    finally:
        for s in term:
            s.flush()
        old_streams[0].flush()
        old_streams[1].flush()
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for fd in saved:
            os.close(fd)
        sys.stdout, sys.stderr = old_streams
        for s in term:
            s.close()


def _stream(fd: int, like: TextIO) -> TextIO:
    enc = getattr(like, "encoding", None) or "utf-8"
    return io.TextIOWrapper(io.FileIO(fd, "w"), encoding=enc, errors="replace",
                            line_buffering=True, write_through=True)


@contextlib.contextmanager
def _env(values: dict[str, str]) -> Iterator[None]:
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@contextlib.contextmanager
def _python_to(log: TextIO) -> Iterator[None]:
    """warnings and handler-less logging -> log; transformers logs propagate there."""
    old_show, old_last = warnings.showwarning, logging.lastResort

    def show(message: Any, category: Any, filename: str, lineno: int, file: Any = None,
             line: Any = None) -> None:
        log.write(warnings.formatwarning(message, category, filename, lineno, line))

    warnings.showwarning = show
    handler = logging.StreamHandler(log)
    handler.setLevel(logging.WARNING)
    logging.lastResort = handler
    hf = _transformers_logging()
    bars = hf is not None and hf.is_progress_bar_enabled()
    if hf is not None:
        hf.disable_default_handler()
        hf.enable_propagation()
        hf.disable_progress_bar()
    try:
        yield
    finally:
        warnings.showwarning, logging.lastResort = old_show, old_last
        if hf is not None:
            hf.enable_default_handler()
            hf.disable_propagation()
            if bars:
                hf.enable_progress_bar()


@contextlib.contextmanager
def _tqdm_to(log: TextIO) -> Iterator[None]:
    """tqdm bars made in this process without a file of their own (vLLM's weight
    loading, when its engine runs here) draw into log instead of sys.stderr."""
    try:
        from tqdm import std
    except ImportError:
        yield
        return
    original = std.tqdm.__init__

    @functools.wraps(original)
    def init(self: Any, *args: Any, **kwargs: Any) -> None:
        if len(args) < 5 and kwargs.get("file") is None:  # file: the 5th positional
            kwargs["file"] = log
        original(self, *args, **kwargs)

    std.tqdm.__init__ = init
    try:
        yield
    finally:
        std.tqdm.__init__ = original


def _transformers_logging() -> Any:
    try:
        from transformers.utils import logging as hf_logging
    except ImportError:
        return None
    return hf_logging
