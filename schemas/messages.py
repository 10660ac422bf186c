"""The wire messages of /work/shared/CONTRACT.md as msgspec tagged-union Structs (tag field `type`).

Ranges live in `Meta` annotations, so msgspec checks them on decode and they appear in the JSON Schema;
cross-field rules live in `__post_init__`. Structs built in Python get only the cross-field checks on
construction: `codec.encode_job` runs the full decode-side validation before anything is sent.
New fields may only be added with defaults (old messages must keep decoding).
"""

import math
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta
from stoker.schemas.errors import ContractError, ErrorCode
from stoker.schemas.names import is_valid_request_id

CONTRACT_VERSION = 2  # the highest `v` this code understands
BASE_VERSION = 1  # the default `v`: a job needs 2 only when it uses a field of version 2 (response_format)
MAX_RESPONSE_FORMAT_BYTES = 64 * 1024  # `response_format` encoded as compact JSON
MAX_STOP_STRINGS = 16
MAX_LOGPROBS = 20
MAX_TENANT_CHARS = 64
MAX_METADATA_BYTES = 16 * 1024  # `metadata` encoded in the job's own encoding (codec checks it on decode)
_INT64_MAX = 2**63 - 1

# msgspec's pattern check uses re.search, where `$` also matches before a trailing newline; __post_init__
# re-checks with fullmatch. The pattern stays here so the JSON Schema carries it for other languages.
RequestId = Annotated[
    str,
    Meta(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9._:-]+$",
         description="1-128 chars of [A-Za-z0-9._:-]; must be fresh (a UUID is right)"),
]
Penalty = Annotated[float, Meta(ge=-2.0, le=2.0)]
TokenId = Annotated[int, Meta(ge=0)]
Role = Literal["system", "user", "assistant", "tool"]
FinishReason = Literal["stop", "length", "cancelled", "deadline"]


class _Struct(msgspec.Struct, kw_only=True, omit_defaults=True):
    """Common config: keyword-only (required fields may follow defaulted ones), defaults omitted on the wire
    (absent == default). Unknown fields are ignored on decode, as the contract requires."""


class _Message(_Struct, tag_field="type"):
    pass


def _check_request_id(request_id: str) -> None:
    if not is_valid_request_id(request_id):
        raise ContractError(ErrorCode.INVALID_JOB,
                            f"`request_id` must be 1-128 chars of [A-Za-z0-9._:-], got {request_id!r}")


class ChatMessage(_Struct):
    """One chat turn. `tool` is allowed because Llama 3.x chat templates render tool results and OpenAI-style
    gateways forward them; content is plain text (no multimodal parts: the engine is text-only)."""

    role: Role
    content: str


class JsonSchemaSpec(_Struct):
    """OpenAI's `json_schema` object. `strict` is accepted and ignored: the output always follows the schema."""

    schema: dict[str, Any]
    name: Annotated[str, Meta(min_length=1, max_length=64)] | None = None
    strict: bool | None = None


class JsonSchemaFormat(_Message, tag="json_schema"):
    """Output is JSON valid against `json_schema.schema` (compact: no whitespace between tokens)."""

    json_schema: JsonSchemaSpec


class JsonObjectFormat(_Message, tag="json_object"):
    """Output is one JSON object (compact)."""


class RegexFormat(_Message, tag="regex"):
    """Output matches `pattern` as a whole (Rust `regex` syntax: no lookaround, no backreferences)."""

    pattern: Annotated[str, Meta(min_length=1)]


class ChoiceFormat(_Message, tag="choice"):
    """Output is exactly one of `choices`."""

    choices: Annotated[list[str], Meta(min_length=1)]


ResponseFormat = JsonSchemaFormat | JsonObjectFormat | RegexFormat | ChoiceFormat
_compact_json = msgspec.json.Encoder()


