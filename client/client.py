"""Producer and subscriber helpers that speak only the wire contract (schemas/): no engine, no torch.

    async with Client("127.0.0.1:9092", "redis://127.0.0.1:6379/0") as c:
        async for event in c.stream(prompt="Hello", max_tokens=32):   # Chunk ... then the Done
            print(event.text, end="")
        done = await c.generate(messages=[{"role": "user", "content": "Hi"}])

How a request is followed: subscribe to its pub/sub channel (and wait for Redis to confirm) BEFORE the job
is produced, so no first token can be missed. Pub/sub is at-most-once, so every event goes through an
`EventSequencer` (highest attempt wins, duplicate seqs dropped, gaps filled from the replayable stream by
XRANGE), and a quiet channel is checked against the result key, so a lost terminal event costs a poll
interval instead of a hang.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, cast

import msgspec
import redis.asyncio as aioredis
import redis.exceptions
from aiokafka import AIOKafkaProducer
from redis.asyncio.client import PubSub
from stoker.schemas import Cancel, Chunk, ContractError, Done, ErrorCode, Job, Names, worker_ids
from stoker.schemas import Error as ErrorEvent

from stoker import schemas

Event = Chunk | Done | ErrorEvent
DEFAULT_BOOTSTRAP = "127.0.0.1:9092"
DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"
CANCEL_TTL_S = 3600  # as long as the result key lives: a cancel must outlast a job waiting in Kafka
RECONNECT_BACKOFF_S = (0.05, 2.0)  # pub/sub reconnects: at once, then 50 ms doubling up to 2 s
_CONNECTION_ERRORS = (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, OSError)
log = logging.getLogger("stoker.client")


class ClientError(Exception):
    """Base of the errors this module raises."""


class RequestFailed(ClientError):
    """The request ended with an `error` event; `code` is the contract's stable snake_case code."""

    def __init__(self, request_id: str, code: str, message: str):
        super().__init__(f"request {request_id} failed: {code}: {message}")
        self.request_id, self.code, self.message = request_id, code, message


class RequestTimeout(ClientError, TimeoutError):
    """No terminal event within the timeout. The job may still run: cancel it if you no longer want it.
    `reason` replaces the usual hint when the time ran out before the job was even sent."""

    def __init__(self, request_id: str, timeout_s: float, events_seen: int, reason: str | None = None):
        super().__init__(
            f"request {request_id}: no terminal event within {timeout_s:g} s ({events_seen} events seen); "
            + (reason or "is a worker running on this topic and prefix? (`stoker workers` lists live ones)")
        )
        self.request_id, self.timeout_s, self.events_seen = request_id, timeout_s, events_seen


def new_request_id() -> str:
    return uuid.uuid4().hex


def decode_event(data: bytes) -> Event:
    """Decodes one event in either encoding (schemas sniffs: a JSON object starts with `{`, a msgpack map not)."""
    return schemas.decode_event(data)


def decode_or_skip(data: bytes, request_id: str, where: str) -> Event | None:
    """An event from the channel or the stream, or None for bytes that are not a valid event (anyone who can
    write to Redis can publish there). Skipping is safe: the seqs around it show a gap, which the stream
    fills, and the result key is the final word; the stream must not die on one bad message."""
    try:
        event = decode_event(data)
    except ContractError as exc:
        log.warning("request %s: skipped an invalid event on the %s: %s", request_id, where, exc)
        return None
    if event.request_id != request_id:
        log.warning("request %s: skipped an event of request %s on the %s", request_id, event.request_id, where)
        return None
    return event


