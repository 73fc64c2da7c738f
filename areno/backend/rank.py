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
import os
import socket
import sys
import time
from multiprocessing.connection import Client, Connection
from typing import Any

from areno.backend.config import BackendConfig
from areno.procs.heartbeat import start_beating
from areno.procs.lifecycle import die_with_parent, set_title, start_up
from areno.procs.serve import quiet_peer, serve_worker
from areno.rundir.log import move_child_output, redirect_child_output
from areno.timing import startup_mark


# -- entry points --------------------------------------------------------------
def spawn_main(conn: Connection, env: dict[str, str], parent_pid: int, use_pdeathsig: bool,
               beats: Any = None) -> None:
    """Target of the controller's spawn processes (launch.spawn_peers): the heavy
    imports first, then the BackendConfig from the pipe (the controller may still
    be loading its tokenizer and data meanwhile); beats: heartbeat slots."""
    os.environ.update(env)  # first: torch.distributed's variables (launch.peer_env)
    quiet_peer()  # before any thread starts: they inherit the signal mask
    die_with_parent(parent_pid, use_pdeathsig)
    _name_process(env, parent_pid)
    if beats is not None:
        start_beating(beats, int(env["RANK"]))
    redirect_child_output()  # third-party output to RUN_DIR/run.log (see areno/rundir/log.py)
    startup_mark("peer imports")
    with start_up():
        worker_class()  # torch, transformers, the worker: while the controller works
    startup_mark("peer imported")
    try:
        cfg = conn.recv()
    except (EOFError, OSError):  # the controller stopped first (a user mistake in its data)
        os._exit(4)
    move_child_output(cfg.run_log)  # started before the run dir existed (runtime/early.py)
    serve(cfg, conn, same_host=True)


def _name_process(env: dict[str, str], parent_pid: int) -> None:
    """`areno: rank i of run PID` in ps (procs.set_title)."""
    set_title(f"areno: rank {env['RANK']} of run {parent_pid}", f"areno-rank{env['RANK']}")


def worker_class() -> type:
    """The RankWorker; importing it imports torch and transformers."""
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
    quiet_peer()
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
    """Build the RankWorker, report ready, then run commands until shutdown or EOF
    (procs/serve.py)."""
    serve_worker(lambda: worker_class()(cfg, same_host=same_host), conn, int(os.environ["RANK"]))


if __name__ == "__main__":
    sys.exit(main())
