"""Tenants and priority classes against the real Kafka and Redis, with the stand-in engine slowed down
(fake step delay) so that a burst takes longer than reading it: what the backlog's read-ahead and admission
order (worker/admission.py) and the tenant limits in Redis (worker/tenant_limits.py) promise."""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from collections import Counter
from typing import Any

import msgspec
import pytest
import redis.asyncio as aioredis
from aiokafka import AIOKafkaProducer
from stoker.schemas import Done, Names, decode_event, default_batch_topic
from stoker.worker import admitter
from stoker.worker.admission import BATCH
from stoker.worker.fake_engine import FakeEngine
from worker_harness import (
    Space,
    committed_offsets,
    create_topics,
    job,
    running_worker,
    stack_fixtures,
    start_worker_process,
    stop_process,
    wait_results,
)

pytestmark = [pytest.mark.stack, pytest.mark.timeout(120)]


space, r = stack_fixtures()


async def batch_topic_of(space: Space) -> str:
    topic = default_batch_topic(space.names.jobs_topic)
    await create_topics(space.bootstrap, {topic: 4})
    return topic


async def produce_bulk(bootstrap: str, topic: str, jobs: list[dict[str, Any]]) -> None:
    """Many small JSON jobs through one producer, batched (the harness's produce() is per-record paced)."""
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, acks=1, linger_ms=20, max_batch_size=256 * 1024)
    await producer.start()
    try:
        futures = [await producer.send(topic, value=msgspec.json.encode(j), key=j["request_id"].encode())
                   for j in jobs]
        await asyncio.gather(*futures)
    finally:
        await producer.stop()


async def count_results(r: aioredis.Redis, names: Names, ids: list[str]) -> int:
    found = 0
    for start in range(0, len(ids), 5000):
        values = await r.mget([names.result(i) for i in ids[start:start + 5000]])
        found += sum(v is not None for v in values)
    return found


def slow_engine(max_num_seqs: int, step_delay_s: float) -> FakeEngine:
    return FakeEngine(max_num_seqs=max_num_seqs, step_delay_s=step_delay_s)


async def test_twenty_jobs_of_a_second_tenant_finish_before_a_tenth_of_a_20000_job_burst(space, r):
    burst = [job(f"acme-{i}", tenant="acme", prompt="x", max_tokens=1) for i in range(20_000)]
    few = [job(f"beta-{i}", tenant="beta", prompt="x", max_tokens=1) for i in range(20)]
    # 8 jobs per 50 ms step: the burst alone would take ~2 minutes, reading it all takes a few seconds.
    async with running_worker(space, slow_engine(8, 0.05), max_num_seqs=8, max_poll_records=500):
        await produce_bulk(space.bootstrap, space.names.jobs_topic, burst)
        await produce_bulk(space.bootstrap, space.names.jobs_topic, few)
        results = await wait_results(r, space.names, [j["request_id"] for j in few], timeout=45)
        burst_done = await count_results(r, space.names, [j["request_id"] for j in burst])
    assert all(isinstance(o.terminal, Done) and o.terminal.tenant == "beta" for o in results.values())
    assert burst_done < len(burst) // 10, f"{burst_done} of the burst finished before the other tenant's 20"


async def test_a_live_job_behind_a_20000_job_batch_backlog_starts_within_a_second(space, r):
    batch_topic = await batch_topic_of(space)
    bulk = [job(f"bulk-{i}", prompt="x", max_tokens=1) for i in range(20_000)]
    live = job("live-0", prompt="x", max_tokens=1)
    async with running_worker(space, slow_engine(8, 0.05), max_num_seqs=8, max_poll_records=500) as worker:
        assert worker.admitter.batch_topic == batch_topic  # read by default, since it exists
        await produce_bulk(space.bootstrap, batch_topic, bulk)
        deadline = time.monotonic() + 30
        while worker.admitter.backlog.jobs_by_class[BATCH] < 15_000 and time.monotonic() < deadline:
            await asyncio.sleep(0.1)  # the batch backlog is read ahead, the engine busy with it
        assert worker.admitter.backlog.jobs_by_class[BATCH] >= 15_000
        await produce_bulk(space.bootstrap, space.names.jobs_topic, [live])
        done = (await wait_results(r, space.names, ["live-0"], timeout=10))["live-0"].terminal
        bulk_done = await count_results(r, space.names, [j["request_id"] for j in bulk])
    assert isinstance(done, Done)
    assert done.timings.queue_ms < 1000, f"the live job waited {done.timings.queue_ms:.0f} ms for the engine"
    assert bulk_done < len(bulk) // 2  # it really was behind the batch backlog


