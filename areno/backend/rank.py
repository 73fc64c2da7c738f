"""The rank process: one per GPU (or gloo CPU process), driven by the controller.

Two ways in, one loop:
  * spawn (one node): `launch.spawn_peers` starts `spawn_main` in N processes with a
    duplex pipe each; MASTER_ADDR/MASTER_PORT/RANK/WORLD_SIZE come in `env`.
  * torchrun (multi-node): `python -m areno.backend.rank --connect HOST:PORT`
    under torchrun reads RANK/WORLD_SIZE/LOCAL_RANK/MASTER_ADDR/MASTER_PORT from
    the environment and dials the controller (authkey from ARENO_BACKEND_AUTHKEY).

Messages from the controller are small tuples (command, kwargs); replies are
("ok", result) or ("err", rank, message, traceback). Step data never travels
in them: a train command carries a `RankHandoff` naming the shared-memory
region to map (or, for a rank on another host, one raw bytes message follows).
"""

from __future__ import annotations

import argparse
import functools
import os
import queue
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable
from multiprocessing.connection import Client, Connection
from typing import Any

from areno.backend.config import BackendConfig
from areno.procs.heartbeat import start_beating
from areno.procs.lifecycle import die_with_parent, set_title
from areno.procs.signals import peer_ignores
from areno.rundir.log import move_child_output, redirect_child_output
from areno.timing import startup_mark


# -- process hygiene ---------------------------------------------------------
def _quiet() -> None:
    # Ctrl-C, a scheduler's SIGTERM, a closed terminal's SIGHUP reach the whole
    # job; the controller owns shutdown (procs/signals.py). Library output
    # (weight-loading bars, engine logs) goes to RUN_DIR/run.log, or to the
    # terminal with --verbose (areno/rundir/log.py), so it is not silenced here.
    peer_ignores()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


# -- entry points --------------------------------------------------------------
def spawn_main(conn: Connection, env: dict[str, str], parent_pid: int, use_pdeathsig: bool,
               beats: Any = None) -> None:
    """Target of the controller's spawn processes (launch.spawn_peers): the heavy
    imports first, then the BackendConfig from the pipe (the controller may still
    be loading its tokenizer and data meanwhile); beats: heartbeat slots."""
    os.environ.update(env)  # first: an engine process's CUDA_VISIBLE_DEVICES (launch.peer_env)
    _quiet()  # before any thread starts: they inherit the signal mask
    die_with_parent(parent_pid, use_pdeathsig)
    _name_process(env, parent_pid)
    if beats is not None:
        start_beating(beats, int(env.get("ARENO_PEER_INDEX", env.get("RANK"))))
    redirect_child_output()  # third-party output to RUN_DIR/run.log (see areno/rundir/log.py)
    startup_mark("peer imports")
    worker_class("ARENO_PEER_INDEX" in env)  # torch, transformers, the worker: while the controller works
    startup_mark("peer imported")
    try:
        cfg = conn.recv()
    except (EOFError, OSError):  # the controller stopped first (a user mistake in its data)
        os._exit(4)
    move_child_output(cfg.run_log)  # started before the run dir existed (runtime/early.py)
    serve(cfg, conn, same_host=True)


def _name_process(env: dict[str, str], parent_pid: int) -> None:
    """`areno: rank i of run PID` / `areno: engine j of run PID` in ps (procs.set_title)."""
    import multiprocessing

    name = multiprocessing.current_process().name  # launch.spawn_peers: areno-rank{i}, areno-engine{j}
    role = "engine " + name.removeprefix("areno-engine") if "ARENO_PEER_INDEX" in env else "rank " + env["RANK"]
    set_title(f"areno: {role} of run {parent_pid}", name)


def worker_class(engine_proc: bool) -> type:
    """The worker this process runs: an EngineWorker (split placement's engine
    process) or a RankWorker; importing it imports torch and transformers."""
    if engine_proc:
        from areno.backend.engine_proc import EngineWorker

        return EngineWorker
    import transformers

    from areno.backend.worker import RankWorker

    transformers.AutoModelForCausalLM  # noqa: B018 - the lazy module's heavy import, now
    return RankWorker


