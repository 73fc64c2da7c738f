"""BackendError: what the controller raises when a rank fails."""

from __future__ import annotations


class BackendError(RuntimeError):
    """A rank failed (exception, death, timeout); the backend has been shut down."""

    def __init__(self, message: str, *, rank: int | None = None, remote_traceback: str | None = None):
        full = message if not remote_traceback else f"{message}\n--- rank {rank} traceback ---\n{remote_traceback}"
        super().__init__(full)
        self.rank = rank
        self.remote_message = message
        self.remote_traceback = remote_traceback
