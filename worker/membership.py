"""Which models a worker serves, what its heartbeat says, and the check that keeps one model set per group.

All workers of one consumer group serve the same set of models (the group is the unit of scale-out), and
different sets read different topics: a job on a topic may land on any partition, so every reader of a
topic must serve every model sent there, or some jobs end with `unknown_model`. A worker therefore looks at
the live heartbeats before it joins its group and refuses to start when a worker of the same group, or a
worker reading the same topic, lists another set.

Two workers starting at once would both see no conflict and both join. So the check and the worker's first
heartbeat happen under one short Redis lock per prefix (`{prefix}:join-lock`, SET NX with a TTL, released
only by its holder): the second starter waits for it, then sees the first one's heartbeat. A holder that
died lets go when the TTL ends.

The check finds the heartbeats through an index, the sorted set `{prefix}:workers` (member: worker id,
score: when its heartbeat was last written, epoch ms), which every heartbeat renewal also writes: a SCAN
for `{prefix}:worker:*` walks the whole keyspace (every result and stream key too: 78 ms at 60k keys on
the 2-core VM, seconds at millions), and the lock would be held that long. The index is read whole and the
heartbeat keys fetched by one MGET, so the lock is held for a few round trips at any keyspace size.
Liveness is still the heartbeat key (its TTL, on Redis's clock); a member whose key is gone is a worker
that stopped or died, and members not written for an hour are dropped at the next join.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import redis.asyncio as aioredis
from stoker.schemas import Names, default_batch_topic, worker_ids

log = logging.getLogger("stoker.worker.membership")

JOIN_LOCK_TTL_MS = 5_000  # far longer than one check takes (a few round trips), short if the holder dies
JOIN_LOCK_WAIT_S = 15.0  # a starter waits this long for the lock: a few holders' TTLs
INDEX_KEEP_MS = 3_600_000  # index members not renewed for this long are dropped (generous: writers' clocks)

# Delete the lock only while it still holds our token: one whose TTL ran out may belong to the next starter.
_UNLOCK_LUA = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


def worker_index(prefix: str) -> str:
    """The sorted set of worker ids with a heartbeat (see the module's docstring; the client reads it too)."""
    return Names(redis_prefix=prefix).workers_index


def served_model_names(engine: Any, served_model_name: str | None = None) -> list[str]:
    """The model names this worker answers to, sorted. A multi-model engine (ModelSet) names them in
    `model_names`; a single model's name may be overridden by --served-model-name, as Worker.model_name is."""
    names = getattr(engine, "model_names", None) or [served_model_name or engine.model_name]
    return sorted({str(name) for name in names})


@dataclass(frozen=True, slots=True)
class Beat:
    """The parts of another worker's heartbeat the group check reads."""

    worker_id: str
    topic: str | None  # None: a worker older than this field (its topic is unknown)
    group: str | None
    models: tuple[str, ...]
    batch_topic: str | None = None  # "" reads none; None: a worker older than the field (its topic + ".batch")


def heartbeat(worker_id: str, topic: str, group: str, models: list[str], *, capacity: int, running: int,
              version: str, started_at: float, batch_topic: str | None = None) -> bytes:
    """The heartbeat value (JSON): who, where it reads (topic, its batch-class topic, group), what it serves,
    its load. `model` (the first served name) stays for readers older than `models`. `batch_topic` is ""
    when the worker reads none (--no-batch-topic): absent would mean an older worker, read as topic + .batch."""
    return json.dumps({"worker": worker_id, "topic": topic, "batch_topic": batch_topic or "", "group": group,
                       "models": models, "model": models[0], "capacity": capacity, "running": running,
                       "version": version, "started_at": started_at}).encode()


def parse_beat(worker_id: str, raw: bytes | str) -> Beat | None:
    """A heartbeat's topic, group and model set; None for a value that is no heartbeat of ours (anyone who may
    write the prefix's keys can put anything there: bytes that are not UTF-8 or JSON, JSON nested past the
    parser's recursion limit)."""
    try:
        info = json.loads(raw)
    except (ValueError, RecursionError):
        return None
    if not isinstance(info, dict):
        return None
    models = info.get("models")
    if not isinstance(models, list):
        models = [info["model"]] if isinstance(info.get("model"), str) else []
    topic, group, batch_topic = info.get("topic"), info.get("group"), info.get("batch_topic")
    return Beat(worker_id, topic if isinstance(topic, str) else None, group if isinstance(group, str) else None,
                tuple(sorted({str(m) for m in models})), batch_topic if isinstance(batch_topic, str) else None)


def conflicts(worker_id: str, topic: str, group: str, models: Iterable[str], beats: Iterable[Beat],
              batch_topic: str | None = None) -> list[Beat]:
    """Live workers whose model set differs from ours while they share our group or any topic we read (job
    or batch topic: a custom --batch-topic two groups share would mix their Batch API lines). Our own id (a
    restart that kept --worker-id) is no conflict; a heartbeat without topic and group can't be placed."""
    ours = tuple(sorted(set(models)))
    read = {topic} | ({batch_topic} if batch_topic else set())
    return [b for b in beats if b.worker_id != worker_id and b.models != ours
            and (b.group == group or bool(read & topics_read(b)))]


def topics_read(beat: Beat) -> set[str]:
    """The topics a worker reads, by its heartbeat: its job topic and batch topic (one older than the batch
    topic field: its job topic + .batch, as the gateway assumes too)."""
    if beat.topic is None:
        return set()
    batch = beat.batch_topic if beat.batch_topic is not None else default_batch_topic(beat.topic)
    return {beat.topic} | ({batch} if batch else set())


def refusal(topic: str, group: str, models: Iterable[str], others: list[Beat]) -> str:
    """The error a refused worker exits with: who is in the way, what they serve, what to do."""
    listed = "; ".join(f"{b.worker_id} (topic {b.topic}, " + (f"batch topic {b.batch_topic}, " if b.batch_topic else "")
                       + f"group {b.group}, models {', '.join(b.models) or '-'})" for b in others)
    return (f"refusing to join consumer group {group!r} on topic {topic!r} with models {', '.join(sorted(models))}: "
            f"live workers there serve another model set: {listed}. All workers of one group serve the same "
            "models, and different model sets read different topics. Start this worker with the same models as "
            "those, or give its model set its own topic and group (--job-topic / STOKER_JOB_TOPIC and "
            "--group-id / STOKER_GROUP_ID; create the topic and its .dlq first), or stop those workers first "
            "(`stoker workers` lists them)")


class JoinLock:
    """The prefix-wide lock around check-then-first-heartbeat (see the module's docstring)."""

    def __init__(self, client: aioredis.Redis, prefix: str):
        self.client, self.key = client, f"{prefix}:join-lock"
        self.token = uuid.uuid4().hex
        self._unlock = client.register_script(_UNLOCK_LUA)

    async def __aenter__(self) -> JoinLock:
        deadline = time.monotonic() + JOIN_LOCK_WAIT_S
        while not await self.client.set(self.key, self.token, nx=True, px=JOIN_LOCK_TTL_MS):
            if time.monotonic() > deadline:
                raise RuntimeError(f"could not take the Redis key {self.key!r} in {JOIN_LOCK_WAIT_S:.0f} s: other "
                                   "workers kept starting; start this one again")
            await asyncio.sleep(0.05)
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._unlock(keys=[self.key], args=[self.token])


async def live_beats(client: aioredis.Redis, prefix: str) -> list[Beat]:
    """The live heartbeats of the workers in the index (one ZRANGE, one MGET); a worker older than the index
    is not in it, and its heartbeat could not be placed anyway (no topic, no group)."""
    ids = worker_ids(await client.zrange(worker_index(prefix), 0, -1))
    values = await client.mget([f"{prefix}:worker:{worker_id}" for worker_id in ids]) if ids else []
    beats = []
    for worker_id, value in zip(ids, values, strict=True):
        beat = parse_beat(worker_id, value) if value is not None else None  # None: stopped or dead
        if beat is not None:
            beats.append(beat)
    return beats


async def join_checked(client: aioredis.Redis, prefix: str, worker_id: str, topic: str, group: str,
                       models: list[str], first_beat: bytes, ttl_s: int, batch_topic: str | None = None) -> None:
    """Refuse (RuntimeError) when live workers of our group or topic serve another model set; else write our
    first heartbeat before letting go of the lock, so the next starter sees us."""
    index = worker_index(prefix)
    async with JoinLock(client, prefix):
        await client.zremrangebyscore(index, "-inf", time.time() * 1000 - INDEX_KEEP_MS)
        others = conflicts(worker_id, topic, group, models, await live_beats(client, prefix), batch_topic)
        if others:
            raise RuntimeError(refusal(topic, group, models, others))
        async with client.pipeline(transaction=False) as pipe:
            pipe.set(f"{prefix}:worker:{worker_id}", first_beat, ex=ttl_s)
            pipe.zadd(index, {worker_id: time.time() * 1000})
            await pipe.execute()
    log.info("event=group_checked worker=%s topic=%s group=%s models=%s", worker_id, topic, group, ",".join(models))


async def recheck(client: aioredis.Redis, prefix: str, worker_id: str, topic: str, group: str, models: list[str],
                  batch_topic: str | None) -> list[Beat]:
    """The group check again, while running (no lock: nothing is decided, only reported). The start's check
    keeps a new worker out; this one finds what slipped past it: a worker older than the check, one started
    with a new prefix's lock lost, or a heartbeat written by hand. Logged loudly each time it finds some."""
    others = conflicts(worker_id, topic, group, models, await live_beats(client, prefix), batch_topic)
    if others:
        log.error("event=group_conflict worker=%s error=%r", worker_id, refusal(topic, group, models, others))
    return others


async def leave(client: aioredis.Redis, prefix: str, worker_id: str) -> None:
    """At a graceful stop: our heartbeat and index entry go at once (not at their TTL)."""
    async with client.pipeline(transaction=False) as pipe:
        pipe.delete(f"{prefix}:worker:{worker_id}")
        pipe.zrem(worker_index(prefix), worker_id)
        await pipe.execute()
