"""A batch's state (stored as JSON on the storage path) and the moves between its statuses. Pure: no I/O.

    validating -> in_progress -> finalizing -> completed | expired
         |             |
         +-> failed    +-> cancelling -> cancelled      (validating may be cancelled too)

`failed` is for a batch that cannot start (its input file is gone); bad lines do not fail a batch, they
become error lines. `expired` is a batch whose completion window ended with lines unanswered (those are
error lines with code batch_expired); `cancelled` one whose remaining lines were stopped (batch_cancelled).
"""

from __future__ import annotations

from typing import Any

import msgspec

TERMINAL = frozenset({"completed", "expired", "cancelled", "failed"})
MOVES: dict[str, frozenset[str]] = {
    "validating": frozenset({"in_progress", "failed", "cancelling"}),
    "in_progress": frozenset({"finalizing", "cancelling"}),
    "cancelling": frozenset({"cancelled"}),
    "finalizing": frozenset({"completed", "expired"}),
}


class IllegalMove(ValueError):
    """A status change the Batch API does not have (a bug of ours, never the caller's)."""


class BatchState(msgspec.Struct, kw_only=True):
    id: str
    input_file_id: str
    endpoint: str
    completion_window: str
    created_at: int  # Unix seconds
    deadline_ms: int  # created_at + the window: every job's deadline_ms
    output_expires_s: int  # the output and error files live this long after they are written
    metadata: dict[str, str] | None = None
    status: str = "validating"
    at: dict[str, int] = msgspec.field(default_factory=dict)  # status -> Unix seconds it was entered
    total: int = 0
    completed: int = 0
    failed: int = 0
    produced_through: int = 0  # every job of a line <= this has been acknowledged by Kafka (lines go in order)
    input_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    output_file_id: str | None = None
    error_file_id: str | None = None
    errors: list[dict[str, Any]] = msgspec.field(default_factory=list)  # why a batch failed (OpenAI's shape)

    @property
    def terminal(self) -> bool:
        return self.status in TERMINAL

    def move(self, to: str, now_s: int) -> None:
        if to not in MOVES.get(self.status, frozenset()):
            raise IllegalMove(f"batch {self.id}: no move from {self.status!r} to {to!r}")
        self.status = to
        self.at[to] = now_s

    def count(self, ok: bool, prompt_tokens: int = 0, completion_tokens: int = 0, cached_tokens: int = 0) -> None:
        """One line answered (ok: in the output file; else in the error file)."""
        if ok:
            self.completed += 1
        else:
            self.failed += 1
        self.input_tokens += prompt_tokens
        self.output_tokens += completion_tokens
        self.cached_tokens += cached_tokens

    @property
    def answered(self) -> int:
        return self.completed + self.failed

    def public(self) -> dict[str, Any]:
        """OpenAI's batch object."""
        def when(status: str) -> int | None:
            return self.at.get(status)

        return {
            "id": self.id, "object": "batch", "endpoint": self.endpoint, "errors": (
                {"object": "list", "data": self.errors} if self.errors else None),
            "input_file_id": self.input_file_id, "completion_window": self.completion_window,
            "status": self.status, "output_file_id": self.output_file_id, "error_file_id": self.error_file_id,
            "created_at": self.created_at, "in_progress_at": when("in_progress"),
            "expires_at": self.deadline_ms // 1000, "finalizing_at": when("finalizing"),
            "completed_at": when("completed"), "failed_at": when("failed"), "expired_at": when("expired"),
            "cancelling_at": when("cancelling"), "cancelled_at": when("cancelled"),
            "request_counts": {"total": self.total, "completed": self.completed, "failed": self.failed},
            "metadata": self.metadata,
            "usage": {"input_tokens": self.input_tokens, "input_tokens_details": {"cached_tokens": self.cached_tokens},
                      "output_tokens": self.output_tokens, "output_tokens_details": {"reasoning_tokens": 0},
                      "total_tokens": self.input_tokens + self.output_tokens},
        }


_decoder = msgspec.json.Decoder(BatchState)


def encode_state(state: BatchState) -> bytes:
    return msgspec.json.encode(state)


def decode_state(data: bytes) -> BatchState:
    return _decoder.decode(data)
