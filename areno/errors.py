"""Errors that are the user's to fix, and loading the user's Python files.

A `UserError` is a user mistake: a bad flag, a missing file, a malformed
dataset row, a broken reward plugin. The CLI catches it and prints its message
as one line with exit code 2 and no traceback, so the message must stand alone:
name the culprit (flag, file, row index and field), the bad value, and the fix.

Internal invariants are asserts or ValueError, never UserError: a traceback is
the right output for a bug in areno.
"""

from __future__ import annotations

import hashlib
import os
import sys
import traceback
from pathlib import Path
from types import ModuleType


class UserError(Exception):
    """A user mistake, reported as one line (exit code 2, no traceback)."""

    def __init__(self, message: str) -> None:
        # One line: the CLI prints str(exc) as is.
        super().__init__(" ".join(str(message).split()))


class SignalInterrupt(KeyboardInterrupt):
    """The KeyboardInterrupt areno's own signal handler raises (Ctrl-C, SIGTERM,
    SIGHUP: areno/procs/signals.py), told apart from one a user's code raises."""


def is_signal_interrupt(e: BaseException) -> bool:
    """e came from a signal (stop the run), not from user code (its error).
    Under Python's default SIGINT handler a real Ctrl-C is a plain
    KeyboardInterrupt, so there every one counts as a signal."""
    import signal

    return isinstance(e, SignalInterrupt) or (
        isinstance(e, KeyboardInterrupt) and signal.getsignal(signal.SIGINT) is signal.default_int_handler)


def one_line(exc: BaseException, limit: int = 300) -> str:
    """`Type: message` on one line, cut to `limit` characters."""
    text = " ".join(str(exc).split())
    out = f"{type(exc).__name__}: {text}" if text else type(exc).__name__
    return out if len(out) <= limit else out[: limit - 3] + "..."


def import_user_file(path: str | os.PathLike, *, what: str) -> ModuleType:
    """Import the Python file `path` (a reward plugin, a row loader) as a fresh module.

    Every failure is a UserError naming `what` and the file: missing file, not a
    .py file, syntax error (with its line), an exception while importing (with
    the plugin line it came from). The module is registered in sys.modules under
    a name unique to the file's path, so classes it defines pickle by reference.
    """
    p = Path(path).expanduser()
    if not p.is_file():
        raise UserError(f"{what} not found: {path} (no such file)")
    if p.suffix != ".py":
        raise UserError(f"{what} must be a Python file ending in .py: {path}")
    p = p.resolve()
    try:
        source = p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"{what} {path}: cannot read it: {one_line(e)}") from None
    # Same path and same text -> same module (imported once per process).
    digest = hashlib.sha1(f"{p}\0{source}".encode()).hexdigest()[:12]
    name = f"_areno_user_{digest}_{p.stem}"
    if name in sys.modules:
        return sys.modules[name]
    try:
        code = compile(source, str(p), "exec")
    except SyntaxError as e:
        raise UserError(f"{what} {path}: syntax error at line {e.lineno}: {e.msg}") from None
    module = ModuleType(name)
    module.__file__ = str(p)
    sys.modules[name] = module
    try:
        exec(code, module.__dict__)
    except BaseException as e:  # noqa: BLE001 - SystemExit from a plugin is its error too
        del sys.modules[name]
        if is_signal_interrupt(e):
            raise
        raise UserError(f"{what} {path} failed to import: {one_line(e)}{user_frame(e, p)}") from None
    return module


def user_frame(exc: BaseException, path: str | os.PathLike) -> str:
    """' (file.py:LINE)' for the innermost traceback frame in `path`, else ''."""
    target = str(Path(path).resolve())
    line = None
    for frame in traceback.extract_tb(exc.__traceback__):
        if frame.filename == target:
            line = frame.lineno
    return f" ({Path(target).name}:{line})" if line is not None else ""
