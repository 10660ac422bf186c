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
import urllib.request
import uuid
from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import openai
import pytest
from stoker.client.client import Client
from stoker.schemas import Done, default_batch_topic
from test_gateway import free_port
from worker_harness import create_topics

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.stack


class BatchStack:
    """A job topic, its batch topic, a Redis prefix and a storage folder of one test; a worker on the job
    topic, which reads its batch sibling below it; gateway replicas as subprocesses."""

    def __init__(self, bootstrap: str, redis_url: str, storage: Path):
        tag = uuid.uuid4().hex[:10]
        self.bootstrap, self.redis_url, self.storage = bootstrap, redis_url, storage
        self.topic, self.prefix = f"test.batch.{tag}", f"bt{tag}"
        self.batch_topic = default_batch_topic(self.topic)
        self.worker: subprocess.Popen[bytes] | None = None
        self.other_workers: list[subprocess.Popen[bytes]] = []  # workers of other groups (routing tests)
        self.gateways: dict[int, subprocess.Popen[bytes]] = {}  # port -> process
        self.logs = Path(os.environ.get("TMPDIR", "/tmp")) / f"stoker-batch-{tag}"
        self.logs.mkdir(parents=True, exist_ok=True)

    async def create_topics(self) -> None:
        await create_topics(self.bootstrap, {self.topic: 2, self.topic + ".dlq": 1, self.batch_topic: 4})

    def env(self, **extra: str) -> dict[str, str]:
        return dict(os.environ, KAFKA_BOOTSTRAP_SERVERS=self.bootstrap, REDIS_URL=self.redis_url,
                    STOKER_PREFIX=self.prefix, PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1", **extra)

    async def start_worker(self, model: Path | None = None, step_delay_s: float = 0.0, **extra: str) -> None:
        """A worker of the job topic: the gateway routes the batch's model to that topic (its heartbeat) and
        produces the lines to the batch sibling, which the worker reads by default."""
        engine = ({"STOKER_MODEL": str(model), "STOKER_DEVICE": "cpu"} if model is not None else
                  {"STOKER_FAKE_ENGINE": "1", "STOKER_FAKE_STEP_DELAY_S": str(step_delay_s)})
        env = self.env(STOKER_JOB_TOPIC=self.topic, STOKER_GROUP_ID=f"g-{self.prefix}",
                       STOKER_METRICS_PORT="-1", **engine, **extra)
        with open(self.logs / "worker.log", "ab") as out:
            self.worker = subprocess.Popen([sys.executable, "-m", "stoker.worker.main"], cwd=ROOT, env=env,
                                           stdout=out, stderr=subprocess.STDOUT)
        await self._wait_for_worker()

    async def start_group(self, topic: str, model: str) -> None:
        """A stand-in worker of another group, on `topic` (and its batch sibling), serving `model`."""
        env = self.env(STOKER_JOB_TOPIC=topic, STOKER_GROUP_ID=f"g-{self.prefix}-{model}", STOKER_METRICS_PORT="-1",
                       STOKER_FAKE_ENGINE="1", STOKER_SERVED_MODEL_NAME=model)
        with open(self.logs / f"worker-{model}.log", "ab") as out:
            self.other_workers.append(subprocess.Popen([sys.executable, "-m", "stoker.worker.main"], cwd=ROOT,
                                                       env=env, stdout=out, stderr=subprocess.STDOUT))
        await self._wait_for_worker(1 + len(self.other_workers))

    async def _wait_for_worker(self, count: int = 1) -> None:
        async with self.client() as c:
            for _ in range(900):
                if len(await c.workers()) >= count:
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
        return Client(self.bootstrap, self.redis_url, prefix=self.prefix, topic=self.topic)

    async def metric(self, port: int, name: str, label: str = "") -> float:
        def scrape() -> str:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
                return str(resp.read().decode())
        text = await asyncio.to_thread(scrape)
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith(name) and label in line and not line.startswith("#"))

    def stop(self) -> None:
        for proc in [*self.gateways.values(), *([self.worker] if self.worker else []), *self.other_workers]:
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


