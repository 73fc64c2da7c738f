"""Peers and ReplyStream: the controller's side of the command pipes.

`Peers` holds the pipes and processes of one group of peers (the ranks, or
split placement's engine processes): it sends commands and reads replies with
`multiprocessing.connection.wait` over the result pipes AND the process
sentinels, in slices of at most a second, so a peer that raises is reported
with its traceback, one that is SIGKILLed at once, one whose heartbeat stops
within its bound; any of them aborts the owner (every process stopped, every
segment unlinked). Nothing blocks forever on a recv.

A `ReplyStream` is one command's replies: opened before its sends (each adds
its peer to `pending`), so an interrupt between a send and the first read still
finds the peers that owe replies. A message read goes to the inbox of the
oldest open stream its peer owes (a peer answers its commands in order), so
several streams may be out to the same peers: the asynchronous loop's rollouts
in flight. Those are `background` streams: whatever stream the controller waits
on, their peers are read too, and each background stream's `on_message` hook
runs after the read (outside the held block), also while the stream itself is
waited on, so the engines never block on a full pipe and their parts are
scored as they come, while the controller waits for the ranks or for them: the
ranks' Peers read the background streams of their `neighbours` (the engine
processes' Peers) too. The owners (TorchBackend, EngineProcs) and the loop-side
engine view (fleet/engines.py) use these objects, never each other's internals.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from multiprocessing.connection import Connection, wait
from typing import Any

from areno.procs.errors import USER_ERROR, BackendError, RankUserError
from areno.procs.heartbeat import HeartbeatWatch, stuck_rank_error
from areno.procs.signals import signals_held
from areno.procs.lifecycle import exit_text


class ReplyStream:
    """One command's replies: `pending` peers still owe their final "ok"."""

    def __init__(self, peers: "Peers", what: str, drain_s: float, pending: Iterable[int],
                 lane: str = "main", detach: bool = False, background: bool = False) -> None:
        self.peers, self.what, self.drain_s, self.lane = peers, what, drain_s, lane
        self.detach = detach  # abandoned: leave its peers running (see settle)
        self.background = background  # read during every wait (see the module docstring)
        self.pending: set[int] = set(pending)
        self.owed: set[int] = set(self.pending)  # every peer this stream was sent to
        self.inbox: deque[tuple[int, str, Any]] = deque()  # read, not yet consumed
        self.on_message: Callable[[], None] | None = None  # a background stream's consumer

    def send(self, rank: int, cmd: str, **kwargs) -> None:
        """Send `cmd` to `rank`, which now owes this stream its reply."""
        self.peers.send(self, rank, cmd, kwargs)

    def send_bytes(self, rank: int, data: Any) -> None:
        """Raw bytes after a command (a payload for a peer on another host)."""
        self.peers.conns[rank].send_bytes(data)

    def events(self, timeout_s: float) -> Iterator[tuple[int, str, Any]]:
        """Yield (rank, "part" | "ok", payload) as replies arrive, until every peer
        has sent its final "ok". Any error, death or timeout aborts the owner.
        So does a consumer that stops early (Ctrl-C while scoring a part, say),
        unless drain_s > 0 (commands that leave the trained weights as they were):
        then the rest of the replies are read for up to drain_s seconds and, if
        all come, the owner stays usable (e.g. to save the last finished step)."""
        try:
            deadline = time.monotonic() + timeout_s
            while self.pending or self.inbox:
                if not self.inbox:
                    self.peers.wait_some(self, deadline, timeout_s)
                while self.inbox:
                    yield self.inbox.popleft()
        finally:
            if not (self.background and self.pending):  # a background stream may be waited on again
                self.settle()

    def wait(self, until: float) -> bool:
        """Read (the background streams too) until every peer has answered (True) or
        time.monotonic() reaches `until` (False: the stream stays open). The
        messages stay in the inbox for events()."""
        while self.pending:
            if time.monotonic() >= until:
                return False
            self.peers.wait_some(self, until, 0.0, late_ok=True)
        return True

    def gather(self, timeout_s: float) -> list:
        """One reply per peer the command went to, in peer order."""
        results: dict[int, Any] = {}
        for r, kind, payload in self.events(timeout_s):
            if kind == "part":
                self.peers.abort()
                raise BackendError(f"{self.what}: rank {r} sent a streamed part to a plain command", rank=r)
            results[r] = payload
        return [results.get(r) for r in sorted(self.owed)]

    def settle(self) -> None:
        """End the replies once: drain what is left (drain_s > 0) or abort. Runs
        when events() finishes or is closed, or before the next command if the
        caller left it suspended (an exception raised while a part was being
        scored keeps the generator alive in its traceback)."""
        if self.peers.streams.get(self.lane) is not self:
            return
        del self.peers.streams[self.lane]
        if self.pending and self.detach:
            # A rollout of engine processes, dropped (Ctrl-C while it runs): the ranks
            # stay usable, so the run saves at once; its peers take no more commands.
            self.peers.stale.update(self.pending)
            return
        if self.pending and not (self.drain_s > 0 and self.peers.drain(self.what, self.pending, self.drain_s)):
            self.peers.abort()


