"""The local stack: real Kafka and Redis round trips, the launcher's idempotence, and what `down` may stop."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest
import redis.asyncio as aioredis
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from conftest import Endpoints, unique_name
from stoker.devstack import stack

ROOT = Path(__file__).resolve().parents[1]


# ------------------------------------------------------------------------------------------------
# Without any server.


@pytest.mark.parametrize(("kwargs", "named"), [
    ({"kafka_port": 0}, "kafka_port"),
    ({"redis_port": 70000}, "redis_port"),
    ({"redis_port": 9092}, "ports must differ"),
    ({"job_partitions": 0}, "job_partitions"),
    ({"job_topic": "bad topic!"}, "bad topic!"),
    ({"dlq_topic": "stoker.jobs"}, "must differ"),
])
def test_config_rejects_bad_values_by_name(kwargs: dict[str, object], named: str, tmp_path: Path) -> None:
    with pytest.raises(stack.StackError, match=named):
        stack.StackConfig(stack_dir=tmp_path, **kwargs)  # type: ignore[arg-type]


def test_config_from_env_reads_ports_dirs_and_topics(tmp_path: Path) -> None:
    env = {"STOKER_CACHE": str(tmp_path), "STOKER_KAFKA_PORT": "19092", "STOKER_REDIS_PORT": "16379",
           "STOKER_JOB_TOPIC": "a.jobs", "STOKER_DLQ_PARTITIONS": "2"}
    cfg = stack.StackConfig.from_env(env)
    assert (cfg.kafka_bootstrap, cfg.redis_url) == ("127.0.0.1:19092", "redis://127.0.0.1:16379/0")
    assert cfg.stack_dir == tmp_path / "stack" and cfg.kafka_home == tmp_path / f"kafka-{cfg.kafka_version}"
    # the dead-letter and batch-class topics follow the job topic
    assert cfg.topics() == {"a.jobs": 4, "a.jobs.batch": 4, "a.jobs.dlq": 2}
    with pytest.raises(stack.StackError, match="STOKER_REDIS_PORT"):
        stack.StackConfig.from_env({"STOKER_REDIS_PORT": "six"})


def test_the_launcher_needs_only_the_standard_library(tmp_path: Path) -> None:
    """`ops/stack` runs before any venv exists: plain python3 without site-packages imports and runs it."""
    code = ("import sys; sys.path.insert(0, sys.argv[1]); import stoker.devstack.stack, stoker.devstack.kafka_wire; "
            "import runpy; sys.argv = ['devstack', 'status', '--stack-dir', sys.argv[2], '--kafka-port', '59091', '--controller-port', '59093', '--redis-port', '59092']; "
            "runpy.run_module('stoker.devstack', run_name='__main__')")
    run = subprocess.run([sys.executable, "-S", "-I", "-c", code, str(ROOT), str(tmp_path)], capture_output=True,
                         text=True, timeout=60)
    assert run.returncode == 3, run.stderr  # LSB 3: not running (no stack in this dir)
    assert "kafka" in run.stderr and "Traceback" not in run.stderr


def test_default_dead_letter_topic_is_one_rule_for_stack_worker_and_client(tmp_path: Path) -> None:
    """The launcher stays standard-library only (schemas needs msgspec), so it repeats the rule: both agree."""
    from stoker.schemas.names import Names, default_dlq_topic

    for topic in ("stoker.jobs", "x", "a-b_c.9"):
        ours = stack.StackConfig(stack_dir=tmp_path, job_topic=topic).dlq_topic
        assert ours == stack.default_dlq_topic(topic) == default_dlq_topic(topic) == Names(jobs_topic=topic).dlq_topic
    assert stack.DEFAULT_DLQ_TOPIC == default_dlq_topic(stack.DEFAULT_JOB_TOPIC) == "stoker.jobs.dlq"
    assert stack.StackConfig.from_env({"STOKER_JOB_TOPIC": "x"}).topics() == {"x": 4, "x.batch": 4, "x.dlq": 1}
    both = stack.StackConfig.from_env({"STOKER_JOB_TOPIC": "x", "STOKER_DLQ_TOPIC": "dead"})
    assert both.topics() == {"x": 4, "x.batch": 4, "dead": 1}
    from stoker.schemas.names import default_batch_topic
    for topic in ("stoker.jobs", "x", "a-b_c.9"):
        assert stack.default_batch_topic(topic) == default_batch_topic(topic)


def test_redis_persistence_setting_from_env_and_its_bad_values(tmp_path: Path) -> None:
    assert stack.StackConfig(stack_dir=tmp_path).redis_persistence == "none"  # the local default: none
    env = {"STOKER_CACHE": str(tmp_path), "STOKER_REDIS_PERSISTENCE": "always"}
    assert stack.StackConfig.from_env(env).redis_persistence == "always"
    with pytest.raises(stack.StackError, match="redis_persistence.*none, everysec or always"):
        stack.StackConfig(stack_dir=tmp_path, redis_persistence="sometimes")


def test_down_never_stops_a_process_it_did_not_start(tmp_path: Path) -> None:
    """Pid files that point at someone else's process (a reused pid) are ignored, not obeyed."""
    cfg = stack.StackConfig(stack_dir=tmp_path, kafka_port=29092, controller_port=29093, redis_port=26379)
    bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        for pid_file in (cfg.kafka_dir / "kafka.pid", cfg.redis_dir / "redis.pid"):
            pid_file.parent.mkdir(parents=True)
            pid_file.write_text(f"{bystander.pid}\n")
        st = stack.status(cfg)
        assert st.kafka.pid is None and st.redis.pid is None and not st.up
        assert stack.down(cfg) == []
        assert bystander.poll() is None  # still running
    finally:
        bystander.kill()
        bystander.wait()


