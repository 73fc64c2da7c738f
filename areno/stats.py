"""Streaming statistics.

`StreamingStats` keeps count/mean/M2/min/max in float64 and merges batches
with Chan et al.'s parallel update, so statistics over every response token of
a run cost O(1) memory and never build a Python list of the values.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np


@dataclass
class StreamingStats:
    """Running count, mean, std (population), min and max of a stream of values."""

    count: int = 0
    mean: float = 0.0
    m2: float = 0.0  # sum of squared deviations from the mean
    min: float = math.inf
    max: float = -math.inf

    @property
    def var(self) -> float:
        return self.m2 / self.count if self.count else math.nan

    @property
    def std(self) -> float:
        return math.sqrt(self.var) if self.count else math.nan

    def update(self, values: np.ndarray) -> None:
        """Fold in a batch of values (any shape; float32/float64)."""
        v = np.asarray(values).reshape(-1)
        n = v.size
        if n == 0:
            return
        # float64 accumulation: numpy's pairwise sum keeps the batch mean exact
        # to ~1e-16 relative; M2 is taken about the batch mean (two-pass), which
        # avoids the cancellation of sum(x^2) - n*mean^2.
        d = v.astype(np.float64)  # one copy, centred in place below
        b_mean = float(d.mean())
        d -= b_mean
        # einsum, not np.dot: dot goes to multithreaded BLAS, which on a busy
        # 2-core host is 10x slower than this single pass (measured).
        b_m2 = float(np.einsum("i,i->", d, d))
        self._combine(n, b_mean, b_m2, float(v.min()), float(v.max()))

    def merge(self, other: "StreamingStats") -> None:
        """Fold in another accumulator (e.g. from another rank or step)."""
        if other.count:
            self._combine(other.count, other.mean, other.m2, other.min, other.max)

    def _combine(self, n: int, mean: float, m2: float, lo: float, hi: float) -> None:
        # Chan, Golub & LeVeque (1979) pairwise update.
        total = self.count + n
        delta = mean - self.mean
        self.mean += delta * n / total
        self.m2 += m2 + delta * delta * self.count * n / total
        self.count = total
        self.min = min(self.min, lo)
        self.max = max(self.max, hi)

    def summary(self, prefix: str = "") -> dict[str, float]:
        return {
            f"{prefix}count": float(self.count),
            f"{prefix}mean": self.mean if self.count else math.nan,
            f"{prefix}std": self.std,
            f"{prefix}min": self.min if self.count else math.nan,
            f"{prefix}max": self.max if self.count else math.nan,
        }

