"""TorchBackend: the controller's handle on N training rank processes.

The controller (a CPU-only process; it never imports CUDA state) starts the
ranks, writes each step's SplitPack once into shared memory, sends every rank
a few hundred bytes of metadata, and waits for replies with
`multiprocessing.connection.wait` over the result pipes AND the process
sentinels, in slices of at most a second: a rank that raises is reported with
its traceback, a rank that is SIGKILLed is noticed at once, and either way
every rank is then stopped (SIGTERM, SIGKILL after a grace period) and every
shared-memory segment unlinked. Nothing blocks forever on a recv.
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import socket
import sys
import threading
import time
import weakref
from multiprocessing.connection import Connection, Listener, wait
from pathlib import Path

import torch

from areno.backend.config import BackendConfig
from areno.backend.handoff import PackWriter, RankHandoff, ShmSegment
from areno.backend.weights import WeightLayout, probe_ids
from areno.pack import SplitPack


class BackendError(RuntimeError):
    """A rank failed (exception, death, timeout); the backend has been shut down."""

    def __init__(self, message: str, *, rank: int | None = None, remote_traceback: str | None = None):
        full = message if not remote_traceback else f"{message}\n--- rank {rank} traceback ---\n{remote_traceback}"
        super().__init__(full)
        self.rank = rank
        self.remote_message = message
        self.remote_traceback = remote_traceback


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


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
        self._closed = False
        self.step = 0
        self.last_timings: dict[str, float] = {}
        self._finalizer = weakref.finalize(
            self, _cleanup, self._procs, self._conns, [self._pack.segment, self._weights, self._marker],
            config.shutdown_grace_s,
        )
        try:
            if config.launcher == "spawn":
                self._spawn()
            else:
                self._accept_external()
            self._hellos = self._gather("startup", config.startup_timeout_s)
        except BaseException:
            self._abort()
            raise
        h0 = self._hellos[0]
        self.vocab_size: int = h0["vocab_size"]
        self.strategy: str = h0["strategy"]
        self._layout = WeightLayout.build(h0["weights"])
        self._probe_ids = probe_ids(self.vocab_size)

    # -- lifecycle -----------------------------------------------------------
    def _spawn(self) -> None:
        import torch.multiprocessing as tmp

        from areno.backend.rank import spawn_main

        cfg = self.config
        ctx = tmp.get_context("spawn")
        port = cfg.master_port or free_port(cfg.master_addr)
        pdeathsig = threading.current_thread() is threading.main_thread()
        for r in range(cfg.world_size):
            parent, child = ctx.Pipe(duplex=True)
            env = {
                "MASTER_ADDR": cfg.master_addr, "MASTER_PORT": str(port), "RANK": str(r),
                "WORLD_SIZE": str(cfg.world_size), "LOCAL_RANK": str(r),
                "LOCAL_WORLD_SIZE": str(cfg.world_size),
            }
            p = ctx.Process(
                target=spawn_main, args=(cfg, child, env, os.getpid(), pdeathsig),
                name=f"areno-rank{r}", daemon=True,
            )
            p.start()
            child.close()
            self._procs.append(p)
            self._conns[r] = parent

    def _accept_external(self) -> None:
        """torchrun launcher: listen, let world_size ranks dial in (see docs/BACKEND.md)."""
        cfg = self.config
        key_hex = os.environ.get("ARENO_BACKEND_AUTHKEY") or secrets.token_hex(16)
        os.environ["ARENO_BACKEND_AUTHKEY"] = key_hex
        token = secrets.token_bytes(16)
        self._marker.ensure(len(token), headroom=0.0)
        self._marker.buf[: len(token)] = token
        listener = Listener((cfg.listen_host, cfg.listen_port), authkey=bytes.fromhex(key_hex))
        print(
            f"areno backend: waiting for {cfg.world_size} ranks on {cfg.listen_host}:{cfg.listen_port}; "
            f"start them with ARENO_BACKEND_AUTHKEY={key_hex} torchrun ... -m areno.backend.rank "
            f"--connect <this-host>:{cfg.listen_port}", file=sys.stderr, flush=True,
        )
        accepted: list = []

        def accept_all() -> None:
            try:
                while len(accepted) < cfg.world_size:
                    accepted.append(listener.accept())
            except OSError:
                pass

        t = threading.Thread(target=accept_all, daemon=True)
        t.start()
        t.join(cfg.startup_timeout_s)
        listener.close()
        if len(accepted) < cfg.world_size:
            for c in accepted:
                c.close()
            raise BackendError(f"startup: {len(accepted)} of {cfg.world_size} ranks connected "
                               f"within {cfg.startup_timeout_s:g}s")
        for conn in accepted:
            _, rank, world, _host = conn.recv()
            if world != cfg.world_size or not 0 <= rank < world or self._conns[rank] is not None:
                raise BackendError(f"startup: rank {rank} of {world} does not fit world_size {cfg.world_size}")
            self._conns[rank] = conn
            conn.send((cfg, (self._marker.name, token)))

    def close(self) -> None:
        """Ask every rank to exit, then make sure they have; unlink all segments."""
        if self._closed:
            return
        self._closed = True
        for c in self._conns:
            try:
                if c is not None:
                    c.send(("shutdown", {}))
            except (OSError, ValueError):
                pass
        deadline = time.monotonic() + self.config.shutdown_grace_s
        for p in self._procs:
            p.join(max(0.0, deadline - time.monotonic()))
        self._finalizer()

    def _abort(self) -> None:
        self._closed = True
        self._finalizer()

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
        ids = split.pack.input_ids
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.vocab_size):
            raise ValueError(f"pack has token ids outside the model's vocabulary [0, {self.vocab_size})")
        t0 = time.perf_counter()
        handoffs = self._pack.write(split)
        t1 = time.perf_counter()
        for r, h in enumerate(handoffs):
            if self._hellos[r]["same_host"]:
                self._send(r, "train", handoff=h)
            else:
                self._send(r, "train", handoff=_remote(h), payload=True)
                self._conns[r].send_bytes(self._pack.region_bytes(h))
        replies = self._gather("train", self.config.command_timeout_s)
        steps = replies[0]["steps"]
        if steps:
            self.step = int(steps[-1]["step"])
        self.last_timings = {
            "handoff_write_s": t1 - t0,
            "handoff_map_s": max(r["map_s"] for r in replies),
            "train_s": max(r["train_s"] for r in replies),
            "total_s": time.perf_counter() - t0,
        }
        if "peak_mem_gb" in replies[0]:
            self.last_timings["peak_gpu_mem_gb"] = max(r["peak_mem_gb"] for r in replies)
            self.last_timings["peak_gpu_reserved_gb"] = max(r["peak_reserved_gb"] for r in replies)
        return steps

    def export_weights(self, *, probe_tolerance: float = 1e-3):
        """-> (iterator of (HF name, tensor), Probe) for `engine.update_weights`.

        The tensors are zero-copy CPU views of a shared-memory segment the
        controller owns; they stay valid until the next export_weights or
        close(), so load (copy) them before that. Names are the HF model's
        state_dict keys, lm_head.weight included.
        """
        self._check_open()
        remote0 = not self._hellos[0]["same_host"]
        self._weights.ensure(self._layout.nbytes, headroom=0.0)
        t0 = time.perf_counter()
        self._broadcast(
            "export", segment=None if remote0 else self._weights.name, layout=self._layout,
            probe_ids=self._probe_ids, probe_tolerance=probe_tolerance,
        )
        out = self._gather("export", self.config.command_timeout_s)[0]
        if remote0:
            self._weights.buf[: self._layout.nbytes] = out["payload"]
        self.last_timings = {"export_gather_s": out["gather_s"], "export_probe_s": out["probe_s"],
                             "export_s": time.perf_counter() - t0}
        return self._layout.views(self._weights.buf), out["probe"]

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
        self._broadcast("load_state", path=str(path))
        self._gather("load_state", self.config.command_timeout_s)
        self.step = int(torch.load(path / "trainer.pt", weights_only=False)["step"])

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Every exported tensor, gathered and pickled from rank 0 (tests/debugging only)."""
        self._broadcast("full_state")
        return self._gather("full_state", self.config.command_timeout_s)[0]

    def debug(self, actions: dict[int, str] | str, seconds: float = 0.0) -> None:
        """Test hook: run an action ('sleep', 'raise', 'barrier', 'noop') on every
        rank, or {rank: action} (others: 'noop')."""
        for r in range(self.world_size):
            action = actions if isinstance(actions, str) else actions.get(r, "noop")
            self._send(r, "debug", action=action, seconds=seconds)
        self._gather("debug", self.config.command_timeout_s)

    # -- plumbing --------------------------------------------------------------
    def _atomic_dir(self, path: str | os.PathLike, cmd: str) -> Path:
        final = Path(path).absolute()
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = final.parent / f".{final.name}.tmp-{secrets.token_hex(4)}"
        tmp.mkdir()
        try:
            self._broadcast(cmd, path=str(tmp))
            self._gather(cmd, self.config.command_timeout_s)
            if final.exists():
                old = final.parent / f".{final.name}.old-{secrets.token_hex(4)}"
                os.rename(final, old)
                os.rename(tmp, final)
                shutil.rmtree(old, ignore_errors=True)
            else:
                os.rename(tmp, final)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        return final

    def _check_open(self) -> None:
        if self._closed:
            raise BackendError("backend is closed (a rank failed or close() was called)")

    def _send(self, rank: int, cmd: str, **kwargs) -> None:
        self._check_open()
        try:
            self._conns[rank].send((cmd, kwargs))
        except (OSError, ValueError) as e:
            self._abort()
            raise BackendError(f"rank {rank}: cannot send {cmd!r} ({e}); rank is gone", rank=rank) from None

    def _broadcast(self, cmd: str, **kwargs) -> None:
        for r in range(self.world_size):
            self._send(r, cmd, **kwargs)

    def _gather(self, what: str, timeout_s: float) -> list:
        """One reply per rank; any error, death or timeout aborts the backend."""
        try:
            return self._gather_inner(what, timeout_s)
        except BaseException:  # BackendError, KeyboardInterrupt, ...
            self._abort()
            raise

    def _gather_inner(self, what: str, timeout_s: float) -> list:
        W = self.world_size
        results: list = [None] * W
        pending = set(range(W))
        deadline = time.monotonic() + timeout_s
        sentinels = {p.sentinel: r for r, p in enumerate(self._procs)}
        while pending:
            left = deadline - time.monotonic()
            if left <= 0:
                raise BackendError(f"{what}: rank(s) {sorted(pending)} did not answer within {timeout_s:g}s")
            ready = set(wait([self._conns[r] for r in pending] + list(sentinels), timeout=min(left, 1.0)))
            errors: list[BackendError] = []
            for r in sorted(pending):
                if self._conns[r] in ready:
                    try:
                        results[r] = self._recv(r, what)
                        pending.discard(r)
                    except BackendError as e:
                        errors.append(e)
            dead = [r for s, r in sentinels.items() if s in ready]
            if errors and not dead and sentinels:
                # A rank's error is often the echo of a peer's death (gloo: "connection
                # closed by peer"); look briefly so the root cause is what gets reported.
                dead = [sentinels[s] for s in wait(list(sentinels), timeout=0.5)]
            if dead:
                raise self._death(dead[0], what, errors)
            if errors:
                raise errors[0]
        return results

    def _death(self, r: int, what: str, echoes: list[BackendError]) -> BackendError:
        if self._conns[r] is not None and self._conns[r].poll(0):
            try:
                self._recv(r, what)  # the dead rank's own last words, if it sent an error
            except BackendError as e:
                if e.remote_traceback:
                    return e
        p = self._procs[r]
        p.join(0.1)
        msg = f"{what}: rank {r} (pid {p.pid}) died ({_exit_name(p.exitcode)})"
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
            raise BackendError(f"{what}: rank {rank} failed: {message}", rank=rank, remote_traceback=tb)
        return msg[1]


def _remote(h: RankHandoff) -> RankHandoff:
    from dataclasses import replace

    return replace(h, segment=None, offset=0)


def _exit_name(code: int | None) -> str:
    if code is None:
        return "still running"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"signal {-code}"
    return f"exit code {code}"


def _cleanup(procs: list, conns: list, segments: list[ShmSegment], grace_s: float) -> None:
    """Stop every rank (SIGTERM, then SIGKILL), close pipes, unlink segments. Idempotent."""
    try:
        alive = [p for p in procs if p.is_alive()]
        for p in alive:
            p.terminate()
        deadline = time.monotonic() + min(grace_s, 3.0)
        for p in alive:
            p.join(max(0.0, deadline - time.monotonic()))
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(5.0)
        for i, c in enumerate(conns):
            if c is not None:
                try:
                    c.close()
                except OSError:
                    pass
                conns[i] = None
    finally:
        for s in segments:
            s.unlink()

