"""Each job's start stages one by one (worker/stage_log.py, GET /stages): the per-request figures a bench needs
to take the engine's own time off each request's TTFT. Against the real Kafka and Redis, stand-in engine."""

from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request

import pytest
from stoker.worker.stage_log import StageLog
from worker_harness import job, produce, running_worker, stack_fixtures, wait_results

space, r = stack_fixtures()

STAGES = ("claimed", "engine_added", "scheduled", "first_output")


def _get(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=5) as resp:
        return bytes(resp.read())


def test_the_log_keeps_the_latest_jobs_in_arrival_order_and_each_stages_first_value() -> None:
    log = StageLog(capacity=2)
    log.note("a", "engine_added", 1.0)
    log.note("b", "engine_added", 2.0)
    log.note("a", "first_output", 5.0)
    log.note("a", "engine_added", 9.0)  # a retried job: the first attempt's figure stays
    assert log.snapshot() == [{"request_id": "a", "engine_added": 1.0, "first_output": 5.0},
                              {"request_id": "b", "engine_added": 2.0}]
    log.note("c", "claimed", 3.0)  # past the capacity: the oldest job goes
    assert [row["request_id"] for row in log.snapshot()] == ["b", "c"]
    with pytest.raises(ValueError, match="capacity"):
        StageLog(0)


@pytest.mark.stack
@pytest.mark.timeout(120)
async def test_stages_per_job_match_the_histogram_and_are_served_at_stages(space, r) -> None:
    ids = [f"sl-{i}" for i in range(5)]
    async with running_worker(space, fake_step_delay_s=0.004, metrics_port=0, debug_stages=True) as worker:
        await produce(space.bootstrap, space.names.jobs_topic, [job(i, max_tokens=4) for i in ids])
        await wait_results(r, space.names, ids, timeout=60)
        assert worker.health is not None and worker.health.port
        url = f"http://127.0.0.1:{worker.health.port}/stages"
        served = json.loads(await asyncio.to_thread(_get, url))  # off the loop: the server runs on it
        sums = {s: worker.metrics.stage.labels(s).sum for s in STAGES}
    rows = {row["request_id"]: row for row in served}
    assert set(rows) == set(ids)
    for rid in ids:
        row = rows[rid]
        assert all(s in row for s in STAGES), row
        assert 0 <= row["engine_added"] <= row["first_output"], row
    for s in STAGES:  # the same figures as the histogram's, job by job (it sums seconds, floored at 0)
        assert sum(max(0.0, rows[i][s]) for i in ids) / 1000 == pytest.approx(sums[s], abs=5e-6 * len(ids)), s


@pytest.mark.stack
@pytest.mark.timeout(120)
async def test_stages_are_off_by_default_since_they_list_request_ids(space, r) -> None:
    ids = [f"off-{i}" for i in range(3)]
    async with running_worker(space, fake_step_delay_s=0.004, metrics_port=0) as worker:
        await produce(space.bootstrap, space.names.jobs_topic, [job(i, max_tokens=4) for i in ids])
        await wait_results(r, space.names, ids, timeout=60)
        assert worker.health is not None and worker.health.port
        with pytest.raises(urllib.error.HTTPError) as refused:
            await asyncio.to_thread(_get, f"http://127.0.0.1:{worker.health.port}/stages")
        assert worker.metrics.stage.labels("first_output").sum > 0  # the histogram still counts
    assert refused.value.code == 404 and b"--debug-stages" in refused.value.read()
    assert worker.metrics.job_stages.snapshot() == []  # and no id was kept
