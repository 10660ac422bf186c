"""The worker against a real Kafka broker and Redis, with the stand-in engine (fast, deterministic).

Each test has its own topic, group and Redis prefix (tests/worker_harness.py). Workers run in-process
(asyncio tasks) except where a process must die (SIGKILL) or drain (SIGTERM)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest
import redis.asyncio as aioredis
import worker_harness
from stoker.devstack import stack
from stoker.schemas import DLQ_HEADERS, Cancel, Chunk, Done, Error, encode_cancel
from stoker.worker.config import WorkerConfig
from stoker.worker.fake_engine import FAIL_MARKER, FakeEngine
from stoker.worker.publish_batch import PublishBatch
from stoker.worker.service import Worker
from worker_harness import (
    Space,
    check_sequence,
    committed_offsets,
    create_topics,
    dead_letters,
    expected_text,
    job,
    make_space,
    produce,
    running_worker,
    scrape,
    stack_fixtures,
    start_worker_process,
    stop_process,
    wait_results,
)

pytestmark = [pytest.mark.stack, pytest.mark.timeout(120)]


space, r = stack_fixtures()


async def test_200_concurrent_jobs_all_finish_in_order_and_get_committed(space, r):
    jobs = [job(f"req-{i}", max_tokens=1 + i % 37, priority=i % 3, temperature=0.5 * (i % 2), seed=i,
                tenant=f"t{i % 4}", metadata={"n": i}) for i in range(200)]
    async with running_worker(space, max_num_seqs=64):
        await produce(space.bootstrap, space.names.jobs_topic, jobs, msgpack_every=5)
        results = await wait_results(r, space.names, [j["request_id"] for j in jobs], timeout=60)
        for i, j in enumerate(jobs):
            outcome = results[j["request_id"]]
            check_sequence(outcome)
            done = outcome.terminal
            assert isinstance(done, Done) and done.attempt == 1 and done.finish_reason == "length"
            assert done.text == expected_text(j["request_id"], j["max_tokens"])
            assert done.usage.completion_tokens == j["max_tokens"] and done.usage.prompt_tokens == 4
            assert done.tenant == f"t{i % 4}" and done.metadata == {"n": i} and done.model == "fake"
            assert 0 <= done.timings.queue_ms <= done.timings.ttft_ms <= done.timings.total_ms
        # MessagePack in, MessagePack out (every 5th job), on the result key too.
        raw = await r.get(space.names.result("req-5"))
        assert isinstance(msgspec.msgpack.decode(raw), dict)
        assert json.loads(await r.get(space.names.result("req-1")))["type"] == "done"
        assert 0 < await r.ttl(space.names.stream("req-1")) <= 3600
        assert 0 < await r.ttl(space.names.result("req-1")) <= 3600
        assert await r.exists(space.names.claim("req-1")) == 0  # released at the end
        for _ in range(50):
            committed, end = await committed_offsets(space.bootstrap, space.group, space.names.jobs_topic)
            if committed == end:
                break
            await asyncio.sleep(0.1)
        assert (committed, end) == (200, 200)


async def test_cancel_mid_stream_and_before_read(space, r):
    names = space.names
    async with running_worker(space, engine=FakeEngine(step_delay_s=0.01)):
        pubsub = r.pubsub()
        await pubsub.subscribe(names.events_channel("long"))
        await produce(space.bootstrap, names.jobs_topic, [job("long", max_tokens=2000)])
        first = None
        while first is None:
            msg = await pubsub.get_message(ignore_subscribe_messages=True, timeout=5)
            first = msg
        await r.publish(names.cancel_channel, encode_cancel(Cancel(request_id="long")))
        # Cancelled before any worker reads it: the key makes it stick.
        await r.set(names.cancelled("early"), b"1", ex=60)
        await produce(space.bootstrap, names.jobs_topic, [job("early", max_tokens=50)])
        results = await wait_results(r, names, ["long", "early"], timeout=30)
        await pubsub.aclose()
    long, early = results["long"], results["early"]
    check_sequence(long)
    assert isinstance(long.terminal, Done) and long.terminal.finish_reason == "cancelled"
    assert 0 < long.terminal.usage.completion_tokens < 2000
    assert isinstance(early.terminal, Done) and early.terminal.finish_reason == "cancelled"
    assert early.events == [early.terminal] and early.terminal.text == ""  # never ran


async def test_deadlines_while_running_and_while_queued(space, r):
    now = time.time() * 1000
    async with running_worker(space, engine=FakeEngine(step_delay_s=0.01)):
        await produce(space.bootstrap, space.names.jobs_topic, [
            job("runs-out", max_tokens=3000, deadline_ms=int(now + 1500)),
            job("already-late", max_tokens=10, deadline_ms=int(now - 1000)),
        ])
        results = await wait_results(r, space.names, ["runs-out", "already-late"], timeout=30)
    runs_out, late = results["runs-out"].terminal, results["already-late"].terminal
    assert isinstance(runs_out, Done) and runs_out.finish_reason == "deadline" and runs_out.usage.completion_tokens > 0
    assert isinstance(late, Done) and late.finish_reason == "deadline" and late.usage.completion_tokens == 0
    assert results["already-late"].events == [late]


async def test_priority_orders_jobs_the_worker_holds(space, r):
    engine = FakeEngine(max_num_seqs=1, step_delay_s=0.005)
    async with running_worker(space, engine=engine, max_num_seqs=1, max_waiting=16):
        # One partition would make Kafka order them too; these land in one poll, so the engine picks.
        jobs = [job("blocker", max_tokens=60)] + [job(f"p{p}", max_tokens=3, priority=p) for p in (5, 3, 9, -2, 0)]
        await produce(space.bootstrap, space.names.jobs_topic, jobs)
        results = await wait_results(r, space.names, [j["request_id"] for j in jobs], timeout=30)
    # Produced together, so total_ms (record time -> done) orders them by when they ran.
    total_ms = {rid: o.terminal.timings.total_ms for rid, o in results.items() if isinstance(o.terminal, Done)}
    by_end = sorted((rid for rid in total_ms if rid != "blocker"), key=total_ms.__getitem__)
    assert by_end == ["p-2", "p0", "p3", "p5", "p9"]


async def test_malformed_jobs_go_to_the_dlq_with_headers_and_an_error_event(space, r):
    names = space.names
    async with running_worker(space):
        await produce(space.bootstrap, names.jobs_topic, [
            (b"bad-1", b'{"type": "job", "request_id": "bad-1", "max_tokens": 0, "prompt": "x"}', [("trace", b"t1")]),
            (b"bad-2", b"\x00 not json", []),
            (None, b"[1, 2]", []),
            job("too-long", prompt="a " * 10, max_tokens=4090),  # valid message the model can't serve
            job("wrong-model", model="other"),
            job("fails", prompt=f"x {FAIL_MARKER}"),
        ])
        results = await wait_results(r, names, ["bad-1", "bad-2", "too-long", "wrong-model", "fails"], timeout=30)
    codes = {rid: (o.terminal.code if isinstance(o.terminal, Error) else None) for rid, o in results.items()}
    assert codes == {"bad-1": "invalid_job", "bad-2": "invalid_job", "too-long": "context_length_exceeded",
                     "wrong-model": "unknown_model", "fails": "internal"}
    bad1_error = results["bad-1"].terminal
    assert isinstance(bad1_error, Error) and "max_tokens" in bad1_error.message
    records = await dead_letters(space.bootstrap, names.dlq_topic)
    # Only the malformed messages are dead letters; engine refusals are answered and committed.
    assert sorted(rec.value for rec in records) == sorted(
        [b'{"type": "job", "request_id": "bad-1", "max_tokens": 0, "prompt": "x"}', b"\x00 not json", b"[1, 2]"])
    bad1 = next(rec for rec in records if rec.key == b"bad-1")
    headers = dict(bad1.headers)
    assert headers["trace"] == b"t1" and set(DLQ_HEADERS) <= set(headers)
    assert headers["stoker-error-code"] == b"invalid_job" and int(headers["stoker-failed-at"]) > 0


async def test_redelivered_job_with_a_result_republishes_nothing(space, r):
    names = space.names
    await r.set(names.result("old"), b'{"type":"done"}', ex=60)
    async with running_worker(space):
        await produce(space.bootstrap, names.jobs_topic, [job("old"), job("new", max_tokens=2)])
        await wait_results(r, names, ["new"], timeout=30)
        for _ in range(50):
            committed, end = await committed_offsets(space.bootstrap, space.group, names.jobs_topic)
            if committed == end == 2:
                break
            await asyncio.sleep(0.1)
    assert (committed, end) == (2, 2)
    assert await r.get(names.result("old")) == b'{"type":"done"}'
    assert await r.exists(names.stream("old")) == 0


async def test_poison_job_goes_to_the_dlq_and_never_runs(space, r):
    names = space.names
    await r.set(f"{names.redis_prefix}:attempts:doomed", 3)
    async with running_worker(space):
        await produce(space.bootstrap, names.jobs_topic, [job("doomed")])
        results = await wait_results(r, names, ["doomed"], timeout=30)
    err = results["doomed"].terminal
    assert isinstance(err, Error) and err.code == "poison_job" and err.attempt == 4
    assert results["doomed"].events == [err]


async def test_job_held_by_another_worker_is_parked_then_taken_over(space, r):
    names = space.names
    await r.set(names.claim("held"), b"someone-else", px=1500)
    await r.set(f"{names.redis_prefix}:attempts:held", 1)
    async with running_worker(space):
        await produce(space.bootstrap, names.jobs_topic, [job("held", max_tokens=3), job("free", max_tokens=3)])
        free = await wait_results(r, names, ["free"], timeout=10)  # not held up by the parked one
        assert await r.exists(names.result("held")) == 0
        held = await wait_results(r, names, ["held"], timeout=20)
    assert free["free"].terminal.attempt == 1
    done = held["held"].terminal
    assert isinstance(done, Done) and done.attempt == 2 and done.finish_reason == "length"


async def test_two_workers_split_the_partitions(space, r):
    jobs = [job(f"s{i}", max_tokens=20) for i in range(120)]
    async with running_worker(space) as w1, running_worker(space) as w2:
        for _ in range(100):  # both joined: the group rebalanced to two members
            if w1._assigned and w2._assigned:
                break
            await asyncio.sleep(0.1)
        assert w1._assigned and w2._assigned and not (w1._assigned & w2._assigned)
        await produce(space.bootstrap, space.names.jobs_topic, jobs)
        results = await wait_results(r, space.names, [j["request_id"] for j in jobs], timeout=60)
    workers = {o.terminal.worker for o in results.values() if isinstance(o.terminal, Done)}
    assert workers == {w1.cfg.worker_id, w2.cfg.worker_id}
    for o in results.values():
        check_sequence(o)
        assert o.terminal.attempt == 1


async def test_the_topics_a_session_makes_are_recorded_and_deleted(space):
    """conftest deletes, at the session's end, every topic made through worker_harness.create_topics (a
    long-lived broker ran out of heap under ~9,600 test partitions): they are recorded and the deletion takes
    exactly the names given, leaving others (this test's own space) in place."""
    tag = uuid.uuid4().hex[:8]
    mine = {f"cleanup.{tag}.a": 2, f"cleanup.{tag}.b": 1}
    await create_topics(space.bootstrap, mine)
    assert set(mine) <= worker_harness.CREATED_TOPICS and space.names.jobs_topic in worker_harness.CREATED_TOPICS
    assert await worker_harness.delete_created_topics(space.bootstrap, set(mine)) == 2
    assert not set(mine) & worker_harness.CREATED_TOPICS
    for _ in range(100):  # the broker deletes in the background
        left = set(stack.kafka_topics(space.bootstrap) or {})
        if not set(mine) & left:
            break
        await asyncio.sleep(0.1)
    assert not set(mine) & left and space.names.jobs_topic in left


async def test_metrics_health_and_heartbeat(space, r):
    async with running_worker(space, metrics_port=0) as w:
        await produce(space.bootstrap, space.names.jobs_topic, [job("m1", max_tokens=4)])
        await wait_results(r, space.names, ["m1"], timeout=20)
        assert w.health is not None
        port = w.health.port

        def get(path: str) -> tuple[int, str]:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as resp:
                    return resp.status, resp.read().decode()
            except urllib.error.HTTPError as exc:
                return exc.code, ""

        status, body = await asyncio.to_thread(get, "/metrics")
        assert status == 200
        assert 'stoker_requests_finished_total{reason="length",tenant=""} 1.0' in body
        assert "stoker_generation_tokens_total" in body and "stoker_time_to_first_token_seconds_count 1.0" in body
        assert (await asyncio.to_thread(get, "/readyz"))[0] == 200
        assert (await asyncio.to_thread(get, "/healthz"))[0] == 200
        beat = json.loads(await r.get(f"{space.names.redis_prefix}:worker:{w.cfg.worker_id}"))
        assert beat["model"] == "fake" and beat["capacity"] == 256


async def test_sigkill_mid_stream_then_a_fresh_worker_finishes_everything(space, r, tmp_path):
    names = space.names
    ids = [f"k{i}" for i in range(12)]
    env = space.worker_env(STOKER_FAKE_STEP_DELAY_S="0.02")
    proc = start_worker_process(env, log_path=tmp_path / "w1.log")
    try:
        await produce(space.bootstrap, names.jobs_topic, [job(i, max_tokens=150) for i in ids])
        for _ in range(300):  # wait until every job streams
            if all(await asyncio.gather(*(r.exists(names.stream(i)) for i in ids))):
                break
            await asyncio.sleep(0.05)
        proc.kill()
        proc.wait(10)
        assert not any(await asyncio.gather(*(r.exists(names.result(i)) for i in ids)))
    finally:
        stop_process(proc, signal.SIGKILL)
    proc2 = start_worker_process(env, log_path=tmp_path / "w2.log")
    try:
        results = await wait_results(r, names, ids, timeout=60)
    finally:
        assert stop_process(proc2) == 0  # SIGTERM drains and exits 0
    for rid, o in results.items():
        check_sequence(o)
        assert isinstance(o.terminal, Done) and o.terminal.attempt == 2  # the killed start counted once
        assert o.terminal.text == expected_text(rid, 150)
        assert {e.attempt for e in o.events} == {1, 2}
    committed, end = await committed_offsets(space.bootstrap, space.group, names.jobs_topic)
    assert committed == end == len(ids)


async def test_sigterm_while_redis_is_unreachable_at_startup_exits_promptly(space, tmp_path):
    """A worker that cannot reach Redis at startup retries; SIGTERM must still stop it (cleanly, exit 0)."""
    env = space.worker_env(REDIS_URL=f"redis://127.0.0.1:{_free_port()}/0")  # nothing listens there
    log_path = tmp_path / "w.log"
    proc = start_worker_process(env, log_path=log_path)
    try:
        for _ in range(400):  # until it is retrying Redis (Kafka joined, engine built)
            if "event=redis_retry" in log_path.read_text():
                break
            assert proc.poll() is None, log_path.read_text()[-2000:]
            await asyncio.sleep(0.05)
        else:
            pytest.fail("the worker never retried Redis: " + log_path.read_text()[-2000:])
        started = time.monotonic()
        assert stop_process(proc, timeout=15) == 0, log_path.read_text()[-2000:]
        assert time.monotonic() - started < 12
    finally:
        stop_process(proc, signal.SIGKILL)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_redis(port: int, data_dir: object) -> subprocess.Popen[bytes]:
    # appendfsync always: what the worker stored before the outage survives the restart (as in production)
    proc = subprocess.Popen(["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--dir", str(data_dir),
                             "--save", "", "--appendonly", "yes", "--appendfsync", "always"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.2):
            return proc
        time.sleep(0.05)
    raise RuntimeError("redis-server did not start")


async def test_redis_outage_holds_commits_and_loses_nothing(request, tmp_path):
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed")
    space = await make_space(request)
    port = _free_port()
    space.redis_url = f"redis://127.0.0.1:{port}/0"
    redis_proc = _start_redis(port, tmp_path)
    r = aioredis.Redis.from_url(space.redis_url)
    ids = [f"o{i}" for i in range(16)]
    try:
        async with running_worker(space, engine=FakeEngine(step_delay_s=0.01)) as worker:
            await produce(space.bootstrap, space.names.jobs_topic, [job(i, max_tokens=120) for i in ids])
            while not all([await r.exists(space.names.stream(i)) for i in ids]):
                await asyncio.sleep(0.05)
            redis_proc.kill()
            redis_proc.wait()
            await asyncio.sleep(3)
            committed, _ = await committed_offsets(space.bootstrap, space.group, space.names.jobs_topic)
            assert committed == 0  # nothing stored, nothing committed
            redis_proc = _start_redis(port, tmp_path)
            await r.aclose()  # the test's own connections died with the server
            r = aioredis.Redis.from_url(space.redis_url)
            results = await wait_results(r, space.names, ids, timeout=60)
            assert worker.metrics.redis_retries.labels("publish")._value.get() > 0  # noqa: SLF001
    finally:
        await r.aclose()
        redis_proc.kill()
        redis_proc.wait()
    for rid, o in results.items():
        # A pipeline cut mid-reply is sent again: subscribers drop the duplicate seqs, as the contract says.
        seen: dict[int, Chunk | Done | Error] = {}
        for e in o.events:
            assert e.attempt == 1
            if e.seq in seen:
                assert seen[e.seq] == e  # a duplicate is the same event, never a different one
            seen.setdefault(e.seq, e)
        assert sorted(seen) == list(range(len(seen)))
        assert isinstance(o.terminal, Done) and o.terminal.text == expected_text(rid, 120)
        assert "".join(e.text for e in seen.values() if isinstance(e, Chunk)) == o.terminal.text
    for _ in range(50):
        committed, end = await committed_offsets(space.bootstrap, space.group, space.names.jobs_topic)
        if committed == end:
            break
        await asyncio.sleep(0.1)
    assert committed == end == len(ids)


@pytest.fixture(scope="module")
def private_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[stack.StackConfig]:
    """A Kafka broker (and Redis) of this module's own: ports and data dir apart from the session stack,
    so restarting its broker disturbs no other test."""
    if shutil.which("java") is None or shutil.which("redis-server") is None:
        pytest.skip("a private stack needs java and redis-server")
    cfg = stack.StackConfig(kafka_port=_free_port(), controller_port=_free_port(), redis_port=_free_port(),
                            stack_dir=tmp_path_factory.mktemp("private-stack"))
    try:
        stack.up(cfg)
        yield cfg
    finally:
        stack.down(cfg, wipe=True)


def _kill_broker(cfg: stack.StackConfig) -> None:
    pid = stack.status(cfg).kafka.pid
    assert pid is not None, "the private broker is not running"
    os.kill(pid, signal.SIGKILL)  # a crash: no goodbye to the clients (a clean stop takes ~10 s here)
    while Path(f"/proc/{pid}").exists() and Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z":
        time.sleep(0.05)


async def wait_committed(space: Space, expected: int, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while True:
        committed, end = await committed_offsets(space.bootstrap, space.group, space.names.jobs_topic)
        if committed == end == expected or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.2)
    assert (committed, end) == (expected, expected)


@pytest.mark.timeout(240)
async def test_broker_restart_mid_run_every_job_done_once_and_committed(private_stack):
    cfg = private_stack
    space = Space(cfg.kafka_bootstrap, cfg.redis_url)
    names = space.names
    await create_topics(space.bootstrap, {names.jobs_topic: 4, names.dlq_topic: 1})
    r = aioredis.Redis.from_url(space.redis_url)
    before = [f"rb{i}" for i in range(24)]
    after = [f"ra{i}" for i in range(8)]
    tokens = {rid: 50 + 25 * (i % 12) for i, rid in enumerate(before + after)}  # 0.5-3.3 s of steps each
    try:
        engine = FakeEngine(step_delay_s=0.01, max_num_seqs=4)  # ~11 s of work in all
        async with running_worker(space, engine=engine, max_num_seqs=4) as worker:
            await produce(space.bootstrap, names.jobs_topic, [job(i, max_tokens=tokens[i]) for i in before])
            while not await r.exists(names.result(before[0]), names.result(before[1])):
                await asyncio.sleep(0.05)  # some jobs finished (and committed), the rest are running or queued
            await asyncio.to_thread(_kill_broker, cfg)
            assert not all([await r.exists(names.result(i)) for i in before]), "everything finished too soon"
            # Work goes on without the broker: every result lands, every commit fails.
            await wait_results(r, names, before, timeout=60)
            await asyncio.to_thread(stack.up, cfg)  # the same data dir: a restart, not a new cluster
            # Nothing finishes from here on, so only the worker retrying its failed commits moves them.
            await wait_committed(space, len(before))
            await produce(space.bootstrap, names.jobs_topic, [job(i, max_tokens=tokens[i]) for i in after])
            results = await wait_results(r, names, before + after, timeout=60)
            await wait_committed(space, len(before) + len(after))
            assert worker._healthy(), "a worker task died during the outage"  # noqa: SLF001
    finally:
        await r.aclose()
    for rid, outcome in results.items():
        check_sequence(outcome)
        # Exactly one terminal event in the whole stream, from the one and only attempt: no job ran twice.
        assert sum(isinstance(e, Done | Error) for e in outcome.events) == 1
        assert {e.attempt for e in outcome.events} == {1}
        assert isinstance(outcome.terminal, Done) and outcome.terminal.text == expected_text(rid, tokens[rid])


# -- correctness review: paths where a job, a commit or a terminal event went wrong ----------------------
async def _wait_all_committed(space: Space, expected: int, timeout: float = 20) -> tuple[int, int]:
    deadline = time.monotonic() + timeout
    while True:
        committed, end = await committed_offsets(space.bootstrap, space.group, space.names.jobs_topic)
        if (committed == end == expected) or time.monotonic() > deadline:
            return committed, end
        await asyncio.sleep(0.2)


async def _terminals(r: aioredis.Redis, names: object, rid: str) -> list[Done | Error]:
    from stoker.schemas import decode_event
    entries = await r.xrange(names.stream(rid))  # type: ignore[attr-defined]
    return [e for e in (decode_event(f[b"data"]) for _, f in entries) if isinstance(e, Done | Error)]


async def test_malformed_record_with_a_running_requests_id_leaves_it_running_and_committed(space, r):
    """A bad record keyed with the id of a job running here goes to the DLQ; the running job still ends with
    its own single terminal event and both records get committed (before: the running job was dropped from
    the worker's books, its record never finished and the partition's commits stuck for good)."""
    names = space.names
    async with running_worker(space, engine=FakeEngine(step_delay_s=0.02)):
        await produce(space.bootstrap, names.jobs_topic, [job("twin", max_tokens=60)])
        for _ in range(300):
            if await r.exists(names.stream("twin")):
                break
            await asyncio.sleep(0.02)
        await produce(space.bootstrap, names.jobs_topic, [(b"twin", b"\x00 not json", [])])
        results = await wait_results(r, names, ["twin"], timeout=30)
        committed, end = await _wait_all_committed(space, 2)
        terminals = await _terminals(r, names, "twin")
    check_sequence(results["twin"])
    done = results["twin"].terminal
    assert isinstance(done, Done) and done.finish_reason == "length" and done.usage.completion_tokens == 60
    assert terminals == [done]
    assert (committed, end) == (2, 2)


async def test_duplicate_record_read_while_the_terminal_event_is_unpublished_does_not_run_again(space, r):
    """A second record of a request whose terminal event is queued (not yet in Redis) joins that request;
    before, it re-claimed our own claim and ran the job again as attempt 2 (two terminal events)."""
    names = space.names
    async with running_worker(space) as w:
        assert w.rio is not None
        original, gate = w.rio.publish, asyncio.Event()

        async def slow_terminals(batch: PublishBatch) -> set[tuple[str, int]]:
            if batch.terminals:
                await gate.wait()
            return await original(batch)

        w.rio.publish = slow_terminals  # type: ignore[method-assign]
        await produce(space.bootstrap, names.jobs_topic, [job("again", max_tokens=3)])
        for _ in range(300):  # finished in the engine, terminal event held back
            if w.tracker.in_flight_count() == 1 and w.requests.running("again") is None and await r.exists(names.stream("again")):
                break
            await asyncio.sleep(0.02)
        await produce(space.bootstrap, names.jobs_topic, [job("again", max_tokens=3)])
        for _ in range(300):
            if w.tracker.in_flight_count() == 2:
                break
            await asyncio.sleep(0.02)
        await asyncio.sleep(0.5)  # let the second record be admitted (or not)
        gate.set()
        results = await wait_results(r, names, ["again"], timeout=20)
        committed, end = await _wait_all_committed(space, 2)
        terminals = await _terminals(r, names, "again")
    check_sequence(results["again"])
    assert [t.attempt for t in terminals] == [1]
    assert (committed, end) == (2, 2)


async def test_a_crashed_background_task_stops_the_worker_and_hands_its_jobs_back(space, r):
    """An unexpected error that ends one of the worker's tasks (here: Redis answers the publish with an
    error reply) must stop the worker with an error, not leave it up, holding claims, doing nothing."""
    from redis.exceptions import ResponseError

    names = space.names
    config = WorkerConfig(fake_engine=True, bootstrap_servers=space.bootstrap, redis_url=space.redis_url,
                          job_topic=names.jobs_topic, prefix=names.redis_prefix, group_id=space.group,
                          metrics_port=-1, claim_ttl_s=3, drain_timeout_s=5)
    worker = Worker(config, FakeEngine(step_delay_s=0.02))
    task = asyncio.create_task(worker.run())
    for _ in range(200):
        if worker.ready or task.done():
            break
        await asyncio.sleep(0.05)
    assert worker.rio is not None

    async def broken(batch: PublishBatch) -> None:
        raise ResponseError("OOM command not allowed when used memory > 'maxmemory'.")

    worker.rio.publish = broken  # type: ignore[method-assign]
    await produce(space.bootstrap, names.jobs_topic, [job("stuck", max_tokens=100)])
    try:
        with pytest.raises(RuntimeError, match="ResponseError: OOM command"):
            await asyncio.wait_for(task, 20)
    finally:
        if not task.done():
            worker.request_stop()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(task, 30)
    assert await r.exists(names.claim("stuck")) == 0  # handed back: another worker takes it at once
    # Its chunks were made (their publish failed, maybe halfway): the attempt stays counted, the next runs as 2.
    assert int(await r.get(f"{names.redis_prefix}:attempts:stuck") or 0) == 1
    committed, _ = await committed_offsets(space.bootstrap, space.group, names.jobs_topic)
    assert committed == 0


async def test_poison_job_too_large_for_the_dead_letter_topic_still_ends_and_commits(space, r):
    """A poison job near the 1 MiB limit plus the dead-letter headers exceeds the producer's request size:
    that send can never succeed. Before, it was retried forever (job never answered, commits stuck)."""
    names = space.names
    await r.set(f"{names.redis_prefix}:attempts:huge", 3)
    body = msgspec.json.encode(job("huge", prompt="x"))
    big = body.replace(b'"x"', b'"' + b"y" * (1_048_400 - len(body)) + b'"')  # fits the topic, not with DLQ headers
    async with running_worker(space):
        await produce(space.bootstrap, names.jobs_topic, [(b"huge", big, [])])
        results = await wait_results(r, names, ["huge"], timeout=30)
        committed, end = await _wait_all_committed(space, 1)
    err = results["huge"].terminal
    assert isinstance(err, Error) and err.code == "poison_job"
    assert (committed, end) == (1, 1)
    records = await dead_letters(space.bootstrap, names.dlq_topic)
    assert [rec.key for rec in records] == [b"huge"]  # the dead letter, without the value that did not fit
    headers = dict(records[0].headers)
    assert headers["stoker-error-code"] == b"poison_job" and b"too large" in headers["stoker-error-message"]


async def test_claims_are_renewed_while_kafka_metadata_calls_hang(space, r):
    """The lag gauge asks Kafka for end offsets; with a broker away that call waits up to its request
    timeout (40 s). Before, claim renewal waited behind it, so every running job's claim expired and
    another worker could take the jobs over mid-run."""
    names = space.names
    async with running_worker(space, engine=FakeEngine(step_delay_s=0.02)) as w:
        assert w.consumer is not None

        async def hanging_end_offsets(partitions: object) -> dict:
            await asyncio.sleep(60)
            return {}

        w.consumer.end_offsets = hanging_end_offsets  # type: ignore[method-assign]
        await produce(space.bootstrap, names.jobs_topic, [job("long", max_tokens=400)])
        for _ in range(300):
            if w.requests.running("long") is not None:
                break
            await asyncio.sleep(0.02)
        await asyncio.sleep(4.5)  # claim_ttl_s is 3: only renewals keep the claim alive this long
        owner = await r.get(names.claim("long"))
        assert w.requests.running("long") is not None
        assert owner == f"{w.cfg.worker_id} 1".encode()  # worker and attempt


async def test_drain_timeout_publishes_nothing_for_a_job_after_handing_it_back(space, r):
    """At the drain timeout the worker releases its claims (and takes back the attempt it counted), so the
    next worker runs the job under the same attempt number. Chunks we publish after that release would
    mix into the new run's seqs; before, the engine and publisher went on for a while after it."""
    names = space.names
    released_at: list[int] = []
    async with running_worker(space, engine=FakeEngine(step_delay_s=0.01), drain_timeout_s=0.3) as w:
        assert w.rio is not None
        original = w.rio.release

        async def release_then_linger(request_id: str, attempt: int, give_back_attempt: bool) -> None:
            await original(request_id, attempt, give_back_attempt)
            seconds, micros = await r.time()
            released_at.append(seconds * 1000 + micros // 1000)
            await asyncio.sleep(0.3)  # the window a slow Redis round trip (or many claims) leaves

        w.rio.release = release_then_linger  # type: ignore[method-assign]
        await produce(space.bootstrap, names.jobs_topic, [job("handed", max_tokens=2000)])
        for _ in range(300):
            if await r.exists(names.stream("handed")):
                break
            await asyncio.sleep(0.02)
    assert len(released_at) == 1 and await r.exists(names.claim("handed")) == 0
    entries = await r.xrange(names.stream("handed"))
    late = [eid for eid, _ in entries if int(eid.split(b"-")[0]) > released_at[0]]
    assert late == []



async def test_job_handed_back_mid_stream_is_resumed_under_a_new_attempt(space, r):
    """A drain that times out hands running jobs back. One that already streamed chunks must be taken over
    as attempt 2: before, the release took the attempt back, the next worker streamed attempt 1 again
    from seq 0, and a subscriber reading the stream saw one attempt with every seq twice (two runs mixed)."""
    names = space.names
    async with running_worker(space, engine=FakeEngine(step_delay_s=0.02), drain_timeout_s=0.2):
        await produce(space.bootstrap, names.jobs_topic, [job("moved", max_tokens=200)])
        for _ in range(300):
            if await r.xlen(names.stream("moved")) >= 3:
                break
            await asyncio.sleep(0.02)
    assert await r.exists(names.result("moved")) == 0 and await r.exists(names.claim("moved")) == 0
    async with running_worker(space):
        results = await wait_results(r, names, ["moved"], timeout=30)
    outcome = results["moved"]
    check_sequence(outcome)
    assert outcome.terminal.attempt == 2 and {e.attempt for e in outcome.events} == {1, 2}


async def test_job_handed_back_before_any_event_keeps_its_attempt_number(space, r):
    """The other side of the hand-back: a job that never published anything costs no attempt (draining
    workers must not push a healthy job towards poison_job)."""
    names = space.names
    async with running_worker(space, engine=FakeEngine(max_num_seqs=1, step_delay_s=0.02), drain_timeout_s=0.2,
                              max_num_seqs=1) as w:
        await produce(space.bootstrap, names.jobs_topic, [job("first", max_tokens=500)])
        for _ in range(300):
            if await r.exists(names.stream("first")):
                break
            await asyncio.sleep(0.02)
        await produce(space.bootstrap, names.jobs_topic, [job("queued", max_tokens=3)])
        for _ in range(300):
            if w.requests.running("queued") is not None and await r.exists(names.stream("first")):
                break
            await asyncio.sleep(0.02)
        assert w.requests.running("queued") is not None and await r.exists(names.stream("queued")) == 0
    assert int(await r.get(f"{names.redis_prefix}:attempts:queued") or 0) == 0
    assert int(await r.get(f"{names.redis_prefix}:attempts:first") or 0) == 1


async def test_stop_ends_a_dead_letter_send_that_cannot_finish(space, r):
    """A poison job's dead letter is sent by a side task that retries while Kafka refuses. stop() waited for
    it (bounded) and then left it running past the worker's end, retrying on a closed producer forever."""
    from aiokafka.errors import KafkaConnectionError

    names = space.names
    await r.set(f"{names.redis_prefix}:attempts:stuck-dlq", 3)
    async with running_worker(space, drain_timeout_s=0.5) as w:
        assert w.producer is not None

        async def refused(*args: object, **kwargs: object) -> None:
            raise KafkaConnectionError("broker away")

        w.producer.send_and_wait = refused  # type: ignore[method-assign]
        await produce(space.bootstrap, names.jobs_topic, [job("stuck-dlq")])
        for _ in range(300):
            if w._side_tasks:
                break
            await asyncio.sleep(0.02)
        side = set(w._side_tasks)
        assert side
    assert all(t.done() for t in side)
    assert await r.exists(names.result("stuck-dlq")) == 0  # not answered: the next worker dead-letters it
    assert await r.exists(names.claim("stuck-dlq")) == 0
    assert int(await r.get(f"{names.redis_prefix}:attempts:stuck-dlq")) == 3  # handed back as it came


async def test_stop_during_a_claim_round_trip_leaves_no_orphan_claim(space, r):
    """stop() cancelled the intake mid-claim: Redis had claimed the jobs (and counted an attempt) but the
    worker never learned it, so the claims sat until they expired and the attempt was never given back
    (each unlucky deploy moved a healthy job towards poison_job)."""
    names = space.names
    async with running_worker(space) as w:
        assert w.rio is not None
        original, in_admit = w.rio.admit, asyncio.Event()

        async def slow_admit(request_ids: list[str]) -> list[tuple[str, int]]:
            out = await original(request_ids)
            in_admit.set()
            await asyncio.sleep(0.5)  # a slow reply: Redis has already claimed
            return out

        w.rio.admit = slow_admit  # type: ignore[method-assign]
        await produce(space.bootstrap, names.jobs_topic, [job("orphan", max_tokens=3)])
        await asyncio.wait_for(in_admit.wait(), 20)
    if not await r.exists(names.result("orphan")):  # not run in the drain: then handed back cleanly
        assert await r.exists(names.claim("orphan")) == 0
        assert int(await r.get(f"{names.redis_prefix}:attempts:orphan") or 0) == 0


# -- review round 2 ---------------------------------------------------------------------------------------
async def test_malformed_record_of_a_finished_request_publishes_nothing(space, r):
    """A bad record whose id already has a result: dead-lettered and committed, and no second terminal event
    (before: an `error` went to the id's channel and stream, though the result key kept the original)."""
    names = space.names
    await r.set(names.result("settled"), b'{"type":"done"}', ex=60)
    pubsub = r.pubsub()
    await pubsub.subscribe(names.events_channel("settled"))
    async with running_worker(space):
        await produce(space.bootstrap, names.jobs_topic, [(b"settled", b"\x00 not json", [])])
        committed, end = await _wait_all_committed(space, 1)
        await asyncio.sleep(0.3)  # a publish would have gone out with the commit's batch
    seen = []
    for _ in range(10):  # the first read returns the subscribe confirmation (skipped as None)
        if (msg := await pubsub.get_message(ignore_subscribe_messages=True, timeout=0.1)) is not None:
            seen.append(msg["data"])
    await pubsub.aclose()
    assert (committed, end) == (1, 1)
    assert seen == [] and await r.exists(names.stream("settled")) == 0
    assert await r.get(names.result("settled")) == b'{"type":"done"}'
    assert [rec.key for rec in await dead_letters(space.bootstrap, names.dlq_topic)] == [b"settled"]



async def test_stream_keeps_every_chunk_of_a_request_longer_than_the_configured_cap(space, r):
    """One chunk per engine step: a long completion outgrew stream_maxlen and a late reader lost its start.
    The cap now covers the longest request the engine can run (every attempt), the flag being a floor."""
    names = space.names
    async with running_worker(space, engine=FakeEngine(max_model_len=1024), stream_maxlen=50):
        await produce(space.bootstrap, names.jobs_topic, [job("long-out", max_tokens=600)])
        results = await wait_results(r, names, ["long-out"], timeout=30)
    outcome = results["long-out"]
    check_sequence(outcome)
    assert len(outcome.events) == 601 and outcome.events[0].seq == 0



async def test_missing_dead_letter_topic_fails_the_start_naming_it(space):
    """With broker auto-creation off a missing DLQ topic made the first dead letter retry forever inside the
    intake while /healthz said ok. Now the start checks both topics and fails with what to do."""
    with pytest.raises(RuntimeError, match=r"nope\.dlq.*does not exist") as info:
        async with running_worker(space, dlq_topic="nope.dlq"):
            pass
    assert space.names.jobs_topic not in str(info.value)  # that one exists: only the missing one is named


async def test_dead_letter_send_that_keeps_failing_turns_healthz_unhealthy(space, r, caplog, monkeypatch):
    """A dead letter refused at run time (the topic deleted since the start) is retried, and said loudly:
    an error log naming the topic, /healthz 503, back to healthy once a send succeeds."""
    from aiokafka.errors import KafkaTimeoutError
    from stoker.worker import service

    monkeypatch.setattr(service, "DLQ_UNHEALTHY_AFTER_S", 0.0)  # at once: the test need not wait 10 s
    names = space.names
    async with running_worker(space, metrics_port=0) as w:
        assert w.producer is not None and w.health is not None
        original, allow = w.producer.send_and_wait, asyncio.Event()

        async def refused(*args: object, **kwargs: object) -> object:
            if not allow.is_set():
                raise KafkaTimeoutError("Failed to update metadata after 60.0 secs.")
            return await original(*args, **kwargs)

        w.producer.send_and_wait = refused  # type: ignore[method-assign]

        def get(path: str) -> int:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{w.health.port}{path}", timeout=5) as resp:  # type: ignore[union-attr]
                    return int(resp.status)
            except urllib.error.HTTPError as exc:
                return exc.code

        await produce(space.bootstrap, names.jobs_topic, [(b"dl-stuck", b"\x00 not json", [])])
        for _ in range(300):
            if await asyncio.to_thread(get, "/healthz") == 503:
                break
            await asyncio.sleep(0.05)
        assert await asyncio.to_thread(get, "/healthz") == 503
        assert any(rec.levelname == "ERROR" and names.dlq_topic in rec.getMessage() for rec in caplog.records)
        allow.set()
        await wait_results(r, names, ["dl-stuck"], timeout=20)
        for _ in range(100):
            if await asyncio.to_thread(get, "/healthz") == 200:
                break
            await asyncio.sleep(0.05)
        assert await asyncio.to_thread(get, "/healthz") == 200


async def test_token_prefix_and_busy_metrics_count_with_a_bounded_tenant_label(space, r):
    """They were declared and never incremented. Exact counts after jobs of known lengths; the tenant label is
    capped (the first max_tenant_labels tenants keep theirs, later ones count as `other`, none is "")."""
    names = space.names
    first = [("a1", "a", 3, 5), ("a2", "a", 2, 4), ("b1", "b", 5, 6)]  # (id, tenant, prompt words, max_tokens)
    later = [("c1", "c", 7, 2), ("d1", "d", 1, 3), ("n1", None, 4, 9)]
    started = time.monotonic()
    async with running_worker(space, metrics_port=0, max_tenant_labels=2) as w:
        assert w.health is not None and w.health.port is not None
        for batch in (first, later):  # a and b are met first: they take the two labels
            await produce(space.bootstrap, names.jobs_topic, [
                job(rid, prompt=" ".join(["word"] * words), max_tokens=max_tokens, **({"tenant": t} if t else {}))
                for rid, t, words, max_tokens in batch])
            await wait_results(r, names, [rid for rid, *_ in batch], timeout=30)
        values = await asyncio.to_thread(scrape, w.health.port)
    wall = time.monotonic() - started

    def get(name: str, **labels: str) -> float:
        return values.get((name, frozenset(labels.items())), 0.0)

    expected = {"a": (5, 9), "b": (5, 6), "other": (8, 5), "": (4, 9)}  # tenant label -> (prompt, generated)
    for tenant, (prompt, generated) in expected.items():
        assert get("stoker_prompt_tokens_total", tenant=tenant) == prompt, tenant
        assert get("stoker_generation_tokens_total", tenant=tenant) == generated, tenant
    assert get("stoker_requests_finished_total", reason="length", tenant="a") == 2
    assert get("stoker_requests_finished_total", reason="length", tenant="other") == 2
    assert get("stoker_requests_finished_total", reason="length", tenant="") == 1
    assert not any(("tenant", t) in labels for _, labels in values for t in ("c", "d"))
    # The stand-in engine looks every prompt token up and finds none cached.
    assert get("stoker_prefix_cache_queries_total") == 22 and get("stoker_prefix_cache_hits_total") == 0
    assert 0 < get("stoker_engine_busy_seconds_total") <= wall


async def test_jobs_outside_the_version_1_1_bounds_get_invalid_job_naming_the_field(space, r):
    """tenant 1-64 chars, metadata at most 16 KiB encoded (JSON and MessagePack), stop_token_ids below the
    vocabulary: each was accepted (the last one reaching the sampler); now an invalid_job error event."""
    names = space.names
    bad = {
        "long-tenant": ("tenant", job("long-tenant", tenant="t" * 65)),
        "empty-tenant": ("tenant", job("empty-tenant", tenant="")),
        "big-meta": ("metadata", job("big-meta", metadata={"k": "x" * (16 * 1024)})),
        "big-meta-mp": ("metadata", job("big-meta-mp", metadata={"k": "x" * (16 * 1024)})),
        "stop-id": ("stop_token_ids", job("stop-id", stop_token_ids=[5, 32000], min_tokens=1, max_tokens=4)),
    }
    items: list[dict | tuple] = [body for _, body in bad.values() if body["request_id"] != "big-meta-mp"]
    mp = bad["big-meta-mp"][1]
    items.append((b"big-meta-mp", msgspec.msgpack.encode(mp), [("content-type", b"application/msgpack")]))
    items.append(job("fine", tenant="t" * 64, metadata={"k": "x" * 1000}, stop_token_ids=[31999], max_tokens=2))
    async with running_worker(space):
        await produce(space.bootstrap, names.jobs_topic, items)
        results = await wait_results(r, names, [*bad, "fine"], timeout=30)
    for rid, (field_name, _) in bad.items():
        terminal = results[rid].terminal
        assert isinstance(terminal, Error) and terminal.code == "invalid_job", (rid, terminal)
        assert field_name in terminal.message, (rid, terminal.message)
    assert isinstance(results["fine"].terminal, Done) and results["fine"].terminal.tenant == "t" * 64


async def test_the_stacks_default_dead_letter_topic_is_the_one_worker_and_client_use(space):
    """STOKER_JOB_TOPIC=x ops/stack up made `x` and `stoker.jobs.dlq`; the worker wanted `x.dlq` and refused to
    start. One rule now: the stack makes x.dlq, the worker starts on x alone and dead-letters there."""
    from stoker.client.client import Client

    topic = f"own.{space.tag}"
    cfg = stack.StackConfig.from_env({"STOKER_JOB_TOPIC": topic})
    assert cfg.dlq_topic == f"{topic}.dlq"
    assert Client(space.bootstrap, space.redis_url, topic=topic).names.dlq_topic == cfg.dlq_topic
    await asyncio.to_thread(stack.ensure_topics, space.bootstrap, cfg.topics())
    async with running_worker(space, job_topic=topic) as w:
        assert w.names.dlq_topic == cfg.dlq_topic
        await produce(space.bootstrap, topic, [(b"junk", b"not json", [])])
        letters = await dead_letters(space.bootstrap, cfg.dlq_topic)
    assert [rec.key for rec in letters] == [b"junk"]


async def test_job_that_breaks_the_engine_before_its_first_event_ends_as_poison(space, r):
    """A job whose first step breaks the engine (a kernel fault on its input; here the stand-in raises when it is
    in the batch) makes each worker that runs it fatal. Its attempt was given back on the way out (no event of it
    yet), so the count never grew: every worker died on it in turn and it never reached the dead-letter topic.
    Now a broken engine keeps the attempts it counted: the fourth worker dead-letters the job as poison_job and
    its requester gets the error, without running it."""
    names = space.names

    class BreaksOnKiller(FakeEngine):
        def __init__(self) -> None:
            super().__init__(step_delay_s=0.01)
            self.armed = False

        def add_request(self, request):  # type: ignore[no-untyped-def,override]
            self.armed = self.armed or request.request_id == "killer"
            return super().add_request(request)

        def step(self):  # type: ignore[no-untyped-def,override]
            if self.armed:
                raise RuntimeError("CUDA error: an illegal memory access was encountered")
            return super().step()

    await produce(space.bootstrap, names.jobs_topic, [job("killer", max_tokens=5)])
    for attempt in (1, 2, 3):
        with pytest.raises(RuntimeError, match="illegal memory access"):
            async with running_worker(space, engine=BreaksOnKiller()) as w:
                for _ in range(600):
                    if w.fatal is not None:
                        break
                    await asyncio.sleep(0.02)
        assert int(await r.get(f"{names.redis_prefix}:attempts:killer")) == attempt
        assert await r.exists(names.result("killer")) == 0
    engine = BreaksOnKiller()
    async with running_worker(space, engine=engine) as w:
        results = await wait_results(r, names, ["killer"], timeout=30)
        assert w.fatal is None and not engine.armed  # never handed to the engine
    err = results["killer"].terminal
    assert isinstance(err, Error) and err.code == "poison_job" and err.attempt == 4
    letters = await dead_letters(space.bootstrap, names.dlq_topic)
    assert [dict(m.headers)["stoker-error-code"] for m in letters] == [b"poison_job"]


@pytest.mark.parametrize("codec", ["zstd", "lz4", "snappy", "gzip"])
async def test_jobs_in_compressed_record_batches_run(space, r, codec):
    """Producers in any language may compress their batches (Java's compression.type, librdkafka's
    compression.codec). Without aiokafka's codec extras the worker could not decompress a zstd, lz4 or snappy
    batch: its poll failed on it again and again, so no job of any of its partitions ran, and nothing was
    dead-lettered. Each codec's batch of jobs, beside an uncompressed one on the same topic, now runs."""
    from aiokafka import AIOKafkaProducer

    names = space.names
    ids = [f"{codec}-{i}" for i in range(6)]
    producer = AIOKafkaProducer(bootstrap_servers=space.bootstrap, acks="all", compression_type=codec, linger_ms=50)
    await producer.start()
    try:
        sent = [await producer.send(names.jobs_topic, msgspec.json.encode(job(i, max_tokens=3)), key=i.encode())
                for i in ids]
        await asyncio.gather(*sent)
    finally:
        await producer.stop()
    await produce(space.bootstrap, names.jobs_topic, [job("plain", max_tokens=3)])
    async with running_worker(space):
        results = await wait_results(r, names, [*ids, "plain"], timeout=30)
    for rid, outcome in results.items():
        assert isinstance(outcome.terminal, Done), (rid, outcome.terminal)
        assert outcome.terminal.text == expected_text(rid, 3)


_PRODUCE_BAD_HEADER = r'''
import asyncio, sys
import msgspec
from aiokafka import AIOKafkaProducer

class Undecodable(str):  # the pure-Python record builder encodes header keys with .encode(): these bytes
    def encode(self, *args, **kwargs):
        return b"\xff\xfe"

async def main(bootstrap, topic):
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, acks="all")
    await producer.start()
    try:
        for rid, headers in (("hb-before", []), ("hb-bad", [(Undecodable("x"), b"v")]), ("hb-after", [])):
            job = {"type": "job", "request_id": rid, "prompt": "hello", "max_tokens": 3}
            await producer.send_and_wait(topic, msgspec.json.encode(job), key=rid.encode(), headers=headers,
                                         partition=0)
    finally:
        await producer.stop()

asyncio.run(main(sys.argv[1], sys.argv[2]))
'''


async def test_a_record_the_kafka_client_cannot_parse_is_dead_lettered_and_skipped(space, r):
    """aiokafka decodes header keys as UTF-8: a record whose key is not (any producer library can write one)
    made every poll raise UnicodeDecodeError, which killed the worker, and each restarted worker died on the same
    uncommitted record. Now the poll finds the record (its partition read one record at a time), dead-letters a
    stub naming where it is, skips it, and the jobs before and after it, and on the other partitions, run."""
    names = space.names
    env = {**os.environ, "AIOKAFKA_NO_EXTENSIONS": "1"}  # the pure-Python builder, whose encode() we hook
    subprocess.run([sys.executable, "-c", _PRODUCE_BAD_HEADER, space.bootstrap, names.jobs_topic], env=env,
                   check=True, timeout=60)
    await produce(space.bootstrap, names.jobs_topic, [job(f"hb-other-{i}", max_tokens=3) for i in range(4)])
    ids = ["hb-before", "hb-after", *(f"hb-other-{i}" for i in range(4))]
    async with running_worker(space) as w:
        results = await wait_results(r, names, ids, timeout=30)
        assert w.fatal is None
        for _ in range(200):  # every record, the skipped one included, committed
            committed, end = await committed_offsets(space.bootstrap, space.group, names.jobs_topic)
            if committed == end == 7:
                break
            await asyncio.sleep(0.05)
        assert (committed, end) == (7, 7)
    for rid in ids:
        assert isinstance(results[rid].terminal, Done), results[rid].terminal
    assert await r.exists(names.result("hb-bad")) == 0  # its id was never readable
    letters = await dead_letters(space.bootstrap, names.dlq_topic)
    assert len(letters) == 1
    headers = dict(letters[0].headers)
    assert headers["stoker-error-code"] == b"invalid_job"
    assert f"{names.jobs_topic}-0 offset 1".encode() in headers["stoker-error-message"]
