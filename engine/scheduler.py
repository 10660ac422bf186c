"""Continuous-batching scheduler (pure Python, no torch).

INTERFACE FIXED BY THE LEAD; the bodies are being written (see the helper brief). Other parts of the
engine rely on exactly these names and meanings.

One engine step, as the engine drives it:
    out = scheduler.schedule()          # drop aborted/expired, admit, chunk prefills, preempt if dry
    result = model_runner.execute(out)  # forward every chunk, sample where chunk.samples
    scheduler.postprocess(out)          # num_computed_tokens += num_tokens; register full blocks
    for each sampled chunk: seq.output_token_ids.append(token); if it must stop: scheduler.finish(seq, r)
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from engine.sequence import FinishReason, Sequence


@dataclass(slots=True)
class SchedulerConfig:
    num_blocks: int  # KV blocks in the pool
    block_size: int = 16  # tokens per block
    max_num_seqs: int = 256  # running sequences at most
    max_num_batched_tokens: int = 8192  # tokens computed in one step (decodes count 1 each)
    enable_prefix_caching: bool = True

    def __post_init__(self) -> None:
        if self.num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {self.num_blocks}")
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")


@dataclass(slots=True)
class ScheduledChunk:
    """Run tokens seq.all_token_ids[start : start + num_tokens] at positions start.. this step."""

    seq: Sequence
    start: int  # == seq.num_computed_tokens when scheduled
    num_tokens: int

    @property
    def samples(self) -> bool:
        """True when the chunk reaches the sequence's last token, so its last logits give the next token."""
        return self.start + self.num_tokens == self.seq.num_tokens


@dataclass(slots=True)
class SchedulerOutput:
    # Decodes first (num_tokens == 1), then prefill chunks; every seq appears at most once.
    chunks: list[ScheduledChunk] = field(default_factory=list)
    # Ended by the scheduler this step without running (aborted -> CANCELLED, past deadline -> DEADLINE):
    # status FINISHED, finish_reason set, blocks already freed.
    ended: list[Sequence] = field(default_factory=list)
    # Running sequences pushed back to waiting this step (blocks freed, num_computed_tokens reset to 0).
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)


class Scheduler:
    def __init__(self, config: SchedulerConfig, clock_ms: Callable[[], float] = lambda: time.time() * 1000):
        raise NotImplementedError

    def add(self, seq: Sequence) -> None:
        """Queue a new sequence (status WAITING). Sets seq.arrival_index."""
        raise NotImplementedError

    def abort(self, request_id: str) -> None:
        """Mark for cancellation; the next schedule() ends it (CANCELLED) and frees its blocks. Unknown ids: no-op."""
        raise NotImplementedError

    def schedule(self) -> SchedulerOutput:
        raise NotImplementedError

    def postprocess(self, out: SchedulerOutput) -> None:
        """After the model ran `out`: advance num_computed_tokens, register newly full blocks in the prefix cache."""
        raise NotImplementedError

    def finish(self, seq: Sequence, reason: FinishReason) -> None:
        """End a running sequence now (stop/length decided by the engine): FINISHED, blocks freed."""
        raise NotImplementedError

    def has_unfinished(self) -> bool:
        raise NotImplementedError

    @property
    def num_waiting(self) -> int:
        raise NotImplementedError

    @property
    def num_running(self) -> int:
        raise NotImplementedError

    @property
    def num_free_blocks(self) -> int:
        """Blocks free or evictable (cached with refcount 0)."""
        raise NotImplementedError

    @property
    def prefix_cache_stats(self) -> tuple[int, int]:
        """(queried prompt tokens, hit tokens) since start."""
        raise NotImplementedError
