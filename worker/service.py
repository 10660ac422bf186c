"""The worker: Kafka in, engine, Redis out, nothing lost.

Tasks on one asyncio loop, each owned by Worker and cancelled in stop():
  poll      reads job records (getmany) of the live and the batch topic, decodes them into the backlog
            (read ahead, bounded in bytes: a class's partitions pause when it holds its share)
  admit     takes jobs from the backlog in admission order (worker.admitter: class, priority, tenant share,
            arrival, tenant limits) as the engine has room, claims them in Redis, hands them to the engine;
            never waits on the engine (it has its own thread, worker.driver)
  publish   drains what the engine produced: one Redis pipeline per batch of steps, then marks the
            records whose terminal event is stored as finished
  commit    commits each partition's contiguous watermark of finished records
  renew     renews our claims and the heartbeat key, learns of cancels and of claims lost
  parked    re-checks jobs another worker holds: commit once their result exists, take over on expiry
  cancels   listens on the cancel channel
Life of a record: read -> tracked in flight -> backlog -> (claimed -> engine -> chunks -> terminal event in Redis) or
(answered at once: already done, cancelled, past deadline, bad input -> DLQ) -> finished -> committed.
Every job held is one entry of the request table (worker.requests: claiming, parked, running, finishing);
the events and dead letters themselves are built in worker.events and worker.dead_letters.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections import Counter, OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import redis.asyncio as aioredis
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, ConsumerRebalanceListener, TopicPartition
from aiokafka.errors import (
    CorruptRecordException,
    KafkaError,
    MessageSizeTooLargeError,
    UnsupportedCodecError,
)
from aiokafka.structs import ConsumerRecord, OffsetAndMetadata
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError
from stoker.engine import EngineRequest, EngineRequestError, EngineStats, RequestOutput
from stoker.schemas import (
    ContractError,
    Done,
    Error,
    ErrorCode,
    Job,
    content_type_of,
    decode_cancel,
    decode_job,
    encode_event,
    event_encoder,
    is_msgpack,
    is_valid_request_id,
)
from stoker.worker import admitter, events
from stoker.worker.admission import BATCH, LIVE
from stoker.worker.admitter import Admitter
from stoker.worker.config import WorkerConfig
from stoker.worker.dead_letters import DeadLetter
from stoker.worker.driver import EngineDriver, EngineLike, EngineStalled
from stoker.worker.grammar_gate import CompileResult, GrammarGate, Outcome
from stoker.worker.membership import heartbeat, join_checked, leave, recheck, served_model_names
from stoker.worker.metrics import HealthServer, WorkerMetrics
from stoker.worker.models import model_states
from stoker.worker.offsets import OffsetTracker
from stoker.worker.publish_batch import CHUNK, FIRST, TERMINAL, PublishBatch, StreamHead
from stoker.worker.redis_io import Admission, RedisIO, Renewal
from stoker.worker.requests import Record, Request, RequestState, RequestTable, engine_request

log = logging.getLogger("stoker.worker")
VERSION = "0.1.0"
CLAIMING, PARKED, RUNNING, FINISHING = (RequestState.CLAIMING, RequestState.PARKED, RequestState.RUNNING,
                                        RequestState.FINISHING)
QUEUED = RequestState.QUEUED
_CLOSE_TIMEOUT_S = 10.0  # at shutdown, how long the last commit and each Kafka client's close may take
_END_OFFSETS_TIMEOUT_S = 2.0  # at a rebalance, how long the new partitions' end offsets may take (else no early start)
_NEVER = float("inf")
# What the Kafka client raises while parsing one record it fetched, the same on every poll: a header key that
# is not UTF-8 (aiokafka decodes them as text), a batch in a codec it cannot decompress, a failed checksum.
_UNREADABLE = (UnicodeDecodeError, UnsupportedCodecError, CorruptRecordException)
# A dead letter refused this long turns /healthz unhealthy: its record (and its partition's commits) is stuck
# until an operator acts. Not at once: a broker restart refuses sends for a few seconds and heals by itself.
DLQ_UNHEALTHY_AFTER_S = 10.0
_EVENT_ENCODERS = (event_encoder(msgpack=False), event_encoder(msgpack=True))  # by Request.msgpack


def now_ms() -> float:
    return time.time() * 1000


@contextlib.contextmanager
def _stop_step(step: str, request_id: str | None = None) -> Iterator[None]:
    """One step of stop() that may fail (Kafka or Redis away, a client already closed): logged, and stop()
    goes on with the next step, so one failure never keeps the rest from closing."""
    try:
        yield
    except Exception as exc:  # noqa: BLE001 -- logged: the shutdown must go on
        log.warning("event=stop_step_failed step=%s request_id=%s error_type=%s error=%r", step, request_id,
                    type(exc).__name__, str(exc))


async def _reaped(task: asyncio.Task[Any]) -> None:
    """Await a cancelled task of ours; an error it ended with is logged, not raised."""
    try:
        await task
    except asyncio.CancelledError:
        pass
    except Exception as exc:  # noqa: BLE001 -- logged: the shutdown must go on
        log.warning("event=stop_step_failed step=task:%s error_type=%s error=%r", task.get_name(),
                    type(exc).__name__, str(exc))


@dataclass(slots=True)
class Batch:
    """One pipeline's worth of output: events, records finished once they are stored, engine steps acked."""

    out: PublishBatch = field(default_factory=PublishBatch)  # the publish script's groups, packed
    terminals: list[Request] = field(default_factory=list)  # their records (and late duplicates') finish
    steps: int = 0
    first_event_record_ms: list[float] = field(default_factory=list)  # for the `published` stage metric


class _Rebalance(ConsumerRebalanceListener):
    def __init__(self, worker: Worker):
        self.worker = worker

    async def on_partitions_revoked(self, revoked: set[TopicPartition]) -> None:
        await self.worker.on_revoked(set(revoked))

    async def on_partitions_assigned(self, assigned: set[TopicPartition]) -> None:
        self.worker.on_assigned(set(assigned))
        await self.worker.note_fresh_offsets(set(assigned))


