"""The ranks start first: `areno train` spawns its rank (and engine) processes
right after the options are validated, before the controller imports torch,
so that their imports (torch, transformers, the worker: most of the time to
step 1) overlap everything the controller does before it needs them.

* `prespawn(cfg)` (cli/app.py): where the shape of the run is known without
  torch (one node, and a CPU run: --device cpu, or no GPU driver on the host),
  the processes start at once. Their output goes to a temporary log until the
  run directory exists; their config tells them its run.log, which takes the
  temporary log's lines (rank.spawn_main, rundir/log.move_child_output).
* `spawn_early(...)` (run.py): after the run directory is made, the peers the
  CLI started if they fit the run, or new ones (a GPU host counts its GPUs
  through torch first).

Peers that are never adopted (a user mistake found meanwhile) are stopped when
the run's start-up exits (EarlyPeers.close), and their temporary log removed.
"""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile

from areno.backend.launch import EarlyPeers, PeerShape, spawn_peers
from areno.config.train import TrainConfig
from areno.rundir.log import ENV as RUN_LOG_ENV
from areno.rundir.log import QUIET_ENV
from areno.runtime.placement import ranks_for
from areno.timing import startup_mark

# A GPU that torch.cuda could see needs one of these: NVIDIA's kernel driver, or ROCm's.
GPU_DRIVER_PATHS = ("/proc/driver/nvidia", "/dev/kfd")


def certainly_cpu(cfg: TrainConfig) -> bool:
    """The run trains on CPU, known without importing torch: --device cpu, or
    --device auto on a host with no GPU driver (resolve_device would say cpu)."""
    if cfg.device == "cpu":
        return True
    return cfg.device == "auto" and not any(os.path.exists(p) for p in GPU_DRIVER_PATHS)


def prespawn(cfg: TrainConfig) -> EarlyPeers | None:
    """The CPU run's peers, spawned now (see module doc); None where the shape
    needs torch to know (a GPU host), or comes from torchrun (--nnodes > 1)."""
    if cfg.nnodes > 1 or not certainly_cpu(cfg):
        return None
    _, world_size = ranks_for(cfg, "cpu")
    extra: dict[str, str] = {}
    log = None
    if not cfg.verbose:  # what they print before the run dir exists: kept, then moved to its run.log
        fd, log = tempfile.mkstemp(prefix="areno-early-", suffix=".log")
        os.close(fd)
        extra = {RUN_LOG_ENV: log, **QUIET_ENV}
        quiet_resource_tracker()
    early = spawn_peers(PeerShape(world_size, cfg.rollout_world_size, "cpu"),
                        heartbeat_timeout_s=cfg.rank_heartbeat_timeout, extra_env=extra)
    early.temp_log = log
    startup_mark("peers spawned")
    return early


def quiet_resource_tracker() -> None:
    """Start multiprocessing's resource tracker (spawning starts it) with its output
    discarded: it outlives the run and would print on the terminal, which it
    inherits when started before the run dir exists. All it says is the shutdown
    notice of a semaphore a rank's vLLM left registered (ranks exit with
    os._exit), which it then unlinks itself."""
    from multiprocessing import resource_tracker

    sys.stdout.flush()
    sys.stderr.flush()
    saved = [os.dup(1), os.dup(2)]
    null = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(null, 1)
        os.dup2(null, 2)
        resource_tracker.ensure_running()
    finally:
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for fd in (*saved, null):
            os.close(fd)


def spawn_early(cfg: TrainConfig, world_size: int, device: str, engine_gpus: tuple[int, ...],
                logs: contextlib.ExitStack, early: EarlyPeers | None = None) -> EarlyPeers | None:
    """One node: the peers `prespawn` started if they fit, else new ones now, so
    that their imports overlap the controller's tokenizer and data loading;
    stopped when `logs` closes unless the backend adopted them."""
    if cfg.nnodes > 1:
        return None
    shape = PeerShape(world_size, cfg.rollout_world_size, device, engine_gpus)
    if early is None or early.shape != shape:
        if early is not None:
            early.close()
        early = spawn_peers(shape, heartbeat_timeout_s=cfg.rank_heartbeat_timeout)
    logs.callback(early.close)
    return early
