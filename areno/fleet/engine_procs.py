"""EngineProcs: the controller's handle on split placement's M engine processes.

The engines are a fleet of their own, apart from the training backend (which
drives its N ranks only): this handle spawns them (`spawn_engine_procs`, early,
beside the ranks: runtime/early.py), owns their pipes and reply streams
(procs/replies.Peers), their heartbeats and watchdog, and the shared-memory
segments they write rollouts into; `load(region)` has each load and check a
weight region rank 0 published (fleet/weight_sync.py). The loop drives them
through ProcEngines (fleet/engines.py). Torch-free at import: the CLI spawns
them before the controller imports torch.
"""

from __future__ import annotations

import os
import threading
import weakref
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any

from areno.procs.errors import BackendError
from areno.procs.heartbeat import HeartbeatWatch
from areno.procs.lifecycle import shut_down, start_up, stop_processes
from areno.procs.replies import Peers, ReplyStream
from areno.procs.segment import ShmSegment
from areno.procs.signals import spawning
from areno.procs.watchdog import start_watchdog

if TYPE_CHECKING:
    from areno.fleet.weight_sync import WeightRegion


@dataclass(frozen=True)
class EngineProcsConfig:
    """What the engine processes need (BackendConfig.engine_procs builds it)."""

    count: int
    """M, the engine processes (each one engine, its TP inside it: refused for now)."""
    model_path: str
    engine: Any  # rollout.factory.EngineSpec
    ranks: int = 1
    """N, the training ranks: engine i takes GPU N + i by default (engine_gpu)."""
    device: str = "cpu"
    engine_gpus: tuple[int, ...] = ()
    cpu_threads: int | None = None
    startup_timeout_s: float = 1800.0
    command_timeout_s: float = 3600.0
    heartbeat_timeout_s: float = 0.0
    shutdown_grace_s: float = 5.0
    run_log: str = ""

    @property
    def shape(self) -> "EngineShape":
        return EngineShape(self.count, self.ranks, self.device, tuple(self.engine_gpus))


@dataclass(frozen=True)
class EngineShape:
    """What an engine process's start-up environment depends on (engine_env):
    known before its config, so they can start early."""

    count: int
    ranks: int = 1
    device: str = "cpu"
    engine_gpus: tuple[int, ...] = ()


@dataclass
class SpawnedEngines:
    """Engine processes spawned before their config exists (spawn_engine_procs);
    EngineProcs(cfg, early=...) adopts them, close() stops them unless it did."""

    procs: list
    conns: list[Connection]
    beats: HeartbeatWatch
    shape: EngineShape
    adopted: bool = False

    def close(self) -> None:
        if not self.adopted:
            stop_processes(self.procs, self.conns, [])


def spawn_engine_procs(shape: EngineShape, heartbeat_timeout_s: float = 0.0,
                       extra_env: dict[str, str] | None = None) -> SpawnedEngines:
    """Start shape.count engine processes (spawn context), each waiting for its
    EngineProcsConfig on its pipe. The caller sets the OpenMP environment they
    start with (launch.spawn_peers). extra_env: added to each one's engine_env."""
    import multiprocessing  # not torch's: this may run before torch is imported (runtime/early.py)

    ctx = multiprocessing.get_context("spawn")
    beats = HeartbeatWatch(shape.count, heartbeat_timeout_s)
    # PR_SET_PDEATHSIG fires when the spawning *thread* exits: only safe from the main thread
    pdeathsig = threading.current_thread() is threading.main_thread()
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    procs, conns = [], []
    for i in range(shape.count):
        parent, child = ctx.Pipe(duplex=True)
        env = {**engine_env(shape, i, visible), **(extra_env or {})}
        p = ctx.Process(target=_spawn_main, args=(child, env, os.getpid(), pdeathsig, beats.slots),
                        name=f"areno-engine{i}", daemon=True)
        with spawning():  # the child ignores HELD before it unblocks them
            p.start()
        child.close()
        procs.append(p)
        conns.append(parent)
    return SpawnedEngines(procs, conns, beats, shape)


def _spawn_main(*args: Any) -> None:
    """The spawned process's target: imported there, not here (engine_proc.py imports torch)."""
    with start_up():
        from areno.fleet.engine_proc import spawn_main

    spawn_main(*args)


def engine_env(shape: EngineShape, i: int, visible: str | None) -> dict[str, str]:
    """The environment engine process i starts with (engine_proc.spawn_main applies
    it first): its index and, on GPU, only its own device visible, since vLLM takes
    device 0 whatever torch.cuda.set_device says. visible: the controller's
    CUDA_VISIBLE_DEVICES (None: every GPU)."""
    env = {"ARENO_ENGINE_INDEX": str(i)}
    if shape.device == "cuda":
        env["CUDA_VISIBLE_DEVICES"] = engine_gpu(shape, i, visible)
    return env


def engine_gpu(shape: EngineShape, i: int, visible: str | None) -> str:
    """CUDA_VISIBLE_DEVICES of engine process i: the (N + i)-th GPU the controller sees
    (shape.engine_gpus[i] when given), as the controller's own list names it."""
    index = shape.engine_gpus[i] if shape.engine_gpus else shape.ranks + i
    if visible is None:
        return str(index)
    names = [v.strip() for v in visible.split(",") if v.strip()]
    if index >= len(names):
        raise BackendError(f"engine process {i} needs GPU {index}; CUDA_VISIBLE_DEVICES={visible!r} "
                           f"lists {len(names)}")
    return names[index]


