"""Summaries of a small sample of timings that a verdict can rest on: p50, mean and a bootstrap interval of each.

W1's TTFT is 16-48 runs of one request whose single runs spread over 2x (BENCHMARKS.md: 12-29 ms on the engine
alone): one p50 moved by +-2 ms from call to call. The percentile bootstrap (resample the runs with
replacement, recompute the statistic, take the 2.5th and 97.5th percentiles) says how far a p50 or a mean of
that many runs can move, without assuming a distribution; the seed is fixed so a report is reproducible.
"""

from __future__ import annotations

import random
import statistics
from collections.abc import Callable, Sequence


def percentile(values: Sequence[float], q: float) -> float:
    """Linear interpolation between the closest ranks (numpy's default); nan for no values."""
    if not values:
        return float("nan")
    v = sorted(values)
    pos = (len(v) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (pos - lo)


def bootstrap_interval(values: Sequence[float], stat: Callable[[Sequence[float]], float], level: float = 0.95,
                       resamples: int = 2000, seed: int = 0) -> tuple[float, float]:
    """The percentile-bootstrap interval of stat(values) at `level`; (nan, nan) for fewer than 2 values."""
    if len(values) < 2:
        return float("nan"), float("nan")
    rng = random.Random(seed)
    n = len(values)
    stats = sorted(stat([values[rng.randrange(n)] for _ in range(n)]) for _ in range(resamples))
    tail = (1 - level) / 2 * 100
    return percentile(stats, tail), percentile(stats, 100 - tail)


def median(values: Sequence[float]) -> float:
    return percentile(values, 50)


def describe(values: Sequence[float]) -> dict[str, float]:
    """n, p50 and mean each with its 95 % bootstrap interval, min, max, p90 (ms in, ms out)."""
    if not values:
        return {"n": 0}
    p50_lo, p50_hi = bootstrap_interval(values, median)
    mean_lo, mean_hi = bootstrap_interval(values, statistics.fmean)
    return {"n": len(values), "p50": median(values), "p50_lo": p50_lo, "p50_hi": p50_hi,
            "mean": statistics.fmean(values), "mean_lo": mean_lo, "mean_hi": mean_hi,
            "min": min(values), "p90": percentile(values, 90), "max": max(values)}


def difference(a: Sequence[float], b: Sequence[float], stat: Callable[[Sequence[float]], float] = median,
               resamples: int = 2000, seed: int = 0) -> dict[str, float]:
    """stat(a) - stat(b) with its 95 % bootstrap interval, a and b resampled independently (two sides of one
    comparison, e.g. W1's TTFT through the queue and on the engine alone)."""
    if len(a) < 2 or len(b) < 2:
        return {"diff": float("nan"), "lo": float("nan"), "hi": float("nan")}
    rng = random.Random(seed)
    diffs = sorted(stat([a[rng.randrange(len(a))] for _ in a]) - stat([b[rng.randrange(len(b))] for _ in b])
                   for _ in range(resamples))
    return {"diff": stat(a) - stat(b), "lo": percentile(diffs, 2.5), "hi": percentile(diffs, 97.5)}


def cell(d: dict[str, float], key: str = "p50") -> str:
    """'p50 [lo, hi]' for a table, from describe()'s output."""
    if not d.get("n"):
        return ""
    return f"{d[key]:.2f} [{d[key + '_lo']:.2f}, {d[key + '_hi']:.2f}]"