class Job(_Message, tag="job"):
    """A generation request, produced to the `stoker.jobs` topic with record key = request_id."""

    request_id: RequestId
    prompt: Annotated[str, Meta(min_length=1)] | None = None
    messages: Annotated[list[ChatMessage], Meta(min_length=1)] | None = None
    prompt_token_ids: Annotated[list[TokenId], Meta(min_length=1)] | None = None
    model: str | None = None  # None: the worker's served model
    max_tokens: Annotated[int, Meta(ge=1)] = 256
    min_tokens: Annotated[int, Meta(ge=0)] = 0
    temperature: Annotated[float, Meta(ge=0.0, description="0 = greedy")] = 1.0
    top_p: Annotated[float, Meta(gt=0.0, le=1.0)] = 1.0
    top_k: Annotated[int, Meta(ge=0, description="0 = off")] = 0
    min_p: Annotated[float, Meta(ge=0.0, le=1.0)] = 0.0
    seed: Annotated[int, Meta(ge=0, le=_INT64_MAX, description="absent = random; < 2^53 for JavaScript")] | None = None
    presence_penalty: Penalty = 0.0
    frequency_penalty: Penalty = 0.0
    repetition_penalty: Annotated[float, Meta(gt=0.0)] = 1.0
    stop: Annotated[list[Annotated[str, Meta(min_length=1)]], Meta(max_length=MAX_STOP_STRINGS)] = []
    stop_token_ids: list[TokenId] = []
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: Annotated[int, Meta(ge=0, le=MAX_LOGPROBS, description="alternatives per token; 0 = none")] = 0
    priority: Annotated[int, Meta(ge=-_INT64_MAX - 1, le=_INT64_MAX, description="lower runs first")] = 0
    deadline_ms: Annotated[int, Meta(ge=0, le=_INT64_MAX, description="Unix epoch ms")] | None = None
    tenant: Annotated[str, Meta(min_length=1, max_length=MAX_TENANT_CHARS,
                                description="opaque label; a metrics label of bounded cardinality")] | None = None
    metadata: Annotated[dict[str, Any], Meta(description=f"opaque object, echoed in `done`; at most "
                                             f"{MAX_METADATA_BYTES} bytes encoded (compact JSON, or MessagePack "
                                             "for a MessagePack job)")] | None = None
    response_format: Annotated[ResponseFormat, Meta(
        description="constrain the output (needs v: 2); at most 64 KiB as compact JSON; a schema or pattern "
                    "that cannot be compiled ends with error `invalid_response_format`; output cut by "
                    "max_tokens ends `length` and may be incomplete")] | None = None
    v: Annotated[int, Meta(ge=1)] = BASE_VERSION

    def __post_init__(self) -> None:
        _check_request_id(self.request_id)
        if self.response_format is not None:
            _check_response_format(self.response_format, self.v)
        given = [name for name in ("prompt", "messages", "prompt_token_ids") if getattr(self, name) is not None]
        if len(given) != 1:
            raise ContractError(ErrorCode.INVALID_JOB, "a job needs exactly one of `prompt`, `messages`, "
                                f"`prompt_token_ids`; got {' and '.join(given) if given else 'none'}")
        if self.min_tokens > self.max_tokens:
            raise ContractError(ErrorCode.INVALID_JOB,
                                f"`min_tokens` ({self.min_tokens}) must be <= `max_tokens` ({self.max_tokens})")
        if not math.isfinite(self.temperature):  # reachable through MessagePack, which carries inf
            raise ContractError(ErrorCode.INVALID_JOB, f"`temperature` must be a finite number >= 0, got {self.temperature}")


def _check_response_format(response_format: ResponseFormat, version: int) -> None:
    if version < 2:
        raise ContractError(ErrorCode.INVALID_JOB, "a job with `response_format` must carry `v: 2` (so that an older "
                            "worker rejects it instead of answering unconstrained)")
    size = len(_compact_json.encode(response_format))
    if size > MAX_RESPONSE_FORMAT_BYTES:
        raise ContractError(ErrorCode.INVALID_JOB, f"`response_format` is {size} bytes as compact JSON; at most "
                            f"{MAX_RESPONSE_FORMAT_BYTES} are allowed: simplify the schema")


class Cancel(_Message, tag="cancel"):
    """Ends a request with finish_reason `cancelled`; published on `stoker:cancel` (and the cancelled key)."""

    request_id: RequestId
    v: Annotated[int, Meta(ge=1)] = BASE_VERSION

    def __post_init__(self) -> None:
        _check_request_id(self.request_id)


class TopLogprob(_Struct):
    token_id: int
    logprob: float
    text: str | None = None  # since 1.1: the token decoded alone (a partial character shows as U+FFFD)


class TokenLogprob(_Struct):
    """Log-probability of one sampled token and the top alternatives, before temperature and penalties."""

    token_id: int
    logprob: float
    top: list[TopLogprob]
    text: str | None = None  # since 1.1: the token decoded alone, so a consumer without the tokenizer can render it


class Usage(_Struct):
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int


class Timings(_Struct):
    queue_ms: float  # Kafka record timestamp -> first engine step; may be skewed by the producer's clock
    ttft_ms: float
    total_ms: float


class _Event(_Message):
    """Every event: `attempt` rises only when another worker takes over; `seq` runs 0,1,2... per attempt."""

    request_id: RequestId
    attempt: Annotated[int, Meta(ge=1)]
    seq: Annotated[int, Meta(ge=0)]


class Chunk(_Event, tag="chunk"):
    """New text since the last chunk (may be empty while text is held back) and the tokens behind it."""

    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None = None  # one entry per token, when the job asked for them


class Done(_Event, tag="done"):
    """Terminal success event; `text` is the whole completion and is authoritative."""

    finish_reason: FinishReason
    text: str
    usage: Usage
    timings: Timings
    model: str
    worker: str
    tenant: str | None = None
    metadata: dict[str, Any] | None = None


class Error(_Event, tag="error"):
    """Terminal failure event; `code` is a stable snake_case ErrorCode (kept a str so newer codes decode)."""

    code: str
    message: str


Inbound = Job | Cancel
Event = Chunk | Done | Error
Terminal = Done | Error
