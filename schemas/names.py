"""Topic, Redis key and header names of the wire contract, shared by the worker and the client."""

import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

JOBS_TOPIC = "stoker.jobs"
DLQ_SUFFIX = ".dlq"
# The batch priority class: jobs that may wait behind live ones (the Batch API, bulk producers) go to the
# job topic's ".batch" sibling, which workers read by weight below the live topic.
BATCH_SUFFIX = ".batch"
REDIS_PREFIX = "stoker"

CONTENT_TYPE_HEADER = "content-type"
JSON_CONTENT_TYPE = "application/json"
MSGPACK_CONTENT_TYPE = "application/msgpack"

STREAM_FIELD = "data"  # each Redis stream entry holds one field, `data`, with the encoded event
DEFAULT_TTL_S = 3600  # stream, result and cancelled keys expire after an hour unless configured otherwise
DEFAULT_MAX_ATTEMPTS = 3  # starts without finishing before a job is dead-lettered as poison_job

# Dead-letter headers: UTF-8 text values added to the original record's headers.
DLQ_ERROR_CODE = "stoker-error-code"
DLQ_ERROR_MESSAGE = "stoker-error-message"
DLQ_FAILED_AT = "stoker-failed-at"  # epoch ms, decimal
DLQ_WORKER = "stoker-worker"
DLQ_ATTEMPTS = "stoker-attempts"
DLQ_HEADERS = (DLQ_ERROR_CODE, DLQ_ERROR_MESSAGE, DLQ_FAILED_AT, DLQ_WORKER, DLQ_ATTEMPTS)

_REQUEST_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")
_KAFKA_TOPIC = re.compile(r"[A-Za-z0-9._-]{1,249}")


def worker_ids(members: Iterable[Any]) -> list[str]:
    """The worker index's members (or heartbeat key suffixes) as worker ids, which are text: bytes that are not
    UTF-8 are no worker's and are skipped. Whoever may write the prefix's keys can put anything there, and one bad
    member must fail neither a worker's group check nor a client's listing."""
    ids = []
    for member in members:
        if isinstance(member, bytes):
            try:
                member = member.decode()
            except UnicodeDecodeError:
                continue
        ids.append(str(member))
    return ids


def default_dlq_topic(jobs_topic: str) -> str:
    """The dead-letter topic of a job topic when none is configured. devstack/stack.py (standard library only,
    so it cannot import this package) repeats this one line; tests/test_stack.py checks that both agree."""
    return jobs_topic + DLQ_SUFFIX


def default_batch_topic(jobs_topic: str) -> str:
    """The batch-class topic of a job topic when none is configured (read below the live topic by weight)."""
    return jobs_topic + BATCH_SUFFIX


def is_valid_request_id(value: object) -> bool:
    """True for 1-128 chars of [A-Za-z0-9._:-] (also the check for a Kafka record key used as a fallback id)."""
    return isinstance(value, str) and _REQUEST_ID.fullmatch(value) is not None


def dlq_headers(code: str, message: str, failed_at_ms: int, worker: str, attempts: int) -> list[tuple[str, bytes]]:
    """The headers appended to a dead-lettered record, in aiokafka's (key, bytes) form."""
    values = (code, message, str(failed_at_ms), worker, str(attempts))
    return [(name, value.encode()) for name, value in zip(DLQ_HEADERS, values, strict=True)]


@dataclass(frozen=True, slots=True)
class Names:
    """Every topic and Redis name from one configurable prefix each; defaults are the contract's."""

    redis_prefix: str = REDIS_PREFIX
    jobs_topic: str = JOBS_TOPIC
    dlq_topic: str = ""  # empty: jobs_topic + ".dlq"

    def __post_init__(self) -> None:
        if not self.redis_prefix or any(c.isspace() for c in self.redis_prefix):
            raise ValueError(f"redis_prefix must be non-empty and without whitespace, got {self.redis_prefix!r}")
        if not self.dlq_topic:
            object.__setattr__(self, "dlq_topic", default_dlq_topic(self.jobs_topic))
        for field, topic in (("jobs_topic", self.jobs_topic), ("dlq_topic", self.dlq_topic)):
            if not _KAFKA_TOPIC.fullmatch(topic):
                raise ValueError(f"{field} must be 1-249 chars of [A-Za-z0-9._-] (a legal Kafka topic), got {topic!r}")
        if self.dlq_topic == self.jobs_topic:
            raise ValueError(f"dlq_topic must differ from jobs_topic ({self.jobs_topic!r}): dead letters would be re-run")

    def _key(self, kind: str, request_id: str) -> str:
        # Guard against building keys from unchecked input: an id with '*' or spaces would escape its namespace.
        if not is_valid_request_id(request_id):
            raise ValueError(f"request_id must be 1-128 chars of [A-Za-z0-9._:-], got {request_id!r}")
        return f"{self.redis_prefix}:{kind}:{request_id}"

    def events_channel(self, request_id: str) -> str:
        """Pub/sub channel with the live events of one request (at-most-once)."""
        return self._key("events", request_id)

    def stream(self, request_id: str) -> str:
        """Stream with the same events, replayable from 0-0; capped length, expires."""
        return self._key("stream", request_id)

    def result(self, request_id: str) -> str:
        """Key holding the terminal event (`done` or `error`)."""
        return self._key("result", request_id)

    def cancelled(self, request_id: str) -> str:
        """Key that makes a cancel stick for a job still waiting in Kafka."""
        return self._key("cancelled", request_id)

    def claim(self, request_id: str) -> str:
        """Key naming the worker that runs the request now; short TTL, renewed while it runs."""
        return self._key("claim", request_id)

    @property
    def workers_index(self) -> str:
        """Sorted set of worker ids with a heartbeat (score: epoch ms of its last write), so readers find the
        heartbeat keys without a SCAN of the whole keyspace."""
        return f"{self.redis_prefix}:workers"

    @property
    def cancel_channel(self) -> str:
        """Pub/sub channel every worker listens on for `cancel` messages."""
        return f"{self.redis_prefix}:cancel"