class EngineProcs:
    """M engine processes serving rollouts. Use as a context manager, or call close()."""

    def __init__(self, config: EngineProcsConfig, early: SpawnedEngines | None = None, wait: bool = True) -> None:
        """early: processes spawn_engine_procs started already (the run's start-up
        overlaps their imports with its own), adopted here; else spawned now. Each
        gets its config at once; wait: also wait for their hellos now, else at
        ready() (run.py: they load their engines while the ranks load the policy)."""
        self.config = config
        self.count = config.count
        self._closed = False
        self.dead: BackendError | None = None  # set by the watchdog
        self.syncs = 0  # weight loads logged (each one a line in run.log)
        self.rollout_segment = ShmSegment("rollout")  # engines' results (fleet/engines.py)
        self._segments = [self.rollout_segment]
        self._procs: list = []
        self._conns: list[Connection | None] = [None] * config.count
        self.hellos: list[dict] = []  # one per engine process, once ready()
        self._beats: HeartbeatWatch | None = None
        self._finalizer = weakref.finalize(self, stop_processes, self._procs, self._conns, self._segments)
        self.peers = Peers(self._conns, self._procs, self._abort, lambda: self._closed,
                           label=lambda i: f"engine process {i}")
        try:
            early = early if early is not None and early.shape == config.shape else self._respawn(early)
            early.adopted = True
            self._procs.extend(early.procs)
            self._conns[:] = early.conns
            for c in self._conns:
                c.send(config)
            self._beats = early.beats
        except BaseException:
            self._abort()
            raise
        if wait:
            self.ready()

    def ready(self) -> "EngineProcs":
        """Wait for every engine process's hello (its engine built), then watch them
        (heartbeats, watchdog). Idempotent."""
        if self.hellos:
            return self
        try:
            self.hellos = self.peers.open("startup", pending=range(self.count)).gather(
                self.config.startup_timeout_s)
        except BaseException:
            self._abort()
            raise
        self.peers.beats = self._beats
        start_watchdog(self.peers, lambda: self._closed, self._abort, self._died, "areno-engine-watchdog")
        return self

    def _respawn(self, early: SpawnedEngines | None) -> SpawnedEngines:
        if early is not None:  # spawned for another shape (a user mistake found since is not this)
            early.close()
        return spawn_engine_procs(self.config.shape, self.config.heartbeat_timeout_s)

    def _died(self, err: BackendError) -> None:
        self.dead = err

    @property
    def pids(self) -> list[int]:
        return [h["pid"] for h in self.hellos]

    @property
    def fingerprinted(self) -> bool:
        """Whether every engine process reports an exact fingerprint (the probe schedule)."""
        return all(h["fingerprinted"] for h in self.hellos)

    def load(self, region: WeightRegion) -> dict[str, float]:
        """Every engine process loads and checks a published region (load_region) ->
        {sync_load_s: the slowest load, and when one probed the worst probe_diff
        and the tightest probe_tolerance}."""
        self._check_open()
        stream = self.peers.broadcast("load_region", range(self.count), drain_s=5.0, region=region)
        replies = stream.gather(self.config.command_timeout_s)
        timings = {"sync_load_s": max(r["load_s"] for r in replies)}
        probed = [r for r in replies if "probe_diff" in r]
        if probed:
            timings.update(probe_diff=max(r["probe_diff"] for r in probed),
                           probe_tolerance=min(r["probe_tolerance"] for r in probed))
        return timings

    def offer(self, region: WeightRegion, version: int, cut: int | None = None) -> None:
        """--partial-rollouts: every engine process may load `region` (weight
        `version`) between two decode steps of the round it generates
        (fleet/inflight_loads.py), and ends the samples still running of rounds
        admitted with `cut` or older (--cut-at-deadline). A message with no reply,
        taken by each one's command reader at once, not behind its queued rounds."""
        self._check_open()
        for i in range(self.count):
            self.peers.post(i, "offer", {"region": region, "version": version, "cut": cut})

    def halt(self) -> None:
        """--partial-rollouts, the run saving after Ctrl-C: every engine process ends
        its single-turn rounds, running or queued, at their next decode step
        boundary, each sample with the tokens it has (finish "abort"); taken at
        once by each one's command reader, as an offer is."""
        self._check_open()
        for i in range(self.count):
            self.peers.post(i, "halt", {})

    def log_sync(self, timings: dict[str, float]) -> dict[str, float]:
        """A sync's figures, also as one line in run.log (weight_sync.log_sync)."""
        from areno.fleet.weight_sync import log_sync  # torch: not at import (module docstring)

        self.syncs += 1
        return log_sync(self.syncs, timings)

    def open_stream(self, what: str, drain_s: float = 0.0, lane: str = "main",
                    detach: bool = False, background: bool = False) -> ReplyStream:
        """A reply stream for a command sent engine by engine (stream.send)."""
        self._check_open()
        return self.peers.open(what, drain_s, lane=lane, detach=detach, background=background)

    def new_rollout_segment(self) -> ShmSegment:
        """One more result segment, for a rollout in flight beside others (unlinked at close)."""
        seg = ShmSegment(f"rollout{len(self._segments)}")
        self._segments.append(seg)
        return seg

    def close(self) -> None:
        """Ask every engine process to exit, then make sure they have; unlink the segments."""
        if self._closed:
            return
        self._closed = True
        shut_down(self._procs, self._conns, self.peers.stale, self.config.shutdown_grace_s)
        self._finalizer()

    def _abort(self) -> None:
        self._closed = True
        self._finalizer()

    def _check_open(self) -> None:
        if self._closed:
            raise BackendError("engine processes are closed (one failed or close() was called)")

    def __enter__(self) -> "EngineProcs":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
