"""ops/kernel_path: each kernel's charge on the critical path of a profiled stream, from Chrome-trace events; the
cases are the timelines PDL makes (a kernel started before its predecessor ended), plain back-to-back launches,
idle gaps and a kernel wholly inside another's span."""

from __future__ import annotations

import pytest
from stoker.ops.kernel_path import Span, critical_path, path_table, spans_from_trace


def _row(summary, prefix: str):
    found = [r for r in summary.rows if r.key.startswith(prefix)]
    assert len(found) == 1, [r.key for r in summary.rows]
    return found[0]


def test_back_to_back_kernels_are_charged_their_durations() -> None:
    s = critical_path([Span("b", 10, 15), Span("a", 0, 10)])
    assert (_row(s, "a ").added, _row(s, "b ").added) == (10, 5)
    assert (s.busy, s.idle, s.span) == (15, 0, 15)


def test_a_kernel_started_early_is_charged_only_past_its_predecessor() -> None:
    s = critical_path([Span("a", 0, 10), Span("b", 4, 13), Span("c", 12.5, 20)])
    b, c = _row(s, "b "), _row(s, "c ")
    assert b.added == 3 and b.duration == 9 and b.early == [6]
    assert c.added == 7 and c.early == [0.5]
    assert s.busy == pytest.approx(20) and s.idle == 0


def test_gaps_are_idle_and_nested_kernels_add_nothing() -> None:
    s = critical_path([Span("a", 0, 10), Span("n", 2, 8), Span("b", 12, 13)])
    assert _row(s, "n ").added == 0 and _row(s, "b ").added == 1
    assert (s.busy, s.idle, s.span) == (11, 2, 13)


def test_one_name_is_split_by_grid_and_predecessor() -> None:
    spans = [Span("attn", 0, 5, (1, 8, 33)), Span("gemv", 5, 10, (1024,)), Span("gemv", 10, 40, (7168,)),
             Span("gemv", 40, 55, (1024,))]
    s = critical_path(spans)
    assert _row(s, "gemv grid 1024 after attn").added == 5
    assert _row(s, "gemv grid 1024 after gemv").added == 15
    assert _row(s, "gemv grid 7168 after gemv").added == 30
    table = path_table(s, per=1)
    assert "| gemv grid 7168 after gemv | 1 | 30.0 |" in table and "55.0 / 0.0 / 55.0" in table


def test_trace_events_other_than_device_work_are_ignored() -> None:
    trace = {"traceEvents": [
        {"ph": "X", "cat": "kernel", "name": "k", "ts": 100.0, "dur": 4.0, "args": {"grid": [4, 1, 1]}},
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 90.0, "dur": 50.0},
        {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy HtoD", "ts": 104.0, "dur": 1.0},
        {"ph": "i", "cat": "kernel", "name": "marker", "ts": 101.0},
    ]}
    spans = spans_from_trace(trace)
    assert spans == [Span("k", 100.0, 104.0, (4, 1, 1)), Span("Memcpy HtoD", 104.0, 105.0, ())]
