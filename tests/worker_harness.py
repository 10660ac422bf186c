"""Helpers for the worker's stack tests: a fresh topic + Redis prefix per test, producing jobs, reading back
every request's stream, starting workers in-process or as subprocesses."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import pytest
import redis.asyncio as aioredis
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.structs import ConsumerRecord
from stoker.engine import EngineRequest, SamplingParams
from stoker.schemas import Chunk, Done, Error, Names, decode_event
from stoker.worker.config import WorkerConfig
from stoker.worker.driver import EngineLike
from stoker.worker.fake_engine import FakeEngine
from stoker.worker.service import Worker

ROOT = Path(__file__).resolve().parents[1]


def stack_endpoints(request: pytest.FixtureRequest) -> tuple[str, str]:
    """(kafka bootstrap, redis url) from the shared fixtures, or the environment while they are missing."""
    try:
        return request.getfixturevalue("kafka_bootstrap"), request.getfixturevalue("redis_url")
    except pytest.FixtureLookupError:
        kafka, redis_url = os.environ.get("KAFKA_BOOTSTRAP_SERVERS"), os.environ.get("REDIS_URL")
        if not kafka or not redis_url:
            pytest.skip("no Kafka/Redis: set KAFKA_BOOTSTRAP_SERVERS and REDIS_URL or run ops/stack up")
        return kafka, redis_url


# Every topic this session made through create_topics: conftest deletes them when the session ends, since on a
# long-lived broker they pile up (the local stack's 384 MiB heap ran out at ~9,600 partitions).
CREATED_TOPICS: set[str] = set()


async def create_topics(bootstrap: str, topics: dict[str, int]) -> None:
    CREATED_TOPICS.update(topics)
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        await admin.create_topics([NewTopic(name, n, 1) for name, n in topics.items()])
    finally:
        await admin.close()
    # Wait until the broker knows every partition's leader, so the first produce does not race creation.
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap)
    await producer.start()
    try:
        for name, n in topics.items():
            for _ in range(100):
                parts = await producer.partitions_for(name)
                if parts and len(parts) == n:
                    break
                await asyncio.sleep(0.1)
    finally:
        await producer.stop()


@dataclass
class Space:
    """One test's own topic pair, consumer group and Redis prefix."""

    bootstrap: str
    redis_url: str
    tag: str = field(default_factory=lambda: uuid.uuid4().hex[:10])

    @property
    def names(self) -> Names:
        return Names(redis_prefix=f"t{self.tag}", jobs_topic=f"jobs.{self.tag}")

    @property
    def group(self) -> str:
        return f"g-{self.tag}"

    def worker_env(self, **extra: str) -> dict[str, str]:
        env = dict(os.environ)
        env.update(KAFKA_BOOTSTRAP_SERVERS=self.bootstrap, REDIS_URL=self.redis_url,
                   STOKER_JOB_TOPIC=self.names.jobs_topic, STOKER_PREFIX=self.names.redis_prefix,
                   STOKER_GROUP_ID=self.group, STOKER_METRICS_PORT="-1", STOKER_FAKE_ENGINE="1",
                   STOKER_CLAIM_TTL_S="3", PYTHONUNBUFFERED="1")
        env.update(extra)
        return env


async def delete_created_topics(bootstrap: str, names: Iterable[str] | None = None, chunk: int = 200) -> int:
    """Delete `names` (default: every topic made through create_topics) from the broker, in chunks; those
    already gone are skipped. -> how many were deleted."""
    wanted = set(CREATED_TOPICS if names is None else names)
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        present = sorted(wanted & set(await admin.list_topics()))
        for start in range(0, len(present), chunk):
            await admin.delete_topics(present[start:start + chunk])
    finally:
        await admin.close()
    CREATED_TOPICS.difference_update(wanted)
    return len(present)


async def make_space(request: pytest.FixtureRequest, partitions: int = 4) -> Space:
    bootstrap, redis_url = stack_endpoints(request)
    space = Space(bootstrap, redis_url)
    await create_topics(bootstrap, {space.names.jobs_topic: partitions, space.names.dlq_topic: 1})
    return space