# ---- durability, cancel, bad input, replicas (the stand-in engine: steps slow enough to act mid-batch) -----------
async def test_gateway_killed_mid_batch_finishes_after_restart(stack: BatchStack) -> None:
    """SIGKILL the gateway while lines are out; a new one on the same storage path and Redis takes the batch
    over (after the lease's TTL) and finishes it: every line once in the output file, and every job run
    once by the worker (attempt 1: a line produced again was never run again)."""
    await stack.start_worker(step_delay_s=0.02)
    port = await stack.start_gateway(None, "--batch-max-in-flight", "40")
    total = 400
    async with stack.oai(port) as oai:
        batch_id = await submit(oai, jsonl([chat_line(i, max_tokens=6) for i in range(total)]))
        before = await wait_for(oai, batch_id, lambda b: b.request_counts.completed >= 80)
    assert not finished(before), "the batch finished before the kill: make it longer"
    stack.kill_gateway(port)
    again = await stack.start_gateway(port)
    async with stack.oai(again) as oai:
        batch = await wait_for(oai, batch_id, finished, timeout=180)
        assert batch.status == "completed" and batch.request_counts.completed == total, batch
        output = await lines_of(oai, batch.output_file_id)
    once_each(output, {f"req-{i}" for i in range(total)})
    dones = await results_in_redis(stack, batch_id, total)
    assert {d.attempt for d in dones} == {1}
    assert {r["custom_id"]: r["response"]["body"]["choices"][0]["message"]["content"] for r in output} == {
        f"req-{n - 1}": d.text for n, d in enumerate(dones, start=1)}  # each line's own job's answer


async def test_cancel_stops_the_remaining_lines(stack: BatchStack) -> None:
    await stack.start_worker(step_delay_s=0.05)
    port = await stack.start_gateway(None, "--batch-max-in-flight", "20")
    total = 300
    async with stack.oai(port) as oai:
        batch_id = await submit(oai, jsonl([chat_line(i, max_tokens=8) for i in range(total)]))
        await wait_for(oai, batch_id, lambda b: b.request_counts.completed >= 20)
        cancelling = await oai.batches.cancel(batch_id)
        assert cancelling.status == "cancelling" and cancelling.cancelling_at is not None
        batch = await wait_for(oai, batch_id, finished, timeout=90)
        output, errors = await lines_of(oai, batch.output_file_id), await lines_of(oai, batch.error_file_id)
        again = await oai.batches.cancel(batch_id)  # cancelling a cancelled batch changes nothing
        assert again.status == "cancelled" and again.request_counts == batch.request_counts
    counts = batch.request_counts
    assert batch.status == "cancelled" and batch.cancelled_at is not None
    assert counts.total == total and counts.completed + counts.failed == total
    assert counts.completed == len(output) < total - 100 and counts.failed == len(errors)
    assert {e["error"]["code"] for e in errors} == {"batch_cancelled"}
    once_each(output + errors, {f"req-{i}" for i in range(total)})
    produced = await stack.metric(port, "stoker_gateway_batch_jobs_produced_total")
    assert produced < total - 100, f"{produced} lines were produced after a cancel at ~20 of {total}"


