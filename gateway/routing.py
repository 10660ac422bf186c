"""Which topic takes a model's jobs, learned from the workers' heartbeats: a pure map, and its cache.

A job produced to a topic may land on any partition, so any worker reading that topic may get it. A topic
therefore routes a model only when EVERY live worker reading it serves that model; otherwise some of its
jobs would end with `unknown_model` (two workers with different models on one topic: the bug this map
exists for). A model no topic routes is not listed and is answered 404 before any job is produced.

A model that several topics route (two groups both serve it) goes to the first topic in name order: the
same choice on every gateway and on every refresh while those groups live, logged when it changes.
A heartbeat without a topic comes from a worker older than that field; it is taken to read the gateway's
own --job-topic, the only topic such a gateway could have sent it jobs on.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field

from stoker.client.client import WorkerInfo
from stoker.schemas import default_batch_topic

log = logging.getLogger("stoker.gateway.routing")


@dataclass(frozen=True, slots=True)
class ModelRoute:
    """Where one model's jobs go."""

    topic: str
    groups: tuple[str, ...]  # the consumer groups reading the topic (for messages and logs)
    workers: int  # live workers reading the topic
    batch_topic: str | None = None  # where its Batch API lines go; None: no reader of `topic` reads a batch topic


@dataclass(frozen=True, slots=True)
class RouteTable:
    routes: dict[str, ModelRoute] = field(default_factory=dict)  # model -> where its jobs go
    unroutable: dict[str, str] = field(default_factory=dict)  # served model -> why no topic takes it
    choices: dict[str, tuple[str, ...]] = field(default_factory=dict)  # model -> every topic that could take it
    workers: int = 0  # live workers seen

    @property
    def models(self) -> list[str]:
        """Every model the gateway can route, sorted."""
        return sorted(self.routes)

    def not_routable(self, model: object) -> str:
        """Why no job is made for `model` (the 404's message): what is wrong, and what is served."""
        why = self.unroutable.get(model) if isinstance(model, str) else None
        return (f"model {model!r} is not served by any live worker" + (f" that can take it ({why})" if why else "")
                + f"; served: {', '.join(self.models) or 'none'}")


def _describe(workers: list[WorkerInfo]) -> str:
    return ", ".join(f"{w.worker_id} ({', '.join(w.models) or 'no models'})" for w in workers)


def build_routes(workers: Iterable[WorkerInfo], default_topic: str) -> RouteTable:
    """The model -> topic map of these live workers (see the module's docstring for the rules)."""
    readers: dict[str, list[WorkerInfo]] = {}
    for worker in workers:
        readers.setdefault(worker.topic or default_topic, []).append(worker)
    candidates: dict[str, list[str]] = {}
    unroutable: dict[str, str] = {}
    for topic in sorted(readers):
        on_topic = readers[topic]
        served_by_all = set.intersection(*(set(w.models) for w in on_topic))
        served_by_any = {model for w in on_topic for model in w.models}
        for model in sorted(served_by_any):
            if model in served_by_all:
                candidates.setdefault(model, []).append(topic)
            else:
                lacking = [w for w in on_topic if model not in w.models]
                unroutable[model] = (f"topic {topic!r} is read by workers that do not all serve it: "
                                     f"{_describe(lacking)} would answer unknown_model")
    routes = {model: ModelRoute(topics[0], tuple(sorted({w.group or "?" for w in readers[topics[0]]})),
                                len(readers[topics[0]]), _batch_topic(topics[0], readers[topics[0]]))
              for model, topics in candidates.items()}
    choices = {model: tuple(topics) for model, topics in candidates.items() if len(topics) > 1}
    return RouteTable(routes, {m: why for m, why in unroutable.items() if m not in routes}, choices,
                      sum(len(on_topic) for on_topic in readers.values()))


def _batch_topic(topic: str, readers: list[WorkerInfo]) -> str | None:
    """The batch topic the readers of `topic` read (their heartbeats say; an older worker's is topic + .batch).
    Every reader serves the route's models, so one that some of them read is enough; the first in name order
    keeps every gateway's choice the same. None when all run with --no-batch-topic."""
    read = {w.batch_topic if w.batch_topic is not None else default_batch_topic(topic) for w in readers} - {""}
    return min(read) if read else None


class RouteCache:
    """The route table, rebuilt from the heartbeats at most every `max_age_s` (the worker index and one MGET) by one
    caller at a time: a burst of requests on a stale table waits for one refresh, not one each."""

    def __init__(self, fetch: Callable[[], Awaitable[list[WorkerInfo]]], default_topic: str, max_age_s: float):
        self._fetch, self.default_topic, self.max_age_s = fetch, default_topic, max_age_s
        self._table = RouteTable()
        self._built_at = float("-inf")
        self._lock = asyncio.Lock()

    async def table(self) -> RouteTable:
        if time.monotonic() - self._built_at <= self.max_age_s:
            return self._table
        async with self._lock:
            if time.monotonic() - self._built_at > self.max_age_s:  # not refreshed while we waited
                fresh = build_routes(await self._fetch(), self.default_topic)
                _log_changes(self._table, fresh)
                self._table, self._built_at = fresh, time.monotonic()
        return self._table


def _log_changes(old: RouteTable, new: RouteTable) -> None:
    """Say once (not on every refresh) which topic a model served by several groups goes to, and which
    served models can't be routed."""
    for model, topics in new.choices.items():
        if old.choices.get(model) != topics or old.routes.get(model) != new.routes[model]:
            log.warning("event=model_on_several_topics model=%s topics=%s picked=%s", model, ",".join(topics),
                        new.routes[model].topic)
    for model, why in new.unroutable.items():
        if old.unroutable.get(model) != why:
            log.error("event=model_unroutable model=%s reason=%r", model, why)
