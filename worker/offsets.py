"""Which Kafka offsets may be committed: per partition, the contiguous watermark of finished records.

Jobs finish out of order (a short job read after a long one ends first), but a Kafka commit says "every
record below this offset is done". So per partition we keep the offsets still in flight and commit up to
the lowest of them (Kafka's +1 convention: the committed offset is the next record to read). A record
counts as finished only once its terminal event is safely in Redis (or it went to the DLQ).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field


@dataclass(slots=True)
class _PartitionOffsets:
    pending: set[int] = field(default_factory=set)  # offsets in flight
    heap: list[int] = field(default_factory=list)  # min-heap over pending, finished ones removed lazily
    next_offset: int | None = None  # highest offset seen + 1
    committed: int | None = None  # last offset we committed (or learned was committed)


class OffsetTracker:
    """Not thread-safe: used from the asyncio loop only. Keys are opaque partition ids (TopicPartition)."""

    def __init__(self) -> None:
        self._parts: dict[object, _PartitionOffsets] = {}

    def track(self, partition: object, offset: int) -> None:
        """A record was read and is now in flight."""
        part = self._parts.setdefault(partition, _PartitionOffsets())
        # A re-read of an offset already in flight (a seek after a failed commit) changes nothing.
        if offset not in part.pending:
            part.pending.add(offset)
            heapq.heappush(part.heap, offset)
        part.next_offset = max(part.next_offset or 0, offset + 1)

    def finish(self, partition: object, offset: int) -> None:
        """The record's outcome is safely stored. Unknown partitions (revoked meanwhile) are ignored."""
        part = self._parts.get(partition)
        if part is None:
            return
        part.pending.discard(offset)
        while part.heap and part.heap[0] not in part.pending:
            heapq.heappop(part.heap)

    def watermark(self, partition: object) -> int | None:
        """The offset to commit: the lowest offset in flight, or one past the highest seen when none is."""
        part = self._parts.get(partition)
        if part is None or part.next_offset is None:
            return None
        return part.heap[0] if part.heap else part.next_offset

    def to_commit(self) -> dict[object, int]:
        """Partitions whose watermark moved past the last commit, with the offset to commit."""
        out = {}
        for partition, part in self._parts.items():
            mark = self.watermark(partition)
            if mark is not None and (part.committed is None or mark > part.committed):
                out[partition] = mark
        return out

    def mark_committed(self, partition: object, offset: int) -> None:
        part = self._parts.get(partition)
        if part is not None and (part.committed is None or offset > part.committed):
            part.committed = offset

    def in_flight_count(self, partition: object | None = None) -> int:
        parts = [self._parts.get(partition)] if partition is not None else list(self._parts.values())
        return sum(len(p.pending) for p in parts if p is not None)

    def forget(self, partition: object) -> None:
        """The partition was revoked: its records are someone else's now."""
        self._parts.pop(partition, None)

    def partitions(self) -> list[object]:
        return list(self._parts)
