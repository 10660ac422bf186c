"""BlockManager: allocation, reference counts, prefix-cache hits, LRU eviction. Pure Python, no model."""

from __future__ import annotations

import random

import pytest
import stoker.engine.block_manager as block_manager_module
from stoker.engine.block_manager import BlockManager, hash_block
from stoker.engine.sampling_params import SamplingParams
from stoker.engine.sequence import Sequence


def make_seq(request_id: str, prompt: list[int], output: list[int] | None = None) -> Sequence:
    return Sequence(
        request_id, list(prompt), SamplingParams(max_tokens=64), output_token_ids=list(output or [])
    )


def compute(bm: BlockManager, seq: Sequence, num_tokens: int) -> None:
    """What the scheduler does around one forward: allocate, advance, register full blocks."""
    assert bm.allocate_slots(seq, num_tokens)
    seq.num_computed_tokens += num_tokens
    bm.cache_full_blocks(seq)


def admit(bm: BlockManager, seq: Sequence) -> int:
    """Admit with a prefix match and compute the rest of the sequence; returns the hit in tokens."""
    match = bm.match_prefix(seq)
    assert bm.allocate_slots(seq, seq.num_tokens - match.num_tokens, match)
    seq.num_computed_tokens = seq.num_tokens
    bm.cache_full_blocks(seq)
    return match.num_tokens


def test_allocate_covers_positions_and_free_returns_blocks() -> None:
    bm = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=False)
    seq = make_seq("a", list(range(10)))
    assert bm.allocate_slots(seq, 10)
    assert len(seq.block_table) == 3 and len(set(seq.block_table)) == 3
    assert bm.num_free_blocks == 5
    seq.num_computed_tokens = 10
    assert bm.allocate_slots(seq, 2)  # positions 10, 11 still fit in block 2
    assert len(seq.block_table) == 3
    assert bm.allocate_slots(seq, 3)  # positions up to 14 need block 3
    assert len(seq.block_table) == 4 and bm.num_free_blocks == 4
    bm.free(seq)
    assert seq.block_table == [] and bm.num_free_blocks == 8
    assert all(block.ref_count == 0 for block in bm.blocks)


def test_allocation_is_all_or_nothing() -> None:
    bm = BlockManager(num_blocks=3, block_size=4, enable_prefix_caching=False)
    first, second = make_seq("a", list(range(8))), make_seq("b", list(range(8)))
    assert bm.allocate_slots(first, 8)
    assert not bm.allocate_slots(second, 8)  # needs 2, 1 left
    assert second.block_table == [] and bm.num_free_blocks == 1
    assert bm.allocate_slots(second, 4)
    assert set(first.block_table).isdisjoint(second.block_table)


def test_shared_prefix_blocks_are_refcounted_and_never_written() -> None:
    bm = BlockManager(num_blocks=10, block_size=4)
    prefix = [7, 1, 9, 4, 3, 3, 8, 0]  # two full blocks
    a = make_seq("a", prefix + [5, 6])
    assert admit(bm, a) == 0
    b = make_seq("b", prefix + [2])
    assert admit(bm, b) == 8
    assert b.block_table[:2] == a.block_table[:2]
    assert b.block_table[2] != a.block_table[2]  # b's own tokens go into a fresh block
    assert [bm.blocks[i].ref_count for i in a.block_table] == [2, 2, 1]
    bm.free(a)
    assert [bm.blocks[i].ref_count for i in b.block_table] == [1, 1, 1]
    assert bm.num_free_blocks == 10 - 3  # a's private tail block is free; the shared ones are still held
    bm.free(b)
    assert bm.num_free_blocks == 10 and bm.num_cached_blocks == 2


def test_match_never_covers_the_whole_sequence() -> None:
    bm = BlockManager(num_blocks=10, block_size=4)
    prompt = list(range(8))
    admit(bm, make_seq("a", prompt))
    again = make_seq("b", prompt)
    match = bm.match_prefix(again)
    assert (
        match.num_tokens == 4
    )  # one token must remain to compute for logits, so the last block is recomputed
    longer = make_seq("c", prompt + [99])
    assert bm.match_prefix(longer).num_tokens == 8


def test_prefix_match_stops_at_first_differing_block() -> None:
    bm = BlockManager(num_blocks=16, block_size=2)
    admit(bm, make_seq("a", [1, 2, 3, 4, 5, 6, 7]))
    assert bm.match_prefix(make_seq("b", [1, 2, 3, 4, 5, 6, 8, 8])).num_tokens == 6
    assert bm.match_prefix(make_seq("c", [1, 2, 9, 4, 5, 6, 7, 8])).num_tokens == 2
    # Same block content at a different place in the chain is not a hit (the hash chains the parent).
    assert bm.match_prefix(make_seq("d", [3, 4, 1, 2, 5])).num_tokens == 0


def test_output_tokens_are_cached_too() -> None:
    bm = BlockManager(num_blocks=8, block_size=4)
    seq = make_seq("a", [1, 2, 3])
    compute(bm, seq, 3)
    for token in (4, 5, 6):  # decode: append the sampled token, then compute it
        seq.output_token_ids.append(token)
        compute(bm, seq, 1)
    assert bm.num_cached_blocks == 1  # [1, 2, 3, 4] is full and computed; [5, 6] is not
    follower = make_seq("b", [1, 2, 3, 4, 5])
    assert bm.match_prefix(follower).num_tokens == 4


