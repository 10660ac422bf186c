"""Encoders and decoders for the wire contract, built once and reused.

Inbound messages (job, cancel) decode in two passes: bytes -> plain objects, then -> Struct. The first pass
lets us enforce the size limit, reject a newer `v` before judging fields it may have changed, read a valid
`request_id` for the error event, and treat `null` as absent, which msgspec's typed decoding cannot do for
fields with non-None defaults. Events come from our own workers and decode in one typed pass.
"""

from collections.abc import Callable, Iterable
from typing import Any, TypeVar

import msgspec
from stoker.schemas.errors import ContractError, ErrorCode
from stoker.schemas.messages import CONTRACT_VERSION, MAX_METADATA_BYTES, Cancel, Event, Job
from stoker.schemas.names import (
    CONTENT_TYPE_HEADER,
    JSON_CONTENT_TYPE,
    MSGPACK_CONTENT_TYPE,
    is_valid_request_id,
)

DEFAULT_MAX_MESSAGE_BYTES = 1 << 20  # 1 MiB, the contract's default limit on a whole encoded job
_MSGPACK_ALIASES = frozenset({MSGPACK_CONTENT_TYPE, "application/x-msgpack", "application/vnd.msgpack"})

_json_encoder = msgspec.json.Encoder()
_msgpack_encoder = msgspec.msgpack.Encoder()
_json_any = msgspec.json.Decoder()
_msgpack_any = msgspec.msgpack.Decoder()
_json_event = msgspec.json.Decoder(Event)
_msgpack_event = msgspec.msgpack.Decoder(Event)

_T = TypeVar("_T", Job, Cancel)
Buffer = bytes | bytearray | memoryview


def is_msgpack(content_type: str | bytes | None) -> bool:
    """Whether a `content-type` header value selects MessagePack; absent or application/json select JSON."""
    if content_type is None:
        return False
    text = content_type.decode("latin-1") if isinstance(content_type, bytes) else content_type
    media = text.split(";", 1)[0].strip().lower()  # tolerate parameters such as "; charset=utf-8"
    if media in ("", JSON_CONTENT_TYPE):
        return False
    if media in _MSGPACK_ALIASES:
        return True
    raise ContractError(ErrorCode.UNSUPPORTED_CONTENT_TYPE, f"content-type {text!r} is not supported; "
                        f"send {JSON_CONTENT_TYPE} (the default) or {MSGPACK_CONTENT_TYPE}")


def content_type_of(headers: Iterable[tuple[str, bytes | None]] | None) -> bytes | None:
    """The `content-type` value among Kafka record headers (name matched case-insensitively), or None."""
    for name, value in headers or ():
        if name.lower() == CONTENT_TYPE_HEADER:
            return value
    return None


def content_type_for(msgpack: bool) -> str:
    return MSGPACK_CONTENT_TYPE if msgpack else JSON_CONTENT_TYPE


def _looks_like_msgpack(data: Buffer) -> bool:
    # A JSON object starts with '{' or whitespace; a MessagePack map starts with 0x80-0x8f, 0xde or 0xdf.
    first = bytes(data[:1])
    return bool(first) and (0x80 <= first[0] <= 0x8F or first[0] in (0xDE, 0xDF))


def _type_name(value: object) -> str:
    return {dict: "object", list: "array", str: "string", bool: "boolean", int: "integer", float: "number",
            type(None): "null"}.get(type(value), type(value).__name__)


def _without_nulls(raw: dict[Any, Any]) -> dict[Any, Any]:
    """`null` means absent: drop it at the Struct levels (job fields, chat messages), not inside `metadata`."""
    clean = {key: value for key, value in raw.items() if value is not None}
    if isinstance(messages := clean.get("messages"), list):
        clean["messages"] = [{k: v for k, v in m.items() if v is not None} if isinstance(m, dict) else m
                             for m in messages]
    return clean


