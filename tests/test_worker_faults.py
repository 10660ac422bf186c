"""Worker faults found by an outside attack (issue 9), each against the real broker and Redis: a record that
breaks the dead-letter send, a worker paused past its claim, a worker that cannot log in to Redis or loses it,
cancels sent while the cancel subscription is down."""

from __future__ import annotations

import asyncio
import contextlib
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import msgspec
import pytest
from aiokafka import AIOKafkaProducer
from stoker.schemas import Cancel, Done, encode_cancel
from stoker.worker.fake_engine import FakeEngine
from worker_harness import (
    Space,
    check_attempt_order,
    check_sequence,
    committed_offsets,
    dead_letters,
    job,
    produce,
    running_worker,
    stack_fixtures,
    start_worker_process,
    stop_process,
    wait_results,
)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "ops"))
from chaos import RedisProxy  # noqa: E402

pytestmark = [pytest.mark.stack, pytest.mark.timeout(180)]


space, r = stack_fixtures()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_redis(port: int, data_dir: Path, *extra: str) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen(["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--dir", str(data_dir),
                             "--save", "", "--appendonly", "yes", "--appendfsync", "always", *extra],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.2):
            return proc
        time.sleep(0.05)
    raise RuntimeError("redis-server did not start")


async def wait_committed(space: Space, expected: int, timeout: float = 30) -> tuple[int, int]:
    deadline = time.monotonic() + timeout
    while True:
        committed, end = await committed_offsets(space.bootstrap, space.group, space.names.jobs_topic)
        if committed == end == expected or time.monotonic() > deadline:
            return committed, end
        await asyncio.sleep(0.2)


# -- 1. one record must never stop the poll loop -------------------------------------------------------------
async def test_keyless_record_over_the_size_limit_is_dead_lettered_and_the_jobs_around_it_finish(space, r):
    """gzip lets the broker take a 2 MiB value; the worker refuses it (message_too_large) and its dead letter
    can't carry the value. Before: the retry without the value kept the key, None, aiokafka asserted "need at
    least one: key or value", the poll loop died and every restarted worker died on the same record."""
    names = space.names
    big = b'{"type":"job","prompt":"' + b"z" * 2_200_000 + b'"}'
    producer = AIOKafkaProducer(bootstrap_servers=space.bootstrap, compression_type="gzip",
                                max_request_size=4_000_000, acks="all")
    await producer.start()
    try:  # one partition's order: job, keyless giant, job
        for key, value in ((b"before", msgspec.json.encode(job("before", max_tokens=5))), (None, big),
                           (b"after", msgspec.json.encode(job("after", max_tokens=5)))):
            await producer.send_and_wait(names.jobs_topic, value=value, key=key, partition=0)
    finally:
        await producer.stop()
    async with running_worker(space) as worker:
        results = await wait_results(r, names, ["before", "after"], timeout=30)
        assert await wait_committed(space, 3) == (3, 3)
        assert worker._healthy() and worker.fatal is None  # noqa: SLF001
    assert all(isinstance(o.terminal, Done) for o in results.values())
    records = await dead_letters(space.bootstrap, names.dlq_topic)
    assert len(records) == 1
    dead = records[0]
    headers = dict(dead.headers)
    assert dead.key is None and dead.value is not None and len(dead.value) < 1000  # a short stub value
    assert headers["stoker-error-code"] == b"message_too_large"
    assert b"left out" in headers["stoker-error-message"]


