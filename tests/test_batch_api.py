"""The Batch API end to end, driven by the official `openai` client: real Kafka, real Redis, a real worker
process on the batch topic (the stand-in engine, or the real engine on CPU with a small model) and the
gateway as a real subprocess (`python -m stoker.gateway.app`), so it can be SIGKILLed mid-batch."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
import uuid
import urllib.request
from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import openai
import pytest
from stoker.client.client import Client
from stoker.schemas import Done, default_batch_topic

from tests.test_gateway import free_port
from tests.worker_harness import create_topics

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.stack


class BatchStack:
    """A job topic, its batch topic, a Redis prefix and a storage folder of one test; a worker on the batch
    topic; gateway replicas as subprocesses."""

    def __init__(self, bootstrap: str, redis_url: str, storage: Path):
        tag = uuid.uuid4().hex[:10]
        self.bootstrap, self.redis_url, self.storage = bootstrap, redis_url, storage
        self.topic, self.prefix = f"test.batch.{tag}", f"bt{tag}"
        self.batch_topic = default_batch_topic(self.topic)
        self.worker: subprocess.Popen[bytes] | None = None
        self.gateways: dict[int, subprocess.Popen[bytes]] = {}  # port -> process
        self.logs = Path(os.environ.get("TMPDIR", "/tmp")) / f"stoker-batch-{tag}"
        self.logs.mkdir(parents=True, exist_ok=True)

    async def create_topics(self) -> None:
        await create_topics(self.bootstrap, {self.topic: 2, self.batch_topic: 4, self.batch_topic + ".dlq": 1})

    def env(self, **extra: str) -> dict[str, str]:
        return dict(os.environ, KAFKA_BOOTSTRAP_SERVERS=self.bootstrap, REDIS_URL=self.redis_url,
                    STOKER_PREFIX=self.prefix, PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1", **extra)

    async def start_worker(self, model: Path | None = None, step_delay_s: float = 0.0, **extra: str) -> None:
        """The worker reads the batch topic as its job topic (until workers read both by weight)."""
        engine = ({"STOKER_MODEL": str(model), "STOKER_DEVICE": "cpu"} if model is not None else
                  {"STOKER_FAKE_ENGINE": "1", "STOKER_FAKE_STEP_DELAY_S": str(step_delay_s)})
        env = self.env(STOKER_JOB_TOPIC=self.batch_topic, STOKER_GROUP_ID=f"g-{self.prefix}",
                       STOKER_METRICS_PORT="-1", **engine, **extra)
        with open(self.logs / "worker.log", "ab") as out:
            self.worker = subprocess.Popen([sys.executable, "-m", "stoker.worker.main"], cwd=ROOT, env=env,
                                           stdout=out, stderr=subprocess.STDOUT)
        await self._wait_for_worker()

    async def _wait_for_worker(self) -> None:
        async with self.client() as c:
            for _ in range(900):
                if await c.workers():
                    return
                assert self.worker is not None
                if self.worker.poll() is not None:
                    break
                await asyncio.sleep(0.1)
        raise RuntimeError(f"the worker did not come up: {(self.logs / 'worker.log').read_text()[-3000:]}")

    async def start_gateway(self, port: int | None = None, *args: str) -> int:
        port = port or free_port()
        cmd = [sys.executable, "-m", "stoker.gateway.app", "--port", str(port), "--job-topic", self.topic,
               "--storage-path", str(self.storage), "--batch-lease-ttl", "2", "--timeout", "60", *args]
        with open(self.logs / f"gateway-{port}.log", "ab") as out:
            self.gateways[port] = subprocess.Popen(cmd, cwd=ROOT, env=self.env(), stdout=out, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                await asyncio.to_thread(urllib.request.urlopen, f"http://127.0.0.1:{port}/health", timeout=1)
                return port
            except OSError:
                if self.gateways[port].poll() is not None:
                    break
                await asyncio.sleep(0.1)
        raise RuntimeError(f"gateway did not start: {(self.logs / f'gateway-{port}.log').read_text()[-3000:]}")

    def kill_gateway(self, port: int) -> None:
        proc = self.gateways.pop(port)
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)

    def oai(self, port: int) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=60)

    def client(self) -> Client:
        return Client(self.bootstrap, self.redis_url, prefix=self.prefix, topic=self.batch_topic)

    async def metric(self, port: int, name: str, label: str = "") -> float:
        def scrape() -> str:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
                return str(resp.read().decode())
        text = await asyncio.to_thread(scrape)
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith(name) and label in line and not line.startswith("#"))

    def stop(self) -> None:
        for proc in [*self.gateways.values(), *([self.worker] if self.worker else [])]:
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(20)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(5)


@pytest.fixture
async def stack(kafka_bootstrap: str, redis_url: str, tmp_path: Path) -> AsyncIterator[BatchStack]:
    s = BatchStack(kafka_bootstrap, redis_url, tmp_path / "storage")
    await s.create_topics()
    try:
        yield s
    finally:
        s.stop()


def chat_line(i: int, max_tokens: int = 4, **body: Any) -> dict[str, Any]:
    return {"custom_id": f"req-{i}", "method": "POST", "url": "/v1/chat/completions",
            "body": {"messages": [{"role": "user", "content": f"Tell me about item {i}"}], "max_tokens": max_tokens,
                     "temperature": 0, **body}}


def jsonl(lines: list[dict[str, Any]]) -> bytes:
    return b"".join(json.dumps(line).encode() + b"\n" for line in lines)


async def submit(oai: openai.AsyncOpenAI, data: bytes, window: str = "24h") -> str:
    uploaded = await oai.files.create(file=("batch.jsonl", data), purpose="batch")
    assert uploaded.purpose == "batch" and uploaded.bytes == len(data)
    batch = await oai.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                     completion_window=window, metadata={"test": "yes"})  # type: ignore[arg-type]
    assert batch.status in ("validating", "in_progress") and batch.metadata == {"test": "yes"}
    return batch.id


async def wait_for(oai: openai.AsyncOpenAI, batch_id: str, until: Any, timeout: float = 120) -> Any:
    """Polls batches.retrieve until `until(batch)` holds; the last batch seen."""
    deadline = time.monotonic() + timeout
    while True:
        batch = await oai.batches.retrieve(batch_id)
        if until(batch):
            return batch
        if time.monotonic() > deadline:
            raise AssertionError(f"batch {batch_id} did not get there in {timeout} s: {batch}")
        await asyncio.sleep(0.2)


def finished(batch: Any) -> bool:
    return batch.status in ("completed", "expired", "cancelled", "failed")


async def lines_of(oai: openai.AsyncOpenAI, file_id: str | None) -> list[dict[str, Any]]:
    if file_id is None:
        return []
    content = await oai.files.content(file_id)
    return [json.loads(line) for line in content.text.splitlines() if line.strip()]


def once_each(records: list[dict[str, Any]], expected: set[str]) -> None:
    counts = Counter(r["custom_id"] for r in records)
    twice = [c for c, n in counts.items() if n > 1]
    assert not twice, f"answered more than once: {twice[:5]}"
    assert set(counts) == expected, f"missing: {sorted(expected - set(counts))[:5]}, extra: {sorted(set(counts) - expected)[:5]}"


async def results_in_redis(stack: BatchStack, batch_id: str, lines: int) -> list[Done]:
    async with stack.client() as c:
        found = [await c.result(f"{batch_id}:{n}") for n in range(1, lines + 1)]
    assert all(isinstance(d, Done) for d in found)
    return found  # type: ignore[return-value]


# ---- the round trip on the real engine --------------------------------------------------------------------------
@pytest.fixture(scope="module")
def small_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    model = tmp_path_factory.mktemp("model") / "tiny"
    subprocess.run([sys.executable, "-m", "stoker.engine.make_model", str(model)], cwd=ROOT, check=True,
                   capture_output=True, timeout=120)
    return model


@pytest.mark.slow
async def test_thousand_lines_round_trip_on_the_real_engine(stack: BatchStack, small_model: Path) -> None:
    """files.create + batches.create + batches.retrieve (polling) + files.content: 1,000 lines, each custom_id
    answered exactly once, and a sample of bodies equal to a direct greedy request's text."""
    await stack.start_worker(model=small_model)
    port = await stack.start_gateway(None, "--batch-max-in-flight", "300")
    lines = [chat_line(i, max_tokens=3) for i in range(1000)]
    async with stack.oai(port) as oai:
        batch_id = await submit(oai, jsonl(lines))
        batch = await wait_for(oai, batch_id, finished, timeout=240)
        assert batch.status == "completed", batch
        assert batch.request_counts is not None and (batch.request_counts.total, batch.request_counts.completed,
                                                     batch.request_counts.failed) == (1000, 1000, 0)
        assert batch.error_file_id is None
        output = await lines_of(oai, batch.output_file_id)
    once_each(output, {f"req-{i}" for i in range(1000)})
    assert all(r["response"]["status_code"] == 200 and r["error"] is None for r in output)
    assert sum(r["response"]["body"]["usage"]["completion_tokens"] for r in output) == batch.usage.output_tokens
    by_id = {r["custom_id"]: r["response"]["body"] for r in output}
    async with stack.client() as c:
        for i in (0, 1, 499, 998):  # a direct request of the same line, on the same worker
            direct = await c.generate(messages=lines[i]["body"]["messages"], max_tokens=3, temperature=0)
            assert by_id[f"req-{i}"]["choices"][0]["message"]["content"] == direct.text
            assert by_id[f"req-{i}"]["object"] == "chat.completion"
