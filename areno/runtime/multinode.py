"""Several nodes from the CLI, with torchrun's conventions: every node runs the
same `areno train ... --nnodes N --node-rank R --master-addr HOST --master-port P`.

Node 0 runs the controller (data, rewards, the loop); it listens for ranks on
P + 1. Every node (node 0 too) starts `--nproc-per-node` rank processes
(`python -m areno.backend.rank --connect HOST:P+1`), each with its own rollout
engine, which rendezvous for torch.distributed at HOST:P and dial the
controller. A worker node (R > 0) only waits for its ranks: they exit when the
controller closes their connection, at the end of the run or on a failure.
The nodes share ARENO_BACKEND_AUTHKEY, which authenticates the ranks' connections.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time


def controller_port(master_port: int) -> int:
    """Where node 0's controller listens for ranks (the rendezvous uses master_port)."""
    return master_port + 1


def start_local_ranks(nnodes: int, node_rank: int, nproc: int, master_addr: str,
                      master_port: int) -> list[subprocess.Popen]:
    """This node's rank processes (global ranks node_rank*nproc ... +nproc-1)."""
    world = nnodes * nproc
    connect = f"{master_addr}:{controller_port(master_port)}"
    procs = []
    for local in range(nproc):
        env = dict(os.environ, RANK=str(node_rank * nproc + local), WORLD_SIZE=str(world),
                   LOCAL_RANK=str(local), LOCAL_WORLD_SIZE=str(nproc), MASTER_ADDR=master_addr,
                   MASTER_PORT=str(master_port))
        procs.append(subprocess.Popen([sys.executable, "-m", "areno.backend.rank", "--connect", connect],
                                      env=env))
    return procs


def stop(procs: list[subprocess.Popen], grace_s: float = 5.0) -> None:
    """Stop what is still running: the ranks exit on the controller's "shutdown"
    within grace_s, else SIGKILL (they ignore SIGTERM, procs/signals.py)."""
    deadline = time.monotonic() + grace_s
    for p in procs:
        try:
            p.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def run_worker_node(nnodes: int, node_rank: int, nproc: int, master_addr: str, master_port: int) -> int:
    """Node R > 0: start this node's ranks and wait for them; returns the exit code
    (0 when every rank ended cleanly, else the first failure's)."""
    procs = start_local_ranks(nnodes, node_rank, nproc, master_addr, master_port)
    print(f"areno: node {node_rank} of {nnodes}: {nproc} rank(s) joining the run at "
          f"{master_addr}:{controller_port(master_port)}", file=sys.stderr, flush=True)
    try:
        codes = [p.wait() for p in procs]
    finally:
        stop(procs)
    bad = [c for c in codes if c != 0]
    if bad:
        print(f"areno: node {node_rank}: a rank exited with code {bad[0]}; node 0's output says why",
              file=sys.stderr, flush=True)
        return 1
    return 0
