"""The worker's read-ahead backlog and its admission: which held jobs go to the engine next, past the
tenant limits. The order itself is worker.admission's (pure); the limits' Redis side is
worker.tenant_limits'; this module joins them to the request table, the metrics and the partitions held.
worker.service calls it from its poll loop (enqueue), its admit loop (next_round) and wherever a request
ends or leaves us (settle).
"""

from __future__ import annotations

import heapq
import itertools
import logging
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

import redis.asyncio as aioredis
from stoker.engine import EngineStats
from stoker.worker.admission import (
    BATCH,
    LIVE,
    NO_TENANT,
    Backlog,
    Queued,
    TenantShares,
    estimate_tokens,
    paused_classes,
)
from stoker.worker.config import WorkerConfig
from stoker.worker.metrics import WorkerMetrics
from stoker.worker.requests import Request, RequestState, RequestTable
from stoker.worker.tenant_limits import TenantGate, Verdict

log = logging.getLogger("stoker.worker")
T = TypeVar("T")
Retry = Callable[[str, Callable[[], Awaitable[Any]]], Awaitable[Any]]  # RedisIO.retry
# Bytes a job in the backlog holds beyond its record (decoded Job, request entry, queue and table slots):
# tracemalloc over 20,000 small jobs measured about 1.3 KiB each (tests/test_admission.py keeps it honest).
QUEUED_OVERHEAD_BYTES = 2048
_BATCH_ENGINE_PRIORITY = 1 << 64  # added to a batch job's priority in the engine: below every live job
BATCH_TOPIC_RECHECK_S = 30.0  # a missing batch topic is looked for again this often
_LIMITED_RETRY_S = 0.1  # a tenant refused by its limits is skipped this long before it is asked again


def model_room(cap: int, held: Mapping[str, int], stats: Mapping[str, EngineStats | None],
               min_free_kv_fraction: float) -> dict[str, int]:
    """Jobs each served model's engine may take now: `cap` (max_num_seqs running + max_waiting queued, per
    engine) less the model's jobs held (claiming or running), and none while its own KV cache is short with
    requests already waiting in it. Per model: each engine has its own slots and KV cache, so another
    model's free blocks are no room for it, and one model's full engine holds back no other model's jobs."""
    room = {}
    for name, st in stats.items():
        low_kv = st is not None and st.kv_blocks_total > 0 and st.num_waiting > 0 and \
            st.kv_blocks_free / st.kv_blocks_total < min_free_kv_fraction
        room[name] = 0 if low_kv else max(0, cap - held.get(name, 0))
    return room


@dataclass(slots=True)
class _Admitted:
    tenant: str
    estimate: int  # tokens charged at admission
    job_class: int
    used: int = 0  # tokens it really cost, once the engine finished it


