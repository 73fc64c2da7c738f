"""Starting ranks: spawn them here (one node) or accept ranks torchrun started
(multi-node). Split placement's engine processes are spawned right after the
ranks, in the same start-up (fleet/engine_procs.py owns them from then on)."""

from __future__ import annotations

import contextlib
import os
import secrets
import socket
import sys
import threading
import time
from dataclasses import dataclass
from multiprocessing import AuthenticationError
from multiprocessing.connection import Connection, Listener, answer_challenge, deliver_challenge
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from areno.fleet.engine_procs import EngineShape, SpawnedEngines, spawn_engine_procs
from areno.procs.errors import BackendError
from areno.procs.heartbeat import HeartbeatWatch
from areno.procs.lifecycle import start_up, stop_processes
from areno.procs.signals import spawning

if TYPE_CHECKING:  # light at run time: runtime/early.py spawns ranks before torch is imported
    from areno.backend.config import BackendConfig
    from areno.procs.segment import ShmSegment


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


# OpenMP settings of every CPU rank and engine process (spawned with them: the
# OpenMP runtime reads them once, when torch loads it). PyTorch's CPU wheels ship
# GNU OpenMP (libgomp), whose threads spin ~300K iterations at each barrier by
# default. Next to a busy process that spin holds the core its partner needs (a
# step several times slower), so the ranks wait passively (PASSIVE: sleep at
# once; KMP_BLOCKTIME=0 is the same for Intel's libiomp5, when preloaded). On a
# host with nothing else to run, though, waking a sleeper at every barrier costs
# the demo's train phase ~1.7x: there a short spin (IDLE_SPIN_ENV, about 0.3 ms)
# is added. Which one is chosen once, at start-up, from the runnable tasks found
# (docs/PERFORMANCE.md, "Threads"). A user's own value of any of them wins.
RANK_OMP_ENV = {"OMP_WAIT_POLICY": "PASSIVE", "KMP_BLOCKTIME": "0"}
IDLE_SPIN_ENV = {"GOMP_SPINCOUNT": "30000"}


def _stat_fields(path: str) -> list[str]:
    """/proc/.../stat's fields after the command name: [state, ppid, ...]."""
    with open(path) as f:
        stat = f.read()
    return stat[stat.rindex(")") + 2:].split()


def own_tree_running(root: int | None = None) -> int:
    """Runnable threads of `root` (this process) and its descendants: a run's own
    helpers (multiprocessing's resource tracker starting up, an early peer) are no
    neighbour."""
    root = os.getpid() if root is None else root
    children: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                children.setdefault(int(_stat_fields(f"/proc/{name}/stat")[1]), []).append(int(name))
            except (OSError, ValueError, IndexError):
                pass  # exited meanwhile
    running, stack = 0, [root]
    while stack:
        pid = stack.pop()
        stack += children.get(pid, [])
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        for tid in tids:
            try:
                running += _stat_fields(f"/proc/{pid}/task/{tid}/stat")[0] == "R"
            except (OSError, ValueError, IndexError):
                pass
    return running


