"""TorchBackend: the controller's handle on N training rank processes.

The controller (a CPU-only process; it never imports CUDA state) starts the
ranks, writes each step's SplitPack once into shared memory, sends every rank
a few hundred bytes of metadata, and waits for replies with
`multiprocessing.connection.wait` over the result pipes AND the process
sentinels, in slices of at most a second: a rank that raises is reported with
its traceback, a rank that is SIGKILLed is noticed at once, one whose heartbeat
stops (SIGSTOP: backend/heartbeat.py) within its bound, and either way
every rank is then stopped (SIGTERM, SIGKILL after a grace period) and every
shared-memory segment unlinked. Nothing blocks forever on a recv.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import signal
import threading
import time
import weakref
from collections.abc import Iterable, Iterator
from dataclasses import replace
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any

import torch

from areno.backend.config import BackendConfig
from areno.backend.errors import USER_ERROR, BackendError, RankUserError
from areno.backend.handoff import PackWriter, ShmSegment
from areno.backend.heartbeat import HeartbeatWatch, stuck_rank_error
from areno.backend.launch import accept_ranks, free_port, spawn_ranks  # noqa: F401 (re-exported)
from areno.backend.signals import signals_held
from areno.backend.weights import WeightLayout, probe_ids
from areno.fileperms import replace_dir
from areno.perf import pack_train_perf
from areno.procs import exit_text, stop_processes
from areno.split import SplitPack


class TorchBackend:
    """N rank processes training one policy. Use as a context manager, or call close()."""

    def __init__(self, config: BackendConfig) -> None:
        self.config = config
        self.world_size = config.world_size
        self._procs: list = []
        self._conns: list[Connection | None] = [None] * config.world_size
        self._pack = PackWriter("pack")
        self._weights = ShmSegment("weights")
        self._marker = ShmSegment("marker")
        self.rollout_segment = ShmSegment("rollout")  # engines' results (backend/rollout.py)
        self._closed = False
        self.step = 0
        self.last_timings: dict[str, float] = {}
        self.last_perf: dict[str, float] = {}  # perf/train_tokens_per_s, perf/mfu of the last train()
        self._open_stream: dict | None = None  # a command whose replies are still coming (_start)
        self._finalizer = weakref.finalize(
            self, stop_processes, self._procs, self._conns, [self._pack.segment, self._weights, self._marker, self.rollout_segment],
            config.shutdown_grace_s,
        )
        self._beats = beats = None  # watched once every rank said hello (heartbeat.py)
        try:
            if config.launcher == "spawn":
                beats = HeartbeatWatch(self.world_size, config.heartbeat_timeout_s)
                self._procs.extend(spawn_ranks(config, self._conns, beats.slots))
            else:
                accept_ranks(config, self._conns, self._marker)
            self._hellos = self._gather(self._start("startup", pending=range(self.world_size)),
                                        config.startup_timeout_s)
            self._beats = beats
        except BaseException:
            self._abort()
            raise
        self.dead: BackendError | None = None  # set by the watchdog
        self._busy = False  # the main thread is waiting on the ranks: it sees a death itself
        if self._procs:
            threading.Thread(target=self._watch, name="areno-rank-watchdog", daemon=True).start()
        h0 = self._hellos[0]
        self.vocab_size: int = h0["vocab_size"]
        self.strategy: str = h0["strategy"]
        self._layout = WeightLayout.build(h0["weights"])
        self._probe_ids = probe_ids(self.vocab_size)

    # -- lifecycle -----------------------------------------------------------
    def close(self) -> None:
        """Ask every rank to exit, then make sure they have; unlink all segments."""
        if self._closed:
            return
        self._closed = True
        for c in filter(None, self._conns):
            with contextlib.suppress(OSError, ValueError):
                c.send(("shutdown", {}))
        deadline = time.monotonic() + self.config.shutdown_grace_s
        for p in self._procs:
            p.join(max(0.0, deadline - time.monotonic()))
        self._finalizer()

    def _abort(self) -> None:
        self._closed = True
        self._finalizer()

    def _watch(self) -> None:
        """Between commands (during a rollout, say) nobody waits on the ranks: a
        rank that dies then would only be noticed at the next call, minutes later
        on a long rollout. Notice it within a second and interrupt the main thread
        (SIGINT: KeyboardInterrupt there); the caller finds the reason in `self.dead`."""
        sentinels = {p.sentinel: r for r, p in enumerate(self._procs)}
        while not self._closed:
            ready = wait(list(sentinels), timeout=1.0)
            if self._closed or self._busy:  # _wait_some reports it, with the rank's own last words
                time.sleep(0.2 if ready else 0.0)
                continue
            self.dead = (self._death(sentinels[ready[0]], "between commands", []) if ready else
                         stuck_rank_error(self._beats, self._procs, "between commands"))
            if self.dead is None:
                continue
            self._abort()
            # A real signal (not _thread.interrupt_main, which is only seen at the
            # next bytecode) so that a blocking call in the main thread returns too.
            signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)
            return

    def __enter__(self) -> "TorchBackend":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def rank_pids(self) -> list[int]:
        return [h["pid"] for h in self._hellos]

    # -- commands --------------------------------------------------------------
    def train(self, split: SplitPack) -> list[dict[str, float]]:
        """One rollout batch: ppo_epochs x num_minibatches optimizer steps.

        Returns one dict per optimizer step (loss, grad_norm, lr, clip_frac,
        ratio stats, kl, entropy, logprob_diff, token counts, nan_skipped, step,
        epoch, minibatch, step_time_s). Raises BackendError (backend shut down)
        if a rank fails or max_nan_steps non-finite steps come in a row.
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
        stream = self._start("train")
        for r, h in enumerate(handoffs):
            if self._hellos[r]["same_host"]:
                self._send(r, "train", stream=stream, handoff=h)
            else:
                self._send(r, "train", stream=stream, handoff=replace(h, segment=None, offset=0), payload=True)
                self._conns[r].send_bytes(self._pack.region_bytes(h))
        replies = self._gather(stream, self.config.command_timeout_s)
        steps = replies[0]["steps"]
        if steps:
            self.step = int(steps[-1]["step"])
        self.last_timings = {
            "handoff_write_s": t1 - t0,
            "handoff_map_s": max(r["map_s"] for r in replies),
            "train_s": max(r["train_s"] for r in replies),
            "total_s": time.perf_counter() - t0,
        }
        h0 = self._hellos[0]
        self.last_perf = pack_train_perf(split.pack.seq_lengths, self.config.ppo_epochs, self.last_timings["train_s"],
                                         len(self._hellos), h0["flop_shape"], h0["device_name"])
        if "peak_mem_gb" in replies[0]:
            self.last_timings["peak_gpu_mem_gb"] = max(r["peak_mem_gb"] for r in replies)
            self.last_timings["peak_gpu_reserved_gb"] = max(r["peak_reserved_gb"] for r in replies)
        return steps

    def export_weights(self, *, engine_dtype: str | None = None):
        """-> (iterator of (HF name, tensor), Probe) for `engine.update_weights`; the
        probe's tolerance is the uncalibrated bound of `engine_dtype` (None: the backend's).

        The tensors are zero-copy CPU views of a shared-memory segment the
        controller owns; they stay valid until the next export_weights or
        close(), so load (copy) them before that. Names are the HF model's
        state_dict keys, lm_head.weight included.
        """
        self._check_open()
        remote0 = not self._hellos[0]["same_host"]
        self._weights.ensure(self._layout.nbytes, headroom=0.0)
        t0 = time.perf_counter()
        stream = self._broadcast(
            "export", segment=None if remote0 else self._weights.name, layout=self._layout,
            probe_ids=self._probe_ids, engine_dtype=engine_dtype or self.config.dtype,
        )
        out = self._gather(stream, self.config.command_timeout_s)[0]
        if remote0:
            self._weights.buf[: self._layout.nbytes] = out["payload"]
        self.last_timings = {"export_gather_s": out["gather_s"], "export_probe_s": out["probe_s"],
                             "export_s": time.perf_counter() - t0}
        return self._layout.views(self._weights.buf), out["probe"]

    def sync_weights(self) -> dict[str, float]:
        """Every rank loads the current weights into its own engine (on its device)
        and checks it (fingerprint, probe when due); returns timings and, when some
        rank probed, the worst probe diff and the tightest tolerance."""
        self._check_open()
        t0 = time.perf_counter()
        # An interrupt here leaves the trained weights intact: let the load finish.
        stream = self._broadcast("sync_weights", drain_s=5.0, probe_ids=self._probe_ids)
        replies = self._gather(stream, self.config.command_timeout_s)
        self.last_timings = {"sync_load_s": max(r["load_s"] for r in replies),
                             "sync_probe_s": max(r["probe_s"] for r in replies),
                             "sync_s": time.perf_counter() - t0,
                             # one engine's load (TP members each get a whole copy); LoRA: the adapter only
                             "sync_mb": max(r["sync_bytes"] for r in replies) / 2**20}
        probed = [r for r in replies if "probe_diff" in r]
        if probed:
            self.last_timings.update(probe_diff=max(r["probe_diff"] for r in probed),
                                     probe_tolerance=min(r["probe_tolerance"] for r in probed))
        return self.last_timings

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
        self._gather(self._broadcast("load_state", path=str(path)), self.config.command_timeout_s)
        self.step = int(torch.load(path / "trainer.pt", weights_only=False)["step"])

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Every exported tensor, gathered and pickled from rank 0 (tests/debugging only)."""
        return self._gather(self._broadcast("full_state"), self.config.command_timeout_s)[0]

    # -- plumbing --------------------------------------------------------------
    def _atomic_dir(self, path: str | os.PathLike, cmd: str) -> Path:
        final = Path(path).absolute()
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = final.parent / f".{final.name}.tmp-{secrets.token_hex(4)}"
        tmp.mkdir()
        try:
            self._gather(self._broadcast(cmd, path=str(tmp)), self.config.command_timeout_s)
            replace_dir(tmp, final)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        return final

    def _check_open(self) -> None:
        if self._closed:
            raise BackendError("backend is closed (a rank failed or close() was called)")

    def _send(self, rank: int, cmd: str, *, stream: dict, **kwargs) -> None:
        """stream: the command's reply stream (`_start`), which now owes this rank's reply."""
        if self._open_stream is not stream:  # opened by _start: an abandoned one was settled there
            raise RuntimeError(f"{cmd!r} sent on a stream that is not open")
        self._check_open()
        try:
            with signals_held():  # sent whole and owed, or neither
                self._conns[rank].send((cmd, kwargs))
                stream["pending"].add(rank)
        except (OSError, ValueError) as e:
            dead = [r for r, p in enumerate(self._procs) if p.exitcode is not None]
            err = (self._death(dead[0], cmd, []) if dead else
                   BackendError(f"rank {rank}: cannot send {cmd!r} ({e}); rank is gone", rank=rank))
            self._abort()
            raise err from None

    def _broadcast(self, cmd: str, *, drain_s: float = 0.0, **kwargs) -> dict:
        """Send `cmd` to every rank -> its reply stream (for _gather)."""
        stream = self._start(cmd, drain_s)
        for r in range(self.world_size):
            self._send(r, cmd, stream=stream, **kwargs)
        return stream

    def _gather(self, stream: dict, timeout_s: float) -> list:
        """One reply per rank; any error, death or timeout aborts the backend
        (an interrupt too, unless the stream's drain_s > 0: see _events)."""
        results: list = [None] * self.world_size
        for r, kind, payload in self._events(stream, timeout_s):
            if kind == "part":
                self._abort()
                raise BackendError(f"{stream['what']}: rank {r} sent a streamed part to a plain command", rank=r)
            results[r] = payload
        return results

    def _start(self, what: str, drain_s: float = 0.0, pending: Iterable[int] = ()) -> dict:
        """A command's reply stream, opened before its sends (each adds its rank to
        `pending`), so an interrupt between a send and the first read still finds
        the ranks that owe replies (_settle). The replies of an abandoned command
        (a caller left its stream unread or suspended) are settled first."""
        if self._open_stream is not None:
            self._settle(self._open_stream)
        self._open_stream = {"what": what, "pending": set(pending), "drain_s": drain_s}
        return self._open_stream

    def _events(self, stream: dict, timeout_s: float) -> Iterator[tuple[int, str, Any]]:
        """Yield (rank, "part" | "ok", payload) as replies arrive, until every rank
        has sent its final "ok". Any error, death or timeout aborts the backend.
        So does a consumer that stops early (Ctrl-C while scoring a part, say),
        unless drain_s > 0 (commands that leave the trained weights as they were):
        then the rest of the replies are read for up to drain_s seconds and, if
        all come, the backend stays usable (e.g. to save the last finished step)."""
        what = stream["what"]
        try:
            deadline = time.monotonic() + timeout_s
            while stream["pending"]:
                for r, msg in self._wait_some(what, stream["pending"], deadline, timeout_s):
                    yield r, msg[0], msg[1]
        finally:
            self._settle(stream)

    def _settle(self, stream: dict) -> None:
        """End a command's replies once: drain what is left (drain_s > 0) or abort.
        Runs when its generator finishes or is closed, or before the next command
        if the caller left it suspended (an exception raised while a part was being
        scored keeps the generator alive in its traceback)."""
        if self._open_stream is not stream:
            return
        self._open_stream = None
        pending, drain_s = stream["pending"], stream["drain_s"]
        if pending and not (drain_s > 0 and self._drain(stream["what"], pending, drain_s)):
            self._abort()

    def _drain(self, what: str, pending: set[int], drain_s: float) -> bool:
        """Read and drop replies until every pending rank has finished (True) or
        drain_s passed, a rank failed, or a second interrupt came (False)."""
        if self._closed:  # the watchdog already tore the backend down
            return False
        deadline = time.monotonic() + drain_s
        try:
            while pending:
                self._wait_some(what, pending, deadline, drain_s)
        except (BackendError, KeyboardInterrupt, OSError, ValueError):
            return False
        return True

    def _wait_some(self, what: str, pending: set[int], deadline: float, timeout_s: float) -> list:
        """Wait (<= 1 s) for messages of pending ranks -> [(rank, message)]; a rank
        whose final "ok" came leaves `pending` here, in the same held block as the
        read. Raises BackendError for a rank's error, death or the deadline."""
        left = deadline - time.monotonic()
        if left <= 0:
            raise BackendError(f"{what}: rank(s) {sorted(pending)} did not answer within {timeout_s:g}s")
        sentinels = {p.sentinel: r for r, p in enumerate(self._procs)}
        # Only while in here: a caller may hold a streamed command open for long
        # (scoring a part in-process), and then the watchdog must act. A death seen
        # here closes the backend before the flag drops, so the watchdog, which
        # sees the same sentinel, never interrupts a run that is already stopping.
        self._busy = True
        try:
            ready = set(wait([self._conns[r] for r in pending] + list(sentinels), timeout=min(left, 1.0)))
            got, errors = [], []
            with signals_held():  # a reply read is a reply counted
                for r in sorted(pending):
                    if self._conns[r] in ready:
                        try:
                            got.append((r, self._recv(r, what)))
                        except BackendError as e:
                            errors.append(e)
                pending.difference_update(r for r, msg in got if msg[0] == "ok")
            dead = [r for s, r in sentinels.items() if s in ready]
            if errors and not dead and sentinels:
                # A rank's error is often the echo of a peer's death (gloo: "connection
                # closed by peer"); look briefly so the root cause is what gets reported.
                dead = [sentinels[s] for s in wait(list(sentinels), timeout=0.5)]
            err = (self._death(dead[0], what, errors) if dead else errors[0] if errors else
                   stuck_rank_error(self._beats, self._procs, what))
            if err is not None:
                self._abort()
                raise err
            return got
        finally:
            self._busy = False

    def _death(self, r: int, what: str, echoes: list[BackendError]) -> BackendError:
        if self._conns[r] is not None and self._conns[r].poll(0):
            try:
                self._recv(r, what)  # the dead rank's own last words, if it sent an error
            except BackendError as e:
                if e.remote_traceback:
                    return e
        p = self._procs[r]
        p.join(0.1)
        msg = f"{what}: rank {r} (pid {p.pid}) died ({exit_text(p.exitcode)})"
        if echoes:
            msg += f"; then {echoes[0].remote_message}"
        return BackendError(msg, rank=r)

    def _recv(self, r: int, what: str):
        try:
            msg = self._conns[r].recv()
        except (EOFError, OSError):
            raise BackendError(f"{what}: rank {r} closed its connection (died?)", rank=r) from None
        if msg[0] == "err":
            _, rank, message, tb = msg
            if message.startswith(USER_ERROR):  # the user's to fix: their one line, exit 2
                raise RankUserError(message[len(USER_ERROR):], rank=rank)
            raise BackendError(f"{what}: rank {rank} failed: {message}", rank=rank, remote_traceback=tb)
        return msg

