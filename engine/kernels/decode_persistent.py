"""Decode attention on a persistent grid of a chosen number of programs (issue 13 item 4's measurement): the
math of attention.py's `_decode_split_kernel` with one split, but each program loops over (sequence, kv head)
work items, so the launch takes as many SMs as it has programs (the block scheduler puts one program per SM
until every SM has one) whatever the batch. ops/bench_overlap.py reads its bandwidth against that count: how
much of the GPU decode attention needs, i.e. what the other half's GEMMs could have beside it.

The reference is attention.py's `paged_decode_attention_ref`; only a cache in q's dtype (no FP8 scales).
"""
from __future__ import annotations

import torch
from stoker.engine.kernels._triton import tl, triton
from stoker.engine.kernels.attention import _LOG2E, _check_cache, _check_kernel_inputs, _dot_precision
from stoker.engine.kernels.kv_quant import is_fp8_cache


@triton.jit(do_not_specialize=["num_items", "block_table_stride"])
def _decode_persistent_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, context_lens_ptr, out_ptr,
    qk_scale, num_items, q_seq_stride, q_head_stride, block_table_stride, out_seq_stride, out_head_stride,
    NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    # Work item = seq * NUM_KV_HEADS + kv head; program p of P takes items p, p + P, ... (P from the grid: one
    # compiled variant for every program count)
    rows = tl.arange(0, BLOCK_G)
    dims = tl.arange(0, BLOCK_D)
    row_mask = rows < GROUP
    dim_mask = dims < HEAD_DIM
    for item in range(tl.program_id(0), num_items, tl.num_programs(0)):
        # int32 offsets: q and out are B * Hq * D elements (4M at batch 1,024), the K/V offset is int64 below.
        seq = item // NUM_KV_HEADS
        kv_head = item % NUM_KV_HEADS
        heads = kv_head * GROUP + rows
        context_len = tl.load(context_lens_ptr + seq)
        q = tl.load(q_ptr + seq * q_seq_stride + heads[:, None] * q_head_stride + dims[None, :],
                    mask=row_mask[:, None] & dim_mask[None, :], other=0.0)
        running_max = tl.full([BLOCK_G], float("-inf"), tl.float32)
        running_sum = tl.zeros([BLOCK_G], tl.float32)
        acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
        for tile_start in range(0, context_len, TILE_N):
            pos = tile_start + tl.arange(0, TILE_N)
            key_mask = pos < context_len
            block = tl.load(block_tables_ptr + seq * block_table_stride + pos // BLOCK_SIZE, mask=key_mask, other=0)
            slot = block.to(tl.int64) * BLOCK_SIZE + pos % BLOCK_SIZE
            kv_offset = slot[:, None] * (NUM_KV_HEADS * HEAD_DIM) + kv_head * HEAD_DIM + dims[None, :]
            kv_mask = key_mask[:, None] & dim_mask[None, :]
            k = tl.load(k_cache_ptr + kv_offset, mask=kv_mask, other=0.0)
            scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
            scores = tl.where(key_mask[None, :], scores, float("-inf"))
            new_max = tl.maximum(running_max, tl.max(scores, axis=1))
            correction = tl.exp2(running_max - new_max)
            probs = tl.exp2(scores - new_max[:, None])
            running_sum = running_sum * correction + tl.sum(probs, axis=1)
            v = tl.load(v_cache_ptr + kv_offset, mask=kv_mask, other=0.0)
            acc = acc * correction[:, None] + tl.dot(probs.to(v.dtype), v, input_precision=DOT_PRECISION)
            running_max = new_max
        out = acc / running_sum[:, None]
        tl.store(out_ptr + seq * out_seq_stride + heads[:, None] * out_head_stride + dims[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & dim_mask[None, :])


def paged_decode_attention_persistent(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    num_programs: int,
    num_warps: int = 4,
) -> torch.Tensor:
    """q [B, Hq, D] -> [B, Hq, D], as paged_decode_attention_ref, on `num_programs` programs (>= 1)."""
    _check_cache(q, k_cache, v_cache)
    if is_fp8_cache(k_cache):
        raise ValueError("persistent decode attention: FP8 caches are not supported (a measurement kernel)")
    if q.shape[0] != context_lens.shape[0] or block_tables.dim() != 2 or block_tables.shape[0] != q.shape[0]:
        raise ValueError(f"decode attention: q [B, Hq, D], block_tables [B, max_blocks], context_lens [B] "
                         f"expected, got {tuple(q.shape)}, {tuple(block_tables.shape)}, {tuple(context_lens.shape)}")
    if num_programs < 1:
        raise ValueError(f"persistent decode attention: num_programs must be >= 1, got {num_programs}")
    _check_kernel_inputs(q, k_cache, v_cache, block_tables, context_lens)
    batch, num_q_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    out = torch.empty_like(q)
    num_items = batch * num_kv_heads
    if num_items == 0:
        return out
    group = num_q_heads // num_kv_heads
    programs = min(num_programs, num_items)  # more programs than items would only exit at once
    _decode_persistent_kernel[(programs,)](
        q, k_cache, v_cache, block_tables, context_lens, out, scale * _LOG2E, num_items,
        q.stride(0), q.stride(1), block_tables.stride(0), out.stride(0), out.stride(1),
        NUM_KV_HEADS=num_kv_heads, GROUP=group, BLOCK_G=max(16, triton.next_power_of_2(group)),
        HEAD_DIM=head_dim, BLOCK_D=triton.next_power_of_2(head_dim), BLOCK_SIZE=block_size,
        TILE_N=64 if q.is_cuda else 16, DOT_PRECISION=_dot_precision(q.dtype),
        num_warps=num_warps,
    )
    return out