class Admitter:
    def __init__(self, cfg: WorkerConfig, requests: RequestTable, metrics: WorkerMetrics, default_model: str = ""):
        self.cfg = cfg
        self.default_model = default_model  # the lane of a job without `model`
        self.requests = requests
        self.metrics = metrics
        self.backlog: Backlog[Request] = Backlog(
            TenantShares(cfg.tenant_weights(), cfg.tenant_share_half_life_s), cfg.batch_weight)
        self.batch_topic: str | None = None  # the batch class's topic, once found to exist
        self.gate: TenantGate | None = None
        self._retry: Retry | None = None
        self._cost: dict[str, _Admitted] = {}  # admitted request id -> what it was charged
        self._limited_until: dict[str, float] = {}  # tenant -> monotonic time its limits are asked again
        self._gauges_at = 0.0
        self._missing_logged = False
        # (deadline_ms, tie-break, entry) of backlog jobs with a deadline; admitted ones are skipped lazily
        self._deadlines: list[tuple[int, int, Request]] = []
        self._deadline_order = itertools.count()

    def start(self, client: aioredis.Redis, retry: Retry) -> None:
        limits = self.cfg.tenant_limits()
        if limits:
            self.gate = TenantGate(client, self.cfg.prefix, limits, int(self.cfg.claim_ttl_s * 1000))
        self._retry = retry

    @property
    def batch_topic_missing(self) -> bool:
        return self.batch_topic is None and self.cfg.batch_topic_name is not None

    def find_batch_topic(self, topics: set[str]) -> bool:
        """Read the batch class's topic when it exists (True when it was just found). A missing one is no
        error: the live topic alone is read, the worker looks again every BATCH_TOPIC_RECHECK_S, and the
        Batch API's jobs wait in Kafka meanwhile."""
        wanted = self.cfg.batch_topic_name
        if wanted is None or self.batch_topic is not None:
            return False
        if wanted in topics:
            self.batch_topic = wanted
            return True
        if not self._missing_logged:
            self._missing_logged = True
            log.warning("event=batch_topic_missing topic=%s hint=%r", wanted, "reading the job topic alone until "
                        "it exists (`ops/stack up` makes it); --no-batch-topic silences this")
        return False

    def class_of(self, topic: str) -> int:
        return BATCH if topic == self.batch_topic else LIVE

    def enqueue(self, entry: Request, size_bytes: int) -> None:
        """A new job into the backlog (its records stay in flight: the watermark waits for it)."""
        self.requests.put(entry, RequestState.QUEUED)
        job = entry.job
        self.backlog.add(Queued(entry, self.class_of(entry.records[0][0].topic), job.priority,
                                job.tenant or NO_TENANT, size_bytes + QUEUED_OVERHEAD_BYTES, estimate_tokens(job),
                                lane=self.lane(job.model)))
        if job.deadline_ms is not None:
            heapq.heappush(self._deadlines, (job.deadline_ms, next(self._deadline_order), entry))
            if len(self._deadlines) > 2 * len(self.backlog) + 1024:  # entries admitted meanwhile piled up
                self._deadlines = [d for d in self._deadlines if d[2].state is RequestState.QUEUED]
                heapq.heapify(self._deadlines)

    def lane(self, model: str | None) -> str:
        return self.default_model if model is None else model

    async def next_round(self, free: int, assigned: set[Any], room: Mapping[str, int] | None = None) -> list[Request]:
        """Up to `free` jobs in admission order, past the tenant limits, as CLAIMING entries to claim; at most
        room[model] of a model's jobs (a model not in `room` is bounded by `free` alone). When every job
        picked was refused, picks again without those tenants (each pass skips one more)."""
        while free > 0 and len(self.backlog):
            now = time.monotonic()
            self._limited_until = {t: until for t, until in self._limited_until.items() if until > now}
            limited = self._limited_until.keys()
            left = dict(room or {})
            full = {lane for lane, n in left.items() if n <= 0}
            picked: list[Queued[Request]] = []
            while len(picked) < free and (queued := self.backlog.pop(limited, full)) is not None:
                picked.append(queued)
                self.requests.put(queued.item, RequestState.CLAIMING)  # a revoke meanwhile leaves it to us
                if queued.lane in left:
                    left[queued.lane] -= 1
                    if left[queued.lane] <= 0:
                        full.add(queued.lane)
            if not picked:
                return []
            if self.gate is not None:
                picked = await self._past_limits(self.gate, picked, assigned)
            for queued in picked:
                self._cost[queued.item.request_id] = _Admitted(queued.tenant, queued.cost_tokens, queued.job_class)
            if picked:
                return [queued.item for queued in picked]
        return []

    async def _past_limits(self, gate: TenantGate, picked: list[Queued[Request]],
                           assigned: set[Any]) -> list[Queued[Request]]:
        """The picked jobs whose tenants' limits let them run; the others go back to the backlog and their
        tenants are skipped for a moment (other tenants' jobs go on meanwhile)."""
        assert self._retry is not None
        asking = [q for q in picked if gate.limited(q.item.job.tenant)]
        if not asking:
            return picked
        candidates = [(q.item.request_id, q.tenant, q.cost_tokens) for q in asking]
        verdicts = await self._retry("tenant_gate", lambda: gate.ask(candidates))
        refused = {id(q): v for q, v in zip(asking, verdicts, strict=True) if v != Verdict.ADMITTED}
        until = time.monotonic() + _LIMITED_RETRY_S
        for queued in picked:
            verdict = refused.get(id(queued))
            if verdict is not None:
                self._limited_until[queued.tenant] = until
                self.metrics.tenant_limited.labels(self.metrics.tenant_label(queued.tenant),
                                                   Verdict.NAMES[verdict]).inc()
                self._requeue(queued, assigned)
        return [q for q in picked if id(q) not in refused]

    def _requeue(self, queued: Queued[Request], assigned: set[Any]) -> None:
        entry = queued.item
        entry.records = [r for r in entry.records if r[0] in assigned]  # a revoke may have come meanwhile
        if not entry.records:
            self.requests.remove(entry)
            return
        self.requests.put(entry, RequestState.QUEUED)
        self.backlog.put_back(queued)

    def engine_priority(self, request_id: str, priority: int) -> int:
        """The engine's priority for an admitted job: a batch job's below every live one, so the engine's own
        queue and its preemption keep the class order too."""
        cost = self._cost.get(request_id)
        return priority + _BATCH_ENGINE_PRIORITY if cost is not None and cost.job_class == BATCH else priority

    def used(self, request_id: str, tokens: int) -> None:
        """The engine finished the request after `tokens` (prompt + completion): settled with its end."""
        cost = self._cost.get(request_id)
        if cost is not None:
            cost.used = tokens

    def settle(self, request_id: str) -> None:
        """The admitted request ended (its terminal event is stored) or left us: its tenant's share and limits
        learn its real cost and its running slot frees. Only then: a slot freed at the engine's last step
        would let the next job start while this one's claim still stands. A no-op after the first call."""
        cost = self._cost.pop(request_id, None)
        if cost is None:
            return
        self.backlog.charge(cost.tenant, cost.used - cost.estimate)
        if self.gate is not None:
            self.gate.used(request_id, cost.used)
            self.gate.release(request_id)

    def take_expired(self, now_ms: float, cancelled: Iterable[str]) -> list[Request]:
        """Backlog jobs past their deadline or cancelled, out of their turn (as CLAIMING entries): claimed,
        they end `deadline` / `cancelled` without running, instead of when admission reaches them. The
        worker calls it about once a second; it costs a pass over the backlog (~20 ms for 20,000 jobs on a
        busy 2-core box) only when one of its jobs did expire."""
        ids = {rid for rid in cancelled if self.requests.get(rid, RequestState.QUEUED) is not None}
        while self._deadlines and self._deadlines[0][0] <= now_ms:
            _, _, entry = heapq.heappop(self._deadlines)
            if self.requests.get(entry.request_id, RequestState.QUEUED) is entry:
                ids.add(entry.request_id)
        if not ids:
            return []
        gone = [queued.item for queued in self.backlog.remove_if(lambda q: q.item.request_id in ids)]
        for entry in gone:
            self.requests.put(entry, RequestState.CLAIMING)
        return gone

    def drop(self, revoked: set[Any]) -> None:
        """Backlog jobs read from revoked partitions are the new owner's now (nothing of theirs was claimed)."""
        for queued in self.backlog.remove_if(lambda q: any(r[0] in revoked for r in q.item.records)):
            entry = queued.item
            entry.records = [r for r in entry.records if r[0] not in revoked]
            if entry.records:  # also read from a partition still ours (a duplicate): it stays
                self.backlog.put_back(queued)
            else:
                self.requests.remove(entry)

    def paused(self, now_paused: set[int]) -> set[int]:
        cfg = self.cfg
        return paused_classes(self.backlog.bytes_by_class, cfg.max_backlog_bytes, cfg.batch_backlog_share, now_paused)

    async def flush(self) -> None:
        """Send the tenant limits' releases and settlements; refresh the backlog gauges once a second."""
        if self.gate is not None and self.gate.pending:
            assert self._retry is not None
            await self._retry("tenant_flush", self.gate.flush)
        if time.monotonic() >= self._gauges_at:
            self._gauges_at = time.monotonic() + 1.0
            backlog = self.backlog
            self.metrics.set_backlog(backlog.jobs_by_class, backlog.bytes_by_class, backlog.jobs_by_tenant)

    async def renew(self) -> None:
        if self.gate is not None:
            assert self._retry is not None
            await self._retry("tenant_renew", self.gate.renew)
