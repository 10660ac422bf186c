"""Who runs next: the order in which jobs read ahead of the engine are admitted to it.

Kafka hands a partition's records out in order, so a tenant's 20 jobs produced behind another's 50,000 would
wait for all of them. The worker therefore reads ahead into this backlog (bounded in bytes by the caller)
and admits from it, in this order:
  1. the priority class: live (the job topic) before batch (its ".batch" sibling); while both wait, the
     batch class still gets `batch_weight` admissions per live one (0 = only when no live job waits),
  2. the job's `priority` (lower first),
  3. the tenant with the least weighted share of recent tokens (TenantShares: tokens decayed with a
     half-life, divided by the tenant's weight), so a tenant with a burst yields to one without,
  4. arrival (the order the worker read the records in).
A tenant is charged its job's estimated tokens when the job is admitted (so one admission round does not
hand every slot to the tenant that was lowest at its start) and the difference to the real count when it ends.
Each job also has a `lane` (the model it asks for): `pop` skips the lanes the caller names (a model whose
engine is full), so one saturated model never holds back the jobs of another; a tenant's queue is kept per
lane for that, its share stays one.

Pure Python (no Kafka, no Redis, no clock but the one passed in), so it is tested alone
(tests/test_admission.py). Every operation is O(log n) in the jobs and tenants held, but for `remove_if`
(a rebalance: O(n)).
"""

from __future__ import annotations

import bisect
import heapq
import itertools
import math
import time
from collections import deque
from collections.abc import Callable, Container, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from stoker.schemas import Job

LIVE, BATCH = 0, 1  # priority classes, in the order they are served
CLASS_NAMES = ("live", "batch")
NO_TENANT = ""  # jobs without a tenant share one account (a real tenant is 1-64 chars)
_REBASE_AFTER = 512.0  # half-lives between rebases of the usage scale (2**512 stays far below float's max)

T = TypeVar("T")


