"""Batches from what finishes (--partial-rollouts; issue 39, docs/DESIGN.md
"Batches from what finishes"): a step trains --batch-size groups taken from
any round in flight, not the oldest round whole. Rounds are admitted and sent
as before (scheduler.Rollouts.admit: at most K + 1 rounds' worth of untrained
groups past the trainer's version), and each step picks its groups with
partial.deadline_first: those that must train now for every group to train
within K updates of its round's version, then the first complete ones of any
round. It waits on the rounds' streams until it can. Under --dynamic-sampling
the filter keeps the informative groups of each take and the next take asks
for the rest. A round taken in part stays in flight holding the rest
(Inflight.left); its engines' final reply is read once its last group
arrived. `sched` below is the run's scheduler.Rollouts (typed Any: this
module sits below it, inflight.py holds what both share)."""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Any, Callable

import numpy as np

from areno.data.sampler import batches_drawn
from areno.dynsample import Filled, Round, concat_rounds, filled_from, take_groups
from areno.inflight import Inflight, check_oldest, lag_metrics
from areno.metrics import groups_ahead_metrics, inflight_metrics, rounds_metrics, wait_metrics
from areno.partial import deadline_first
from areno.rewards import RewardResult
from areno.rollout.batch import RolloutBatch, with_version
from areno.scoring import score
from areno.timing import PhaseTimer

@dataclass
class Took:
    """A round's share of the step in progress (put back if the step is undone)."""

    cur: Inflight
    groups: np.ndarray  # [g] int64 positions in the round


def left_of(cur: Inflight) -> np.ndarray:
    """[g] int64: the positions of a round's groups not trained yet."""
    return np.arange(cur.prompt_idx.size) if cur.left is None else np.flatnonzero(cur.left)


