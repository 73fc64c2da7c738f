"""Partial rollouts' policy (areno/partial.py): a batch is the first groups to
finish, all their samples done; the scheduler's batches: deadline first, then
the first groups to finish. And the group pool the benchmark simulates
(scripts/arenobench/partial_pool.py): submission within (v + K + 1) batches, an
update retiring the groups whose oldest token could no longer be trained."""

from __future__ import annotations

import numpy as np

from areno.partial import deadline_first, first_finished, must_take
from arenobench.partial_pool import PartialPool, admission_room, group_done_at, retired


def test_a_batch_is_the_first_complete_groups_not_the_first_submitted() -> None:
    # samples of 4 groups (2 each): group 0 submitted first but its second sample runs on
    sample_done = np.array([1.0, np.inf, 5.0, 2.0, 3.0, 4.0, 0.5, 9.0])
    done = group_done_at(sample_done, np.repeat(np.arange(4), 2), 5)
    assert done.tolist() == [np.inf, 5.0, 4.0, 9.0, np.inf]  # group 4: no sample yet
    assert first_finished(done, 2).tolist() == [2, 1]
    assert first_finished(done, 9).tolist() == [2, 1, 3]  # fewer: not enough complete
    assert first_finished(np.array([3.0, 3.0, 1.0]), 3).tolist() == [2, 0, 1]  # ties: lower index


def test_admission_and_retirement_bound_the_lag_by_k() -> None:
    assert admission_room(submitted=40, version=2, k=2, batch_size=10) == 10
    assert admission_room(submitted=60, version=2, k=2, batch_size=10) == 0
    assert retired(np.array([0, 1, 2, 3]), version=3, k=2).tolist() == [True, False, False, False]


def test_the_pool_trains_what_finishes_first_and_retires_what_grew_too_old() -> None:
    pool = PartialPool(batch_size=2, k=1)
    assert pool.room() == 4
    for gid in range(4):
        pool.submit(gid)
    assert pool.room() == 0 and pool.take(0) is None
    pool.finish(3, 1.0)
    pool.finish(1, 2.0)
    pool.finish(0, 3.0)
    assert pool.take(0) == [3, 1]  # the first two to finish, group 0 waits
    pool.version = 1
    for gid in (4, 5):
        pool.submit(gid)
    # version 2: groups 0 and 2 started at 0, two behind with K = 1: retired (0 had
    # finished but was not trained), their room given back
    assert pool.update(2) == [0, 2] and pool.room() == 4  # (2 + 1 + 1) * 2 - 2 trained - 2 running
    pool.finish(5, 4.0)
    pool.finish(4, 5.0)
    assert pool.take(2) == [5, 4]


def test_take_leaves_a_finished_group_the_trainer_may_not_train() -> None:
    pool = PartialPool(batch_size=1, k=0)
    pool.submit(0)
    pool.finish(0, 1.0)
    assert pool.take(1) is None  # started at 0, the trainer holds 1 update: lag 1 > K
    assert pool.take(0) == [0]


INF = np.inf


def test_at_startup_k_plus_one_rounds_of_version_0_train_first_finished_within_their_deadlines() -> None:
    # K = 1, B = 2: rounds 0 and 1 both sampled with version 0 (4 groups), due by
    # offsets 1: step 1 must take at least 4 - 2 = 2 of them (any), the first done.
    oldest = np.array([0, 0, 0, 0])
    assert must_take(oldest, 0, 1, 2) == 2
    done = np.array([INF, 3.0, 1.0, 2.0])  # round 0's group 0 still runs
    assert deadline_first(oldest, done, 0, 1, 2).tolist() == [2, 3]  # round 1's, finished first
    assert deadline_first(oldest, np.full(4, INF), 0, 1, 2) is None  # nothing complete: wait
    # K = 2, three rounds at version 0: nothing is due yet beyond what one step per round gives
    assert must_take(np.zeros(6, np.int64), 0, 2, 2) == 2
    assert must_take(np.zeros(2, np.int64), 0, 2, 2) == 0  # one round in flight: due in 2 steps


