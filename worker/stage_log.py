"""The latest jobs' start stages one by one: what the stage histogram (stoker_job_stage_seconds) averages away.

A bench that compares W1's TTFT through the queue with the engine alone needs, per request, how long the engine
itself took inside the worker (engine_added -> first_output) to take it off that request's TTFT: the rest is
the queue's own share. Means of the histogram's stages mix requests whose engine time spreads over 2x, so the
share of one run could not be told from the engine's noise. Bounded (the oldest job is dropped first) and
touched only on the loop thread, like the histograms. Served as JSON at the health server's /stages.
"""

from __future__ import annotations

from collections import OrderedDict


class StageLog:
    def __init__(self, capacity: int = 256) -> None:
        if capacity < 1:
            raise ValueError(f"StageLog capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self._jobs: OrderedDict[str, dict[str, float]] = OrderedDict()

    def note(self, request_id: str, stage: str, ms_from_record: float) -> None:
        """A stage of request_id's start, ms after its Kafka record's timestamp (a retried job keeps its first
        value of each stage: the figure of the attempt that started it)."""
        stages = self._jobs.get(request_id)
        if stages is None:
            stages = self._jobs[request_id] = {}
            while len(self._jobs) > self.capacity:
                self._jobs.popitem(last=False)
        stages.setdefault(stage, round(ms_from_record, 3))

    def snapshot(self) -> list[dict[str, object]]:
        """Oldest first: [{"request_id": ..., "<stage>": ms, ...}, ...]."""
        return [{"request_id": rid, **stages} for rid, stages in self._jobs.items()]