def untrained_steps(inflight: list[Inflight], batch_size: int) -> int:
    """The steps' worth of untrained groups in flight (admission counts rounds)."""
    return -(-sum(left_of(c).size for c in inflight) // batch_size)


def group_table(sched: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The untrained groups in flight -> ([G] int64 round index in sched.inflight,
    [G] int64 position in it, [G] int64 its round's version, [G] float64 when it
    came complete, inf: running; a saved round's came before any). A round whose
    every group arrived has its engines' final reply read here (segment freed),
    every round's before any arrival is read: reading one round's reply reads
    what the engines sent before it, other rounds' parts too (tail fill), so an
    arrival read earlier could miss a part, and with it the round's final
    reply, read by now, no round would be left generating to wait on."""
    for cur in sched.inflight:
        if cur.pending is not None:
            cur.pending.settle_whole()
    owner, pos, version, done = [], [], [], []
    for i, cur in enumerate(sched.inflight):
        g = left_of(cur)
        at = np.zeros(cur.prompt_idx.size) if cur.pending is None else cur.pending.arrived()
        owner.append(np.full(g.size, i, np.int64))
        pos.append(g)
        version.append(np.full(g.size, cur.version, np.int64))
        done.append(at[g])
    cat = [np.concatenate(a) if a else np.zeros(0) for a in (owner, pos, version, done)]
    return cat[0].astype(np.int64), cat[1].astype(np.int64), cat[2].astype(np.int64), cat[3]


def pick_groups(sched: Any, batch_size: int, take: int) -> tuple[np.ndarray, np.ndarray, float]:
    """Wait until deadline_first can take `take` groups (or more: those due) ->
    ([n] round index, [n] position, the seconds waited)."""
    t0, since = time.perf_counter(), time.monotonic()
    while True:
        owner, pos, version, done = group_table(sched)
        pick = deadline_first(version, done, sched.updates_at_train, sched.k, batch_size, take)
        if pick is not None:
            return owner[pick], pos[pick], time.perf_counter() - t0
        live = [c.pending for c in sched.inflight if c.pending is not None and c.pending.generating]
        if not live:
            raise AssertionError(f"{owner.size} untrained groups in flight, none generating, and no take of "
                                 f"{take} can be formed (scheduler bug)")
        live[0].poll(since)  # reads every round's parts


def take_round(sched: Any, cur: Inflight, groups: np.ndarray, timer: PhaseTimer) -> Round:
    """Groups `groups` of round `cur`, scored and stamped with its version; they
    leave it (cur.left) and are recorded in sched.taken."""
    if cur.saved is not None:
        batch, scored = cur.saved
        if scored is None:
            sub, _ = batch.take_groups(groups)
            idx = cur.prompt_idx[groups]
            r = Round(idx, sub, score(sched.run, sched.data, idx, sub, timer))
        else:
            r = take_groups(Round(cur.prompt_idx, batch, scored), groups)
    else:
        r = cur.pending.take(groups, timer)
    if cur.left is None:
        cur.left = np.ones(cur.prompt_idx.size, bool)
    cur.left[groups] = False
    sched.taken.append(Took(cur, groups))
    return replace(r, batch=with_version(r.batch, cur.version))


def next_groups(sched: Any, step: int, timer: PhaseTimer,
                informative: Callable[[Round], np.ndarray] | None = None) -> tuple[Filled, dict[str, float]]:
    """Step's batch of --batch-size groups from the rounds in flight (module
    docstring) -> (the Filled batch, the loop's metrics). informative(part) ->
    [g] bool (--dynamic-sampling): the groups the filter keeps; takes go on until
    --batch-size are kept or --max-sampling-rounds rounds' worth were taken."""
    cfg = sched.run.cfg
    b = cfg.batch_size
    bound = b * cfg.max_sampling_rounds if informative is not None else b
    sched.taken, sched.updates_at_train = [], sched.updates
    kept, seen, waits, pend = [], [], [], []
    n_kept = consumed = ahead = 0
    while n_kept < b and consumed < bound:
        got, waited, n_ahead, done = take_some(sched, step, min(b - n_kept, bound - consumed), len(seen), timer)
        seen.append(got)
        waits.append(waited)
        pend += done
        ahead += n_ahead
        consumed += got.batch.num_prompts
        keep = np.flatnonzero(informative(got))[: b - n_kept] if informative is not None else \
            np.arange(got.batch.num_prompts)
        if keep.size:
            kept.append(got if keep.size == got.batch.num_prompts else take_groups(got, keep))
            n_kept += keep.size
    filled = Filled.whole(seen[0]) if informative is None else filled_from(kept, seen, b, -(-consumed // b))
    metrics = lag_metrics(sched.updates_at_train, sched.k, [r.batch for r in seen]) | \
        wait_metrics(waits, [p.info.get("idle_s", 0.0) for p in pend]) | \
        inflight_metrics([p.info for p in pend]) | groups_ahead_metrics(ahead)
    return filled, metrics


def take_some(sched: Any, step: int, need: int, r: int, timer: PhaseTimer,
              ) -> tuple[Round, float, int, list[Any]]:
    """`need` groups (or more: those due) from the rounds in flight, the r-th
    take of the step. The first admits what the trainer's version allows; a
    --dynamic-sampling refill (r >= 1) admits nothing more (a round admitted
    for a later step would make its groups due sooner, and the surplus taken
    for them is dropped). When fewer untrained groups than it needs are left
    (a refill, or the run's last steps after refills: admission counts started
    rounds' worth, and admits none past the last step), one more round starts.
    -> (the groups, scored, in flight order; the seconds waited; how many came
    from rounds other than the oldest; the Pending of each round it emptied,
    whose engines' figures count at this step)."""
    if not r:
        sched.admit(step)
    if sum(left_of(c).size for c in sched.inflight) < need:
        sched.inflight.append(sched.start(step))
    owner, pos, waited = pick_groups(sched, sched.run.cfg.batch_size, need)
    rounds = [take_round(sched, cur, np.sort(pos[owner == i]), timer)
              for i, cur in enumerate(sched.inflight) if (owner == i).any()]
    pend = [c.pending for c in sched.inflight if c.pending is not None and not left_of(c).size]
    sched.inflight = [c for c in sched.inflight if left_of(c).size]
    got = concat_rounds(rounds)
    got = replace(got, extra=rounds_metrics([(r.extra, r.batch.num_responses) for r in rounds]))
    check_oldest(got.batch, sched.updates_at_train, sched.k)
    return got, waited, int((owner != 0).sum()), pend


def put_back(sched: Any) -> None:
    """The step in progress did not update the weights: its groups go back to
    their rounds, which are in flight again in the order they started."""
    for t in sched.taken:
        t.cur.left[t.groups] = True
        if not any(c is t.cur for c in sched.inflight):
            sched.inflight.append(t.cur)
    sched.inflight.sort(key=lambda c: batches_drawn(c.sampler_before))  # tags may repeat (--dynamic-sampling)
    sched.taken = []


def remaining(cur: Inflight, batch: RolloutBatch, scored: RewardResult | None,
              ) -> tuple[np.ndarray, RolloutBatch, RewardResult | None]:
    """A round's untrained groups for a checkpoint: (prompt_idx, batch, env rewards)."""
    if cur.left is None:
        return cur.prompt_idx, batch, scored
    g = left_of(cur)
    sub, resp = batch.take_groups(g)
    return cur.prompt_idx[g], sub, None if scored is None else scored.take(resp)
