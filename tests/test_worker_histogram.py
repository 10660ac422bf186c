"""The loop histogram exposes exactly what prometheus_client's Histogram exposes for the same observations."""

from __future__ import annotations

import random

import pytest
from prometheus_client import CollectorRegistry, Histogram, generate_latest
from stoker.worker.histogram import LoopHistogram

BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28)


def _exposition(registry: CollectorRegistry) -> list[str]:
    # prometheus_client adds a `_created` timestamp series that the loop histogram leaves out
    return [line for line in generate_latest(registry).decode().splitlines() if "_created" not in line]


@pytest.mark.parametrize("labelled", [False, True])
def test_same_exposition_as_prometheus_client(labelled: bool) -> None:
    rng = random.Random(7)
    values = [rng.choice(BUCKETS) for _ in range(200)] + [rng.uniform(0, 3) for _ in range(2000)] + [0.0, 99.0]
    ours, theirs = CollectorRegistry(), CollectorRegistry()
    labels = ("stage",) if labelled else ()
    fast = LoopHistogram("x_seconds", "doc", BUCKETS, labels, registry=ours)
    reference = Histogram("x_seconds", "doc", labels, buckets=BUCKETS, registry=theirs)
    for i, value in enumerate(values):  # bucket bounds themselves included: `le` is inclusive
        if labelled:
            stage = ("polled", "claimed")[i % 2]
            fast.labels(stage).observe(value)
            reference.labels(stage).observe(value)
        else:
            fast.observe(value)
            reference.observe(value)
    assert _exposition(ours) == _exposition(theirs)


def test_label_misuse_is_an_error() -> None:
    with pytest.raises(ValueError, match="observe through labels"):
        LoopHistogram("y", "doc", BUCKETS, ("stage",)).observe(1.0)
    with pytest.raises(ValueError, match="expected labels"):
        LoopHistogram("z", "doc", BUCKETS, ("stage",)).labels("a", "b")
    with pytest.raises(ValueError, match="distinct"):
        LoopHistogram("w", "doc", (0.1, 0.1))


def test_observe_many_is_observe_per_value() -> None:
    rng = random.Random(3)
    values = [rng.choice(BUCKETS) for _ in range(100)] + [rng.uniform(0, 2) for _ in range(500)] + [0.0, 50.0]
    one, many = CollectorRegistry(), CollectorRegistry()
    each = LoopHistogram("x_seconds", "doc", BUCKETS, registry=one)
    batched = LoopHistogram("x_seconds", "doc", BUCKETS, registry=many)
    for value in values:
        each.observe(value)
    batched.observe_many(values[:250])
    batched.observe_many(values[250:])
    batched.observe_many([])
    assert _exposition(one) == _exposition(many)
    with pytest.raises(ValueError, match="observe through labels"):
        LoopHistogram("v", "doc", BUCKETS, ("stage",)).observe_many([1.0])
