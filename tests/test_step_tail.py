"""ops/step_tail.py: the per-step distribution and the GC recorder that ops/bench_guided.py reports the slow-step
tail with, and the heap policies it runs under."""

from __future__ import annotations

import gc
import sys

import pytest
from stoker.ops.step_tail import GcRecorder, distribution, heap_policy, quantile


def test_quantile_interpolates_between_order_statistics() -> None:
    values = [5.0, 1.0, 4.0, 2.0, 3.0]  # unsorted on purpose
    assert quantile(values, 0.0) == 1.0
    assert quantile(values, 0.5) == 3.0
    assert quantile(values, 0.9) == pytest.approx(4.6)  # 0.9 * 4 = 3.6 -> 4 + 0.6 * (5 - 4)
    assert quantile(values, 1.0) == 5.0


def test_distribution_names_the_slowest_steps_by_index() -> None:
    walls = [30.0] * 60 + [31.0, 170.0, 30.5, 90.0]
    d = distribution(walls)
    assert d["max"] == 170.0
    assert d["slowest"][:2] == [[61, 170.0], [63, 90.0]]
    assert d["p50"] == 30.0
    assert d["p99"] > d["p90"] >= d["p50"]
    assert d["mean"] == pytest.approx(sum(walls) / len(walls))


def test_gc_recorder_ties_each_collection_to_its_step() -> None:
    with GcRecorder() as recorder:
        gc.collect(0)  # outside the timed steps: step -1, left out of the summary
        recorder.step = 7
        gc.collect(2)
        recorder.step = -1
    assert [(c["step"], c["generation"]) for c in recorder.collections] == [(-1, 0), (7, 2)]
    summary = recorder.summary()
    assert summary["count"] == [0, 0, 1]
    assert summary["slowest"][0]["step"] == 7 and summary["ms"][2] > 0
    gc.collect(2)  # after the block: the callback is gone
    assert len(recorder.collections) == 2


def test_heap_policies_set_what_they_say() -> None:
    before = gc.get_threshold()
    try:
        worker = heap_policy("worker")
        assert gc.get_threshold()[0] == 20_000 and gc.get_freeze_count() > 0
        # Frozen objects may die after the count was read (another thread's temporaries; the full suite leaves
        # some running), never join without a freeze: the count reported, or a hair above today's.
        assert worker["frozen"] >= gc.get_freeze_count() > 0.99 * worker["frozen"]
        assert worker["switch_interval_s"] == sys.getswitchinterval()
        heap_policy("default")
        assert gc.get_threshold()[0] == 700 and gc.get_freeze_count() == 0
        with pytest.raises(ValueError, match="worker"):
            heap_policy("frozen")
    finally:
        gc.unfreeze()
        gc.set_threshold(*before)
