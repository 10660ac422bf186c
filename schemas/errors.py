"""The one exception every contract violation raises, and the stable error codes of the wire contract."""

from enum import StrEnum


class ErrorCode(StrEnum):
    """Stable snake_case codes carried by `error` events and DLQ headers. Never rename one: clients match on them."""

    INVALID_JOB = "invalid_job"
    INVALID_CANCEL = "invalid_cancel"
    INVALID_EVENT = "invalid_event"
    UNSUPPORTED_VERSION = "unsupported_version"
    UNSUPPORTED_CONTENT_TYPE = "unsupported_content_type"
    MESSAGE_TOO_LARGE = "message_too_large"
    # Raised by the worker, not by schemas (they need the model), listed here so every part shares one spelling.
    UNKNOWN_MODEL = "unknown_model"
    CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"
    INVALID_RESPONSE_FORMAT = "invalid_response_format"  # the grammar compiler rejected the schema or pattern
    POISON_JOB = "poison_job"
    INTERNAL = "internal"


class ContractError(ValueError):
    """A message broke the wire contract. `request_id` is set when the body was readable far enough to hold a
    valid one, so the worker can send that requester an `error` event; otherwise it is None (the worker may
    fall back to the Kafka record key)."""

    def __init__(self, code: str, message: str, request_id: str | None = None) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message
        self.request_id = request_id

    def __reduce__(self):  # keep code/message/request_id across pickling (multiprocessing, logging handlers)
        return (type(self), (self.code, self.message, self.request_id))
