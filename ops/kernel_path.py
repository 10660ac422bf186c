"""What each kernel adds to a CUDA stream's critical path, from a torch.profiler (Kineto) Chrome trace.

Why: with programmatic dependent launch a kernel starts before its predecessor ends and waits on
griddepcontrol.wait, so the profiler's per-kernel durations count that wait and sum to more than the step
(BENCHMARKS.md, 2026-12-03: the FP8 W1 GEMVs "took" 4.03 ms of a 2.72 ms token). Here each kernel is charged
only for the time by which it moved the end of the work so far: end - max(start, the latest end before it),
never below zero. Those charges sum to the busy time of the span, and idle gaps are counted apart.

Kernels of one name (every fused GEMV is `_gemv_kernel`) are told apart by their grid and by the kernel that
ran before them (o_proj follows the attention, down follows gate_up).

    PYTHONPATH=. python3 ops/kernel_path.py trace.json [--rows 30]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

DEVICE_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")


@dataclass(frozen=True, slots=True)
class Span:
    name: str
    start: float  # us
    end: float
    grid: tuple[int, ...] = ()


@dataclass(slots=True)
class PathRow:
    key: str
    count: int = 0
    added: float = 0.0  # us put on the critical path, summed
    duration: float = 0.0  # us from start to end, summed (waits included)
    early: list[float] = field(default_factory=list)  # us each launch started before the work before it ended


@dataclass(frozen=True, slots=True)
class PathSummary:
    rows: list[PathRow]
    busy: float  # us: the sum of the charges
    idle: float  # us: gaps with no kernel running
    span: float  # us: first start to last end


def spans_from_trace(trace: dict) -> list[Span]:
    """The device events of a Chrome trace (torch.profiler's export_chrome_trace), in start order."""
    out = []
    for ev in trace.get("traceEvents", []):
        if ev.get("ph") != "X" or ev.get("cat") not in DEVICE_CATEGORIES:
            continue
        start, dur = float(ev["ts"]), float(ev.get("dur", 0.0))
        grid = tuple(int(g) for g in (ev.get("args") or {}).get("grid", ()))
        out.append(Span(str(ev.get("name", "?")), start, start + dur, grid))
    return sorted(out, key=lambda s: (s.start, s.end))


def _short(name: str) -> str:
    return name if len(name) <= 60 else name[:57] + "..."


def critical_path(spans: Iterable[Span]) -> PathSummary:
    """Charge each span end - max(start, frontier) (>= 0), frontier being the latest end before it."""
    rows: dict[str, PathRow] = {}
    frontier = None
    first = last = None
    idle = busy = 0.0
    previous = "start"
    for s in sorted(spans, key=lambda s: (s.start, s.end)):
        key = f"{_short(s.name)} grid {'x'.join(map(str, s.grid)) or '-'} after {_short(previous)}"
        row = rows.setdefault(key, PathRow(key))
        begin = s.start if frontier is None else max(s.start, frontier)
        if frontier is not None and s.start > frontier:
            idle += s.start - frontier
        charge = max(0.0, s.end - begin)
        row.count += 1
        row.added += charge
        row.duration += s.end - s.start
        row.early.append(max(0.0, frontier - s.start) if frontier is not None else 0.0)
        busy += charge
        frontier = s.end if frontier is None else max(frontier, s.end)
        first = s.start if first is None else min(first, s.start)
        last = s.end if last is None else max(last, s.end)
        previous = s.name
    span = 0.0 if first is None or last is None else last - first
    return PathSummary(sorted(rows.values(), key=lambda r: -r.added), busy, idle, span)


def path_table(summary: PathSummary, rows: int = 30, per: int = 1) -> str:
    """Markdown table: per kernel key, launches, us added to the path (total and per launch), us from start to end
    per launch, median us started early; `per` divides the totals (e.g. the number of steps)."""
    lines = [f"| kernel (grid, after) | launches / {per} | added us / {per} | added us a launch | start-to-end us a "
             "launch | started early, median us |", "|---|---|---|---|---|---|"]
    for r in summary.rows[:rows]:
        lines.append(f"| {r.key} | {r.count / per:g} | {r.added / per:.1f} | {r.added / r.count:.2f} | "
                     f"{r.duration / r.count:.2f} | {statistics.median(r.early):.2f} |")
    lines.append(f"| busy (sum of charges) / idle / span | | {summary.busy / per:.1f} / {summary.idle / per:.1f} / "
                 f"{summary.span / per:.1f} | | | |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("trace")
    ap.add_argument("--rows", type=int, default=30)
    ap.add_argument("--per", type=int, default=1, help="divide totals by this (steps in the trace)")
    args = ap.parse_args(argv)
    summary = critical_path(spans_from_trace(json.loads(Path(args.trace).read_text())))
    print(path_table(summary, args.rows, args.per))
    return 0


if __name__ == "__main__":
    sys.exit(main())
