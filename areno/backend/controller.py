"""TorchBackend: the controller's handle on N training rank processes.

The controller (a CPU-only process; it never imports CUDA state) starts the
ranks, writes each step's SplitPack once into shared memory, sends every rank
a few hundred bytes of metadata, and waits for replies with
`multiprocessing.connection.wait` over the result pipes AND the process
sentinels, in slices of at most a second: a rank that raises is reported with
its traceback, a rank that is SIGKILLed is noticed at once, one whose heartbeat
stops (SIGSTOP: procs/heartbeat.py) within its bound, and either way
every rank is then stopped ("shutdown", SIGKILL after a grace period) and every
shared-memory segment unlinked (the pipes, waits and reply streams are
procs/replies.py's). Nothing blocks forever on a recv.
"""

from __future__ import annotations

import os
import secrets
import shutil
import time
import weakref
from dataclasses import replace
from multiprocessing.connection import Connection
from pathlib import Path

import torch

from areno.backend.config import BackendConfig
from areno.procs.errors import BackendError
from areno.backend.handoff import PackWriter
from areno.procs.segment import ShmSegment
from areno.procs.heartbeat import HeartbeatWatch
from areno.backend.launch import EarlyPeers, PeerShape, accept_ranks, early_peers_for, free_port  # noqa: F401 (re-exported)
from areno.procs.replies import Peers, ReplyStream
from areno.procs.watchdog import start_watchdog
from areno.fleet.weight_sync import WeightLayout, WeightRegion, log_sync
from areno.backend.weights import probe_ids
from areno.fileperms import replace_dir
from areno.perf import pack_train_perf
from areno.procs.lifecycle import shut_down, stop_processes
from areno.rollout.probe import probe_due
from areno.split import SplitPack


class TrainSteps(list):
    """backend.train's result: one metrics dict per optimizer step (a list, as
    before), with that call's `timings` (seconds; peak GPU memory on GPU) and
    `perf` (perf/train_tokens_per_s, perf/mfu on GPU). Empty: nothing trained."""

    def __init__(self, steps: list[dict[str, float]] = (), timings: dict[str, float] | None = None,
                 perf: dict[str, float] | None = None) -> None:
        super().__init__(steps)
        self.timings: dict[str, float] = dict(timings or {})
        self.perf: dict[str, float] = dict(perf or {})


