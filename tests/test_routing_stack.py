"""Routing by model across consumer groups, against the real Kafka and Redis: the gateway in front of two
groups (two topics, two models, stand-in engines), and workers refusing a group or topic whose live members
serve another model set."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
import redis.asyncio as aioredis
from aiokafka import AIOKafkaConsumer, TopicPartition
from stoker.client.client import Client
from stoker.gateway.app import create_app
from stoker.schemas import Done
from stoker.worker.fake_engine import FakeEngine
from stoker.worker.membership import heartbeat, join_checked
from stoker.worker.service import Worker
from test_routing import TwoModels
from worker_harness import (
    Space,
    create_topics,
    make_space,
    running_worker,
    start_worker_process,
    stop_process,
)

pytestmark = pytest.mark.stack


@pytest.fixture
async def space(request: pytest.FixtureRequest) -> Space:
    return await make_space(request, partitions=2)


@pytest.fixture
async def r(redis_url: str) -> AsyncIterator[aioredis.Redis]:
    client = aioredis.Redis.from_url(redis_url)
    yield client
    await client.aclose()


async def end_offsets(bootstrap: str, topics: list[str]) -> dict[str, int]:
    """Records ever produced to each topic (the sum of its partitions' end offsets)."""
    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap)
    await consumer.start()
    try:
        out = {}
        for topic in topics:
            parts = await consumer._client.fetch_all_metadata()  # noqa: SLF001 -- a fresh client's metadata
            tps = [TopicPartition(topic, p) for p in parts.partitions_for_topic(topic) or set()]
            assert tps, f"topic {topic} has no partitions"
            out[topic] = sum((await consumer.end_offsets(tps)).values())
        return out
    finally:
        await consumer.stop()


async def second_topic(space: Space, suffix: str) -> str:
    topic = f"{space.names.jobs_topic}.{suffix}"
    await create_topics(space.bootstrap, {topic: 2, topic + ".dlq": 1})
    return topic


@pytest.fixture
async def two_groups(space: Space) -> AsyncIterator[tuple[Worker, Worker, str]]:
    """Worker A (model-a) on the space's topic and group, worker B (model-b) on a topic and group of its
    own, one Redis prefix; yields them and the gateway's --job-topic (a third topic, which no worker reads)."""
    topic_b, fallback = await second_topic(space, "b"), await second_topic(space, "fallback")
    async with running_worker(space, FakeEngine("model-a")) as a, \
            running_worker(space, FakeEngine("model-b"), job_topic=topic_b, group_id=f"{space.group}.b") as b:
        yield a, b, fallback


@pytest.fixture
async def gateway(space: Space, two_groups: tuple[Worker, Worker, str]) -> AsyncIterator[httpx.AsyncClient]:
    fallback = two_groups[2]
    # unindexed_scan_s=0: a heartbeat written outside the worker index (an older worker's) shows at once
    app = create_app(lambda: Client(space.bootstrap, space.redis_url, prefix=space.names.redis_prefix,
                                    topic=fallback, unindexed_scan_s=0), timeout=30.0)
    transport = httpx.ASGITransport(app=app)
    async with app.router.lifespan_context(app), \
            httpx.AsyncClient(transport=transport, base_url="http://gw/v1", timeout=30) as h:
        yield h


async def test_gateway_routes_each_model_to_the_group_that_serves_it(
        space: Space, two_groups: tuple[Worker, Worker, str], gateway: httpx.AsyncClient) -> None:
    a, b, fallback = two_groups
    topics = [space.names.jobs_topic, b.names.jobs_topic, fallback]
    before = await end_offsets(space.bootstrap, topics)
    models = ["model-a", "model-b"] * 10  # the outside test's 20 requests, interleaved, all at once

    async def ask(i: int, model: str) -> httpx.Response:
        if i % 4 < 2:
            return await gateway.post("/completions", json={"model": model, "prompt": f"p{i}", "max_tokens": 3,
                                                            "ignore_eos": True})
        return await gateway.post("/chat/completions", json={
            "model": model, "messages": [{"role": "user", "content": f"p{i}"}], "max_tokens": 3, "ignore_eos": True})

    answers = await asyncio.gather(*(ask(i, m) for i, m in enumerate(models)))
    assert [r.status_code for r in answers] == [200] * 20, [r.text for r in answers if r.status_code != 200]
    expected_worker = {"model-a": a.cfg.worker_id, "model-b": b.cfg.worker_id}
    async with Client(space.bootstrap, space.redis_url, prefix=space.names.redis_prefix) as c:
        for model, answer in zip(models, answers, strict=True):
            assert answer.json()["model"] == model
            done = await c.result(answer.headers["x-request-id"])
            assert isinstance(done, Done) and done.model == model and done.worker == expected_worker[model]
    after = await end_offsets(space.bootstrap, topics)
    assert {t: after[t] - before[t] for t in topics} == {topics[0]: 10, topics[1]: 10, fallback: 0}