async def test_not_jsonl_is_400_and_bad_lines_land_in_the_error_file(stack: BatchStack) -> None:
    await stack.start_worker()
    port = await stack.start_gateway()
    async with stack.oai(port) as oai:
        for bad, says in ((b'{"custom_id": "a"}\nnot json at all\n', "line 2 is not JSON"),
                          (b"\xff\xfe binary", "not UTF-8"), (b"[1, 2]\n", "not an object"), (b"\n\n", "no requests")):
            with pytest.raises(openai.BadRequestError) as info:
                await oai.files.create(file=("bad.jsonl", bad), purpose="batch")
            assert says in str(info.value.body), info.value.body
        with pytest.raises(openai.BadRequestError):
            await oai.files.create(file=("ok.jsonl", jsonl([chat_line(0)])), purpose="fine-tune")
        good = [chat_line(0), chat_line(1)]
        bad_lines = [
            (chat_line(0), "duplicate_custom_id"),  # custom_id of line 1 again: line 1 runs, this one does not
            ({**chat_line(2), "url": "/v1/embeddings"}, "invalid_url"),
            ({"method": "POST", "url": "/v1/chat/completions", "body": chat_line(3)["body"]}, "missing_custom_id"),
            (chat_line(4, stream=True), "unsupported"),
            (chat_line(5, temperature=-1), "invalid_job"),  # the contract's own range check
            (chat_line(6, n=2), "unsupported"),
            (chat_line(7, frobnicate=1), "unsupported"),
            ({**chat_line(8), "body": "not an object"}, "invalid_body"),
        ]
        batch_id = await submit(oai, jsonl(good + [line for line, _ in bad_lines]))
        batch = await wait_for(oai, batch_id, finished, timeout=60)
        assert batch.status == "completed" and batch.request_counts is not None
        assert (batch.request_counts.total, batch.request_counts.completed, batch.request_counts.failed) == (10, 2, 8)
        output, errors = await lines_of(oai, batch.output_file_id), await lines_of(oai, batch.error_file_id)
        error_file = await oai.files.retrieve(batch.error_file_id or "")
        assert error_file.purpose == "batch_output" and error_file.bytes > 0
        with pytest.raises(openai.ConflictError):  # a completed batch has nothing left to cancel
            await oai.batches.cancel(batch_id)
        assert [b.id async for b in oai.batches.list(limit=1)] == [batch_id]  # the list pages through `after`
    once_each(output, {"req-0", "req-1"})
    assert [e["error"]["code"] for e in errors] == [code for _, code in bad_lines]
    assert [e["custom_id"] for e in errors] == ["req-0", "req-2", None, "req-4", "req-5", "req-6", "req-7", "req-8"]
    assert all(e["response"] is None or e["response"]["status_code"] >= 400 for e in errors)
    assert "line 5" in errors[2]["error"]["message"] and "temperature" in errors[4]["error"]["message"]
    small = await stack.start_gateway(None, "--max-upload-bytes", "300", "--batch-max-requests", "2")
    async with stack.oai(small) as oai:
        with pytest.raises(openai.APIStatusError) as too_big:
            await oai.files.create(file=("big.jsonl", jsonl([chat_line(i) for i in range(3)])), purpose="batch")
        assert too_big.value.status_code == 413
        with pytest.raises(openai.BadRequestError, match="more than 2 requests"):
            await oai.files.create(file=("many.jsonl", b'{"custom_id": "a"}\n' * 3), purpose="batch")


async def test_files_list_retrieve_delete_and_expiry(stack: BatchStack) -> None:
    await stack.start_worker()
    port = await stack.start_gateway()
    async with stack.oai(port) as oai:
        first = await oai.files.create(file=("a.jsonl", jsonl([chat_line(0)])), purpose="batch")
        second = await oai.files.create(file=("b.jsonl", jsonl([chat_line(1)])), purpose="batch",
                                        expires_after={"anchor": "created_at", "seconds": 3600})
        assert second.expires_at == second.created_at + 3600 and first.filename == "a.jsonl"
        listed = [f.id async for f in oai.files.list(purpose="batch", limit=1)]  # pages of one, via `after`
        assert listed == [second.id, first.id] or listed == [first.id, second.id]
        assert (await oai.files.content(first.id)).content == jsonl([chat_line(0)])
        deleted = await oai.files.delete(first.id)
        assert deleted.deleted and deleted.id == first.id
        with pytest.raises(openai.NotFoundError):
            await oai.files.retrieve(first.id)
        with pytest.raises(openai.NotFoundError):
            await oai.batches.create(input_file_id=first.id, endpoint="/v1/chat/completions",
                                     completion_window="24h")
        with pytest.raises(openai.BadRequestError):
            await oai.batches.create(input_file_id=second.id, endpoint="/v1/chat/completions",
                                     completion_window="forever")  # type: ignore[arg-type]
    meta_path = stack.storage / "files" / f"{second.id}.json"  # as if an hour had passed
    meta = json.loads(meta_path.read_text())
    meta_path.write_text(json.dumps(meta | {"expires_at": int(time.time()) - 1}))
    async with stack.oai(port) as oai:
        with pytest.raises(openai.NotFoundError):
            await oai.files.retrieve(second.id)
        assert second.id not in [f.id async for f in oai.files.list()]