def test_a_dynamic_sampling_take_asks_for_the_rest_of_its_batch_but_always_takes_the_due_groups() -> None:
    """--dynamic-sampling takes `take` groups after a filtered take kept some:
    the first finished, unless more are due than that (those all)."""
    oldest, done = np.zeros(4, np.int64), np.array([4.0, 3.0, 1.0, 2.0])
    assert deadline_first(oldest, done, 0, 2, 2, take=1).tolist() == [2]  # nothing due: the first done
    assert deadline_first(oldest, done, 0, 2, 2, take=3).tolist() == [2, 3, 1]
    assert deadline_first(oldest, done, 0, 1, 2, take=1).tolist() == [2, 3]  # K = 1: two are due now
    assert deadline_first(oldest, np.array([INF, INF, 1.0, INF]), 0, 2, 2, take=2) is None  # one done: wait


def test_a_slow_group_trains_at_its_deadline_while_later_rounds_fast_groups_fill_the_batches() -> None:
    """K = 2, B = 2: rounds 0-2 start with version 0 (groups 0-5), round 0's group 0
    runs long. Steps 1 and 2 take the first finished groups of rounds 0-2; at 2
    updates (its deadline) it must train, and the step waits for it."""
    oldest, done = np.zeros(6, np.int64), np.array([INF, 1.0, 2.0, 3.0, 4.0, 5.0])
    assert deadline_first(oldest, done, 0, 2, 2).tolist() == [1, 2]
    left = np.array([0, 3, 4, 5, 6, 7])  # round 3 (version 1): groups 6-7
    oldest, done = np.array([0, 0, 0, 0, 1, 1]), np.array([INF, 3.0, 4.0, 5.0, 6.0, 7.0])
    assert must_take(oldest, 1, 2, 2) == 2
    assert left[deadline_first(oldest, done, 1, 2, 2)].tolist() == [3, 4]  # not the slow one: not due yet
    left = np.array([0, 5, 6, 7, 8, 9])  # round 4 (version 2): groups 8-9
    oldest, done = np.array([0, 0, 1, 1, 2, 2]), np.array([INF, 5.0, 6.0, 7.0, 8.0, 9.0])
    assert deadline_first(oldest, done, 2, 2, 2) is None  # due now and running: the step waits
    done[0] = 10.0  # it finished last of all
    assert left[deadline_first(oldest, done, 2, 2, 2)].tolist() == [5, 0]


def test_a_group_past_its_deadline_or_more_due_than_a_batch_is_a_scheduler_bug() -> None:
    import pytest

    with pytest.raises(AssertionError, match="past its deadline"):
        must_take(np.array([0, 3]), 3, 2, 2)
    with pytest.raises(AssertionError, match="more than --batch-size 2"):
        must_take(np.zeros(3, np.int64), 2, 2, 2)


class _Stream:
    """A round in flight whose parts another round's reply read may deliver
    (what an engine process's tail fill does: rounds' messages interleave)."""

    def __init__(self, arrived: list[float]) -> None:
        self.at = np.array(arrived)
        self.delivers: tuple["_Stream", list[float]] | None = None

    def arrived(self) -> np.ndarray:
        return self.at.copy()

    def settle_whole(self) -> None:
        if self.delivers is not None:  # reading this round's reply read the other's last parts
            other, at = self.delivers
            other.at = np.array(at)
            self.delivers = None


def test_the_group_table_reads_every_rounds_reply_before_any_arrival():
    """Round 2's settle reads round 1's last part (and its final reply): the table
    must show round 1 complete, or the step would find no group to take and no
    round left generating to wait on (a run of the multi-turn tail fill hit it)."""
    from types import SimpleNamespace

    from areno.first_finished import group_table
    from areno.inflight import Inflight

    one, two = _Stream([1.0, np.inf]), _Stream([2.0, 3.0])
    two.delivers = (one, [1.0, 4.0])
    sched = SimpleNamespace(inflight=[Inflight(1, np.arange(2), {}, 0, pending=one),
                                      Inflight(2, np.arange(2), {}, 0, pending=two)])
    owner, pos, version, done = group_table(sched)
    assert owner.tolist() == [0, 0, 1, 1] and done.tolist() == [1.0, 4.0, 2.0, 3.0]