async def test_models_lists_exactly_the_routable_models_and_an_unroutable_one_is_404_without_a_job(
        space: Space, two_groups: tuple[Worker, Worker, str], gateway: httpx.AsyncClient) -> None:
    a, b, fallback = two_groups
    listed = (await gateway.get("/models")).json()
    assert [m["id"] for m in listed["data"]] == ["model-a", "model-b"]
    assert (await gateway.get("/models/model-b")).status_code == 200
    topics = [space.names.jobs_topic, b.names.jobs_topic, fallback]
    before = await end_offsets(space.bootstrap, topics)
    for path, body in (("/completions", {"model": "model-c", "prompt": "hi"}),
                       ("/chat/completions", {"model": "model-c", "messages": [{"role": "user", "content": "hi"}]}),
                       ("/completions", {"prompt": "hi"})):  # no model, two routable: which one?
        answer = await gateway.post(path, json=body)
        error = answer.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["param"] == "model"
        if "model" in body:
            assert answer.status_code == 404 and error["code"] == "model_not_found"
            assert "'model-c'" in error["message"] and "model-a, model-b" in error["message"]
        else:
            assert answer.status_code == 400
    assert (await gateway.get("/models/model-c")).status_code == 404
    await asyncio.sleep(0.5)  # a produce in flight would have landed by now
    assert await end_offsets(space.bootstrap, topics) == before


async def test_gateway_does_not_list_models_of_a_topic_whose_readers_disagree(
        space: Space, two_groups: tuple[Worker, Worker, str], gateway: httpx.AsyncClient, r: aioredis.Redis) -> None:
    # A worker older than the group check (it never refused) reading worker A's topic with another model: a
    # job for model-a may now land on it, so model-a must not be routed; model-b's topic is untouched.
    a, b, _ = two_groups
    beat = heartbeat("old-worker", space.names.jobs_topic, "elsewhere", ["model-z"], capacity=1, running=0,
                     version="0.0.9", started_at=0.0)
    await r.set(f"{space.names.redis_prefix}:worker:old-worker", beat, ex=30)
    await asyncio.sleep(2.2)  # past the gateway's cache age
    assert [m["id"] for m in (await gateway.get("/models")).json()["data"]] == ["model-b"]
    answer = await gateway.post("/completions", json={"model": "model-a", "prompt": "hi"})
    assert answer.status_code == 404 and "old-worker (model-z)" in answer.json()["error"]["message"]


async def test_a_worker_into_a_group_serving_another_model_set_exits_non_zero_naming_them(
        space: Space, r: aioredis.Redis, tmp_path: Path) -> None:
    log = tmp_path / "refused.log"
    async with running_worker(space, FakeEngine("model-a")) as a:
        proc = start_worker_process(space.worker_env(STOKER_SERVED_MODEL_NAME="model-x",
                                                     STOKER_WORKER_ID="refused-worker"), log_path=log)
        try:
            code = await asyncio.to_thread(proc.wait, 60)
        finally:
            stop_process(proc)
        text = log.read_text()
        assert code == 1, text
        assert "refusing to join consumer group" in text and a.cfg.worker_id in text and "model-a" in text
        assert "model-x" in text and "--job-topic" in text and "--group-id" in text
        keys = [k.decode() async for k in r.scan_iter(match=f"{space.names.redis_prefix}:worker:*")]
        assert keys == [f"{space.names.redis_prefix}:worker:{a.cfg.worker_id}"]  # the refused one left none


async def test_a_worker_on_the_same_topic_in_another_group_with_another_set_is_refused(space: Space) -> None:
    async with running_worker(space, FakeEngine("model-a")) as a:
        with pytest.raises(RuntimeError, match=f"refusing to join .*{a.cfg.worker_id}"):
            async with running_worker(space, FakeEngine("model-x"), group_id=f"{space.group}.other"):
                pass


async def test_the_same_model_set_in_another_order_joins_and_heartbeats_carry_topic_group_models(
        space: Space, r: aioredis.Redis) -> None:
    async with running_worker(space, TwoModels("m1", "m2")) as first, \
            running_worker(space, TwoModels("m2", "m1")) as second:
        assert first.ready and second.ready
        for w in (first, second):
            beat = json.loads(await r.get(f"{space.names.redis_prefix}:worker:{w.cfg.worker_id}"))
            assert (beat["topic"], beat["group"], beat["models"]) == (space.names.jobs_topic, space.group,
                                                                      ["m1", "m2"])
            assert beat["capacity"] == 2 * 256 and beat["running"] == 0  # max_num_seqs per served model


async def _join(client: aioredis.Redis, prefix: str, worker_id: str, topic: str, group: str,
                models: list[str]) -> None:
    beat = heartbeat(worker_id, topic, group, models, capacity=1, running=0, version="t", started_at=0.0)
    await join_checked(client, prefix, worker_id, topic, group, models, beat, 30)


