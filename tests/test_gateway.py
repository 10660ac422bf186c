"""The OpenAI-compatible gateway, driven by the official `openai` package, over a live stack: real Kafka,
real Redis and a `stoker-worker` subprocess on the stand-in engine (STOKER_FAKE_ENGINE=1), each test module
with its own topic and Redis prefix."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import jsonschema
import openai
import pytest
import uvicorn
from redis.exceptions import ConnectionError as RedisConnectionError
from stoker.client.client import Client, WorkerInfo
from stoker.gateway.app import create_app
from stoker.schemas import Done

ROOT = Path(__file__).resolve().parents[1]
STEP_DELAY_S = 0.02  # the stand-in engine's step time: slow enough to disconnect mid-stream, fast enough for CI

pytestmark = pytest.mark.stack


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def _create_topics(bootstrap: str, names: list[str]) -> None:
    from aiokafka.admin import AIOKafkaAdminClient, NewTopic

    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        await admin.create_topics([NewTopic(n, num_partitions=2, replication_factor=1) for n in names])
    finally:
        await admin.close()


class Live:
    """A worker subprocess on its own topic/prefix, and the gateway served in-process by uvicorn."""

    def __init__(self, bootstrap: str, redis_url: str):
        tag = uuid.uuid4().hex[:10]
        self.bootstrap, self.redis_url = bootstrap, redis_url
        self.topic, self.prefix = f"test.gw.{tag}", f"gw{tag}"
        self.worker: subprocess.Popen[bytes] | None = None
        self.server: uvicorn.Server | None = None
        self.thread: threading.Thread | None = None
        self.port = free_port()
        self.log = Path(os.environ.get("TMPDIR", "/tmp")) / f"stoker-gw-worker-{tag}.log"

    def client(self, **kw: object) -> Client:
        return Client(self.bootstrap, self.redis_url, prefix=self.prefix, topic=self.topic, **kw)  # type: ignore[arg-type]

    def start(self, serve_gateway: bool = True, model: Path | None = None, worker: bool = True) -> None:
        """Worker on the stand-in engine, or on the real engine (CPU) with `model`. worker=False: none yet
        (spawn_worker later), only a placeholder heartbeat for model "fake", so the gateway takes jobs."""
        asyncio.run(_create_topics(self.bootstrap, [self.topic, self.topic + ".dlq"]))
        if worker:
            self.spawn_worker(model)
            asyncio.run(self._wait_for_heartbeat())
        else:
            asyncio.run(self._placeholder_heartbeat())
        if serve_gateway:
            self._serve()

    async def _placeholder_heartbeat(self) -> None:
        async with self.client() as c:
            await c.redis.set(f"{self.prefix}:worker:placeholder", b'{"model": "fake", "capacity": 1}', ex=120)

    def spawn_worker(self, model: Path | None = None) -> None:
        engine = ({"STOKER_MODEL": str(model), "STOKER_DEVICE": "cpu"} if model is not None else
                  {"STOKER_FAKE_ENGINE": "1", "STOKER_FAKE_STEP_DELAY_S": str(STEP_DELAY_S)})
        env = dict(os.environ, KAFKA_BOOTSTRAP_SERVERS=self.bootstrap, REDIS_URL=self.redis_url,
                   STOKER_JOB_TOPIC=self.topic, STOKER_PREFIX=self.prefix, STOKER_GROUP_ID=f"g-{self.prefix}",
                   STOKER_METRICS_PORT="-1", **engine)
        with self.log.open("wb") as out:
            self.worker = subprocess.Popen([sys.executable, "-m", "stoker.worker.main"], cwd=ROOT, env=env,
                                           stdout=out, stderr=subprocess.STDOUT)

    def _serve(self) -> None:
        app = create_app(lambda: self.client(), timeout=30.0)
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            if time.monotonic() > deadline:
                raise RuntimeError("the gateway did not start within 20 s")
            time.sleep(0.05)

    async def _wait_for_heartbeat(self) -> None:
        async with self.client() as c:
            for _ in range(600):  # the real engine imports torch and loads the model first
                if await c.workers():
                    return
                assert self.worker is not None
                if self.worker.poll() is not None:
                    break
                await asyncio.sleep(0.1)
        raise RuntimeError(f"the worker did not come up; its log:\n{self.log.read_text()[-3000:]}")

    def stop(self) -> None:
        if self.server is not None:
            self.server.should_exit = True
        if self.thread is not None:
            self.thread.join(10)
        if self.worker is not None and self.worker.poll() is None:
            self.worker.terminate()  # SIGTERM: the worker drains and exits
            try:
                self.worker.wait(20)
            except subprocess.TimeoutExpired:
                self.worker.kill()
                self.worker.wait(5)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"


@pytest.fixture(scope="module")
def live(kafka_bootstrap: str, redis_url: str) -> Iterator[Live]:
    stack = Live(kafka_bootstrap, redis_url)
    try:
        stack.start()
        yield stack
    finally:
        stack.stop()


@pytest.fixture
async def oai(live: Live) -> AsyncIterator[openai.AsyncOpenAI]:
    async with openai.AsyncOpenAI(base_url=live.base_url, api_key="unused", max_retries=0, timeout=30) as c:
        yield c


async def test_models_lists_what_live_workers_serve(oai: openai.AsyncOpenAI) -> None:
    models = await oai.models.list()
    assert [m.id for m in models.data] == ["fake"]


async def test_completion_not_streaming(oai: openai.AsyncOpenAI) -> None:
    r = await oai.completions.create(model="fake", prompt="Once upon a time", max_tokens=7,
                                     extra_body={"ignore_eos": True})
    assert r.object == "text_completion" and r.choices[0].finish_reason == "length"
    assert r.usage is not None and r.usage.completion_tokens == 7 and r.usage.prompt_tokens > 0
    assert r.usage.total_tokens == r.usage.prompt_tokens + 7
    assert len(r.choices[0].text.split()) == 7  # the stand-in engine says one word per token


async def test_chat_not_streaming_accepts_max_completion_tokens(oai: openai.AsyncOpenAI) -> None:
    r = await oai.chat.completions.create(model="fake", messages=[{"role": "user", "content": "hi"}],
                                          max_completion_tokens=5, temperature=0, extra_body={"ignore_eos": True})
    assert r.object == "chat.completion" and r.choices[0].message.role == "assistant"
    assert r.usage is not None and r.usage.completion_tokens == 5
    assert r.choices[0].message.content and len(r.choices[0].message.content.split()) == 5


async def test_chat_streaming_with_usage_joins_to_the_done_text(oai: openai.AsyncOpenAI, live: Live) -> None:
    raw = await oai.chat.completions.with_raw_response.create(
        model="fake", messages=[{"role": "user", "content": "tell me"}], max_tokens=12, seed=7, temperature=0.0,
        stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    stream = raw.parse()
    pieces, finish, usage, roles = [], None, None, []
    async for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
            assert chunk.choices == []
            continue
        delta = chunk.choices[0].delta
        roles.append(delta.role)
        pieces.append(delta.content or "")
        finish = chunk.choices[0].finish_reason or finish
    assert roles[0] == "assistant" and finish == "length"
    assert usage is not None and usage.completion_tokens == 12
    async with live.client() as c:  # the worker's done event (its text is authoritative) under the result key
        done = await c.result(raw.headers["x-request-id"])
    assert isinstance(done, Done) and "".join(pieces) == done.text and done.usage.completion_tokens == 12


async def test_completion_streaming_and_stop_as_string(oai: openai.AsyncOpenAI) -> None:
    stream = await oai.completions.create(model="fake", prompt="x", max_tokens=6, stream=True, stop="never-said",
                                          extra_body={"ignore_eos": True})
    texts = [c.choices[0].text async for c in stream if c.choices]
    assert len("".join(texts).split()) == 6


@pytest.mark.parametrize(("kwargs", "status", "param"), [
    ({"n": 0}, 400, "n"),
    ({"top_logprobs": 3}, 400, "top_logprobs"),  # without logprobs: true
    ({"extra_body": {"guided_decoding_backend": "xgrammar"}}, 400, "guided_decoding_backend"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]}, 400, "tools"),
    ({"response_format": {"type": "grammar"}}, 400, "response_format"),
    ({"extra_body": {"guided_grammar": "root ::= x"}}, 400, "guided_grammar"),
    ({"response_format": {"type": "json_object"}, "extra_body": {"guided_regex": "a+"}}, 400, "guided_regex"),
    ({"logit_bias": {"1": 5}}, 400, "logit_bias"),
    ({"temperature": -1.0}, 400, None),
])
async def test_unsupported_or_bad_params_get_openai_errors(oai: openai.AsyncOpenAI, kwargs: dict, status: int,
                                                           param: str | None) -> None:
    """Every field the gateway does not support is a 400 naming it, never silently dropped."""
    with pytest.raises(openai.APIStatusError) as info:
        await oai.chat.completions.create(model="fake", messages=[{"role": "user", "content": "hi"}], **kwargs)
    assert info.value.status_code == status
    body = info.value.body
    assert isinstance(body, dict) and body["message"] and body["type"] == "invalid_request_error"
    if param is not None:
        assert body["param"] == param
    else:
        assert "temperature" in body["message"]


async def test_n_choices_with_logprobs_not_streaming(oai: openai.AsyncOpenAI, live: Live) -> None:
    raw = await oai.chat.completions.with_raw_response.create(
        model="fake", messages=[{"role": "user", "content": "hi"}], n=2, max_tokens=4, logprobs=True,
        top_logprobs=3, store=False, extra_body={"ignore_eos": True})
    r = raw.parse()
    assert [c.index for c in r.choices] == [0, 1]
    ids = raw.headers["x-request-ids"].split(",")
    assert len(ids) == 2 and ids[0] == raw.headers["x-request-id"]
    async with live.client() as c:
        dones = [await c.result(rid) for rid in ids]
    for choice, done in zip(r.choices, dones, strict=True):
        assert isinstance(done, Done) and choice.message.content == done.text
        assert choice.logprobs is not None and choice.logprobs.content is not None
        entries = choice.logprobs.content
        assert len(entries) == 4 and "".join(e.token for e in entries) == done.text  # each token's own text
        for entry in entries:
            assert len(entry.top_logprobs) == 3 and entry.top_logprobs[0].token == entry.token
            assert entry.bytes == list(entry.token.encode()) and entry.logprob <= 0
    assert r.choices[0].message.content != r.choices[1].message.content  # two jobs, two answers
    assert r.usage is not None and r.usage.completion_tokens == 8


async def test_n_choices_with_logprobs_streaming(oai: openai.AsyncOpenAI) -> None:
    stream = await oai.chat.completions.create(
        model="fake", messages=[{"role": "user", "content": "hi"}], n=2, max_tokens=5, logprobs=True,
        top_logprobs=3, stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    texts, tokens, finish, usage = ["", ""], [[], []], [None, None], None
    async for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
            continue
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            if choice.logprobs is not None and choice.logprobs.content:
                assert all(len(e.top_logprobs) == 3 for e in choice.logprobs.content)
                tokens[choice.index] += [e.token for e in choice.logprobs.content]
            finish[choice.index] = choice.finish_reason or finish[choice.index]
    assert finish == ["length", "length"] and usage is not None and usage.completion_tokens == 10
    assert [len(t) for t in tokens] == [5, 5] and ["".join(t) for t in tokens] == texts


async def test_completion_batch_of_prompts_with_logprobs(oai: openai.AsyncOpenAI) -> None:
    r = await oai.completions.create(model="fake", prompt=["one", "two", "three"], max_tokens=3, logprobs=2,
                                     extra_body={"ignore_eos": True, "stop_token_ids": [0],
                                                 "include_stop_str_in_output": False})
    assert [c.index for c in r.choices] == [0, 1, 2] and len({c.text for c in r.choices}) == 3
    for choice in r.choices:
        lp = choice.logprobs
        assert lp is not None and lp.tokens is not None and "".join(lp.tokens) == choice.text
        assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(3)]
        assert lp.top_logprobs is not None and all(len(alts) == 2 for alts in lp.top_logprobs)
    stream = await oai.completions.create(model="fake", prompt=["one", "two"], n=2, max_tokens=2, logprobs=0,
                                          stream=True, extra_body={"ignore_eos": True})
    seen: dict[int, list[str]] = {}
    async for chunk in stream:
        for choice in chunk.choices:
            if choice.logprobs is not None and choice.logprobs.tokens:
                seen.setdefault(choice.index, []).extend(choice.logprobs.tokens)
    assert sorted(seen) == [0, 1, 2, 3] and all(len(t) == 2 for t in seen.values())


async def test_health_metrics_and_one_model(oai: openai.AsyncOpenAI, live: Live) -> None:
    model = await oai.models.retrieve("fake")
    assert (model.id, model.object) == ("fake", "model")
    with pytest.raises(openai.NotFoundError):
        await oai.models.retrieve("gpt-9")
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{live.port}") as h:
        assert (await h.get("/health")).status_code == 200
        metrics = (await h.get("/metrics")).text
    assert 'stoker_gateway_requests_total{route="/v1/chat/completions",status="200"}' in metrics
    assert 'stoker_gateway_errors_total{code="model_not_found",route="/v1/models/{model}"}' in metrics
    assert "stoker_gateway_request_duration_seconds_bucket" in metrics


async def test_api_key_is_checked_on_every_route_but_health(live: Live) -> None:
    app = create_app(lambda: live.client(), timeout=30.0, api_key="sk-right")
    async with app.router.lifespan_context(app):
        for key, ok in (("sk-wrong", False), ("sk-right", True)):
            http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw/v1")
            async with openai.AsyncOpenAI(base_url="http://gw/v1", api_key=key, http_client=http, max_retries=0) as oai:
                if ok:
                    assert [m.id for m in (await oai.models.list()).data] == ["fake"]
                    continue
                with pytest.raises(openai.AuthenticationError) as info:
                    await oai.chat.completions.create(model="fake", messages=[{"role": "user", "content": "x"}])
                assert info.value.status_code == 401 and "API key" in info.value.message
                with pytest.raises(openai.AuthenticationError):
                    await oai.models.list()
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw") as h:
            assert (await h.get("/health")).status_code == 200
            assert (await h.get("/metrics")).status_code == 401


async def test_unknown_model_is_404_and_bad_json_400_and_bad_type_422(oai: openai.AsyncOpenAI, live: Live) -> None:
    with pytest.raises(openai.NotFoundError) as info:
        await oai.completions.create(model="gpt-9", prompt="hi")
    assert "gpt-9" in info.value.message and "fake" in info.value.message
    async with httpx.AsyncClient(base_url=live.base_url) as h:
        r = await h.post("/chat/completions", content=b"{not json")
        assert r.status_code == 400 and set(r.json()["error"]) == {"message", "type", "param", "code"}
        r = await h.post("/completions", json={"model": "fake", "prompt": "hi", "max_tokens": "many"})
        assert r.status_code == 422 and r.json()["error"]["param"] == "max_tokens"
        r = await h.get("/nothing-here")
        assert r.status_code == 404 and "error" in r.json()


async def test_no_live_workers_is_503(live: Live) -> None:
    app = create_app(lambda: Client(live.bootstrap, live.redis_url, prefix=f"empty{uuid.uuid4().hex[:8]}"))
    transport = httpx.ASGITransport(app=app)
    async with app.router.lifespan_context(app), httpx.AsyncClient(transport=transport, base_url="http://gw") as h:
        r = await h.post("/v1/completions", json={"model": "fake", "prompt": "hi"})
    assert r.status_code == 503 and r.json()["error"]["code"] == "no_workers"


async def test_redis_failing_is_503_naming_it(live: Live) -> None:
    class RedisDown(Client):
        async def workers(self) -> list[WorkerInfo]:
            raise RedisConnectionError("Error 111 connecting to 127.0.0.1:6379. Connection refused.")

    app = create_app(lambda: RedisDown(live.bootstrap, live.redis_url, prefix=live.prefix, topic=live.topic))
    transport = httpx.ASGITransport(app=app)
    async with app.router.lifespan_context(app), httpx.AsyncClient(transport=transport, base_url="http://gw") as h:
        for r in (await h.post("/v1/completions", json={"model": "fake", "prompt": "hi"}),
                  await h.get("/v1/models")):
            error = r.json()["error"]
            assert r.status_code == 503 and error["code"] == "backend_unavailable"
            assert error["message"].startswith("Redis is unavailable: ConnectionError") and "refused" in error["message"]


async def test_client_disconnect_cancels_the_job_in_the_worker(live: Live) -> None:
    body = {"model": "fake", "messages": [{"role": "user", "content": "go on"}], "max_tokens": 2000,
            "stream": True, "ignore_eos": True}
    async with httpx.AsyncClient(base_url=live.base_url, timeout=30) as h, \
            h.stream("POST", "/chat/completions", json=body) as r:
        assert r.status_code == 200
        request_id = r.headers["x-request-id"]
        lines = r.aiter_lines()
        while not (await anext(lines)).startswith("data: {"):
            pass
        # leaving the block closes the connection mid-stream: 2000 tokens at 20 ms a step take 40 s
    async with live.client() as c:
        done = None
        for _ in range(100):
            done = await c.result(request_id)
            if done is not None:
                break
            await asyncio.sleep(0.1)
    assert isinstance(done, Done) and done.finish_reason == "cancelled"
    assert done.usage.completion_tokens < 2000


async def _hang_up(live: Live, path: str, body: dict[str, object], jobs_before: int) -> str:
    """Sends a request on a raw socket, waits until its job is in Kafka (no event can come: no worker
    runs yet), then closes the socket before any byte of the answer. Returns the job's request id."""
    from aiokafka import AIOKafkaConsumer, TopicPartition

    data = json.dumps(body).encode()
    reader, writer = await asyncio.open_connection("127.0.0.1", live.port)
    writer.write(f"POST /v1{path} HTTP/1.1\r\nHost: gw\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
    await writer.drain()
    consumer = AIOKafkaConsumer(bootstrap_servers=live.bootstrap)
    await consumer.start()
    try:
        partitions = [TopicPartition(live.topic, p) for p in (0, 1)]
        for _ in range(200):
            if sum((await consumer.end_offsets(partitions)).values()) > jobs_before:
                break
            await asyncio.sleep(0.05)
        else:
            raise AssertionError("the gateway did not produce the job within 10 s")
    finally:
        await consumer.stop()
    async with live.client() as c:  # subscribed before producing: the one live events channel is this job's
        channels = await c.redis.pubsub_channels(f"{live.prefix}:events:*")
    assert len(channels) == 1 and not reader.at_eof()  # nothing answered yet
    writer.close()
    await writer.wait_closed()
    channel = channels[0]
    return (channel.decode() if isinstance(channel, bytes) else channel).rsplit(":", 1)[1]


async def test_hangup_before_the_first_event_cancels_the_job(kafka_bootstrap: str, redis_url: str) -> None:
    """Both paths (plain and streaming) wait for the first event before answering anything; a client that
    hangs up then must still cancel its job. No worker runs while the two clients hang up, so no event can
    arrive first; the worker started afterwards must end both jobs `cancelled`, without running them."""
    idle = Live(kafka_bootstrap, redis_url)
    await asyncio.to_thread(idle.start, worker=False)
    try:
        request_ids = []
        for n, (path, body) in enumerate([
            ("/completions", {"model": "fake", "prompt": "hi", "max_tokens": 50}),
            ("/chat/completions", {"model": "fake", "messages": [{"role": "user", "content": "hi"}],
                                   "max_tokens": 50, "stream": True}),
        ]):
            rid = await _hang_up(idle, path, body, jobs_before=n)
            request_ids.append(rid)
            async with idle.client() as c:
                for _ in range(50):  # the gateway's timeout is 30 s: only noticing the hang-up cancels in 5 s
                    if await c.redis.exists(c.names.cancelled(rid)):
                        break
                    await asyncio.sleep(0.1)
                else:
                    raise AssertionError(f"hang-up on {path} did not cancel {rid} within 5 s")
        idle.spawn_worker()
        async with idle.client() as c:
            results = {}
            for _ in range(300):
                results = {rid: await c.result(rid) for rid in request_ids}
                if all(results.values()):
                    break
                await asyncio.sleep(0.1)
        for rid, result in results.items():
            assert isinstance(result, Done), (rid, result, idle.log.read_text()[-2000:])
            assert result.finish_reason == "cancelled" and result.usage.completion_tokens == 0
    finally:
        await asyncio.to_thread(idle.stop)


@pytest.fixture(scope="module")
def real_live(kafka_bootstrap: str, redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Live]:
    """A worker on the real engine with the small random model (engine.make_model), on CPU."""
    model = tmp_path_factory.mktemp("model") / "tiny"
    subprocess.run([sys.executable, "-m", "stoker.engine.make_model", str(model)], cwd=ROOT, check=True,
                   capture_output=True, timeout=120)
    stack = Live(kafka_bootstrap, redis_url)
    try:
        stack.start(model=model)
        yield stack
    finally:
        stack.stop()


@pytest.mark.slow
async def test_real_small_engine_completes_and_streams_chat(real_live: Live) -> None:
    async with openai.AsyncOpenAI(base_url=real_live.base_url, api_key="unused", max_retries=0, timeout=60) as oai:
        (model,) = [m.id for m in (await oai.models.list()).data]
        r = await oai.completions.create(model=model, prompt="Once upon a time", max_tokens=12, temperature=0,
                                         extra_body={"ignore_eos": True})
        assert r.usage is not None and r.usage.completion_tokens == 12 and r.choices[0].finish_reason == "length"
        again = await oai.completions.create(model=model, prompt="Once upon a time", max_tokens=12, temperature=0,
                                             extra_body={"ignore_eos": True})
        assert again.choices[0].text == r.choices[0].text  # greedy on the real engine: deterministic
        with_logprobs = await oai.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "Hello"}], max_tokens=6, temperature=0, n=2,
            logprobs=True, top_logprobs=3, extra_body={"ignore_eos": True})
        for choice in with_logprobs.choices:  # the worker decoded each token alone with the model's tokenizer
            assert choice.logprobs is not None and choice.logprobs.content is not None
            content = choice.logprobs.content
            assert len(content) == 6 and all(e.token and len(e.top_logprobs) == 3 for e in content)
            assert all(e.top_logprobs[0].logprob >= e.top_logprobs[1].logprob for e in content)
            assert content[0].token == content[0].top_logprobs[0].token  # greedy: the likeliest was taken
        assert with_logprobs.choices[0].message.content == with_logprobs.choices[1].message.content  # greedy

        raw = await oai.chat.completions.with_raw_response.create(
            model=model, messages=[{"role": "user", "content": "Hello"}], max_tokens=10, temperature=0,
            stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        pieces, usage = [], None
        async for chunk in raw.parse():
            if chunk.usage is not None:
                usage = chunk.usage
            elif chunk.choices:
                pieces.append(chunk.choices[0].delta.content or "")
    assert usage is not None and usage.completion_tokens == 10
    async with real_live.client() as c:
        done = await c.result(raw.headers["x-request-id"])
    assert isinstance(done, Done) and "".join(pieces) == done.text and done.model == model


@pytest.mark.slow
async def test_real_small_engine_structured_output(real_live: Live) -> None:
    """The official client's response_format (json_schema) returns schema-valid JSON; vLLM's guided_choice
    picks a choice; a schema the compiler rejects is a 400 with code invalid_response_format."""
    schema = {"type": "object", "properties": {"title": {"type": "string", "maxLength": 12},
                                               "year": {"type": "integer", "minimum": 1900, "maximum": 2030},
                                               "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3}},
              "required": ["title", "year", "tags"], "additionalProperties": False}
    async with openai.AsyncOpenAI(base_url=real_live.base_url, api_key="unused", max_retries=0, timeout=60) as oai:
        (model,) = [m.id for m in (await oai.models.list()).data]
        r = await oai.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "A film, as JSON"}], max_tokens=100, seed=5,
            response_format={"type": "json_schema", "json_schema": {"name": "film", "schema": schema, "strict": True}})
        assert r.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(r.choices[0].message.content or ""), schema)
        c = await oai.completions.create(model=model, prompt="Pick", max_tokens=10,
                                         extra_body={"guided_choice": ["left", "right"]})
        assert c.choices[0].text in ("left", "right")
        with pytest.raises(openai.BadRequestError) as info:
            await oai.chat.completions.create(
                model=model, messages=[{"role": "user", "content": "x"}], max_tokens=5,
                response_format={"type": "json_schema", "json_schema": {"name": "bad", "schema": {"type": "strin"}}})
    body = info.value.body
    assert isinstance(body, dict) and body["code"] == "invalid_response_format", body
