"""Paged KV block pool with reference counts and a prefix cache (pure Python, no torch).

Every sequence owns a block table: token at position p lives in physical block block_table[p // block_size].
With prefix caching, a FULL block whose K/V have been computed is registered under a chain hash
H_i = blake2b(H_{i-1} || token ids of block i), so a later request sharing the first k*block_size tokens
reuses those k blocks instead of recomputing them. Only full blocks strictly before the first token still to
compute are shared, and new tokens always go into blocks the sequence owns alone, so a shared block is
never written.

Free blocks come in two kinds: never-cached ones (worthless, handed out first) and cached ones with no
reference left (reusable by a prefix hit, evicted least recently freed first when a fresh block is needed).
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict, deque
from dataclasses import dataclass

from stoker.engine.sequence import Sequence

BlockHash = bytes  # 16-byte blake2b digest


def hash_block(parent: BlockHash | None, token_ids: tuple[int, ...]) -> BlockHash:
    """Chain hash of one full block. Stable across processes (unlike hash()), 128 bits."""
    digest = hashlib.blake2b(digest_size=16)
    digest.update(parent or b"\0" * 16)
    digest.update(array("q", token_ids).tobytes())
    return digest.digest()


@dataclass(slots=True)
class KVBlock:
    block_id: int
    ref_count: int = 0
    # Set while the block is registered in the prefix cache; parent and tokens are kept to verify a hit
    # fully (a hash match alone is not trusted).
    block_hash: BlockHash | None = None
    parent_hash: BlockHash | None = None
    token_ids: tuple[int, ...] = ()


@dataclass(slots=True)
class PrefixMatch:
    """Cached blocks covering a sequence's first num_tokens tokens (num_tokens = len(blocks) * block_size)."""

    blocks: list[int]
    hashes: list[BlockHash]  # the chain hashes of those blocks, to continue the chain from
    num_tokens: int