async def test_window_end_expires_the_lines_not_answered(stack: BatchStack) -> None:
    """completion_window becomes each job's deadline: lines not answered by then are error lines with code
    batch_expired (those out end at the worker with finish_reason deadline) and the batch is expired. The
    first 20 lines take 2 steps of 50 ms, the rest 400 steps (20 s): those out when the 6 s window ends are
    cut mid-run whatever the machine's load."""
    await stack.start_worker(step_delay_s=0.05)
    port = await stack.start_gateway(None, "--batch-max-in-flight", "10")
    lines = [chat_line(i, max_tokens=2 if i < 20 else 400) for i in range(200)]
    async with stack.oai(port) as oai:
        batch_id = await submit(oai, jsonl(lines), window="6s")
        batch = await wait_for(oai, batch_id, finished, timeout=60)
        output, errors = await lines_of(oai, batch.output_file_id), await lines_of(oai, batch.error_file_id)
    assert batch.status == "expired" and batch.expired_at is not None
    assert 0 < len(output) < 200 and batch.request_counts.failed == len(errors) == 200 - len(output)
    assert {e["error"]["code"] for e in errors} == {"batch_expired"}
    once_each(output + errors, {f"req-{i}" for i in range(200)})
    # The jobs out when the window closed end at the worker with finish_reason deadline; on a loaded machine
    # the worker may reach them a little after the gateway closed the batch, so look for a while.
    deadlines: list[Done] = []
    for _ in range(60):
        found = await results_in_redis_some(stack, batch_id, 200)
        if deadlines := [d for d in found if d.finish_reason == "deadline"]:
            break
        await asyncio.sleep(0.25)
    assert deadlines, "no line was stopped by its job's deadline at the worker"


async def results_in_redis_some(stack: BatchStack, batch_id: str, lines: int) -> list[Done]:
    async with stack.client() as c:
        found = [await c.result(f"{batch_id}:{n}") for n in range(1, lines + 1)]
    return [d for d in found if isinstance(d, Done)]


async def test_two_replicas_one_gathers_and_the_other_takes_over(stack: BatchStack) -> None:
    """Two gateways on one storage path and Redis: one holds the batch's lease and gathers, both serve it;
    when the holder is killed the other takes the batch over and finishes it."""
    await stack.start_worker(step_delay_s=0.05)
    ports = [await stack.start_gateway(None, "--batch-max-in-flight", "30") for _ in range(2)]
    total = 600  # 20 rounds of 30 lines, each 8 steps of 50 ms: some 10 s
    async with stack.oai(ports[0]) as a, stack.oai(ports[1]) as b:
        batch_id = await submit(a, jsonl([chat_line(i, max_tokens=8) for i in range(total)]))
        await wait_for(b, batch_id, lambda batch: batch.request_counts.completed >= 60)
        await asyncio.sleep(3)  # over the scan interval (2 s): the other replica has looked at the batch
        gathered = [await stack.metric(p, "stoker_gateway_batch_lines_gathered_total") for p in ports]
        assert sorted(gathered)[0] == 0 and sorted(gathered)[1] >= 60, gathered  # one gathers, one serves
        assert not finished(await b.batches.retrieve(batch_id)), "the batch ended before the kill: make it longer"
        holder, other = (ports[0], b) if gathered[0] else (ports[1], a)
        stack.kill_gateway(holder)
        batch = await wait_for(other, batch_id, finished, timeout=180)
        assert batch.status == "completed" and batch.request_counts.completed == total
        output = await lines_of(other, batch.output_file_id)
    once_each(output, {f"req-{i}" for i in range(total)})
    survivor = next(p for p in ports if p != holder)
    assert await stack.metric(survivor, "stoker_gateway_batch_leases_total") == 1