# ------------------------------------------------------------------------------------------------
# Against the real broker and server.


@pytest.mark.stack
async def test_job_record_round_trips_with_key_value_and_headers(
        kafka_bootstrap: str, new_topic: Callable[..., Awaitable[str]]) -> None:
    topic = await new_topic(partitions=3)
    headers = [("content-type", b"application/json"), ("traceparent", b"00-abc-01")]
    producer = AIOKafkaProducer(bootstrap_servers=kafka_bootstrap, acks="all", enable_idempotence=True)
    await producer.start()
    try:
        sent = await producer.send_and_wait(topic, b'{"type":"job","request_id":"r-1","prompt":"hi"}',
                                            key=b"r-1", headers=headers)
    finally:
        await producer.stop()
    # A consumer group, as the worker uses: exercises the group coordinator and __consumer_offsets.
    group = unique_name("group")
    consumer = AIOKafkaConsumer(topic, bootstrap_servers=kafka_bootstrap, group_id=group,
                                auto_offset_reset="earliest", enable_auto_commit=False)
    await consumer.start()
    try:
        record = await asyncio.wait_for(consumer.getone(), timeout=30)
        tp = TopicPartition(topic, record.partition)
        await consumer.commit({tp: record.offset + 1})
        assert await consumer.committed(tp) == record.offset + 1
    finally:
        await consumer.stop()
    assert (record.key, record.value) == (b"r-1", b'{"type":"job","request_id":"r-1","prompt":"hi"}')
    assert list(record.headers) == headers
    assert (record.partition, record.offset) == (sent.partition, sent.offset)


@pytest.mark.stack
async def test_new_topic_has_the_partitions_asked_for(kafka_bootstrap: str,
                                                      new_topic: Callable[..., Awaitable[str]]) -> None:
    topic = await new_topic(partitions=5)
    producer = AIOKafkaProducer(bootstrap_servers=kafka_bootstrap)
    await producer.start()
    try:
        assert await producer.partitions_for(topic) == set(range(5))
    finally:
        await producer.stop()
    assert stack.kafka_topics(kafka_bootstrap, timeout=5) is not None
    assert (stack.kafka_topics(kafka_bootstrap, timeout=5) or {})[topic] == 5


@pytest.mark.stack
async def test_redis_pubsub_and_stream_round_trip(redis_url: str) -> None:
    r = aioredis.Redis.from_url(redis_url)
    channel, stream = unique_name("events"), unique_name("stream")
    try:
        pubsub = r.pubsub()
        await pubsub.subscribe(channel)
        subscribed = await pubsub.get_message(timeout=5)
        assert subscribed is not None and subscribed["type"] == "subscribe"
        assert await r.publish(channel, b'{"type":"chunk","seq":0}') == 1  # one subscriber: us
        message = await pubsub.get_message(ignore_subscribe_messages=True, timeout=5)
        assert message is not None and message["data"] == b'{"type":"chunk","seq":0}'
        await pubsub.aclose()

        first = await r.xadd(stream, {"data": b"e0"}, maxlen=100)
        second = await r.xadd(stream, {"data": b"e1"}, maxlen=100)
        await r.expire(stream, 60)
        entries = await r.xrange(stream, "0-0", "+")
        assert entries == [(first, {b"data": b"e0"}), (second, {b"data": b"e1"})]
        assert 0 < await r.ttl(stream) <= 60
    finally:
        await r.delete(stream)
        await r.aclose()


@pytest.mark.stack
def test_status_reports_up_and_up_again_changes_nothing(stack_services: Endpoints) -> None:
    if stack_services.source != "stack":
        pytest.skip(f"Kafka/Redis came from {stack_services.source}, not devstack")
    cfg = stack.StackConfig.from_env()
    before = stack.status(cfg)
    assert before.up and before.kafka.pid and before.redis.pid
    assert before.topics[cfg.job_topic] >= 1 and cfg.dlq_topic in before.topics
    again = stack.up(cfg)
    assert again.started == [] and again.elapsed_s < 5
    assert (again.status.kafka.pid, again.status.redis.pid) == (before.kafka.pid, before.redis.pid)
    assert again.env() == {"KAFKA_BOOTSTRAP_SERVERS": stack_services.kafka_bootstrap,
                           "REDIS_URL": stack_services.redis_url}


