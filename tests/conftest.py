"""Shared fixtures: a real Kafka broker and Redis server for `stack` tests, per-test topics, GPU skipping.

Where Kafka and Redis come from, first that applies:
1. `KAFKA_BOOTSTRAP_SERVERS` / `REDIS_URL` in the environment (CI services, a stack you started yourself);
2. testcontainers, when a Docker engine answers a ping;
3. the local stack of `devstack/stack.py` (real Kafka + Redis processes, no Docker). `up` is idempotent, so a
   running stack is reused. A stack that a test session started is stopped by the last session to finish
   (sessions hold a shared lock on a file in the stack dir); one started by hand is left running.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
import re
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from stoker.devstack import stack

JOB_TOPIC, DLQ_TOPIC = stack.DEFAULT_JOB_TOPIC, stack.DEFAULT_DLQ_TOPIC


# ------------------------------------------------------------------------------------------------
# The demo's tiny model (stoker.engine.make_model's preset, our own code, no transformers), written once per
# test module that asks for it: the worker tests that run a real engine on the CPU.


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    out = tmp_path_factory.mktemp("model") / "tiny"
    subprocess.run([sys.executable, "-m", "stoker.engine.make_model", str(out), "--preset", "tiny"],
                   cwd=Path(__file__).resolve().parent.parent, check=True, capture_output=True)
    return str(out)


# ------------------------------------------------------------------------------------------------
# GPU tests: skipped without CUDA; torch is imported only when such a test was collected.


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    gpu_items = [item for item in items if item.get_closest_marker("gpu")]
    if not gpu_items:
        return
    import torch  # lazily: most suites (schemas, client, stack) never need it

    if not torch.cuda.is_available():
        skip = pytest.mark.skip(reason="needs a CUDA GPU (torch.cuda.is_available() is False)")
        for item in gpu_items:
            item.add_marker(skip)


# ------------------------------------------------------------------------------------------------
# The kernel files' interpreter runs, started together before the first test (tests/interpreter_runs.py).


def pytest_collection_finish(session: pytest.Session) -> None:
    if os.environ.get("TRITON_INTERPRET") == "1" or session.config.option.collectonly:
        return  # an interpreter run itself (its driver tests skip), or nothing will run
    files = sorted({str(item.path) for item in session.items if item.name.endswith("_under_triton_interpreter")})
    if not files:
        return
    import interpreter_runs

    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        reporter.write_line(f"[interpreter] running {len(files)} kernel files under TRITON_INTERPRET=1 before the "
                            "tests, as many at once as there are cores")
    wall = interpreter_runs.run_all(files)
    if reporter is not None:
        reporter.write_line(f"[interpreter] done in {wall:.0f} s")


# ------------------------------------------------------------------------------------------------
# Kafka + Redis for the session.


@dataclass(frozen=True, slots=True)
class Endpoints:
    kafka_bootstrap: str
    redis_url: str
    source: str  # "env", "testcontainers" or "stack": which of the three provided them


def _docker_answers() -> bool:
    """A quick ping, never a hang: no engine here is the common case."""
    if not (os.environ.get("DOCKER_HOST") or Path("/var/run/docker.sock").exists()):
        return False
    try:
        import docker

        client = docker.from_env(timeout=3)
        try:
            return bool(client.ping())
        finally:
            client.close()
    except Exception:  # any failure to reach an engine means "no Docker": fall through to the local stack
        return False


@contextlib.contextmanager
def _containers() -> Iterator[tuple[str, str]]:
    from testcontainers.kafka import KafkaContainer
    from testcontainers.redis import RedisContainer

    with KafkaContainer().with_kraft() as kafka, RedisContainer() as redis:
        redis_url = f"redis://{redis.get_container_host_ip()}:{redis.get_exposed_port(6379)}/0"
        yield kafka.get_bootstrap_server(), redis_url


@contextlib.contextmanager
def _local_stack() -> Iterator[tuple[str, str]]:
    cfg = stack.StackConfig.from_env()
    cfg.stack_dir.mkdir(parents=True, exist_ok=True)
    marker = cfg.stack_dir / "started-by-tests"
    with open(cfg.stack_dir / "test-sessions.lock", "a") as lease:
        fcntl.flock(lease, fcntl.LOCK_SH)  # "a test session is using this stack"
        info = stack.up(cfg)
        if info.started:
            marker.touch()
        try:
            yield info.kafka_bootstrap, info.redis_url
        finally:
            # Last session out stops a stack that tests started; any other holder of the lease blocks this.
            try:
                fcntl.flock(lease, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                pass
            else:
                if marker.exists():
                    stack.down(cfg)
                    marker.unlink(missing_ok=True)
            fcntl.flock(lease, fcntl.LOCK_UN)


@pytest.fixture(scope="session")
def stack_services() -> Iterator[Endpoints]:
    env_kafka, env_redis = os.environ.get("KAFKA_BOOTSTRAP_SERVERS"), os.environ.get("REDIS_URL")
    with contextlib.ExitStack() as exit_stack:
        if env_kafka and env_redis:
            kafka, redis_url, source = env_kafka, env_redis, "env"
        else:
            if _docker_answers():
                kafka, redis_url = exit_stack.enter_context(_containers())
                source = "testcontainers"
            else:
                kafka, redis_url = exit_stack.enter_context(_local_stack())
                source = "stack"
            kafka, redis_url = env_kafka or kafka, env_redis or redis_url  # one variable set: it wins
        # Idempotent; the local stack made them already, the other sources may not have.
        stack.ensure_topics(kafka, {JOB_TOPIC: 4, DLQ_TOPIC: 1})
        yield Endpoints(kafka, redis_url, source)
        _delete_session_topics(kafka)


def _delete_session_topics(bootstrap: str) -> None:
    """The topics this session's stack tests made (tests/worker_harness.py records them); looked up in
    sys.modules so that this file never imports the Kafka client itself (the GPU machine runs without it).
    Best effort: a broker already gone only leaves them behind."""
    harness = sys.modules.get("worker_harness")
    if harness is None or not harness.CREATED_TOPICS:
        return
    try:
        asyncio.run(harness.delete_created_topics(bootstrap))
    except Exception as exc:  # noqa: BLE001 -- teardown must not fail the session
        print(f"\n[conftest] left {len(harness.CREATED_TOPICS)} test topics on {bootstrap}: {exc!r}")


@pytest.fixture(scope="session")
def kafka_bootstrap(stack_services: Endpoints) -> str:
    return stack_services.kafka_bootstrap


@pytest.fixture(scope="session")
def redis_url(stack_services: Endpoints) -> str:
    return stack_services.redis_url


# ------------------------------------------------------------------------------------------------
# Per-test topics: tests of every suite share one broker, so each test makes its own.


def unique_name(hint: str = "test") -> str:
    """A fresh topic / key prefix: `test.<hint>.<12 hex>`, only characters Kafka and Redis both accept."""
    hint = re.sub(r"[^A-Za-z0-9_-]+", "_", hint)[:60].strip("_") or "test"
    return f"test.{hint}.{uuid.uuid4().hex[:12]}"


async def create_topic(bootstrap: str, name: str, partitions: int = 1) -> str:
    """Create `name` (replication 1) and return once every partition has a leader; an existing topic is
    kept as it is. Runs the stdlib wire client in a thread, so it works against any of the three sources."""
    await asyncio.to_thread(stack.ensure_topics, bootstrap, {name: partitions})
    return name


async def delete_topics(bootstrap: str, names: list[str]) -> None:
    from aiokafka.admin import AIOKafkaAdminClient

    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        await admin.delete_topics(names)
    finally:
        await admin.close()


@pytest.fixture
async def new_topic(kafka_bootstrap: str, request: pytest.FixtureRequest
                    ) -> AsyncIterator[Callable[..., Awaitable[str]]]:
    """`name = await new_topic(partitions=4)`: a fresh topic for this test, deleted afterwards."""
    made: list[str] = []

    async def make(partitions: int = 1, name: str | None = None) -> str:
        made.append(await create_topic(kafka_bootstrap, name or unique_name(request.node.name), partitions))
        return made[-1]

    yield make
    if made:
        await delete_topics(kafka_bootstrap, made)
