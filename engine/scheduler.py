"""Continuous-batching scheduler (pure Python, no torch): it owns every request's life.

One engine step, as the engine drives it:
    out = scheduler.schedule()               # drop aborted/expired, admit, chunk prefills, preempt if dry
    (the model runner launches out: forward every chunk, sample where chunk.samples)
    scheduler.update_from_launch(out)        # num_computed_tokens += num_tokens; full blocks cached; a
                                             # placeholder (PENDING_TOKEN) for each token being sampled
    ... later, when the sampled values reach the host:
    finished = scheduler.update_from_output([SampledToken(seq, token_id, stop_string_hit), ...])
                                             # fill placeholders, apply the stop rule, free the finished

The stop rule (update_from_output): STOP on a stop string (found by the engine's output processor) or,
once min_tokens are out, on one of seq.stop_token_ids; LENGTH at max_tokens or the end of the context.
Sequences also end in schedule() (CANCELLED, DEADLINE) and by finish() (the engine failed one alone).
However a sequence ends, its blocks are freed and a token still in flight is dropped; the engine learns of
it from out.ended, update_from_output's result, or its own finish() call, and forgets it then.

Overlapped steps (the engine's async mode): the next step is scheduled before the last one's values are
known; it decodes the pending token (its input id comes from the device). A sequence whose output already
counts max_tokens (its last token in flight) is not scheduled again.
"""

from __future__ import annotations

import time
from bisect import insort
from collections.abc import Callable
from dataclasses import dataclass, field

from stoker.engine.block_manager import BlockManager
from stoker.engine.sequence import FinishReason, Sequence, SequenceStatus


@dataclass(slots=True)
class SchedulerConfig:
    num_blocks: int  # KV blocks in the pool
    block_size: int = 16  # tokens per block
    max_num_seqs: int = 256  # running sequences at most
    max_num_batched_tokens: int = 8192  # tokens computed in one step (decodes count 1 each)
    enable_prefix_caching: bool = True
    max_model_len: int | None = None  # prompt + output tokens at most (LENGTH there); None = no cap

    def __post_init__(self) -> None:
        if self.num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {self.num_blocks}")
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1 or None, got {self.max_model_len}")


@dataclass(slots=True)
class ScheduledChunk:
    """Run tokens seq.all_token_ids[start : start + num_tokens] at positions start.. this step."""

    seq: Sequence
    start: int  # == seq.num_computed_tokens when scheduled
    num_tokens: int
    # The chunk reaches the sequence's last token, so its last logits give the next token. Set when scheduled
    # (start + num_tokens == seq.num_tokens then; update_from_launch's placeholder makes seq one longer after):
    # read three times per sequence per step, it was a property over two len() calls each time.
    samples: bool


@dataclass(slots=True)
class SampledToken:
    """A sampled token whose value reached the host, for update_from_output."""

    seq: Sequence
    token_id: int
    stop_string: bool = False  # the output processor found a stop string ending at this token


