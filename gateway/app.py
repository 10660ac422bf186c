"""`stoker-gateway`: an OpenAI-compatible HTTP front over the queue (Starlette + uvicorn).

Each call becomes one job, produced to Kafka and answered from the request's events in Redis, so the
gateway holds no model and scales apart from the workers. `/v1/models` lists what live workers serve
(their heartbeat keys). A client that hangs up cancels its job (Client.run's cancel_on_exit does the
cancel): before the first event, in both the streaming and the plain path, a task reading the ASGI
`receive` channel notices it; once a stream has started, Starlette's own disconnect listener does.
The job carries deadline_ms = now + the gateway's timeout, so a worker stops spending GPU time on an answer
nobody waits for any more.

What a request may ask and how it maps to a job is in gateway.mapping; this module is the HTTP side.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any, TypeVar

import click
import msgspec
from aiokafka.errors import KafkaError
from redis.exceptions import RedisError
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import Receive, Scope, Send
from stoker.client.client import (
    Client,
    RequestFailed,
    RequestTimeout,
    TextAssembler,
    WorkerInfo,
)
from stoker.client.options import kafka_options, option, redis_options, resolve_aliases, version_option
from stoker.gateway.mapping import APIError, Shape, job_fields, shape_for, sse, status_for
from stoker.schemas import Chunk, ContractError, Done

from stoker import schemas

WORKER_CACHE_S = 2.0  # heartbeats are re-read at most this often; a worker's TTL is longer than this


def _respond(error: APIError) -> JSONResponse:
    """OpenAI's error object: {"error": {"message", "type", "param", "code"}}."""
    return JSONResponse(error.body(), status_code=error.status)


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
            return _respond(_backend_down(exc))
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
            fields, stream, include_usage = job_fields(body, chat)
            model = await self._resolve_model(body)
            try:
                job = self.client.make_job(model=model, deadline_ms=int(time.time() * 1000 + self.timeout * 1000),
                                           **fields)
            except ContractError as exc:
                raise APIError(400, exc.message, code=exc.code) from None
            shape = shape_for(chat, job.request_id, model)
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
            return _respond(exc)
        except ClientGone:  # nobody reads this; 499 is the usual log mark for "client closed request"
            return Response(status_code=499)
        except (RedisError, KafkaError) as exc:
            return _respond(_backend_down(exc))

    async def _collect(self, job: schemas.Job) -> Done:
        try:
            async for event in self.client.run(job, timeout=self.timeout):
                if isinstance(event, Done):
                    return event
        except RequestFailed as exc:
            raise APIError(status_for(exc.code), exc.message, code=exc.code) from None
        except RequestTimeout as exc:
            raise APIError(504, str(exc), code="timeout") from None
        raise APIError(500, "the event stream ended without a done event", code="internal")

    @staticmethod
    async def _first(events: AsyncIterator[Chunk | Done]) -> Chunk | Done:
        try:
            return await anext(events)
        except RequestFailed as exc:
            raise APIError(status_for(exc.code), exc.message, code=exc.code) from None
        except RequestTimeout as exc:
            raise APIError(504, str(exc), code="timeout") from None

    async def _sse(self, shape: Shape, first: Chunk | Done, events: AsyncIterator[Chunk | Done],
                   include_usage: bool) -> AsyncIterator[bytes]:
        text = TextAssembler()
        try:
            yield sse(shape.chunk(None, None, first=True))
            event: Chunk | Done | None = first
            while event is not None:
                if isinstance(event, Chunk):
                    delta = text.feed(event)
                    if delta:
                        yield sse(shape.chunk(delta, None))
                else:
                    yield sse(shape.chunk(None, event.finish_reason))
                    if include_usage:
                        yield sse(shape.usage_chunk(event))
                    break
                event = await anext(events, None)
            yield sse("[DONE]")
        except (RequestFailed, RequestTimeout) as exc:  # mid-stream: the status is sent; say it in-band
            code = exc.code if isinstance(exc, RequestFailed) else "timeout"
            yield sse({"error": {"message": str(exc), "type": "server_error", "param": None, "code": code}})
        finally:
            # Closing `events` runs Client.run's finally: the cancel, unless the job had finished.
            await events.aclose()  # type: ignore[attr-defined]


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
        return _respond(APIError(404, f"no route {request.method} {request.url.path}", code="not_found"))

    async def server_error(request: Request, exc: Exception) -> Response:
        return _respond(APIError(500, f"internal error: {type(exc).__name__}: {exc}", code="internal"))

    return Starlette(
        routes=[Route("/v1/models", route("list_models"), methods=["GET"]),
                Route("/v1/completions", route("completions"), methods=["POST"]),
                Route("/v1/chat/completions", route("chat_completions"), methods=["POST"])],
        lifespan=lifespan, exception_handlers={404: not_found, 500: server_error},
    )


@click.command(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110})
@option("--host", env="STOKER_GATEWAY_HOST", default="127.0.0.1", help="address to listen on")
@option("--port", env="STOKER_GATEWAY_PORT", type=int, default=8000, help="port to listen on")
@option("--api-key", env="STOKER_API_KEY", default=None, show_default=False,
        help="require `Authorization: Bearer KEY` on every route but /health (prefer the env var)")
@kafka_options
@redis_options
@option("--timeout", env="STOKER_GATEWAY_TIMEOUT", type=float, default=300.0,
        help="seconds a request may take; also sent to the worker as the job's deadline")
@version_option("stoker-gateway")
def command(**params: Any) -> None:
    """OpenAI-compatible HTTP gateway to Stoker (/v1/completions, /v1/chat/completions, /v1/models)."""
    resolve_aliases(params, "stoker-gateway")
    import uvicorn  # the gateway extra; imported here so `import stoker.gateway.app` works for tests without it

    def factory() -> Client:
        return Client(params["bootstrap_servers"], params["redis_url"], prefix=params["prefix"],
                      topic=params["job_topic"], timeout=params["timeout"])

    app_options: dict[str, Any] = {"timeout": params["timeout"]}
    if params["api_key"]:
        if "api_key" not in inspect.signature(create_app).parameters:  # the routes' check comes with issue 18 item 1
            raise click.UsageError("--api-key / STOKER_API_KEY: this gateway does not check API keys yet")
        app_options["api_key"] = params["api_key"]
    uvicorn.run(create_app(factory, **app_options), host=params["host"], port=params["port"], log_level="info")


def main(argv: list[str] | None = None) -> None:
    command.main(args=argv, prog_name="stoker-gateway")


if __name__ == "__main__":
    main()