def stack_fixtures(partitions: int = 4) -> tuple[Any, Any]:
    """A stack test module's `space` (a fresh job topic pair and Redis prefix per test) and `r` (a Redis client,
    closed after the test) fixtures: `space, r = stack_fixtures()` at module level (pytest finds fixtures in a
    module's namespace). Not in conftest.py: it is loaded on the GPU machine too, without Kafka and Redis."""
    @pytest.fixture(name="space")
    async def space_fixture(request: pytest.FixtureRequest) -> Space:
        return await make_space(request, partitions=partitions)

    @pytest.fixture(name="r")
    async def redis_fixture(space: Space) -> AsyncIterator[aioredis.Redis]:
        client = aioredis.Redis.from_url(space.redis_url)
        yield client
        await client.aclose()

    return space_fixture, redis_fixture


def job(request_id: str, **fields: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"type": "job", "request_id": request_id}
    if not any(k in fields for k in ("prompt", "messages", "prompt_token_ids")):
        body["prompt"] = "tell me a story"
    body.update(fields)
    return body


async def produce(bootstrap: str, topic: str, jobs: Iterable[dict[str, Any] | tuple[bytes | None, bytes, list]],
                  msgpack_every: int = 0) -> None:
    """Produce jobs (dicts: JSON, or MessagePack for every `msgpack_every`-th; tuples: raw key/value/headers)."""
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, acks="all")
    await producer.start()
    try:
        futures = []
        for i, item in enumerate(jobs):
            if isinstance(item, tuple):
                key, value, headers = item
            elif msgpack_every and i % msgpack_every == 0:
                key, value = item["request_id"].encode(), msgspec.msgpack.encode(item)
                headers = [("content-type", b"application/msgpack")]
            else:
                key, value, headers = item["request_id"].encode(), msgspec.json.encode(item), []
            futures.append(await producer.send(topic, value=value, key=key, headers=headers))
        await asyncio.gather(*futures)
    finally:
        await producer.stop()


@dataclass
class Outcome:
    terminal: Done | Error
    events: list[Chunk | Done | Error]  # the stream, in order

    def chunks_of_final_attempt(self) -> list[Chunk]:
        return [e for e in self.events if isinstance(e, Chunk) and e.attempt == self.terminal.attempt]


async def dead_letters(bootstrap: str, dlq_topic: str) -> list[ConsumerRecord[bytes, bytes]]:
    """Every record on the test's dead-letter topic (read from the start; waits up to 5 s for the first)."""
    consumer = AIOKafkaConsumer(dlq_topic, bootstrap_servers=bootstrap, auto_offset_reset="earliest")
    await consumer.start()
    try:
        batches = await consumer.getmany(timeout_ms=5000)
    finally:
        await consumer.stop()
    return [rec for recs in batches.values() for rec in recs]


async def wait_results(r: aioredis.Redis, names: Names, ids: Iterable[str], timeout: float) -> dict[str, Outcome]:
    """Wait until every id has a result key, then read its stream from 0-0."""
    ids = list(ids)
    deadline = time.monotonic() + timeout
    while True:
        values = await r.mget([names.result(i) for i in ids])
        missing = [i for i, v in zip(ids, values, strict=True) if v is None]
        if not missing:
            break
        if time.monotonic() > deadline:
            raise AssertionError(f"{len(missing)} of {len(ids)} jobs have no result after {timeout}s: {missing[:5]}")
        await asyncio.sleep(0.1)
    out = {}
    for rid, value in zip(ids, values, strict=True):
        entries: Any = await r.xrange(names.stream(rid))
        events = [decode_event(fields[b"data"]) for _, fields in entries]
        out[rid] = Outcome(decode_event(value), events)  # type: ignore[arg-type]
    return out


def check_sequence(outcome: Outcome) -> None:
    """seq 0..n without gaps within the final attempt, chunks join to the terminal text, terminal last."""
    final = [e for e in outcome.events if e.attempt == outcome.terminal.attempt]
    assert [e.seq for e in final] == list(range(len(final))), [e.seq for e in final]
    assert final[-1] == outcome.terminal
    assert sum(isinstance(e, Done | Error) for e in final) == 1
    if isinstance(outcome.terminal, Done):
        assert "".join(c.text for c in outcome.chunks_of_final_attempt()) == outcome.terminal.text