class TorchBackend:
    """N rank processes training one policy. Use as a context manager, or call close()."""

    def __init__(self, config: BackendConfig, early: EarlyPeers | None = None) -> None:
        """early: peers spawn_peers started already (the run's start-up overlaps
        their imports with its own), adopted here; else spawned now."""
        self.config = config
        self.world_size = config.world_size
        self._procs: list = []
        self._conns: list[Connection | None] = [None] * config.world_size
        self._pack = PackWriter("pack")
        # Weight regions by slot: the asynchronous loop publishes version v into slot
        # v % (K + 1) while the engine processes (fleet/engine_procs.py) may still
        # have to load the K before it (scheduler.py); two to begin with, more made
        # as a slot is first used.
        self._weights = [ShmSegment("weights"), ShmSegment("weights1")]
        self._marker = ShmSegment("marker")
        self.rollout_segment = ShmSegment("rollout")  # the ranks' engines' results (fleet/engines.py)
        self._closed = False
        self.step = 0
        self.last_timings: dict[str, float] = {}
        self.last_perf: dict[str, float] = {}  # perf/train_tokens_per_s, perf/mfu of the last train()
        self.publishes = 0  # weight regions published (the probe runs when due)
        self.syncs = 0  # weight syncs into the ranks' engines (each one a line in run.log)
        self.peers = Peers(self._conns, self._procs, self._abort, lambda: self._closed)
        # Every segment, unlinked on any exit; weight and rollout segments join it as made.
        self._segments = [self._pack.segment, *self._weights, self._marker, self.rollout_segment]
        self._finalizer = weakref.finalize(
            self, stop_processes, self._procs, self._conns, self._segments)
        beats = None  # watched once every rank said hello (heartbeat.py)
        try:
            if config.launcher == "spawn":
                beats = self._adopt(early or early_peers_for(config))
            else:
                accept_ranks(config, self._conns, self._marker)
            self.hellos: list[dict] = self.peers.open("startup", pending=range(self.world_size)).gather(
                config.startup_timeout_s)
            self.peers.beats = beats
        except BaseException:
            self._abort()
            raise
        self.dead: BackendError | None = None  # set by the watchdog
        if self._procs:
            start_watchdog(self.peers, lambda: self._closed, self._abort, self._died, "areno-rank-watchdog")
        h0 = self.hellos[0]
        self.vocab_size: int = h0["vocab_size"]
        self.strategy: str = h0["strategy"]
        self._layout = WeightLayout.build(h0["weights"])
        self._probe_ids = probe_ids(self.vocab_size)

    def _adopt(self, early: EarlyPeers) -> HeartbeatWatch:
        """Take over spawned ranks and send each its config -> their heartbeat watch
        (the engine processes spawned with them are EngineProcs')."""
        if not early.fits(self.config):
            early.close()
            raise ValueError(f"early peers are {early.shape}; the config asks for {PeerShape.of(self.config)}")
        early.adopted = True
        self._procs.extend(early.procs)
        self._conns[:] = early.conns
        for c in self._conns:
            c.send(self.config)
        return early.beats

    # -- lifecycle -----------------------------------------------------------
    def close(self) -> None:
        """Ask every rank to exit, then make sure they have; unlink all segments."""
        if self._closed:
            return
        self._closed = True
        shut_down(self._procs, self._conns, self.peers.stale, self.config.shutdown_grace_s)
        self._finalizer()

    def _abort(self) -> None:
        self._closed = True
        self._finalizer()

    def _died(self, err: BackendError) -> None:
        self.dead = err  # the watchdog's finding (procs/watchdog.py)

    def __enter__(self) -> "TorchBackend":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def rank_pids(self) -> list[int]:
        return [h["pid"] for h in self.hellos]

    # -- commands --------------------------------------------------------------
    def train(self, split: SplitPack) -> TrainSteps:
        """One rollout batch: ppo_epochs x num_minibatches optimizer steps.

        Returns one dict per optimizer step (loss, grad_norm, lr, clip_frac,
        ratio stats, kl, entropy, logprob_diff, token counts, nan_skipped, step,
        epoch, minibatch, step_time_s), with the call's timings and perf (TrainSteps).
        Raises BackendError (backend shut down) if a rank fails or max_nan_steps
        non-finite steps come in a row.
        """
        self._check_open()
        if split.world_size != self.world_size:
            raise ValueError(f"split has {split.world_size} ranks, backend world_size is {self.world_size}")
        # numpy, not torch: torch's min/max open an OpenMP region that waits for a
        # busy core (8-34 ms on a loaded 2-core host, measured; numpy 0.4 ms).
        ids = split.pack.input_ids.numpy()
        if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= self.vocab_size):
            raise ValueError(f"pack has token ids outside the model's vocabulary [0, {self.vocab_size})")
        t0 = time.perf_counter()
        handoffs = self._pack.write(split)
        t1 = time.perf_counter()
        stream = self.peers.open("train")
        for r, h in enumerate(handoffs):
            if self.hellos[r]["same_host"]:
                stream.send(r, "train", handoff=h)
            else:
                stream.send(r, "train", handoff=replace(h, segment=None, offset=0), payload=True)
                stream.send_bytes(r, self._pack.region_bytes(h))
        replies = stream.gather(self.config.command_timeout_s)
        steps = replies[0]["steps"]
        if steps:
            self.step = int(steps[-1]["step"])
        self.last_timings = {
            "handoff_write_s": t1 - t0,
            "handoff_map_s": max(r["map_s"] for r in replies),
            "train_s": max(r["train_s"] for r in replies),
            "total_s": time.perf_counter() - t0,
        }
        h0 = self.hellos[0]
        self.last_perf = pack_train_perf(split.pack.seq_lengths, self.config.ppo_epochs, self.last_timings["train_s"],
                                         len(self.hellos), h0["flop_shape"], h0["device_name"])
        if "peak_mem_gb" in replies[0]:
            self.last_timings["peak_gpu_mem_gb"] = max(r["peak_mem_gb"] for r in replies)
            self.last_timings["peak_gpu_reserved_gb"] = max(r["peak_reserved_gb"] for r in replies)
        return TrainSteps(steps, self.last_timings, self.last_perf)

    def publish_weights(self, *, fingerprinted: bool = True, slot: int = 0) -> WeightRegion:
        """Shared-memory transport (weight_sync.py): every rank gathers, rank 0 writes
        the full weights (under LoRA the adapter alone, versioned by this publish's
        count) into the controller's weight segment -> the WeightRegion a reader in
        another process loads (weight_sync.load_region) and checks against
        (fingerprint; the probe when due for an engine that is `fingerprinted` or not).

        The region stays valid until the next publish_weights into the same `slot`
        (0, 1, ...) or close(). Names are
        the HF model's state_dict keys, lm_head.weight included (LoRA: peft's saved
        adapter names); dtype the engines'.
        """
        self._check_open()
        remote0 = not self.hellos[0]["same_host"]  # rank 0 sends the bytes; readers still map the segment
        while len(self._weights) <= slot:
            self._weights.append(ShmSegment(f"weights{len(self._weights)}"))
            self._segments.append(self._weights[-1])
        seg = self._weights[slot]
        seg.ensure(self._layout.nbytes, headroom=0.0)
        t0 = time.perf_counter()
        due = probe_due(self.publishes, fingerprinted)
        stream = self.peers.broadcast("publish_weights", range(self.world_size), drain_s=5.0,
                                      segment=None if remote0 else seg.name, layout=self._layout,
                                      probe_ids=self._probe_ids if due else None)
        out = stream.gather(self.config.command_timeout_s)[0]
        if remote0:
            seg.buf[: self._layout.nbytes] = out.pop("payload")
        self.publishes += 1
        self.last_timings = {"publish_gather_s": out["gather_s"], "publish_probe_s": out["probe_s"],
                             "publish_s": time.perf_counter() - t0}
        return WeightRegion(seg.name, self._layout, out["fingerprint"], out["probe"], out["adapter"], self.publishes)

    def sync_weights(self) -> dict[str, float]:
        """Every rank loads the current weights into its own engine (on its device)
        and checks it (fingerprint, probe when due); returns timings and, when some
        rank probed, the worst probe diff and the tightest tolerance."""
        self._check_open()
        t0 = time.perf_counter()
        # An interrupt here leaves the trained weights intact: let the load finish.
        stream = self.peers.broadcast("sync_weights", range(self.world_size), drain_s=5.0,
                                      probe_ids=self._probe_ids)
        replies = stream.gather(self.config.command_timeout_s)
        self.last_timings = {"sync_load_s": max(r["load_s"] for r in replies),
                             "sync_probe_s": max(r["probe_s"] for r in replies),
                             "sync_s": time.perf_counter() - t0,
                             # one engine's load (TP members each get a whole copy); LoRA: the adapter only
                             "sync_mb": max(r["sync_bytes"] for r in replies) / 2**20}
        probed = [r for r in replies if "probe_diff" in r]
        if probed:
            self.last_timings.update(probe_diff=max(r["probe_diff"] for r in probed),
                                     probe_tolerance=min(r["probe_tolerance"] for r in probed))
        return self.log_sync(self.last_timings)

    def log_sync(self, timings: dict[str, float]) -> dict[str, float]:
        """A sync's figures, also as one line in run.log (weight_sync.sync_line)."""
        self.syncs += 1
        return log_sync(self.syncs, timings)

    def save_pretrained(self, path: str | os.PathLike) -> Path:
        """Full HF checkpoint (safetensors, config, tokenizer files) written by rank 0."""
        return self._atomic_dir(path, "save_pretrained")

    def save_state(self, path: str | os.PathLike) -> Path:
        """Optimizer (sharded DCP), scheduler, step, NaN streak, per-rank RNG, for resume."""
        return self._atomic_dir(path, "save_state")

    def load_state(self, path: str | os.PathLike) -> None:
        path = Path(path)
        if not (path / "trainer.pt").is_file():
            raise FileNotFoundError(f"{path}: not a backend state directory (no trainer.pt)")
        self.command("load_state", path=str(path))
        self.step = int(torch.load(path / "trainer.pt", weights_only=False)["step"])

    # -- plumbing --------------------------------------------------------------
    def _atomic_dir(self, path: str | os.PathLike, cmd: str) -> Path:
        final = Path(path).absolute()
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = final.parent / f".{final.name}.tmp-{secrets.token_hex(4)}"
        tmp.mkdir()
        try:
            self.command(cmd, path=str(tmp))
            replace_dir(tmp, final)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        return final

    def _check_open(self) -> None:
        if self._closed:
            raise BackendError("backend is closed (a rank failed or close() was called)")

    def command(self, cmd: str, **kwargs) -> list:
        """Send `cmd` to every rank and wait for the replies (one per rank)."""
        stream = self.peers.broadcast(cmd, range(self.world_size), **kwargs)
        return stream.gather(self.config.command_timeout_s)

    def open_stream(self, what: str, drain_s: float = 0.0, lane: str = "main",
                    detach: bool = False, background: bool = False) -> ReplyStream:
        """A reply stream for a command sent rank by rank (stream.send)."""
        self._check_open()
        return self.peers.open(what, drain_s, lane=lane, detach=detach, background=background)

    def new_rollout_segment(self) -> ShmSegment:
        """One more result segment, for a rollout in flight beside others (unlinked at close)."""
        seg = ShmSegment(f"rollout{len(self._segments)}")
        self._segments.append(seg)
        return seg
