"""Running batches: each gateway replica gathers the batches whose lease it holds, one task per batch.

A batch's life on the gateway that holds its lease (a Redis key `{prefix}:batch-lease:{batch_id}` naming
the replica, renewed every tick, so a replica that dies hands its batches over within the lease's TTL):

    load     the input file's lines (gateway.batch_lines), the log of lines already answered;
    tick     renew the lease; act on a cancel; gather finished lines from their result keys (MGET), append
             them to the log (fsync) and count them; produce the next chunk of lines while fewer than
             max_in_flight are out (back-pressure); save the state when it changed;
    finalize write the output and error files from the log, in line order, then the final status.

Nothing here keeps what matters in memory only: the log says which lines are answered, the state's
`produced_through` which lines Kafka has. After a restart (of this replica or another taking over) lines up
to `produced_through` are followed without producing them again; the lines of a chunk whose acknowledgement
was not yet saved are produced again, under the same request ids, which a worker does not run twice (a
result key stands; a live claim parks the copy). Result keys expire after an hour (the contract's TTL), so
gathering runs continuously: a line is in the log long before its key is gone, as long as some replica runs.
What this cannot survive is Redis losing a result key before it was gathered (a Redis without persistence,
restarted): such a line stays in flight until the batch's window ends, then it is an error line.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import msgspec
from prometheus_client import CollectorRegistry, Counter
from stoker.client.client import Client
from stoker.gateway.batch_lines import (
    UNANSWERED,
    LineError,
    LineJob,
    Outcome,
    error_outcome,
    invalid_outcome,
    parse_input,
    request_id_for,
    terminal_outcome,
)
from stoker.gateway.batch_state import BatchState, decode_state, encode_state
from stoker.gateway.routing import RouteCache
from stoker.gateway.storage import FileObject, Storage
from stoker.schemas import ContractError, Done, Names, decode_event, default_batch_topic
from stoker.schemas import Error as ErrorEvent

log = logging.getLogger("stoker.gateway.batches")
DAY_S = 86400
MGET_CHUNK = 512  # result keys per MGET: one round trip per this many lines in flight


@dataclass(slots=True)
class BatchConfig:
    """The Batch API's settings (the gateway's --storage-path and --batch-* flags)."""

    storage_path: Path
    batch_topic: str | None = None  # None: the job topic + ".batch" (schemas.default_batch_topic)
    max_in_flight: int = 2048  # lines produced and not yet answered, per batch: bounds what waits in Kafka
    produce_chunk: int = 256  # lines sent per round (they share Kafka batches)
    poll_s: float = 0.25  # a tick: how often result keys are read and the lease renewed
    lease_ttl_s: float = 10.0  # a dead replica's batches are taken over after this
    scan_s: float = 2.0  # how often a replica looks for batches nobody gathers
    max_upload_bytes: int = 200 * 1024 * 1024  # OpenAI's limits: 200 MB, 50,000 requests a file
    max_requests: int = 50_000
    file_expires_s: int = 30 * DAY_S  # input files (OpenAI's default for purpose batch)
    output_expires_s: int = 30 * DAY_S  # output and error files, unless the batch asks otherwise
    cancel_grace_s: float = 60.0  # after a cancel (or the window's end), how long to wait for lines in flight

    def __post_init__(self) -> None:
        problems = [f"{name} must be > 0, got {getattr(self, name)}" for name in (
            "max_in_flight", "produce_chunk", "poll_s", "lease_ttl_s", "scan_s", "max_upload_bytes", "max_requests",
            "file_expires_s", "output_expires_s", "cancel_grace_s") if getattr(self, name) <= 0]
        if self.batch_topic is not None:
            try:
                Names(jobs_topic=self.batch_topic)
            except ValueError as exc:
                problems.append(f"batch_topic: {exc}")
        if self.lease_ttl_s < 3 * self.poll_s:
            problems.append(f"lease_ttl_s ({self.lease_ttl_s}) must be at least 3 ticks (poll_s {self.poll_s}): "
                            "the lease is renewed once a tick")
        if problems:
            raise ValueError("batch settings: " + "; ".join(problems))


class BatchMetrics:
    def __init__(self, registry: CollectorRegistry):
        self.produced = Counter("stoker_gateway_batch_jobs_produced", "batch lines produced to Kafka (a line "
                                "produced again after a restart counts again)", registry=registry)
        self.gathered = Counter("stoker_gateway_batch_lines_gathered", "batch lines answered by this replica, "
                                "by outcome (ok: output file, error: error file)", ["outcome"], registry=registry)
        self.leases = Counter("stoker_gateway_batch_leases", "batches this replica took to gather",
                              registry=registry)


_RENEW = """if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('pexpire', KEYS[1], ARGV[2]) end
return 0"""
_RELEASE = """if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('del', KEYS[1]) end
return 0"""


class Lease:
    """One replica's right to gather one batch: a Redis key naming the replica, with a TTL renewed each tick.
    Only the holder writes the batch's state and log; the others serve what it wrote."""

    def __init__(self, client: Client, batch_id: str, owner: str, ttl_s: float):
        self.client, self.owner, self.ttl_ms = client, owner, int(ttl_s * 1000)
        self.key = f"{client.prefix}:batch-lease:{batch_id}"

    async def acquire(self) -> bool:
        return bool(await self.client.redis.set(self.key, self.owner, nx=True, px=self.ttl_ms))

    async def renew(self) -> bool:
        return bool(await self.client.redis.eval(_RENEW, 1, self.key, self.owner, self.ttl_ms))

    async def release(self) -> None:
        await self.client.redis.eval(_RELEASE, 1, self.key, self.owner)