async def test_stoker_batch_cli_submits_follows_and_writes_the_files(stack: BatchStack, tmp_path: Path) -> None:
    await stack.start_worker()
    port = await stack.start_gateway()
    source = tmp_path / "work.jsonl"
    source.write_bytes(jsonl([chat_line(i) for i in range(30)] + [chat_line(3)]))  # the last: a duplicate
    cli = [sys.executable, "-m", "stoker.client.cli", "batch", "--gateway", f"http://127.0.0.1:{port}/v1",
           "--poll", "0.2"]
    done = await asyncio.to_thread(subprocess.run, [*cli, str(source)], cwd=ROOT, env=stack.env(),
                                   capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    output = [json.loads(x) for x in (tmp_path / "work.output.jsonl").read_text().splitlines()]
    errors = [json.loads(x) for x in (tmp_path / "work.errors.jsonl").read_text().splitlines()]
    once_each(output, {f"req-{i}" for i in range(30)})
    assert [e["error"]["code"] for e in errors] == ["duplicate_custom_id"]
    assert "30 of 31 answered, 1 in the error file" in done.stderr
    batch_id = done.stderr.split("batch ", 1)[1].split()[0]
    again = await asyncio.to_thread(subprocess.run, [*cli, "--follow", batch_id, "-o", str(tmp_path / "again.jsonl"),
                                                     "--no-progress"], cwd=ROOT, env=stack.env(), capture_output=True,
                                    text=True, timeout=60)
    assert again.returncode == 0 and (tmp_path / "again.jsonl").read_bytes() == (tmp_path / "work.output.jsonl").read_bytes()
    assert (tmp_path / "again.errors.jsonl").exists()
    nobody = await asyncio.to_thread(subprocess.run, [*cli[:4], "--gateway", f"http://127.0.0.1:{free_port()}/v1",
                                                      str(source)], cwd=ROOT, env=stack.env(), capture_output=True,
                                     text=True, timeout=60)
    assert nobody.returncode == 4 and "unreachable" in nobody.stderr


async def test_lease_lost_mid_batch_is_taken_again_and_nothing_is_lost(stack: BatchStack) -> None:
    """Redis forgetting the lease (a restart without persistence) stops the gatherer at its next renewal;
    the next scan takes the batch again from the storage path and finishes it, each line once."""
    await stack.start_worker(step_delay_s=0.02)
    port = await stack.start_gateway(None, "--batch-max-in-flight", "40")
    total = 400
    async with stack.oai(port) as oai:
        batch_id = await submit(oai, jsonl([chat_line(i, max_tokens=6) for i in range(total)]))
        await wait_for(oai, batch_id, lambda b: b.request_counts.completed >= 80)
        async with stack.client() as c:
            assert await c.redis.delete(f"{stack.prefix}:batch-lease:{batch_id}") == 1
        batch = await wait_for(oai, batch_id, finished, timeout=120)
        output = await lines_of(oai, batch.output_file_id)
    assert batch.status == "completed" and batch.request_counts.completed == total
    once_each(output, {f"req-{i}" for i in range(total)})
    assert await stack.metric(port, "stoker_gateway_batch_leases_total") == 2  # taken, lost, taken again


async def test_each_line_goes_to_the_group_that_serves_its_model(stack: BatchStack) -> None:
    """Two worker groups, each on a topic of its own with a model of its own: each line goes to the batch
    sibling of the topic whose workers serve its model (a line sent to the other group would end
    unknown_model, an error line); a line whose model no group serves is never produced and expires."""
    other = f"{stack.topic}.other"
    await create_topics(stack.bootstrap, {other: 2, other + ".dlq": 1, default_batch_topic(other): 2})
    await stack.start_worker(STOKER_SERVED_MODEL_NAME="alpha")
    await stack.start_group(other, "beta")
    port = await stack.start_gateway()
    models = ["alpha", "beta"] * 20 + ["gamma"] * 3  # mixed in one file; gamma last: it holds what follows it
    lines = [chat_line(i, model=model) for i, model in enumerate(models)]
    async with stack.oai(port) as oai:
        batch_id = await submit(oai, jsonl(lines), window="8s")
        batch = await wait_for(oai, batch_id, finished, timeout=60)
        output, errors = await lines_of(oai, batch.output_file_id), await lines_of(oai, batch.error_file_id)
    assert batch.status == "expired" and batch.request_counts.completed == 40 and batch.request_counts.failed == 3
    once_each(output + errors, {f"req-{i}" for i in range(len(models))})
    by_id = {record["custom_id"]: record for record in output}
    for i, model in enumerate(models[:40]):
        assert by_id[f"req-{i}"]["response"]["body"]["model"] == model  # answered by its own group
    assert {e["custom_id"] for e in errors} == {"req-40", "req-41", "req-42"}
    assert {e["error"]["code"] for e in errors} == {"batch_expired"}
    async with stack.client() as c:  # gamma's lines never became jobs
        assert not any([await c.known(f"{batch_id}:{line}") for line in (41, 42, 43)])  # lines count from 1
        assert await c.known(f"{batch_id}:40")


async def topic_records(bootstrap: str, topic: str) -> int:
    """Records ever produced to `topic` (the sum of its partitions' end offsets)."""
    from aiokafka import AIOKafkaConsumer, TopicPartition

    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap)
    await consumer.start()
    try:
        cluster = await consumer._client.fetch_all_metadata()  # noqa: SLF001 -- a fresh client's metadata
        parts = [TopicPartition(topic, p) for p in cluster.partitions_for_topic(topic) or set()]
        return sum((await consumer.end_offsets(parts)).values())
    finally:
        await consumer.stop()


