"""A least-squares line t = a + b·x kept as running sums, not samples.

The engine feeds one point per decode step (x: rows in the batch) and per prefill (x: tokens fed);
the sums go out with its /stats, add up across replicas, and `asyncrl plan --calibrate` reads the
line back (asyncrl/plan/calibrate.py). Five numbers, whatever the run's length.
"""
from __future__ import annotations

import time
from contextlib import contextmanager

KEYS = ("n", "x", "xx", "t", "xt")


class LinearFit:
    def __init__(self):
        self.sums = dict.fromkeys(KEYS, 0.0)

    def add(self, x: float, t: float) -> None:
        s = self.sums
        s["n"] += 1
        s["x"] += x
        s["xx"] += x * x
        s["t"] += t
        s["xt"] += x * t

    @contextmanager
    def timed(self, x: float):
        """One point: `x`, and the seconds the block took."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self.add(x, time.perf_counter() - start)


def solve(sums: dict) -> tuple[float, float]:
    """(a, b) of the line through the points the sums hold. With one x only (every decode step at
    the same batch size) the slope is unknowable: it is 0 and a the mean. A negative part is noise
    around zero, so it is clipped and the other refitted to keep the mean right."""
    n, x, xx, t, xt = (float(sums.get(k, 0.0)) for k in KEYS)
    if n <= 0:
        return 0.0, 0.0
    spread = n * xx - x * x
    b = (n * xt - x * t) / spread if spread > 1e-9 * max(n * xx, 1.0) else 0.0
    a = (t - b * x) / n
    if b < 0:
        return t / n, 0.0
    if a < 0:
        return 0.0, t / x if x else 0.0
    return a, b