async def sample_until(r: aioredis.Redis, names: Names, ids: list[str], seconds: float) -> dict[str, float]:
    """Poll the result keys; {request id: monotonic time its result was first seen}."""
    seen: dict[str, float] = {}
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        missing = [i for i in ids if i not in seen]
        now = time.monotonic()
        for start in range(0, len(missing), 5000):
            chunk = missing[start:start + 5000]
            for rid, value in zip(chunk, await r.mget([names.result(i) for i in chunk]), strict=True):
                if value is not None:
                    seen[rid] = now
        await asyncio.sleep(0.2)
    return seen


async def test_a_tenant_token_limit_holds_across_two_workers_within_ten_percent(space, r):
    tokens_per_minute, per_job = 6000, 10  # 100 tokens/s: the two engines could do ~30 times that
    jobs = [job(f"m-{i}", tenant="metered", prompt="x", max_tokens=per_job - 1) for i in range(1500)]
    limits: dict[str, Any] = dict(tenant_tokens_per_minute=("metered=6000",), tenant_burst_s=1.0,
                                  max_num_seqs=16)
    async with running_worker(space, slow_engine(16, 0.01), **limits), \
            running_worker(space, slow_engine(16, 0.01), **limits):
        await produce_bulk(space.bootstrap, space.names.jobs_topic, jobs)
        started = time.monotonic()
        seen = await sample_until(r, space.names, [j["request_id"] for j in jobs], 20)
    window = (started + 4, started + 19)  # past the first second's burst and the group's settling
    served = per_job * sum(window[0] <= t < window[1] for t in seen.values())
    expected = tokens_per_minute / 60 * (window[1] - window[0])
    assert abs(served - expected) <= 0.1 * expected, f"{served} tokens in {window[1] - window[0]:.0f} s, " \
                                                     f"limit {expected:.0f}"
    workers = set()
    for rid in list(seen)[:200]:
        event = decode_event(await r.get(space.names.result(rid)))
        assert isinstance(event, Done) and event.usage.prompt_tokens + event.usage.completion_tokens == per_job
        workers.add(event.worker)
    assert len(workers) == 2  # both workers served the tenant: the limit is one budget for them both


async def test_a_tenant_running_limit_holds_across_two_workers_and_others_go_on(space, r):
    capped = [job(f"c-{i}", tenant="capped", prompt="x", max_tokens=20) for i in range(30)]
    free = [job(f"f-{i}", tenant="free", prompt="x", max_tokens=20) for i in range(30)]
    settings: dict[str, Any] = dict(tenant_max_running=("capped=3",), max_num_seqs=16)
    async with running_worker(space, slow_engine(16, 0.02), **settings) as w1, \
            running_worker(space, slow_engine(16, 0.02), **settings) as w2:
        await produce_bulk(space.bootstrap, space.names.jobs_topic, capped + free)
        most = 0
        free_ids = [j["request_id"] for j in free]
        free_done_at = None
        deadline = time.monotonic() + 40
        while time.monotonic() < deadline:
            claims = await r.mget([space.names.claim(j["request_id"]) for j in capped])
            most = max(most, sum(c is not None for c in claims))
            if free_done_at is None and await count_results(r, space.names, free_ids) == len(free):
                free_done_at = time.monotonic()
            if await count_results(r, space.names, [j["request_id"] for j in capped]) == len(capped):
                break
            await asyncio.sleep(0.03)
        capped_done_at = time.monotonic()
        refused = sum(w.metrics.registry.get_sample_value(
            "stoker_tenant_limited_total", {"tenant": "capped", "limit": "max_running"}) or 0 for w in (w1, w2))
    assert refused > 0  # counted per tenant in the metrics
    assert most == 3, f"{most} of the capped tenant's jobs ran at once (limit 3)"
    assert free_done_at is not None and free_done_at < capped_done_at - 1  # the other tenant did not wait


async def test_the_batch_topic_is_read_when_it_exists_and_not_when_switched_off(space, r):
    batch_topic = await batch_topic_of(space)
    await produce_bulk(space.bootstrap, batch_topic, [job(f"b-{i}", max_tokens=2) for i in range(20)])
    async with running_worker(space, no_batch_topic=True, group_id=space.group + "-off") as worker:
        assert worker.admitter.batch_topic is None
        await asyncio.sleep(3)
        assert await count_results(r, space.names, [f"b-{i}" for i in range(20)]) == 0
    async with running_worker(space):
        results = await wait_results(r, space.names, [f"b-{i}" for i in range(20)], timeout=30)
    assert all(isinstance(o.terminal, Done) for o in results.values())


