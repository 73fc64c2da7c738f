"""The simulation behind `bench_async.py --partial` (scripts/arenobench/partial_sim.py)
against hand-computed figures: without a tail every mode makes the same tokens,
a synchronous step is generation + training + the weight load, and partial
rollouts gain nothing over K-ahead; with a tail they gain over both."""

from __future__ import annotations

import numpy as np
import pytest

from arenobench.partial_sim import Workload, run_partial, run_rounds

L, TRAIN, SYNC, STEPS = 50, 30, 5, 5


def test_without_a_tail_the_modes_take_the_hand_computed_ticks() -> None:
    # every sample exactly L tokens, one slot per sample of a step: a round is L ticks
    w = Workload(batch_size=4, n=2, sigma=1e-9, median=L, slots=8, train_s=TRAIN, sync_s=SYNC, steps=STEPS)
    sync, ahead, part = run_rounds(w, 0), run_rounds(w, 1), run_partial(w, 1)
    assert sync.trained_tokens == ahead.trained_tokens == part.trained_tokens == STEPS * 8 * L
    # generate, train, load (from the second round on): nothing overlaps
    assert sync.ticks == STEPS * (L + TRAIN) + (STEPS - 1) * SYNC
    assert sync.idle == pytest.approx((TRAIN + SYNC) / (L + TRAIN + SYNC), abs=0.02)
    assert sync.lags.max() == 0 and ahead.lags.max() == part.lags.max() == 1
    # K = 1 hides training behind generation (L + SYNC a step, the last step's training after)
    assert ahead.ticks == pytest.approx(STEPS * L + (STEPS - 1) * SYNC + TRAIN, abs=STEPS)
    assert part.ticks == pytest.approx(ahead.ticks, rel=0.05)  # no tail: nothing to gain
    # the steps are a window of a longer run: who admits ahead generates past it, so
    # the run's end (its last rounds draining with nothing behind) counts in no mode
    assert sync.generated_tokens == sync.trained_tokens < ahead.generated_tokens


def test_with_a_heavy_tail_partial_rollouts_keep_the_slots_busy() -> None:
    w = Workload(batch_size=8, n=4, sigma=1.5, median=L, slots=32, train_s=4 * L, sync_s=SYNC, steps=8)
    sync, ahead, part = run_rounds(w, 0), run_rounds(w, 2), run_partial(w, 2)
    assert part.tokens_per_tick > ahead.tokens_per_tick >= sync.tokens_per_tick
    assert part.idle < ahead.idle <= sync.idle
    assert part.lags.max() <= 2 and np.all(part.lags >= 0)


def test_first_finished_trains_no_slower_than_whole_rounds_within_the_lag_bound() -> None:
    """areno's --partial-rollouts simulated: with a heavy tail, batches by
    deadline_first keep the engines at least as busy as training the oldest
    round whole, every token within K, nothing retired."""
    from arenobench.partial_sim import run_first_finished

    w = Workload(batch_size=8, n=4, sigma=1.5, median=L, slots=32, train_s=4 * L, sync_s=SYNC, steps=8)
    whole, first = run_first_finished(w, 2, whole=True), run_first_finished(w, 2)
    assert first.tokens_per_tick >= whole.tokens_per_tick
    assert first.trained_tokens == whole.trained_tokens and first.retired_tokens == 0
    assert 0 <= first.lags.min() and first.lags.max() <= 2


def test_the_cut_at_deadline_keeps_the_engines_busy_where_a_capped_sample_outlives_k_steps() -> None:
    """--cut-at-deadline simulated: a capped sample decodes longer than K steps of
    training, so first-finished waits for it and the engines idle; cutting the
    groups due keeps every token generated (none retired), trains more per tick,
    idles less, and cuts some samples, every token within K."""
    from arenobench.partial_sim import run_first_finished

    w = Workload(batch_size=8, n=4, sigma=1.5, median=L, max_tokens=20 * L, slots=32, train_s=4 * L,
                 sync_s=SYNC, steps=8)
    first, cut = run_first_finished(w, 2), run_first_finished(w, 2, cut=True)
    assert first.cut == 0 < cut.cut < 0.5 and cut.retired_tokens == 0
    assert cut.tokens_per_tick > first.tokens_per_tick and cut.idle < first.idle
    assert 0 <= cut.lags.min() and cut.lags.max() <= 2