def main(argv: list[str] | None = None) -> int:
    """torchrun entry point: dial the controller, then serve."""
    ap = argparse.ArgumentParser(prog="python -m areno.backend.rank")
    ap.add_argument("--connect", required=True, help="HOST:PORT the controller listens on")
    args = ap.parse_args(argv)
    host, _, port = args.connect.rpartition(":")
    key = os.environ.get("ARENO_BACKEND_AUTHKEY")
    if not key:
        print("areno rank: ARENO_BACKEND_AUTHKEY is not set (the controller prints it)", file=sys.stderr)
        return 2
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        if var not in os.environ:
            print(f"areno rank: {var} is not set; run under torchrun", file=sys.stderr)
            return 2
    _quiet()
    conn = _dial(host, int(port), bytes.fromhex(key))
    conn.send(("hello", int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), socket.gethostname()))
    cfg, marker = conn.recv()
    # ARENO_RANK_ASSUME_REMOTE=1 forces the bytes transport (tests of the multi-node path).
    same_host = _sees_segment(marker) and not os.environ.get("ARENO_RANK_ASSUME_REMOTE")
    serve(cfg, conn, same_host=same_host)
    return 0


def _dial(host: str, port: int, key: bytes, timeout_s: float = 300.0) -> Connection:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return Client((host, port), authkey=key)
        except (ConnectionRefusedError, OSError):
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


def _sees_segment(marker: tuple[str, bytes]) -> bool:
    """Same host as the controller iff its marker segment is readable here."""
    name, token = marker
    try:
        with open(os.path.join("/dev/shm", name), "rb") as f:
            return f.read(len(token)) == token
    except OSError:
        return False


def serve(cfg: BackendConfig, conn: Connection, *, same_host: bool) -> None:
    """Build the worker (a RankWorker, or an EngineWorker in an engine process of
    split placement: ARENO_PEER_INDEX set), report ready, then run commands until
    shutdown or EOF."""
    engine_proc = "ARENO_PEER_INDEX" in os.environ
    rank = int(os.environ["ARENO_PEER_INDEX" if engine_proc else "RANK"])
    try:
        worker = worker_class(engine_proc)(cfg, same_host=same_host)
        worker.emit = lambda part: conn.send(("part", part))
        startup_mark("peer ready")
        conn.send(("ok", worker.hello()))
    except BaseException as e:  # noqa: BLE001 - reported, then exit
        _reply_error(conn, rank, e)
        return
    recv = queued_commands(conn) if engine_proc else conn.recv
    while True:
        try:
            cmd, kwargs = recv()
        except (EOFError, OSError):  # controller gone
            os._exit(4)
        if cmd == "shutdown":
            worker.close()
            conn.send(("ok", None))
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(0)  # nothing left to clean up; skip the slow interpreter teardown
        try:
            if kwargs.pop("payload", False):
                buf = bytearray(kwargs["handoff"].nbytes)
                conn.recv_bytes_into(buf)
                kwargs["payload"] = buf
            result = command_of(worker, cmd)(**kwargs)
            conn.send(("ok", result))
        except BaseException as e:  # noqa: BLE001
            _reply_error(conn, rank, e)


def command_of(worker: Any, cmd: str) -> Callable[..., Any]:
    """worker.cmd_<cmd>, else the command its hooks add (RankHooks.command)."""
    fn = getattr(worker, f"cmd_{cmd}", None)
    if fn is not None:
        return fn
    extra = worker.hooks.command(cmd)
    if extra is None:
        raise AttributeError(f"{type(worker).__name__} has no command {cmd!r}")
    return functools.partial(extra, worker)


def queued_commands(conn: Connection) -> Callable[[], tuple]:
    """An engine process's commands, read by a thread of their own as they come ->
    the call that takes the next: the controller queues rollouts here while one
    runs (scheduler.py), and a command bigger than the pipe's buffer must not
    hold the controller's send until this rollout ends (while its parts fill
    the other direction). Reading and sending on one pipe from two threads is
    safe: the two directions share no state."""
    inbox: queue.Queue = queue.Queue()

    def read() -> None:
        while True:
            try:
                inbox.put(conn.recv())
            except (EOFError, OSError) as e:
                inbox.put(e)
                return

    threading.Thread(target=read, name="areno-engine-commands", daemon=True).start()

    def take() -> tuple:
        item = inbox.get()
        if isinstance(item, BaseException):
            raise item
        return item
    return take


def _reply_error(conn: Connection, rank: int, e: BaseException) -> None:
    try:
        conn.send(("err", rank, f"{type(e).__name__}: {e}", traceback.format_exc()))
    except (OSError, EOFError):
        pass


if __name__ == "__main__":
    sys.exit(main())