class EventSequencer:
    """Applies the contract's ordering rules to events of one request, in the order they arrive.

    `offer` answers "accept" (deliver it), "drop" (an older attempt or a duplicate seq) or "gap" (seqs are
    missing before it: fill them from the stream, then offer it again, or `skip_to` it if they are lost).
    """

    def __init__(self) -> None:
        self.attempt = 0
        self.next_seq = 0
        self.lost = 0  # seqs given up on (stream capped or expired before we could read them)

    def offer(self, event: Event) -> str:
        if event.attempt < self.attempt:
            return "drop"
        if event.attempt > self.attempt:  # a takeover: the new attempt's seqs start again from 0
            self.attempt, self.next_seq = event.attempt, 0
        if event.seq < self.next_seq:
            return "drop"
        if event.seq > self.next_seq:
            return "gap"
        self.next_seq += 1
        return "accept"

    def skip_to(self, event: Event) -> None:
        self.lost += event.seq - self.next_seq
        self.next_seq = event.seq + 1


class TextAssembler:
    """Turns accepted chunks into text deltas that are safe to show once, across takeovers.

    When a worker dies mid-request another starts it again (attempt + 1, text from the beginning). What the
    reader has already seen cannot be taken back, so a new attempt's text is shown only past the length
    already shown. This is exact when the rerun reproduces the prefix (greedy or seeded sampling); otherwise
    the `done` text, which is authoritative, is the one to keep."""

    def __init__(self) -> None:
        self.shown = ""
        self._attempt = 0
        self._attempt_text = ""

    def feed(self, chunk: Chunk) -> str:
        if chunk.attempt != self._attempt:
            self._attempt, self._attempt_text = chunk.attempt, ""
        self._attempt_text += chunk.text
        delta = self._attempt_text[len(self.shown):]
        self.shown += delta
        return delta


