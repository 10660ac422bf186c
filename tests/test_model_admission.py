"""Admission per model in a worker serving several: one model saturated (its engine full, a long backlog of
its jobs) must not hold back the jobs of another model whose engine is idle. Real Kafka and Redis; two
stand-in engines behind one ModelSet."""

from __future__ import annotations

import asyncio
import time

import pytest
import redis.asyncio as aioredis
from stoker.schemas import Done, Error, decode_event
from stoker.worker.fake_engine import FakeEngine
from stoker.worker.models import ModelSet
from stoker.worker.requests import RequestState
from worker_harness import job, make_space, produce, running_worker, wait_results

pytestmark = [pytest.mark.stack, pytest.mark.timeout(120)]

SLOTS = 2  # max_num_seqs and max_waiting of the worker, so each model's engine takes 4 jobs at once
STEP_S = 0.02


def two_models() -> ModelSet:
    return ModelSet(["busy", "idle"], lambda name: FakeEngine(name, max_num_seqs=SLOTS, step_delay_s=STEP_S))


async def test_a_saturated_model_does_not_hold_back_another_models_jobs(request: pytest.FixtureRequest,
                                                                        redis_url: str) -> None:
    """40 jobs of `busy` (20 steps each, 2 at a time: about 8 s of work) read first, then one job of `idle`:
    the idle model's job is admitted at once, beside busy's backlog, and ends long before busy's jobs do
    (before the fix it waited behind all 40: admission counted one set of slots for the whole worker)."""
    space = await make_space(request, partitions=1)  # one partition: the worker reads them in this order
    busy = [job(f"busy-{i}", model="busy", max_tokens=20, ignore_eos=True) for i in range(40)]
    r = aioredis.Redis.from_url(redis_url)
    try:
        async with running_worker(space, two_models(), max_num_seqs=SLOTS, max_waiting=SLOTS,
                                  claim_ttl_s=10) as worker:
            await produce(space.bootstrap, space.names.jobs_topic, busy)
            await asyncio.sleep(1.0)  # busy's jobs are in the backlog and its engine is full
            sent = time.monotonic()
            await produce(space.bootstrap, space.names.jobs_topic, [job("idle-0", model="idle", max_tokens=2)])
            idle = await wait_results(r, space.names, ["idle-0"], timeout=30)
            idle_s = time.monotonic() - sent
            busy_done = sum(v is not None for v in await r.mget([space.names.result(j["request_id"]) for j in busy]))
            assert isinstance(idle["idle-0"].terminal, Done) and idle["idle-0"].terminal.model == "idle"
            assert idle_s < 2.0 and busy_done < 30, (idle_s, busy_done)
            # ...and busy's engine still holds no more than its slots: the rest wait in the backlog
            held = [req for req in worker.requests.of(RequestState.RUNNING) if req.job.model == "busy"]
            assert len(held) <= 2 * SLOTS and len(worker.admitter.backlog) > 0, (len(held), len(worker.admitter.backlog))
            await wait_results(r, space.names, [j["request_id"] for j in busy], timeout=60)
            results = [decode_event(v) for v in await r.mget([space.names.result(j["request_id"]) for j in busy])]
            assert all(isinstance(e, Done) and e.model == "busy" for e in results)
    finally:
        await r.aclose()


async def test_unknown_model_is_answered_at_intake_not_behind_the_tenants_limit(request: pytest.FixtureRequest,
                                                                               redis_url: str) -> None:
    """A job naming a model this worker does not serve can never run here: it is answered unknown_model when
    read, not after waiting in the backlog for admission (behind its tenant's running limit here: one job
    of `capped` runs for ~4 s, and its second job, for a model nobody serves, used to wait for it)."""
    space = await make_space(request, partitions=1)
    long_one = job("cap-long", tenant="capped", model="busy", max_tokens=200, ignore_eos=True)
    wrong = job("cap-wrong", tenant="capped", model="no-such-model", max_tokens=2)
    r = aioredis.Redis.from_url(redis_url)
    try:
        async with running_worker(space, two_models(), max_num_seqs=SLOTS, claim_ttl_s=10,
                                  tenant_max_running=("capped=1",)):
            await produce(space.bootstrap, space.names.jobs_topic, [long_one])
            await wait_claimed(r, space.names.claim("cap-long"))
            sent = time.monotonic()
            await produce(space.bootstrap, space.names.jobs_topic, [wrong])
            outcome = (await wait_results(r, space.names, ["cap-wrong"], timeout=30))["cap-wrong"]
            waited = time.monotonic() - sent
            assert isinstance(outcome.terminal, Error) and outcome.terminal.code == "unknown_model"
            assert "no-such-model" in outcome.terminal.message and "busy" in outcome.terminal.message
            assert waited < 2.0, waited
            assert await r.get(space.names.result("cap-long")) is None  # the capped one still runs
    finally:
        await r.aclose()


async def wait_claimed(r: aioredis.Redis, key: str) -> None:
    for _ in range(200):
        if await r.exists(key):
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"{key} was never claimed")


def test_the_heartbeat_names_the_batch_topic_and_the_capacity_of_every_model() -> None:
    """Each model's engine runs max_num_seqs requests at once, so a two-model worker's capacity is twice
    that; the heartbeat also names the batch topic the worker reads (what the gateway's Batch API uses)."""
    import json

    from stoker.worker.config import WorkerConfig
    from stoker.worker.service import Worker

    cfg = WorkerConfig(fake_engine=True, max_num_seqs=SLOTS, job_topic="t.jobs", batch_topic="t.bulk",
                       metrics_port=-1)
    beat = json.loads(Worker(cfg, two_models())._heartbeat(0))
    assert beat["capacity"] == 2 * SLOTS and beat["models"] == ["busy", "idle"] and beat["batch_topic"] == "t.bulk"
    off = WorkerConfig(fake_engine=True, job_topic="t.jobs", no_batch_topic=True, metrics_port=-1)
    assert json.loads(Worker(off, two_models())._heartbeat(0))["batch_topic"] == ""
