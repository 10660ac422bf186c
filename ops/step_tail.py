"""Where a benchmark's slow decode steps come from: the per-step wall distribution, the slowest steps by index,
and the garbage collections that ran inside each step (gc.callbacks).

Used by ops/bench_guided.py. Issue 15's constrained step had means 4-6 ms above its p50 and a max of 154-175 ms
in both the constrained and the unconstrained case (H200, 19:00 UTC): a tail of a few slow steps that the p50
hides and the mean pays for. A full collection of a process that holds torch, the model and 1,024 requests'
objects walks every tracked object (~100-150 ms, stoker.engine.settle_heap), which is what these record.
"""

from __future__ import annotations

import gc
import statistics
import sys
import time
from types import TracebackType
from typing import Any

SLOWEST = 5  # slow steps listed per case


def quantile(values: list[float], q: float) -> float:
    """The q-quantile (0..1) by linear interpolation between order statistics (numpy's default)."""
    ordered = sorted(values)
    if not ordered:
        return 0.0
    position = q * (len(ordered) - 1)
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def distribution(walls_ms: list[float]) -> dict[str, Any]:
    """-> p50 / p90 / p99 / max / mean ms of the steps and the SLOWEST steps as [index, ms], slowest first."""
    slowest = sorted(range(len(walls_ms)), key=walls_ms.__getitem__, reverse=True)[:SLOWEST]
    return {
        "p50": statistics.median(walls_ms) if walls_ms else 0.0,
        "p90": quantile(walls_ms, 0.90),
        "p99": quantile(walls_ms, 0.99),
        "max": max(walls_ms, default=0.0),
        "mean": statistics.fmean(walls_ms) if walls_ms else 0.0,
        "slowest": [[i, walls_ms[i]] for i in slowest],
    }


class GcRecorder:
    """Records each garbage collection (generation, wall ms, objects collected) with the index of the step it
    ran in (set .step before each step; -1 outside the timed steps). A context manager: the callback is
    removed on exit."""

    def __init__(self) -> None:
        self.step = -1
        self.collections: list[dict[str, Any]] = []
        self._started = 0.0

    def __enter__(self) -> GcRecorder:
        gc.callbacks.append(self._callback)
        return self

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None,
                 traceback: TracebackType | None) -> None:
        gc.callbacks.remove(self._callback)

    def _callback(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._started = time.perf_counter()
            return
        self.collections.append({"step": self.step, "generation": info["generation"],
                                 "ms": (time.perf_counter() - self._started) * 1e3,
                                 "collected": info["collected"]})

    def summary(self) -> dict[str, Any]:
        """Per generation: count and total ms inside the timed steps; the slowest collections with their step."""
        timed = [c for c in self.collections if c["step"] >= 0]
        by_gen = {g: [c["ms"] for c in timed if c["generation"] == g] for g in (0, 1, 2)}
        return {
            "count": [len(by_gen[g]) for g in (0, 1, 2)],
            "ms": [sum(by_gen[g]) for g in (0, 1, 2)],
            "slowest": sorted(timed, key=lambda c: c["ms"], reverse=True)[:SLOWEST],
        }


def heap_policy(name: str) -> dict[str, Any]:
    """Set the process's GC policy for the cases that follow -> what was set. "worker": the worker's once its
    engine is loaded (stoker.engine.settle_heap: everything alive frozen, the young generation raised);
    "default": Python's own (unfrozen, threshold 700)."""
    if name == "worker":
        from stoker.engine import settle_heap

        settle_heap()
    elif name == "default":
        gc.unfreeze()
        gc.set_threshold(700, *gc.get_threshold()[1:])
    else:
        raise ValueError(f"heap policy must be 'worker' or 'default', got {name!r}")
    return {"heap": name, "gc_threshold": list(gc.get_threshold()), "frozen": gc.get_freeze_count(),
            "switch_interval_s": sys.getswitchinterval()}
