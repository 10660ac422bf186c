"""The client against real Kafka and Redis, with a scripted responder standing in for the worker.

The responder consumes the test's own topic and publishes events exactly as scripted (duplicates, gaps on
pub/sub, a takeover, a lost terminal event, errors), which is how the client's ordering rules are tested:
the real worker never misbehaves on purpose. Tests of the client with the real worker are in
test_gateway.py and test_cli.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec
import pytest
import redis.asyncio as aioredis
from aiokafka import AIOKafkaConsumer
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from redis.exceptions import ConnectionError as RedisConnectionError
from stoker.client.client import (
    Client,
    ClientError,
    EventSequencer,
    RequestFailed,
    RequestTimeout,
    SyncClient,
    TextAssembler,
)
from stoker.schemas import Chunk, Done, Job, Names, Timings, Usage
from stoker.schemas import Error as ErrorEvent

from stoker import schemas

WORDS = ["alpha ", "beta ", "gamma ", "delta ", "epsilon "]


def chunk(rid: str, seq: int, attempt: int = 1, text: str | None = None) -> Chunk:
    return Chunk(request_id=rid, attempt=attempt, seq=seq, text=WORDS[seq % 5] if text is None else text,
                 token_ids=[seq])


def done(rid: str, seq: int, text: str, attempt: int = 1) -> Done:
    return Done(request_id=rid, attempt=attempt, seq=seq, finish_reason="length", text=text,
                usage=Usage(prompt_tokens=3, completion_tokens=seq, cached_tokens=0),
                timings=Timings(queue_ms=1.0, ttft_ms=2.0, total_ms=3.0), model="scripted", worker="responder")


# ---- pure logic: no stack needed ---------------------------------------------------------------------------
def test_sequencer_orders_attempts_duplicates_and_gaps() -> None:
    s = EventSequencer()
    assert s.offer(chunk("r", 0)) == "accept"
    assert s.offer(chunk("r", 0)) == "drop"  # duplicate
    assert s.offer(chunk("r", 2)) == "gap"  # seq 1 missing: not accepted, state unchanged
    assert s.offer(chunk("r", 1)) == "accept"
    assert s.offer(chunk("r", 2)) == "accept"
    assert s.offer(chunk("r", 0, attempt=2)) == "accept"  # takeover restarts seqs
    assert s.offer(chunk("r", 3, attempt=1)) == "drop"  # the dead attempt's late events are discarded
    assert s.offer(chunk("r", 2, attempt=2)) == "gap"
    s.skip_to(chunk("r", 2, attempt=2))
    assert (s.attempt, s.next_seq, s.lost) == (2, 3, 1)


def test_text_assembler_shows_a_rerun_prefix_once() -> None:
    t = TextAssembler()
    shown = [t.feed(chunk("r", 0, text="Hel")), t.feed(chunk("r", 1, text="lo "))]
    # the worker died; attempt 2 reproduces the text from the start and goes further
    shown += [t.feed(chunk("r", 0, 2, "He")), t.feed(chunk("r", 1, 2, "llo")), t.feed(chunk("r", 2, 2, " wor"))]
    assert shown == ["Hel", "lo ", "", "", "wor"]
    assert t.shown == "Hello wor"


def test_bad_job_is_refused_before_anything_is_sent() -> None:
    c = Client("127.0.0.1:1", "redis://127.0.0.1:1/0")  # never started: validation needs no connection
    with pytest.raises(schemas.ContractError, match="temperature"):
        c.make_job("hi", temperature=-1.0)
    with pytest.raises(schemas.ContractError, match="exactly one"):
        c.make_job("hi", prompt_token_ids=[1, 2])
    with pytest.raises(schemas.ContractError, match="stop"):
        c.make_job("hi", stop="a bare string")
    assert len(c.make_job("hi").request_id) == 32  # uuid4 hex by default


def test_response_format_sets_v2() -> None:
    c = Client("127.0.0.1:1", "redis://127.0.0.1:1/0")
    job = c.make_job("hi", response_format={"type": "regex", "pattern": "[a-z]+"})
    assert job.v == 2 and job.response_format == schemas.RegexFormat(pattern="[a-z]+")
    job = c.make_job("hi", response_format=schemas.ChoiceFormat(choices=["a", "b"]))
    assert job.v == 2 and job.response_format == schemas.ChoiceFormat(choices=["a", "b"])
    assert c.make_job("hi").v == 1
    with pytest.raises(schemas.ContractError, match="response_format"):
        c.make_job("hi", response_format={"type": "choice", "choices": "ab"})


def test_a_failed_start_raises_and_leaves_nothing_open() -> None:
    """`with SyncClient(...)` against a Redis that is not there: the connection error comes out, and the
    event loop SyncClient made is closed (no __exit__ follows a failed __enter__; a loop left open is a
    ResourceWarning, an error under this suite's filterwarnings)."""
    client = SyncClient("127.0.0.1:1", "redis://127.0.0.1:1/0")
    with pytest.raises(RedisConnectionError, match="127.0.0.1:1"), client:
        pass
    gc.collect()  # an unclosed loop would warn here, inside this test
    with pytest.raises(ClientError, match="not started"):  # and the async client holds no half-open state
        _ = client._client.redis


def test_client_imports_without_torch() -> None:
    code = (
        "import sys, importlib.abc\n"
        "class Block(importlib.abc.MetaPathFinder):\n"
        "    def find_spec(self, name, path, target=None):\n"
        "        if name == 'torch' or name.startswith(('torch.', 'engine', 'stoker.engine', 'stoker.worker', 'triton')):\n"
        "            raise ImportError('blocked: ' + name)\n"
        "sys.meta_path.insert(0, Block())\n"
        "import stoker.client, stoker.client.client, stoker.client.cli, stoker.client.load, stoker.client.demo\n"
        "import stoker.gateway.app, stoker.gateway.mapping\n"
        "assert not any(m == 'torch' or m.startswith(('torch.', 'engine', 'stoker.engine', 'stoker.worker')) for m in sys.modules), sorted(sys.modules)\n"
        "from stoker.client.cli import cli\n"
        "for argv in (['submit', 'x'], ['tail', 'r'], ['load', '-n', '2'], ['workers']):\n"
        "    cli.commands[argv[0]].make_context(argv[0], argv[1:])\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


# ---- against the stack -------------------------------------------------------------------------------------
Hook = Callable[[aioredis.Redis], Awaitable[object]]  # a step that acts on Redis itself (awaited in order)
# (where: "pub" | "stream" | "both" | "result", event) or ("hook", Hook)
Script = Callable[[Job], list[tuple[str, schemas.Event]] | list[tuple[str, schemas.Event | Hook]]]


@dataclass
class Responder:
    """Consumes jobs from one topic and plays a script of events for each: the worker's wire behaviour,
    under the test's control. Records how many subscribers each job's channel had when the job arrived."""

    bootstrap: str
    redis_url: str
    topic: str
    names: Names
    script: Script
    subscribers_at_arrival: dict[str, int] = field(default_factory=dict)
    jobs: list[tuple[Job, bytes | None]] = field(default_factory=list)

    async def run(self, ready: asyncio.Event) -> None:
        consumer = AIOKafkaConsumer(self.topic, bootstrap_servers=self.bootstrap, group_id=f"g-{uuid.uuid4().hex}",
                                    auto_offset_reset="earliest")
        r = aioredis.from_url(self.redis_url)
        await consumer.start()
        try:
            while not consumer.assignment():  # joined: jobs produced from now on reach us
                await asyncio.sleep(0.05)
            ready.set()
            async for record in consumer:
                content_type = schemas.content_type_of(record.headers)
                job = schemas.decode_job(record.value, content_type)
                self.jobs.append((job, content_type))
                rid = job.request_id
                self.subscribers_at_arrival[rid] = dict(await r.pubsub_numsub(self.names.events_channel(rid)))[
                    self.names.events_channel(rid).encode()]
                packed = schemas.is_msgpack(content_type)
                for where, event in self.script(job):
                    if not isinstance(event, Chunk | Done | ErrorEvent):  # a hook
                        await event(r)
                        continue
                    data = schemas.encode_event(event, msgpack=packed)
                    if where in ("stream", "both", "result"):
                        await r.xadd(self.names.stream(rid), {schemas.STREAM_FIELD: data})
                    if where == "result":
                        await r.set(self.names.result(rid), data, ex=60)
                    if where in ("pub", "both"):
                        await r.publish(self.names.events_channel(rid), data)
        finally:
            await consumer.stop()
            await r.aclose()


async def make_topic(bootstrap: str, partitions: int = 1) -> str:
    name = f"test.client.{uuid.uuid4().hex[:12]}"
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        await admin.create_topics([NewTopic(name, num_partitions=partitions, replication_factor=1)])
    finally:
        await admin.close()
    return name


@contextlib.asynccontextmanager
async def scripted(kafka_bootstrap: str, redis_url: str, script: Script, **client_kw) -> AsyncIterator[
        tuple[Client, Responder]]:
    topic = await make_topic(kafka_bootstrap)
    prefix = f"t{uuid.uuid4().hex[:10]}"
    responder = Responder(kafka_bootstrap, redis_url, topic, Names(redis_prefix=prefix), script)
    ready = asyncio.Event()
    task = asyncio.create_task(responder.run(ready))
    await asyncio.wait_for(ready.wait(), 30)
    try:
        async with Client(kafka_bootstrap, redis_url, prefix=prefix, topic=topic, **client_kw) as c:
            yield c, responder
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


def straight(n: int) -> Script:
    """A well-behaved worker: n chunks then done, each on the channel and the stream, result key last."""
    def play(job: Job) -> list[tuple[str, schemas.Event]]:
        rid = job.request_id
        chunks = [chunk(rid, i) for i in range(n)]
        return [("both", c) for c in chunks] + [("result", done(rid, n, "".join(c.text for c in chunks))),
                                                ("pub", done(rid, n, "".join(c.text for c in chunks)))]
    return play


@pytest.mark.stack
async def test_subscribes_before_producing_so_no_first_token_is_lost(kafka_bootstrap: str, redis_url: str) -> None:
    def pub_only(job: Job) -> list[tuple[str, schemas.Event]]:  # nothing replayable: a late subscriber loses tokens
        rid = job.request_id
        return [("pub", chunk(rid, i)) for i in range(4)] + [("pub", done(rid, 4, "alpha beta gamma delta "))]

    async with scripted(kafka_bootstrap, redis_url, pub_only) as (c, responder):
        subscribers_at_submit: dict[str, int] = {}
        real_submit = c.submit

        async def observed_submit(job: Job, *, topic: str | None = None) -> None:  # Redis when the job is produced
            channel = c.names.events_channel(job.request_id)
            subscribers_at_submit[job.request_id] = dict(await c.redis.pubsub_numsub(channel))[channel.encode()]
            await real_submit(job, topic=topic)

        c.submit = observed_submit  # type: ignore[method-assign]
        for _ in range(3):
            events = [e async for e in c.stream("hi", max_tokens=4, timeout=20)]
            rid = events[0].request_id
            assert subscribers_at_submit[rid] == 1 and responder.subscribers_at_arrival[rid] == 1
            assert [e.seq for e in events] == [0, 1, 2, 3, 4]
            assert "".join(e.text for e in events[:-1]) == events[-1].text


@pytest.mark.stack
async def test_duplicates_dropped_gaps_filled_from_stream_older_attempt_ignored(kafka_bootstrap: str,
                                                                                 redis_url: str) -> None:
    def messy(job: Job) -> list[tuple[str, schemas.Event]]:
        rid = job.request_id
        c = [chunk(rid, i, attempt=2) for i in range(6)]
        text = "".join(x.text for x in c)
        return [("both", c[0]), ("pub", c[0]), ("both", c[1]),
                ("stream", c[2]), ("stream", c[3]),  # lost on pub/sub: only the stream has them
                ("both", c[4]), ("pub", c[1]), ("pub", chunk(rid, 9, attempt=1, text="STALE")),
                ("both", c[5]), ("both", done(rid, 6, text, attempt=2))]

    async with scripted(kafka_bootstrap, redis_url, messy) as (c, _):
        events = [e async for e in c.stream("hi", timeout=20)]
    assert [e.seq for e in events] == [0, 1, 2, 3, 4, 5, 6]
    assert isinstance(events[-1], Done)
    assert "".join(e.text for e in events[:-1]) == events[-1].text == "".join(WORDS) + WORDS[0]


@pytest.mark.stack
async def test_invalid_or_foreign_events_on_the_channel_and_stream_are_skipped(kafka_bootstrap: str,
                                                                                redis_url: str) -> None:
    """Anyone who can write to Redis can publish on a request's channel: bytes that are not an event, an
    event that breaks the contract, or another request's event must not end the stream or reach the caller."""
    def hostile(job: Job) -> list[tuple[str, schemas.Event | Hook]]:
        rid = job.request_id
        c = [chunk(rid, i) for i in range(3)]
        channel, stream = Names(redis_prefix=prefix).events_channel(rid), Names(redis_prefix=prefix).stream(rid)
        bad_json = b'{"type":"chunk","request_id":"%s","attempt":0,"seq":1,"text":"BAD","token_ids":[1]}' % rid.encode()
        foreign = schemas.encode_event(chunk("someone-else", 1, text="FOREIGN"))
        return [("both", c[0]),
                ("hook", lambda r: r.publish(channel, b"\xff\x00 not an event")),
                ("hook", lambda r: r.publish(channel, bad_json)),
                ("hook", lambda r: r.publish(channel, foreign)),
                ("hook", lambda r: r.xadd(stream, {schemas.STREAM_FIELD: b"garbage"})),
                ("hook", lambda r: r.xadd(stream, {"wrong-field": b"x"})),
                ("both", c[1]), ("both", c[2]), ("both", done(rid, 3, "".join(x.text for x in c)))]

    prefix = ""
    async with scripted(kafka_bootstrap, redis_url, hostile) as (c, responder):
        prefix = responder.names.redis_prefix
        events = [e async for e in c.stream("hi", timeout=20)]
        assert [e.seq for e in events] == [0, 1, 2, 3]
        assert all(e.request_id == events[0].request_id for e in events)
        assert "BAD" not in events[-1].text and "FOREIGN" not in "".join(e.text for e in events)
        # an observer reading the same stream from the start skips the two bad entries as well
        tailed = [e async for e in c.tail(events[0].request_id, timeout=20)]
        assert [e.seq for e in tailed] == [0, 1, 2, 3]


@pytest.mark.stack
async def test_takeover_restarts_seq_and_text_is_shown_once(kafka_bootstrap: str, redis_url: str) -> None:
    def takeover(job: Job) -> list[tuple[str, schemas.Event]]:
        rid = job.request_id
        first = [("both", chunk(rid, i)) for i in range(2)]  # attempt 1 dies after two chunks
        second = [("both", chunk(rid, i, attempt=2)) for i in range(4)]
        late = [("pub", chunk(rid, 2, attempt=1))]  # a straggler from the dead attempt
        return first + second + late + [("both", done(rid, 4, "".join(WORDS[:4]), attempt=2))]

    async with scripted(kafka_bootstrap, redis_url, takeover) as (c, _):
        assembler = TextAssembler()
        shown = ""
        async for e in c.stream("hi", timeout=20):
            if isinstance(e, Chunk):
                shown += assembler.feed(e)
            else:
                final = e
    assert final.attempt == 2 and shown == final.text == "alpha beta gamma delta "


@pytest.mark.stack
async def test_lost_terminal_event_is_found_under_the_result_key(kafka_bootstrap: str, redis_url: str) -> None:
    def no_done_on_pubsub(job: Job) -> list[tuple[str, schemas.Event]]:
        rid = job.request_id
        return [("both", chunk(rid, 0)), ("both", chunk(rid, 1)), ("stream", chunk(rid, 2)),
                ("result", done(rid, 3, "alpha beta gamma "))]

    async with scripted(kafka_bootstrap, redis_url, no_done_on_pubsub, poll_interval=0.2) as (c, _):
        d = await c.generate("hi", timeout=20)
        assert d.text == "alpha beta gamma " and d.seq == 3


@pytest.mark.stack
async def test_error_event_raises_typed_exception(kafka_bootstrap: str, redis_url: str) -> None:
    def refuse(job: Job) -> list[tuple[str, schemas.Event]]:
        err = ErrorEvent(request_id=job.request_id, attempt=1, seq=0, code="context_length_exceeded",
                         message="prompt of 9000 tokens + max_tokens 256 > 4096")
        return [("result", err), ("pub", err)]

    async with scripted(kafka_bootstrap, redis_url, refuse) as (c, _):
        with pytest.raises(RequestFailed) as info:
            await c.generate("hi", timeout=20)
    assert info.value.code == "context_length_exceeded" and "4096" in info.value.message


@pytest.mark.stack
async def test_msgpack_job_and_events(kafka_bootstrap: str, redis_url: str) -> None:
    async with scripted(kafka_bootstrap, redis_url, straight(3), msgpack=True) as (c, responder):
        d = await c.generate(messages=[{"role": "user", "content": "hi"}], temperature=0.0, timeout=20)
    job, content_type = responder.jobs[0]
    assert content_type == b"application/msgpack" and job.messages is not None and job.temperature == 0.0
    assert d.text == "alpha beta gamma "


@pytest.mark.stack
async def test_timeout_raises_and_cancels_the_job(kafka_bootstrap: str, redis_url: str) -> None:
    topic = await make_topic(kafka_bootstrap)  # nobody consumes it: the job can never finish
    prefix = f"t{uuid.uuid4().hex[:10]}"
    names = Names(redis_prefix=prefix)
    r = aioredis.from_url(redis_url)
    watch = r.pubsub()
    await watch.subscribe(names.cancel_channel)
    try:
        async with Client(kafka_bootstrap, redis_url, prefix=prefix, topic=topic, poll_interval=0.1) as c:
            with pytest.raises(RequestTimeout, match="no terminal event within 0.5 s"):
                await c.generate("hi", request_id="req-timeout-1", timeout=0.5)
        assert 0 < await r.ttl(names.cancelled("req-timeout-1")) <= 3600
        msg = None
        for _ in range(50):
            msg = await watch.get_message(ignore_subscribe_messages=True, timeout=0.1)
            if msg:
                break
        assert msg is not None and schemas.decode_cancel(msg["data"]).request_id == "req-timeout-1"
    finally:
        await watch.aclose()
        await r.aclose()


@pytest.mark.stack
async def test_tail_replays_a_finished_request_and_follows_a_live_one(kafka_bootstrap: str, redis_url: str) -> None:
    async with scripted(kafka_bootstrap, redis_url, straight(3)) as (c, _):
        d = await c.generate("hi", timeout=20)
        replayed = [e async for e in c.tail(d.request_id, timeout=5)]
        assert [e.seq for e in replayed] == [0, 1, 2, 3] and replayed[-1] == d

        # live: tail starts before anything is written, events arrive while it blocks
        names, rid = c.names, "tail-live-1"
        follower = asyncio.create_task(_collect(c.tail(rid, timeout=10)))
        await asyncio.sleep(0.3)
        live_events: list[schemas.Event] = [chunk(rid, 0), chunk(rid, 1), done(rid, 2, "alpha beta ")]
        for e in live_events:
            await c.redis.xadd(names.stream(rid), {"data": schemas.encode_event(e)})
            await asyncio.sleep(0.05)
        events = await follower
        assert [e.seq for e in events] == [0, 1, 2] and isinstance(events[-1], Done)


async def _collect(agen: AsyncIterator[schemas.Event]) -> list[schemas.Event]:
    return [e async for e in agen]


@pytest.mark.stack
async def test_workers_lists_live_heartbeats(kafka_bootstrap: str, redis_url: str) -> None:
    prefix = f"t{uuid.uuid4().hex[:10]}"
    async with Client(kafka_bootstrap, redis_url, prefix=prefix) as c:
        assert await c.workers() == []
        beat = {"model": "tiny-llama", "capacity": 64, "version": "0.1.0", "started_at": 1.0}
        await c.redis.set(f"{prefix}:worker:w-2", msgspec.json.encode(beat), ex=10)
        await c.redis.set(f"{prefix}:worker:w-1", msgspec.json.encode(beat | {"model": "other"}), ex=10)
        found = await c.workers()
    assert [(w.worker_id, w.model, w.capacity) for w in found] == [("w-1", "other", 64), ("w-2", "tiny-llama", 64)]


@pytest.mark.stack
async def test_workers_reads_the_worker_index_and_scans_only_without_one(kafka_bootstrap: str, redis_url: str,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """With the index (`{prefix}:workers`) holding ids, workers() reads it and SCANs the keyspace (for workers
    older than the index) only every unindexed_scan_s, not at each call (the gateway asks every 2 s); an id
    whose heartbeat key is gone (stopped, died) is skipped. With the index empty, a SCAN finds the older
    workers at once."""
    prefix = f"t{uuid.uuid4().hex[:10]}"
    beat = {"model": "m", "capacity": 8, "topic": "t", "group": "g", "models": ["m"]}
    async with Client(kafka_bootstrap, redis_url, prefix=prefix, unindexed_scan_s=3600) as c:
        scans: list[object] = []  # one entry per walk of the keyspace
        real_scan_iter = c.redis.scan_iter

        def counted_scan_iter(*args: Any, **kwargs: Any) -> Any:
            scans.append(kwargs)
            return real_scan_iter(*args, **kwargs)

        monkeypatch.setattr(c.redis, "scan_iter", counted_scan_iter)
        await c.redis.set(f"{prefix}:worker:old", msgspec.json.encode(beat), ex=10)
        assert [w.worker_id for w in await c.workers()] == ["old"]  # no index yet: found by SCAN
        assert len(scans) == 1
        await c.redis.set(f"{prefix}:worker:new", msgspec.json.encode(beat), ex=10)
        await c.redis.zadd(c.names.workers_index, {"new": time.time() * 1000, "died": time.time() * 1000})
        for _ in range(3):
            assert [w.worker_id for w in await c.workers()] == ["new", "old"]  # old: the last SCAN's
        assert len(scans) == 1
        c.unindexed_scan_s = 0
        await c.redis.delete(f"{prefix}:worker:old")
        assert [w.worker_id for w in await c.workers()] == ["new"]
        assert len(scans) == 2


@pytest.mark.stack
def test_sync_client(kafka_bootstrap: str, redis_url: str) -> None:
    # SyncClient runs its own loop, so the responder gets another one, on a thread.
    topic = asyncio.run(make_topic(kafka_bootstrap))
    prefix = f"t{uuid.uuid4().hex[:10]}"
    responder = Responder(kafka_bootstrap, redis_url, topic, Names(redis_prefix=prefix), straight(2))
    stop = threading.Event()
    ready = threading.Event()

    def serve() -> None:
        async def main() -> None:
            joined = asyncio.Event()
            task = asyncio.create_task(responder.run(joined))
            await joined.wait()
            ready.set()
            while not stop.is_set():
                await asyncio.sleep(0.05)
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        asyncio.run(main())

    thread = threading.Thread(target=serve)
    thread.start()
    try:
        assert ready.wait(30)
        with SyncClient(kafka_bootstrap, redis_url, prefix=prefix, topic=topic) as c:
            assert c.generate("hi", timeout=20).text == "alpha beta "
            events = list(c.stream("hi", timeout=20))
            assert [type(e).__name__ for e in events] == ["Chunk", "Chunk", "Done"]
    finally:
        stop.set()
        thread.join(30)


@pytest.mark.stack
async def test_pubsub_connection_killed_mid_run_reconnects_and_requests_complete(kafka_bootstrap: str,
                                                                                 redis_url: str) -> None:
    """The client's pub/sub connection is killed while a request runs; the events published before it is
    back are lost on pub/sub. The running request must resume on the new connection (its gap filled from
    the stream), and requests started after the kill must work. poll_interval is longer than the test's
    timeout, so the result-key poll cannot be what finishes them: only the reconnect can."""
    name = f"stoker-test-{uuid.uuid4().hex[:8]}"  # to find our pub/sub connection among other sessions'
    gate = asyncio.Event()
    kills = 0

    async def kill_then_publish_into_the_gap(r: aioredis.Redis, rid: str, lost: list[Chunk]) -> None:
        nonlocal kills
        ids = [c["id"] for c in await r.client_list(_type="pubsub") if c["name"] == name]
        assert len(ids) == 1, ids
        # One transaction: Redis runs the kill and these writes before it reads anything from the client's
        # new connection, so both chunks certainly reach nobody on pub/sub and only the stream has them.
        async with r.pipeline(transaction=True) as pipe:
            pipe.client_kill_filter(_id=ids[0], _type="pubsub")
            for c in lost:
                data = schemas.encode_event(c)
                pipe.xadd(Names(redis_prefix=prefix).stream(rid), {schemas.STREAM_FIELD: data})
                pipe.publish(Names(redis_prefix=prefix).events_channel(rid), data)
            replies = await pipe.execute()
        assert replies[0] == 1 and replies[2::2] == [0] * len(lost)  # killed; nobody heard the chunks
        kills += 1

    async def until_resubscribed(r: aioredis.Redis, rid: str) -> None:
        channel = Names(redis_prefix=prefix).events_channel(rid)
        for _ in range(200):
            if dict(await r.pubsub_numsub(channel))[channel.encode()] == 1:
                return
            await asyncio.sleep(0.025)
        raise AssertionError(f"the client did not subscribe to {channel} again within 5 s")

    def play(job: Job) -> list[tuple[str, schemas.Event | Hook]]:
        rid = job.request_id
        c = [chunk(rid, i) for i in range(5)]
        text = "".join(x.text for x in c)
        steps: list[tuple[str, schemas.Event | Hook]] = [("both", c[0]), ("both", c[1])]
        if kills == 0:  # the first request: the outage happens while it runs
            steps += [("hook", lambda r: gate.wait()), ("hook", lambda r: kill_then_publish_into_the_gap(r, rid, c[2:4])),
                      ("hook", lambda r: until_resubscribed(r, rid))]
        else:
            steps += [("both", c[2]), ("both", c[3])]
        return steps + [("both", c[4]), ("result", done(rid, 5, text)), ("pub", done(rid, 5, text))]

    topic = await make_topic(kafka_bootstrap)
    prefix = f"t{uuid.uuid4().hex[:10]}"
    responder = Responder(kafka_bootstrap, redis_url, topic, Names(redis_prefix=prefix), play)
    ready = asyncio.Event()
    task = asyncio.create_task(responder.run(ready))
    await asyncio.wait_for(ready.wait(), 30)
    expected = "".join(WORDS)
    try:
        async with Client(kafka_bootstrap, redis_url, prefix=prefix, topic=topic, poll_interval=60.0,
                          redis_options={"client_name": name}) as c:
            running = c.stream("hi", timeout=15)
            first = [await anext(running), await anext(running)]
            assert [e.seq for e in first] == [0, 1]
            gate.set()  # the responder kills our pub/sub connection now
            # started during or right after the outage: waits for the new connection, then runs
            later = asyncio.create_task(c.generate("again", timeout=15))
            rest = [e async for e in running]
            assert [e.seq for e in first + rest] == [0, 1, 2, 3, 4, 5] and kills == 1
            assert "".join(e.text for e in (first + rest)[:-1]) == rest[-1].text == expected
            assert (await later).text == expected
            assert (await c.generate("once more", timeout=15)).text == expected  # after the reconnect
            assert c._dispatcher is not None and c._dispatcher.reconnects == 1
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