async def committed_offsets(bootstrap: str, group: str, topic: str) -> tuple[int, int]:
    """(sum of the group's committed offsets, sum of end offsets) over the topic's partitions."""
    from aiokafka import AIOKafkaConsumer, TopicPartition

    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, group_id=group, enable_auto_commit=False)
    await consumer.start()
    try:
        parts = [TopicPartition(topic, p) for p in (consumer.partitions_for_topic(topic) or set())]
        if not parts:
            await consumer._client.force_metadata_update()  # noqa: SLF001 -- a fresh client may lack metadata
            parts = [TopicPartition(topic, p) for p in (consumer.partitions_for_topic(topic) or set())]
        ends = await consumer.end_offsets(parts)
        committed = 0
        for tp in parts:
            committed += (await consumer.committed(tp)) or 0
        return committed, sum(ends.values())
    finally:
        await consumer.stop()


def scrape(port: int) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    """/metrics as {(sample name, labels): value}."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def start_worker_process(env: dict[str, str], *args: str, log_path: Path | None = None) -> subprocess.Popen[bytes]:
    if log_path is None:
        return subprocess.Popen([sys.executable, "-m", "stoker.worker.main", *args], cwd=ROOT, env=env,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    with open(log_path, "ab") as out:  # the child keeps its own copy of the descriptor
        return subprocess.Popen([sys.executable, "-m", "stoker.worker.main", *args], cwd=ROOT, env=env, stdout=out,
                                stderr=subprocess.STDOUT)


def stop_process(proc: subprocess.Popen[bytes], sig: int = signal.SIGTERM, timeout: float = 20) -> int:
    if proc.poll() is None:
        proc.send_signal(sig)
    try:
        return proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.wait()


@contextlib.asynccontextmanager
async def running_worker(space: Space, engine: EngineLike | None = None, **cfg: object) -> AsyncIterator[Worker]:
    settings: dict[str, object] = dict(
        fake_engine=True, bootstrap_servers=space.bootstrap, redis_url=space.redis_url,
        job_topic=space.names.jobs_topic, prefix=space.names.redis_prefix, group_id=space.group,
        metrics_port=-1, claim_ttl_s=3, drain_timeout_s=5)
    settings.update(cfg)
    config = WorkerConfig(**settings)  # type: ignore[arg-type]
    worker = Worker(config, engine or FakeEngine(max_num_seqs=config.max_num_seqs))
    task = asyncio.create_task(worker.run())
    try:
        for _ in range(200):  # joined the group and got partitions
            if worker.ready or task.done():
                break
            await asyncio.sleep(0.05)
        if task.done():
            task.result()
        yield worker
    finally:
        worker.request_stop()
        await asyncio.wait_for(task, 30)


def check_attempt_order(outcome: Outcome) -> None:
    """The contract's attempt rules over one request's stream: attempts never go down (no event of a lower
    attempt after the first event of a higher one), the highest attempt ends with exactly one terminal
    event, and the result key holds that very event."""
    attempts = [e.attempt for e in outcome.events]
    assert attempts == sorted(attempts), f"an older attempt published after a newer one: {attempts}"
    top = max(attempts)
    assert outcome.terminal.attempt == top, f"the result is attempt {outcome.terminal.attempt}, the stream has {top}"
    final_terminals = [e for e in outcome.events if e.attempt == top and isinstance(e, Done | Error)]
    assert final_terminals == [outcome.terminal], final_terminals


def expected_text(request_id: str, max_tokens: int) -> str:
    """What the stand-in engine alone makes of a request (prompt "x"): the text a worker must deliver for it."""
    engine = FakeEngine()
    engine.add_request(EngineRequest(request_id, prompt="x", params=SamplingParams(max_tokens=max_tokens)))
    text = []
    while engine.has_unfinished():
        text += [o.text_delta for o in engine.step()]
    return "".join(text)
