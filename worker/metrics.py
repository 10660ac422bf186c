"""Prometheus metrics and the small HTTP server for /metrics, /healthz and /readyz.

prometheus_client's own server cannot answer health probes, so a tiny asyncio HTTP/1.0 responder serves all
three on one port (one request per connection; probes and scrapers need no more).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from stoker.engine import EngineStats

log = logging.getLogger("stoker.worker.metrics")
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
# Transport stages are sub-millisecond to tens of ms when healthy: fine buckets there, coarse beyond.
_STAGE_BUCKETS = (0.0005, 0.001, 0.002, 0.003, 0.005, 0.0075, 0.01, 0.015, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28)
NO_TENANT = ""  # a job without `tenant` (a real tenant is 1-64 chars, so this never collides)
OTHER_TENANT = "other"  # every tenant met after the first max_tenant_labels
DEFAULT_MAX_TENANT_LABELS = 100


class _EngineTotals(Protocol):
    """What the engine driver exposes: the last step's stats (running totals) and time spent stepping."""

    busy_s: float

    @property
    def last_stats(self) -> EngineStats | None: ...


class TenantLabels:
    """Bounds the `tenant` label's cardinality: the first `limit` distinct tenants keep their own value, later
    ones share OTHER_TENANT (each series costs memory here and in Prometheus, and tenants are user input)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._known: set[str] = set()

    def __call__(self, tenant: str | None) -> str:
        if tenant is None:
            return NO_TENANT
        if tenant in self._known:
            return tenant
        if len(self._known) < self.limit:
            self._known.add(tenant)
            return tenant
        return OTHER_TENANT


class WorkerMetrics:
    def __init__(self, max_tenant_labels: int = DEFAULT_MAX_TENANT_LABELS) -> None:
        self.tenant_label = TenantLabels(max_tenant_labels)
        self._engine: _EngineTotals | None = None
        self._engine_seen = (0, 0, 0.0)  # prefix queries, prefix hits, busy seconds already counted
        r = self.registry = CollectorRegistry()
        self.running = Gauge("stoker_requests_running", "requests in the engine's running batch", registry=r)
        self.waiting = Gauge("stoker_requests_waiting", "requests queued in the engine", registry=r)
        self.parked = Gauge("stoker_requests_parked", "jobs waiting on another worker's claim", registry=r)
        self.kv_usage = Gauge("stoker_kv_cache_usage", "share of KV blocks in use (0-1)", registry=r)
        # By tenant (bounded: see TenantLabels), counted by the worker from each request's outputs.
        self.prompt_tokens = Counter("stoker_prompt_tokens", "prompt tokens of requests the engine started",
                                     ["tenant"], registry=r)
        self.generation_tokens = Counter("stoker_generation_tokens", "tokens generated", ["tenant"], registry=r)
        self.prefix_queries = Counter("stoker_prefix_cache_queries", "prompt tokens looked up", registry=r)
        self.prefix_hits = Counter("stoker_prefix_cache_hits", "prompt tokens found cached", registry=r)
        self.ttft = Histogram("stoker_time_to_first_token_seconds", "Kafka record time to first token",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("stoker_inter_token_latency_seconds", "time between a request's chunks",
                             buckets=_ITL_BUCKETS, registry=r)
        self.e2e = Histogram("stoker_e2e_latency_seconds", "Kafka record time to terminal event",
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.queue = Histogram("stoker_queue_time_seconds", "Kafka record time to first engine step",
                               buckets=_LATENCY_BUCKETS, registry=r)
        # Where a job's first-event latency goes: seconds from the Kafka record's timestamp to each stage
        # (polled: getmany returned it; claimed: the claim script answered; engine_added: add_request
        # returned; first_output: the engine step that made its first output ended; published: the
        # pipeline carrying that first event returned). Differences of adjacent stages locate a delay.
        self.stage = Histogram("stoker_job_stage_seconds", "Kafka record time to each stage of a job's start",
                               ["stage"], buckets=_STAGE_BUCKETS, registry=r)
        self.finished = Counter("stoker_requests_finished", "requests ended, by finish reason or error code",
                                ["reason", "tenant"], registry=r)
        self.dlq = Counter("stoker_dead_letters", "records sent to the dead-letter topic", ["code"], registry=r)
        self.dlq_dropped = Counter("stoker_dead_letters_dropped", "dead letters that could not be sent in any "
                                   "form (logged, their records committed)", ["code"], registry=r)
        self.records_failed = Counter("stoker_records_failed", "records whose handling raised an unexpected error "
                                      "(dead-lettered as internal)", registry=r)
        self.events = Counter("stoker_events_published", "events written to Redis", registry=r)
        self.redis_retries = Counter("stoker_redis_retries", "Redis calls retried after a failure", ["op"],
                                     registry=r)
        self.lag = Gauge("stoker_consumer_lag", "records behind the end of the job topic, all partitions",
                         registry=r)
        self.engine_busy = Counter("stoker_engine_busy_seconds", "time spent inside engine.step()", registry=r)

    def watch_engine(self, engine: _EngineTotals) -> None:
        """Count the engine's own running totals (prefix cache, busy time) from `engine` at each scrape."""
        self._engine = engine

    def add_tokens(self, prompt: dict[str, int], generated: dict[str, int]) -> None:
        """One engine step's tokens, {tenant label: count}: one increment per tenant, not per request."""
        for label, count in prompt.items():
            self.prompt_tokens.labels(label).inc(count)
        for label, count in generated.items():
            self.generation_tokens.labels(label).inc(count)

    def _sync_engine(self) -> None:
        if self._engine is None:
            return
        stats, busy_s = self._engine.last_stats, self._engine.busy_s
        queries, hits = (stats.prefix_cache_queries, stats.prefix_cache_hits) if stats else self._engine_seen[:2]
        seen_queries, seen_hits, seen_busy = self._engine_seen
        self.prefix_queries.inc(max(0, queries - seen_queries))
        self.prefix_hits.inc(max(0, hits - seen_hits))
        self.engine_busy.inc(max(0.0, busy_s - seen_busy))
        self._engine_seen = (max(queries, seen_queries), max(hits, seen_hits), max(busy_s, seen_busy))

    def render(self) -> bytes:
        self._sync_engine()
        return generate_latest(self.registry)