def _log_entry(outcome: Outcome) -> bytes:
    return msgspec.json.encode({"line": outcome.line, "ok": outcome.ok, "record": outcome.record,
                                "usage": [outcome.prompt_tokens, outcome.completion_tokens, outcome.cached_tokens]})


def read_outcomes(storage: Storage, batch_id: str) -> dict[int, Outcome]:
    """The log's answered lines by line number; a line logged twice (a takeover raced a write) counts once."""
    found: dict[int, Outcome] = {}
    for raw in storage.read_log(batch_id):
        with contextlib.suppress(msgspec.DecodeError, RecursionError, KeyError, TypeError, ValueError):
            entry = msgspec.json.decode(raw)
            prompt, completion, cached = entry["usage"]
            found.setdefault(entry["line"], Outcome(entry["line"], entry["ok"], entry["record"], prompt,
                                                    completion, cached))
    return found


@dataclass(slots=True)
class _Progress:
    """What the runner holds while it gathers: lines still to produce (in order), lines out, by request id."""

    pending: deque[LineJob] = field(default_factory=deque)
    in_flight: dict[str, LineJob] = field(default_factory=dict)
    stop_since: float | None = None  # monotonic time of the cancel or the window's end: grace runs from it


class BatchRunner:
    """Gathers one batch while this replica holds its lease (see the module's docstring)."""

    def __init__(self, service: BatchService, state: BatchState, lease: Lease):
        self.service, self.state, self.lease = service, state, lease
        self.storage, self.cfg, self.client = service.storage, service.cfg, service.client
        self.progress = _Progress()
        self._saved = b""

    async def run(self) -> None:
        lines = await asyncio.to_thread(self._load)
        if lines is None:
            return
        await self._start(lines)
        while await self.lease.renew():
            await self._tick()
            if not self.progress.pending and not self.progress.in_flight:
                await self._finalize()
                return
            await asyncio.sleep(self.cfg.poll_s)
        log.warning("batch %s: lease lost (another replica gathers it now); stopped", self.state.id)

    # ---- starting ---------------------------------------------------------------------------------------------
    def _load(self) -> list[LineJob | LineError] | None:
        """The input's lines, or None after failing a batch whose input file is gone."""
        state = self.state
        meta = self.storage.get_file(state.input_file_id)
        if meta is None:
            state.errors = [{"code": "input_file_not_found", "line": None, "param": "input_file_id",
                             "message": f"input file {state.input_file_id} was deleted or expired before the batch "
                             "started: upload it again and create a new batch"}]
            state.move("failed", int(time.time()))
            self._save_now()
            return None
        self.storage.repair_log(state.id)
        data = self.storage.content_path(meta.id).read_bytes()
        return parse_input(data, state.id, state.endpoint, state.deadline_ms)

    async def _start(self, lines: list[LineJob | LineError]) -> None:
        """Counts from the log (the truth after a crash), error lines for bad input, the rest pending or out."""
        state, answered = self.state, await asyncio.to_thread(read_outcomes, self.storage, self.state.id)
        state.total, state.completed, state.failed = len(lines), 0, 0
        state.input_tokens = state.output_tokens = state.cached_tokens = 0
        for outcome in answered.values():
            state.count(outcome.ok, outcome.prompt_tokens, outcome.completion_tokens, outcome.cached_tokens)
        await self._answer([invalid_outcome(state.id, line) for line in lines
                            if isinstance(line, LineError) and line.line not in answered])
        for line in lines:
            if isinstance(line, LineJob) and line.line not in answered:
                if line.line <= state.produced_through:
                    self.progress.in_flight[line.job.request_id] = line
                else:
                    self.progress.pending.append(line)
        if state.status == "validating":
            state.move("in_progress", int(time.time()))
        await self._save()

    # ---- one tick -----------------------------------------------------------------------------------------------
    async def _tick(self) -> None:
        now_s = time.time()
        asked_at = self.storage.cancel_requested(self.state.id)
        if asked_at is not None and self.state.status in ("validating", "in_progress"):
            self.state.move("cancelling", asked_at)
        if self.state.status == "cancelling" and self.progress.stop_since is None:  # also after a restart
            await self._cancel_the_rest()
        await self._gather()
        if now_s * 1000 >= self.state.deadline_ms:
            await self._expire()
        elif self.state.status == "in_progress":
            await self._produce()
        if given_up := self._give_up_after_grace():
            await self._unanswered(given_up, "cancelled" if self.state.status == "cancelling" else "deadline")
        await self._save()

    async def _gather(self) -> None:
        out, ids = self.progress.in_flight, list(self.progress.in_flight)
        answered = []
        for start in range(0, len(ids), MGET_CHUNK):
            chunk = ids[start:start + MGET_CHUNK]
            values = await self.client.redis.mget([self.client.names.result(i) for i in chunk])
            answered += [self._outcome(out[rid], value) for rid, value in zip(chunk, values, strict=True)
                         if value is not None]
        await self._answer(answered)

    def _outcome(self, line: LineJob, value: bytes | str) -> Outcome:
        try:
            event = decode_event(value if isinstance(value, bytes) else value.encode())
        except ContractError as exc:
            return error_outcome(self.state.id, line.line, line.custom_id, "internal",
                                 f"the worker's result could not be read: {exc}", 500)
        if not isinstance(event, Done | ErrorEvent):
            return error_outcome(self.state.id, line.line, line.custom_id, "internal",
                                 f"the result key held a {type(event).__name__}", 500)
        return terminal_outcome(self.state.id, line, self.state.endpoint, event)

    async def _answer(self, outcomes: list[Outcome]) -> None:
        """Log first (durably), then count: a crash in between re-reads the log and counts it then."""
        if not outcomes:
            return
        await asyncio.to_thread(self.storage.append_log, self.state.id, [_log_entry(o) for o in outcomes])
        for outcome in outcomes:
            self.state.count(outcome.ok, outcome.prompt_tokens, outcome.completion_tokens, outcome.cached_tokens)
            self.service.metrics.gathered.labels("ok" if outcome.ok else "error").inc()
            self.progress.in_flight.pop(request_id_for(self.state.id, outcome.line), None)

    async def _produce(self) -> None:
        """Chunks while there is room (back-pressure: at most max_in_flight lines out), each saved before the
        next: a batch's start fills the workers in one tick, later ticks top up what was answered."""
        while await self._produce_chunk():
            pass

    async def _routed_chunk(self, room: int) -> list[tuple[LineJob, str]]:
        """Up to `room` pending lines in line order with their topics, stopping at the first line whose model
        no live group serves: lines go out in order (produced_through is a prefix), so that line and those
        after it wait, for a worker group to appear or the window to end, rather than fail."""
        pending, chunk = self.progress.pending, list[tuple[LineJob, str]]()
        while pending and len(chunk) < room:
            topic = await self.service.topic_for(pending[0].job.model)
            if topic is None:
                break
            chunk.append((pending.popleft(), topic))
        return chunk

    async def _produce_chunk(self) -> bool:
        room = min(self.cfg.max_in_flight - len(self.progress.in_flight), self.cfg.produce_chunk)
        routed = await self._routed_chunk(room)
        if not routed:
            return False
        chunk = [line for line, _topic in routed]
        try:
            for topic in dict.fromkeys(t for _line, t in routed):  # one call per topic, in first-seen order
                await self.client.submit_many([line.job for line, t in routed if t == topic], topic=topic)
        except BaseException:
            self.progress.pending.extendleft(reversed(chunk))  # produced again next tick: same ids
            raise
        self.progress.in_flight.update((line.job.request_id, line) for line in chunk)
        self.state.produced_through = chunk[-1].line
        self.service.metrics.produced.inc(len(chunk))
        await self._save()  # before the next chunk: a restart must not produce these again
        return True

    # ---- stopping early ---------------------------------------------------------------------------------------
    async def _cancel_the_rest(self) -> None:
        """Lines not produced are cancelled now; those out are cancelled at the workers, and their results
        (finish_reason cancelled, or done if they finished first) are gathered within the grace period."""
        await self._unanswered(list(self.progress.pending), "cancelled")
        self.progress.pending.clear()
        await asyncio.gather(*(self.client.cancel(rid) for rid in self.progress.in_flight))
        self.progress.stop_since = time.monotonic()

    async def _expire(self) -> None:
        """The window has ended: nothing more is produced; lines out end with finish_reason deadline at the
        workers (the jobs carry it), gathered within the grace period."""
        await self._unanswered(list(self.progress.pending), "deadline")
        self.progress.pending.clear()
        if self.progress.stop_since is None:
            self.progress.stop_since = time.monotonic()

    def _give_up_after_grace(self) -> list[LineJob]:
        """Lines still out once the grace period after a cancel or the window's end is over (no worker
        answered them: none running, or their results lost): they are error lines too."""
        stop = self.progress.stop_since
        if stop is None or time.monotonic() - stop < self.cfg.cancel_grace_s:
            return []
        return list(self.progress.in_flight.values())

    async def _unanswered(self, lines: list[LineJob], reason: str) -> None:
        code, message = UNANSWERED[reason]
        await self._answer([error_outcome(self.state.id, line.line, line.custom_id, code, message) for line in lines])

    # ---- the end ----------------------------------------------------------------------------------------------------
    async def _finalize(self) -> None:
        """Output and error files from the log, in line order; their ids derive from the batch's, so a
        finalize cut short and run again replaces them instead of making new ones."""
        state, now_s = self.state, int(time.time())
        if state.status == "in_progress":
            state.move("finalizing", now_s)
            await self._save()
        outcomes = await asyncio.to_thread(read_outcomes, self.storage, state.id)
        await asyncio.to_thread(self._write_files, sorted(outcomes.values(), key=lambda o: o.line), now_s)
        if state.status == "cancelling":
            state.move("cancelled", int(time.time()))
        else:
            expired = any(not o.ok and o.record["error"]["code"] == "batch_expired" for o in outcomes.values())
            state.move("expired" if expired else "completed", int(time.time()))
        await self._save()
        log.info("batch %s: %s (%d completed, %d failed)", state.id, state.status, state.completed, state.failed)

    def _write_files(self, outcomes: list[Outcome], now_s: int) -> None:
        state, hex_id = self.state, self.state.id.removeprefix("batch_")
        for ok, suffix, attr in ((True, "output", "output_file_id"), (False, "errors", "error_file_id")):
            records = [o.record for o in outcomes if o.ok is ok]
            if not records:
                continue
            data = b"".join(msgspec.json.encode(r) + b"\n" for r in records)
            meta = FileObject(id=f"file-{hex_id}_{suffix}", bytes=len(data), created_at=now_s,
                              filename=f"{state.id}_{suffix}.jsonl", purpose="batch_output",
                              expires_at=now_s + state.output_expires_s, requests=len(records))
            self.storage.put_file(meta, data)
            setattr(state, attr, meta.id)

    # ---- saving ---------------------------------------------------------------------------------------------------
    async def _save(self) -> None:
        """Writes the state when it changed (once a tick at most, plus once per produced chunk)."""
        data = encode_state(self.state)
        if data != self._saved:
            await asyncio.to_thread(self.storage.put_state, self.state.id, data)
            self._saved = data

    def _save_now(self) -> None:
        self._saved = encode_state(self.state)
        self.storage.put_state(self.state.id, self._saved)


