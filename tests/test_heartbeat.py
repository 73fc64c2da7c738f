"""areno.procs.heartbeat: the bound and who counts as silent (the SIGSTOP
end to end is in test_faults_probe.py)."""

from __future__ import annotations

import time

from areno.procs.heartbeat import AUTO_FACTOR, AUTO_FLOOR_S, BEAT_S, HeartbeatWatch, start_beating


def test_a_given_bound_holds_and_the_auto_bound_grows_with_the_longest_gap():
    w = HeartbeatWatch(2, timeout_s=5.0)
    assert w.bound() == 5.0
    w = HeartbeatWatch(2)
    assert w.bound() == AUTO_FLOOR_S
    w.slots[0], w.slots[1] = 100.0, 100.0
    assert w.silent(now=101.0) is None
    w.slots[0] = 120.0  # a 20 s gap between two beats of rank 0
    assert w.silent(now=121.0) is None
    assert w.longest_gap == 20.0 and w.bound() == AUTO_FACTOR * 20.0
    assert w.silent(now=100.0 + AUTO_FACTOR * 20.0 + 1) == (1, AUTO_FACTOR * 20.0 + 1)


def test_a_rank_that_never_beat_is_not_judged_and_a_beating_thread_keeps_its_slot_fresh():
    w = HeartbeatWatch(2, timeout_s=10.0)  # wide: a loaded CI host delays sleeping threads
    assert w.silent(now=1e9) is None  # slot 0.0: not started yet
    start_beating(w.slots, 1)
    deadline = time.monotonic() + 10.0
    while w.slots[1] == 0.0 and time.monotonic() < deadline:
        time.sleep(0.01)
    first = w.slots[1]
    while w.slots[1] == first and time.monotonic() < deadline:
        time.sleep(0.01)
    assert 0.0 < first < w.slots[1], "the thread did not beat twice"
    assert w.silent() is None
