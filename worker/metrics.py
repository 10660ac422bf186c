"""Prometheus metrics and the small HTTP server for /metrics, /healthz and /readyz.

prometheus_client's own server cannot answer health probes, so a tiny asyncio HTTP/1.0 responder serves all
three on one port (one request per connection; probes and scrapers need no more).

Beside our `stoker_*` families the worker serves the vLLM names that Grafana boards and KEDA scalers already
query (`vllm:num_requests_running`, `vllm:time_to_first_token_seconds`, ...; VLLM_FAMILIES), with a
`model_name` label. They are views, not second metrics: `VllmView` reads our metrics' current values at
scrape time and exposes them again under vLLM's names, so the per-token path still makes one observation
(the decode loop runs about 10,000 tokens/s per worker; worker/histogram.py's LoopHistogram observes each in
0.17 us where prometheus_client's Histogram took 1.09). Histograms
keep our buckets, which histogram_quantile reads as well as vLLM's. The view costs about 5 ms a scrape with
100 tenant labels (the whole render about 20 ms; a 2-core development box), on the loop, once per scrape.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable, Iterator
from typing import Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.registry import Collector
from stoker.engine import EngineStats
from stoker.worker.histogram import LoopHistogram
from stoker.worker.stage_log import StageLog

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


# {served model name: (loaded | loading | unloaded | failed, its latest stats or None)}
ModelStates = Callable[[], dict[str, tuple[str, EngineStats | None]]]


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


def _samples(metric: Counter | Gauge | LoopHistogram) -> Iterator[tuple[str, dict[str, str], float]]:
    for family in metric.collect():
        for sample in family.samples:
            yield sample.name, sample.labels, sample.value


def _total(metric: Counter | Gauge, **match: str) -> float:
    """Sum of a metric's series (over every label but those in `match`)."""
    return sum(value for name, labels, value in _samples(metric) if not name.endswith("_created")
               and all(labels.get(k) == v for k, v in match.items()))


class VllmView(Collector):
    """vLLM's metric families, read from ours at scrape time (see the module's docstring)."""

    # finish reasons of ours -> vLLM's `finished_reason` values; error codes are not successes
    SUCCESS_REASONS = {"stop": "stop", "length": "length", "cancelled": "abort", "deadline": "abort"}

    def __init__(self, metrics: WorkerMetrics, model_name: str):
        self.m, self.model_name = metrics, model_name

    def _gauge(self, name: str, doc: str, value: float) -> Metric:
        family = GaugeMetricFamily(name, doc, labels=["model_name"])
        family.add_metric([self.model_name], value)
        return family

    def _counter(self, name: str, doc: str, value: float) -> Metric:
        family = CounterMetricFamily(name, doc, labels=["model_name"])
        family.add_metric([self.model_name], value)
        return family

    def _histogram(self, name: str, doc: str, source: LoopHistogram) -> Metric:
        buckets, total = [], 0.0
        for sample, labels, value in _samples(source):
            if sample.endswith("_bucket"):
                buckets.append((labels["le"], value))
            elif sample.endswith("_sum"):
                total = value
        family = HistogramMetricFamily(name, doc, labels=["model_name"])
        family.add_metric([self.model_name], buckets, total)
        return family

    def collect(self) -> Iterator[Metric]:
        m = self.m
        yield self._gauge("vllm:num_requests_running", "requests in the running batch", _total(m.running))
        yield self._gauge("vllm:num_requests_waiting", "requests queued in the engine", _total(m.waiting))
        yield self._gauge("vllm:kv_cache_usage_perc", "KV-cache usage (1 = full)", _total(m.kv_usage))
        yield self._counter("vllm:prompt_tokens", "prompt tokens processed", _total(m.prompt_tokens))
        yield self._counter("vllm:generation_tokens", "tokens generated", _total(m.generation_tokens))
        yield self._histogram("vllm:time_to_first_token_seconds", "time to first token (from the Kafka record)",
                              m.ttft)
        yield self._histogram("vllm:inter_token_latency_seconds", "time between a request's outputs", m.itl)
        yield self._histogram("vllm:e2e_request_latency_seconds", "Kafka record to the terminal event", m.e2e)
        success = CounterMetricFamily("vllm:request_success", "requests finished, by finished_reason",
                                      labels=["model_name", "finished_reason"])
        by_reason: dict[str, float] = {}
        for sample, labels, value in _samples(m.finished):
            reason = self.SUCCESS_REASONS.get(labels.get("reason", ""))
            if reason is not None and sample.endswith("_total"):
                by_reason[reason] = by_reason.get(reason, 0.0) + value
        for reason, value in sorted(by_reason.items()):
            success.add_metric([self.model_name, reason], value)
        yield success


