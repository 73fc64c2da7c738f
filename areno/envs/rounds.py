"""Several multi-turn rounds in one loop over one engine (--partial-rollouts,
fleet/episode_fill.py): while every trajectory of the running rounds waits on
its environment, the engine would idle; a round queued behind them starts
then, and from there on every round's ready trajectories take their turns as
they come (the eager schedule: which trajectories share a generate call depends
on when env calls return, so this is never the deterministic `turns`
schedule, which runs its rounds one after another).

Each round keeps its own driver (envs/driver.py's _Driver: its trajectories,
rewards, seeds and streamed parts); they share the engine and the environment
pool. A round ends when its every trajectory has; `done` hears of each, in
the order they end. When the run is saving (`halting`: a Ctrl-C under
--partial-rollouts), a wait on environments ends every waiting trajectory
where it is (envs/halted.py, halt_waiting) instead of waiting for the calls.
Under --cut-at-deadline a round that is due (`due`) is ended at the loop's
next pass, between two turns (`cut_due`): its trajectories waiting on their
environments or ready for a turn end there, finish "length", with the
rewards their environments gave so far; a wait on environments looks for a
due round as it looks for a halt.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from areno.envs.driver import EnvRollout
from areno.envs.halted import halt_waiting
from areno.rollout.batch import FINISH_LENGTH

HALT_POLL_S = 0.05  # how often a wait on environments looks for a halt: the save waits at most this


def run_rounds(first: Any, admit: Callable[[], Any | None], done: Callable[[int, EnvRollout], None],
               halting: Callable[[], bool] | None = None, due: Callable[[int], bool] | None = None) -> int:
    """Drive `first` (a _Driver, not started) and every driver `admit()` returns
    (None: none now), asked whenever no trajectory is ready for a turn; done(k,
    rollout) as round k (0: first, then in admission order) ends. The engine's
    waits on environments count as the oldest running round's engine_idle_s.
    halting: whether the run is saving (None: it never halts here); due(k):
    whether round k is due (None: no round is cut) -> the trajectories cut."""
    drivers = [first]
    first.start()
    ended: set[int] = set()
    cut = 0
    while len(ended) < len(drivers):
        live = [d for k, d in enumerate(drivers) if k not in ended]
        for k, d in enumerate(drivers):
            if k not in ended:
                d.harvest(wait=False)
                cut += cut_due(d) if due is not None and due(k) else 0
                d.stream()
        for k, d in enumerate(drivers):
            if k not in ended and not d.active:
                ended.add(k)
                done(k, d.result())
        live = [d for d in live if d.active]
        if not live:
            continue  # the loop ends, or admit below is asked again next pass
        if not any(d.ready for d in live):
            new = admit()
            if new is not None:
                new.start()
                drivers.append(new)
                continue
            t0 = time.perf_counter()
            due_now = None if due is None else \
                (lambda: any(due(k) for k in range(len(drivers)) if k not in ended))
            if _wait(live, halting, due_now) and halting is not None and halting():
                for d in live:
                    halt_waiting(d)
            live[0].out.engine_idle_s += time.perf_counter() - t0
            continue
        for d in live:
            d.generate_ready()
    return cut


def cut_due(d: Any) -> int:
    """--cut-at-deadline: every trajectory of driver `d` (envs/driver.py's _Driver)
    waiting on its environment or ready for a turn ends now, finish "length"
    (as one out of its token budget), with the rewards its environment gave so
    far; its calls out are left to the workers (their answers are never read)
    -> how many ended. A trajectory ends between turns, never mid-turn."""
    waiting = [i for i, _ in d.pending.values()] + d.ready
    for i in waiting:
        d.end(i, FINISH_LENGTH)
    d.pending, d.ready = {}, []
    return len(waiting)


def _wait(live: list[Any], *stops: Callable[[], bool] | None) -> bool:
    """Wait until an environment call of the `live` drivers answers -> False, or
    until one of `stops` (None: none) holds -> True."""
    tickets = [t for d in live for t in d.pending]
    polls = [s for s in stops if s is not None]
    if not polls:
        live[0].pool.wait_any(tickets, timeout=None)
        return False
    while not any(s() for s in polls):
        if live[0].pool.wait_any(tickets, timeout=HALT_POLL_S):
            return False
    return True