def estimate_tokens(job: Job) -> int:
    """Tokens a job may cost before it is tokenized: its prompt (ids counted, text at ~4 bytes a token) plus
    max_tokens. Corrected to the real count when the job ends."""
    if job.prompt_token_ids is not None:
        prompt = len(job.prompt_token_ids)
    elif job.prompt is not None:
        prompt = len(job.prompt.encode()) // 4 + 1
    else:
        prompt = sum(len(m.content.encode()) // 4 + 4 for m in job.messages or ())
    return prompt + job.max_tokens


def parse_weights(specs: tuple[str, ...] | list[str], what: str) -> dict[str, float]:
    """`("acme=4", "beta=0.5")` -> {"acme": 4.0, "beta": 0.5}; a bad spec raises ValueError naming it."""
    out: dict[str, float] = {}
    for spec in specs:
        name, sep, value = spec.rpartition("=")
        try:
            number = float(value) if sep and name else math.nan
        except ValueError:
            number = math.nan
        if not number > 0 or math.isinf(number):
            raise ValueError(f"{what} takes TENANT=NUMBER with a number > 0 (e.g. acme=4), got {spec!r}")
        out[name] = number
    return out


class TenantShares:
    """Each tenant's recent tokens divided by its weight, decayed by half every `half_life_s`.

    Stored scaled by 2**(t / half_life) (t since a base time), so decay moves every tenant alike and the
    stored numbers compare without touching them; the base is moved (every stored number rescaled) once
    the scale grows large. `version` changes whenever a tenant's stored number does."""

    def __init__(self, weights: Mapping[str, float] | None = None, half_life_s: float = 60.0,
                 clock: Callable[[], float] = time.monotonic):
        if half_life_s <= 0:
            raise ValueError(f"half_life_s must be > 0, got {half_life_s}")
        self.weights = dict(weights or {})
        self.half_life_s = half_life_s
        self._clock = clock
        self._base = clock()
        self._scaled: dict[str, float] = {}
        self.version: dict[str, int] = {}
        self.rebases = 0  # the backlog rebuilds its heaps when this moves

    def weight(self, tenant: str) -> float:
        return self.weights.get(tenant, 1.0)

    def _scale(self) -> float:
        exponent = (self._clock() - self._base) / self.half_life_s
        if exponent > _REBASE_AFTER:
            factor = 2.0 ** -exponent
            self._scaled = {t: v * factor for t, v in self._scaled.items() if v * factor > 1e-12}
            self.version = {t: self.version.get(t, 0) for t in self._scaled}  # forgotten tenants start afresh
            self._base = self._clock()
            self.rebases += 1
            exponent = 0.0
        return 2.0 ** exponent

    def charge(self, tenant: str, tokens: float) -> None:
        """Add `tokens` (negative: a correction downwards) to the tenant's recent use."""
        if tokens == 0:
            return
        value = self._scaled.get(tenant, 0.0) + tokens * self._scale() / self.weight(tenant)
        self._scaled[tenant] = max(0.0, value)
        self.version[tenant] = self.version.get(tenant, 0) + 1

    def key(self, tenant: str) -> float:
        """The tenant's place in the order (lower goes first); comparable between tenants at any one time."""
        return self._scaled.get(tenant, 0.0)

    def share(self, tenant: str) -> float:
        """Recent weighted tokens now (decayed), for metrics and logs."""
        return self._scaled.get(tenant, 0.0) / self._scale()


@dataclass(slots=True)
class Queued(Generic[T]):
    """One job waiting for admission. `item` is the caller's (the worker's request entry)."""

    item: T
    job_class: int
    priority: int
    tenant: str
    size_bytes: int
    cost_tokens: int
    arrival: int = 0  # set by the backlog
    lane: str = ""  # the model it asks for: pop() may skip a lane


@dataclass(slots=True)
class _Level(Generic[T]):
    """The jobs of one (class, priority): a queue per (tenant, lane) and a heap of those by tenant share."""

    queues: dict[tuple[str, str], deque[Queued[T]]] = field(default_factory=dict)
    # (tenant's share key, first arrival in the queue, tenant's version, (tenant, lane)); stale entries are
    # skipped when popped
    heap: list[tuple[float, int, int, tuple[str, str]]] = field(default_factory=list)


class Backlog(Generic[T]):
    """Jobs read ahead of the engine, admitted in the module's order. Not thread-safe (the loop's only)."""

    def __init__(self, shares: TenantShares, batch_weight: float = 0.0):
        if batch_weight < 0 or math.isinf(batch_weight):
            raise ValueError(f"batch_weight must be a finite number >= 0, got {batch_weight}")
        self.shares = shares
        self.batch_weight = batch_weight
        self._levels: dict[tuple[int, int], _Level[T]] = {}
        self._priorities: list[list[int]] = [[], []]  # per class: heap of priorities with a level (lazy)
        self._in_heap: list[set[int]] = [set(), set()]  # what each class's heap holds (no duplicates)
        self._tenant_levels: dict[str, set[tuple[int, int, str]]] = {}  # tenant -> (class, priority, lane)
        self._arrivals = itertools.count(1)
        self._rebases_seen = 0
        # Virtual time per class (weighted fair queueing over two classes): the busy class with the least goes.
        self._class_time = [0.0, 0.0]
        self.bytes_by_class = [0, 0]
        self.jobs_by_class = [0, 0]
        self.jobs_by_tenant: dict[str, int] = {}

    def __len__(self) -> int:
        return self.jobs_by_class[LIVE] + self.jobs_by_class[BATCH]

    @property
    def bytes(self) -> int:
        return self.bytes_by_class[LIVE] + self.bytes_by_class[BATCH]

    def add(self, queued: Queued[T]) -> None:
        if queued.job_class not in (LIVE, BATCH):
            raise ValueError(f"job_class must be LIVE (0) or BATCH (1), got {queued.job_class}")
        queued.arrival = next(self._arrivals)
        self._place(queued)
        self.bytes_by_class[queued.job_class] += queued.size_bytes
        self.jobs_by_class[queued.job_class] += 1
        self.jobs_by_tenant[queued.tenant] = self.jobs_by_tenant.get(queued.tenant, 0) + 1

    def put_back(self, queued: Queued[T]) -> None:
        """A popped job that could not be admitted after all (its tenant is over a limit): back in its place
        (its arrival kept), its tenant's charge undone."""
        self._place(queued)
        self.bytes_by_class[queued.job_class] += queued.size_bytes
        self.jobs_by_class[queued.job_class] += 1
        self.jobs_by_tenant[queued.tenant] = self.jobs_by_tenant.get(queued.tenant, 0) + 1
        self.charge(queued.tenant, -queued.cost_tokens)

    def _place(self, queued: Queued[T]) -> None:
        level_key = (queued.job_class, queued.priority)
        level = self._levels.get(level_key)
        if level is None:
            level = self._levels[level_key] = _Level()
            if queued.priority not in self._in_heap[queued.job_class]:
                self._in_heap[queued.job_class].add(queued.priority)
                heapq.heappush(self._priorities[queued.job_class], queued.priority)
        queue_key = (queued.tenant, queued.lane)
        queue = level.queues.get(queue_key)
        if queue is None:
            queue = level.queues[queue_key] = deque()
            self._tenant_levels.setdefault(queued.tenant, set()).add((queued.job_class, queued.priority, queued.lane))
            self._push_tenant(level, queue_key, queued.arrival)
        if not queue or queued.arrival > queue[-1].arrival:
            queue.append(queued)
        elif queued.arrival < queue[0].arrival:  # put back at the head: the tenant's heap entry must say so
            queue.appendleft(queued)
            self._push_tenant(level, queue_key, queued.arrival)
        else:
            queue.insert(bisect.bisect([q.arrival for q in queue], queued.arrival), queued)

    def _push_tenant(self, level: _Level[T], queue_key: tuple[str, str], arrival: int) -> None:
        shares, tenant = self.shares, queue_key[0]
        heapq.heappush(level.heap, (shares.key(tenant), arrival, shares.version.get(tenant, 0), queue_key))

    def pop(self, blocked: Container[str] = (), full_lanes: Container[str] = ()) -> Queued[T] | None:
        """The next job to admit, skipping tenants in `blocked` (over a limit: their jobs keep waiting) and
        lanes in `full_lanes` (a model whose engine has no room)."""
        self._check_rebase()
        busy = [c for c in (LIVE, BATCH) if self.jobs_by_class[c]]
        for job_class in self._class_order(busy):
            queued = self._pop_class(job_class, blocked, full_lanes)
            if queued is not None:
                self._after_pop(queued, busy)
                return queued
        return None

    def _class_order(self, busy: list[int]) -> list[int]:
        if len(busy) < 2 or self.batch_weight == 0:
            return busy  # one class waiting, or strict priority: live first
        return sorted(busy, key=lambda c: (self._class_time[c], c))

    def _after_pop(self, queued: Queued[T], busy: list[int]) -> None:
        c = queued.job_class
        if len(busy) == 2 and self.batch_weight > 0:
            self._class_time[c] += 1.0 if c == LIVE else 1.0 / self.batch_weight
        else:  # a class alone banks no credit against the other's return
            self._class_time = [0.0, 0.0]
        self.bytes_by_class[c] -= queued.size_bytes
        self.jobs_by_class[c] -= 1
        left = self.jobs_by_tenant[queued.tenant] - 1
        if left:
            self.jobs_by_tenant[queued.tenant] = left
        else:
            del self.jobs_by_tenant[queued.tenant]
        self.charge(queued.tenant, queued.cost_tokens)

    def _pop_class(self, job_class: int, blocked: Container[str], full_lanes: Container[str]) -> Queued[T] | None:
        priorities = self._priorities[job_class]
        skipped: list[int] = []
        found = None
        while priorities and found is None:
            priority = priorities[0]
            level = self._levels.get((job_class, priority))
            if level is None:  # emptied earlier: drop the stale priority
                self._in_heap[job_class].discard(heapq.heappop(priorities))
                continue
            found = self._pop_level(job_class, priority, level, blocked, full_lanes)
            if found is None:  # every tenant here is blocked: look at the next priority
                skipped.append(heapq.heappop(priorities))
        for priority in skipped:
            heapq.heappush(priorities, priority)
        return found

    def _pop_level(self, job_class: int, priority: int, level: _Level[T], blocked: Container[str],
                   full_lanes: Container[str]) -> Queued[T] | None:
        versions = self.shares.version
        set_aside: list[tuple[float, int, int, tuple[str, str]]] = []
        found = None
        while level.heap and found is None:
            entry = heapq.heappop(level.heap)
            _, _, version, queue_key = entry
            tenant, lane = queue_key
            queue = level.queues.get(queue_key)
            if queue is None or version != versions.get(tenant, 0):
                continue  # stale: the queue emptied, or its tenant's share changed (a fresh entry exists)
            if tenant in blocked or lane in full_lanes:
                set_aside.append(entry)
                continue
            found = queue.popleft()
            if queue:
                self._push_tenant(level, queue_key, queue[0].arrival)
            else:
                del level.queues[queue_key]
                self._tenant_levels[tenant].discard((job_class, priority, lane))
                if not self._tenant_levels[tenant]:
                    del self._tenant_levels[tenant]
        for entry in set_aside:
            heapq.heappush(level.heap, entry)
        if not level.queues:
            del self._levels[(job_class, priority)]
        return found

    def charge(self, tenant: str, tokens: float) -> None:
        """Change the tenant's recent use (a job admitted, or the correction when it ended) and re-key the
        tenant in every level where it has jobs waiting."""
        if tokens == 0:
            return
        self.shares.charge(tenant, tokens)
        self._check_rebase()
        for job_class, priority, lane in self._tenant_levels.get(tenant, ()):
            level = self._levels[job_class, priority]
            self._push_tenant(level, (tenant, lane), level.queues[tenant, lane][0].arrival)
            if len(level.heap) > 4 * len(level.queues) + 64:  # stale entries piled up: rebuild
                self._rebuild_heap(level)

    def _check_rebase(self) -> None:
        self.shares.share(NO_TENANT)  # moves the base when due
        if self.shares.rebases != self._rebases_seen:
            self._rebases_seen = self.shares.rebases
            for level in self._levels.values():
                self._rebuild_heap(level)

    def _rebuild_heap(self, level: _Level[T]) -> None:
        level.heap = []
        for queue_key, queue in level.queues.items():
            self._push_tenant(level, queue_key, queue[0].arrival)

    def remove_if(self, drop: Callable[[Queued[T]], bool]) -> list[Queued[T]]:
        """Take out every job `drop` selects (a rebalance took their partitions); returns them."""
        kept: list[Queued[T]] = []
        dropped: list[Queued[T]] = []
        for level in self._levels.values():
            for queue in level.queues.values():
                for queued in queue:
                    (dropped if drop(queued) else kept).append(queued)
        if not dropped:
            return []
        self._levels.clear()
        self._priorities, self._in_heap = [[], []], [set(), set()]
        self._tenant_levels.clear()
        self.bytes_by_class, self.jobs_by_class, self.jobs_by_tenant = [0, 0], [0, 0], {}
        for queued in sorted(kept, key=lambda q: q.arrival):
            self._place(queued)
            self.bytes_by_class[queued.job_class] += queued.size_bytes
            self.jobs_by_class[queued.job_class] += 1
            self.jobs_by_tenant[queued.tenant] = self.jobs_by_tenant.get(queued.tenant, 0) + 1
        return dropped

    def __iter__(self) -> Iterator[Queued[T]]:
        for level in list(self._levels.values()):
            for queue in list(level.queues.values()):
                yield from list(queue)


def paused_classes(bytes_by_class: list[int], budget: int, batch_share: float, paused: set[int]) -> set[int]:
    """Which classes' partitions to pause: every class once the backlog holds `budget` bytes, the batch class
    already at `batch_share` of it (so a batch backlog never keeps live records from being read). A paused
    class resumes below 90% of its threshold, so the consumer does not flap at the edge."""
    total = bytes_by_class[LIVE] + bytes_by_class[BATCH]
    out: set[int] = set()
    for job_class, held, limit in ((LIVE, total, budget), (BATCH, total, budget),
                                   (BATCH, bytes_by_class[BATCH], budget * batch_share)):
        resume_below = limit * 0.9
        if held >= limit or (job_class in paused and held >= resume_below):
            out.add(job_class)
    return out