def test_hash_collision_is_a_miss(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(block_manager_module, "hash_block", lambda parent, tokens: b"same")
    bm = BlockManager(num_blocks=8, block_size=2)
    admit(bm, make_seq("a", [1, 2, 3]))
    assert bm.match_prefix(make_seq("b", [5, 6, 7])).num_tokens == 0  # same hash, other tokens
    assert bm.match_prefix(make_seq("c", [1, 2, 7])).num_tokens == 2


def test_hash_is_stable_and_chained() -> None:
    first = hash_block(None, (1, 2, 3))
    assert first == hash_block(None, (1, 2, 3)) and len(first) == 16
    assert hash_block(first, (4,)) != hash_block(None, (4,))
    assert hash_block(None, (1, 2)) != hash_block(None, (2, 1))


def test_uncached_free_blocks_go_before_evicting_and_eviction_is_lru() -> None:
    bm = BlockManager(num_blocks=6, block_size=2)
    a, b = make_seq("a", [1, 2, 3, 4, 0]), make_seq("b", [5, 6, 0])
    admit(bm, a)  # blocks [1,2] [3,4] cached, [0] private
    admit(bm, b)  # [5,6] cached, [0] private
    a_blocks, b_blocks = list(a.block_table), list(b.block_table)
    bm.free(a)
    bm.free(b)
    assert bm.num_cached_blocks == 3 and bm.num_free_blocks == 6
    # 6 fresh blocks: 1 never used + 2 private freed ones first, then cached ones oldest-freed first, and
    # within a freed sequence its tail before its prefix.
    taker = make_seq("t", [9] * 12)
    assert bm.allocate_slots(taker, 12)
    expected_eviction = [a_blocks[1], a_blocks[0], b_blocks[0]]
    assert taker.block_table[3:] == expected_eviction
    assert bm.num_cached_blocks == 0
    assert bm.match_prefix(make_seq("a2", [1, 2, 3, 4, 0])).num_tokens == 0


def test_eviction_spares_cached_blocks_used_again() -> None:
    bm = BlockManager(num_blocks=4, block_size=2)
    old, recent = make_seq("old", [1, 1, 0]), make_seq("recent", [2, 2, 0])
    admit(bm, old)
    admit(bm, recent)
    bm.free(old)
    bm.free(recent)
    reuse = make_seq("reuse", [1, 1, 5])  # hits old's block, which moves out of the LRU queue
    assert admit(bm, reuse) == 2
    bm.free(reuse)  # ...and back in, now the most recently freed
    taker = make_seq("t", [9] * 5)
    assert bm.allocate_slots(taker, 5)  # 1 unused + 1 private + evicts one cached block
    assert bm.match_prefix(make_seq("x", [1, 1, 5])).num_tokens == 2
    assert bm.match_prefix(make_seq("y", [2, 2, 5])).num_tokens == 0


def test_matched_free_blocks_do_not_count_as_free_for_the_same_allocation() -> None:
    bm = BlockManager(num_blocks=3, block_size=2)
    first = make_seq("a", [1, 2, 3, 4, 5])
    admit(bm, first)  # all 3 blocks used, 2 cached
    bm.free(first)  # 3 free: 1 uncached + 2 evictable
    too_long = make_seq("b", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    match = bm.match_prefix(too_long)
    assert match.num_tokens == 4
    # Needs 2 matched + 3 fresh blocks; reviving the 2 matched ones leaves 1: refused, nothing changed.
    assert not bm.allocate_slots(too_long, too_long.num_tokens - 4, match)
    assert too_long.block_table == [] and bm.num_free_blocks == 3 and bm.num_cached_blocks == 2
    fits = make_seq("c", [1, 2, 3, 4, 6])
    assert admit(bm, fits) == 4 and bm.num_free_blocks == 0


def test_random_alloc_free_never_hands_out_a_referenced_block() -> None:
    rng = random.Random(1234)
    bm = BlockManager(num_blocks=24, block_size=4)
    live: list[Sequence] = []
    for step in range(3000):
        if live and (rng.random() < 0.35 or bm.num_free_blocks < 3):
            bm.free(live.pop(rng.randrange(len(live))))
        else:
            prompt = [rng.randrange(3) for _ in range(rng.randrange(1, 14))]
            seq = make_seq(f"s{step}", prompt)
            match = bm.match_prefix(seq)
            if bm.allocate_slots(seq, seq.num_tokens - match.num_tokens, match):
                seq.num_computed_tokens = seq.num_tokens
                bm.cache_full_blocks(seq)
                live.append(seq)
        holders: dict[int, list[Sequence]] = {}
        for seq in live:
            for index, block_id in enumerate(seq.block_table):
                holders.setdefault(block_id, []).append(seq)
                if len(holders[block_id]) > 1:  # shared: must be a full, cached block of identical content
                    assert bm.blocks[block_id].block_hash is not None
                    assert (index + 1) * bm.block_size <= seq.num_computed_tokens
        for block in bm.blocks:
            assert block.ref_count == len(holders.get(block.block_id, []))
        assert bm.num_free_blocks == sum(block.ref_count == 0 for block in bm.blocks)
    assert bm.num_cached_blocks > 0


def test_disabled_prefix_caching_never_matches() -> None:
    bm = BlockManager(num_blocks=8, block_size=2, enable_prefix_caching=False)
    admit(bm, make_seq("a", [1, 2, 3, 4, 5]))
    assert bm.num_cached_blocks == 0
    assert bm.match_prefix(make_seq("b", [1, 2, 3, 4, 5])).num_tokens == 0


def test_bad_sizes_are_refused() -> None:
    with pytest.raises(ValueError, match="num_blocks and block_size"):
        BlockManager(0, 16)
