"""Partial rollouts' policy (areno/partial.py): a batch is the first groups to
finish, all their samples done; submission stays within (v + K + 1) batches;
an update retires the groups whose oldest token could no longer be trained."""

from __future__ import annotations

import numpy as np

from areno.partial import PartialPool, admission_room, first_finished, group_done_at, retired


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