class Peers:
    """Pipes `conns[r]` and processes `procs[r]` (empty: launched elsewhere) of the
    peers; `abort` tears the owner down, `is_closed` says whether it is."""

    def __init__(self, conns: list[Connection | None], procs: list, abort: Callable[[], None],
                 is_closed: Callable[[], bool], label: Callable[[int], str] = lambda r: f"rank {r}") -> None:
        self.conns, self.procs = conns, procs
        self.label = label  # how messages name peer r
        self.abort, self.is_closed = abort, is_closed
        self.beats: HeartbeatWatch | None = None  # watched once every peer said hello
        self.busy = False  # the main thread is waiting on the peers: it sees a death itself
        # One open stream per lane: "main" for commands to the ranks (and the engines,
        # synchronously); "rollout" for the asynchronous loop's rollout, which the
        # engine processes run while the ranks answer main-lane commands.
        self.streams: dict[str, ReplyStream] = {}
        self.stale: set[int] = set()  # peers that owe a detached stream its replies
        # Other groups whose background streams are read during this group's waits
        # (the engine processes' rollouts while the ranks train); a failure there
        # tears both down.
        self.neighbours: list[Peers] = []

    def open(self, what: str, drain_s: float = 0.0, pending: Iterable[int] = (),
             lane: str = "main", detach: bool = False, background: bool = False) -> ReplyStream:
        """A command's reply stream; an abandoned one of the same lane is settled first.
        detach: abandoning it leaves its peers running instead of draining them;
        background: its peers are read during every wait (the module docstring)."""
        if (old := self.streams.get(lane)) is not None:
            old.settle()
        self.streams[lane] = ReplyStream(self, what, drain_s, pending, lane, detach, background)
        return self.streams[lane]

    def broadcast(self, cmd: str, ranks: Iterable[int], *, drain_s: float = 0.0, **kwargs) -> ReplyStream:
        """Send `cmd` to every peer of `ranks` -> its reply stream."""
        stream = self.open(cmd, drain_s)
        for r in ranks:
            stream.send(r, cmd, **kwargs)
        return stream

    def send(self, stream: ReplyStream, rank: int, cmd: str, kwargs: dict) -> None:
        if self.streams.get(stream.lane) is not stream:  # opened by open(): an abandoned one was settled there
            raise RuntimeError(f"{cmd!r} sent on a stream that is not open")
        if rank in self.stale and not self.is_closed():
            raise BackendError(f"{cmd!r}: {self.label(rank)} is still in an abandoned command", rank=rank)
        self._write(rank, cmd, kwargs, stream)

    def post(self, rank: int, cmd: str, kwargs: dict) -> None:
        """Send `cmd` to `rank` with no reply owed (a peer that runs it on its
        command reader: procs.serve.queued_commands' immediate)."""
        self._write(rank, cmd, kwargs, None)

    def _write(self, rank: int, cmd: str, kwargs: dict, stream: ReplyStream | None) -> None:
        """The one write to a peer: sent whole (and owed to `stream`), or neither;
        a peer gone aborts the owner with the death it died."""
        if self.is_closed():
            raise BackendError("backend is closed (a rank failed or close() was called)")
        try:
            with signals_held():
                self.conns[rank].send((cmd, kwargs))
                if stream is not None:
                    stream.pending.add(rank)
                    stream.owed.add(rank)
        except (OSError, ValueError) as e:
            dead = [r for r, p in enumerate(self.procs) if p.exitcode is not None]
            err = (self.death(dead[0], cmd, []) if dead else
                   BackendError(f"{self.label(rank)}: cannot send {cmd!r} ({e}); it is gone", rank=rank))
            self.abort()
            raise err from None

    def drain(self, what: str, pending: set[int], drain_s: float) -> bool:
        """Read and drop replies until every pending peer has finished (True) or
        drain_s passed, a peer failed, or a second interrupt came (False)."""
        if self.is_closed():  # the watchdog already tore the owner down
            return False
        deadline = time.monotonic() + drain_s
        stream = ReplyStream(self, what, drain_s, pending)  # unregistered: it owns what it reads
        try:
            while stream.pending:
                self.wait_some(stream, deadline, drain_s)
        except (BackendError, KeyboardInterrupt, OSError, ValueError):
            return False
        return True

    def wait_some(self, stream: ReplyStream, deadline: float, timeout_s: float, late_ok: bool = False) -> None:
        """Wait (<= 1 s) for messages of `stream`'s pending peers and of every
        background stream's, and route each read to its owner's inbox (route);
        a peer whose final "ok" came leaves its owner's `pending` here, in the
        same held block as the read. Then the streams that got messages and have
        an on_message hook (a rollout in flight: it takes its own) run it.
        Raises BackendError for a peer's error, death or the deadline (late_ok:
        return instead). A torn-down owner (a second interrupt aborted it) has no
        pipes left to wait on: BackendError."""
        if self.is_closed():
            raise BackendError(f"{stream.what}: backend is closed (a rank failed or close() was called)")
        left = deadline - time.monotonic()
        if left <= 0:
            if late_ok:
                return
            flag = "--startup-timeout" if stream.what == "startup" else "--command-timeout"
            raise BackendError(f"{stream.what}: rank(s) {sorted(stream.pending)} did not answer "
                               f"within {timeout_s:g}s ({flag})")
        what = stream.what
        groups = [self, *self.neighbours]
        readers = self.readers(stream)
        sentinels = {p.sentinel: (g, r) for g in groups for r, p in enumerate(g.procs)}
        # Only while in here: a caller may hold a streamed command open for long
        # (scoring a part in-process), and then the watchdog must act. A death seen
        # here closes the owner before the flag drops, so the watchdog, which sees
        # the same sentinel, never interrupts a run that is already stopping.
        for g in groups:
            g.busy = True
        fed: list[ReplyStream] = []
        try:
            conns = {g.conns[r]: (g, r) for g, r in readers}
            ready = set(wait(list(conns) + list(sentinels), timeout=min(left, 1.0)))
            errors = []
            with signals_held():  # a reply read is a reply counted
                for c, (g, r) in conns.items():
                    if c in ready:
                        try:
                            msg = g.recv(r, what)
                        except BackendError as e:
                            errors.append(e)
                            continue
                        owner = g.route(r, msg, stream)
                        if owner.on_message is not None and owner not in fed:
                            fed.append(owner)
            dead = [gr for s, gr in sentinels.items() if s in ready]
            if errors and not dead and sentinels:
                # A peer's error is often the echo of another's death (gloo: "connection
                # closed by peer"); look briefly so the root cause is what gets reported.
                dead = [sentinels[s] for s in wait(list(sentinels), timeout=0.5)]
            err = (dead[0][0].death(dead[0][1], what, errors) if dead else errors[0] if errors else
                   next(filter(None, (stuck_rank_error(g.beats, g.procs, what, g.label) for g in groups)), None))
            if err is not None:
                for g in groups:
                    g.abort()
                raise err
        finally:
            for g in groups:
                g.busy = False
        for s in fed:  # outside the held block: a consumer may take its time (decode, submit)
            s.on_message()

    def readers(self, stream: ReplyStream) -> list[tuple["Peers", int]]:
        """Whom a wait on `stream` reads: its pending peers and, of this group and
        its neighbours, every background stream's; (group, peer index) pairs. A
        peer still in a dropped command (stale) is left out: what it sends is nobody's."""
        out = [(self, r) for r in sorted(stream.pending - self.stale)]
        for g in (self, *self.neighbours):
            owing = set().union(*(s.pending for s in g.streams.values() if s.background)) - g.stale
            out += [(g, r) for r in sorted(owing) if (g, r) not in out]
        return out

    def route(self, r: int, msg: tuple, waiting: ReplyStream) -> ReplyStream:
        """Put peer r's message into the inbox of the oldest open stream r owes a
        reply (`waiting` when none does: a settled stream draining) -> that stream.
        A part tagged "ahead" j belongs to the j-th stream after that one: an engine
        process that started a queued rollout inside the one it runs (tail fill,
        fleet/tail_fill.py) streams its parts before the older one's reply."""
        owing = [s for s in self.streams.values() if r in s.pending]
        ahead = msg[1].get("ahead", 0) if msg[0] == "part" and isinstance(msg[1], dict) else 0
        owner = owing[min(ahead, len(owing) - 1)] if owing else waiting
        owner.inbox.append((r, msg[0], msg[1]))
        if msg[0] == "ok":
            owner.pending.discard(r)
        return owner

    def death(self, r: int, what: str, echoes: list[BackendError]) -> BackendError:
        """The error for peer r's death: its own last words when it sent some, read
        now or in the wait that saw it exit (a peer that fails its start-up
        reports why, then ends at once)."""
        def said(e: BackendError) -> bool:  # an error it reported, not a broken pipe
            return bool(e.remote_traceback) or isinstance(e, RankUserError)

        own = [e for e in echoes if e.rank == r and said(e)]
        if own:
            return own[0]
        if self.conns[r] is not None and self.conns[r].poll(0):
            try:
                self.recv(r, what)
            except BackendError as e:
                if said(e):
                    return e
        p = self.procs[r]
        p.join(0.1)
        msg = f"{what}: {self.label(r)} (pid {p.pid}) died ({exit_text(p.exitcode)})"
        if echoes:
            msg += f"; then {echoes[0].remote_message}"
        return BackendError(msg, rank=r)

    def recv(self, r: int, what: str):
        try:
            msg = self.conns[r].recv()
        except (EOFError, OSError):
            raise BackendError(f"{what}: {self.label(r)} closed its connection (died?)", rank=r) from None
        if msg[0] == "err":
            _, rank, message, tb = msg
            if message.startswith(USER_ERROR):  # the user's to fix: their one line, exit 2
                raise RankUserError(message[len(USER_ERROR):], rank=rank)
            raise BackendError(f"{what}: {self.label(rank)} failed: {message}", rank=rank, remote_traceback=tb)
        return msg