NO_MATCH = PrefixMatch([], [], 0)


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks and block_size must be >= 1, got {num_blocks} and {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self._free_uncached: deque[int] = deque(range(num_blocks))
        self._evictable: OrderedDict[int, None] = OrderedDict()  # cached, ref_count 0; oldest first
        self._hash_to_block: dict[BlockHash, int] = {}
        # Chain hashes of each live sequence's leading full blocks that are computed (registered or not:
        # a block computed twice concurrently is registered once, but both sequences chain through it).
        self._seq_hashes: dict[Sequence, list[BlockHash]] = {}

    @property
    def num_free_blocks(self) -> int:
        """Blocks that a fresh allocation can take: never-cached free ones plus evictable cached ones."""
        return len(self._free_uncached) + len(self._evictable)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._hash_to_block)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _block_tokens(self, seq: Sequence, index: int) -> tuple[int, ...]:
        # Slice prompt and output separately: seq.all_token_ids would copy the whole sequence.
        start, end, num_prompt = index * self.block_size, (index + 1) * self.block_size, seq.num_prompt_tokens
        if end <= num_prompt:
            return tuple(seq.prompt_token_ids[start:end])
        if start >= num_prompt:
            return tuple(seq.output_token_ids[start - num_prompt : end - num_prompt])
        return tuple(seq.prompt_token_ids[start:]) + tuple(seq.output_token_ids[: end - num_prompt])

    def match_prefix(self, seq: Sequence) -> PrefixMatch:
        """Longest run of cached full blocks at the start of seq. Never the whole sequence: at least one
        token is left to compute so the step has logits to sample from. Takes no references."""
        if not self.enable_prefix_caching:
            return NO_MATCH
        blocks: list[int] = []
        hashes: list[BlockHash] = []
        parent: BlockHash | None = None
        # Only blocks whose tokens are all known (a pending sampled token has no value to hash yet).
        num_blocks = min(seq.num_tokens - 1, seq.num_known_tokens) // self.block_size
        for index in range(num_blocks):
            token_ids = self._block_tokens(seq, index)
            block_hash = hash_block(parent, token_ids)
            block_id = self._hash_to_block.get(block_hash)
            if block_id is None:
                break
            block = self.blocks[block_id]
            if block.parent_hash != parent or block.token_ids != token_ids:
                break  # a hash collision: treat as a miss
            blocks.append(block_id)
            hashes.append(block_hash)
            parent = block_hash
        return PrefixMatch(blocks, hashes, len(blocks) * self.block_size)

    def allocate_slots(self, seq: Sequence, num_new_tokens: int, prefix: PrefixMatch | None = None) -> bool:
        """Make seq.block_table cover every position < start + num_new_tokens, where start is prefix.num_tokens
        on admission (prefix given, empty table) and seq.num_computed_tokens otherwise. All or nothing:
        returns False, changing nothing, when the pool cannot supply the fresh blocks."""
        if prefix is not None and seq.block_table:
            raise ValueError(f"{seq.request_id}: a prefix match applies only to a sequence holding no blocks")
        if (
            prefix is None
            and seq.num_computed_tokens + num_new_tokens <= len(seq.block_table) * self.block_size
        ):
            return True  # the common decode: the last block still has room
        prefix = prefix or NO_MATCH
        start = prefix.num_tokens if prefix.blocks else seq.num_computed_tokens
        num_fresh = self.blocks_needed(start + num_new_tokens) - len(seq.block_table) - len(prefix.blocks)
        # Matched blocks with no reference are counted as free; taking them makes them unavailable.
        num_revived = sum(1 for b in prefix.blocks if self.blocks[b].ref_count == 0)
        if num_fresh > self.num_free_blocks - num_revived:
            return False
        for block_id in prefix.blocks:
            self._take(block_id)
        seq.block_table.extend(prefix.blocks)
        if prefix.blocks:
            self._seq_hashes[seq] = list(prefix.hashes)
        for _ in range(num_fresh):
            seq.block_table.append(self._take(self._pop_free()))
        return True

    def forget_cached(self) -> None:
        """Drop every cached block that no sequence holds (they become plain free blocks): the cache then
        answers no prefix from before, e.g. after the engine's warm-up ran synthetic prompts."""
        while self._evictable:
            block_id, _ = self._evictable.popitem(last=False)
            block = self.blocks[block_id]
            if block.block_hash is not None:
                del self._hash_to_block[block.block_hash]
            block.block_hash, block.parent_hash, block.token_ids = None, None, ()
            self._free_uncached.append(block_id)

    def _pop_free(self) -> int:
        if self._free_uncached:
            return self._free_uncached.popleft()
        block_id, _ = self._evictable.popitem(last=False)  # least recently freed
        block = self.blocks[block_id]
        assert block.block_hash is not None  # only cached blocks are evictable
        del self._hash_to_block[block.block_hash]
        block.block_hash, block.parent_hash, block.token_ids = None, None, ()
        return block_id

    def _take(self, block_id: int) -> int:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            self._evictable.pop(block_id, None)  # a prefix hit revives a cached free block
        block.ref_count += 1
        return block_id

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Register the blocks of seq whose tokens are all computed (call after num_computed_tokens advanced).
        A block whose content is already cached elsewhere stays private (it is freed as uncached)."""
        if not self.enable_prefix_caching:
            return
        hashes = self._seq_hashes.setdefault(seq, [])
        # A block is hashed once its tokens are computed AND known: with overlapped steps the newest sampled
        # token is computed by the next step before its value reaches the host.
        num_full = min(
            min(seq.num_computed_tokens, seq.num_known_tokens) // self.block_size, len(seq.block_table)
        )
        for index in range(len(hashes), num_full):
            parent = hashes[-1] if hashes else None
            token_ids = self._block_tokens(seq, index)
            block_hash = hash_block(parent, token_ids)
            hashes.append(block_hash)
            block = self.blocks[seq.block_table[index]]
            if block.block_hash is None and block_hash not in self._hash_to_block:
                block.block_hash, block.parent_hash, block.token_ids = block_hash, parent, token_ids
                self._hash_to_block[block_hash] = block.block_id

    def free(self, seq: Sequence) -> None:
        """Drop seq's references and clear its block table. Released in reverse so that, of a sequence's
        cached blocks, the tail (least likely shared) is evicted before the prefix."""
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            if block.ref_count <= 0:
                raise RuntimeError(
                    f"{seq.request_id}: block {block_id} freed with ref_count {block.ref_count}"
                )
            block.ref_count -= 1
            if block.ref_count == 0:
                if block.block_hash is not None:
                    self._evictable[block_id] = None
                else:
                    self._free_uncached.append(block_id)
        seq.block_table.clear()
        self._seq_hashes.pop(seq, None)
