"""The watchdog of a group of peers between commands.

Between commands (during a rollout, say) nobody waits on the peers: one that
dies then would only be noticed at the next call, minutes later on a long
rollout. A thread notices it within a second (its sentinel, or its heartbeat,
procs/heartbeat.py), tears the owner down and interrupts the main thread
(SIGINT: KeyboardInterrupt there); the caller finds the reason in the owner's
`dead`."""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import wait

from areno.procs.errors import BackendError
from areno.procs.heartbeat import stuck_rank_error
from areno.procs.replies import Peers


def start_watchdog(peers: Peers, is_closed: Callable[[], bool], abort: Callable[[], None],
                   dead: Callable[[BackendError], None], name: str) -> None:
    """Watch `peers` (their processes and heartbeats) in a daemon thread until the
    owner closes: a death or a silence past the bound calls dead(error), abort()
    and interrupts the main thread. Silent while the main thread waits on them
    (peers.busy): that wait reports it, with the peer's own last words."""

    def watch() -> None:
        sentinels = {p.sentinel: r for r, p in enumerate(peers.procs)}
        while not is_closed():
            ready = wait(list(sentinels), timeout=1.0)
            if is_closed() or peers.busy:
                time.sleep(0.2 if ready else 0.0)
                continue
            err = (peers.death(sentinels[ready[0]], "between commands", []) if ready else
                   stuck_rank_error(peers.beats, peers.procs, "between commands", peers.label))
            if err is None:
                continue
            dead(err)
            abort()
            # A real signal (not _thread.interrupt_main, which is only seen at the
            # next bytecode) so that a blocking call in the main thread returns too.
            signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)
            return

    threading.Thread(target=watch, name=name, daemon=True).start()