class _Dispatcher:
    """One pub/sub connection shared by every request the client follows: a reader task routes each
    message to the queue of its channel, and `subscribe` returns only once Redis has confirmed, so a job
    produced afterwards cannot publish before we listen. One connection for N requests keeps a load test
    of thousands of concurrent requests from opening thousands of sockets.

    The connection is replaceable: when it drops (Redis restart, CLIENT KILL, a network blip) the reader
    opens a new one with backoff and subscribes every channel still followed. What was published in
    between is lost on pub/sub; followers notice the seq gap at their next event and fill it from the
    stream (or find the terminal event under the result key), so only latency is lost. Requests started
    during the outage wait (within their timeout) for the new connection's confirmation."""

    def __init__(self, redis: aioredis.Redis, *, backoff_s: tuple[float, float] = RECONNECT_BACKOFF_S):
        self._redis = redis
        self._pubsub: PubSub | None = None  # None while disconnected: the reader is reconnecting
        self._queues: dict[bytes, asyncio.Queue[bytes]] = {}
        self._confirm: dict[bytes, asyncio.Future[None]] = {}
        self._reader: asyncio.Task[None] | None = None
        self._wanted = asyncio.Event()  # set after a subscribe: wakes a reader that idles with none
        self._stale = False  # a caller's SUBSCRIBE failed on the connection: the reader replaces it
        self._backoff_s = backoff_s
        self.last_error: BaseException | None = None
        self.reconnects = 0

    async def start(self) -> None:
        self._pubsub = await self._connect()  # the first connection fails loudly; later ones are retried
        self._reader = asyncio.create_task(self._read(), name="stoker-client-pubsub")

    async def close(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reader
            self._reader = None
        if self._pubsub is not None:
            await self._pubsub.aclose()
            self._pubsub = None

    async def _connect(self) -> PubSub:
        """A new connection subscribed to every followed channel, including those added meanwhile."""
        pubsub = self._redis.pubsub()
        try:
            await pubsub.connect()
            subscribed: set[bytes] = set()
            # No await between the last check and the return: a subscribe() after it sees this connection
            # (the caller stores it at once) and sends its own SUBSCRIBE.
            while True:
                missing, gone = self._queues.keys() - subscribed, subscribed - self._queues.keys()
                if not missing and not gone:
                    break
                if missing:
                    await pubsub.subscribe(*missing)
                    subscribed |= missing
                if gone:  # unsubscribed while we reconnected: do not keep listening for it
                    await pubsub.unsubscribe(*gone)
                    subscribed -= gone
        except BaseException:
            await pubsub.aclose()
            raise
        return pubsub

    async def subscribe(self, channel: str, timeout_s: float) -> asyncio.Queue[bytes]:
        """The channel's queue, once Redis has confirmed the subscription (TimeoutError after timeout_s)."""
        key = channel.encode()
        if key in self._queues:
            raise ClientError(f"already following channel {channel}: request ids must be fresh")
        queue: asyncio.Queue[bytes] = asyncio.Queue()
        self._queues[key] = queue
        confirmed = self._confirm[key] = asyncio.get_running_loop().create_future()
        try:
            if self._pubsub is not None:  # else the reader's reconnect subscribes it with the others
                try:
                    await self._pubsub.subscribe(channel)
                    self._wanted.set()
                except _CONNECTION_ERRORS as exc:  # the reader replaces the connection, channel included
                    self.last_error, self._stale = exc, True
                    self._wanted.set()  # an idle reader acts on it now rather than at its next check
            await asyncio.wait_for(confirmed, timeout_s)
        except BaseException:
            self._queues.pop(key, None)
            raise
        finally:
            self._confirm.pop(key, None)
        return queue

    async def unsubscribe(self, channel: str) -> None:
        if self._queues.pop(channel.encode(), None) is not None and self._pubsub is not None:
            with contextlib.suppress(Exception):  # the connection may be gone; a new one will not have it
                await self._pubsub.unsubscribe(channel)

    async def _read(self) -> None:
        failures = 0
        while True:
            try:
                if self._pubsub is None:
                    self._pubsub = await self._connect()
                    self.reconnects += 1
                    log.warning("Redis pub/sub reconnected; following %d channels again", len(self._queues))
                    failures = 0
                if self._stale:
                    self._stale = False
                    raise ClientError(f"a SUBSCRIBE failed: {self.last_error!r}")
                if not self._pubsub.subscribed:  # get_message needs a subscription to read anything
                    self._wanted.clear()
                    with contextlib.suppress(TimeoutError):  # re-checks the stale flag now and then
                        await asyncio.wait_for(self._wanted.wait(), 1.0)
                    continue
                msg = await self._pubsub.get_message(timeout=1.0)
                if msg is None:
                    continue
                channel = msg["channel"]
                if msg["type"] == "subscribe":
                    confirmed = self._confirm.get(channel)
                    if confirmed is not None and not confirmed.done():
                        confirmed.set_result(None)
                elif msg["type"] == "message" and (queue := self._queues.get(channel)) is not None:
                    queue.put_nowait(msg["data"])
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # connection lost (or broken): drop it, retry with capped exponential backoff
                self.last_error = exc
                if self._pubsub is not None:
                    log.warning("Redis pub/sub connection lost (%r); reconnecting", exc)
                    with contextlib.suppress(Exception):
                        await self._pubsub.aclose()
                    self._pubsub = None
                first, cap = self._backoff_s
                await asyncio.sleep(0.0 if failures == 0 else min(cap, first * 2 ** (failures - 1)))
                failures += 1


@dataclass(slots=True)
class WorkerInfo:
    """One live worker, from its heartbeat key `{prefix}:worker:{worker_id}` (a JSON object)."""

    worker_id: str
    model: str | None
    capacity: Any
    version: str | None
    info: dict[str, Any] = field(default_factory=dict)  # the whole heartbeat, for fields added later
    topic: str | None = None  # the job topic it reads; None from a worker older than the field
    group: str | None = None  # its Kafka consumer group; None likewise
    models: tuple[str, ...] = ()  # every model name it serves, sorted (an older worker's: its one `model`)
    batch_topic: str | None = None  # its batch-class topic; "" reads none; None: older worker (topic + .batch)

    @classmethod
    def from_heartbeat(cls, worker_id: str, info: dict[str, Any]) -> WorkerInfo:
        """Tolerant of older workers and odd values: a field of the wrong type counts as absent."""
        model, topic, group = (v if isinstance(v, str) else None for v in map(info.get, ("model", "topic", "group")))
        models = info.get("models")
        names = [m for m in models if isinstance(m, str)] if isinstance(models, list) else [model] if model else []
        batch_topic = info.get("batch_topic")
        return cls(worker_id, model, info.get("capacity"), info.get("version"), info, topic, group,
                   tuple(sorted(set(names))), batch_topic if isinstance(batch_topic, str) else None)


class Client:
    """Produces jobs to Kafka and follows their events in Redis. Use as `async with Client(...) as c:`."""

    def __init__(
        self,
        bootstrap_servers: str = DEFAULT_BOOTSTRAP,
        redis_url: str = DEFAULT_REDIS_URL,
        *,
        prefix: str = schemas.REDIS_PREFIX,
        topic: str = schemas.JOBS_TOPIC,
        msgpack: bool = False,
        timeout: float = 300.0,
        poll_interval: float = 0.5,
        kafka_options: dict[str, Any] | None = None,
        redis_options: dict[str, Any] | None = None,
        unindexed_scan_s: float = 30.0,
    ):
        if timeout <= 0 or poll_interval <= 0:
            raise ValueError(f"timeout ({timeout}) and poll_interval ({poll_interval}) must be > 0 seconds")
        self.bootstrap_servers, self.redis_url, self.topic = bootstrap_servers, redis_url, topic
        self.names = Names(redis_prefix=prefix, jobs_topic=topic)
        self.prefix = prefix
        self.msgpack, self.timeout, self.poll_interval = msgpack, timeout, poll_interval
        # linger_ms 0: a lone request leaves at once (ops/bench_kafka_rtt.py on the 2-core VM: send -> fetch
        # p50 1.1 ms at 0 against 4.0 ms at 2); concurrent sends still share batches while one is in flight.
        self._kafka_options = {"acks": "all", "linger_ms": 0, **(kafka_options or {})}
        self._redis_options = redis_options or {}
        self._producer: AIOKafkaProducer | None = None
        self._redis: aioredis.Redis | None = None
        self._dispatcher: _Dispatcher | None = None
        self._producer_lock = asyncio.Lock()
        self._cleanups: set[asyncio.Future[Any]] = set()  # unsubscribe/cancel tasks still in flight
        # workers(): how often a SCAN also looks for heartbeats missing from the worker index (workers older
        # than it); 0 = at every call. Each SCAN walks the whole keyspace.
        self.unindexed_scan_s = unindexed_scan_s
        self._scanned_at = float("-inf")
        self._unindexed: list[str] = []  # worker ids the last SCAN found outside the index

    async def __aenter__(self) -> Client:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def start(self) -> None:
        # A blocking pool: thousands of followers may poll at once; they queue for a connection instead of
        # failing with "Too many connections" (the pub/sub reader holds one connection of its own).
        options = {"max_connections": 64, "timeout": 30, **self._redis_options}
        pool = aioredis.BlockingConnectionPool.from_url(self.redis_url, **options)
        self._redis = aioredis.Redis.from_pool(pool)  # owns the pool: aclose() closes it too
        try:
            await self._redis.ping()  # fail here, with the URL in the message, not on the first request
            self._dispatcher = _Dispatcher(self._redis)
            await self._dispatcher.start()
        except BaseException:  # `async with` runs no __aexit__ when __aenter__ fails: free what we opened
            await self.close()
            raise

    async def close(self) -> None:
        """Idempotent; each resource is released even if releasing an earlier one failed."""
        try:
            if self._cleanups:  # let pending cancels reach Redis before the connection goes
                await asyncio.wait(list(self._cleanups), timeout=5.0)
        finally:
            producer, self._producer = self._producer, None
            dispatcher, self._dispatcher = self._dispatcher, None
            client, self._redis = self._redis, None
            try:
                if producer is not None:
                    await producer.stop()
            finally:
                try:
                    if dispatcher is not None:
                        await dispatcher.close()
                finally:
                    if client is not None:
                        await client.aclose()

    @property
    def redis(self) -> aioredis.Redis:
        if self._redis is None:
            raise ClientError("the client is not started: use `async with Client(...)` or `await start()`")
        return self._redis

    async def _kafka(self) -> AIOKafkaProducer:
        # Started lazily so read-only uses (tail, workers, cancel) need no broker; the lock makes the
        # first N concurrent submits share one producer.
        async with self._producer_lock:
            if self._producer is None:
                producer = AIOKafkaProducer(bootstrap_servers=self.bootstrap_servers, **self._kafka_options)
                try:
                    await producer.start()
                except BaseException:
                    await producer.stop()
                    raise
                self._producer = producer
        return self._producer

    # ---- producing -------------------------------------------------------------------------------------
    def make_job(
        self,
        prompt: str | None = None,
        *,
        messages: list[dict[str, Any]] | None = None,
        prompt_token_ids: list[int] | None = None,
        request_id: str | None = None,
        response_format: dict[str, Any] | schemas.ResponseFormat | None = None,
        **params: Any,
    ) -> Job:
        """Builds and validates a job (ContractError names any bad field) before anything is sent.
        response_format (a dict in the contract's shape, e.g. {"type": "json_schema", "json_schema": {"name": ...,
        "schema": {...}}}, or a schemas struct) constrains the output; the job then carries `v: 2`."""
        if response_format is not None:
            params.setdefault("v", 2)
        fields = {"prompt": prompt, "messages": messages, "prompt_token_ids": prompt_token_ids,
                  "response_format": response_format, **params}
        raw = {"type": "job", "request_id": request_id or new_request_id(),
               **{k: v for k, v in fields.items() if v is not None}}
        try:
            data = msgspec.json.encode(raw)
        except (TypeError, msgspec.EncodeError) as exc:  # e.g. a set or an object where JSON wants a value
            raise ContractError(ErrorCode.INVALID_JOB, f"cannot encode the job: {exc}", raw["request_id"]) from None
        # The worker's own decoder: the same checks and messages the worker would answer with, but now.
        return schemas.decode_job(data)

    async def submit(self, job: Job, *, topic: str | None = None) -> None:
        """Produces the job (key = request id) to `topic` (default: the client's) and returns once the broker
        has it; does not follow it."""
        producer = await self._kafka()
        headers = [(schemas.CONTENT_TYPE_HEADER, schemas.content_type_for(self.msgpack).encode())]
        await producer.send_and_wait(
            topic or self.topic, schemas.encode_job(job, msgpack=self.msgpack), key=job.request_id.encode(),
            headers=headers
        )

    async def submit_many(self, jobs: list[Job], *, topic: str | None = None) -> None:
        """Produces jobs to `topic` (default: the client's) and returns once the broker has every one; sent
        together, so they share Kafka batches (the Batch API produces its lines in chunks this way)."""
        producer = await self._kafka()
        headers = [(schemas.CONTENT_TYPE_HEADER, schemas.content_type_for(self.msgpack).encode())]
        sent = [await producer.send(topic or self.topic, schemas.encode_job(job, msgpack=self.msgpack),
                                    key=job.request_id.encode(), headers=headers) for job in jobs]
        await asyncio.gather(*sent)

    # ---- following ---------------------------------------------------------------------------------------
    async def stream(
        self,
        prompt: str | None = None,
        *,
        messages: list[dict[str, Any]] | None = None,
        prompt_token_ids: list[int] | None = None,
        request_id: str | None = None,
        timeout: float | None = None,
        cancel_on_exit: bool = True,
        response_format: dict[str, Any] | schemas.ResponseFormat | None = None,
        **params: Any,
    ) -> AsyncGenerator[Chunk | Done, None]:
        """Submits a job and yields its `chunk` events in order, then its `done` event (last). An `error`
        event raises RequestFailed. If the caller stops iterating early (break, task cancelled, client
        disconnect in the gateway), the job is cancelled unless cancel_on_exit=False. response_format: see
        make_job."""
        job = self.make_job(prompt, messages=messages, prompt_token_ids=prompt_token_ids,
                            request_id=request_id, response_format=response_format, **params)
        async for event in self.run(job, timeout=timeout, cancel_on_exit=cancel_on_exit):
            yield event

    async def run(
        self, job: Job, *, timeout: float | None = None, cancel_on_exit: bool = True, topic: str | None = None
    ) -> AsyncGenerator[Chunk | Done, None]:
        """Like `stream`, for a job already built (e.g. by `make_job`), produced to `topic` (default: the
        client's; the gateway picks the topic whose workers serve the job's model)."""
        timeout = self.timeout if timeout is None else timeout
        deadline = time.monotonic() + timeout
        if self._dispatcher is None:
            raise ClientError("the client is not started: use `async with Client(...)` or `await start()`")
        dispatcher = self._dispatcher
        channel = self.names.events_channel(job.request_id)
        try:  # before producing: no lost first tokens
            queue = await dispatcher.subscribe(channel, timeout)
        except TimeoutError:
            raise RequestTimeout(job.request_id, timeout, 0, reason="Redis never confirmed the subscription to "
                                 f"its events (last pub/sub error: {dispatcher.last_error!r}); the job was not "
                                 "sent") from None
        finished = False
        try:
            try:  # bounded too: a missing topic makes aiokafka wait 40 s for metadata
                await asyncio.wait_for(self.submit(job, topic=topic), max(1e-3, deadline - time.monotonic()))
            except TimeoutError:
                raise RequestTimeout(job.request_id, timeout, 0, reason=f"Kafka did not take the job in time; "
                                     f"does topic {topic or self.topic!r} exist at {self.bootstrap_servers}?") \
                    from None
            async for event in self._follow(job.request_id, queue, deadline, timeout):
                if isinstance(event, ErrorEvent):
                    finished = True
                    raise RequestFailed(job.request_id, event.code, event.message)
                finished = isinstance(event, Done)
                yield event
        finally:
            # Cleanup runs as its own task: when we are here because our task was cancelled (a gateway
            # client hung up; anyio cancels every later await too), the cancel must still go out.
            cleanup = [dispatcher.unsubscribe(channel)]
            if cancel_on_exit and not finished:
                cleanup.append(self.cancel(job.request_id))
            task = asyncio.ensure_future(asyncio.gather(*cleanup, return_exceptions=True))
            self._cleanups.add(task)
            task.add_done_callback(self._cleanups.discard)
            await asyncio.shield(task)

    async def generate(self, prompt: str | None = None, **kwargs: Any) -> Done:
        """Submits a job and returns its `done` event (text, finish_reason, usage, timings)."""
        async for event in self.stream(prompt, **kwargs):
            if isinstance(event, Done):
                return event
        raise ClientError("the event stream ended without a done event")  # _follow never does this

    async def _follow(
        self, request_id: str, queue: asyncio.Queue[bytes], deadline: float, timeout: float
    ) -> AsyncIterator[Event]:
        sequencer = EventSequencer()
        seen = 0
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise RequestTimeout(request_id, timeout, seen)
            try:
                # get_nowait first: wait_for wraps the get in a new task, too dear to pay per token
                raw = queue.get_nowait() if not queue.empty() else await asyncio.wait_for(
                    queue.get(), min(remaining, self.poll_interval))
            except TimeoutError:
                # Quiet channel: the terminal event may have been lost (pub/sub is at-most-once). The
                # result key says whether it exists; the stream then replays what we missed, in order.
                try:
                    if await self.redis.exists(self.names.result(request_id)):
                        async for event in self._replay(request_id, sequencer):
                            seen += 1
                            yield event
                            if isinstance(event, Done | ErrorEvent):
                                return
                        terminal = await self.result(request_id)  # stream capped/expired: the key is final
                        if terminal is not None:
                            yield terminal
                            return
                except _CONNECTION_ERRORS as exc:  # Redis is restarting: look again next interval
                    log.debug("request %s: result check failed (%r); retrying", request_id, exc)
                continue
            if (decoded := decode_or_skip(raw, request_id, "channel")) is None:
                continue
            event = decoded
            verdict = sequencer.offer(event)
            if verdict == "gap":
                for _ in range(3):  # the worker XADDs in the same pipeline as the PUBLISH: a retry suffices
                    async for replayed in self._replay(request_id, sequencer):
                        seen += 1
                        yield replayed
                        if isinstance(replayed, Done | ErrorEvent):
                            return
                    if (verdict := sequencer.offer(event)) != "gap":
                        break
                    await asyncio.sleep(0.02)
                else:
                    sequencer.skip_to(event)
                    verdict = "accept"
            if verdict == "accept":
                seen += 1
                yield event
                if isinstance(event, Done | ErrorEvent):
                    return

    async def _replay(self, request_id: str, sequencer: EventSequencer) -> AsyncIterator[Event]:
        """Yields the stream's events that the sequencer accepts (those we have not delivered yet)."""
        # redis-py's stubs cover every decode_responses mode; ours returns bytes
        entries = cast(list[tuple[bytes, dict[bytes, bytes]]], await self.redis.xrange(self.names.stream(request_id)))
        for _entry_id, entry in entries:
            event = decode_or_skip(entry.get(b"data", b""), request_id, "stream")
            if event is not None and sequencer.offer(event) == "accept":
                yield event

    async def tail(self, request_id: str, *, timeout: float | None = None) -> AsyncIterator[Event]:
        """Follows a request from its replayable stream (from 0-0, so it works for late subscribers) until
        its terminal event, which is yielded too (an `error` is yielded, not raised: tail is an observer)."""
        timeout = self.timeout if timeout is None else timeout
        deadline = time.monotonic() + timeout
        sequencer, last_id, seen = EventSequencer(), "0-0", 0
        stream = self.names.stream(request_id)
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise RequestTimeout(request_id, timeout, seen)
            block_ms = max(1, int(min(remaining, self.poll_interval) * 1000))
            reply = cast(list[tuple[bytes, list[tuple[bytes, dict[bytes, bytes]]]]] | None,
                         await self.redis.xread({stream: last_id}, block=block_ms, count=512))
            for _stream, entries in reply or []:
                for entry_id, entry in entries:
                    last_id = entry_id.decode()
                    if (event := decode_or_skip(entry.get(b"data", b""), request_id, "stream")) is None:
                        continue
                    verdict = sequencer.offer(event)
                    if verdict == "gap":  # the stream is capped: its oldest entries are gone
                        sequencer.skip_to(event)
                        verdict = "accept"
                    if verdict == "accept":
                        seen += 1
                        yield event
                        if isinstance(event, Done | ErrorEvent):
                            return
            if not reply and (terminal := await self.result(request_id)) is not None:
                yield terminal  # the stream expired (or was never written) but the result stands
                return

    # ---- control and inspection ----------------------------------------------------------------------------
    async def cancel(self, request_id: str, ttl_s: int = CANCEL_TTL_S) -> None:
        """Cancels a request: the key makes it stick for a job still in Kafka, the channel reaches the worker
        running it now. Set the key first so a worker that reads the job after our PUBLISH still sees it."""
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.set(self.names.cancelled(request_id), b"1", ex=ttl_s)
            pipe.publish(self.names.cancel_channel, schemas.encode_cancel(Cancel(request_id=request_id)))
            await pipe.execute()

    async def known(self, request_id: str) -> bool:
        """Whether anything of the request is in Redis yet: its stream, its result or a worker's claim. False
        means it has not started (still in Kafka, or no worker up), or the id is unknown or expired."""
        names = self.names
        count = await self.redis.exists(names.stream(request_id), names.result(request_id), names.claim(request_id))
        return bool(count)

    async def result(self, request_id: str) -> Done | ErrorEvent | None:
        """The terminal event under the result key, or None if the request has not finished (or expired)."""
        raw = cast(bytes | None, await self.redis.get(self.names.result(request_id)))
        if raw is None:
            return None
        event = decode_event(raw)
        if not isinstance(event, Done | ErrorEvent):
            raise ClientError(f"result key of {request_id} holds a {type(event).__name__}, not done/error")
        return event

    async def workers(self) -> list[WorkerInfo]:
        """Live workers, from their heartbeat keys (they expire when a worker stops renewing them), found
        through the worker index (one ZRANGE and one MGET at any keyspace size). A SCAN, which walks every
        key, also looks for workers older than the index, at most every `unindexed_scan_s` (and whenever the
        index is empty), so such a worker shows up that much later."""
        ids = worker_ids(await self.redis.zrange(self.names.workers_index, 0, -1))
        if not ids or time.monotonic() - self._scanned_at >= self.unindexed_scan_s:
            self._scanned_at = time.monotonic()
            indexed = set(ids)
            self._unindexed = [worker_id for worker_id in await self._scanned_ids() if worker_id not in indexed]
        ids += self._unindexed
        values = await self.redis.mget([f"{self.prefix}:worker:{worker_id}" for worker_id in ids]) if ids else []
        return _worker_infos(zip(ids, values, strict=True))

    async def _scanned_ids(self) -> list[str]:
        pattern = f"{self.prefix}:worker:*"
        keys = worker_ids([key async for key in self.redis.scan_iter(match=pattern, count=500)])
        return [key[len(pattern) - 1:] for key in keys]


def _worker_infos(found: Iterable[tuple[str, bytes | str | None]]) -> list[WorkerInfo]:
    """(worker id, heartbeat value) pairs -> WorkerInfo, sorted; a key gone (the worker stopped or died) or a
    value that is no heartbeat of ours is skipped rather than failing the whole listing."""
    infos = []
    for worker_id, value in found:
        if value is None:
            continue
        try:
            info = msgspec.json.decode(value)
        except (msgspec.DecodeError, RecursionError):  # RecursionError: JSON nested past the decoder's limit
            continue
        if isinstance(info, dict):
            infos.append(WorkerInfo.from_heartbeat(worker_id, info))
    return sorted(infos, key=lambda w: w.worker_id)


async def _anext(agen: AsyncGenerator[Chunk | Done, None]) -> Chunk | Done:
    return await anext(agen)


class SyncClient:
    """A blocking wrapper over Client for scripts and notebooks without an event loop of their own.

        with SyncClient(bootstrap, redis_url) as c:
            print(c.generate("Hello", max_tokens=16).text)
    """

    def __init__(self, *args: Any, **kwargs: Any):
        self._runner = asyncio.Runner()
        self._client = Client(*args, **kwargs)

    def __enter__(self) -> SyncClient:
        try:
            self._runner.run(self._client.start())
        except BaseException:  # no __exit__ follows a failed __enter__: close the loop here
            self._runner.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        with contextlib.suppress(RuntimeError):  # closing twice: the runner is already closed
            self._runner.run(self._client.close())
        self._runner.close()

    def generate(self, prompt: str | None = None, **kwargs: Any) -> Done:
        return self._runner.run(self._client.generate(prompt, **kwargs))

    def stream(self, prompt: str | None = None, **kwargs: Any) -> Iterator[Chunk | Done]:
        agen = self._client.stream(prompt, **kwargs)
        try:
            while True:
                try:
                    yield self._runner.run(_anext(agen))
                except StopAsyncIteration:
                    return
        finally:
            self._runner.run(agen.aclose())  # cancels the job if the caller stopped early

    def cancel(self, request_id: str) -> None:
        self._runner.run(self._client.cancel(request_id))

    def result(self, request_id: str) -> Done | ErrorEvent | None:
        return self._runner.run(self._client.result(request_id))

    def workers(self) -> list[WorkerInfo]:
        return self._runner.run(self._client.workers())
