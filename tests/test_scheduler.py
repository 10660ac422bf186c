"""Scheduler policy, driven the way the engine drives it, with a fake model and a fake KV cache.

The fake KV cache stores, for each written slot, a key standing for the K/V of that position (a hash of the
sequence's tokens up to it). Before a chunk "runs", every earlier position of the sequence is read back
through its block table and must hold the right key: that catches a wrong prefix hit, a shared block
written by another sequence, and a block handed out twice.
"""

from __future__ import annotations

import random
from collections import Counter

import pytest
from stoker.engine.sampling_params import SamplingParams
from stoker.engine.scheduler import SampledToken, Scheduler, SchedulerConfig, SchedulerOutput
from stoker.engine.sequence import PENDING_TOKEN, FinishReason, Sequence, SequenceStatus


class Clock:
    def __init__(self) -> None:
        self.now_ms = 1_000_000.0

    def __call__(self) -> float:
        return self.now_ms


def prefix_keys(seq: Sequence, upto: int, pending: list[int] | None = None) -> list[int]:
    """Keys of positions < upto; `pending` holds the true values of seq's PENDING_TOKEN tail (overlap mode:
    the model computes with values the host does not know yet)."""
    tokens = seq.all_token_ids
    if seq.num_pending:
        assert pending is not None and len(pending) == seq.num_pending
        tokens[len(tokens) - seq.num_pending :] = pending
    keys, key = [], 0
    for token in tokens[:upto]:
        key = hash((key, token))
        keys.append(key)
    return keys


def fake_token(seq: Sequence) -> int:
    # Deterministic in (request, position): recomputation after preemption yields the same stream.
    return hash((seq.request_id, seq.num_tokens)) % 50


