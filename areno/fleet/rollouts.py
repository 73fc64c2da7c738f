"""A rollout on the engine peers, once sent (fleet/engines.py, PeerEngines.start_rollout):
how it was split (RolloutPlan), its finished parts as they come (Parts, or a
sink that scores them), and the handle the scheduler waits on, collects or
drops (PendingRollout)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from areno.metrics import INFLIGHT_COUNTS
from areno.procs.replies import ReplyStream
from areno.procs.signals import signals_held
from areno.rollout.batch import RolloutBatch

if TYPE_CHECKING:
    from areno.fleet.engines import PeerEngines
    from areno.procs.segment import ShmSegment


@dataclass(frozen=True)
class RolloutPlan:
    """How one rollout was split: the validated prompts (CSR), n, and per engine
    group its prompt positions, region start (bytes) and capacity (tokens)."""

    ids: np.ndarray
    offsets: np.ndarray
    n: int
    members: list[np.ndarray]
    starts: list[int]
    caps: list[int]
    segment: "ShmSegment"  # where the engines write the token ids and log-probs


class Parts:
    """A rollout's finished parts as they come -> the batch in prompt order (merge).
    add = keep (the batch) + score (nothing here; scoring.PartScorer's decode and
    rewards), two steps so that an interrupt between them loses no part.
    arrived: when each part was kept (time.monotonic: the order groups finished
    in, --partial-rollouts' batches); result(i): part i's rewards (None: not
    scored here, the taker scores it)."""

    def __init__(self) -> None:
        self.parts: list[RolloutBatch] = []
        self.positions: list[np.ndarray] = []
        self.arrived: list[float] = []

    def add(self, pos: np.ndarray, part: RolloutBatch) -> None:
        self.keep(pos, part)
        self.score(pos, part)

    def keep(self, pos: np.ndarray, part: RolloutBatch, meta: dict | None = None) -> None:
        """meta: the engine's message for the part (what else it carries: an episode's rewards)."""
        self.parts.append(part)
        self.positions.append(pos)
        self.arrived.append(time.monotonic())

    def score(self, pos: np.ndarray, part: RolloutBatch) -> None:
        """Work on a kept part (none here)."""

    def result(self, i: int) -> Any:
        """Part i's RewardResult, None here (nothing scored)."""
        return None

    def merge(self) -> tuple[RolloutBatch, np.ndarray]:
        """(the batch in prompt order, the permutation from arrival order to it)."""
        return RolloutBatch.merge_parts(self.parts, self.positions)


class PartSink(Protocol):
    def keep(self, pos: np.ndarray, part: RolloutBatch, meta: dict | None = None) -> None: ...

    def score(self, pos: np.ndarray, part: RolloutBatch) -> None: ...


class Episodes(Protocol):
    """A multi-turn rollout's arguments for the engine processes (scheduler.py)."""

    spec: Any  # envs.driver.EpisodeSpec

    def share(self, g: int, num_engines: int, positions: np.ndarray) -> dict: ...


class PendingRollout:
    """A rollout the engine processes are generating (PeerEngines.start_rollout);
    its parts go to `sink` as they are read (consume)."""

    def __init__(self, engines: "PeerEngines", stream: ReplyStream, plan: RolloutPlan, sink: PartSink) -> None:
        self.engines, self.stream, self.plan, self.sink = engines, stream, plan, sink
        self.replies: dict[int, dict] = {}  # engine group -> its final reply
        stream.on_message = self.consume

    @property
    def whole(self) -> bool:
        """Every engine has sent its last part and its final reply."""
        return not self.stream.pending

    def consume(self) -> None:
        """Take what was read for this rollout so far: each part into the sink,
        kept whole under an interrupt (the rollout it completes may be saved),
        then scored (an interrupted run needs no rewards)."""
        inbox = self.stream.inbox
        while inbox:
            with signals_held():
                r, kind, meta = inbox.popleft()
                g = self.engines._group_of[r]
                if kind == "ok":
                    self.replies[g] = meta
                    continue
                pos, part = self.engines._part(self.plan, g, meta)
                self.sink.keep(pos, part, meta)
            self.sink.score(pos, part)

    def wait(self, until: float) -> bool:
        """Wait until the rollout is whole (True) or time.monotonic() reaches `until`."""
        done = self.stream.wait(until)
        self.consume()
        return done

    def poll(self, since: float) -> None:
        """Read what comes within about a second (this rollout's parts and every
        other background one's), consumed; BackendError once `since` lies the
        command timeout back."""
        if self.stream.pending:
            timeout = self.engines.host.config.command_timeout_s
            self.stream.peers.wait_some(self.stream, since + timeout, timeout)
        self.consume()

    def collect(self) -> dict[str, float]:
        """Wait for every engine (its parts are in the sink then) -> {idle_s: the
        longest an engine waited before it; sync_load_s: the slowest load, when it
        began with one}. Its segment goes back to the engines' pool."""
        self.consume()
        for _ in self.stream.events(self.engines.host.config.command_timeout_s):
            pass  # nothing comes out: its hook (consume) takes each message as it is read
        replies = [self.replies[g] for g in range(self.engines.num_engines)]
        self.engines.last_tokens = [r["tokens"] for r in replies]
        self.engines._free_segments.append(self.plan.segment)
        info = {"idle_s": max(r["idle_s"] for r in replies)}
        if any("inflight_loads" in r for r in replies):  # --partial-rollouts (fleet/inflight_loads.py)
            info |= {k: sum(r.get(k, 0) for r in replies) for k in INFLIGHT_COUNTS}
        if failed := [r["reward_error"] for r in replies if "reward_error" in r]:
            info["reward_error"] = failed[0]  # an environment's failure (episodes): the caller raises it
        loaded = [r["load_s"] for r in replies if "load_s" in r]
        if loaded:
            info["sync_load_s"] = max(loaded)
            probed = [r for r in replies if "probe_diff" in r]
            probe = {"probe_diff": max(r["probe_diff"] for r in probed),
                     "probe_tolerance": min(r["probe_tolerance"] for r in probed)} if probed else {}
            self.engines.host.log_sync({"sync_load_s": info["sync_load_s"], **probe})
        return info

    def drop(self) -> None:
        """Leave it to run (Ctrl-C): its engines take no more commands, and its
        segment is never reused (they may still write into it)."""
        self.stream.settle()
