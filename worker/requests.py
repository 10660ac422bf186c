"""The worker's request table: every job it holds, one entry per request id, in one of four states.

    QUEUED     read ahead of the engine, in the backlog (worker.admission): not claimed, its records in flight
    CLAIMING   picked for admission; its claim is on the way (one admit round trip for the round)
    PARKED     decoded but not running here: another worker's live claim, or ours was lost; re-checked
               until a result exists (commit) or the claim expires (take it over as the next attempt)
    RUNNING    claimed by us: in the engine, or being answered without it (cancel, deadline, poison)
    FINISHING  its terminal event is queued, not yet in Redis; records of it read meanwhile (a duplicate,
               a re-delivery) finish with that event and never run again

A record of an id already in the table joins that entry (its records finish together). Pure Python: no
Kafka, no Redis, no engine beyond its request type, so it is tested alone.
"""

from __future__ import annotations

import enum
import json
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from stoker.engine import EngineRequest, GuidedDecoding, RequestOutput, SamplingParams
from stoker.schemas import ChoiceFormat, Job, JsonObjectFormat, JsonSchemaFormat, RegexFormat, ResponseFormat
from stoker.worker.publish_batch import StreamHead

Record = tuple[Any, int]  # (partition, offset); the partition is aiokafka's TopicPartition in the worker
RawRecord = tuple[bytes | None, bytes | None, list[tuple[str, bytes]]]  # key, value, headers (for the DLQ)


class RequestState(enum.Enum):
    QUEUED = "queued"
    CLAIMING = "claiming"
    PARKED = "parked"
    RUNNING = "running"
    FINISHING = "finishing"


@dataclass(slots=True)
class Request:
    """A job this worker holds. Running state (attempt, seq, text, times) is fresh for each attempt: an
    entry taken (back) from PARKED into RUNNING is a new Request."""

    job: Job
    msgpack: bool
    record_ms: float  # the Kafka record's timestamp: the start of every latency we report
    records: list[Record]
    raw: RawRecord
    attempt: int = 0  # 0 until claimed
    state: RequestState = RequestState.CLAIMING
    seq: int = 0
    text: list[str] = field(default_factory=list)
    first_token_ms: float | None = None
    last_chunk_ms: float | None = None
    first_scheduled_ms: float | None = None
    lost: bool = False  # our claim went to another worker: stop publishing
    # Records read while FINISHING: they finish with the terminal event (kept apart from `records`, which
    # a revoke leaves alone once the terminal event is queued).
    late_records: list[Record] = field(default_factory=list)
    head: StreamHead | None = None  # this attempt's publish keys, packed at its first event (worker.publish_batch)
    # CLAIMING, handed to the engine before the claim answered (Worker._start_early): the engine's outputs
    # meanwhile, as (output, step end ms), published only once the claim is ours. None: not started early.
    early: list[tuple[RequestOutput, float]] | None = None
    # This attempt is in the engine (submitted, or adopted from its early start): only then are the engine's
    # outputs of its id this attempt's. An early run stopped by a claim answer that left the job RUNNING
    # without the engine (poison: its dead letter in flight) ends with an output that must not be published.
    in_engine: bool = False

    @property
    def request_id(self) -> str:
        return self.job.request_id

    def next_attempt(self, attempt: int) -> Request:
        """The entry as a fresh claimed attempt (state RUNNING once put in the table)."""
        return Request(self.job, self.msgpack, self.record_ms, self.records, self.raw, attempt=attempt)


class RequestTable:
    """request id -> Request, with each state's entries in the order they entered it."""

    def __init__(self) -> None:
        self._by_id: dict[str, Request] = {}
        self._by_state: dict[RequestState, dict[str, Request]] = {s: {} for s in RequestState}

    def get(self, request_id: str, state: RequestState | None = None) -> Request | None:
        """The entry of this id (only if it is in `state`, when given)."""
        req = self._by_id.get(request_id)
        if req is None or (state is not None and req.state is not state):
            return None
        return req

    def running(self, request_id: str) -> Request | None:
        return self.get(request_id, RequestState.RUNNING)

    def running_by_id(self) -> Mapping[str, Request]:
        """The RUNNING entries by id, live (not a copy): for a lookup per engine output without a call each."""
        return self._by_state[RequestState.RUNNING]

    def put(self, req: Request, state: RequestState) -> None:
        """Make `req` the entry of its id, in `state` (replacing whatever entry the id had)."""
        rid = req.request_id
        old = self._by_id.get(rid)
        if old is not None:
            del self._by_state[old.state][rid]
        req.state = state
        self._by_id[rid] = req
        self._by_state[state][rid] = req

    def remove(self, req: Request) -> bool:
        """Drop `req` if it is its id's entry (never another request under the same id)."""
        rid = req.request_id
        if self._by_id.get(rid) is not req:
            return False
        del self._by_id[rid]
        del self._by_state[req.state][rid]
        return True

    def clear(self, state: RequestState) -> None:
        for rid in self._by_state[state]:
            del self._by_id[rid]
        self._by_state[state].clear()

    def ids(self, state: RequestState) -> list[str]:
        return list(self._by_state[state])

    def of(self, state: RequestState) -> list[Request]:
        return list(self._by_state[state].values())

    def count(self, state: RequestState) -> int:
        return len(self._by_state[state])

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._by_id

    def __len__(self) -> int:
        return len(self._by_id)

    def __iter__(self) -> Iterator[Request]:
        return iter(list(self._by_id.values()))


def engine_request(job: Job) -> EngineRequest:
    """The one place a wire job becomes an engine request."""
    params = SamplingParams(
        max_tokens=job.max_tokens, min_tokens=job.min_tokens, temperature=job.temperature, top_p=job.top_p,
        top_k=job.top_k, min_p=job.min_p, seed=job.seed, presence_penalty=job.presence_penalty,
        frequency_penalty=job.frequency_penalty, repetition_penalty=job.repetition_penalty,
        stop=tuple(job.stop), stop_token_ids=tuple(job.stop_token_ids), ignore_eos=job.ignore_eos,
        include_stop_str_in_output=job.include_stop_str_in_output, logprobs=job.logprobs,
        guided=guided_decoding(job.response_format) if job.response_format is not None else None,
    )
    messages = [{"role": m.role, "content": m.content} for m in job.messages] if job.messages else None
    return EngineRequest(job.request_id, prompt=job.prompt, messages=messages, prompt_token_ids=job.prompt_token_ids,
                         params=params, priority=job.priority, deadline_ms=job.deadline_ms, model=job.model)


def guided_decoding(response_format: ResponseFormat) -> GuidedDecoding:
    """The job's `response_format` as the engine's spec. The schema's JSON keeps its key order (the output's
    properties follow it) and is the grammar cache's key: the same schema sent again compiles once."""
    if isinstance(response_format, JsonSchemaFormat):
        return GuidedDecoding("json_schema", json.dumps(response_format.json_schema.schema, separators=(",", ":")))
    if isinstance(response_format, JsonObjectFormat):
        return GuidedDecoding("json_object")
    if isinstance(response_format, RegexFormat):
        return GuidedDecoding("regex", response_format.pattern)
    if isinstance(response_format, ChoiceFormat):
        return GuidedDecoding("choice", json.dumps(response_format.choices))
    raise TypeError(f"unknown response_format {type(response_format).__name__}")