async def test_lines_go_to_the_custom_batch_topic_the_workers_read(stack: BatchStack) -> None:
    """A worker group with its own --batch-topic says so in its heartbeat, and the gateway sends the batch's
    lines there: the default sibling (which exists, and nobody reads) gets none."""
    custom = f"{stack.topic}.bulk"
    await create_topics(stack.bootstrap, {custom: 2})
    await stack.start_worker(STOKER_BATCH_TOPIC=custom)
    port = await stack.start_gateway()
    async with stack.oai(port) as oai:
        batch_id = await submit(oai, jsonl([chat_line(i) for i in range(10)]), window="20s")
        batch = await wait_for(oai, batch_id, finished, timeout=60)
        output = await lines_of(oai, batch.output_file_id)
    assert batch.status == "completed" and batch.request_counts.completed == 10
    once_each(output, {f"req-{i}" for i in range(10)})
    assert await topic_records(stack.bootstrap, custom) == 10
    assert await topic_records(stack.bootstrap, stack.batch_topic) == 0


async def test_lines_wait_while_the_workers_read_no_batch_topic(stack: BatchStack) -> None:
    """Workers started with --no-batch-topic read no batch topic: the gateway produces no line (none would
    ever be read) and they expire with the window."""
    await stack.start_worker(STOKER_NO_BATCH_TOPIC="1")
    port = await stack.start_gateway()
    async with stack.oai(port) as oai:
        batch_id = await submit(oai, jsonl([chat_line(i) for i in range(5)]), window="4s")
        batch = await wait_for(oai, batch_id, finished, timeout=60)
        errors = await lines_of(oai, batch.error_file_id)
    assert batch.status == "expired" and {e["error"]["code"] for e in errors} == {"batch_expired"}
    assert len(errors) == 5
    assert await topic_records(stack.bootstrap, stack.batch_topic) == 0