@dataclass(slots=True)
class SchedulerOutput:
    # Decodes first (num_tokens == 1), then prefill chunks; every seq appears at most once.
    chunks: list[ScheduledChunk] = field(default_factory=list)
    # Ended by the scheduler this step without running (aborted -> CANCELLED, past deadline -> DEADLINE):
    # status FINISHED, finish_reason set, blocks already freed, a token in flight dropped.
    ended: list[Sequence] = field(default_factory=list)
    # Running sequences pushed back to waiting this step (blocks freed, num_computed_tokens reset to 0).
    preempted: list[Sequence] = field(default_factory=list)
    # Chunks that decode (start at or past their prompt's end), counted as they are scheduled: with prompt
    # chunks beside them the forward is a mixed step.
    num_decodes: int = 0
    # Tokens of all chunks, summed as they are scheduled.
    num_batched_tokens: int = 0


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
        if out.num_batched_tokens != len(chunks):  # some chunk has more than one token: a prompt chunk
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
        # This loop runs per sequence per step (1,024 a step in W2): attributes are read once into locals, and
        # the counts are added to `out` at the end.
        running, allocate, chunks = self.running, self.block_manager.allocate_slots, out.chunks
        num_decodes = num_batched = index = 0
        try:
            while index < len(running) and budget > 0:
                seq = running[index]
                num_outputs = len(seq.output_token_ids)
                if num_outputs >= seq.params.max_tokens:
                    # Overlapped steps: its last token is still on the device and ends it (length) whatever its
                    # value; computing it would be wasted work. update_from_output finishes it when the value
                    # arrives.
                    index += 1
                    continue
                computed, num_prompt = seq.num_computed_tokens, len(seq.prompt_token_ids)
                num_new = min(num_prompt + num_outputs - computed, budget)
                if num_new <= 0:
                    raise RuntimeError(
                        f"{seq.request_id}: running with all {seq.num_tokens} tokens computed; call "
                        "update_from_launch after every schedule() (it adds the sampled token's placeholder)"
                    )
                while not allocate(seq, num_new):
                    victim = running.pop()  # processed sequences are a prefix of the list: never a victim
                    self._preempt(victim, out)
                    if victim is seq:
                        return budget
                chunks.append(ScheduledChunk(seq, computed, num_new, computed + num_new == num_prompt + num_outputs))
                num_decodes += computed >= num_prompt
                num_batched += num_new
                budget -= num_new
                index += 1
            return budget
        finally:
            out.num_decodes += num_decodes
            out.num_batched_tokens += num_batched

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
            out.chunks.append(ScheduledChunk(seq, seq.num_computed_tokens, num_new,
                                             seq.num_computed_tokens + num_new == seq.num_tokens))
            out.num_decodes += seq.num_computed_tokens >= len(seq.prompt_token_ids)
            out.num_batched_tokens += num_new
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
        seq.drop_placeholders()
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        del self._unfinished[seq.request_id]
        self._num_deadlines -= seq.deadline_ms is not None
        self._abort_requested.discard(seq.request_id)

    def update_from_launch(self, out: SchedulerOutput) -> None:
        """The model runs `out` (launched; values may still be on the device): advance num_computed_tokens,
        register newly full blocks in the prefix cache, and give each sequence whose chunk samples a
        placeholder for its token."""
        cache = self.block_manager.cache_full_blocks if self.block_manager.enable_prefix_caching else None
        running = SequenceStatus.RUNNING
        for chunk in out.chunks:
            seq = chunk.seq
            if chunk.start != seq.num_computed_tokens or seq.status is not running:
                raise RuntimeError(
                    f"{seq.request_id}: update_from_launch of a stale chunk (start {chunk.start}, computed "
                    f"{seq.num_computed_tokens}, status {seq.status.value}); call it once per schedule()"
                )
            seq.num_computed_tokens += chunk.num_tokens
            if cache is not None:
                cache(seq)
            if chunk.samples:  # (set when scheduled: the placeholder below does not change it)
                seq.add_placeholder()

    def update_from_output(self, sampled: list[SampledToken]) -> list[Sequence]:
        """Sampled values reached the host: fill each sequence's oldest placeholder, apply the stop rule (see
        the module docstring), end the sequences that must stop. -> those ended here (finish_reason set)."""
        finished = []
        max_model_len = self.config.max_model_len
        cache = self.block_manager.cache_full_blocks if self.block_manager.enable_prefix_caching else None
        for item in sampled:
            seq, token_id = item.seq, item.token_id
            if seq.status is SequenceStatus.FINISHED:
                continue  # ended while its token was in flight: the token is discarded
            num_outputs = seq.fill_placeholder(token_id)
            params = seq.params
            reason: FinishReason | None = None
            if item.stop_string or (token_id in seq.stop_token_ids and num_outputs >= params.min_tokens):
                reason = FinishReason.STOP
            elif num_outputs >= params.max_tokens or (
                max_model_len is not None and len(seq.prompt_token_ids) + num_outputs >= max_model_len
            ):
                reason = FinishReason.LENGTH
            if reason is not None:
                self._end(seq, reason)
                finished.append(seq)
            elif cache is not None and seq.status is SequenceStatus.RUNNING:  # blocks holding it may be hashed now
                cache(seq)
        return finished

    def finish(self, seq: Sequence, reason: FinishReason) -> None:
        """End a sequence now (the engine failed it alone): FINISHED, blocks freed, a token in flight dropped."""
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

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix and zero the prefix counters. Only with nothing running or waiting."""
        if self.has_unfinished():
            raise RuntimeError("reset_prefix_cache needs an idle scheduler: requests are still running or waiting")
        self.block_manager.forget_cached()
        self._prefix_queried_tokens = self._prefix_hit_tokens = 0

    @property
    def prefix_cache_stats(self) -> tuple[int, int]:
        """(queried prompt tokens, hit tokens) since start, counted at each request's first admission."""
        return self._prefix_queried_tokens, self._prefix_hit_tokens


def _order(seq: Sequence) -> tuple[int, int]:
    return seq.priority, seq.arrival_index