def runnable_elsewhere(samples: int = 8, interval_s: float = 0.002, loadavg: str = "/proc/loadavg") -> int | None:
    """Tasks runnable on the host outside this process and its descendants: the
    median of `samples` reads of the kernel's count of running tasks
    (/proc/loadavg's "running/total", the reading thread included), each less this
    process tree's running threads. None where the count cannot be read (not Linux)."""
    counts = []
    try:
        for i in range(samples):
            if i:
                time.sleep(interval_s)
            with open(loadavg) as f:
                total = int(f.read().split()[3].split("/")[0])
            counts.append(total - max(own_tree_running(), 1))
    except (OSError, IndexError, ValueError):
        return None
    return max(0, sorted(counts)[len(counts) // 2])


def rank_omp_env(device: str, environ: Mapping[str, str], others: int | None = -1) -> dict[str, str]:
    """The OpenMP entries a CPU peer starts with that `environ` (the user's)
    does not set: RANK_OMP_ENV, plus IDLE_SPIN_ENV when no other task is
    runnable (`others`: runnable tasks besides the caller; -1: count them now,
    None: unknown) and the user chose no wait policy or spin count. None on CUDA
    (the GPU computes; host threads stay as the user has them)."""
    if device == "cuda":
        return {}
    env = dict(RANK_OMP_ENV)
    if not {"OMP_WAIT_POLICY", "GOMP_SPINCOUNT"} & environ.keys():
        if others == -1:
            others = runnable_elsewhere()
        if others == 0:
            env.update(IDLE_SPIN_ENV)
    return {k: v for k, v in env.items() if k not in environ}


@dataclass(frozen=True)
class PeerShape:
    """What a peer's start-up environment depends on (peer_env): known before the
    BackendConfig, so the peers can start early (runtime/early.py)."""

    world_size: int
    rollout_world_size: int = 0
    device: str = "cpu"
    engine_gpus: tuple[int, ...] = ()
    master_addr: str = "127.0.0.1"

    @classmethod
    def of(cls, cfg: BackendConfig) -> "PeerShape":
        return cls(cfg.world_size, cfg.rollout_world_size, cfg.device, tuple(cfg.engine_gpus), cfg.master_addr)


@dataclass
class EarlyPeers:
    """Rank and engine processes spawned before their configs exist: they import
    torch, transformers and their worker module while the controller loads the
    tokenizer and the data (the run's start-up), then take their config from
    their pipe (`TorchBackend(config, early=...)` adopts the ranks,
    `EngineProcs(config, early=early.engines)` the engine processes). close()
    stops those not adopted (a user mistake found meanwhile). beats: the ranks'
    heartbeat slots (heartbeat.py)."""

    procs: list
    conns: list[Connection]
    beats: HeartbeatWatch
    shape: PeerShape
    engines: SpawnedEngines | None = None  # split placement's engine processes
    adopted: bool = False  # the ranks, by a TorchBackend
    temp_log: str | None = None  # their output until the run dir exists (runtime/early.py)

    def close(self) -> None:
        if self.engines is not None:
            self.engines.close()
        if not self.adopted:
            stop_processes(self.procs, self.conns, [])
            if self.temp_log:  # an adopted peer moves it into run.log itself
                with contextlib.suppress(OSError):
                    os.unlink(self.temp_log)

    def fits(self, cfg: BackendConfig) -> bool:
        """Whether the ranks fit cfg (the engine processes' fit is EngineProcs')."""
        mine, want = self.shape, PeerShape.of(cfg)
        return (mine.world_size, mine.device, mine.master_addr) == (want.world_size, want.device, want.master_addr)


def spawn_peers(shape: PeerShape, master_port: int | None = None, heartbeat_timeout_s: float = 0.0,
                extra_env: dict[str, str] | None = None) -> EarlyPeers:
    """Start shape.world_size rank processes (spawn context), each waiting for its
    BackendConfig on its pipe, then shape.rollout_world_size engine processes
    (fleet/engine_procs.py). extra_env: added to each one's environment
    (runtime/early.py: its temporary log)."""
    import multiprocessing  # not torch's: this may run before torch is imported (runtime/early.py)

    ctx = multiprocessing.get_context("spawn")
    world_size, rollout_world_size = shape.world_size, shape.rollout_world_size
    port = master_port or free_port(shape.master_addr)
    beats = HeartbeatWatch(world_size, heartbeat_timeout_s)
    # PR_SET_PDEATHSIG fires when the spawning *thread* exits: only safe from the main thread
    pdeathsig = threading.current_thread() is threading.main_thread()
    procs, conns = [], []
    # In the environment a child starts with, not its spawn_main's update: its
    # target (_spawn_main) imports torch before that update, and OpenMP reads its
    # settings then.
    omp = rank_omp_env(shape.device, os.environ)
    os.environ.update(omp)
    engines = None
    try:
        for r in range(world_size):
            parent, child = ctx.Pipe(duplex=True)
            env = {**peer_env(shape, r, port), **(extra_env or {})}
            p = ctx.Process(
                target=_spawn_main, args=(child, env, os.getpid(), pdeathsig, beats.slots),
                name=f"areno-rank{r}", daemon=True,
            )
            with spawning():  # the child ignores HELD before it unblocks them
                p.start()
            child.close()
            procs.append(p)
            conns.append(parent)
        if rollout_world_size:
            engines = spawn_engine_procs(EngineShape(rollout_world_size, world_size, shape.device, shape.engine_gpus),
                                         heartbeat_timeout_s, extra_env)
    finally:
        for k in omp:  # the controller's own environment stays the user's
            os.environ.pop(k, None)
    return EarlyPeers(procs, conns, beats, shape, engines)


def _spawn_main(*args: Any) -> None:
    """The spawned process's target: imported there, not here (rank.py imports torch)."""
    with start_up():
        from areno.backend.rank import spawn_main

    spawn_main(*args)


def early_peers_for(cfg: BackendConfig) -> EarlyPeers:
    """spawn_peers with cfg's shape, rendezvous and heartbeat bound: the ranks only
    (a backend started without early peers; EngineProcs spawns its own)."""
    shape = PeerShape(cfg.world_size, 0, cfg.device, (), cfg.master_addr)
    return spawn_peers(shape, cfg.master_port, cfg.heartbeat_timeout_s)


def peer_env(cfg: PeerShape | BackendConfig, r: int, port: int) -> dict[str, str]:
    """The environment rank r starts with (rank.spawn_main applies it first, before
    anything can touch CUDA): torch.distributed's. The ranks see every GPU
    (cuda:LOCAL_RANK)."""
    return {"MASTER_ADDR": cfg.master_addr, "MASTER_PORT": str(port), "RANK": str(r),
            "WORLD_SIZE": str(cfg.world_size), "LOCAL_RANK": str(r), "LOCAL_WORLD_SIZE": str(cfg.world_size)}


def accept_connections(listener: Listener, n: int, key: bytes, timeout_s: float) -> list[Connection]:
    """Up to n authenticated connections within timeout_s (fewer on timeout). Each
    handshake runs in a thread of its own, so a connection that fails it (a port
    scan, a health check, a node that hangs up: EOFError, a wrong key:
    AuthenticationError) or stalls in it is rejected, logged with its address, and
    accepting goes on. `listener` has no authkey (the handshake is done here); it
    is closed on return."""
    accepted: list[Connection] = []
    lock, done = threading.Lock(), threading.Event()

    def handshake(conn: Connection, addr: Any) -> None:
        try:
            deliver_challenge(conn, key)
            answer_challenge(conn, key)
        except (EOFError, OSError, AuthenticationError) as e:
            conn.close()
            print(f"areno: rejected a connection from {_address(addr)} ({type(e).__name__}: {e or 'closed'}); "
                  "still waiting for ranks", file=sys.stderr, flush=True)
            return
        with lock:
            if done.is_set():  # too late: the caller has what it takes
                conn.close()
                return
            accepted.append(conn)
            if len(accepted) >= n:
                done.set()

    def accept_all() -> None:
        while not done.is_set():
            try:
                conn = listener.accept()
            except OSError:  # the listener closed on timeout
                return
            threading.Thread(target=handshake, args=(conn, listener.last_accepted), daemon=True).start()

    threading.Thread(target=accept_all, name="areno-accept-ranks", daemon=True).start()
    done.wait(timeout_s)
    listener.close()
    with lock:
        done.set()  # a handshake finishing after this is not taken
        return accepted[:n]


def _address(addr: Any) -> str:
    return f"{addr[0]}:{addr[1]}" if isinstance(addr, tuple) and len(addr) >= 2 else str(addr)


def accept_ranks(cfg: BackendConfig, conns: list[Connection | None], marker: ShmSegment) -> None:
    """torchrun launcher: listen until world_size ranks dial in; fills conns[rank].

    Each rank gets the config and the name of a marker segment holding a random
    token: a rank that can read it shares this host's /dev/shm (see rank.py).
    """
    given = os.environ.get("ARENO_BACKEND_AUTHKEY")
    key_hex = given or secrets.token_hex(16)
    os.environ["ARENO_BACKEND_AUTHKEY"] = key_hex
    token = secrets.token_bytes(16)
    marker.ensure(len(token), headroom=0.0)
    marker.buf[: len(token)] = token
    listener = Listener((cfg.listen_host, cfg.listen_port))  # authenticated per connection
    how = "" if given else (f"; start them with ARENO_BACKEND_AUTHKEY={key_hex} torchrun ... "
                            f"-m areno.backend.rank --connect <this-host>:{cfg.listen_port}")
    print(f"areno: waiting for {cfg.world_size} ranks on {cfg.listen_host}:{cfg.listen_port}{how}",
          file=sys.stderr, flush=True)
    accepted = accept_connections(listener, cfg.world_size, bytes.fromhex(key_hex), cfg.startup_timeout_s)
    try:
        if len(accepted) < cfg.world_size:
            raise BackendError(f"startup: {len(accepted)} of {cfg.world_size} ranks connected "
                               f"within {cfg.startup_timeout_s:g}s (--startup-timeout)")
        for conn in accepted:
            if not conn.poll(cfg.startup_timeout_s):
                raise BackendError("startup: a rank connected but never said hello")
            _, rank, world, _host = conn.recv()
            if world != cfg.world_size or not 0 <= rank < world or conns[rank] is not None:
                raise BackendError(f"startup: rank {rank} of {world} does not fit world_size {cfg.world_size}")
            conns[rank] = conn
            conn.send((cfg, (marker.name, token)))
    except BaseException:
        for c in accepted:
            if c not in conns:
                c.close()
        raise
