"""The engines the training loop sees (`EngineView`), wherever they live: inside
the ranks (backend/rank_engines.py's RankEngines) or in engine processes of
their own (ProcEngines, over fleet/engine_procs.py). Both are a `PeerEngines`
over a host that holds the peers' pipes: the controller only splits prompts,
sends each engine group its share (a few arrays) and reassembles the finished
parts from the shared-memory segment the peers write into; it never imports
vLLM and never touches a GPU.

Prompts go to engines by whole groups (all n samples of a prompt on one engine),
balanced by expected tokens with longest-first greedy (LPT): a prompt is
expected to cost its length plus `max_tokens` per sample.

The loop never puts these engines to sleep or loads their weights itself: each
rank sleeps its own engine while it trains (RankWorker.cmd_train), and
`sync_weights` asks the ranks to load their engines, or rank 0 to publish and
the engine processes to load (weight_sync.py).
"""

from __future__ import annotations

import heapq
import itertools
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, Callable, Protocol

import numpy as np

from areno.fleet.engine_host import OutRegion
from areno.fleet.rollouts import Episodes, PartSink, Parts, PendingRollout, RolloutPlan
from areno.procs.replies import ReplyStream
from areno.fleet.weight_sync import WeightRegion
from areno.rollout.batch import RolloutBatch, csr_take, offsets_from_lengths
from areno.rollout.engine import SamplingConfig, engine_sampling, validate_prompts

if TYPE_CHECKING:
    from areno.fleet.engine_procs import EngineProcs
    from areno.procs.replies import Peers
    from areno.procs.segment import ShmSegment

_PAGE = 4096
DRAIN_S = 5.0


def assign_groups(cost: np.ndarray, num_engines: int) -> np.ndarray:
    """[P] expected cost per prompt -> [P] int64 engine of each prompt (LPT:
    longest first onto the least-loaded engine; ties by engine index).
    O(P log E) Python over prompts, none over tokens."""
    cost = np.asarray(cost, dtype=np.int64)
    out = np.zeros(cost.size, dtype=np.int64)
    heap = [(0, e) for e in range(num_engines)]
    for p in np.argsort(-cost, kind="stable").tolist():
        load, e = heapq.heappop(heap)
        out[p] = e
        heapq.heappush(heap, (load + int(cost[p]), e))
    return out


class EngineView(Protocol):
    """What the training loop needs from its rollout engines, wherever they live
    (PeerEngines: in the ranks or in engine processes; a benchmark's stand-in):
    sampling, and new weights after each update."""

    max_model_len: int
    background: bool  # its rounds run while the ranks train (engine processes), else when collected
    dead: Any         # why its processes stopped (a watchdog's BackendError), else None

    def generate(self, prompt_ids: np.ndarray, prompt_offsets: np.ndarray, n: int,
                 sampling: SamplingConfig) -> RolloutBatch: ...

    def generate_stream(self, prompt_ids: np.ndarray, prompt_offsets: np.ndarray, n: int,
                        sampling: SamplingConfig, min_groups: int = 1,
                        ) -> Iterator[tuple[np.ndarray, RolloutBatch]]: ...

    def sync_weights(self) -> dict[str, float]:
        """The trainer's current weights into every engine, checked (weight_sync.py)."""
        ...

    def publish(self, slot: int = 0) -> tuple[WeightRegion | None, dict[str, float]]:
        """The trainer's weights for the engines -> (the region engine processes load
        with their next round, or None: loaded and checked now; the sync's figures)."""
        ...

    def load(self, region: WeightRegion) -> dict[str, float]:
        """Load a published region now, checked (engine processes, before an eval)."""
        ...

    def offer(self, region: WeightRegion, version: int, cut: int | None = None) -> None:
        """--partial-rollouts: a published region of weight `version` for the engines
        to load between two decode steps of the rounds they generate now, and
        (cut, --cut-at-deadline) the rounds now due (fleet/inflight_loads.py);
        engines that cannot: nothing."""
        ...

    def halt(self) -> None:
        """--partial-rollouts, an interrupted run saving: the rounds generating now
        end at their next decode step, each sample with the tokens it has
        (finish "abort"); engines in the ranks: nothing (none runs while it saves)."""
        ...


