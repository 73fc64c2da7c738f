"""Partial rollouts as a policy: which groups a step trains.

With partial rollouts the engines never wait for a round's slowest sample: the
engines take new weights between decode steps (rollout/hf_inflight.py,
rollout/vllm_inflight.py), and a training batch is made of groups (a prompt's n
samples, all done: the group advantage needs all of them) from any round in
flight, not one whole round. All rules are pure (arrays in, arrays out):

  deadline_first  the batch the run's scheduler trains (first_finished.py):
                  the groups that must train now for every group to train
                  within K updates of its round's version (earliest deadline
                  first), the rest of --batch-size the first complete groups
  first_finished  the complete groups in order of completion

The run's scheduler submits whole rounds (round admission bounds the lag) and
forms batches with deadline_first, so it retires nothing. Admitting groups one
by one and retiring those past the bound is simulated, not run
(scripts/arenobench/partial_pool.py, the benchmark's PartialPool).
"""

from __future__ import annotations

import numpy as np


def first_finished(done_at: np.ndarray, batch_size: int) -> np.ndarray:
    """[G] float64 completion time of each group (inf: a sample still running)
    -> [<= batch_size] int64 the complete groups that finished first, in order
    of completion (ties: lower index first). Fewer than batch_size: not enough
    groups are complete yet."""
    done = np.flatnonzero(np.isfinite(done_at))
    order = done[np.argsort(done_at[done], kind="stable")]
    return order[:batch_size].astype(np.int64)


def must_take(oldest: np.ndarray, updates: int, k: int, batch_size: int) -> int:
    """[G] int64 the version each untrained group's round started with -> how many
    of the most urgent ones this step (the trainer holding `updates`) must take.
    A group of version o trains at latest at step offset o + k - updates (one
    update a step; a skipped one only lowers the lag), and at most batch_size
    groups train a step, so by offset j the groups due by j need (j + 1) slots:
    m = max_j #(due by j) - j * batch_size, at least 0. A group already past its
    deadline, or m > batch_size, is a scheduler bug (AssertionError)."""
    due = np.asarray(oldest, dtype=np.int64) + k - updates
    if not due.size:
        return 0
    if due.min() < 0:
        raise AssertionError(f"a group of version {int(due.min()) - k + updates} is past its deadline: "
                             f"{updates} updates, K = {k} (scheduler bug)")
    by = np.cumsum(np.bincount(due)) - batch_size * np.arange(int(due.max()) + 1)
    m = max(0, int(by.max()))
    if m > batch_size:
        raise AssertionError(f"{m} groups must train at {updates} updates to meet their deadlines, "
                             f"more than --batch-size {batch_size} (scheduler bug: admission let too many in)")
    return m


def deadline_first(oldest: np.ndarray, done_at: np.ndarray, updates: int, k: int,
                   batch_size: int, take: int | None = None) -> np.ndarray | None:
    """[G] int64 version each untrained group's round started with, [G] float64
    its completion order (inf: a sample still running) -> [n] int64 the groups
    to take now, n = max(take, must_take) (take: batch_size unless given; a
    --dynamic-sampling refill asks for the rest of its batch): the must_take most
    urgent ones (lowest version; among equals, complete ones first, in order of
    completion), then the first complete ones of the rest in order of completion.
    None: the step must wait (an urgent group is running, or too few are complete)."""
    oldest = np.asarray(oldest, dtype=np.int64)
    done_at = np.asarray(done_at, dtype=np.float64)
    m = must_take(oldest, updates, k, batch_size)
    n = max(m, batch_size if take is None else take)
    urgent = np.lexsort((np.arange(oldest.size), done_at, oldest))[:m]
    if not np.isfinite(done_at[urgent]).all():
        return None
    rest = np.ones(oldest.size, bool)
    rest[urgent] = False
    done_at = np.where(rest, done_at, np.inf)
    out = np.concatenate([urgent, first_finished(done_at, n - m)]).astype(np.int64)
    return out if out.size == n else None