async def test_two_workers_starting_at_once_with_different_sets_one_joins_one_is_refused(
        space: Space, redis_url: str) -> None:
    # The check and the first heartbeat are atomic under the join lock; without it both scans would find an
    # empty group and both workers would join.
    prefix = space.names.redis_prefix
    clients = [aioredis.Redis.from_url(redis_url) for _ in range(2)]
    try:
        for round_ in range(5):  # a fresh topic and group each round
            topic, group = f"{space.names.jobs_topic}-{round_}", f"{space.group}-{round_}"
            ids = [f"racer-{round_}-{i}" for i in range(2)]
            outcomes = await asyncio.gather(_join(clients[0], prefix, ids[0], topic, group, ["a"]),
                                            _join(clients[1], prefix, ids[1], topic, group, ["b"]),
                                            return_exceptions=True)
            refused = [o for o in outcomes if isinstance(o, RuntimeError)]
            assert len(refused) == 1 and outcomes.count(None) == 1, outcomes
            assert ids[outcomes.index(None)] in str(refused[0])
    finally:
        for client in clients:
            await client.aclose()


async def test_a_group_whose_workers_stopped_or_died_takes_another_model_set_at_once(
        space: Space, r: aioredis.Redis) -> None:
    prefix = space.names.redis_prefix
    async with running_worker(space, FakeEngine("model-a")) as a:
        assert await r.zscore(f"{prefix}:workers", a.cfg.worker_id) is not None  # the index has it
    # a graceful stop takes the heartbeat and the index entry with it, not at their TTL
    assert await r.zscore(f"{prefix}:workers", a.cfg.worker_id) is None
    assert await r.exists(f"{prefix}:worker:{a.cfg.worker_id}") == 0
    # one that died (its heartbeat expired, its index entry left behind) is no conflict either
    await r.zadd(f"{prefix}:workers", {"died-earlier": time.time() * 1000})
    async with running_worker(space, FakeEngine("model-b")) as b:
        assert b.ready


async def test_each_heartbeat_renews_the_workers_index_entry(space: Space, r: aioredis.Redis) -> None:
    # An entry not renewed for an hour is dropped at the next join, so a long-lived worker must keep its own
    # fresh, or later starters would no longer see it.
    index = f"{space.names.redis_prefix}:workers"
    async with running_worker(space, FakeEngine("model-a")) as a:  # claim TTL 3 s: a heartbeat every second
        await r.zadd(index, {a.cfg.worker_id: 1.0})
        await asyncio.sleep(1.5)
        score = await r.zscore(index, a.cfg.worker_id)
        assert score is not None and abs(score - time.time() * 1000) < 5_000


async def test_another_model_set_appearing_in_the_group_later_is_logged_and_counted(
        space: Space, r: aioredis.Redis, caplog: pytest.LogCaptureFixture) -> None:
    """The group check at start can't see what comes after it (a worker older than the check, a heartbeat
    written past the lock): the running worker re-checks every claim TTL (3 s here), logs event=group_conflict
    naming the intruder and sets stoker_group_conflicts, back to 0 once it is gone."""
    prefix = space.names.redis_prefix
    async with running_worker(space, FakeEngine("model-a")) as a:
        def conflicts_now() -> float | None:
            return a.metrics.registry.get_sample_value("stoker_group_conflicts")

        assert conflicts_now() == 0
        beat = heartbeat("intruder", "elsewhere", space.group, ["model-z"], capacity=1, running=0, version="t",
                         started_at=0.0)
        await r.set(f"{prefix}:worker:intruder", beat, ex=30)
        await r.zadd(f"{prefix}:workers", {"intruder": time.time() * 1000})
        for _ in range(100):
            if conflicts_now() == 1:
                break
            await asyncio.sleep(0.1)
        assert conflicts_now() == 1
        logged = [rec for rec in caplog.records if "event=group_conflict" in rec.getMessage()]
        assert logged and logged[0].levelname == "ERROR" and "intruder" in logged[0].getMessage()
        await r.delete(f"{prefix}:worker:intruder")
        for _ in range(100):
            if conflicts_now() == 0:
                break
            await asyncio.sleep(0.1)
        assert conflicts_now() == 0


async def test_garbage_in_the_worker_index_neither_stops_workers_nor_hides_them(space: Space,
                                                                               r: aioredis.Redis) -> None:
    """The worker index and the heartbeat keys are writable by anyone who writes the prefix's keys (clients do,
    for cancels). A member that is not UTF-8 and a heartbeat nested past the JSON parser's recursion limit made
    the worker's group check raise: a running worker turned fatal within a claim TTL, and no worker could start
    until someone cleaned Redis; the client's listing failed whole. Now both are skipped as no heartbeat of ours."""
    prefix = space.names.redis_prefix
    now_ms = time.time() * 1000
    await r.zadd(f"{prefix}:workers", {b"\xff\xfe-not-text": now_ms, "deep": now_ms})
    await r.set(f"{prefix}:worker:deep", "[" * 200_000 + "]" * 200_000, ex=60)
    await r.set(f"{prefix}:worker:\xff".encode("latin-1"), b"{}", ex=60)  # a key name that is not UTF-8 either
    async with running_worker(space) as w:  # the join's check reads the index first
        await asyncio.sleep(2.5 * w.cfg.claim_ttl_s)  # two or more of the running group checks
        assert w.fatal is None and w.ready
        async with Client(space.bootstrap, space.redis_url, prefix=prefix, unindexed_scan_s=0) as c:
            assert [x.worker_id for x in await c.workers()] == [w.cfg.worker_id]
