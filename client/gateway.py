"""`stoker-gateway`: an OpenAI-compatible HTTP front over the queue (Starlette + uvicorn).

Each call becomes one job, produced to Kafka and answered from the request's events in Redis, so the
gateway holds no model and scales apart from the workers. `/v1/models` lists what live workers serve
(their heartbeat keys). A client that hangs up cancels its job (Client.run's cancel_on_exit does the
cancel): before the first event, in both the streaming and the plain path, a task reading the ASGI
`receive` channel notices it; once a stream has started, Starlette's own disconnect listener does.
The job carries deadline_ms = now + the gateway's timeout, so a worker stops spending GPU time on an answer
nobody waits for any more.

Not supported, answered 400 rather than silently ignored: n > 1, best_of > 1, echo, suffix, logprobs (the
gateway has no tokenizer to render token strings), tools/functions, response_format other than text,
logit_bias, non-text content parts. finish_reason passes the contract's `cancelled` and `deadline` through.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any, TypeVar

import msgspec
from aiokafka.errors import KafkaError
from redis.exceptions import RedisError
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

import schemas
from client.client import (
    DEFAULT_BOOTSTRAP,
    DEFAULT_REDIS_URL,
    Client,
    RequestFailed,
    RequestTimeout,
    TextAssembler,
    WorkerInfo,
)
from schemas import Chunk, ContractError, Done

WORKER_CACHE_S = 2.0  # heartbeats are re-read at most this often; a worker's TTL is longer than this
# Contract error codes -> HTTP status: the caller's fault, a missing model, or ours.
STATUS_FOR_CODE = {"invalid_job": 400, "context_length_exceeded": 400, "unsupported_version": 400,
                   "message_too_large": 413, "unknown_model": 404}


class APIError(Exception):
    """Answered as OpenAI's error object: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def response(self) -> JSONResponse:
        kind = {400: "invalid_request_error", 404: "invalid_request_error", 413: "invalid_request_error",
                422: "invalid_request_error", 503: "service_unavailable", 504: "timeout"}.get(self.status, "server_error")
        body = {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}
        return JSONResponse(body, status_code=self.status)


T = TypeVar("T")


class ClientGone(Exception):
    """The HTTP client hung up before its answer was ready."""


class _Hangup:
    """Notices the HTTP client going away while the gateway waits for a job's events.

    Once the body is read, an ASGI server's `receive()` has nothing more to say until the client
    disconnects (`http.disconnect`), so one task waiting on it is an event-driven hang-up signal: no
    polling of `request.is_disconnected()`. `race` runs a wait against it and cancels the wait when the
    client leaves first; cancelling Client.run's generator is what sends the job's cancel."""

    def __init__(self, receive: Receive):
        self._task = asyncio.create_task(self._watch(receive), name="stoker-gateway-hangup")

    @staticmethod
    async def _watch(receive: Receive) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass  # a body part after the body was read: not ours to use

    async def race(self, work: Awaitable[T]) -> T:
        job = asyncio.ensure_future(work)
        try:
            await asyncio.wait((job, self._task), return_when=asyncio.FIRST_COMPLETED)
        except BaseException:  # we were cancelled (server shutdown): the wait goes with us
            job.cancel()
            raise
        if job.done():
            return job.result()
        job.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):  # its outcome no longer matters
            await job
        raise ClientGone

    async def close(self) -> None:
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await self._task


class _EventStream(StreamingResponse):
    """An SSE response that always closes the job's event iterator when it ends. On a hang-up Starlette
    cancels the body but never closes it: a generator left suspended at a `yield` would cancel its job
    only when the garbage collector finalised it."""

    def __init__(self, body: AsyncIterator[bytes], events: AsyncIterator[Chunk | Done], headers: dict[str, str]):
        super().__init__(body, media_type="text/event-stream", headers=headers)
        self._body, self._events = body, events

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._body.aclose()  # type: ignore[attr-defined]
            await self._events.aclose()  # type: ignore[attr-defined]


