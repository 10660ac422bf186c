"""What the worker sends to the dead-letter topic for a record it cannot run (pure: the service sends it).

A dead letter is the original record (key, value, headers) plus `stoker-error-*` headers (code, message,
time, worker, attempts). A record too large to forward with our headers, or refused by the client outright,
is sent again smaller, form by form: the key and headers with a short stub value, then the stub and our
headers alone, then without the key too. The error message of a smaller form says what was left out.
"""

from __future__ import annotations

from dataclasses import dataclass

from stoker.schemas import dlq_headers

Headers = list[tuple[str, bytes]]
MAX_MESSAGE_CHARS = 1000  # of the error message in the header of a whole record
MAX_NOTE_MESSAGE_CHARS = 800  # of the message a smaller form's note starts with


@dataclass(frozen=True, slots=True)
class Form:
    """One shape of the dead letter: the record's key, value and headers as sent, and what was dropped
    ("" for the whole record)."""

    key: bytes | None
    value: bytes | None
    headers: Headers
    dropped: str


def stub(value_bytes: int) -> bytes:
    return f"stoker: the dead-lettered record's value ({value_bytes} bytes) is left out".encode()


@dataclass(frozen=True, slots=True)
class DeadLetter:
    """One rejected record and why; `forms` in the order they are tried."""

    key: bytes | None
    value: bytes | None
    headers: Headers
    code: str
    message: str
    attempts: int
    worker: str
    error_headers: Headers  # ours for the whole record, stamped once, when the record was rejected

    @classmethod
    def of(cls, key: bytes | None, value: bytes | None, headers: Headers, *, code: str, message: str,
           attempts: int, worker: str, now_ms: int) -> DeadLetter:
        return cls(key, value, list(headers), code, message, attempts, worker,
                   dlq_headers(code, message[:MAX_MESSAGE_CHARS], now_ms, worker, attempts))

    @property
    def value_bytes(self) -> int:
        return len(self.value or b"")

    @property
    def forms(self) -> list[Form]:
        small = stub(self.value_bytes)
        forms = [
            Form(self.key, self.value, list(self.headers), ""),
            Form(self.key, small, list(self.headers), "value"),
            Form(self.key, small, [], "value and headers"),
            Form(None, small, [], "key, value and headers"),
        ]
        if self.value is None:  # nothing to stub: keep what came (a record may lack a value, not both)
            forms[0] = Form(self.key, self.value if self.key is not None else small, list(self.headers), "")
        return forms

    def note(self, form: Form) -> str:
        """The error message a form carries: the original one, or for a smaller form what was left out."""
        if not form.dropped:
            return self.message
        return (f"{self.message[:MAX_NOTE_MESSAGE_CHARS]}; the record's {form.dropped} made the dead letter too "
                f"large to send and are left out (value {self.value_bytes} bytes, key {len(self.key or b'')} bytes)")

    def record(self, form: Form, now_ms: int) -> tuple[bytes | None, bytes | None, Headers]:
        """(key, value, headers) to send for `form`: the whole record carries the headers stamped at
        rejection; a smaller form gets fresh ones whose message says what was left out."""
        ours = self.error_headers if not form.dropped else dlq_headers(self.code, self.note(form), now_ms,
                                                                        self.worker, self.attempts)
        return form.key, form.value, form.headers + ours