class HealthServer:
    """GET /metrics, /healthz (the process is alive and its loops run), /readyz (model loaded, consumer
    joined: `ready()` says)."""

    def __init__(self, metrics: WorkerMetrics, ready: Callable[[], bool], healthy: Callable[[], bool]):
        self.metrics, self.ready, self.healthy = metrics, ready, healthy
        self._server: asyncio.Server | None = None
        self.port: int | None = None

    async def start(self, host: str, port: int) -> None:
        self._server = await asyncio.start_server(self._handle, host, port)
        self.port = self._server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            request_line = await asyncio.wait_for(reader.readline(), 5)
            while (await asyncio.wait_for(reader.readline(), 5)) not in (b"\r\n", b"\n", b""):
                pass  # headers: not needed
            parts = request_line.decode("latin-1").split()
            path = parts[1].split("?", 1)[0] if len(parts) >= 2 else ""
            if path == "/metrics":
                status, body, ctype = 200, self.metrics.render(), CONTENT_TYPE_LATEST
            elif path == "/healthz":
                ok = self.healthy()
                status, body, ctype = (200 if ok else 503), (b"ok\n" if ok else b"unhealthy\n"), "text/plain"
            elif path == "/readyz":
                ok = self.ready()
                status, body, ctype = (200 if ok else 503), (b"ready\n" if ok else b"not ready\n"), "text/plain"
            else:
                status, body, ctype = 404, b"not found: try /metrics, /healthz, /readyz\n", "text/plain"
            reason = {200: "OK", 404: "Not Found", 503: "Service Unavailable"}[status]
            writer.write(f"HTTP/1.0 {status} {reason}\r\nContent-Type: {ctype}\r\nContent-Length: {len(body)}\r\n"
                         f"Connection: close\r\n\r\n".encode() + body)
            await writer.drain()
        except (TimeoutError, ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()