async def test_a_missing_batch_topic_is_logged_the_live_topic_served_and_the_topic_read_once_made(
        space, r, caplog, monkeypatch):
    caplog.set_level(logging.WARNING, logger="stoker.worker")
    monkeypatch.setattr(admitter, "BATCH_TOPIC_RECHECK_S", 0.5)
    async with running_worker(space) as worker:
        assert worker.admitter.batch_topic is None
        await produce_bulk(space.bootstrap, space.names.jobs_topic, [job("live-1", max_tokens=2)])
        results = await wait_results(r, space.names, ["live-1"], timeout=20)
        batch_topic = await batch_topic_of(space)  # made while the worker runs: it subscribes to it
        await produce_bulk(space.bootstrap, batch_topic, [job("late-batch-1", max_tokens=2)])
        results |= await wait_results(r, space.names, ["late-batch-1"], timeout=30)
        assert worker.admitter.batch_topic == batch_topic
    assert all(isinstance(o.terminal, Done) for o in results.values())
    assert any("event=batch_topic_missing" in rec.getMessage() and default_batch_topic(space.names.jobs_topic)
               in rec.getMessage() for rec in caplog.records)


async def test_deadline_and_cancel_of_jobs_in_the_backlog_apply_within_seconds(space, r):
    burst = [job(f"w-{i}", tenant="acme", prompt="x", max_tokens=1) for i in range(5000)]
    soon = int(time.time() * 1000) + 1500
    tail = [job("dl-0", tenant="acme", prompt="x", max_tokens=1, deadline_ms=soon),
            job("cx-0", tenant="acme", prompt="x", max_tokens=1)]
    async with running_worker(space, slow_engine(8, 0.05), max_num_seqs=8, max_poll_records=500):
        await produce_bulk(space.bootstrap, space.names.jobs_topic, burst + tail)
        await asyncio.sleep(0.5)
        await r.set(space.names.cancelled("cx-0"), b"1", ex=600)
        await r.publish(space.names.cancel_channel, msgspec.json.encode({"type": "cancel", "request_id": "cx-0"}))
        results = await wait_results(r, space.names, ["dl-0", "cx-0"], timeout=6)
        burst_done = await count_results(r, space.names, [j["request_id"] for j in burst])
    assert [results[i].terminal.finish_reason for i in ("dl-0", "cx-0")] == ["deadline", "cancelled"]  # type: ignore[union-attr]
    assert burst_done < len(burst) // 2  # they ended long before their turn in the backlog came


async def test_sigkill_with_a_full_backlog_loses_nothing_and_counts_no_attempt_for_unstarted_jobs(space, r,
                                                                                                   tmp_path):
    """The backlog's records stay uncommitted (watermark), so a crash re-delivers them; they were never
    claimed, so the next worker runs them as attempt 1, and only the jobs the engine held run again."""
    names = space.names
    jobs = [job(f"k-{i}", tenant=f"t{i % 3}", prompt="x", max_tokens=3) for i in range(3000)]
    env = space.worker_env(STOKER_FAKE_STEP_DELAY_S="0.05", STOKER_MAX_NUM_SEQS="8", STOKER_MAX_POLL_RECORDS="500")
    proc = start_worker_process(env, log_path=tmp_path / "w1.log")
    try:
        await produce_bulk(space.bootstrap, names.jobs_topic, jobs)
        for _ in range(300):  # some have finished: the backlog holds the rest
            if await count_results(r, names, [j["request_id"] for j in jobs]) >= 50:
                break
            await asyncio.sleep(0.1)
        proc.kill()
        proc.wait(10)
        done_before = await count_results(r, names, [j["request_id"] for j in jobs])
    finally:
        stop_process(proc, signal.SIGKILL)
    assert 0 < done_before < len(jobs) // 2
    proc2 = start_worker_process(space.worker_env(STOKER_MAX_POLL_RECORDS="500"), log_path=tmp_path / "w2.log")
    try:
        results = await wait_results(r, names, [j["request_id"] for j in jobs], timeout=60)
    finally:
        assert stop_process(proc2) == 0
    attempts = Counter(o.terminal.attempt for o in results.values())
    assert all(isinstance(o.terminal, Done) for o in results.values())
    # at most what the engine held at the kill (8 running + 8 waiting) ran twice; the backlog's ran once
    assert attempts[1] >= len(jobs) - 16 and set(attempts) <= {1, 2}, attempts
    committed, end = await committed_offsets(space.bootstrap, space.group, names.jobs_topic)
    assert committed == end == len(jobs)