class Worker:
    def __init__(self, config: WorkerConfig, engine: EngineLike):
        self.cfg = config
        self.engine = engine
        self.model_name = config.served_model_name or engine.model_name
        self.served_models = served_model_names(engine, config.served_model_name)  # sorted, for the heartbeat
        # Every served name in the set's order (a ModelSet serves several; model_name, the first, takes jobs
        # without `model`)
        self.model_names: list[str] = list(getattr(engine, "model_names", None) or [self.model_name])
        self.names = config.names
        self.metrics = WorkerMetrics(config.max_tenant_labels, self.model_name)
        self._stage = {name: self.metrics.stage.labels(name)
                       for name in ("polled", "claimed", "engine_added", "scheduled", "first_output", "published")}
        self.tracker = OffsetTracker()
        self.requests = RequestTable()  # every job we hold, by id: claiming, parked, running, finishing
        # Cancels for ids we have not met yet (the pub/sub message may beat the Kafka record).
        self._early_cancels: OrderedDict[str, None] = OrderedDict()
        self._outbox: asyncio.Queue[Batch] = asyncio.Queue()
        self._commit_wakeup = asyncio.Event()
        self._stopping = asyncio.Event()
        self._paused: set[int] = set()  # classes (admission.LIVE, BATCH) whose partitions are paused
        # the backlog read ahead, and who goes next
        self.admitter = Admitter(config, self.requests, self.metrics, default_model=self.model_name)
        self._admit_wakeup = asyncio.Event()
        self._left_group = False  # left the consumer group during a long Redis outage (rejoins after it)
        self._assigned: set[TopicPartition] = set()
        # Per partition, the log end offset when we were given it: records from there on were produced while we
        # owned the partition, so no earlier owner ran them (note_fresh_offsets, _start_early).
        self._fresh_from: dict[TopicPartition, int] = {}
        # Per partition, the offset after the last record the intake received: where a failed poll rewinds to
        # (_rewind: aiokafka advances a partition's position as it drains it, and a poll that raises on another
        # partition afterwards drops what it drained).
        self._next_read: dict[TopicPartition, int] = {}
        self._tasks: list[asyncio.Task[Any]] = []
        self._side_tasks: set[asyncio.Task[Any]] = set()  # short ones (dead letters), awaited in stop()
        self._dlq_failing: dict[object, float] = {}  # dead-letter sends being retried -> when first refused
        self._started_at = time.time()
        self.ready = False
        self.consumer: AIOKafkaConsumer | None = None
        self.producer: AIOKafkaProducer | None = None
        self.redis: aioredis.Redis | None = None
        self.rio: RedisIO | None = None
        self.driver: EngineDriver | None = None
        self.grammars: GrammarGate | None = None  # compiles uncached response_formats off the loop
        self.health: HealthServer | None = None
        self.fatal: BaseException | None = None

    # -- life cycle ---------------------------------------------------------------------------------------
    async def start(self) -> None:
        cfg = self.cfg
        loop = asyncio.get_running_loop()
        self.redis = self._redis_client()
        self.rio = RedisIO(self.redis, self.names, token=cfg.worker_id, stream_maxlen=self.stream_cap(),
                           ttl_s=cfg.ttl_s, claim_ttl_ms=int(cfg.claim_ttl_s * 1000),
                           attempts_ttl_s=cfg.attempts_ttl_s,
                           on_retry=lambda op, exc: self.metrics.redis_retries.labels(op).inc())
        if cfg.metrics_port >= 0:
            self.health = HealthServer(self.metrics, ready=lambda: self.ready, healthy=self._healthy,
                                       model_state=lambda name: self._model_states().get(name, (None,))[0],
                                       stages=cfg.debug_stages)
            await self.health.start(cfg.metrics_host, cfg.metrics_port)
            log.info("event=metrics_listening port=%s", self.health.port)
        # Redis first: a worker that cannot log in must fail here, before it joins the group and takes
        # partitions it could never serve (an outage, by contrast, is waited out).
        await self.rio.retry("ping", self.redis.ping)
        self.admitter.start(self.redis, self.rio.retry)
        self.driver = EngineDriver(self.engine, loop, self._on_step, first_token_wait_s=cfg.first_token_wait_s)
        self.grammars = GrammarGate(self.engine, cfg.grammar_compile_threads, cfg.grammar_compile_timeout_s)
        self.driver.on_abort = self.grammars.abort  # a cancel must reach a request still compiling
        self.metrics.watch_engine(self.driver)
        self.metrics.watch_models(self._model_states)
        self.driver.start()
        security = cfg.kafka_security()
        self.producer = AIOKafkaProducer(bootstrap_servers=cfg.bootstrap_servers, acks="all",
                                         client_id=f"stoker-worker-{cfg.worker_id}", **security)
        await self.producer.start()
        await self._check_topics()
        # One model set per group and per topic: refuse to join beside workers that serve another set.
        redis = self.redis
        await self.rio.retry("join_check", lambda: join_checked(
            redis, self.names.redis_prefix, cfg.worker_id, self.names.jobs_topic, cfg.group_id,
            self.served_models, self._heartbeat(0), self._heartbeat_ttl_s(), cfg.batch_topic_name or ""))
        self.consumer = AIOKafkaConsumer(
            bootstrap_servers=cfg.bootstrap_servers, group_id=cfg.group_id, enable_auto_commit=False,
            auto_offset_reset="earliest", client_id=f"stoker-worker-{cfg.worker_id}",
            max_poll_records=cfg.max_poll_records, **security,
        )
        self.consumer.subscribe(self._topics(), listener=_Rebalance(self))
        await self.consumer.start()
        for loop_fn in (self._poll_loop, self._admit_loop, self._publish_loop, self._commit_loop, self._renew_loop,
                        self._parked_loop, self._cancel_loop, self._redis_watch_loop, self._membership_loop,
                        self._stall_loop):
            task = asyncio.create_task(loop_fn(), name=loop_fn.__name__)
            task.add_done_callback(self._on_task_done)
            self._tasks.append(task)
        log.info("event=worker_started worker=%s model=%s topics=%s group=%s stream_cap=%d", cfg.worker_id,
                 self.model_name, ",".join(self._topics()), cfg.group_id, self.rio.stream_maxlen)

    def _model_states(self) -> dict[str, tuple[str, EngineStats | None]]:
        return model_states(self.engine, self.model_name, self.driver.last_stats if self.driver else None)

    def _redis_client(self, name: str | None = None) -> aioredis.Redis:
        cfg = self.cfg
        extra: dict[str, Any] = {"ssl_ca_certs": cfg.redis_ca_certs} if cfg.redis_url.startswith("rediss://") else {}
        if cfg.redis_password is not None:
            extra["password"] = cfg.redis_password
        if name is not None:
            extra["client_name"] = name  # CLIENT LIST shows whose connection it is
        return aioredis.Redis.from_url(cfg.redis_url, socket_timeout=10, socket_connect_timeout=5,
                                       health_check_interval=15, **extra)

    def stream_cap(self) -> int:
        """Entries a request's stream keeps: the configured cap, raised to what the longest request the
        engine can run may write, so a late reader replaying from 0-0 finds its first chunks. One chunk per
        engine step at most, so an attempt writes at most max_model_len chunks and its terminal event; a
        job takes up to max_attempts attempts plus a last one that only dead-letters it (one event)."""
        longest = self.cfg.max_attempts * (int(self.engine.max_model_len) + 1) + 1
        return max(self.cfg.stream_maxlen, longest)

    async def run(self) -> None:
        """Until request_stop() (SIGTERM) or a fatal error; then drain and stop. A stop requested while
        start() still waits (Redis or Kafka unreachable: it retries without end) cancels the start."""
        starting = asyncio.create_task(self.start())
        stopping = asyncio.create_task(self._stopping.wait())
        try:
            await asyncio.wait({starting, stopping}, return_when=asyncio.FIRST_COMPLETED)
            if not starting.done():
                starting.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await starting
                log.info("event=stopped_during_startup worker=%s", self.cfg.worker_id)
            else:
                starting.result()  # a failed start raises here
                await stopping
        finally:
            stopping.cancel()
            await self.stop()
        if self.fatal is not None:
            raise RuntimeError(f"the worker failed: {type(self.fatal).__name__}: {self.fatal}; see the log") \
                from self.fatal

    async def _check_topics(self) -> None:
        """Fail the start when the job or dead-letter topic is missing. Brokers run with auto-creation off
        (a typo must not make a topic), and then the first dead letter would retry forever, holding its
        partition's commits, while the worker looked healthy."""
        assert self.producer is not None
        while True:
            try:
                cluster = await self.producer.client.fetch_all_metadata()
                break
            except (KafkaError, OSError, TimeoutError) as exc:  # broker not up yet: wait, like the rest of start
                log.warning("event=kafka_metadata_retry error=%r", str(exc))
                await asyncio.sleep(1.0)
        topics = cluster.topics()
        self.admitter.find_batch_topic(topics)
        missing = [t for t in (self.names.jobs_topic, self.names.dlq_topic) if t not in topics]
        if missing:
            what = "; ".join(f"Kafka topic {t!r} does not exist on {self.cfg.bootstrap_servers}" for t in missing)
            raise RuntimeError(
                f"{what} (or this client may not describe it). Brokers here do not create topics on first use: "
                f"create it (kafka-topics.sh --create --topic {missing[0]} ...; `ops/stack up` makes the default "
                "ones), or point --job-topic / --dlq-topic (STOKER_JOB_TOPIC / STOKER_DLQ_TOPIC) at existing ones")

    def _topics(self) -> list[str]:
        batch = self.admitter.batch_topic
        return [self.names.jobs_topic] + ([batch] if batch else [])

    def _on_task_done(self, task: asyncio.Task[Any]) -> None:
        """A task of ours ended by an error nobody expected (e.g. Redis answering with an error reply): the
        worker can't go on (a dead publisher stalls every job while the claims keep being renewed), so stop,
        hand the running jobs back and exit with an error for the supervisor to restart us."""
        if task.cancelled() or task.exception() is None:
            return
        exc = task.exception()
        log.critical("event=task_failed task=%s error=%r", task.get_name(), str(exc), exc_info=exc)
        if self.fatal is None:
            self.fatal = exc
        self._stopping.set()

    def request_stop(self) -> None:
        self._stopping.set()

    async def stop(self) -> None:
        """Drain: stop reading, let running requests finish (up to drain_timeout_s), publish, commit, hand
        back what is left (its claim released, so another worker takes it at once), close."""
        self._stopping.set()
        self.ready = False
        for intake in self._tasks[:2]:  # poll, admit
            # Let the intake end by itself (it checks _stopping after each round, 200 ms): cancelled in the
            # middle of a claim round trip, Redis would hold claims (and attempts) nobody here knows of.
            await asyncio.wait({intake}, timeout=_CLOSE_TIMEOUT_S)
            intake.cancel()
            await _reaped(intake)  # one that failed is in self.fatal (and logged by _on_task_done)
        if self._side_tasks:
            await asyncio.wait(self._side_tasks, timeout=self.cfg.drain_timeout_s)
            # A dead letter Kafka still refuses: give it up (its job is handed back below, unanswered and
            # uncommitted, so the next worker dead-letters it) rather than retry past our own end.
            for task in list(self._side_tasks):
                task.cancel()
                await _reaped(task)
        deadline = time.monotonic() + self.cfg.drain_timeout_s
        while (self.requests.count(RUNNING) or not self._outbox.empty()) and time.monotonic() < deadline \
                and self.fatal is None:
            await asyncio.sleep(0.05)
        # Hand back what still runs. Its claim is released below (with the attempt we counted), so the next
        # worker runs it under the same attempt number: none of our events for it may follow the release.
        # Stop them at the source, then let the publisher flush what is already queued.
        for req in self.requests.of(RUNNING):
            req.lost = True
            if self.driver is not None and self.driver.fatal is None:
                with _stop_step("engine_abort", req.request_id):
                    self.driver.abort(req.request_id)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._outbox.join(), 2.0)
        # Bounded: with the broker away a commit (and the clients' close) waits for it without end. What is
        # not committed is read again by the next owner, which finds the results and publishes nothing.
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._commit_now(), _CLOSE_TIMEOUT_S)
        if self.rio is not None:
            # seq 0: no event of this attempt was made, so a drain gives its attempt back. Not when the engine
            # broke (a step raised or stalled): one of these jobs may be what broke it, and a job whose attempt
            # came back every time would take down every worker that ran it without ever reaching
            # max_attempts and the dead-letter topic. Its companions pay one attempt each.
            engine_broke = self.driver is not None and self.driver.fatal is not None
            for req in self.requests.of(RUNNING):
                with _stop_step("claim_release", req.request_id):
                    await asyncio.wait_for(self.rio.release(req.request_id, req.attempt,
                                                            give_back_attempt=req.seq == 0 and not engine_broke), 2)
            for req in self.requests.of(RUNNING):
                self.admitter.settle(req.request_id)
            with _stop_step("tenant_release"):
                await asyncio.wait_for(self.admitter.flush(), 2)
            self.rio.stopping = True
        for task in self._tasks[2:]:
            task.cancel()
        for task in self._tasks[2:]:
            await _reaped(task)
        if self.grammars is not None:
            await self.grammars.close()
        if self.driver is not None:  # a stalled step's thread does not come back: don't wait for it
            stalled = isinstance(self.driver.fatal, EngineStalled)
            await asyncio.to_thread(self.driver.stop, 1.0 if stalled else 10.0)
        if self.consumer is not None:
            with _stop_step("consumer_close"):
                await asyncio.wait_for(self.consumer.stop(), _CLOSE_TIMEOUT_S)
        if self.producer is not None:
            with _stop_step("producer_close"):
                await asyncio.wait_for(self.producer.stop(), _CLOSE_TIMEOUT_S)
        if self.redis is not None:
            if self.rio is not None:
                with _stop_step("heartbeat_delete"):
                    await leave(self.redis, self.names.redis_prefix, self.cfg.worker_id)
            await self.redis.aclose()
        if self.health is not None:
            await self.health.stop()
        log.info("event=worker_stopped worker=%s left_running=%d", self.cfg.worker_id,
                 self.requests.count(RUNNING))

    def _healthy(self) -> bool:
        """Every loop runs (none before start() finished), no dead letter is stuck, and we are in the group
        (not sitting out a Redis outage)."""
        now = time.monotonic()
        dlq_stuck = any(now - since >= DLQ_UNHEALTHY_AFTER_S for since in list(self._dlq_failing.values()))
        running = bool(self._tasks) and all(not t.done() for t in self._tasks)
        return self.fatal is None and running and not dlq_stuck and not self._left_group

    async def _stall_loop(self) -> None:
        """The step watchdog: a step that runs past step_stall_timeout_s never ends by itself (a hung GPU, a
        tensor-parallel peer gone inside a one-shot all-reduce), while the renew loop would go on renewing its
        jobs' claims, so no other worker could take them. It raises EngineStalled: the worker stops (claims
        released, jobs handed back) and exits 1 (worker/main.py). So does a model load (several models in one
        worker) running past model_load_timeout_s. A gap in its own ticks (the process stopped) is noted
        with the driver and not counted."""
        limit, load_limit = self.cfg.step_stall_timeout_s, self.cfg.model_load_timeout_s
        limits = [x for x in (limit, load_limit) if x > 0]
        if not limits:  # off; the task still lives until the stop (the health check counts every loop)
            await self._stopping.wait()
            return
        interval = min(5.0, min(limits) / 4)
        last = time.monotonic()
        while not self._stopping.is_set():
            await asyncio.sleep(interval)
            now = time.monotonic()
            # A tick far later than asked: the process was stopped (SIGSTOP, a frozen VM); not the step's time.
            if now - last > 2 * interval + 0.5 and self.driver is not None:
                self.driver.note_pause(last + interval, now)
            last = now
            if self.driver is not None and (stalled := self.driver.stalled(limit, load_limit_s=load_limit)) is not None:
                log.critical("event=engine_step_stalled worker=%s running=%d detail=%r", self.cfg.worker_id,
                             self.requests.count(RUNNING), str(stalled))
                raise stalled

    # -- intake -------------------------------------------------------------------------------------------
    async def _poll_loop(self) -> None:
        assert self.consumer is not None
        while not self._stopping.is_set():
            if self._left_group:  # sitting out a Redis outage: no subscription to poll
                await asyncio.sleep(0.2)
                continue
            try:
                batches = await self.consumer.getmany(timeout_ms=200, max_records=self.cfg.max_poll_records)
            except _UNREADABLE as exc:  # before KafkaError: two of them are KafkaErrors a retry never gets past
                await self._rewind()
                await self._skip_unreadable(exc)
                continue
            except (KafkaError, OSError, TimeoutError) as exc:  # broker restart: aiokafka reconnects; keep polling
                log.warning("event=kafka_poll_error error=%r", str(exc))
                await self._rewind()
                await asyncio.sleep(0.5)
                continue
            if not self.ready and self.consumer.assignment():
                self.ready = True
            records = [rec for tp_records in batches.values() for rec in tp_records]
            if records:
                await self._intake(records, now_ms())
            self._apply_backpressure()

    async def _rewind(self) -> None:
        """After a poll that raised: every partition back to the record after the last one the intake received
        (or its committed offset, when it received none). aiokafka moves a partition's position as it drains its
        records into the poll's result; when another partition then raises, the result, and those records, are
        gone, and the position past them would skip them for good."""
        assert self.consumer is not None
        deadline = time.monotonic() + _END_OFFSETS_TIMEOUT_S  # for all the committed-offset lookups together
        for tp in sorted(self.consumer.assignment() & self._assigned):
            expected: int | None = self._next_read.get(tp)
            if expected is None:
                try:
                    expected = await asyncio.wait_for(self.consumer.committed(tp), max(0.0, deadline - time.monotonic()))
                except (KafkaError, OSError, TimeoutError):
                    continue  # the broker is away: it fetched nothing for this partition to drop either
                if expected is None:  # nothing committed: auto_offset_reset="earliest" starts at the log's start
                    await self.consumer.seek_to_beginning(tp)
                    continue
            self.consumer.seek(tp, expected)

    async def _skip_unreadable(self, exc: BaseException) -> None:
        """A poll failed on a record the Kafka client cannot parse, and would fail on it forever: no job of any
        of our partitions would run again. Find it: each partition's records one at a time (the good ones before
        it go through the intake as usual); the unreadable one is dead-lettered as a stub naming where it is
        (the client hands over none of its bytes) and skipped, so that it stops neither its partition nor the
        worker. A partition that is not the culprit yields its records or nothing."""
        assert self.consumer is not None
        log.error("event=kafka_record_unreadable error=%r", str(exc))
        for tp in sorted(self.consumer.assignment() & self._assigned):
            highwater = self.consumer.highwater(tp)  # from the last fetch: a partition read to its end is not it
            if highwater is not None and await self.consumer.position(tp) >= highwater:
                continue
            for _ in range(self.cfg.max_poll_records):
                try:  # (the failed poll dropped what it had fetched: this fetches again, hence the wait)
                    got = await self.consumer.getmany(tp, timeout_ms=500, max_records=1)
                except _UNREADABLE as found:
                    await self._dead_letter_unreadable(tp, await self.consumer.position(tp), found)
                    break
                records = got.get(tp, [])
                if not records:
                    break
                await self._intake(records, now_ms())

    async def _dead_letter_unreadable(self, tp: TopicPartition, offset: int, exc: BaseException) -> None:
        assert self.consumer is not None
        message = (f"the worker's Kafka client could not read the record at {tp.topic}-{tp.partition} offset "
                   f"{offset}: {type(exc).__name__}: {exc} (a header key that is not UTF-8 text, a compression "
                   "codec it lacks or a corrupt batch); skipped, its bytes are not in this letter")
        log.error("event=kafka_record_skipped topic=%s partition=%d offset=%d error=%r", tp.topic, tp.partition,
                  offset, str(exc))
        self.metrics.records_failed.inc()
        self.tracker.track(tp, offset)
        await self._dead_letter(None, None, [], ErrorCode.INVALID_JOB, message, 0)
        self._finish_records([(tp, offset)])
        self._next_read[tp] = offset + 1
        self.consumer.seek(tp, offset + 1)

    def _observe(self, stage: str, record_ms: float, at_ms: float, request_id: str | None = None) -> None:
        self._stage[stage].observe(max(0.0, at_ms - record_ms) / 1000)
        if request_id is not None and self.cfg.debug_stages:  # the job's own line at /stages (stage_log.py)
            self.metrics.job_stages.note(request_id, stage, at_ms - record_ms)

    async def _intake(self, records: list[ConsumerRecord[Any, Any]], polled_ms: float) -> None:
        claims: list[tuple[Request, int]] = []  # this round's new ids (to the backlog), with their bytes
        for rec in records:
            tp = TopicPartition(rec.topic, rec.partition)
            if tp not in self._assigned:
                continue  # revoked while the batch was in hand: the new owner reads it
            self.tracker.track(tp, rec.offset)
            self._next_read[tp] = max(self._next_read.get(tp, 0), rec.offset + 1)
            record: Record = (tp, rec.offset)
            record_ms = float(rec.timestamp) if rec.timestamp and rec.timestamp > 0 else polled_ms
            self._observe("polled", record_ms, polled_ms)
            try:
                await self._take(rec, record, record_ms, claims)
            except Exception as exc:  # noqa: BLE001 -- no record may stop the intake
                await self._record_failed(rec, record, exc, claims)
        for entry, size in claims:
            self.admitter.enqueue(entry, size)
        if claims:
            self._admit_wakeup.set()

    async def _admit_loop(self) -> None:
        """Admit from the backlog whenever the engine has room: woken by new jobs and by finished ones."""
        next_sweep = 0.0
        next_topic_check = time.monotonic() + admitter.BATCH_TOPIC_RECHECK_S
        while not self._stopping.is_set():
            # asyncio.timeout, not wait_for: wait_for runs the wait as a task of its own, three loop passes from
            # the intake's set() to this task running (ops/bench_ttft.py measures the stages) and a task made
            # 20 times a second while idle.
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(0.05):
                    await self._admit_wakeup.wait()
            self._admit_wakeup.clear()
            if self._left_group:
                continue
            await self.admitter.flush()
            if time.monotonic() >= next_sweep:  # deadlines and cancels of jobs still in the backlog
                next_sweep = time.monotonic() + 1.0
                if expired := self.admitter.take_expired(now_ms(), self._early_cancels):
                    await self._claim(expired)
            if self.admitter.batch_topic_missing and time.monotonic() >= next_topic_check:
                next_topic_check = time.monotonic() + admitter.BATCH_TOPIC_RECHECK_S
                await self._look_for_batch_topic()
            while not self._stopping.is_set() and len(self.admitter.backlog):  # (_free_slots walks the running)
                free, room = self._free_slots()
                if not (claims := await self.admitter.next_round(free, self._assigned, room)):
                    break
                await self._claim(claims)

    async def _look_for_batch_topic(self) -> None:
        """The batch topic was made after we started: subscribe to it too (a rebalance follows)."""
        assert self.producer is not None and self.consumer is not None
        try:
            cluster = await asyncio.wait_for(self.producer.client.fetch_all_metadata(), 5)
        except (KafkaError, OSError, TimeoutError):
            return  # the broker is away: look again later
        if self.admitter.find_batch_topic(cluster.topics()) and not self._left_group:
            log.info("event=batch_topic_found topic=%s", self.admitter.batch_topic)
            self.consumer.subscribe(self._topics(), listener=_Rebalance(self))

    def _free_slots(self) -> tuple[int, dict[str, int]]:
        """Jobs the engines may take now (at most a poll's worth at once), in all and per served model
        (admitter.model_room: max_num_seqs running plus max_waiting queued each, none while a model's KV is
        short); none while the publisher lags (Redis slow). Jobs parked here, or of a model not served
        (they fail at once), count against the total."""
        cfg = self.cfg
        assert cfg.max_waiting is not None
        if self._outbox.qsize() > 64:
            return 0, {}
        if self.grammars is not None and self.grammars.waiting > 0:  # a flood of new schemas: none more until
            return 0, {}  # a compile thread frees
        held = Counter(self.admitter.lane(req.job.model) for state in (RUNNING, CLAIMING) for req in self.requests.of(state))
        stats = {name: st for name, (_, st) in self._model_states().items()}
        room = admitter.model_room(cfg.max_num_seqs + cfg.max_waiting, held, stats, cfg.min_free_kv_fraction)
        free = sum(room.values()) - self.requests.count(PARKED) - sum(n for m, n in held.items() if m not in room)
        return min(free, cfg.max_poll_records), room

    async def _claim(self, claims: list[Request]) -> None:
        assert self.rio is not None
        launches = [launch for entry in claims if (launch := self._start_early(entry)) is not None]
        try:
            if launches and self.cfg.claim_after_launch_s > 0:
                await self._until_launched(launches)
            outcomes = await self.rio.admit([entry.request_id for entry in claims])
        except BaseException:  # no answer (refused credentials, a stop, a bug): no early run goes on for nobody
            for entry in claims:
                if entry.early is not None:
                    entry.early = None
                    if self.driver is not None:
                        self.driver.abort(entry.request_id)
            raise
        claimed_ms = now_ms()
        for entry, (status, attempt) in zip(claims, outcomes, strict=True):
            if status in (Admission.DONE, Admission.BUSY):
                self.admitter.settle(entry.request_id)
            self._observe("claimed", entry.record_ms, claimed_ms, entry.request_id)
            try:
                self._admitted(entry, status, attempt)
            except Exception as exc:  # noqa: BLE001 -- one job's failure must not stop the intake
                log.exception("event=admit_failed request_id=%s", entry.request_id)
                self.metrics.records_failed.inc()
                req = self.requests.running(entry.request_id) or entry.next_attempt(attempt)
                self._fail(req, ErrorCode.INTERNAL, f"the worker failed to start this job: {exc}")

    def _join(self, rid: str, record: Record) -> bool:
        """A record of an id we hold joins its entry: its records finish together. False when new."""
        entry = self.requests.get(rid)
        if entry is None:
            return False
        if entry.state is FINISHING:
            entry.late_records.append(record)
        else:  # RUNNING: delivered again while we run it (a rebalance came back to us); PARKED; CLAIMING
            entry.records.append(record)
        return True

    async def _take(self, rec: ConsumerRecord[Any, Any], record: Record, record_ms: float,
                    claims: list[tuple[Request, int]]) -> None:
        """One record: decode it and route it (to the request it duplicates, or to this round's new jobs)."""
        ctype = content_type_of(rec.headers)
        try:
            job = decode_job(rec.value, ctype, max_bytes=self.cfg.max_message_bytes)
            msgpack = is_msgpack(ctype)
        except ContractError as exc:
            await self._reject(rec, record, exc, claims)
            return
        rid = job.request_id
        if not self._join(rid, record):
            entry = Request(job, msgpack, record_ms, [record], (rec.key, rec.value, list(rec.headers or ())))
            if job.model is not None and job.model not in self.model_names:
                # It can never run here: answered now, not after its turn in the backlog (and its tenant's
                # limits). Unclaimed, like a rejected record: stored only if the id has no result yet.
                self._fail(entry.next_attempt(1), ErrorCode.UNKNOWN_MODEL, self._unknown_model(job.model),
                           unless_ended=True)
                return
            self.requests.put(entry, QUEUED)  # joinable by a duplicate read in the same round
            # The record's bytes twice: kept raw (for a dead letter) and decoded into the Job's strings.
            claims.append((entry, 2 * (len(rec.key or b"") + len(rec.value or b""))))
            if self.cfg.log_prompts:
                log.info("event=job_read request_id=%s prompt=%r", rid, job.prompt or job.messages)

    async def _record_failed(self, rec: ConsumerRecord[Any, Any], record: Record, exc: Exception,
                             claims: list[tuple[Request, int]]) -> None:
        """A record whose handling raised what nobody expected (a bug, a client refusing it): dead-letter it
        as `internal`; if even that raises, log it loudly, count it and let it be committed, so one record
        can never stall its partition or kill the worker."""
        log.exception("event=record_failed topic=%s partition=%d offset=%d", rec.topic, rec.partition, rec.offset)
        self.metrics.records_failed.inc()
        try:
            await self._reject(rec, record, ContractError(ErrorCode.INTERNAL, f"the worker failed on this record: "
                                                           f"{type(exc).__name__}: {exc}"), claims)
        except Exception:  # noqa: BLE001
            log.critical("event=record_dropped topic=%s partition=%d offset=%d", rec.topic, rec.partition,
                         rec.offset, exc_info=True)
            self._finish_records([record])

    def _admitted(self, entry: Request, status: Admission, attempt: int) -> None:
        """Act on the claim script's answer for one job (CLAIMING, or taken out of PARKED). One the engine
        started before the answer (_start_early) goes on there when the answer lets it run here, else stops."""
        held, entry.early = entry.early, None  # from here its outputs go to the RUNNING entry, or nowhere
        adopted = False
        try:
            adopted = self._act_on_claim(entry, status, attempt, held)
        finally:  # a raise too (the caller fails the job): the engine must not run on for nobody
            if held is not None and not adopted and self.driver is not None:
                self.driver.abort(entry.request_id)

    def _act_on_claim(self, entry: Request, status: Admission, attempt: int,
                      held: list[tuple[RequestOutput, float]] | None) -> bool:
        """_admitted's decision; True when the job runs on in the engine from its early start."""
        rid = entry.request_id
        if status == Admission.DONE:  # a result stands: nothing to republish, just commit
            self.requests.remove(entry)
            self._finish_records(entry.records)
            return False
        if status == Admission.BUSY:  # another worker's live claim: wait for its result or its claim's expiry
            self.requests.put(entry, PARKED)
            self.metrics.parked.set(self.requests.count(PARKED))
            return False
        req = entry.next_attempt(attempt)
        self.requests.put(req, RUNNING)
        if attempt > self.cfg.max_attempts:
            task = asyncio.create_task(self._poison(req))  # a Kafka send: don't hold up the other jobs
            self._side_tasks.add(task)
            task.add_done_callback(self._side_tasks.discard)
            return False
        if status == Admission.CANCELLED or rid in self._early_cancels:
            self._end_without_running(req, "cancelled")
            return False
        if req.job.deadline_ms is not None and now_ms() >= req.job.deadline_ms:
            self._end_without_running(req, "deadline")
            return False
        if req.job.model is not None and req.job.model not in self.model_names:
            self._fail(req, ErrorCode.UNKNOWN_MODEL, self._unknown_model(req.job.model))
            return False
        if held is None:
            self._submit(req)
            return False
        self._adopt(req, held)
        return True

    async def _until_launched(self, launches: list[asyncio.Future[None]]) -> None:
        """Jobs started early woke an idle engine: their claim waits until its step has launched them (at most
        claim_after_launch_s). That step's host work (schedule, prepare, the prefill's launches) needs the GIL,
        which this loop would hold meanwhile to send the claim and read its answer; after the launch the loop's
        work overlaps the GPU's instead, and the claim's round trip still ends long before a prefill does. It
        pays since the prefill step is a CUDA graph replay (W1's TTFT 1.0 ms lower on the H200); before that, a
        512-token prefill step returned > 10 ms after the add and the claim only moved into it (BENCHMARKS.md)."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(self.cfg.claim_after_launch_s):
                await asyncio.gather(*launches)

    def _start_early(self, entry: Request) -> asyncio.Future[None] | None:
        """Hand a job being claimed to the engine now, so that the claim's round trip overlaps its first step
        instead of preceding it (a lone job's TTFT). Nothing of it is published before the claim is ours: its
        outputs wait in `entry.early` until _admitted adopts them or aborts the job. Not for a job that would
        not run anyway (cancelled, past its deadline, of a model not served) nor one whose grammar compiles
        first; one the engine refuses now takes the usual path (and gets the same answer after the claim).
        Nor a job read from before the log's end when we got its partition: an earlier owner may have run it,
        and if it broke that owner's engine (a kernel fault, an OOM kill), running it before the claim tells its
        attempt would break ours too before max_attempts could dead-letter it.
        Returns the driver's future of the launch when the job woke an idle engine (see _until_launched)."""
        assert self.driver is not None and self.grammars is not None
        job = entry.job
        if not all(offset >= self._fresh_from.get(tp, _NEVER) for tp, offset in entry.records):
            return None
        if entry.state is not CLAIMING or entry.request_id in self._early_cancels or \
                (job.deadline_ms is not None and now_ms() >= job.deadline_ms) or \
                (job.model is not None and job.model not in self.model_names):
            return None
        try:
            request = engine_request(job)
            request.priority = self.admitter.engine_priority(entry.request_id, request.priority)
            if self.grammars.needs_compile(request):
                return None
            launch = self.driver.add_request(request)
        except Exception:  # noqa: BLE001 -- refused (too long, a bad field): the claim's path answers it
            return None
        entry.early = []
        self._observe("engine_added", entry.record_ms, now_ms(), entry.request_id)
        return launch

    def _hold_early(self, out: RequestOutput, step_ms: float) -> None:
        """An output of no running request: kept if its job started early and is still being claimed."""
        entry = self.requests.get(out.request_id, CLAIMING)
        if entry is not None and entry.early is not None:
            entry.early.append((out, step_ms))

    def _adopt(self, req: Request, held: list[tuple[RequestOutput, float]]) -> None:
        """The claim of a job started early is ours: what the engine made meanwhile goes out now, in order,
        before any later step's events (those reach the loop after this call)."""
        req.in_engine = True
        batch = Batch()  # steps=0: the driver counted those steps when their own (empty) batches went out
        for out, step_ms in held:
            self._add_outputs(batch, [out], step_ms)
        if len(batch.out) or batch.terminals:
            self._outbox.put_nowait(batch)

    def _submit(self, req: Request, request: EngineRequest | None = None) -> None:
        """Hand the job to the engine; one whose response_format is not compiled yet compiles off the loop
        first (worker.grammar_gate) and comes back through _compiled."""
        assert self.driver is not None and self.grammars is not None
        try:
            if request is None:
                request = engine_request(req.job)
                request.priority = self.admitter.engine_priority(req.request_id, request.priority)
                if self.grammars.needs_compile(request):
                    self.grammars.start(request, functools.partial(self._compiled, req, request))
                    return
            self.driver.add_request(request)
            req.in_engine = True
            self._observe("engine_added", req.record_ms, now_ms(), req.request_id)
        except EngineRequestError as exc:
            # A valid message the model can't serve (e.g. too long): an error event, no DLQ, committed.
            self._fail(req, exc.code, exc.message)
        except Exception as exc:  # noqa: BLE001 -- one request's failure must not stop the worker
            log.exception("event=add_request_failed request_id=%s", req.request_id)
            self._fail(req, ErrorCode.INTERNAL, f"the engine could not take the request: {exc}")

    def _compiled(self, req: Request, request: EngineRequest, result: CompileResult) -> None:
        """Its grammar compile settled: go on with admission, unless the request is no longer ours to answer
        (claim lost, handed back at shutdown, group left: whoever runs it next answers it)."""
        if self.requests.running(req.request_id) is not req or req.lost:
            return
        if result.outcome is Outcome.CANCELLED:  # aborted while compiling, still ours: only a cancel does that
            self._end_without_running(req, "cancelled")
        elif result.outcome is Outcome.ERROR:
            self._fail(req, ErrorCode.INVALID_RESPONSE_FORMAT, result.message)
        elif result.outcome is Outcome.FAILED:
            self._fail(req, ErrorCode.INTERNAL, result.message)
        else:
            self._submit(req, request)

    def _unknown_model(self, model: str) -> str:
        served = f"model {self.model_name!r}" if len(self.model_names) == 1 else f"models {self.model_names}"
        return (f"this worker serves {served}, the job asked for {model!r}: send it to a topic served by that "
                "model, or omit `model`")

    def _apply_backpressure(self) -> None:
        """Pause a class's partitions while the backlog holds its share of bytes. A full engine pauses
        nothing by itself: the backlog fills, and reading stops there."""
        assert self.consumer is not None
        paused = self.admitter.paused(self._paused)
        if paused == self._paused:
            return
        assignment = self.consumer.assignment()
        for job_class in (LIVE, BATCH):
            parts = [tp for tp in assignment if self.admitter.class_of(tp.topic) == job_class]
            if parts and job_class in paused - self._paused:
                self.consumer.pause(*parts)
            elif parts and job_class in self._paused - paused:
                self.consumer.resume(*parts)
        log.debug("event=intake_paused classes=%s backlog_bytes=%d", sorted(paused), self.admitter.backlog.bytes)
        self._paused = paused

    # -- answers that need no engine ----------------------------------------------------------------------
    def _end_without_running(self, req: Request, reason: str) -> None:
        done = events.ended_without_running(req, reason, now_ms(), req.job.model or self.model_name,
                                            self.cfg.worker_id)
        self._send_terminal(req, done, reason)

    def _fail(self, req: Request, code: str, message: str, unless_ended: bool = False) -> None:
        self._send_terminal(req, events.error(req, code, message), str(code), unclaimed=unless_ended)

    def _send_terminal(self, req: Request, event: Done | Error, reason: str, unclaimed: bool = False) -> None:
        rid = req.request_id
        self.metrics.finished.labels(reason, self.metrics.tenant_label(req.job.tenant)).inc()
        current = self.requests.get(rid)
        # Its id's entry is now this terminal event's, unless another request holds the id (running or parked
        # under it, or its terminal event queued): records of the id keep joining that one.
        if current is None or current is req or current.state is CLAIMING:
            self.requests.put(req, FINISHING)
        batch = Batch(terminals=[req])
        batch.out.add(req.head or self._head(req), TERMINAL, [encode_event(event, req.msgpack)], unclaimed=unclaimed)
        self._outbox.put_nowait(batch)

    async def _dead_letter(self, rec_key: bytes | None, rec_value: bytes | None,
                           headers: list[tuple[str, bytes]], code: str, message: str, attempts: int) -> None:
        assert self.producer is not None
        letter = DeadLetter.of(rec_key, rec_value, headers, code=code, message=message, attempts=attempts,
                               worker=self.cfg.worker_id, now_ms=int(now_ms()))
        token = object()  # this send, in _dlq_failing while Kafka refuses it
        try:
            await self._send_dead_letter(token, letter)
        finally:
            self._dlq_failing.pop(token, None)

    async def _send_dead_letter(self, token: object, letter: DeadLetter) -> None:
        """Send until stored. A dead letter that can never be sent (too large for the topic with our
        headers, or refused by the client outright) is sent again smaller (worker.dead_letters); past the
        smallest form it is given up, loudly (log and metric): its record is committed rather than held,
        since it would stall the partition forever."""
        assert self.producer is not None
        code, value_bytes = letter.code, letter.value_bytes
        forms = letter.forms
        form = 0
        while True:
            key, value, headers = letter.record(forms[form], int(now_ms()))
            try:
                await self.producer.send_and_wait(self.names.dlq_topic, value=value, key=key, headers=headers)
                break
            except (KafkaError, OSError, TimeoutError) as exc:
                if not isinstance(exc, MessageSizeTooLargeError):  # keep the record in flight until stored
                    await self._dead_letter_refused(token, code, exc)
                    continue
                failure: BaseException = exc
            except Exception as exc:  # noqa: BLE001 -- the client refused the record itself (e.g. its shape)
                failure = exc
            form += 1
            if form == len(forms):
                log.critical("event=dlq_dropped code=%s error=%r value_bytes=%d hint=%r", code, str(failure),
                             value_bytes, "the record is committed without a dead letter; see the log above")
                self.metrics.dlq_dropped.labels(code).inc()
                return
            log.error("event=dlq_part_dropped code=%s dropped=%s error=%r value_bytes=%d", code, forms[form].dropped,
                      str(failure), value_bytes)
        self.metrics.dlq.labels(code).inc()

    async def _dead_letter_refused(self, token: object, code: str, exc: BaseException) -> None:
        if token not in self._dlq_failing:
            self._dlq_failing[token] = time.monotonic()
            log.error("event=dlq_send_failing topic=%s code=%s error=%r hint=%r", self.names.dlq_topic, code,
                      str(exc), "retrying; check the topic exists (broker auto-creation is off) and the "
                      "broker is reachable: the record's partition commits nothing until it is stored")
        else:
            log.warning("event=dlq_retry topic=%s error=%r", self.names.dlq_topic, str(exc))
        await asyncio.sleep(0.5)

    async def _reject(self, rec: ConsumerRecord[Any, Any], record: Record, exc: ContractError,
                      claims: list[tuple[Request, int]]) -> None:
        """A record that breaks the contract: to the DLQ, and an error event when a request id is readable."""
        key = rec.key.decode("utf-8", "replace") if isinstance(rec.key, bytes) else None
        rid = exc.request_id or (key if is_valid_request_id(key) else None)
        log.warning("event=job_rejected request_id=%s code=%s topic=%s partition=%d offset=%d", rid, exc.code,
                    rec.topic, rec.partition, rec.offset)
        await self._dead_letter(rec.key, rec.value, list(rec.headers or ()), exc.code, exc.message, 0)
        if rid is None:
            self._finish_records([record])
            return
        # The id is live here (claiming, running, parked or its terminal event queued): that request's own
        # terminal event is the one its id gets; this record is done (dead-lettered) once that event is stored.
        if self._join(rid, record):
            return
        msgpack = False
        with contextlib.suppress(ContractError):
            msgpack = is_msgpack(content_type_of(rec.headers))
        # A stand-in Job only to carry the id into the Request; it is never run.
        req = Request(Job(request_id=rid, prompt_token_ids=[0]), msgpack, now_ms(), [record], (None, None, []),
                      attempt=1)
        # Published only if the id has no result yet (checked in the publish script, atomically): a bad
        # record reusing a finished request's id is a dead letter alone, never a second terminal event.
        self._fail(req, exc.code, exc.message, unless_ended=True)

    async def _poison(self, req: Request) -> None:
        """Started max_attempts times without finishing: never again. DLQ (the job as we read it) + error."""
        code, msg = ErrorCode.POISON_JOB, (f"the job was started {req.attempt - 1} times without finishing "
                                          f"(limit {self.cfg.max_attempts}); it will not be run again")
        log.error("event=poison_job request_id=%s attempts=%d", req.request_id, req.attempt - 1)
        key, value, headers = req.raw
        await self._dead_letter(key, value, headers, code, msg, req.attempt - 1)
        if req.lost:  # another worker took the claim while the send waited: its answer stands
            return
        self._fail(req, code, msg)

    # -- output -------------------------------------------------------------------------------------------
    def _on_step(self, outputs: list[RequestOutput], stats: EngineStats | None, step_ms: float) -> None:
        """On the loop thread, once per engine step: turn outputs into events, queue one Batch. This runs once
        per token of every request (~10,000 a second per worker): the common output, a running request's next
        chunk, costs a dict lookup, one encode and one PublishBatch.chunk; per-tenant counts and histograms are
        gathered and applied once per step."""
        assert self.driver is not None
        if self.driver.fatal is not None:
            self.fatal = self.driver.fatal
            self._stopping.set()
            return
        batch = Batch(steps=1)
        self._add_outputs(batch, outputs, step_ms)
        if stats is not None:
            m = self.metrics
            m.running.set(stats.num_running)
            m.waiting.set(stats.num_waiting)
            m.kv_usage.set(stats.kv_usage)
        self._outbox.put_nowait(batch)

    def _add_outputs(self, batch: Batch, outputs: list[RequestOutput], step_ms: float) -> None:
        """One step's outputs as events into `batch` (an output of no running request is dropped, or held
        for a job still being claimed after its early start)."""
        publish = batch.out
        running = self.requests.running_by_id()
        prompt_tokens: dict[str | None, int] = {}  # by the job's tenant: labelled once per step (add_tokens)
        generated: dict[str | None, int] = {}
        gaps: list[float] = []  # inter-token times, seconds
        for out in outputs:
            req = running.get(out.request_id)
            if req is None:
                self._hold_early(out, step_ms)
                continue
            if req.lost or not req.in_engine:
                continue
            if out.first_scheduled_ms is not None and req.first_scheduled_ms is None:
                self._first_scheduled(req, out, prompt_tokens)
            new_ids = out.new_token_ids
            chunk: bytes | None = None
            if new_ids or out.text_delta:
                if new_ids:
                    tenant = req.job.tenant
                    generated[tenant] = generated.get(tenant, 0) + len(new_ids)
                last = req.last_chunk_ms
                if req.first_token_ms is None:
                    self._first_token(req, step_ms, batch)
                elif last is not None:
                    gaps.append((step_ms - last) / 1000)
                req.last_chunk_ms = step_ms
                req.text.append(out.text_delta)
                chunk = _EVENT_ENCODERS[req.msgpack](events.chunk(req, out))
                req.seq += 1
                if not out.finished:
                    if req.seq > 1:
                        publish.chunk(req.head or self._head(req), chunk)
                    else:
                        publish.add(req.head or self._head(req), FIRST, [chunk])
                    continue
            if out.finished:
                self._finished(req, out, step_ms, batch, chunk)
        self.metrics.itl.observe_many(gaps)
        self.metrics.add_tokens(prompt_tokens, generated)

    def _head(self, req: Request) -> StreamHead:
        """The request's packed publish keys for this attempt (made once, at its first event)."""
        assert self.rio is not None
        req.head = self.rio.head(req.request_id, req.attempt)
        return req.head

    def _first_scheduled(self, req: Request, out: RequestOutput, prompt_tokens: dict[str | None, int]) -> None:
        req.first_scheduled_ms = out.first_scheduled_ms
        self._observe("scheduled", req.record_ms, out.first_scheduled_ms or req.record_ms, req.request_id)
        self.metrics.queue.observe(max(0.0, (out.first_scheduled_ms or 0.0) - req.record_ms) / 1000)
        prompt_tokens[req.job.tenant] = prompt_tokens.get(req.job.tenant, 0) + out.prompt_tokens

    def _first_token(self, req: Request, step_ms: float, batch: Batch) -> None:
        req.first_token_ms = step_ms
        self.metrics.ttft.observe(max(0.0, step_ms - req.record_ms) / 1000)
        self._observe("first_output", req.record_ms, step_ms, req.request_id)
        batch.first_event_record_ms.append(req.record_ms)

    def _finished(self, req: Request, out: RequestOutput, step_ms: float, batch: Batch, chunk: bytes | None) -> None:
        """The engine finished the request: its terminal event (after this step's chunk, when it made one, in
        one group), and the request waits in FINISHING until the event is stored."""
        m = self.metrics
        self.admitter.used(req.request_id, out.prompt_tokens + out.completion_tokens)
        event = events.finished(req, out, step_ms, req.job.model or self.model_name, self.cfg.worker_id)
        if isinstance(event, Error):
            reason = event.code
        else:
            reason = event.finish_reason
            m.e2e.observe(max(0.0, step_ms - req.record_ms) / 1000)
        m.finished.labels(reason, m.tenant_label(req.job.tenant)).inc()
        terminal = _EVENT_ENCODERS[req.msgpack](event)
        head = req.head or self._head(req)
        if chunk is None:
            batch.out.add(head, TERMINAL, [terminal])
        else:  # the terminal event sets the stream's TTL: a first chunk in its group needs no FIRST
            batch.out.add(head, CHUNK + TERMINAL, [chunk, terminal])
        batch.terminals.append(req)
        self.requests.put(req, FINISHING)

    async def _publish_loop(self) -> None:
        assert self.rio is not None and self.driver is not None
        while True:
            batch = await self._outbox.get()
            taken = 1  # task_done() once stored: stop() waits on the queue's join()
            # Coalesce a backlog into one pipeline (bounded, so one call stays small).
            while not self._outbox.empty() and len(batch.out) < 4096:
                more = self._outbox.get_nowait()
                taken += 1
                batch.out.extend(more.out)
                batch.terminals += more.terminals
                batch.steps += more.steps
                batch.first_event_record_ms += more.first_event_record_ms
            lost = await self.rio.publish(batch.out)
            published_ms = now_ms()
            for record_ms in batch.first_event_record_ms:
                self._observe("published", record_ms, published_ms)
            self.metrics.events.inc(len(batch.out))
            for rid, attempt in lost:
                req = self.requests.running(rid)
                if req is not None and req.attempt == attempt:
                    self._claim_lost(req, "publish")
            finished: list[Record] = []
            for req in batch.terminals:
                rid = req.request_id
                self.admitter.settle(rid)  # its terminal event is stored: the tenant's slot and tokens settle
                records = req.records
                entry = self.requests.get(rid, FINISHING)
                if entry is not None:
                    self.requests.remove(entry)
                    records = records + entry.late_records
                if (rid, req.attempt) in lost:  # another attempt owns the request: wait for its answer
                    self._park(req, records)
                else:
                    finished += records
            self._finish_records(finished)
            for _ in range(batch.steps):
                self.driver.published()
            for _ in range(taken):
                self._outbox.task_done()

    def _finish_records(self, records: list[Record]) -> None:
        for tp, offset in records:
            self.tracker.finish(tp, offset)
        if records:
            self._commit_wakeup.set()
            self._admit_wakeup.set()  # a slot may have freed

    # -- commits and rebalances ---------------------------------------------------------------------------
    async def _commit_loop(self) -> None:
        while True:
            await self._commit_wakeup.wait()
            self._commit_wakeup.clear()
            if not await self._commit_now():
                # Broker away or a rebalance: nothing new may finish to wake us, so try again by ourselves.
                self._commit_wakeup.set()
                await asyncio.sleep(0.5)
            await asyncio.sleep(0.05)  # at most ~20 commits/s: batches the watermark moves

    async def _commit_now(self) -> bool:
        """Commit every assigned partition's watermark; False when the commit failed (retry later)."""
        if self.consumer is None:
            return True
        offsets = {tp: off for tp, off in self.tracker.to_commit().items() if tp in self._assigned}
        if not offsets:
            return True
        try:
            await self.consumer.commit({tp: OffsetAndMetadata(off, "") for tp, off in offsets.items()})
        except (KafkaError, OSError, TimeoutError) as exc:  # broker restart, rebalance: the offsets stay due
            log.warning("event=commit_failed error=%r", str(exc))
            return False
        for tp, off in offsets.items():
            self.tracker.mark_committed(tp, off)
        return True

    async def on_revoked(self, revoked: set[TopicPartition]) -> None:
        """Commit what is safe, stop admitting those partitions' jobs. Running ones go on: the new owner
        finds our claim, parks the job until our result lands, then commits it."""
        await self._commit_now()
        self._assigned -= revoked
        for tp in revoked:
            self.tracker.forget(tp)
            self._fresh_from.pop(tp, None)
            self._next_read.pop(tp, None)
        self.admitter.drop(revoked)
        # Not CLAIMING ones (the intake, mid claim round trip, settles them) nor the records a FINISHING
        # request was read in (they finish with its terminal event, a no-op on a partition forgotten here).
        for parked in self.requests.of(PARKED):
            parked.records = [r for r in parked.records if r[0] not in revoked]
            if not parked.records:
                self.requests.remove(parked)
        for req in self.requests.of(RUNNING):
            req.records = [r for r in req.records if r[0] not in revoked]
        for req in self.requests.of(FINISHING):
            req.late_records = [r for r in req.late_records if r[0] not in revoked]
        log.info("event=partitions_revoked partitions=%s", sorted(f"{tp.topic}-{tp.partition}" for tp in revoked))

    async def note_fresh_offsets(self, assigned: set[TopicPartition]) -> None:
        """Where each new partition's fresh records begin (its end offset now). A partition whose end the broker
        does not tell in time has none: its jobs all wait for their claims (_start_early)."""
        if self.consumer is None or not assigned:
            return
        try:
            ends = await asyncio.wait_for(self.consumer.end_offsets(sorted(assigned)), _END_OFFSETS_TIMEOUT_S)
        except (KafkaError, OSError, TimeoutError) as exc:
            log.warning("event=end_offsets_unknown partitions=%d error=%r", len(assigned), exc)
            return
        self._fresh_from.update({tp: off for tp, off in ends.items() if tp in self._assigned})

    def on_assigned(self, assigned: set[TopicPartition]) -> None:
        self._assigned |= assigned
        paused = [tp for tp in assigned if self.admitter.class_of(tp.topic) in self._paused]
        if paused and self.consumer is not None:
            self.consumer.pause(*paused)  # keep newly assigned partitions in step with the pause state
        log.info("event=partitions_assigned partitions=%s", sorted(f"{tp.topic}-{tp.partition}" for tp in assigned))

    # -- claims, cancels, parked jobs ---------------------------------------------------------------------
    def _claim_lost(self, req: Request, found_by: str) -> None:
        """Another worker (or a newer attempt) holds the request's claim: we were presumed dead (paused,
        cut off). Stop at once: nothing more of ours may be published for it (the publish script drops it
        anyway), its KV blocks are freed, and its records wait for the new owner's answer."""
        rid = req.request_id
        log.warning("event=claim_lost request_id=%s attempt=%d found_by=%s", rid, req.attempt, found_by)
        self.admitter.settle(rid)
        req.lost = True
        self.requests.remove(req)
        if self.driver is not None:
            self.driver.abort(rid)
        self._park(req, req.records)

    def _park(self, req: Request, records: list[Record]) -> None:
        """Wait on the new owner's answer for these records: commit once its result exists, run the job
        again if its claim expires."""
        if not records:
            return
        holder = self.requests.get(req.request_id)
        if holder is None:
            self.requests.put(Request(req.job, req.msgpack, req.record_ms, list(records), req.raw), PARKED)
        elif holder.state is FINISHING:
            holder.late_records.extend(records)
        else:  # parked already (or held by another request of the id): the records finish with it
            holder.records.extend(records)
        self.metrics.parked.set(self.requests.count(PARKED))

    async def _renew_loop(self) -> None:
        assert self.rio is not None and self.driver is not None
        interval = self.cfg.claim_ttl_s / 3
        key = self.rio.worker_key(self.cfg.worker_id)
        while True:
            running = [(req.request_id, req.attempt) for req in self.requests.of(RUNNING) if not req.lost]
            ids = [rid for rid, _ in running]
            codes = await self.rio.renew(running, (key, self._heartbeat(len(ids)), self._heartbeat_ttl_s()))
            for (rid, attempt), code in zip(running, codes, strict=True):
                req = self.requests.running(rid)
                if req is None or req.attempt != attempt:
                    continue
                if code == Renewal.LOST:  # another worker runs it now (we were presumed dead): let theirs stand
                    self._claim_lost(req, "renew")
                elif code == Renewal.CANCELLED:
                    self.driver.abort(rid)
            # Bounded: with a broker away Kafka's offset calls wait up to their request timeout (40 s), and
            # the claims must not wait behind a gauge (they expire after claim_ttl_s).
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._update_lag(), interval)
            await self.admitter.renew()  # the tenants' running-set leases, as often as the claims
            await asyncio.sleep(interval)

    async def _membership_loop(self) -> None:
        """The start's group check again every claim TTL: another model set in our group, topic or batch
        topic is logged (event=group_conflict) and counted (stoker_group_conflicts) until it is gone."""
        assert self.rio is not None and self.redis is not None
        cfg, redis = self.cfg, self.redis
        while True:
            await asyncio.sleep(cfg.claim_ttl_s)
            others = await self.rio.retry("group_recheck", lambda: recheck(
                redis, self.names.redis_prefix, cfg.worker_id, self.names.jobs_topic, cfg.group_id,
                self.served_models, cfg.batch_topic_name or ""))
            self.metrics.group_conflicts.set(len(others))

    def _heartbeat(self, running: int) -> bytes:
        cfg = self.cfg
        # capacity: each served model's engine runs max_num_seqs at once
        return heartbeat(cfg.worker_id, self.names.jobs_topic, cfg.group_id, self.served_models,
                         capacity=cfg.max_num_seqs * len(self.model_names), running=running, version=VERSION, started_at=self._started_at,
                         batch_topic=cfg.batch_topic_name)

    def _heartbeat_ttl_s(self) -> int:
        return max(3, int(self.cfg.claim_ttl_s))  # a few renewals (every third of the claim TTL)

    async def _update_lag(self) -> None:
        consumer = self.consumer
        if consumer is None or not self._assigned:
            self.metrics.set_lag({})  # none held: no partition's series stays behind
            return
        with contextlib.suppress(Exception):
            parts = list(self._assigned)
            ends = await consumer.end_offsets(parts)
            lag: dict[tuple[str, int], int] = {}
            for tp in parts:
                mark = self.tracker.watermark(tp)
                if mark is None:
                    mark = await consumer.committed(tp) or 0
                lag[tp.topic, tp.partition] = max(0, ends.get(tp, 0) - mark)
            self.metrics.set_lag(lag)

    async def _parked_loop(self) -> None:
        assert self.rio is not None
        while True:
            await asyncio.sleep(min(0.5, self.cfg.claim_ttl_s / 5))
            if not self.requests.count(PARKED):
                continue
            ids = self.requests.ids(PARKED)
            outcomes = await self.rio.admit(ids)
            for rid, (status, attempt) in zip(ids, outcomes, strict=True):
                parked = self.requests.get(rid, PARKED)
                if parked is None or status == Admission.BUSY:
                    continue
                self._admitted(parked, status, attempt)
            self.metrics.parked.set(self.requests.count(PARKED))

    async def _cancel_loop(self) -> None:
        assert self.rio is not None
        client = self._redis_client(name=f"stoker-cancels-{self.cfg.worker_id}")
        try:
            await self._listen_for_cancels(client)
        finally:
            with contextlib.suppress(Exception):
                await client.aclose()

    async def _listen_for_cancels(self, client: aioredis.Redis) -> None:
        assert self.rio is not None
        while True:
            pubsub = client.pubsub(ignore_subscribe_messages=True)
            try:
                await pubsub.subscribe(self.names.cancel_channel)
                # Cancels published while we were not subscribed (Redis dropped us, e.g. for a burst that
                # overflowed our output buffer) are lost on the channel; their keys are not.
                await self._apply_cancel_keys()
                while True:
                    msg = await pubsub.get_message(timeout=1.0)
                    if msg is not None:
                        self._on_cancel(msg["data"])
            except (OSError, RedisConnectionError, RedisTimeoutError) as exc:
                # The renew loop also checks cancel keys, so a cancel sent while we were away still lands.
                log.warning("event=cancel_listener_reconnect error=%r", str(exc))
                await asyncio.sleep(0.5)
            finally:
                with contextlib.suppress(Exception):
                    await pubsub.aclose()

    async def _apply_cancel_keys(self) -> None:
        assert self.rio is not None
        ids = [req.request_id for req in self.requests.of(RUNNING) if not req.lost]
        for rid in await self.rio.cancelled_among(ids):
            if self.requests.running(rid) is not None and self.driver is not None:
                log.info("event=cancel_from_key request_id=%s", rid)
                self.driver.abort(rid)

    async def _redis_watch_loop(self) -> None:
        """A Redis outage longer than redis_outage_leave_s: leave the consumer group, so that workers that
        still reach Redis take our partitions (our claims expire meanwhile and they start the jobs again as
        the next attempt); rejoin once Redis answers. Shorter outages are waited out (commits held)."""
        assert self.rio is not None and self.consumer is not None
        while True:
            await asyncio.sleep(0.5)
            down_since = self.rio.down_since
            if not self._left_group and down_since is not None and \
                    time.monotonic() - down_since >= self.cfg.redis_outage_leave_s:
                await self._leave_group(time.monotonic() - down_since)
            elif self._left_group and down_since is None and await self._redis_answers():
                log.warning("event=group_rejoin reason=redis_back worker=%s", self.cfg.worker_id)
                self.consumer.subscribe(self._topics(), listener=_Rebalance(self))
                self._left_group = False

    async def _redis_answers(self) -> bool:
        assert self.redis is not None
        try:
            return bool(await asyncio.wait_for(self.redis.ping(), 5))
        except (OSError, RedisConnectionError, RedisTimeoutError, TimeoutError):
            return False

    async def _leave_group(self, down_s: float) -> None:
        assert self.consumer is not None
        log.error("event=group_leave reason=redis_unreachable down_s=%.1f running=%d worker=%s", down_s,
                  self.requests.count(RUNNING), self.cfg.worker_id)
        self._left_group = True
        self.ready = False
        await self.on_revoked(set(self._assigned))
        for req in self.requests.of(RUNNING):
            self.admitter.settle(req.request_id)
        self.consumer.unsubscribe()
        # What runs here can't publish; its claims expire and other workers run it again. Free the engine.
        for req in self.requests.of(RUNNING):
            req.lost = True
            if self.driver is not None:
                self.driver.abort(req.request_id)
        self.requests.clear(RUNNING)
        self.requests.clear(PARKED)
        self.metrics.parked.set(0)

    def _on_cancel(self, data: bytes) -> None:
        try:
            rid = decode_cancel(data).request_id
        except ContractError as exc:
            log.warning("event=bad_cancel code=%s message=%r", exc.code, exc.message)
            return
        if self.requests.running(rid) is not None and self.driver is not None:
            self.driver.abort(rid)
        else:
            self._early_cancels[rid] = None
            while len(self._early_cancels) > 10_000:
                self._early_cancels.popitem(last=False)

