"""Attention over the paged KV cache: mixed prefill/decode batches, and the decode-only hot path.

Cache layout per layer: k_cache, v_cache [num_blocks, block_size, Hkv, D]; position p of sequence b lives
in block block_tables[b, p // block_size] at offset p % block_size. Query head h reads kv head
h // (Hq // Hkv) (GQA).
"""
from __future__ import annotations

import torch

from engine.kernels._triton import check_launchable, tl, triton


def _check_cache(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    if q.dim() != 3:
        raise ValueError(f"attention: q must be [tokens, Hq, D], got {tuple(q.shape)}")
    if k_cache.dim() != 4 or v_cache.shape != k_cache.shape or k_cache.shape[3] != q.shape[2]:
        raise ValueError(
            f"attention: caches must be [num_blocks, block_size, Hkv, {q.shape[2]}], "
            f"got {tuple(k_cache.shape)}, {tuple(v_cache.shape)}"
        )
    if q.shape[1] % k_cache.shape[2]:
        raise ValueError(f"attention: Hq={q.shape[1]} is not a multiple of Hkv={k_cache.shape[2]}")
    if k_cache.dtype != q.dtype or v_cache.dtype != q.dtype:
        raise ValueError(f"attention: q dtype {q.dtype} differs from cache dtype {k_cache.dtype}")


def _check_batch(
    num_tokens: int, block_tables: torch.Tensor, query_start_loc: torch.Tensor, context_lens: torch.Tensor
) -> None:
    batch = context_lens.shape[0]
    if context_lens.dim() != 1 or block_tables.dim() != 2 or block_tables.shape[0] != batch:
        raise ValueError(
            f"attention: context_lens [B] and block_tables [B, max_blocks] expected, "
            f"got {tuple(context_lens.shape)}, {tuple(block_tables.shape)}"
        )
    if query_start_loc.shape != (batch + 1,):
        raise ValueError(f"attention: query_start_loc must be [B+1] = [{batch + 1}], "
                         f"got {tuple(query_start_loc.shape)}")


def paged_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """q [T, Hq, D] -> [T, Hq, D]. Sequence b's n_b queries q[query_start_loc[b]:query_start_loc[b+1]]
    sit at positions context_lens[b]-n_b .. context_lens[b]-1 and attend causally to the cached keys at
    positions 0 .. context_lens[b]-1. Softmax in float32. Reads only the blocks a sequence owns, so
    padding entries in block_tables are never touched. Loops over sequences on the host (a reference)."""
    _check_cache(q, k_cache, v_cache)
    _check_batch(q.shape[0], block_tables, query_start_loc, context_lens)
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    group = q.shape[1] // num_kv_heads
    flat_k = k_cache.view(-1, num_kv_heads, head_dim)
    flat_v = v_cache.view(-1, num_kv_heads, head_dim)
    out = torch.zeros_like(q)
    starts, lens = query_start_loc.tolist(), context_lens.tolist()
    for b, ctx in enumerate(lens):
        start, end = starts[b], starts[b + 1]
        n = end - start
        if n == 0:
            continue
        if n < 0 or n > ctx or end > q.shape[0]:
            raise ValueError(f"attention: sequence {b} has {n} queries [{start}:{end}] but context {ctx}")
        pos = torch.arange(ctx, device=q.device)
        slots = block_tables[b, pos // block_size].long() * block_size + pos % block_size
        keys = flat_k[slots].float().repeat_interleave(group, dim=1)  # [ctx, Hq, D]
        values = flat_v[slots].float().repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q[start:end].float(), keys) * scale  # [Hq, n, ctx]
        query_pos = torch.arange(ctx - n, ctx, device=q.device)
        scores.masked_fill_(pos[None, :] > query_pos[:, None], float("-inf"))
        out[start:end] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), values).to(q.dtype)
    return out


def paged_decode_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """q [B, Hq, D] -> [B, Hq, D]: one query per sequence at position context_lens[b]-1."""
    if q.dim() != 3 or q.shape[0] != context_lens.shape[0]:
        raise ValueError(f"decode attention: q must be [B, Hq, D] with B = len(context_lens) = "
                         f"{context_lens.shape[0]}, got {tuple(q.shape)}")
    query_start_loc = torch.arange(q.shape[0] + 1, dtype=torch.int32, device=q.device)
    return paged_attention_ref(q, k_cache, v_cache, block_tables, query_start_loc, context_lens, scale)