# -- 2. a worker paused past its claim publishes nothing after it resumes -----------------------------------
@pytest.mark.timeout(240)
async def test_worker_paused_past_its_claim_ttl_publishes_nothing_after_it_resumes(space, r, tmp_path):
    """The first worker's Redis link stalls with a publish in flight, then the process is SIGSTOPped past
    its claims' TTL; the second worker takes every job over as attempt 2. Then the held bytes reach Redis
    and the first worker resumes: before, its attempt-1 chunks (and a second `done`) landed after attempt 2's
    events, and its `done` could take the result key for good (set only if absent)."""
    names = space.names
    ids = [f"p{i}" for i in range(8)]
    port = int(space.redis_url.rsplit(":", 1)[1].split("/")[0])
    proxy = RedisProxy(port)
    proxy_port = await proxy.start()
    env = space.worker_env(STOKER_FAKE_STEP_DELAY_S="0.02")
    first = start_worker_process({**env, "REDIS_URL": f"redis://127.0.0.1:{proxy_port}/0"},
                                 log_path=tmp_path / "a.log")
    second = None
    try:
        await produce(space.bootstrap, names.jobs_topic, [job(i, max_tokens=400) for i in ids])
        for _ in range(400):  # every job streams on the first worker
            if all(await asyncio.gather(*(r.exists(names.stream(i)) for i in ids))):
                break
            await asyncio.sleep(0.05)
        second = start_worker_process(env, log_path=tmp_path / "b.log")
        await asyncio.sleep(1.0)
        proxy.flowing.clear()
        await asyncio.sleep(0.3)  # the first worker's next publish is now held in the proxy
        first.send_signal(signal.SIGSTOP)
        # The claims (3 s) expire and the group (10 s session) gives every partition to the second worker,
        # which starts the jobs again as attempt 2.
        for _ in range(800):
            attempts = await asyncio.gather(*(r.get(f"{names.redis_prefix}:attempts:{i}") for i in ids))
            if all(a is not None and int(a) >= 2 for a in attempts):
                break
            await asyncio.sleep(0.05)
        else:
            pytest.fail("the second worker never took the jobs over")
        await asyncio.sleep(1.0)  # attempt 2 streams
        proxy.flowing.set()
        first.send_signal(signal.SIGCONT)
        results = await wait_results(r, names, ids, timeout=60)
        await asyncio.sleep(2.0)  # anything the resumed worker still had queued would land by now
        results = await wait_results(r, names, ids, timeout=5)
    finally:
        with contextlib.suppress(ProcessLookupError):
            first.send_signal(signal.SIGCONT)
        stop_process(first)
        if second is not None:
            stop_process(second)
        await proxy.close()
    for outcome in results.values():
        check_attempt_order(outcome)
        check_sequence(outcome)


# -- 3. Redis: login checked before joining; an outage past the bound leaves the group -----------------------
def test_wrong_redis_password_is_fatal_before_joining_the_group(space, tmp_path):
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed")
    port = free_port()
    proc = start_redis(port, tmp_path, "--requirepass", "right-password")
    try:
        env = space.worker_env(REDIS_URL=f"redis://127.0.0.1:{port}/0", REDIS_PASSWORD="wrong-password")
        log_path = tmp_path / "w.log"
        worker = start_worker_process(env, log_path=log_path)
        try:
            code = worker.wait(30)
        finally:
            stop_process(worker, signal.SIGKILL)
        text = log_path.read_text()
        assert code == 1, text[-2000:]
        failed = [line for line in text.splitlines() if "event=worker_failed" in line]
        assert len(failed) == 1 and re.search("authentication|password", failed[0], re.I), text[-2000:]
        assert "partitions_assigned" not in text  # it never joined the group
    finally:
        proc.kill()
        proc.wait()


async def test_healthz_is_unhealthy_until_the_worker_really_runs(space, tmp_path):
    env = space.worker_env(REDIS_URL=f"redis://127.0.0.1:{free_port()}/0", STOKER_METRICS_PORT="0",
                           STOKER_METRICS_HOST="127.0.0.1")
    log_path = tmp_path / "w.log"
    proc = start_worker_process(env, log_path=log_path)
    try:
        port = None
        for _ in range(400):
            m = re.search(r"event=metrics_listening port=(\d+)", log_path.read_text())
            if m and "event=redis_retry" in log_path.read_text():
                port = int(m.group(1))
                break
            await asyncio.sleep(0.05)
        assert port is not None, log_path.read_text()[-2000:]
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=5)
        assert err.value.code == 503
        err.value.close()  # the error holds the response's socket
    finally:
        stop_process(proc)