class WorkerMetrics:
    def __init__(self, max_tenant_labels: int = DEFAULT_MAX_TENANT_LABELS, model_name: str = "") -> None:
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
        self.ttft = LoopHistogram("stoker_time_to_first_token_seconds", "Kafka record time to first token",
                                  _LATENCY_BUCKETS, registry=r)
        self.itl = LoopHistogram("stoker_inter_token_latency_seconds", "time between a request's chunks",
                                 _ITL_BUCKETS, registry=r)
        self.e2e = LoopHistogram("stoker_e2e_latency_seconds", "Kafka record time to terminal event",
                                 _LATENCY_BUCKETS, registry=r)
        self.queue = LoopHistogram("stoker_queue_time_seconds", "Kafka record time to first engine step",
                                   _LATENCY_BUCKETS, registry=r)
        # Where a job's first-event latency goes: seconds from the Kafka record's timestamp to each stage
        # (polled: getmany returned it; claimed: the claim script answered; engine_added: add_request
        # returned; scheduled: the engine's thread launched its first step (engine_added -> scheduled is the
        # step loop's wake-up); first_output: the engine step that made its first output ended; published: the
        # pipeline carrying that first event returned). Differences of adjacent stages locate a delay.
        self.stage = LoopHistogram("stoker_job_stage_seconds", "Kafka record time to each stage of a job's start",
                                   _STAGE_BUCKETS, ["stage"], registry=r)
        self.job_stages = StageLog()  # the same stages per job for the latest jobs (GET /stages)
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
        # The autoscaling signal (README: KEDA): records not yet done, per partition this worker holds.
        self.partition_lag = Gauge("stoker_consumer_partition_lag", "records behind the end of each partition "
                                   "this worker consumes", ["topic", "partition", "model_name"], registry=r)
        # Per served model (a worker may hold several, worker/models.py): set from the engine at each scrape.
        self.model_loaded = Gauge("stoker_model_loaded", "1 while the model is loaded, 0 while unloaded or loading "
                                  "(an unloaded model reloads on its next job)", ["model"], registry=r)
        self.model_running = Gauge("stoker_model_requests_running", "requests in this model's running batch",
                                   ["model"], registry=r)
        self.model_waiting = Gauge("stoker_model_requests_waiting", "requests queued for this model",
                                   ["model"], registry=r)
        self.model_kv_usage = Gauge("stoker_model_kv_cache_usage", "share of this model's KV blocks in use (0-1)",
                                    ["model"], registry=r)
        self._models: ModelStates | None = None
        self.group_conflicts = Gauge("stoker_group_conflicts", "live workers of this worker's group, topic or batch "
                                     "topic that serve another model set (re-checked while running; should be 0)",
                                     registry=r)
        # The backlog read ahead of the engine (worker.admission), and tenants held back by their limits.
        self.backlog_jobs = Gauge("stoker_backlog_jobs", "jobs read ahead, waiting for admission", ["class"],
                                  registry=r)
        self.backlog_bytes = Gauge("stoker_backlog_bytes", "bytes the backlog holds (estimate)", ["class"],
                                   registry=r)
        self.tenant_backlog = Gauge("stoker_tenant_backlog_jobs", "backlog jobs by tenant", ["tenant"], registry=r)
        self.tenant_limited = Counter("stoker_tenant_limited", "admissions refused by a tenant limit (the job "
                                      "waits)", ["tenant", "limit"], registry=r)
        self.model_name = model_name
        self.engine_busy = Counter("stoker_engine_busy_seconds", "time spent inside engine.step()", registry=r)
        r.register(VllmView(self, model_name))

    def set_lag(self, by_partition: dict[tuple[str, int], int]) -> None:
        """Lag of each partition held now; partitions given away lose their series (no stale lag)."""
        self.lag.set(sum(by_partition.values()))
        self.partition_lag.clear()
        for (topic, partition), lag in by_partition.items():
            self.partition_lag.labels(topic, str(partition), self.model_name).set(lag)

    def set_backlog(self, jobs: list[int], size: list[int], by_tenant: dict[str, int]) -> None:
        """The backlog's size by class (live, batch) and its jobs by tenant (bounded labels)."""
        for name, count, held in zip(("live", "batch"), jobs, size, strict=True):
            self.backlog_jobs.labels(name).set(count)
            self.backlog_bytes.labels(name).set(held)
        labelled: dict[str, int] = {}
        for tenant, count in by_tenant.items():
            label = self.tenant_label(tenant or None)
            labelled[label] = labelled.get(label, 0) + count
        self.tenant_backlog.clear()
        for label, count in labelled.items():
            self.tenant_backlog.labels(label).set(count)

    def watch_engine(self, engine: _EngineTotals) -> None:
        """Count the engine's own running totals (prefix cache, busy time) from `engine` at each scrape."""
        self._engine = engine

    def watch_models(self, states: ModelStates) -> None:
        """Read each served model's state and stats from `states` at each scrape."""
        self._models = states

    def _sync_models(self) -> None:
        if self._models is None:
            return
        for name, (state, stats) in self._models().items():
            self.model_loaded.labels(name).set(1 if state == "loaded" else 0)
            self.model_running.labels(name).set(stats.num_running if stats else 0)
            self.model_waiting.labels(name).set(stats.num_waiting if stats else 0)
            self.model_kv_usage.labels(name).set(stats.kv_usage if stats and stats.kv_blocks_total else 0)

    def add_tokens(self, prompt: dict[str | None, int], generated: dict[str | None, int]) -> None:
        """One engine step's tokens, {the jobs' tenant: count}: one increment per tenant, not per request."""
        for tenant, count in prompt.items():
            self.prompt_tokens.labels(self.tenant_label(tenant)).inc(count)
        for tenant, count in generated.items():
            self.generation_tokens.labels(self.tenant_label(tenant)).inc(count)

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
        self._sync_models()
        return generate_latest(self.registry)