class EngineHost(Protocol):
    """Who holds the engines' pipes: the TorchBackend (engines in the ranks) or
    EngineProcs (engine processes)."""

    config: Any  # its command_timeout_s
    rollout_segment: "ShmSegment"

    def open_stream(self, what: str, drain_s: float = 0.0, lane: str = "main",
                    detach: bool = False, background: bool = False) -> ReplyStream: ...

    def new_rollout_segment(self) -> "ShmSegment": ...

    def log_sync(self, timings: dict[str, float]) -> dict[str, float]: ...


class PeerEngines:
    """EngineView over engine groups of peers of `host`: `groups[g]` the peers of
    engine g (a TP group's members, the first its leader), `hellos` theirs in peer
    order; prompt ids are checked against `vocab_size`. Subclasses say how new
    weights reach them (sync_weights, publish, load)."""

    background = False
    dead = None

    def __init__(self, host: EngineHost, groups: list[list[int]], hellos: list[dict], vocab_size: int) -> None:
        self.host, self.groups, self.vocab_size = host, groups, vocab_size
        self.num_engines = len(self.groups)
        self._group_of = {r: g for g, peers in enumerate(self.groups) for r in peers}
        self.kinds: list[str] = sorted({h["engine"] for h in hellos})
        self.notes: list[str] = sorted({h["engine_note"] for h in hellos if h.get("engine_note")})
        self.max_model_len: int = min(int(h["engine_max_model_len"]) for h in hellos)
        self._remote = {r: not h["same_host"] for r, h in zip(sorted(self._group_of), hellos)}
        self.last_tokens: list[int] = []  # response tokens each engine wrote in the last call
        self._free_segments: list["ShmSegment"] = []  # result segments of collected rollouts
        self._lanes = itertools.count()  # a reply lane per rollout in flight

    def generate(self, prompt_ids: np.ndarray, prompt_offsets: np.ndarray, n: int,
                 sampling: SamplingConfig) -> RolloutBatch:
        parts, positions = [], []
        for pos, part in self.generate_stream(prompt_ids, prompt_offsets, n, sampling):
            parts.append(part)
            positions.append(pos)
        return RolloutBatch.merge_parts(parts, positions)[0]

    def generate_stream(self, prompt_ids: np.ndarray, prompt_offsets: np.ndarray, n: int,
                        sampling: SamplingConfig, min_groups: int = 1,
                        ) -> Iterator[tuple[np.ndarray, RolloutBatch]]:
        """Yield (prompt positions [p] int64, RolloutBatch of those p groups) as each
        engine finishes groups."""
        # An interrupt mid-rollout (even between two sends) waits a few seconds for
        # the engines to finish, so the run can still save its last finished step.
        stream = self.host.open_stream("generate", drain_s=DRAIN_S)
        plan = self._send(stream, "generate", prompt_ids, prompt_offsets, n, sampling)
        self.last_tokens = [0] * self.num_engines
        for r, kind, meta in stream.events(self.host.config.command_timeout_s):
            g = self._group_of[r]
            if kind == "ok":
                self.last_tokens[g] = max(self.last_tokens[g], meta["tokens"])
            else:
                yield self._part(plan, g, meta)

    def start_rollout(self, prompt_ids: np.ndarray, prompt_offsets: np.ndarray, n: int,
                      sampling: SamplingConfig, region: WeightRegion | None,
                      sink: "PartSink | None" = None, episodes: "Episodes | None" = None,
                      version: int | None = None) -> "PendingRollout":
        """Split placement: send a rollout to the engine processes and return at once
        (the asynchronous loop trains meanwhile); each engine first loads `region`
        when given. Several may be out at once: they queue on the engines, each
        on a lane of its own (replies.Peers) and a result segment of its own, so
        the ranks' commands run meanwhile. Its parts go to `sink.add(pos, part)`
        as they are read, which is during every wait of the controller (a
        background stream); dropped (Ctrl-C), it is left to run: the ranks save
        at once. episodes: a multi-turn rollout, each engine process running the
        episode driver on its share of the groups (EngineWorker.cmd_episodes).
        version (--partial-rollouts): the weight version after `region`, which the
        engines tag tokens with and compare offers to (fleet/inflight_loads.py)."""
        region_kw = {"region": region, **({} if version is None else {"version": version})}
        seg = self._free_segments.pop() if self._free_segments else self.host.new_rollout_segment()
        lane = f"rollout{next(self._lanes)}"
        stream = self.host.open_stream("rollout", lane=lane, detach=True, background=True)
        if episodes is None:
            plan = self._send(stream, "rollout", prompt_ids, prompt_offsets, n, sampling, seg=seg, **region_kw)
        else:
            plan = self._send(stream, "episodes", prompt_ids, prompt_offsets, n, sampling, seg=seg,
                              spec=episodes.spec, per_engine=episodes.share, **region_kw)
        return PendingRollout(self, stream, plan, sink if sink is not None else Parts())

    def _send(self, stream: ReplyStream, cmd: str, prompt_ids: np.ndarray, prompt_offsets: np.ndarray,
              n: int, sampling: SamplingConfig, seg: "ShmSegment | None" = None,
              per_engine: "Callable[[int, int, np.ndarray], dict] | None" = None, **extra) -> RolloutPlan:
        """Split the prompts over the engines by whole groups and send each its share,
        to write into `seg` (default: the host's rollout segment). per_engine(g, E,
        its prompt positions) -> more arguments for engine g (then the seed goes as
        it is: the command derives each call's own, EngineWorker.cmd_episodes)."""
        ids, offsets = validate_prompts(prompt_ids, prompt_offsets, n, max_model_len=self.max_model_len,
                                        vocab_size=self.vocab_size)
        engine_of = assign_groups(np.diff(offsets) + sampling.max_tokens, self.num_engines)
        members = [np.flatnonzero(engine_of == g) for g in range(self.num_engines)]
        caps = [m.size * n * sampling.max_tokens for m in members]
        starts = np.cumsum([0] + [-(-8 * c // _PAGE) * _PAGE for c in caps]).tolist()
        seg = seg or self.host.rollout_segment
        seg.ensure(max(starts[-1], 1))
        for r, g in self._group_of.items():
            sub_ids, sub_off = csr_take(ids, offsets, members[g])
            out = OutRegion(None if self._remote[r] else seg.name, starts[g], caps[g])
            s = sampling if per_engine is not None else engine_sampling(sampling, g, self.num_engines)
            lead = {"leader": r == self.groups[g][0]} if cmd == "generate" else {}
            own = per_engine(g, self.num_engines, members[g]) if per_engine is not None else {}
            stream.send(r, cmd, ids=sub_ids, offsets=sub_off, n=n, sampling=s, out=out, **lead, **extra, **own)
        return RolloutPlan(ids, offsets, n, members, starts, caps, seg)

    def _part(self, plan: RolloutPlan, g: int, meta: dict) -> tuple[np.ndarray, RolloutBatch]:
        """One finished part of engine group g -> (prompt positions, its RolloutBatch)."""
        ids, offsets, n = plan.ids, plan.offsets, plan.n
        pos, start, cap = plan.members[g][meta["positions"]], plan.starts[g], plan.caps[g]
        lengths = meta["lengths"]
        total = int(lengths.sum())
        if "ids" in meta:  # a rank on another host sent its arrays inline
            rid, rlp = meta["ids"], meta["logprobs"]
        else:
            buf = plan.segment.buf
            at = start + 4 * meta["start"]
            # Copied out (one memcpy per part): no view may pin the segment, which
            # is unlinked on any failure and reused by the next call.
            rid = np.frombuffer(buf, dtype=np.int32, count=total, offset=at).copy()
            rlp = np.frombuffer(buf, dtype=np.float32, count=total, offset=at + 4 * cap).copy()
        if "prompt_ids" in meta:  # an episode's part: its prompts are its trajectories' (an agent's own)
            p_ids, p_off = meta["prompt_ids"], meta["prompt_offsets"]
        else:
            p_ids, p_off = csr_take(ids, offsets, pos)
        return pos, RolloutBatch(
            prompt_ids=p_ids, prompt_offsets=p_off, response_ids=rid,
            response_offsets=offsets_from_lengths(lengths), response_logprobs=rlp,
            group_index=np.repeat(np.arange(pos.size, dtype=np.int64), n),
            finish_reason=meta["finish"], response_mask=meta.get("mask"),
            turn_cut=meta.get("turn_cut"), token_version=meta.get("versions"),
        )

    def sync_weights(self) -> dict[str, float]:
        raise NotImplementedError

    def publish(self, slot: int = 0) -> tuple[WeightRegion | None, dict[str, float]]:
        return None, self.sync_weights() or {}

    def load(self, region: WeightRegion) -> dict[str, float]:
        raise RuntimeError(f"{type(self).__name__} loads the trainer's weights through sync_weights")

    def offer(self, region: WeightRegion, version: int, cut: int | None = None) -> None:
        """Engines in the ranks sleep while the ranks train: no round runs to offer to."""

    def halt(self) -> None:
        """Engines in the ranks: no round runs while the run saves."""


class RankSide(Protocol):
    """What ProcEngines needs of the training ranks (a TorchBackend): rank 0
    publishes the weights; the ranks' waits read the engines' rollouts too."""

    vocab_size: int
    peers: "Peers"

    def publish_weights(self, *, fingerprinted: bool = True, slot: int = 0) -> WeightRegion: ...


class ProcEngines(PeerEngines):
    """EngineView over split placement's engine processes (one engine each, its TP,
    if any, inside it): rank 0 of `ranks` publishes, every engine process loads."""

    background = True

    def __init__(self, fleet: "EngineProcs", ranks: RankSide) -> None:
        super().__init__(fleet, [[i] for i in range(fleet.count)], fleet.ready().hellos, ranks.vocab_size)
        self.fleet, self.ranks = fleet, ranks
        # A rollout in flight is read while the controller waits on the ranks (a
        # train step): its parts are scored meanwhile and the engines never block
        # on a full pipe (procs/replies.py, background streams).
        ranks.peers.neighbours.append(fleet.peers)

    def sync_weights(self) -> dict[str, float]:
        """Publish the weights (rank 0 writes the region), then every engine process
        loads and checks them (EngineProcs.load); timings and probe figures as a
        colocated sync's."""
        t0 = time.perf_counter()
        region = self.ranks.publish_weights(fingerprinted=self.fleet.fingerprinted)
        publish_s = time.perf_counter() - t0
        timings = self.fleet.load(region) | {"sync_publish_s": publish_s, "sync_s": time.perf_counter() - t0}
        return self.fleet.log_sync(timings)

    def publish(self, slot: int = 0) -> tuple[WeightRegion, dict[str, float]]:
        """Rank 0 writes the weights into region `slot`; the engine processes load it
        with their next round (its figures come with the round)."""
        return self.ranks.publish_weights(fingerprinted=self.fleet.fingerprinted, slot=slot), {}

    def load(self, region: WeightRegion) -> dict[str, float]:
        return self.fleet.load(region)

    def offer(self, region: WeightRegion, version: int, cut: int | None = None) -> None:
        self.fleet.offer(region, version, cut)

    def halt(self) -> None:
        self.fleet.halt()

    @property
    def dead(self) -> Any:  # type: ignore[override]
        return self.fleet.dead