class BatchService:
    """Every batch this replica gathers: a scan finds batches nobody gathers (new, or their replica died)
    and takes their lease; `kick` starts a new batch at once. Also sweeps expired files."""

    def __init__(self, client: Client, cfg: BatchConfig, registry: CollectorRegistry | None = None,
                 routes: RouteCache | None = None):
        self.client, self.cfg = client, cfg
        self.storage = Storage(cfg.storage_path)
        self.batch_topic = cfg.batch_topic or default_batch_topic(client.topic)
        # Without a fixed --batch-topic, a line goes to the batch sibling of the topic whose workers serve its
        # model (the gateway's routes, from the heartbeats), as a live request for that model would.
        self.routes = None if cfg.batch_topic else routes
        self._held_models: set[str | None] = set()  # models whose lines wait for a route (logged once)
        self.replica = uuid.uuid4().hex  # names this replica in the leases it holds
        self.metrics = BatchMetrics(registry or CollectorRegistry())
        self._runners: dict[str, asyncio.Task[None]] = {}
        self._finished: set[str] = set()  # batches seen terminal: the scan reads their state no more
        self._scanner: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self._scanner = asyncio.create_task(self._scan_forever(), name="stoker-gateway-batch-scan")

    async def stop(self) -> None:
        """Stops gathering and hands the leases back, so another replica takes the batches over at once."""
        tasks = [t for t in (self._scanner, *self._runners.values()) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._runners.clear()

    def load(self, batch_id: str) -> BatchState | None:
        data = self.storage.get_state(batch_id)
        return None if data is None else decode_state(data)

    async def kick(self, batch_id: str) -> None:
        """Try to take a batch now (a new one: no need to wait for the next scan)."""
        if batch_id in self._finished or batch_id in self._runners:
            return
        state = self.load(batch_id)
        if state is not None and state.terminal:
            self._finished.add(batch_id)
        elif state is not None:
            await self._take(state)

    async def topic_for(self, model: str | None) -> str | None:
        """The batch topic for a line of `model`, or None while no live worker group serves it."""
        if self.routes is None:
            return self.batch_topic
        table = await self.routes.table()
        if model is None and len(table.models) == 1:  # as the live endpoints: lenient with one model
            model = table.models[0]
        route = table.routes.get(model) if model is not None else None
        if route is None or route.batch_topic is None:
            if model not in self._held_models:
                self._held_models.add(model)
                why = table.not_routable(model) if route is None else (
                    f"the workers of topic {route.topic!r} read no batch topic (--no-batch-topic); start one "
                    "without it, or give the gateway a --batch-topic that some worker of that model reads")
                log.warning("batch lines for model %r wait: %s", model, why)
            return None
        self._held_models.discard(model)
        return route.batch_topic

    async def _scan_forever(self) -> None:
        swept_at = float("-inf")
        while True:
            try:
                for batch_id in await asyncio.to_thread(self.storage.batch_ids):
                    await self.kick(batch_id)
                if time.monotonic() - swept_at > 60:
                    swept_at = time.monotonic()
                    await asyncio.to_thread(self.storage.sweep_expired)
            except Exception as exc:  # Redis or the disk away for a while: look again at the next scan
                log.warning("batch scan failed: %s: %s", type(exc).__name__, exc)
            await asyncio.sleep(self.cfg.scan_s)

    async def _take(self, state: BatchState) -> None:
        lease = Lease(self.client, state.id, self.replica, self.cfg.lease_ttl_s)
        if not await lease.acquire():
            return  # another replica gathers it
        fresh = self.load(state.id)  # read again under the lease: the last holder may have written since
        if fresh is None or fresh.terminal:
            await lease.release()
            return
        state = fresh
        self.metrics.leases.inc()
        task = asyncio.create_task(self._run(BatchRunner(self, state, lease)), name=f"stoker-batch-{state.id}")
        self._runners[state.id] = task

    async def _run(self, runner: BatchRunner) -> None:
        batch_id = runner.state.id
        try:
            await runner.run()
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # Kafka or Redis away: the next scan takes the batch again (from the disk)
            where = repr(self.batch_topic) if self.routes is None else "that its models' workers name"
            log.warning("batch %s: stopped on %s: %s; retried at the next scan (is Kafka up, and does the batch "
                        "topic %s exist?)", batch_id, type(exc).__name__, exc, where)
        finally:
            self._runners.pop(batch_id, None)
            with contextlib.suppress(Exception):  # gone with Redis: the lease's TTL frees it anyway
                await asyncio.shield(runner.lease.release())