class Harness:
    """The engine loop of engine/scheduler.py's docstring, checking invariants at every step. A "stop" is
    reported as a stop string at output count stop_early[request_id]; the scheduler's own rule does the rest.
    overlap=True drives it as the engine's overlapped steps do: sampled tokens stay PENDING_TOKEN until the
    next step has been scheduled and run, and are then filled in (or dropped when the sequence ended)."""

    def __init__(self, config: SchedulerConfig, clock: Clock | None = None, overlap: bool = False) -> None:
        self.overlap = overlap
        self.hidden: dict[Sequence, list[int]] = {}  # overlap: true values of each sequence's pending tokens
        self.in_flight: list[Sequence] = []  # overlap: sequences sampled by the last step, values unread
        self.config = config
        self.clock = clock or Clock()
        self.scheduler = Scheduler(config, clock_ms=self.clock)
        self.kv: dict[tuple[int, int], int] = {}
        self.seqs: dict[str, Sequence] = {}
        self.stop_early: dict[str, int] = {}  # request_id -> output count at which the "model" emits a stop
        self.prefill_chunks: Counter[str] = Counter()
        self.log: list[tuple[str, int, int, bool]] = []  # (request_id, start, num_tokens, samples) per chunk

    def add(self, request_id: str, prompt: list[int], max_tokens: int = 4, **kwargs: object) -> Sequence:
        seq = Sequence(request_id, prompt, SamplingParams(max_tokens=max_tokens), **kwargs)  # type: ignore[arg-type]
        self.scheduler.add(seq)
        self.seqs[request_id] = seq
        return seq

    def step(self) -> SchedulerOutput:
        out = self.scheduler.schedule()
        self.check(out)
        self.run_model(out)
        samples = [chunk.samples for chunk in out.chunks]  # before update_from_launch adds the placeholders
        tokens = [fake_token(c.seq) if sampled else 0 for c, sampled in zip(out.chunks, samples, strict=True)]
        self.log += [
            (c.seq.request_id, c.start, c.num_tokens, sampled)
            for c, sampled in zip(out.chunks, samples, strict=True)
        ]
        for seq in out.ended:  # the scheduler dropped the token of an ended sequence still in flight
            self.hidden.pop(seq, None)
        self.scheduler.update_from_launch(out)
        launched = []
        for chunk, sampled, token in zip(out.chunks, samples, tokens, strict=True):
            if chunk.num_tokens > 1 or chunk.start < chunk.seq.num_prompt_tokens - 1:
                self.prefill_chunks[chunk.seq.request_id] += 1
            if sampled:
                assert chunk.seq.output_token_ids[-1] == PENDING_TOKEN
                self.hidden.setdefault(chunk.seq, []).append(token)
                launched.append(chunk.seq)
        if self.overlap:  # the previous step's values arrive only now, after this step was scheduled and ran
            arrived, self.in_flight = self.in_flight, launched
        else:
            arrived = launched
        self.deliver(arrived)
        self.check_blocks()
        return out

    def deliver(self, seqs: list[Sequence]) -> None:
        sampled = []
        for seq in seqs:
            if seq.is_finished:
                continue
            token = self.hidden[seq].pop(0)
            stop = seq.num_known_output_tokens + 1 == self.stop_early.get(seq.request_id)
            sampled.append(SampledToken(seq, token, stop_string=stop))
        for seq in self.scheduler.update_from_output(sampled):
            assert seq.is_finished and seq.num_pending == 0
            self.hidden.pop(seq, None)

    def run_until_done(self, max_steps: int = 10_000) -> int:
        for step in range(max_steps):
            if not self.scheduler.has_unfinished():
                return step
            self.step()
        raise AssertionError(f"not finished after {max_steps} steps")

    def run_model(self, out: SchedulerOutput) -> None:
        bs = self.config.block_size
        for chunk in out.chunks:
            seq, end = chunk.seq, chunk.start + chunk.num_tokens
            keys = prefix_keys(seq, end, self.hidden.get(seq))
            for position in range(end):
                slot = (seq.block_table[position // bs], position % bs)
                if position < chunk.start:
                    assert self.kv.get(slot) == keys[position], f"{seq.request_id}: stale K/V at {position}"
                else:
                    self.kv[slot] = keys[position]

    def check(self, out: SchedulerOutput) -> None:
        sched, bs = self.scheduler, self.config.block_size
        assert out.num_batched_tokens <= self.config.max_num_batched_tokens
        # The counts and flags the scheduler records as it schedules equal what they stand for.
        assert out.num_batched_tokens == sum(chunk.num_tokens for chunk in out.chunks)
        assert out.num_decodes == sum(chunk.start >= chunk.seq.num_prompt_tokens for chunk in out.chunks)
        assert [c.samples for c in out.chunks] == [c.start + c.num_tokens == c.seq.num_tokens for c in out.chunks]
        assert sched.num_running <= self.config.max_num_seqs
        scheduled = [chunk.seq for chunk in out.chunks]
        assert len(set(map(id, scheduled))) == len(scheduled), "a sequence scheduled twice"
        sizes = [chunk.num_tokens for chunk in out.chunks]
        assert sizes == sorted(sizes, key=lambda n: n != 1), "decodes must come first"
        for chunk in out.chunks:
            seq = chunk.seq
            assert seq.status is SequenceStatus.RUNNING and chunk.num_tokens >= 1
            assert chunk.start == seq.num_computed_tokens
            assert chunk.start + chunk.num_tokens <= seq.num_tokens
            assert len(seq.block_table) * bs >= chunk.start + chunk.num_tokens
            assert seq.num_output_tokens < seq.params.max_tokens, "scheduled past its last token"
        for seq in out.ended:
            assert seq.is_finished and seq.finish_reason in (FinishReason.CANCELLED, FinishReason.DEADLINE)
        for seq in out.preempted:
            assert seq.status is SequenceStatus.WAITING and seq.num_computed_tokens == 0
        self.check_blocks()

    def check_blocks(self) -> None:
        sched, bm = self.scheduler, self.scheduler.block_manager
        holders: Counter[int] = Counter()
        for seq in self.seqs.values():
            if seq.status is not SequenceStatus.RUNNING:
                assert seq.block_table == [], f"{seq.request_id} holds blocks while {seq.status.value}"
                continue
            assert seq in sched.running
            holders.update(seq.block_table)
        assert sched.num_running + sched.num_waiting == sum(not s.is_finished for s in self.seqs.values())
        for block in bm.blocks:
            assert block.ref_count == holders[block.block_id]
            if block.ref_count > 1:
                assert block.block_hash is not None, "only cached full blocks may be shared"
            assert PENDING_TOKEN not in block.token_ids, "a block hashed before its tokens were known"
        used = sum(block.ref_count > 0 for block in bm.blocks)
        assert used + sched.num_free_blocks == self.config.num_blocks


def test_single_request_prefill_then_decode() -> None:
    h = Harness(SchedulerConfig(num_blocks=8, block_size=4))
    seq = h.add("a", [1, 2, 3, 4, 5], max_tokens=3)
    out = h.step()
    assert [(c.start, c.num_tokens) for c in out.chunks] == [(0, 5)]
    assert [(c.start, c.num_tokens) for c in h.step().chunks] == [(5, 1)]
    h.step()
    assert seq.is_finished and seq.finish_reason is FinishReason.LENGTH and seq.num_output_tokens == 3
    assert h.scheduler.num_free_blocks == 8 and not h.scheduler.has_unfinished()


def test_chunked_prefill_under_a_tiny_budget() -> None:
    h = Harness(SchedulerConfig(num_blocks=32, block_size=4, max_num_batched_tokens=5))
    h.add("long", list(range(23)), max_tokens=2)
    h.run_until_done()
    chunks = [entry[1:] for entry in h.log]
    assert chunks == [
        (0, 5, False),
        (5, 5, False),
        (10, 5, False),
        (15, 5, False),
        (20, 3, True),
        (23, 1, True),
    ]


def test_budget_shared_between_decodes_and_a_new_prefill() -> None:
    h = Harness(SchedulerConfig(num_blocks=32, block_size=4, max_num_batched_tokens=6))
    a = h.add("a", [1, 2, 3], max_tokens=10)
    b = h.add("b", [4, 5, 6], max_tokens=10)
    h.step()  # both prefills fit: 3 + 3
    c = h.add("c", list(range(10)), max_tokens=2)
    out = h.step()
    assert [(ch.seq, ch.num_tokens) for ch in out.chunks] == [(a, 1), (b, 1), (c, 4)]
    out = h.step()
    assert [(ch.seq, ch.num_tokens) for ch in out.chunks] == [(a, 1), (b, 1), (c, 4)]
    out = h.step()  # c's last 2 prompt tokens are a running chunk now; decodes still first
    assert [(ch.seq, ch.num_tokens) for ch in out.chunks] == [(a, 1), (b, 1), (c, 2)]
    h.run_until_done()
    assert all(s.finish_reason is FinishReason.LENGTH for s in (a, b, c))


def test_decodes_come_before_prefill_chunks_whatever_the_priority() -> None:
    h = Harness(SchedulerConfig(num_blocks=32, block_size=4, max_num_batched_tokens=8))
    relaxed = h.add("relaxed", [1, 2], max_tokens=10, priority=5)
    h.step()
    urgent = h.add("urgent", list(range(12)), max_tokens=2, priority=0)
    out = h.step()
    assert [(c.seq, c.num_tokens) for c in out.chunks] == [(relaxed, 1), (urgent, 7)]
    out = h.step()  # urgent is scheduled first (priority) but its prefill chunk is listed after the decode
    assert [(c.seq, c.num_tokens) for c in out.chunks] == [(relaxed, 1), (urgent, 5)]
    h.run_until_done()
    assert urgent.finish_reason is relaxed.finish_reason is FinishReason.LENGTH


def test_higher_priority_prefill_takes_the_budget_first() -> None:
    h = Harness(SchedulerConfig(num_blocks=32, block_size=4, max_num_batched_tokens=8))
    relaxed = h.add("relaxed", [1, 2], max_tokens=10, priority=5)
    h.step()
    urgent = h.add("urgent", list(range(30)), max_tokens=2, priority=0)
    h.step()
    out = h.step()
    assert [(c.seq, c.num_tokens) for c in out.chunks] == [(urgent, 8)]  # relaxed waits a step
    h.run_until_done()
    assert relaxed.num_output_tokens == 10


def test_admission_is_strict_order_a_big_head_is_not_overtaken() -> None:
    h = Harness(SchedulerConfig(num_blocks=4, block_size=2, enable_prefix_caching=False))
    first = h.add("first", [1, 2, 3, 4, 5], max_tokens=2)  # 3 blocks
    h.step()
    big = h.add("big", [6, 7, 8, 9], max_tokens=1)  # 2 blocks: does not fit in the 1 left
    small = h.add("small", [6], max_tokens=1)  # would fit, but must not overtake big
    out = h.step()
    assert [c.seq for c in out.chunks] == [first]
    assert h.scheduler.waiting == [big, small]
    assert first.is_finished
    out = h.step()  # now both fit (the 1-token chunk is listed first: decode-shaped chunks go first)
    assert [c.seq for c in out.chunks] == [small, big]
    h.run_until_done()


def test_priority_then_arrival_order_of_admission() -> None:
    h = Harness(SchedulerConfig(num_blocks=64, block_size=4, max_num_seqs=1))
    for request_id, priority in [("p5-first", 5), ("p1", 1), ("p5-second", 5), ("p0", 0)]:
        h.add(request_id, [1, 2, 3], max_tokens=2, priority=priority)
    order = []
    while h.scheduler.has_unfinished():
        for chunk in h.step().chunks:
            if chunk.start == 0:
                order.append(chunk.seq.request_id)
    assert order == ["p0", "p1", "p5-first", "p5-second"]


def test_max_num_seqs_caps_running() -> None:
    h = Harness(SchedulerConfig(num_blocks=64, block_size=4, max_num_seqs=2))
    seqs = [h.add(f"s{i}", [i, i + 1], max_tokens=3) for i in range(5)]
    out = h.step()
    assert [c.seq for c in out.chunks] == seqs[:2] and h.scheduler.num_waiting == 3
    h.run_until_done()
    assert all(s.num_output_tokens == 3 for s in seqs)


def test_preemption_when_the_pool_runs_dry_then_recompute_completes() -> None:
    # 4 blocks of 2 tokens: two requests of 3-token prompts need 2 blocks each at first, then grow.
    h = Harness(SchedulerConfig(num_blocks=4, block_size=2, enable_prefix_caching=False))
    early = h.add("early", [1, 2, 3], max_tokens=5)
    late = h.add("late", [4, 5, 6], max_tokens=5)
    h.step()  # both prefilled: 4 blocks used
    out = h.step()  # both decode position 3 (fits in their second blocks)
    assert len(out.chunks) == 2 and not out.preempted
    out = h.step()  # position 4 needs a third block each: late is preempted for early
    assert out.preempted == [late] and [c.seq for c in out.chunks] == [early]
    assert late.num_preemptions == 1 and late.block_table == [] and late.num_output_tokens == 2
    h.run_until_done()
    assert early.num_output_tokens == late.num_output_tokens == 5
    assert early.num_preemptions == 0
    # The recompute covered the prompt and the 2 output tokens generated before preemption in one chunk.
    assert h.prefill_chunks["late"] == 2
    assert late.output_token_ids == [hash(("late", n)) % 50 for n in range(3, 8)]


def test_preemption_picks_the_lowest_priority_not_the_latest_admitted() -> None:
    h = Harness(SchedulerConfig(num_blocks=3, block_size=2, enable_prefix_caching=False))
    low = h.add("low", [7], max_tokens=4, priority=9)
    h.step()
    high = h.add("high", [1, 2, 3], max_tokens=4, priority=0)
    h.step()  # low decodes position 1 in its block; high prefilled into 2 blocks
    h.step()  # high decodes position 3; low needs a 2nd block for position 2: nothing free
    assert low.num_preemptions == 1 and high.num_preemptions == 0
    h.run_until_done()
    assert high.num_output_tokens == low.num_output_tokens == 4


def test_running_sequence_preempts_itself_when_it_is_the_lowest() -> None:
    h = Harness(SchedulerConfig(num_blocks=2, block_size=2, enable_prefix_caching=False))
    high = h.add("high", [1], max_tokens=2, priority=0)
    low = h.add("low", [3, 4], max_tokens=3, priority=1)
    h.step()  # one block each
    out = h.step()  # high decodes position 1 (fits); low needs a block for position 2 and is the last
    assert [c.seq for c in out.chunks] == [high] and out.preempted == [low]
    assert high.is_finished
    h.run_until_done()
    assert low.num_output_tokens == 3 and low.num_preemptions == 1


def test_a_sequence_whose_last_token_is_in_flight_is_not_scheduled_again() -> None:
    # Overlapped steps: the engine has not read the value of the max_tokens-th token yet, so the sequence is
    # still running; computing that token would be wasted (and could outgrow the blocks add() allowed for).
    sched = Scheduler(SchedulerConfig(num_blocks=2, block_size=2))
    seq, other = (
        Sequence("last", [1, 2], SamplingParams(max_tokens=2)),
        Sequence("o", [3], SamplingParams(max_tokens=2)),
    )
    sched.add(seq)
    for _ in range(2):
        out = sched.schedule()
        sched.update_from_launch(out)  # adds the placeholder of the token being sampled
    assert seq.num_output_tokens == 2 and seq.status is SequenceStatus.RUNNING and len(seq.block_table) == 2
    sched.add(other)
    for _ in range(3):  # no chunk of `last`, no preemption of it, no spin; `other` waits for a free block
        out = sched.schedule()
        assert out.chunks == [] and out.preempted == [] and out.ended == []
    sched.finish(seq, FinishReason.LENGTH)
    out = sched.schedule()
    assert [c.seq for c in out.chunks] == [other] and sched.num_free_blocks == 1


def test_misuse_of_the_loop_is_a_clear_error() -> None:
    sched = Scheduler(SchedulerConfig(num_blocks=4, block_size=2))
    sched.add(Sequence("a", [1, 2, 3], SamplingParams(max_tokens=3)))
    out = sched.schedule()
    sched.update_from_launch(out)
    with pytest.raises(RuntimeError, match="stale chunk"):
        sched.update_from_launch(out)
    sched.running[0].drop_placeholders()  # as if the launch had not added the sampled token's placeholder
    with pytest.raises(RuntimeError, match="call update_from_launch after every schedule"):
        sched.schedule()


def test_preempted_sequence_resumes_before_later_arrivals_of_equal_priority() -> None:
    h = Harness(SchedulerConfig(num_blocks=4, block_size=2, enable_prefix_caching=False))
    h.add("early", [1, 2, 3], max_tokens=5)
    late = h.add("late", [4, 5, 6], max_tokens=5)
    h.step()
    h.step()
    newcomer = h.add("newcomer", [9], max_tokens=1)
    out = h.step()
    assert out.preempted == [late]
    assert h.scheduler.waiting == [late, newcomer]


def test_abort_waiting_and_running() -> None:
    h = Harness(SchedulerConfig(num_blocks=16, block_size=4, max_num_seqs=1))
    running = h.add("running", list(range(6)), max_tokens=50)
    waiting = h.add("waiting", [1, 2], max_tokens=50)
    h.step()
    assert running.status is SequenceStatus.RUNNING and len(running.block_table) == 2
    h.scheduler.abort("waiting")
    h.scheduler.abort("running")
    h.scheduler.abort("no-such-request")
    out = h.step()
    assert out.ended == [running, waiting] and out.chunks == []
    assert running.finish_reason is waiting.finish_reason is FinishReason.CANCELLED
    assert running.block_table == [] and h.scheduler.num_free_blocks == 16
    assert not h.scheduler.has_unfinished()
    h.scheduler.abort("running")  # already ended: no-op
    assert h.step().ended == []


def test_deadlines_end_waiting_and_running_sequences() -> None:
    clock = Clock()
    h = Harness(SchedulerConfig(num_blocks=16, block_size=4, max_num_seqs=1), clock)
    running = h.add("running", [1, 2, 3], max_tokens=50, deadline_ms=clock.now_ms + 100)
    waiting = h.add("waiting", [4, 5], max_tokens=50, deadline_ms=clock.now_ms + 50)
    relaxed = h.add("relaxed", [6], max_tokens=2, deadline_ms=None)
    h.step()
    clock.now_ms += 49
    assert h.step().ended == []
    clock.now_ms += 1
    out = h.step()
    assert out.ended == [waiting] and waiting.finish_reason is FinishReason.DEADLINE
    clock.now_ms += 50
    out = h.step()
    assert out.ended == [running] and running.finish_reason is FinishReason.DEADLINE
    assert running.block_table == [] and [c.seq for c in out.chunks] == [relaxed]
    h.run_until_done()
    assert relaxed.finish_reason is FinishReason.LENGTH


def test_prefix_hits_reported_from_first_admission_only() -> None:
    h = Harness(SchedulerConfig(num_blocks=6, block_size=4, max_num_batched_tokens=64))
    shared = list(range(100, 112))  # three full blocks
    first = h.add("first", shared + [1], max_tokens=2)
    h.run_until_done()
    assert first.num_cached_tokens == 0
    second = h.add("second", shared + [2], max_tokens=6)
    third = h.add("third", [7, 7, 7, 7, 7], max_tokens=6)
    out = h.step()
    assert second.num_cached_tokens == 12 and out.chunks[0].start == 12 and out.chunks[0].num_tokens == 1
    assert h.scheduler.prefix_cache_stats == (13 + 13 + 5, 12)
    while not out.preempted:  # the pool of 6 runs dry as both grow: third (later) is preempted
        out = h.step()
    assert out.preempted == [third]
    h.run_until_done()
    assert third.num_preemptions >= 1 and third.num_cached_tokens == 0  # its recompute hit is not reported
    assert h.scheduler.prefix_cache_stats == (13 + 13 + 5, 12)
    assert second.num_output_tokens == third.num_output_tokens == 6


def test_identical_prompts_admitted_together_share_after_caching() -> None:
    h = Harness(SchedulerConfig(num_blocks=32, block_size=2))
    prompt = [3, 1, 4, 1, 5, 9, 2]
    a = h.add("a", prompt, max_tokens=3)
    b = h.add("b", prompt, max_tokens=3)
    h.step()  # admitted in the same step: neither can hit, both compute
    assert a.num_cached_tokens == b.num_cached_tokens == 0
    c = h.add("c", prompt, max_tokens=3)
    h.step()
    assert c.num_cached_tokens == 6 and c.block_table[:3] == a.block_table[:3]
    h.run_until_done()


def test_add_refuses_requests_the_pool_can_never_hold() -> None:
    sched = Scheduler(SchedulerConfig(num_blocks=4, block_size=4))
    sched.add(Sequence("fits", list(range(10)), SamplingParams(max_tokens=7)))  # 16 KV positions
    with pytest.raises(ValueError, match=r"needs 5 KV blocks of 4 tokens, but the pool has only 4"):
        sched.add(Sequence("big", list(range(10)), SamplingParams(max_tokens=8)))
    with pytest.raises(ValueError, match="already queued"):
        sched.add(Sequence("fits", [1]))
    with pytest.raises(ValueError, match="prompt is empty"):
        sched.add(Sequence("empty", []))
    assert sched.num_waiting == 1


def test_finish_of_an_unknown_sequence_is_an_error() -> None:
    sched = Scheduler(SchedulerConfig(num_blocks=4))
    with pytest.raises(ValueError, match="not queued or running"):
        sched.finish(Sequence("ghost", [1]), FinishReason.STOP)


def test_config_validation() -> None:
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        SchedulerConfig(num_blocks=4, max_num_batched_tokens=0)


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
@pytest.mark.parametrize("seed", range(40))
def test_randomized_simulation(seed: int, overlap: bool) -> None:
    rng = random.Random(seed)
    block_size = rng.choice([1, 2, 4, 16])
    max_len = rng.randrange(4, 40)
    config = SchedulerConfig(
        num_blocks=-(-max_len // block_size) + rng.randrange(0, 12),
        block_size=block_size,
        max_num_seqs=rng.randrange(1, 9),
        max_num_batched_tokens=rng.randrange(1, 48),
        enable_prefix_caching=rng.random() < 0.8,
    )
    clock = Clock()
    h = Harness(config, clock, overlap=overlap)
    prefixes = [[rng.randrange(5) for _ in range(rng.randrange(1, max_len))] for _ in range(3)]
    num_requests = 60
    for _step in range(20_000):
        if len(h.seqs) < num_requests and rng.random() < 0.3:
            prompt = rng.choice(prefixes) + [rng.randrange(5) for _ in range(rng.randrange(0, 6))]
            prompt = prompt[: max_len - 1]
            request_id = f"r{len(h.seqs)}"
            h.add(
                request_id,
                prompt,
                max_tokens=rng.randrange(1, max_len - len(prompt) + 1),
                priority=rng.randrange(3),
                deadline_ms=clock.now_ms + rng.randrange(50, 5000) if rng.random() < 0.2 else None,
            )
            if rng.random() < 0.2:
                h.stop_early[request_id] = rng.randrange(1, 4)
        unfinished = [s for s in h.seqs.values() if not s.is_finished]
        if unfinished and rng.random() < 0.03:
            h.scheduler.abort(rng.choice(unfinished).request_id)
        clock.now_ms += 10
        h.step()
        if len(h.seqs) == num_requests and not h.scheduler.has_unfinished():
            break
        if overlap and not h.scheduler.has_unfinished():
            assert h.in_flight == [] or all(s.is_finished for s in h.in_flight)
    else:
        raise AssertionError(f"seed {seed}: requests left unfinished")
    for seq in h.seqs.values():
        assert seq.is_finished
        if seq.finish_reason is FinishReason.LENGTH:
            assert seq.num_output_tokens == seq.params.max_tokens
    assert h.scheduler.num_free_blocks == config.num_blocks


def run_one_token(sched: Scheduler, seq: Sequence, token: int, stop_string: bool = False) -> list[Sequence]:
    sched.update_from_launch(sched.schedule())
    return sched.update_from_output([SampledToken(seq, token, stop_string)])


def test_update_from_output_applies_the_stop_rule_and_frees_the_finished() -> None:
    sched = Scheduler(SchedulerConfig(num_blocks=8, block_size=2, max_model_len=7))
    # A stop id counts only once min_tokens are out.
    seq = Sequence("ids", [1, 2], SamplingParams(max_tokens=4, min_tokens=2), stop_token_ids=frozenset({9}))
    sched.add(seq)
    assert run_one_token(sched, seq, 9) == [] and seq.output_token_ids == [9] and not seq.is_finished
    assert run_one_token(sched, seq, 9) == [seq]
    assert seq.finish_reason is FinishReason.STOP and seq.block_table == [] and sched.num_free_blocks == 8
    # A stop string found on the max_tokens-th token wins over LENGTH.
    seq = Sequence("str", [1], SamplingParams(max_tokens=1))
    sched.add(seq)
    assert run_one_token(sched, seq, 5, stop_string=True) == [seq] and seq.finish_reason is FinishReason.STOP
    # The context's end: prompt 5 + 2 outputs reach max_model_len=7 before max_tokens.
    seq = Sequence("ctx", [1, 2, 3, 4, 5], SamplingParams(max_tokens=10))
    sched.add(seq)
    assert run_one_token(sched, seq, 5) == []
    assert run_one_token(sched, seq, 6) == [seq] and seq.finish_reason is FinishReason.LENGTH
    assert seq.output_token_ids == [5, 6] and not sched.has_unfinished()


def test_an_ended_sequence_drops_its_token_in_flight_and_ignores_its_value() -> None:
    sched = Scheduler(SchedulerConfig(num_blocks=8, block_size=2))
    seq = Sequence("a", [1, 2, 3], SamplingParams(max_tokens=5))
    sched.add(seq)
    sched.update_from_launch(sched.schedule())
    assert seq.output_token_ids == [PENDING_TOKEN] and seq.num_pending == 1
    sched.abort("a")
    assert sched.schedule().ended == [seq]
    assert seq.output_token_ids == [] and seq.num_pending == 0 and seq.finish_reason is FinishReason.CANCELLED
    assert sched.update_from_output([SampledToken(seq, 4)]) == [] and seq.output_token_ids == []
