"""Stoker's wire contract (see CONTRACT.md): msgspec Structs, codecs and names. Needs msgspec and nothing else
of ours, so producers and subscribers in Python install it without torch."""

from .codec import (
    DEFAULT_MAX_MESSAGE_BYTES,
    content_type_for,
    content_type_of,
    decode_cancel,
    decode_event,
    decode_job,
    encode,
    encode_cancel,
    encode_event,
    encode_job,
    is_msgpack,
)
from .errors import ContractError, ErrorCode
from .messages import (
    CONTRACT_VERSION,
    MAX_LOGPROBS,
    MAX_STOP_STRINGS,
    Cancel,
    ChatMessage,
    Chunk,
    Done,
    Error,
    Event,
    FinishReason,
    Inbound,
    Job,
    Role,
    Terminal,
    Timings,
    TokenLogprob,
    TopLogprob,
    Usage,
)
from .names import (
    CONTENT_TYPE_HEADER,
    DEFAULT_MAX_ATTEMPTS,
    DEFAULT_TTL_S,
    DLQ_ATTEMPTS,
    DLQ_ERROR_CODE,
    DLQ_ERROR_MESSAGE,
    DLQ_FAILED_AT,
    DLQ_HEADERS,
    DLQ_WORKER,
    JOBS_TOPIC,
    JSON_CONTENT_TYPE,
    MSGPACK_CONTENT_TYPE,
    REDIS_PREFIX,
    STREAM_FIELD,
    Names,
    dlq_headers,
    is_valid_request_id,
)

__all__ = [
    "CONTENT_TYPE_HEADER", "CONTRACT_VERSION", "DEFAULT_MAX_ATTEMPTS", "DEFAULT_MAX_MESSAGE_BYTES", "DEFAULT_TTL_S",
    "DLQ_ATTEMPTS", "DLQ_ERROR_CODE", "DLQ_ERROR_MESSAGE", "DLQ_FAILED_AT", "DLQ_HEADERS", "DLQ_WORKER",
    "JOBS_TOPIC", "JSON_CONTENT_TYPE", "MAX_LOGPROBS", "MAX_STOP_STRINGS", "MSGPACK_CONTENT_TYPE", "REDIS_PREFIX",
    "STREAM_FIELD", "Cancel", "ChatMessage", "Chunk", "ContractError", "Done", "Error", "ErrorCode", "Event",
    "FinishReason", "Inbound", "Job", "Names", "Role", "Terminal", "Timings", "TokenLogprob", "TopLogprob", "Usage",
    "content_type_for", "content_type_of", "decode_cancel", "decode_event", "decode_job", "dlq_headers", "encode",
    "encode_cancel", "encode_event", "encode_job", "is_msgpack", "is_valid_request_id",
]
