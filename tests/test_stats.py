import math

import numpy as np
import pytest

from areno.stats import StreamingStats


def test_matches_numpy_over_uneven_chunks():
    rng = np.random.default_rng(0)
    chunks = [rng.normal(3.0, 2.0, n).astype(np.float32) for n in (1, 7, 1000, 0, 33, 4096)]
    s = StreamingStats()
    for c in chunks:
        s.update(c)
    allv = np.concatenate(chunks).astype(np.float64)
    assert s.count == allv.size
    assert s.mean == pytest.approx(allv.mean(), rel=1e-12)
    assert s.std == pytest.approx(allv.std(), rel=1e-10)
    assert s.min == allv.min() and s.max == allv.max()


def test_merge_equals_single_stream():
    rng = np.random.default_rng(1)
    a, b = rng.random(500), rng.random(1200) * 10
    s1, s2, s = StreamingStats(), StreamingStats(), StreamingStats()
    s1.update(a)
    s2.update(b)
    s1.merge(s2)
    s.update(np.concatenate([a, b]))
    for k in ("count", "mean", "min", "max"):
        assert getattr(s1, k) == pytest.approx(getattr(s, k), rel=1e-12)
    assert s1.std == pytest.approx(s.std, rel=1e-10)
    s1.merge(StreamingStats())  # empty merge is a no-op
    assert s1.count == 1700


def test_stable_over_1e8_values_with_large_offset():
    # 1e8 float32 values around 1e4 with unit spread, in 100 chunks: the naive
    # sum-of-squares formula loses the variance entirely here.
    rng = np.random.default_rng(2)
    s = StreamingStats()
    n_chunks, size = 100, 1_000_000
    mean_acc, sq_acc = 0.0, 0.0
    for _ in range(n_chunks):
        x = (1e4 + rng.standard_normal(size, dtype=np.float32)).astype(np.float32)
        s.update(x)
        xd = x.astype(np.float64)
        mean_acc += xd.sum()
        sq_acc += ((xd - 1e4) ** 2).sum()
    n = n_chunks * size
    true_mean = mean_acc / n
    true_var = sq_acc / n - (true_mean - 1e4) ** 2
    assert s.count == n
    assert s.mean == pytest.approx(true_mean, rel=1e-12)
    assert s.var == pytest.approx(true_var, rel=1e-6)
    assert abs(s.var - 1.0) < 0.01


def test_summary_and_empty():
    s = StreamingStats()
    assert math.isnan(s.summary()["mean"])
    s.update(np.array([1.0, 3.0]))
    assert s.summary(prefix="lp_") == {
        "lp_count": 2.0, "lp_mean": 2.0, "lp_std": 1.0, "lp_min": 1.0, "lp_max": 3.0,
    }
