"""ops/bench_guided.py's interleaved rounds: each constrained case is divided by the unconstrained case of its own
batch and round, and the figure reported is the median of those per-round ratios (issue 15: one noisy run must
not decide); the slowest steps keep their own timeline phases."""

from __future__ import annotations

import pytest
from stoker.ops.bench_guided import case_ratio, round_ratios, slow_step_phases


def _case(batch: int, repeat: int, constrained: bool, p50: float, mean: float) -> dict[str, object]:
    return {"batch": batch, "repeat": repeat, "constrained": constrained, "sync_steps": False,
            "grammar_work": "overlap", "step_p50_ms": p50, "step_mean_ms": mean}


def test_each_round_is_divided_by_its_own_unconstrained_case() -> None:
    cases = [
        _case(1024, 0, False, 30.0, 31.0), _case(1024, 0, True, 39.0, 40.0),
        _case(1024, 1, False, 40.0, 41.0), _case(1024, 1, True, 40.0, 45.0),  # a slow round: both cases slow
        _case(1024, 2, False, 30.0, 30.0), _case(1024, 2, True, 31.5, 36.0),
        _case(256, 0, False, 10.0, 10.0), _case(256, 0, True, 12.0, 12.0),
    ]
    assert case_ratio(cases, cases[3]) == pytest.approx(1.0)  # round 1's own baseline, not round 0's 30 ms
    assert case_ratio(cases, cases[7]) == pytest.approx(1.2)  # batch 256's own
    assert case_ratio(cases, cases[0]) == 1.0  # an unconstrained case is its own baseline
    ratios = round_ratios({"cases": cases})
    assert ratios["1024 schema"]["p50"] == pytest.approx([1.3, 1.0, 1.05])  # one noisy round
    assert ratios["1024 schema"]["median_p50_ratio"] == pytest.approx(1.05)
    assert ratios["1024 schema"]["median_mean_ratio"] == pytest.approx(36.0 / 30.0)  # of 1.29, 1.10, 1.20
    assert ratios["256 schema"]["median_p50_ratio"] == pytest.approx(1.2)


def test_the_slowest_steps_keep_their_own_phases() -> None:
    per_step = [{"step": w, "fill": f} for w, f in [(30.0, 3.0), (150.0, 140.0), (31.0, 4.0), (90.0, 80.0)]]
    phases = {"host_ms": {}, "gpu_ms": {}, "per_step": per_step}
    slow = slow_step_phases(phases, [30.0, 150.0, 31.0, 90.0])
    assert [(s["index"], s["wall_ms"], s["fill"]) for s in slow[:2]] == [(1, 150.0, 140.0), (3, 90.0, 80.0)]
    assert "per_step" not in phases  # the JSON keeps only the slow ones
