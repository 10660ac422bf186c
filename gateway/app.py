"""`stoker-gateway`: an OpenAI-compatible HTTP front over the queue (Starlette + uvicorn).

Each call becomes one job, produced to Kafka and answered from the request's events in Redis, so the
gateway holds no model and scales apart from the workers. Each job goes to the topic whose workers serve
its model, learned from the workers' heartbeats (gateway.routing); `/v1/models` lists the models it can
route, and any other model is answered 404 before a job is produced. A client that hangs up cancels its
job (Client.run's cancel_on_exit does the cancel): before the first event, in both the streaming and the
plain path, a task reading the ASGI `receive` channel notices it; once a stream has started, Starlette's own
disconnect listener does.
The job carries deadline_ms = now + the gateway's timeout, so a worker stops spending GPU time on an answer
nobody waits for any more.

A request with n choices (or a batch of prompts) fans out to one job per choice, each with its own request
id, so they land on different partitions and usually on different workers: a prompt shared by the choices
is not served from one prefix cache across them.

What a request may ask and how it maps to a job is in gateway.mapping; this module is the HTTP side: the
routes, the API key (`--api-key`, every route but /health) and the gateway's own Prometheus metrics.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Sequence
from contextlib import asynccontextmanager
from typing import Any, TypeVar

import click
from aiokafka.errors import KafkaError
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from redis.exceptions import RedisError
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from stoker.client.client import (
    Client,
    RequestFailed,
    RequestTimeout,
)
from stoker.client.options import kafka_options, option, redis_options, resolve_aliases, version_option
from stoker.gateway.batch_api import BatchAPI, batch_config, batch_options, batch_routes, route_label
from stoker.gateway.batches import BatchConfig, BatchService
from stoker.gateway.mapping import (
    APIError,
    Choice,
    Plan,
    Shape,
    json_object,
    plan_request,
    shape_for,
    sse,
    status_for,
    total_usage,
)
from stoker.gateway.routing import ModelRoute, RouteCache
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

    def __init__(self, body: AsyncIterator[bytes], streams: Sequence[AsyncIterator[Chunk | Done]],
                 headers: dict[str, str]):
        super().__init__(body, media_type="text/event-stream", headers=headers)
        self._body, self._streams = body, streams

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._body.aclose()  # type: ignore[attr-defined]
            await _close_all(self._streams)


async def _close_all(streams: Sequence[AsyncIterator[Chunk | Done]]) -> None:
    """Closing a job's event iterator runs Client.run's finally: the cancel, unless the job had finished."""
    for events in streams:
        await events.aclose()  # type: ignore[attr-defined]


async def _all(works: list[Coroutine[Any, Any, T]]) -> list[T]:
    """Every result, or the first failure with the rest cancelled (so their jobs are cancelled too)."""
    try:
        async with asyncio.TaskGroup() as group:
            tasks = [group.create_task(w) for w in works]
    except BaseExceptionGroup as failed:
        raise failed.exceptions[0] from None
    return [t.result() for t in tasks]


# Route label values: the routes below, and one value for everything else, so a scan of random paths
# cannot grow the metrics without bound.
ROUTES = ("/health", "/metrics", "/v1/models", "/v1/models/{model}", "/v1/completions", "/v1/chat/completions")
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


class GatewayMetrics:
    """The gateway's own Prometheus metrics (the workers serve the engine's)."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter("stoker_gateway_requests", "HTTP requests answered, by route and status",
                                ["route", "status"], registry=r)
        self.latency = Histogram("stoker_gateway_request_duration_seconds", "request start to the last byte "
                                 "of the answer (a stream's end)", ["route"], buckets=_LATENCY_BUCKETS, registry=r)
        self.errors = Counter("stoker_gateway_errors", "error answers, by route and OpenAI error code",
                              ["route", "code"], registry=r)
        self.jobs = Counter("stoker_gateway_jobs", "jobs produced (one per choice)", registry=r)

    @staticmethod
    def route_of(scope: Scope) -> str:
        path = scope.get("path", "")
        if path.startswith("/v1/models/"):
            return "/v1/models/{model}"
        if (batch_route := route_label(path)) is not None:
            return batch_route
        return path if path in ROUTES else "other"