def _backend_down(exc: Exception) -> APIError:
    """Redis or Kafka failing is not the caller's fault nor a bug of ours: 503, so clients retry later."""
    backend = "Redis" if isinstance(exc, RedisError) else "Kafka"
    return APIError(503, f"{backend} is unavailable: {type(exc).__name__}: {exc}", code="backend_unavailable")


def _typed(body: dict[str, Any], name: str, kinds: type | tuple[type, ...], what: str) -> Any:
    """The field's value if present and of the right JSON type (bool is not a number here), else 422."""
    value = body.get(name)
    if value is None:
        return None
    kinds_t = kinds if isinstance(kinds, tuple) else (kinds,)
    if isinstance(value, bool) and bool not in kinds_t or not isinstance(value, kinds_t):
        raise APIError(422, f"`{name}` must be {what}, got {type(value).__name__}", param=name, code="invalid_type")
    return value


def _reject_unsupported(body: dict[str, Any], chat: bool) -> None:
    n = _typed(body, "n", int, "an integer")
    if n is not None and n != 1:
        raise APIError(400, "only n=1 is supported: submit several requests instead", param="n", code="unsupported")
    for name in ("tools", "functions", "tool_choice", "function_call", "logit_bias"):
        if body.get(name):
            raise APIError(400, f"`{name}` is not supported by this gateway", param=name, code="unsupported")
    fmt = body.get("response_format")
    if fmt is not None and not (isinstance(fmt, dict) and fmt.get("type") == "text"):
        raise APIError(400, "`response_format` is not supported (only {\"type\": \"text\"})",
                       param="response_format", code="unsupported")
    logprob_fields = ("logprobs", "top_logprobs") if chat else ("logprobs",)
    for name in logprob_fields:
        if body.get(name):  # chat: logprobs=true; completions: logprobs=N > 0
            raise APIError(400, f"`{name}` is not supported: the gateway has no tokenizer to render tokens",
                           param=name, code="unsupported")
    if not chat:
        if body.get("echo"):
            raise APIError(400, "`echo` is not supported", param="echo", code="unsupported")
        if body.get("suffix"):
            raise APIError(400, "`suffix` is not supported", param="suffix", code="unsupported")
        best_of = _typed(body, "best_of", int, "an integer")
        if best_of is not None and best_of != 1:
            raise APIError(400, "only best_of=1 is supported", param="best_of", code="unsupported")


def _sampling(body: dict[str, Any], default_max_tokens: int | None) -> dict[str, Any]:
    """OpenAI (and vLLM's extra) sampling fields -> job fields; ranges are checked by schemas."""
    number, integer = (int, float), int
    out: dict[str, Any] = {}
    max_tokens = _typed(body, "max_completion_tokens", integer, "an integer")
    if max_tokens is None:
        max_tokens = _typed(body, "max_tokens", integer, "an integer")
    if max_tokens is None:
        max_tokens = default_max_tokens
    if max_tokens is not None:
        out["max_tokens"] = max_tokens
    for name, kinds, what in (("temperature", number, "a number"), ("top_p", number, "a number"),
                              ("presence_penalty", number, "a number"), ("frequency_penalty", number, "a number"),
                              ("seed", integer, "an integer"), ("top_k", integer, "an integer"),
                              ("min_p", number, "a number"), ("repetition_penalty", number, "a number"),
                              ("min_tokens", integer, "an integer"), ("ignore_eos", bool, "a boolean"),
                              ("priority", integer, "an integer")):
        value = _typed(body, name, kinds, what)
        if value is not None:
            out[name] = value
    stop = body.get("stop")
    if isinstance(stop, str):
        out["stop"] = [stop]
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        out["stop"] = stop
    elif stop is not None:
        raise APIError(422, "`stop` must be a string or a list of strings", param="stop", code="invalid_type")
    user = body.get("user")
    if isinstance(user, str) and user:
        out["tenant"] = user
    return out


