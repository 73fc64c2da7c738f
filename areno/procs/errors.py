"""BackendError: what the controller raises when a rank fails."""

from __future__ import annotations

from areno.errors import UserError

# How a rank reports a UserError (rank._reply_error: "Type: message").
USER_ERROR = f"{UserError.__name__}: "


class BackendError(RuntimeError):
    """A rank failed (exception, death, timeout); the backend has been shut down."""

    def __init__(self, message: str, *, rank: int | None = None, remote_traceback: str | None = None):
        full = message if not remote_traceback else f"{message}\n--- rank {rank} traceback ---\n{remote_traceback}"
        super().__init__(full)
        self.rank = rank
        self.remote_message = message
        self.remote_traceback = remote_traceback


class RankUserError(BackendError, UserError):
    """A rank found a user mistake (e.g. the engine's memory budget at start-up):
    the CLI reports the rank's message as one line with exit code 2, and the
    backend still treats it as a failed rank (it has been shut down)."""

    def __init__(self, message: str, *, rank: int | None = None):
        BackendError.__init__(self, message, rank=rank)