def _decode_inbound(data: Buffer | None, content_type: str | bytes | None, max_bytes: int, kind: type[_T]) -> _T:
    tag = kind.__struct_config__.tag
    bad = ErrorCode.INVALID_JOB if kind is Job else ErrorCode.INVALID_CANCEL
    if not data:
        raise ContractError(bad, f"the {tag} body is empty (a Kafka tombstone or an empty message)")
    if len(data) > max_bytes:  # checked before parsing so an oversized body costs nothing
        raise ContractError(ErrorCode.MESSAGE_TOO_LARGE,
                            f"the {tag} is {len(data)} bytes; the limit is {max_bytes} bytes")
    msgpack = is_msgpack(content_type)
    try:
        raw = (_msgpack_any if msgpack else _json_any).decode(data)
    except (msgspec.DecodeError, RecursionError) as exc:
        hint = (f" (MessagePack bodies need the header {CONTENT_TYPE_HEADER}: {MSGPACK_CONTENT_TYPE})"
                if not msgpack and _looks_like_msgpack(data) else "")
        raise ContractError(bad, f"the {tag} is not valid {'MessagePack' if msgpack else 'JSON'}: {exc}{hint}") from None
    if not isinstance(raw, dict):
        raise ContractError(bad, f"a {tag} must be an object (map), got {_type_name(raw)}")
    request_id = raw.get("request_id") if is_valid_request_id(raw.get("request_id")) else None
    version = raw.get("v")
    if type(version) is int and version > CONTRACT_VERSION:  # type(): a bool is not a version
        raise ContractError(ErrorCode.UNSUPPORTED_VERSION, f"contract version v={version} is newer than this "
                            f"code understands (v <= {CONTRACT_VERSION}); upgrade the worker or send v={CONTRACT_VERSION}",
                            request_id)
    if raw.get("type") != tag:
        raise ContractError(bad, f"field `type` must be {tag!r} here, got {raw.get('type')!r}", request_id)
    try:
        message = msgspec.convert(_without_nulls(raw), kind)
    except msgspec.ValidationError as exc:
        # Cross-field rules raise ContractError inside __post_init__; msgspec wraps it but keeps the cause.
        reason = exc.__cause__.message if isinstance(exc.__cause__, ContractError) else str(exc)
        raise ContractError(bad, f"{tag} rejected: {reason}", request_id) from None
    if isinstance(message, Job) and message.metadata is not None:
        # Measured re-encoded (compact JSON, or MessagePack), so a producer's whitespace does not count. It is
        # echoed in `done` on the channel, the stream and the result key: every byte is held per request.
        size = len((_msgpack_encoder if msgpack else _json_encoder).encode(message.metadata))
        if size > MAX_METADATA_BYTES:
            raise ContractError(bad, f"{tag} rejected: `metadata` is {size} bytes encoded; the limit is "
                                f"{MAX_METADATA_BYTES} bytes (16 KiB): keep large data elsewhere and send a "
                                "reference", request_id)
    return message


def decode_job(data: Buffer | None, content_type: str | bytes | None = None, *,
               max_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> Job:
    """Decode a Kafka job record value; `content_type` is its content-type header (None: JSON).
    Raises ContractError (invalid_job, unsupported_version, message_too_large, unsupported_content_type)."""
    return _decode_inbound(data, content_type, max_bytes, Job)


def decode_cancel(data: Buffer | None, content_type: str | bytes | None = None, *,
                  max_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> Cancel:
    """Decode a cancel message. Pub/sub carries no headers, so with content_type None the encoding is sniffed."""
    if content_type is None and data and _looks_like_msgpack(data):
        content_type = MSGPACK_CONTENT_TYPE
    return _decode_inbound(data, content_type, max_bytes, Cancel)


def decode_event(data: Buffer, msgpack: bool | None = None) -> Event:
    """Decode an event from the channel, the stream or the result key; msgpack None sniffs the encoding."""
    use_msgpack = _looks_like_msgpack(data) if msgpack is None else msgpack
    try:
        return (_msgpack_event if use_msgpack else _json_event).decode(data)
    except (msgspec.DecodeError, RecursionError) as exc:  # ValidationError is a DecodeError
        raise ContractError(ErrorCode.INVALID_EVENT, f"event rejected: {exc}") from None


def encode(message: msgspec.Struct, msgpack: bool = False) -> bytes:
    """Encode any contract message as it travels on the wire (defaults omitted: absent == default)."""
    return (_msgpack_encoder if msgpack else _json_encoder).encode(message)


def encode_event(event: Event, msgpack: bool = False) -> bytes:
    return encode(event, msgpack)


def event_encoder(msgpack: bool = False) -> Callable[[Event], bytes]:
    """encode_event's own encoder (the same bytes), for a caller that encodes an event per token (the worker):
    two Python calls fewer per event."""
    return (_msgpack_encoder if msgpack else _json_encoder).encode


def _encode_checked(message: Job | Cancel, msgpack: bool, max_bytes: int) -> bytes:
    # Run the consumer's own decoding on the bytes, so a producer sees the error the worker would send.
    bad = ErrorCode.INVALID_JOB if isinstance(message, Job) else ErrorCode.INVALID_CANCEL
    try:
        data = encode(message, msgpack)
    except (TypeError, OverflowError, msgspec.EncodeError) as exc:  # e.g. an int beyond 64 bits, a set in metadata
        raise ContractError(bad, f"cannot encode: {exc}", message.request_id) from None
    if isinstance(message, Job):
        _decode_inbound(data, content_type_for(msgpack), max_bytes, Job)
    else:
        _decode_inbound(data, content_type_for(msgpack), max_bytes, Cancel)
    return data


def encode_job(job: Job, msgpack: bool = False, *, max_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> bytes:
    """Validate a Job fully (ranges, size, version) and encode it; send with `content_type_for(msgpack)`."""
    return _encode_checked(job, msgpack, max_bytes)


def encode_cancel(cancel: Cancel, msgpack: bool = False) -> bytes:
    return _encode_checked(cancel, msgpack, DEFAULT_MAX_MESSAGE_BYTES)
