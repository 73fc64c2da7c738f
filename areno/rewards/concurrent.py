"""A worker that runs many async plugin calls at once (agents: --agent-concurrency).

An agent run spends its time waiting on the gateway, so one run per worker
process leaves the engine idle unless there are as many processes as runs.
Here a worker has `slots` slots: the pool (rewards/pool.py) sends a chunk to a
free slot, and the worker runs every chunk it holds as a task of one event
loop, at most `slots` at a time (a semaphore). Each slot has its own progress
triple, values and statuses in the worker's shared memory (slot s at
3*s in progress, s*max_chunk in values/status), so the pool watches each run's
clock as it watches a one-run worker's.

A run past the timeout is cancelled here (STATUS_TIMEOUT), a raise is that
run's error: the other runs go on. The pool's kill stays as the backstop (a
run that blocks the event loop, a crash), a grace later; it ends every run on
the worker, each charged (rewards/pool.py, _retire).
"""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import numpy as np

from areno.rewards.plugin import STATUS_OK


def serve_concurrent(kind: Any, plugin: Any, conn: Any, progress: Any, vals: np.ndarray, stat: np.ndarray,
                     slots: int, timeout: float) -> None:
    """The worker's loop: messages (seq, records, slot) in, ("err"/"out"/"done", ...)
    out as a one-run worker sends them; None or a closed pipe ends it."""
    loop = asyncio.new_event_loop()
    inbox: asyncio.Queue = asyncio.Queue()

    def read() -> None:  # the pipe's reads off the loop; the loop alone sends
        while True:
            try:
                msg = conn.recv()
            except (EOFError, OSError):
                msg = None
            loop.call_soon_threadsafe(inbox.put_nowait, msg)
            if msg is None:
                return

    threading.Thread(target=read, name="areno-worker-inbox", daemon=True).start()
    loop.run_until_complete(_serve(kind, plugin, conn, progress, vals, stat, slots, timeout, inbox))


async def _serve(kind: Any, plugin: Any, conn: Any, progress: Any, vals: np.ndarray, stat: np.ndarray,
                 slots: int, timeout: float, inbox: asyncio.Queue) -> None:
    gate = asyncio.Semaphore(slots)
    size = vals.size // slots
    tasks: set[asyncio.Task] = set()

    async def run(seq: int, recs: list, slot: int) -> None:
        async with gate:
            p, at = 3 * slot, size * slot
            for i, rec in enumerate(recs):
                # The write order of a one-run worker: start time, position, seq.
                progress[p + 2] = time.monotonic()
                progress[p + 1] = i
                progress[p] = seq
                s, v, m, payload = await kind.acall(plugin, rec, timeout)
                if s != STATUS_OK:  # an error or a timeout: before the status, as a one-run worker
                    conn.send(("err", seq, i, m))
                elif payload is not None:
                    conn.send(("out", seq, i, payload))
                vals[at + i] = v
                stat[at + i] = s
            conn.send(("done", seq))

    while (msg := await inbox.get()) is not None:
        task = asyncio.ensure_future(run(msg[0], msg[1], msg[2]))
        tasks.add(task)
        task.add_done_callback(tasks.discard)
    for task in list(tasks):
        task.cancel()
