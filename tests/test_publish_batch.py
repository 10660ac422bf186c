"""The publish path of the worker's per-token events: worker.publish_batch packs the publish script's KEYS and
ARGV as each step's events are made, RedisIO.publish sends them (against a real Redis), and Worker._on_step
takes the short path for a running request's next chunk. What the subscriber reads must be what the generic
path (events.chunk / events.finished, then encode_event) would have written."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator

import msgspec
import pytest
import redis.asyncio as aioredis
from stoker.engine import RequestOutput
from stoker.engine.outputs import TokenLogprob as EngineTokenLogprob
from stoker.engine.outputs import TopLogprob as EngineTopLogprob
from stoker.schemas import Chunk, Done, Job, Names, Usage, decode_event, encode_event, event_encoder
from stoker.schemas.names import STREAM_FIELD
from stoker.worker import events
from stoker.worker.config import WorkerConfig
from stoker.worker.fake_engine import FakeEngine
from stoker.worker.publish_batch import CHUNK, FIRST, TERMINAL, PublishBatch, StreamHead
from stoker.worker.redis_io import RedisIO
from stoker.worker.requests import Request, RequestState
from stoker.worker.service import Worker
from worker_harness import stack_endpoints

SHA = "f" * 40
FIXED = b"".join(b"$%d\r\n%s\r\n" % (len(v), v) for v in (b"100", b"60", b"w1", b"9000", b"86400"))


def _resp_array(data: bytes) -> list[bytes]:
    """A RESP array of bulk strings (what a command is on the wire), read back strictly."""
    assert data.startswith(b"*")
    end = data.index(b"\r\n")
    count, pos, items = int(data[1:end]), end + 2, []
    for _ in range(count):
        assert data[pos:pos + 1] == b"$"
        end = data.index(b"\r\n", pos)
        size = int(data[pos + 1:end])
        items.append(data[end + 2:end + 2 + size])
        assert data[end + 2 + size:end + 4 + size] == b"\r\n"
        pos = end + 4 + size
    assert pos == len(data), "bytes after the command"
    return items


def _head(rid: str, attempt: int, prefix: str = "p") -> StreamHead:
    keys = [f"{prefix}:{kind}:{rid}" for kind in ("events", "stream", "claim", "attempts", "result")]
    return StreamHead.of(rid, attempt, keys)


# -- packing (no Redis) ---------------------------------------------------------------------------------------
def test_the_command_is_the_evalsha_the_script_reads() -> None:
    a, b, c = _head("a", 3), _head("b", 1), _head("c", 1)
    batch = PublishBatch()
    batch.chunk(a, b'{"x":1}')
    batch.add(b, FIRST, [b"b0"])
    batch.add(b, CHUNK + TERMINAL, [b"b1", b"b-done"])
    batch.add(c, TERMINAL, [b"c-error"], unclaimed=True)
    items = _resp_array(batch.command(SHA, FIXED))
    assert items[:3] == [b"EVALSHA", SHA.encode(), b"20"]  # 4 groups x 5 keys
    keys = items[3:23]
    assert keys[:5] == [b"p:events:a", b"p:stream:a", b"p:claim:a", b"p:attempts:a", b"p:result:a"]
    assert keys[5:10] == keys[10:15] == [b"p:events:b", b"p:stream:b", b"p:claim:b", b"p:attempts:b", b"p:result:b"]
    assert keys[15:] == [b"p:events:c", b"p:stream:c", b"p:claim:c", b"p:attempts:c", b"p:result:c"]
    assert items[23:28] == [b"100", b"60", b"w1", b"9000", b"86400"]
    assert items[28:] == [b"c 3 0", b'{"x":1}', b"c 1 1", b"b0", b"c 1 02", b"b1", b"b-done", b"u 1 2", b"c-error"]
    assert batch.groups == [("a", 3), ("b", 1), ("b", 1), ("c", 1)]
    assert (len(batch), batch.terminals) == (5, 2)


def test_extend_is_the_same_command_as_one_batch_built_in_order() -> None:
    a, b = _head("a", 1), _head("b", 2)
    first, second, whole = PublishBatch(), PublishBatch(), PublishBatch()
    for part in (first, whole):
        part.chunk(a, b"a1")
        part.add(b, FIRST, [b"b0"])
    for part in (second, whole):
        part.add(a, TERMINAL, [b"a-done"])
    first.extend(second)
    assert first.command(SHA, FIXED) == whole.command(SHA, FIXED)
    assert (first.groups, len(first), first.terminals) == (whole.groups, 3, 1)


def test_a_group_needs_one_known_kind_per_payload() -> None:
    batch = PublishBatch()
    with pytest.raises(ValueError, match="one of 0, 1, 2"):
        batch.add(_head("a", 1), CHUNK + TERMINAL, [b"only one"])
    with pytest.raises(ValueError, match="one of 0, 1, 2"):
        batch.add(_head("a", 1), "3", [b"x"])
    with pytest.raises(ValueError, match="publish keys are 5"):
        StreamHead.of("a", 1, ["k1", "k2"])
    assert batch.groups == [] and batch.command(SHA, FIXED).startswith(b"*8\r\n")


def test_event_encoder_writes_encode_events_bytes() -> None:
    chunk = Chunk(request_id="r", attempt=2, seq=5, text="é\n\"x\"", token_ids=[1, 2])
    done = Done(request_id="r", attempt=2, seq=6, finish_reason="length", text="t",
                usage=Usage(prompt_tokens=1, completion_tokens=2, cached_tokens=0),
                timings=events.Timings(queue_ms=1.0, ttft_ms=2.0, total_ms=3.0), model="m", worker="w")
    for msgpack in (False, True):
        for event in (chunk, done):
            assert event_encoder(msgpack)(event) == encode_event(event, msgpack)


# -- against Redis --------------------------------------------------------------------------------------------
@pytest.fixture(name="rio")
async def rio_fixture(request: pytest.FixtureRequest) -> AsyncIterator[RedisIO]:
    _, redis_url = stack_endpoints(request)
    client = aioredis.Redis.from_url(redis_url)
    names = Names(redis_prefix=f"pb{uuid.uuid4().hex[:10]}")
    yield RedisIO(client, names, token="w1", stream_maxlen=100, ttl_s=60, claim_ttl_ms=9000, attempts_ttl_s=600)
    keys = [key async for key in client.scan_iter(f"{names.redis_prefix}:*")]
    if keys:
        await client.delete(*keys)
    await client.aclose()


async def _stream(rio: RedisIO, rid: str) -> list[bytes]:
    return [fields[STREAM_FIELD.encode()] for _, fields in await rio.client.xrange(rio.names.stream(rid))]


async def test_coalesced_steps_write_each_group_in_order_and_report_lost_claims(rio: RedisIO) -> None:
    client, names = rio.client, rio.names
    for rid in ("a", "b"):
        await client.set(names.claim(rid), "w1 1", px=9000)
        await client.set(rio.attempts_key(rid), 1)
    await client.set(names.claim("c"), "w2 1", px=9000)  # another worker's: nothing of ours may land
    pubsub = client.pubsub()
    await pubsub.subscribe(names.events_channel("a"))
    heads = {rid: rio.head(rid, 1) for rid in "abc"}
    step1, step2 = PublishBatch(), PublishBatch()
    step1.add(heads["a"], FIRST, [b"a0"])
    step1.chunk(heads["b"], b"b5")
    step1.chunk(heads["c"], b"c5")
    step2.chunk(heads["a"], b"a1")
    step2.add(heads["b"], CHUNK + TERMINAL, [b"b6", b"b-done"])
    step1.extend(step2)
    assert await rio.publish(step1) == {("c", 1)}
    assert await _stream(rio, "a") == [b"a0", b"a1"]
    assert await _stream(rio, "b") == [b"b5", b"b6", b"b-done"]
    assert await _stream(rio, "c") == [] and not await client.exists(names.result("c"))
    assert 0 < await client.ttl(names.stream("a")) <= 60  # the first event set it
    assert await client.get(names.result("b")) == b"b-done"
    assert not await client.exists(names.claim("b"))  # released by its terminal event
    assert await client.get(names.claim("a")) == b"w1 1"
    seen: list[bytes] = []
    deadline = asyncio.get_running_loop().time() + 5
    while len(seen) < 2 and asyncio.get_running_loop().time() < deadline:
        msg = await pubsub.get_message(ignore_subscribe_messages=True, timeout=0.5)  # None: the confirmation too
        if msg is not None:
            seen.append(msg["data"])
    assert seen == [b"a0", b"a1"]
    await pubsub.aclose()


async def test_an_unclaimed_terminal_lands_only_where_no_result_or_claim_stands(rio: RedisIO) -> None:
    client, names = rio.client, rio.names
    await client.set(names.result("done"), b"earlier")
    await client.set(names.claim("held"), "w2 1", px=9000)
    batch = PublishBatch()
    for rid in ("done", "held", "free"):
        batch.add(rio.head(rid, 1), TERMINAL, [rid.encode()], unclaimed=True)
    assert await rio.publish(batch) == set()  # mode 'u' reports nothing lost: it claims nothing
    assert await client.get(names.result("done")) == b"earlier"
    assert not await client.exists(names.result("held"))
    assert await client.get(names.result("free")) == b"free"


# -- the worker's step path -----------------------------------------------------------------------------------
def _running(worker: Worker, rid: str, *, msgpack: bool = False, tenant: str | None = None) -> Request:
    job = Job(request_id=rid, prompt="x", max_tokens=100, tenant=tenant)
    req = Request(job, msgpack, 1_000.0, [], (None, None, []), attempt=1, in_engine=True)  # as _submit leaves it
    worker.requests.put(req, RequestState.RUNNING)
    return req


def _out(rid: str, ids: list[int], text: str, finished: bool = False, **kw: object) -> RequestOutput:
    base: dict[str, object] = dict(request_id=rid, new_token_ids=ids, text_delta=text, logprobs=None,
                                   finished=finished, finish_reason="length" if finished else None,
                                   prompt_tokens=4, completion_tokens=len(ids), cached_tokens=0,
                                   first_scheduled_ms=None)
    return RequestOutput(**(base | kw))  # type: ignore[arg-type]


async def test_on_step_writes_what_the_generic_path_would(rio: RedisIO) -> None:
    worker = Worker(WorkerConfig(fake_engine=True, metrics_port=-1, prefix=rio.names.redis_prefix),
                    FakeEngine())
    worker.rio = rio
    worker.driver = type("Driver", (), {"fatal": None})()  # type: ignore[assignment]  # _on_step reads .fatal
    reqs = {"j": _running(worker, "j", tenant="acme"), "m": _running(worker, "m", msgpack=True),
            "q": _running(worker, "q", tenant="acme")}
    for rid in reqs:
        await rio.client.set(rio.names.claim(rid), "w1 1", px=9000)
    logprob = [EngineTokenLogprob(7, -0.5, [EngineTopLogprob(7, -0.5, "a"), EngineTopLogprob(8, -1.5, "b")], "a")]
    steps = [
        [_out("j", [1], " a", first_scheduled_ms=1_001.0), _out("m", [2], " é"), _out("q", [], "")],
        [_out("j", [3], " b"), _out("m", [4], "", logprobs=logprob), _out("q", [9], " c", finished=True)],
        [_out("j", [5], " d", finished=True), _out("m", [], "", finished=True)],
    ]
    expected: dict[str, list[bytes]] = {rid: [] for rid in reqs}
    mirror = {rid: Request(r.job, r.msgpack, r.record_ms, [], r.raw, attempt=1) for rid, r in reqs.items()}
    for number, outputs in enumerate(steps):
        step_ms = 2_000.0 + 100 * number
        for out in outputs:  # the generic path, on a copy of each request's state
            req = mirror[out.request_id]
            if out.new_token_ids or out.text_delta:
                req.first_token_ms = req.first_token_ms or step_ms
                req.text.append(out.text_delta)
                expected[out.request_id].append(encode_event(events.chunk(req, out), req.msgpack))
                req.seq += 1
            if out.finished:
                req.first_scheduled_ms = 1_001.0 if out.request_id == "j" else None
                terminal = events.finished(req, out, step_ms, "fake", worker.cfg.worker_id)
                expected[out.request_id].append(encode_event(terminal, req.msgpack))
        worker._on_step(outputs, None, step_ms)
        if number == 0:  # each first event set its stream's TTL (later ones renew it only at the end)
            assert await rio.publish(worker._outbox.get_nowait().out) == set()
            assert [await rio.client.ttl(rio.names.stream(rid)) > 0 for rid in "jmq"] == [True, True, False]
    batch = PublishBatch()
    while not worker._outbox.empty():
        batch.extend(worker._outbox.get_nowait().out)
    assert await rio.publish(batch) == set()
    for rid in reqs:
        assert await _stream(rio, rid) == expected[rid], rid
        assert await rio.client.get(rio.names.result(rid)) == expected[rid][-1]
        assert 0 < await rio.client.ttl(rio.names.stream(rid)) <= rio.ttl_s
    assert isinstance(decode_event(expected["m"][1]), Chunk) and expected["m"][0][:1] != b"{"  # MessagePack
    assert msgspec.json.decode(expected["j"][0])["seq"] == 0
    assert {r.state for r in reqs.values()} == {RequestState.FINISHING}
    sample = worker.metrics.registry.get_sample_value
    assert sample("stoker_generation_tokens_total", {"tenant": "acme"}) == 4  # j: 1, 3, 5; q: 9
    assert sample("stoker_generation_tokens_total", {"tenant": ""}) == 2  # m, no tenant: 2, 4
    assert sample("stoker_prompt_tokens_total", {"tenant": "acme"}) == 4  # j's first scheduled step only
    # inter-token times: j at steps 1 and 2, m at step 1 (each after a chunk one step earlier), 0.1 s each
    assert sample("stoker_inter_token_latency_seconds_count") == 3
    assert sample("stoker_inter_token_latency_seconds_sum") == pytest.approx(0.3)
    assert sample("stoker_inter_token_latency_seconds_bucket", {"le": "0.16"}) == 3
    assert sample("stoker_inter_token_latency_seconds_bucket", {"le": "0.08"}) == 0


async def test_the_answer_to_a_rejected_record_goes_unclaimed(rio: RedisIO) -> None:
    """_fail(unless_ended=True) (a bad record, an unknown model) claims nothing: beside another worker's live
    claim of the id it writes nothing and reports no lost claim (a claimed group would be 'lost' and parked)."""
    worker = Worker(WorkerConfig(fake_engine=True, metrics_port=-1, prefix=rio.names.redis_prefix), FakeEngine())
    worker.rio = rio
    await rio.client.set(rio.names.claim("taken"), "w2 1", px=9000)
    for rid in ("taken", "free"):
        req = Request(Job(request_id=rid, prompt_token_ids=[0]), False, 1_000.0, [], (None, None, []), attempt=1)
        worker._fail(req, "invalid_job", "bad", unless_ended=True)
    batch = PublishBatch()
    while not worker._outbox.empty():
        batch.extend(worker._outbox.get_nowait().out)
    assert await rio.publish(batch) == set()
    assert not await rio.client.exists(rio.names.result("taken"))
    assert decode_event(await rio.client.get(rio.names.result("free"))).code == "invalid_job"  # type: ignore[union-attr]
    assert await rio.client.get(rio.names.claim("taken")) == b"w2 1" and not await rio.client.exists(rio.names.claim("free"))