def _chat_messages(body: dict[str, Any]) -> list[dict[str, str]]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise APIError(400, "`messages` must be a non-empty list", param="messages", code="invalid_value")
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise APIError(400, f"messages[{i}] must be an object with a `role`", param=f"messages[{i}]")
        role, content = message["role"], message.get("content")
        role = "system" if role == "developer" else role  # OpenAI's newer name for the system role
        if isinstance(content, list):  # content parts: text only (the engine is text-only)
            texts = []
            for part in content:
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise APIError(400, f"messages[{i}]: only text content parts are supported",
                                   param=f"messages[{i}].content", code="unsupported")
                texts.append(part["text"])
            content = "".join(texts)
        if not isinstance(content, str):
            raise APIError(400, f"messages[{i}].content must be a string or text parts",
                           param=f"messages[{i}].content", code="invalid_value")
        out.append({"role": role, "content": content})
    return out


def _completion_prompt(body: dict[str, Any]) -> dict[str, Any]:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        return {"prompt": prompt}
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return {"prompt_token_ids": prompt}
    raise APIError(400, "`prompt` must be a string, a list of token ids, or a list of one of those "
                   "(batches: send one request each)", param="prompt", code="invalid_value")


def _usage(done: Done) -> dict[str, Any]:
    u = done.usage
    return {"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens,
            "total_tokens": u.prompt_tokens + u.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": u.cached_tokens}}


def _sse(payload: dict[str, Any] | str) -> bytes:
    data = payload if isinstance(payload, str) else msgspec.json.encode(payload).decode()
    return f"data: {data}\n\n".encode()


class Gateway:
    def __init__(self, client: Client, *, timeout: float = 300.0):
        self.client, self.timeout = client, timeout
        self._workers: list[WorkerInfo] = []
        self._workers_at = float("-inf")

    async def workers(self) -> list[WorkerInfo]:
        if time.monotonic() - self._workers_at > WORKER_CACHE_S:
            self._workers, self._workers_at = await self.client.workers(), time.monotonic()
        return self._workers

    async def served_models(self) -> list[str]:
        return sorted({w.model for w in await self.workers() if w.model})

    async def _resolve_model(self, body: dict[str, Any]) -> str:
        models = await self.served_models()
        if not models:
            raise APIError(503, "no live workers: start one with `stoker-worker` (see `stoker workers`)",
                           code="no_workers")
        model = body.get("model")
        if model is None:  # OpenAI requires it; be lenient when only one model is served
            if len(models) == 1:
                return models[0]
            raise APIError(400, f"`model` is required; served: {', '.join(models)}", param="model")
        if model not in models:
            raise APIError(404, f"model {model!r} is not served by any live worker; served: {', '.join(models)}",
                           param="model", code="model_not_found")
        return str(model)

    # ---- endpoints -------------------------------------------------------------------------------------
    async def list_models(self, request: Request) -> Response:
        try:
            models = await self.served_models()
        except RedisError as exc:
            return _backend_down(exc).response()
        data = [{"id": m, "object": "model", "created": 0, "owned_by": "stoker"} for m in models]
        return JSONResponse({"object": "list", "data": data})

    async def completions(self, request: Request) -> Response:
        return await self._handle(request, chat=False)

    async def chat_completions(self, request: Request) -> Response:
        return await self._handle(request, chat=True)

    async def _handle(self, request: Request, chat: bool) -> Response:
        try:
            try:
                body = msgspec.json.decode(await request.body())
            except msgspec.DecodeError as exc:
                raise APIError(400, f"the body is not valid JSON: {exc}", code="invalid_json") from None
            if not isinstance(body, dict):
                raise APIError(400, "the body must be a JSON object")
            _reject_unsupported(body, chat)
            fields = ({"messages": _chat_messages(body)} if chat else _completion_prompt(body))
            fields.update(_sampling(body, default_max_tokens=None if chat else 16))  # OpenAI's legacy default
            stream = _typed(body, "stream", bool, "a boolean") or False
            opts = body.get("stream_options") or {}
            include_usage = bool(isinstance(opts, dict) and opts.get("include_usage"))
            model = await self._resolve_model(body)
            try:
                job = self.client.make_job(model=model, deadline_ms=int(time.time() * 1000 + self.timeout * 1000),
                                           **fields)
            except ContractError as exc:
                raise APIError(400, exc.message, code=exc.code) from None
            make = _ChatShape if chat else _CompletionShape
            shape = make(f"{'chatcmpl' if chat else 'cmpl'}-{job.request_id}", model)
            headers = {"x-request-id": job.request_id}
            hangup = _Hangup(request.receive)
            try:
                if stream:
                    events = self.client.run(job, timeout=self.timeout)
                    # errors before the first event still get a status code
                    first = await hangup.race(self._first(events))
                    return _EventStream(self._sse(shape, first, events, include_usage), events, headers)
                done = await hangup.race(self._collect(job))
                return JSONResponse(shape.whole(done), headers=headers)
            finally:
                await hangup.close()  # before Starlette's listener takes over `receive` for the stream
        except APIError as exc:
            return exc.response()
        except ClientGone:  # nobody reads this; 499 is the usual log mark for "client closed request"
            return Response(status_code=499)
        except (RedisError, KafkaError) as exc:
            return _backend_down(exc).response()

    async def _collect(self, job: schemas.Job) -> Done:
        try:
            async for event in self.client.run(job, timeout=self.timeout):
                if isinstance(event, Done):
                    return event
        except RequestFailed as exc:
            raise APIError(STATUS_FOR_CODE.get(exc.code, 500), exc.message, code=exc.code) from None
        except RequestTimeout as exc:
            raise APIError(504, str(exc), code="timeout") from None
        raise APIError(500, "the event stream ended without a done event", code="internal")

    @staticmethod
    async def _first(events: AsyncIterator[Chunk | Done]) -> Chunk | Done:
        try:
            return await anext(events)
        except RequestFailed as exc:
            raise APIError(STATUS_FOR_CODE.get(exc.code, 500), exc.message, code=exc.code) from None
        except RequestTimeout as exc:
            raise APIError(504, str(exc), code="timeout") from None

    async def _sse(self, shape: _Shape, first: Chunk | Done, events: AsyncIterator[Chunk | Done],
                   include_usage: bool) -> AsyncIterator[bytes]:
        text = TextAssembler()
        try:
            yield _sse(shape.chunk(None, None, first=True))
            event: Chunk | Done | None = first
            while event is not None:
                if isinstance(event, Chunk):
                    delta = text.feed(event)
                    if delta:
                        yield _sse(shape.chunk(delta, None))
                else:
                    yield _sse(shape.chunk(None, event.finish_reason))
                    if include_usage:
                        yield _sse(shape.usage_chunk(event))
                    break
                event = await anext(events, None)
            yield _sse("[DONE]")
        except (RequestFailed, RequestTimeout) as exc:  # mid-stream: the status is sent; say it in-band
            code = exc.code if isinstance(exc, RequestFailed) else "timeout"
            yield _sse({"error": {"message": str(exc), "type": "server_error", "param": None, "code": code}})
        finally:
            # Closing `events` runs Client.run's finally: the cancel, unless the job had finished.
            await events.aclose()  # type: ignore[attr-defined]


class _Shape:
    object_whole = object_chunk = ""

    def __init__(self, id_: str, model: str):
        self.id, self.model, self.created = id_, model, int(time.time())

    def _base(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def usage_chunk(self, done: Done) -> dict[str, Any]:
        return self._base(self.object_chunk) | {"choices": [], "usage": _usage(done)}

    def chunk(self, delta: str | None, finish_reason: str | None, first: bool = False) -> dict[str, Any]:
        raise NotImplementedError

    def whole(self, done: Done) -> dict[str, Any]:
        raise NotImplementedError


class _CompletionShape(_Shape):
    object_whole = object_chunk = "text_completion"

    def chunk(self, delta: str | None, finish_reason: str | None, first: bool = False) -> dict[str, Any]:
        choice = {"index": 0, "text": delta or "", "logprobs": None, "finish_reason": finish_reason}
        return self._base(self.object_chunk) | {"choices": [choice]}

    def whole(self, done: Done) -> dict[str, Any]:
        choice = {"index": 0, "text": done.text, "logprobs": None, "finish_reason": done.finish_reason}
        return self._base(self.object_whole) | {"choices": [choice], "usage": _usage(done)}


class _ChatShape(_Shape):
    object_whole, object_chunk = "chat.completion", "chat.completion.chunk"

    def chunk(self, delta: str | None, finish_reason: str | None, first: bool = False) -> dict[str, Any]:
        body: dict[str, Any] = {"role": "assistant", "content": ""} if first else {}
        if delta:
            body["content"] = delta
        choice = {"index": 0, "delta": body, "logprobs": None, "finish_reason": finish_reason}
        return self._base(self.object_chunk) | {"choices": [choice]}

    def whole(self, done: Done) -> dict[str, Any]:
        choice = {"index": 0, "message": {"role": "assistant", "content": done.text}, "logprobs": None,
                  "finish_reason": done.finish_reason}
        return self._base(self.object_whole) | {"choices": [choice], "usage": _usage(done)}


def create_app(client_factory: Callable[[], Client], *, timeout: float = 300.0) -> Starlette:
    """The ASGI app; the client starts and stops with it (lifespan)."""
    holder: dict[str, Gateway] = {}

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        async with client_factory() as client:
            holder["gw"] = Gateway(client, timeout=timeout)
            yield

    def route(name: str) -> Callable[[Request], Any]:
        async def endpoint(request: Request) -> Response:
            return await getattr(holder["gw"], name)(request)
        return endpoint

    async def not_found(request: Request, exc: Exception) -> Response:
        return APIError(404, f"no route {request.method} {request.url.path}", code="not_found").response()

    async def server_error(request: Request, exc: Exception) -> Response:
        return APIError(500, f"internal error: {type(exc).__name__}: {exc}", code="internal").response()

    return Starlette(
        routes=[Route("/v1/models", route("list_models"), methods=["GET"]),
                Route("/v1/completions", route("completions"), methods=["POST"]),
                Route("/v1/chat/completions", route("chat_completions"), methods=["POST"])],
        lifespan=lifespan, exception_handlers={404: not_found, 500: server_error},
    )


def main(argv: list[str] | None = None) -> None:
    env = os.environ.get
    p = argparse.ArgumentParser(prog="stoker-gateway", description="OpenAI-compatible HTTP gateway to Stoker")
    p.add_argument("--host", default=env("STOKER_GATEWAY_HOST", "127.0.0.1"))
    p.add_argument("--port", type=int, default=int(env("STOKER_GATEWAY_PORT", "8000")))
    p.add_argument("--bootstrap", default=env("KAFKA_BOOTSTRAP_SERVERS", DEFAULT_BOOTSTRAP))
    p.add_argument("--redis-url", default=env("REDIS_URL", DEFAULT_REDIS_URL))
    p.add_argument("--prefix", default=env("STOKER_PREFIX", schemas.REDIS_PREFIX))
    p.add_argument("--topic", default=env("STOKER_JOB_TOPIC", schemas.JOBS_TOPIC))
    p.add_argument("--timeout", type=float, default=float(env("STOKER_GATEWAY_TIMEOUT", "300")),
                   help="seconds a request may take; also sent to the worker as the job's deadline")
    args = p.parse_args(argv)
    import uvicorn  # the gateway extra; imported here so `import client.gateway` works for tests without it

    def factory() -> Client:
        return Client(args.bootstrap, args.redis_url, prefix=args.prefix, topic=args.topic, timeout=args.timeout)

    uvicorn.run(create_app(factory, timeout=args.timeout), host=args.host, port=args.port, log_level="info")


if __name__ == "__main__":
    main()