class _Edge:
    """ASGI middleware around every route: the API key (as vLLM: `Authorization: Bearer KEY`, every route
    but /health), and the request, latency and error metrics."""

    def __init__(self, app: ASGIApp, metrics: GatewayMetrics, api_key: str | None):
        self.app, self.metrics, self.api_key = app, metrics, api_key

    def _authorized(self, scope: Scope) -> bool:
        if self.api_key is None or scope.get("path") == "/health":
            return True
        given = dict(scope.get("headers") or []).get(b"authorization", b"")
        return hmac.compare_digest(given, f"Bearer {self.api_key}".encode())  # constant time: no key oracle

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        route, start, status = self.metrics.route_of(scope), time.perf_counter(), 500

        async def send_noting_status(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            if self._authorized(scope):
                await self.app(scope, receive, send_noting_status)
            else:
                self.metrics.errors.labels(route, "invalid_api_key").inc()
                await _respond(APIError(401, "invalid or missing API key: send `Authorization: Bearer <key>`",
                                        code="invalid_api_key"))(scope, receive, send_noting_status)
        finally:
            self.metrics.requests.labels(route, str(status)).inc()
            self.metrics.latency.labels(route).observe(time.perf_counter() - start)


def _backend_down(exc: Exception) -> APIError:
    """Redis or Kafka failing is not the caller's fault nor a bug of ours: 503, so clients retry later."""
    backend = "Redis" if isinstance(exc, RedisError) else "Kafka"
    return APIError(503, f"{backend} is unavailable: {type(exc).__name__}: {exc}", code="backend_unavailable")


class Gateway:
    def __init__(self, client: Client, *, timeout: float = 300.0, metrics: GatewayMetrics | None = None):
        self.client, self.timeout = client, timeout
        self.metrics = metrics or GatewayMetrics()
        self.routes = RouteCache(client.workers, client.topic, WORKER_CACHE_S)

    async def served_models(self) -> list[str]:
        """The models a job can be routed for (see gateway.routing)."""
        return (await self.routes.table()).models

    async def _resolve_model(self, body: dict[str, Any]) -> tuple[str, ModelRoute]:
        """The job's model and the route of its topic, or the APIError answered instead of producing it."""
        table = await self.routes.table()
        if not table.workers:
            raise APIError(503, "no live workers: start one with `stoker-worker` (see `stoker workers`)",
                           code="no_workers")
        model, models = body.get("model"), table.models
        if model is None and len(models) == 1:  # OpenAI requires it; be lenient when one model is routable
            model = models[0]
        if model is None:
            raise APIError(400, f"`model` is required; served: {', '.join(models) or 'none'}", param="model")
        route = table.routes.get(model) if isinstance(model, str) else None
        if route is None:
            raise APIError(404, table.not_routable(model), param="model", code="model_not_found")
        return model, route

    def _error(self, request: Request, error: APIError) -> JSONResponse:
        route = self.metrics.route_of(request.scope)
        self.metrics.errors.labels(route, error.code or str(error.status)).inc()
        return _respond(error)

    # ---- endpoints -------------------------------------------------------------------------------------
    async def health(self, request: Request) -> Response:
        """The process answers (as vLLM's /health): liveness, not whether workers are up (see /v1/models)."""
        return PlainTextResponse("ok\n")

    async def render_metrics(self, request: Request) -> Response:
        return Response(generate_latest(self.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @staticmethod
    def _model_card(model: str) -> dict[str, Any]:
        return {"id": model, "object": "model", "created": 0, "owned_by": "stoker"}

    async def list_models(self, request: Request) -> Response:
        try:
            models = await self.served_models()
        except RedisError as exc:
            return self._error(request, _backend_down(exc))
        return JSONResponse({"object": "list", "data": [self._model_card(m) for m in models]})

    async def get_model(self, request: Request) -> Response:
        model = request.path_params["model"]
        try:
            table = await self.routes.table()
        except RedisError as exc:
            return self._error(request, _backend_down(exc))
        if model not in table.routes:
            return self._error(request, APIError(404, table.not_routable(model), param="model",
                                                 code="model_not_found"))
        return JSONResponse(self._model_card(model))

    async def completions(self, request: Request) -> Response:
        return await self._handle(request, chat=False)

    async def chat_completions(self, request: Request) -> Response:
        return await self._handle(request, chat=True)

    async def _handle(self, request: Request, chat: bool) -> Response:
        try:
            body = json_object(await request.body())
            plan = plan_request(body, chat)
            model, route = await self._resolve_model(body)
            deadline_ms = int(time.time() * 1000 + self.timeout * 1000)
            try:
                jobs = [self.client.make_job(model=model, deadline_ms=deadline_ms, **fields) for fields in plan.jobs()]
            except ContractError as exc:
                raise APIError(400, exc.message, code=exc.code) from None
            self.metrics.jobs.inc(len(jobs))
            shape = shape_for(chat, jobs[0].request_id, model, plan.top_logprobs)
            headers = {"x-request-id": jobs[0].request_id}
            if len(jobs) > 1:
                headers["x-request-ids"] = ",".join(job.request_id for job in jobs)
            hangup = _Hangup(request.receive)
            try:
                if plan.stream:
                    streams = [self.client.run(job, timeout=self.timeout, topic=route.topic) for job in jobs]
                    try:  # errors before the first events still get a status code
                        firsts = await hangup.race(_all([self._first(events) for events in streams]))
                    except BaseException:
                        await _close_all(streams)
                        raise
                    return _EventStream(self._sse(shape, plan, firsts, streams), streams, headers)
                choices = await hangup.race(_all([self._collect(i, job, route.topic) for i, job in enumerate(jobs)]))
                return JSONResponse(shape.whole(choices, plan.n), headers=headers)
            finally:
                await hangup.close()  # before Starlette's listener takes over `receive` for the stream
        except APIError as exc:
            return self._error(request, exc)
        except ClientGone:  # nobody reads this; 499 is the usual log mark for "client closed request"
            return Response(status_code=499)
        except (RedisError, KafkaError) as exc:
            return self._error(request, _backend_down(exc))

    async def _collect(self, index: int, job: schemas.Job, topic: str) -> Choice:
        choice = Choice(index)
        try:
            async for event in self.client.run(job, timeout=self.timeout, topic=topic):
                if isinstance(event, Done):
                    choice.done = event
                    return choice
                choice.logprobs.feed(event)
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

    async def _sse(self, shape: Shape, plan: Plan, firsts: list[Chunk | Done],
                   streams: Sequence[AsyncIterator[Chunk | Done]]) -> AsyncIterator[bytes]:
        """One SSE stream of every choice's chunks, in the order their events arrive; one pump task per job
        feeds a queue (None from a pump: that job's events ended)."""
        queue: asyncio.Queue[tuple[int, Chunk | Done | Exception | None]] = asyncio.Queue()

        async def pump(index: int, event: Chunk | Done | None, events: AsyncIterator[Chunk | Done]) -> None:
            try:
                while event is not None:
                    queue.put_nowait((index, event))
                    if isinstance(event, Done):
                        break
                    event = await anext(events, None)
            except (RequestFailed, RequestTimeout) as exc:
                queue.put_nowait((index, exc))
            finally:
                queue.put_nowait((index, None))

        choices = [Choice(i) for i in range(len(streams))]
        pumps = [asyncio.create_task(pump(i, first, events))
                 for i, (first, events) in enumerate(zip(firsts, streams, strict=True))]
        try:
            for choice in choices:
                yield sse(shape.chunk(choice, None, None, first=True))
            running = len(pumps)
            while running:
                index, event = await queue.get()
                choice = choices[index]
                if event is None:
                    running -= 1
                elif isinstance(event, Exception):  # mid-stream: the status is sent; say it in-band
                    code = event.code if isinstance(event, RequestFailed) else "timeout"
                    yield sse({"error": {"message": str(event), "type": "server_error", "param": None, "code": code}})
                    return
                elif isinstance(event, Chunk):
                    delta, entries = choice.text.feed(event), choice.logprobs.feed(event)
                    if delta or entries:
                        yield sse(shape.chunk(choice, delta, None, entries=entries))
                else:
                    choice.done = event
                    yield sse(shape.chunk(choice, None, event.finish_reason))
            if plan.include_usage:
                yield sse(shape.usage_chunk(total_usage([c.done for c in choices if c.done], plan.n)))
            yield sse("[DONE]")
        finally:
            for task in pumps:
                task.cancel()
            await asyncio.gather(*pumps, return_exceptions=True)
            await _close_all(streams)


def create_app(client_factory: Callable[[], Client], *, timeout: float = 300.0,
               api_key: str | None = None, batch: BatchConfig | None = None) -> Starlette:
    """The ASGI app; the client starts and stops with it (lifespan). With `api_key`, every route but
    /health answers 401 unless the request sends `Authorization: Bearer <api_key>`. With `batch`, the
    Batch API (/v1/files, /v1/batches: gateway.batch_api) is served and its batches gathered."""
    holder: dict[str, Any] = {}
    metrics = GatewayMetrics()

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        async with client_factory() as client:
            holder["gw"] = gw = Gateway(client, timeout=timeout, metrics=metrics)
            if batch is None:
                yield
                return
            service = BatchService(client, batch, metrics.registry, routes=gw.routes)
            holder["batch"] = BatchAPI(service, gw._error)
            await service.start()
            try:
                yield
            finally:
                await service.stop()

    def route(name: str) -> Callable[[Request], Any]:
        async def endpoint(request: Request) -> Response:
            return await getattr(holder["gw"], name)(request)
        return endpoint

    def counted(error: APIError, request: Request) -> Response:
        metrics.errors.labels(metrics.route_of(request.scope), error.code or str(error.status)).inc()
        return _respond(error)

    async def not_found(request: Request, exc: Exception) -> Response:
        return counted(APIError(404, f"no route {request.method} {request.url.path}", code="not_found"), request)

    async def server_error(request: Request, exc: Exception) -> Response:
        return counted(APIError(500, f"internal error: {type(exc).__name__}: {exc}", code="internal"), request)

    return Starlette(
        routes=[*(batch_routes(lambda: holder["batch"]) if batch is not None else []),
                Route("/health", route("health"), methods=["GET"]),
                Route("/metrics", route("render_metrics"), methods=["GET"]),
                Route("/v1/models", route("list_models"), methods=["GET"]),
                Route("/v1/models/{model:path}", route("get_model"), methods=["GET"]),
                Route("/v1/completions", route("completions"), methods=["POST"]),
                Route("/v1/chat/completions", route("chat_completions"), methods=["POST"])],
        middleware=[Middleware(_Edge, metrics=metrics, api_key=api_key)],
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
@batch_options
@version_option("stoker-gateway")
def command(**params: Any) -> None:
    """OpenAI-compatible HTTP gateway to Stoker (/v1/completions, /v1/chat/completions, /v1/models, and the Batch
    API: /v1/files, /v1/batches)."""
    resolve_aliases(params, "stoker-gateway")
    import uvicorn  # the gateway extra; imported here so `import stoker.gateway.app` works for tests without it

    def factory() -> Client:
        return Client(params["bootstrap_servers"], params["redis_url"], prefix=params["prefix"],
                      topic=params["job_topic"], timeout=params["timeout"])

    uvicorn.run(create_app(factory, timeout=params["timeout"], api_key=params["api_key"] or None,
                           batch=batch_config(params)),
                host=params["host"], port=params["port"], log_level="info")


def main(argv: list[str] | None = None) -> None:
    command.main(args=argv, prog_name="stoker-gateway")


if __name__ == "__main__":
    main()