class HealthServer:
    """GET /metrics, /healthz (the process is alive and its loops run), /readyz (model loaded, consumer
    joined: `ready()` says), and /stages only when `stages` is on (--debug-stages: it lists request ids)."""

    def __init__(self, metrics: WorkerMetrics, ready: Callable[[], bool], healthy: Callable[[], bool],
                 model_state: Callable[[str], str | None] | None = None, stages: bool = False):
        self.metrics, self.ready, self.healthy = metrics, ready, healthy
        self.stages = stages
        self.model_state = model_state  # /readyz/<model>: that model's state (None: not served here)
        self._server: asyncio.Server | None = None
        self.port: int | None = None

    async def start(self, host: str, port: int) -> None:
        self._server = await asyncio.start_server(self._handle, host, port)
        self.port = self._server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

    def _model_ready(self, name: str) -> tuple[int, bytes, str]:
        """200 when the worker is ready and the model is loaded or unloaded-on-idle (its next job reloads it);
        503 while it loads or after its load failed; 404 for a model not served here."""
        assert self.model_state is not None
        state = self.model_state(name)
        if state is None:
            return 404, f"model {name!r} is not served here\n".encode(), "text/plain"
        ok = self.ready() and state in ("loaded", "unloaded")
        return (200 if ok else 503), f"{state}\n".encode(), "text/plain"

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            request_line = await asyncio.wait_for(reader.readline(), 5)
            while (await asyncio.wait_for(reader.readline(), 5)) not in (b"\r\n", b"\n", b""):
                pass  # headers: not needed
            parts = request_line.decode("latin-1").split()
            path = parts[1].split("?", 1)[0] if len(parts) >= 2 else ""
            if path == "/metrics":
                status, body, ctype = 200, self.metrics.render(), CONTENT_TYPE_LATEST
            elif path == "/stages" and self.stages:
                status, body, ctype = 200, json.dumps(self.metrics.job_stages.snapshot()).encode(), "application/json"
            elif path == "/stages":
                status, body, ctype = 404, b"/stages is off: start the worker with --debug-stages\n", "text/plain"
            elif path == "/healthz":
                ok = self.healthy()
                status, body, ctype = (200 if ok else 503), (b"ok\n" if ok else b"unhealthy\n"), "text/plain"
            elif path == "/readyz":
                ok = self.ready()
                status, body, ctype = (200 if ok else 503), (b"ready\n" if ok else b"not ready\n"), "text/plain"
            elif path.startswith("/readyz/") and self.model_state is not None:
                status, body, ctype = self._model_ready(path.removeprefix("/readyz/"))
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