@pytest.mark.timeout(240)
async def test_worker_that_loses_redis_past_the_bound_leaves_the_group_and_rejoins(space, r):
    names = space.names
    port = int(space.redis_url.rsplit(":", 1)[1].split("/")[0])
    proxy = RedisProxy(port)
    proxy_port = await proxy.start()
    ids = [f"l{i}" for i in range(24)]
    try:
        async with (
            running_worker(space, engine=FakeEngine(step_delay_s=0.02),
                           redis_url=f"redis://127.0.0.1:{proxy_port}/0", redis_outage_leave_s=3) as cut,
            running_worker(space, engine=FakeEngine(step_delay_s=0.02)) as healthy,
        ):
            for _ in range(400):  # both hold partitions
                if cut.consumer.assignment() and healthy.consumer.assignment():
                    break
                await asyncio.sleep(0.05)
            await produce(space.bootstrap, names.jobs_topic, [job(i, max_tokens=150) for i in ids])
            await asyncio.sleep(0.5)
            proxy.sever()
            results = await wait_results(r, names, ids, timeout=90)
            assert not cut.consumer.assignment()  # it left the group while Redis was away
            proxy.cut = False
            for _ in range(600):  # Redis is back: it rejoins and gets partitions again
                if cut.consumer.assignment():
                    break
                await asyncio.sleep(0.05)
            else:
                pytest.fail("the worker never rejoined the group after Redis came back")
            assert await wait_committed(space, len(ids)) == (len(ids), len(ids))
    finally:
        await proxy.close()
    for outcome in results.values():
        check_attempt_order(outcome)
        check_sequence(outcome)


# -- 5. cancels sent while the cancel subscription is down ---------------------------------------------------
async def test_cancel_published_while_the_cancel_subscription_is_down_lands_at_once(space, r):
    names = space.names
    async with running_worker(space, engine=FakeEngine(step_delay_s=0.02), claim_ttl_s=30) as worker:
        await produce(space.bootstrap, names.jobs_topic, [job("c1", max_tokens=2000)])
        while not await r.exists(names.stream("c1")):
            await asyncio.sleep(0.05)
        clients = await r.client_list()
        ours = [c for c in clients if c.get("name") == f"stoker-cancels-{worker.cfg.worker_id}"]
        assert len(ours) == 1, "the cancel listener names its connection"
        await r.execute_command("CLIENT", "KILL", "ID", ours[0]["id"])
        for _ in range(100):  # nobody listens on the cancel channel now
            if dict(await r.pubsub_numsub(names.cancel_channel)).get(names.cancel_channel.encode(), 0) == 0:
                break
            await asyncio.sleep(0.01)
        await r.set(names.cancelled("c1"), 1, ex=60)
        await r.publish(names.cancel_channel, encode_cancel(Cancel(request_id="c1")))
        sent = time.monotonic()
        results = await wait_results(r, names, ["c1"], timeout=20)
        # The renew loop (every 10 s here) would find the key only much later.
        assert time.monotonic() - sent < 3.0
    assert isinstance(results["c1"].terminal, Done) and results["c1"].terminal.finish_reason == "cancelled"