@pytest.mark.stack
@pytest.mark.slow
def test_cli_lifecycle_on_other_ports(stack_services: Endpoints, tmp_path: Path) -> None:
    """A second stack, through ops/stack: up prints the env lines, status exits 0, down stops both."""
    if stack_services.source != "stack":
        pytest.skip("needs the local launcher (Java, Maven cache), not containers or given servers")
    env = {**os.environ, "STOKER_STACK_DIR": str(tmp_path), "STOKER_KAFKA_PORT": "29192",
           "STOKER_KAFKA_CONTROLLER_PORT": "29193", "STOKER_REDIS_PORT": "26479", "STOKER_JOB_PARTITIONS": "2"}

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([str(ROOT / "ops" / "stack"), *args], env=env, capture_output=True, text=True,
                              timeout=180)

    try:
        started = run("up")
        assert started.returncode == 0, started.stderr
        assert started.stdout.splitlines() == ["KAFKA_BOOTSTRAP_SERVERS=127.0.0.1:29192",
                                               "REDIS_URL=redis://127.0.0.1:26479/0"]
        assert "stoker.jobs (2 partitions)" in started.stderr
        cfg = stack.StackConfig.from_env(env)
        pids = stack.status(cfg).kafka.pid, stack.status(cfg).redis.pid
        assert all(pids) and run("status").returncode == 0
    finally:
        stopped = run("down", "--wipe")
    assert stopped.returncode == 0 and "stopped kafka, redis" in stopped.stderr
    deadline = time.monotonic() + 5
    while any(Path(f"/proc/{pid}").exists() and stack._alive(pid) for pid in pids if pid):
        assert time.monotonic() < deadline, f"{pids} still running after down"
        time.sleep(0.1)
    status = run("status")
    assert status.returncode == 3 and status.stdout == "" and "down" in status.stderr


def _redis_kill_9(pid: int) -> None:
    os.kill(pid, signal.SIGKILL)
    while stack._alive(pid):
        time.sleep(0.02)


@pytest.mark.parametrize(("persistence", "kept"), [("always", True), ("everysec", True), ("none", False)])
def test_private_redis_keeps_a_result_across_kill_9_with_aof(persistence: str, kept: bool, tmp_path: Path) -> None:
    """The launcher's Redis with `--redis-persistence always` (AOF, fsync per write) keeps a result key across
    a crash and restart; with `none` (the old only choice) every result is gone. everysec may lose the last
    second; here the write is older than that."""
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed")
    import redis

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cfg = stack.StackConfig(stack_dir=tmp_path, redis_port=port, redis_persistence=persistence)
    pid = stack._start_redis(cfg)
    try:
        client = redis.Redis(port=port)
        client.set("stoker:result:r1", b'{"type":"done"}', ex=3600)
        assert client.config_get("appendonly")["appendonly"] == ("no" if persistence == "none" else "yes")
        assert stack._running_persistence(port) == persistence  # what `up` compares with the asked-for one
        if persistence == "everysec":
            time.sleep(1.5)
        client.close()
        _redis_kill_9(pid)
        pid = stack._start_redis(cfg)
        client = redis.Redis(port=port)
        assert client.get("stoker:result:r1") == (b'{"type":"done"}' if kept else None)
        assert 0 < client.ttl("stoker:result:r1") <= 3600 or not kept
        client.close()
        assert any(cfg.redis_dir.glob("appendonly*")) is kept  # the AOF lives in the stack's data dir
    finally:
        _redis_kill_9(pid)


def test_kafka_storage_formats_with_a_cluster_id_that_starts_with_a_dash(
        stack_services: Endpoints, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """One random cluster id in 64 starts with '-'; passed as `-t ID` the broker's format tool read it as an
    option and the stack failed to start (seen once in a fault run)."""
    if stack_services.source != "stack":
        pytest.skip("needs the local launcher (Java, Maven cache), not containers or given servers")
    monkeypatch.setattr(stack.secrets, "token_bytes", lambda n: b"\xf8" * n)  # base64 "-..."
    ports = []
    for _ in range(3):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            ports.append(s.getsockname()[1])
    cfg = stack.StackConfig(stack_dir=tmp_path, kafka_port=ports[0], controller_port=ports[1], redis_port=ports[2])
    try:
        stack.up(cfg)
        meta = (tmp_path / "kafka" / "data" / "meta.properties").read_text()
        assert "cluster.id=-" in meta
        assert stack.kafka_topics(cfg.kafka_bootstrap) is not None
    finally:
        stack.down(cfg, wipe=True)
