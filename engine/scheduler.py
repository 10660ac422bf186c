"""Continuous-batching scheduler (pure Python, no torch).

INTERFACE FIXED BY THE LEAD: other parts of the engine rely on exactly these names and meanings.

One engine step, as the engine drives it:
    out = scheduler.schedule()          # drop aborted/expired, admit, chunk prefills, preempt if dry
    result = model_runner.execute(out)  # forward every chunk, sample where chunk.samples
    scheduler.postprocess(out)          # num_computed_tokens += num_tokens; register full blocks
    for each sampled chunk: seq.output_token_ids.append(token); if it must stop: scheduler.finish(seq, r)

Overlapped steps (the engine's async mode): after launching a step the engine appends PENDING_TOKEN
(seq.num_pending += 1) for each sampled chunk and schedules the next step before the values are known; the
next step decodes that pending token (its input id comes from the device). When the value arrives the engine
writes it in place (num_pending -= 1) and calls tokens_known(seq) so full blocks get hashed. A sequence whose
output already counts max_tokens (its last token in flight) is not scheduled again.
"""

from __future__ import annotations

import time
from bisect import insort
from collections.abc import Callable
from dataclasses import dataclass, field

from engine.block_manager import BlockManager
from engine.sequence import FinishReason, Sequence, SequenceStatus


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
    """Policy, per schedule():
    1. End sequences aborted (CANCELLED) or past their deadline (DEADLINE), waiting or running.
    2. Running sequences, in (priority, arrival) order, get their next token (decode) or prefill chunk
       within the step's token budget. One that cannot get a block preempts the last running sequence
       (lowest priority, latest arrival) until it fits; if it is itself the last, it preempts itself.
       Preempted sequences drop their blocks and are recomputed later (prefix caching makes that cheap).
    3. Only if nothing was preempted: admit waiting sequences in strict (priority, arrival) order, each
       starting from its prefix-cache hit, with a chunk of what the budget leaves. The first that does not
       fit stops admission, so a large request is never overtaken forever by smaller ones behind it.
    A sequence that could never fit in the whole pool is refused by add() with a ValueError (the engine
    should cap max_model_len at num_blocks * block_size so its own check fires first).
    """

    def __init__(self, config: SchedulerConfig, clock_ms: Callable[[], float] = lambda: time.time() * 1000):
        self.config = config
        self.clock_ms = clock_ms
        self.block_manager = BlockManager(config.num_blocks, config.block_size, config.enable_prefix_caching)
        self.waiting: list[Sequence] = []  # sorted by (priority, arrival_index)
        self.running: list[Sequence] = []  # sorted by (priority, arrival_index)
        self._unfinished: dict[str, Sequence] = {}
        self._abort_requested: set[str] = set()
        self._num_deadlines = 0  # unfinished sequences with a deadline (none: schedule() skips the scan)
        self._next_arrival = 0
        self._prefix_queried_tokens = 0
        self._prefix_hit_tokens = 0

    def add(self, seq: Sequence) -> None:
        """Queue a new sequence (status WAITING). Sets seq.arrival_index."""
        if seq.request_id in self._unfinished:
            raise ValueError(f"request_id {seq.request_id!r} is already queued or running")
        if seq.num_prompt_tokens < 1:
            raise ValueError(f"{seq.request_id}: the prompt is empty; at least one token is needed")
        # The last sampled token is never computed, so KV holds at most prompt + max_tokens - 1 positions.
        max_positions = seq.num_prompt_tokens + seq.params.max_tokens - 1
        needed = self.block_manager.blocks_needed(max_positions)
        if needed > self.config.num_blocks:
            raise ValueError(
                f"{seq.request_id}: prompt ({seq.num_prompt_tokens} tokens) + max_tokens "
                f"({seq.params.max_tokens}) needs {needed} KV blocks of {self.config.block_size} tokens, but the "
                f"pool has only {self.config.num_blocks}; shorten the request or enlarge the KV cache"
            )
        seq.arrival_index = self._next_arrival
        self._next_arrival += 1
        seq.status = SequenceStatus.WAITING
        self._unfinished[seq.request_id] = seq
        self._num_deadlines += seq.deadline_ms is not None
        insort(self.waiting, seq, key=_order)

    def abort(self, request_id: str) -> None:
        """Mark for cancellation; the next schedule() ends it (CANCELLED) and frees its blocks. Unknown ids: no-op."""
        if request_id in self._unfinished:
            self._abort_requested.add(request_id)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        self._end_aborted_and_expired(out)
        budget = self._schedule_running(out, self.config.max_num_batched_tokens)
        if not out.preempted:  # admitting right after preempting would just thrash the pool
            self._admit_waiting(out, budget)
        # Decodes first (the model runner relies on it), each group in priority order.
        chunks = out.chunks
        if any(c.num_tokens != 1 for c in chunks):
            out.chunks = [c for c in chunks if c.num_tokens == 1] + [c for c in chunks if c.num_tokens != 1]
        return out

    def _end_aborted_and_expired(self, out: SchedulerOutput) -> None:
        if not self._abort_requested and not self._num_deadlines:
            return  # the common step: nothing to scan
        now = self.clock_ms()
        for seq in [*self.running, *self.waiting]:
            if seq.request_id in self._abort_requested:
                self._end(seq, FinishReason.CANCELLED)
            elif seq.deadline_ms is not None and now >= seq.deadline_ms:
                self._end(seq, FinishReason.DEADLINE)
            else:
                continue
            out.ended.append(seq)

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        index = 0
        while index < len(self.running) and budget > 0:
            seq = self.running[index]
            num_outputs = len(seq.output_token_ids)  # (len() inline: this loop runs per sequence per step)
            if num_outputs >= seq.params.max_tokens:
                # Overlapped steps: its last token is still on the device and ends it (length) whatever its
                # value; computing it would be wasted work. The engine finishes it when the value arrives.
                index += 1
                continue
            num_new = min(len(seq.prompt_token_ids) + num_outputs - seq.num_computed_tokens, budget)
            if num_new <= 0:
                raise RuntimeError(
                    f"{seq.request_id}: running with all {seq.num_tokens} tokens computed; the engine must "
                    "append the sampled token (or finish the sequence) after every sampling chunk"
                )
            while not self.block_manager.allocate_slots(seq, num_new):
                victim = self.running.pop()  # processed sequences are a prefix of the list: never a victim
                self._preempt(victim, out)
                if victim is seq:
                    return budget
            out.chunks.append(ScheduledChunk(seq, seq.num_computed_tokens, num_new))
            budget -= num_new
            index += 1
        return budget

    def _admit_waiting(self, out: SchedulerOutput, budget: int) -> None:
        bm = self.block_manager
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            match = bm.match_prefix(seq)
            num_new = min(seq.num_tokens - match.num_tokens, budget)
            if not bm.allocate_slots(seq, num_new, match):
                if not self.running and not out.chunks and bm.num_free_blocks == bm.num_blocks:
                    # Cannot fit even alone in an empty pool (only if the engine let it outgrow max_tokens):
                    # end it rather than spin forever.
                    self._end(seq, FinishReason.LENGTH)
                    out.ended.append(seq)
                    continue
                break
            self.waiting.pop(0)
            if seq.num_preemptions == 0:  # usage and stats count the first admission, not recomputes
                seq.num_cached_tokens = match.num_tokens
                self._prefix_queried_tokens += seq.num_prompt_tokens if bm.enable_prefix_caching else 0
                self._prefix_hit_tokens += match.num_tokens
            seq.num_computed_tokens = match.num_tokens
            seq.status = SequenceStatus.RUNNING
            insort(self.running, seq, key=_order)
            out.chunks.append(ScheduledChunk(seq, seq.num_computed_tokens, num_new))
            budget -= num_new

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        self.block_manager.free(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        insort(self.waiting, seq, key=_order)  # keeps its arrival_index: resumes first among equals
        out.preempted.append(seq)

    def _end(self, seq: Sequence, reason: FinishReason) -> None:
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        del self._unfinished[seq.request_id]
        self._num_deadlines -= seq.deadline_ms is not None
        self._abort_requested.discard(seq.request_id)

    def postprocess(self, out: SchedulerOutput) -> None:
        """After the model ran `out`: advance num_computed_tokens, register newly full blocks in the prefix cache."""
        for chunk in out.chunks:
            seq = chunk.seq
            if chunk.start != seq.num_computed_tokens or seq.status is not SequenceStatus.RUNNING:
                raise RuntimeError(
                    f"{seq.request_id}: postprocess of a stale chunk (start {chunk.start}, computed "
                    f"{seq.num_computed_tokens}, status {seq.status.value}); call it once per schedule()"
                )
            seq.num_computed_tokens += chunk.num_tokens
            self.block_manager.cache_full_blocks(seq)

    def tokens_known(self, seq: Sequence) -> None:
        """The engine filled in pending tokens of seq: register blocks that became hashable (prefix cache)."""
        if seq.status is SequenceStatus.RUNNING:
            self.block_manager.cache_full_blocks(seq)

    def finish(self, seq: Sequence, reason: FinishReason) -> None:
        """End a running sequence now (stop/length decided by the engine): FINISHED, blocks freed."""
        if self._unfinished.get(seq.request_id) is not seq:
            raise ValueError(f"{seq.request_id}: finish() of a sequence that is not queued or running")
        self._end(seq, reason)

    def has_unfinished(self) -> bool:
        return bool(self._unfinished)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_free_blocks(self) -> int:
        """Blocks free or evictable (cached with refcount 0)."""
        return self.block_manager.num_free_blocks

    @property
    def prefix_cache_stats(self) -> tuple[int, int]:
        """(queried prompt tokens, hit tokens) since start, counted at each request's first admission."""
        return self._prefix_queried_tokens, self._prefix_hit_tokens


def _order(seq: Sequence) -> tuple[int, int]:
    return seq.priority, seq.arrival_index