# -- 5. a hung engine step: the worker hands its jobs back and exits ------------------------------------------
@pytest.mark.timeout(150)
async def test_worker_whose_engine_step_hangs_hands_its_jobs_back_and_exits(space, r, tmp_path):
    """The stand-in engine's step after its 40th never returns, as on a hung GPU (or a tensor-parallel peer gone
    inside a one-shot all-reduce). Before the step watchdog the worker sat there renewing its jobs' claims for
    good, so no other worker could take them. Now it exits 1 by itself a few seconds past its 2 s limit, its
    claims already released (well inside their 3 s TTL, which the renewals would have kept alive forever), and a
    second worker then finishes every job, each stream in order with one terminal event."""
    names = space.names
    ids = [f"s{i}" for i in range(6)]
    env = space.worker_env(STOKER_FAKE_STEP_DELAY_S="0.02")
    hung_log = tmp_path / "a.log"
    first = start_worker_process({**env, "STOKER_FAKE_HANG_AFTER_STEPS": "40", "STOKER_STEP_STALL_TIMEOUT_S": "2"},
                                 log_path=hung_log)
    second = None
    try:
        await produce(space.bootstrap, names.jobs_topic, [job(i, max_tokens=300) for i in ids])
        for _ in range(600):  # the first worker runs them (300 tokens at 20 ms a step: still running at step 40)
            if any(await asyncio.gather(*(r.exists(names.stream(i)) for i in ids))):
                break
            await asyncio.sleep(0.05)
        else:
            pytest.fail("the first worker never streamed a job")
        started = time.monotonic()
        try:
            code = await asyncio.to_thread(first.wait, 40)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the worker with the hung step did not exit: {hung_log.read_text()[-3000:]}")
        text = hung_log.read_text()
        assert code == 1, text[-3000:]
        assert time.monotonic() - started < 30, text[-3000:]
        assert "event=engine_step_stalled" in text, text[-3000:]
        failed = [line for line in text.splitlines() if "event=worker_failed" in line]
        assert len(failed) == 1 and "engine step has run for" in failed[0], text[-3000:]
        # handed back: no claim of ours is left to wait out
        assert not any(await asyncio.gather(*(r.exists(names.claim(i)) for i in ids)))
        second = start_worker_process(env, log_path=tmp_path / "b.log")
        results = await wait_results(r, names, ids, timeout=60)
    finally:
        stop_process(first, signal.SIGKILL)
        if second is not None:
            stop_process(second)
    for outcome in results.values():
        assert isinstance(outcome.terminal, Done), outcome.terminal
        check_attempt_order(outcome)
        check_sequence(outcome)


# -- 6. a worker stopped and resumed with a step in flight is not a hung one --------------------------------------
@pytest.mark.timeout(120)
async def test_worker_stopped_longer_than_its_step_limit_goes_on_after_it_resumes(space, r, tmp_path):
    """SIGSTOP with an engine step in flight (the stand-in's steps sleep 20 ms each, so the stop nearly always
    lands inside one), for 3 s against a 1 s step limit, then SIGCONT. Before, the watchdog's first tick after
    the resume saw a step "running" for 3 s and the worker exited 1, to be restarted and reload its model; now
    the gap in its own ticks is taken for the pause it is, and the worker finishes every job as attempt 1.
    (Claims live 30 s here: the pause must not cost them.)"""
    names = space.names
    ids = [f"z{i}" for i in range(4)]
    env = space.worker_env(STOKER_FAKE_STEP_DELAY_S="0.02", STOKER_STEP_STALL_TIMEOUT_S="1", STOKER_CLAIM_TTL_S="30")
    log_path = tmp_path / "w.log"
    worker = start_worker_process(env, log_path=log_path)
    try:
        await produce(space.bootstrap, names.jobs_topic, [job(i, max_tokens=300) for i in ids])
        for _ in range(600):
            if all(await asyncio.gather(*(r.exists(names.stream(i)) for i in ids))):
                break
            await asyncio.sleep(0.05)
        else:
            pytest.fail(f"the worker never streamed every job: {log_path.read_text()[-3000:]}")
        worker.send_signal(signal.SIGSTOP)
        await asyncio.sleep(3.0)
        worker.send_signal(signal.SIGCONT)
        results = await wait_results(r, names, ids, timeout=60)
        await asyncio.sleep(1.5)  # a watchdog that took the pause for a hung step would have fired by now
        assert worker.poll() is None, log_path.read_text()[-3000:]
        assert "event=engine_step_stalled" not in log_path.read_text()
    finally:
        with contextlib.suppress(ProcessLookupError):
            worker.send_signal(signal.SIGCONT)
        stop_process(worker)
    for outcome in results.values():
        assert isinstance(outcome.terminal, Done), outcome.terminal
        check_sequence(outcome)
        assert {e.attempt for e in outcome.events} == {1}
