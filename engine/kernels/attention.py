"""Attention over the paged KV cache: mixed prefill/decode batches, and the decode-only hot path.

Cache layout per layer: k_cache, v_cache [num_blocks, block_size, Hkv, D]; position p of sequence b lives
in block block_tables[b, p // block_size] at offset p % block_size. Query head h reads kv head
h // (Hq // Hkv) (GQA).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from stoker.engine.kernels import decode_fp8_mma
from stoker.engine.kernels._triton import check_launchable, interpreting, tl, triton
from stoker.engine.kernels.decode_pdl import pdl_first_tile, pdl_first_tile_early
from stoker.engine.kernels.kv_fp8_tiles import (
    DEFAULT_DECODE,
    DEFAULT_PREFILL,
    FP8_F16,
    FP8_F16_VWORDS,
    FP8_MMA,
    FP8_MODES,
    Fp8AttentionConfig,
    fp8_dot_fp16,
    fp8_unit,
    kv_for_dots,
    q_for_dots,
    v_words_f16,
)
from stoker.engine.kernels.kv_quant import check_scale, dequantize_kv, is_fp8_cache


def _check_cache(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    if q.dim() != 3:
        raise ValueError(f"attention: q must be [tokens, Hq, D], got {tuple(q.shape)}")
    if k_cache.dim() != 4 or v_cache.shape != k_cache.shape or k_cache.shape[3] != q.shape[2]:
        raise ValueError(
            f"attention: caches must be [num_blocks, block_size, Hkv, {q.shape[2]}], "
            f"got {tuple(k_cache.shape)}, {tuple(v_cache.shape)}"
        )
    if q.shape[1] % k_cache.shape[2]:
        raise ValueError(f"attention: Hq={q.shape[1]} is not a multiple of Hkv={k_cache.shape[2]}")
    if v_cache.dtype != k_cache.dtype:
        raise ValueError(f"attention: k_cache is {k_cache.dtype} but v_cache {v_cache.dtype}")
    if is_fp8_cache(k_cache):  # the FP8 KV cache (kv_quant.py): read as stored * scale
        check_scale(k_scale, "attention k_scale", k_cache.device)
        check_scale(v_scale, "attention v_scale", k_cache.device)
    elif k_cache.dtype != q.dtype:
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
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """q [T, Hq, D] -> [T, Hq, D]. Sequence b's n_b queries q[query_start_loc[b]:query_start_loc[b+1]]
    sit at positions context_lens[b]-n_b .. context_lens[b]-1 and attend causally to the cached keys at
    positions 0 .. context_lens[b]-1. Softmax in float32. Reads only the blocks a sequence owns, so
    padding entries in block_tables are never touched. Loops over sequences on the host (a reference).
    An FP8 cache (kv_quant.py) is dequantized on load with k_scale / v_scale, then the same float32 math."""
    _check_cache(q, k_cache, v_cache, k_scale, v_scale)
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
        keys = dequantize_kv(flat_k[slots], k_scale).repeat_interleave(group, dim=1)  # [ctx, Hq, D]
        values = dequantize_kv(flat_v[slots], v_scale).repeat_interleave(group, dim=1)
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
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """q [B, Hq, D] -> [B, Hq, D]: one query per sequence at position context_lens[b]-1."""
    if q.dim() != 3 or q.shape[0] != context_lens.shape[0]:
        raise ValueError(f"decode attention: q must be [B, Hq, D] with B = len(context_lens) = "
                         f"{context_lens.shape[0]}, got {tuple(q.shape)}")
    query_start_loc = torch.arange(q.shape[0] + 1, dtype=torch.int32, device=q.device)
    return paged_attention_ref(q, k_cache, v_cache, block_tables, query_start_loc, context_lens, scale,
                               k_scale, v_scale)


# ---------------------------------------------------------------------------------------------- Triton
# Both kernels keep the scores in the log2 domain (scale * log2(e) folded into one multiply, exp2 instead
# of exp) and run the online softmax in float32. K/V rows are gathered token by token through the block
# table, so a tile of keys need not align with cache blocks and tile size is free of block_size.
# FP8_CACHE (the FP8 KV cache, kv_quant.py): K/V tiles are converted to q's dtype in registers (exact: e4m3
# fits fp16/bf16/fp32) and the per-tensor scales are applied outside the dots, k_scale folded into the score
# multiply and v_scale into the output: one multiply per row instead of one per cached element. The scales
# are read from device tensors, so a CUDA graph replays with whatever the checkpoint loaded.

_LOG2E = 1.4426950408889634


def _dot_precision(dtype: torch.dtype) -> str:
    # fp32 inputs would silently use tf32 tensor cores (~1e-3 error); keep fp32 exact, it is a test dtype.
    return "ieee" if dtype == torch.float32 else "tf32"


def _check_kernel_inputs(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, *ints: torch.Tensor) -> None:
    check_launchable(q, k_cache, v_cache, *ints)
    if q.stride(2) != 1:
        raise ValueError("attention: the head_dim of q must be contiguous")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("attention: k_cache and v_cache must be contiguous")
    for t in ints:
        if t.dtype not in (torch.int32, torch.int64) or t.stride(-1) != 1:
            raise ValueError(f"attention: block_tables/query_start_loc/context_lens must be int32 or int64 "
                             f"with a contiguous last dim, got {t.dtype}, strides {t.stride()}")


def _fp8_launch(fp8: bool, config: Fp8AttentionConfig, q: torch.Tensor, decode: bool) -> tuple[dict, dict]:
    """The FP8 cache's constexprs and launch options (kv_fp8_tiles.py); a cache in q's dtype launches as ever.
    decode: the decode kernel (F16_VWORDS is a decode-kernel mode: the prefill kernel runs it as F16)."""
    if not fp8:
        return {}, {"num_warps": 4}
    mode = FP8_MODES[config.mode]
    if mode == FP8_MMA:  # decode_fp8_mma.py's kernel where it runs (the launcher); here, where it does not
        mode = FP8_F16_VWORDS
    if mode == FP8_F16_VWORDS and (q.shape[2] % 4 or not decode):
        mode = FP8_F16  # the words need head_dim % 4 == 0; the prefill kernel has no word path (nor FP8_PTX)
    constexprs = {"FP8_MODE": mode, "DOT_FP16": fp8_dot_fp16(config.mode, q.dtype == torch.float32)}
    if mode == FP8_F16_VWORDS:
        constexprs["FP8_PTX"] = q.is_cuda  # the interpreter runs no PTX: a cast per byte there (kv_fp8_tiles.py)
    return constexprs, {"num_warps": config.num_warps, "num_stages": config.num_stages}


# Integer arguments that vary from batch to batch are not specialized on (Triton otherwise compiles a variant
# per "== 1" / "% 16 == 0" class of each value): a mid-run compile costs ~1 s of host time and stalls the GPU.
@triton.jit(do_not_specialize=["block_table_stride"])
def _decode_split_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, context_lens_ptr,
    out_ptr, part_out_ptr, part_max_ptr, part_sum_ptr, k_scale_ptr, v_scale_ptr, counters_ptr,
    qk_scale, q_seq_stride, q_head_stride, block_table_stride, out_seq_stride, out_head_stride,
    NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr, BLOCK_G: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr, DOT_PRECISION: tl.constexpr, FP8_CACHE: tl.constexpr,
    FUSED_COMBINE: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_GP: tl.constexpr, CHUNK_S: tl.constexpr,
    FP8_MODE: tl.constexpr = 0, DOT_FP16: tl.constexpr = False, FP8_PTX: tl.constexpr = False,
    USE_PDL: tl.constexpr = False, PDL_GDC: tl.constexpr = False, TABLE_AHEAD: tl.constexpr = False,
):
    # Program (sequence, kv head, split): all GROUP query heads sharing this kv head are rows of one tile,
    # so each K/V row is read once per group; the context is cut into NUM_SPLITS contiguous pieces.
    seq = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    context_len = tl.load(context_lens_ptr + seq)
    split_len = _decode_split_len(context_len, NUM_SPLITS, TILE_N)
    start = split * split_len
    end = tl.minimum(start + split_len, context_len)
    if (split > 0) & (start >= context_len):
        # An empty split (the grid is sized for the longest context the block table can hold, fixed inside a
        # CUDA graph): exit before loading q or storing a partial; the reduce reads only the live splits.
        return

    rows = tl.arange(0, BLOCK_G)
    heads = kv_head * GROUP + rows
    dims = tl.arange(0, BLOCK_D)
    row_mask = rows < GROUP
    dim_mask = dims < HEAD_DIM
    loop_start = start
    if USE_PDL:  # decode_pdl.py: the first key tile but this step's key before the qkv kernel is done, then wait
        k_first, v_first = pdl_first_tile_early(
            k_cache_ptr, v_cache_ptr, block_tables_ptr, seq, kv_head, block_table_stride, start, end, context_len,
            dims, dim_mask, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE, TILE_N, PDL_GDC)
    q = tl.load(q_ptr + seq * q_seq_stride + heads[:, None] * q_head_stride + dims[None, :],
                mask=row_mask[:, None] & dim_mask[None, :], other=0.0)
    if FP8_CACHE:  # kv_fp8_tiles.py: the dots' dtype and the scales' unit follow FP8_MODE
        qk_scale = qk_scale * tl.load(k_scale_ptr) * fp8_unit(FP8_MODE)
        q = q_for_dots(q, DOT_FP16)
    running_max = tl.full([BLOCK_G], float("-inf"), tl.float32)
    running_sum = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    if USE_PDL:
        running_max, running_sum, acc = pdl_first_tile(
            q, k_first, v_first, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq, kv_head, block_table_stride,
            start, end, context_len, dims, dim_mask, qk_scale, running_max, running_sum, acc,
            NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE, TILE_N, DOT_PRECISION, FP8_MODE)
        loop_start = start + TILE_N
    table_row = block_tables_ptr + seq * block_table_stride
    block_next = _first_blocks_ahead(table_row, loop_start, end, BLOCK_SIZE, TILE_N, TABLE_AHEAD)
    for tile_start in range(loop_start, end, TILE_N):
        pos = tile_start + tl.arange(0, TILE_N)
        key_mask = pos < end
        block, block_next = _tile_blocks(table_row, pos, end, block_next, BLOCK_SIZE, TILE_N, TABLE_AHEAD)
        slot = block.to(tl.int64) * BLOCK_SIZE + pos % BLOCK_SIZE
        kv_offset = slot[:, None] * (NUM_KV_HEADS * HEAD_DIM) + kv_head * HEAD_DIM + dims[None, :]
        kv_mask = key_mask[:, None] & dim_mask[None, :]
        k = kv_for_dots(tl.load(k_cache_ptr + kv_offset, mask=kv_mask, other=0.0), q.dtype, FP8_MODE)
        scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
        scores = tl.where(key_mask[None, :], scores, float("-inf"))
        new_max = tl.maximum(running_max, tl.max(scores, axis=1))
        correction = tl.exp2(running_max - new_max)
        probs = tl.exp2(scores - new_max[:, None])
        running_sum = running_sum * correction + tl.sum(probs, axis=1)
        if FP8_MODE == 3:  # kv_fp8_tiles.py: F16_VWORDS
            v = v_words_f16(v_cache_ptr, slot, kv_head, key_mask, NUM_KV_HEADS, HEAD_DIM, BLOCK_D, FP8_PTX).to(q.dtype)
        else:
            v = kv_for_dots(tl.load(v_cache_ptr + kv_offset, mask=kv_mask, other=0.0), q.dtype, FP8_MODE)
        acc = acc * correction[:, None] + tl.dot(probs.to(v.dtype), v, input_precision=DOT_PRECISION)
        running_max = new_max
    if FP8_CACHE:
        acc = acc * (tl.load(v_scale_ptr) * fp8_unit(FP8_MODE))

    out_mask = row_mask[:, None] & dim_mask[None, :]
    if NUM_SPLITS == 1:
        out = acc / running_sum[:, None]
        tl.store(out_ptr + seq * out_seq_stride + heads[:, None] * out_head_stride + dims[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=out_mask)
    else:
        # Partials [B, Hq, NUM_SPLITS(, D)] of the live splits (split 0 is always live).
        part = (seq * (NUM_KV_HEADS * GROUP) + heads) * NUM_SPLITS + split
        tl.store(part_max_ptr + part, running_max, mask=row_mask)
        tl.store(part_sum_ptr + part, running_sum, mask=row_mask)
        tl.store(part_out_ptr + part[:, None] * HEAD_DIM + dims[None, :], acc, mask=out_mask)
        if FUSED_COMBINE:
            _combine_if_last(out_ptr, part_out_ptr, part_max_ptr, part_sum_ptr, counters_ptr, seq, kv_head,
                             tl.cdiv(context_len, split_len), out_seq_stride, out_head_stride,
                             NUM_KV_HEADS, GROUP, BLOCK_GP, HEAD_DIM, BLOCK_D, NUM_SPLITS, CHUNK_S)


@triton.jit
def _table_blocks(table_row, pos, mask, BLOCK_SIZE: tl.constexpr):
    """The cache block of each key position `pos` (0 where `mask` is off: positions past the keys, never read): one
    sequence's block-table row, read by both attention kernels once a key tile, in its loop or a tile ahead."""
    return tl.load(table_row + pos // BLOCK_SIZE, mask=mask, other=0)


@triton.jit
def _first_blocks_ahead(table_row, start, end, BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr,
                        TABLE_AHEAD: tl.constexpr):
    """Before a key loop from `start`: with TABLE_AHEAD its first tile's block numbers (the loop then carries each
    next tile's, see DECODE_TABLE_AHEAD); without, zeros that _tile_blocks passes through untouched (a loop-carried
    value that never changes, which the compiler folds away: no load, no register)."""
    if TABLE_AHEAD:
        ahead = start + tl.arange(0, TILE_N)
        blocks = _table_blocks(table_row, ahead, ahead < end, BLOCK_SIZE)
    else:
        blocks = tl.zeros([TILE_N], tl.int32)
    return blocks


@triton.jit
def _tile_blocks(table_row, pos, end, block_next, BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr,
                 TABLE_AHEAD: tl.constexpr):
    """(the block numbers of the key tile at positions `pos`, the carried value for the next tile): with
    TABLE_AHEAD the tile's were loaded a tile earlier and the next tile's are loaded now; without, the tile's are
    loaded now and block_next passes through."""
    if TABLE_AHEAD:
        block = block_next
        ahead = pos + TILE_N
        block_next = _table_blocks(table_row, ahead, ahead < end, BLOCK_SIZE)
    else:
        block = _table_blocks(table_row, pos, pos < end, BLOCK_SIZE)
    return block, block_next


@triton.jit
def _combine_if_last(
    out_ptr, part_out_ptr, part_max_ptr, part_sum_ptr, counters_ptr, seq, kv_head, num_live,
    out_seq_stride, out_head_stride,
    NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr, BLOCK_GP: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr, NUM_SPLITS: tl.constexpr, CHUNK_S: tl.constexpr,
):
    # The combine without a second kernel: every live split of (seq, kv head) bumps one counter after its
    # partials are stored; the one that sees num_live - 1 arrived last, so all partials are visible to it
    # (release by the writers, acquire here) and it combines them for the GROUP query heads. It then puts
    # the counter back to 0: the buffer stays zeroed between launches, so a CUDA graph replays it as is.
    # The barrier first: the release below is one thread's, and must follow every thread's partial stores.
    num_live = tl.maximum(num_live, 1)  # split 0 always runs, even for a context of 0
    tl.debug_barrier()
    counter = counters_ptr + seq * NUM_KV_HEADS + kv_head
    arrived = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
    if arrived == num_live - 1:
        tl.store(counter, 0)
        _combine_group(out_ptr, part_out_ptr, part_max_ptr, part_sum_ptr, seq, kv_head, num_live, out_seq_stride,
                       out_head_stride, NUM_KV_HEADS, GROUP, BLOCK_GP, HEAD_DIM, BLOCK_D, NUM_SPLITS, CHUNK_S)


@triton.jit
def _combine_group(
    out_ptr, part_out_ptr, part_max_ptr, part_sum_ptr, seq, kv_head, num_live, out_seq_stride, out_head_stride,
    NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr, BLOCK_GP: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr, NUM_SPLITS: tl.constexpr, CHUNK_S: tl.constexpr,
):
    """out[seq, the GROUP heads of kv_head] from their num_live splits' partials: all heads at once in
    [BLOCK_GP, CHUNK_S(, D)] tiles, merged online over chunks of splits, so the last split waits one L2 round
    trip per chunk (one at W1's 16 splits) where a head at a time (_combine_head) waited one per head: that
    made the first fused combine slower than the second kernel (8B batch 1: 9.1 vs 6.3 us a layer)."""
    g = tl.arange(0, BLOCK_GP)
    heads = kv_head * GROUP + g
    head_mask = g < GROUP
    dims = tl.arange(0, BLOCK_D)
    dim_mask = dims < HEAD_DIM
    first = (seq * (NUM_KV_HEADS * GROUP) + heads) * NUM_SPLITS  # [BLOCK_GP]: each head's split 0
    run_max = tl.full([BLOCK_GP], -1e30, tl.float32)  # finite, so the padding heads never make inf - inf
    run_sum = tl.zeros([BLOCK_GP], tl.float32)
    acc = tl.zeros([BLOCK_GP, BLOCK_D], tl.float32)
    for s0 in range(0, num_live, CHUNK_S):
        splits = s0 + tl.arange(0, CHUNK_S)
        mask = head_mask[:, None] & (splits[None, :] < num_live)
        part = first[:, None] + splits[None, :]
        part_max = tl.load(part_max_ptr + part, mask=mask, other=float("-inf"), cache_modifier=".cg")
        part_sum = tl.load(part_sum_ptr + part, mask=mask, other=0.0, cache_modifier=".cg")
        part_out = tl.load(part_out_ptr + part[:, :, None] * HEAD_DIM + dims[None, None, :],
                           mask=mask[:, :, None] & dim_mask[None, None, :], other=0.0, cache_modifier=".cg")
        new_max = tl.maximum(run_max, tl.max(part_max, axis=1))
        keep = tl.exp2(run_max - new_max)
        weight = tl.exp2(part_max - new_max[:, None])
        run_sum = run_sum * keep + tl.sum(part_sum * weight, axis=1)
        acc = acc * keep[:, None] + tl.sum(part_out * weight[:, :, None], axis=1)
        run_max = new_max
    out = acc / tl.where(run_sum > 0, run_sum, 1.0)[:, None]
    tl.store(out_ptr + seq * out_seq_stride + heads[:, None] * out_head_stride + dims[None, :],
             out.to(out_ptr.dtype.element_ty), mask=head_mask[:, None] & dim_mask[None, :])


@triton.jit
def _combine_head(
    out_ptr, part_out_ptr, part_max_ptr, part_sum_ptr, seq, head, num_live, out_seq_stride, out_head_stride,
    NUM_Q_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, NUM_SPLITS: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    """out[seq, head] from the partials of its num_live first splits (the others were never written): the
    reduce kernel's work, one program per (sequence, query head)."""
    splits = tl.arange(0, BLOCK_S)
    dims = tl.arange(0, BLOCK_D)
    part = (seq * NUM_Q_HEADS + head) * NUM_SPLITS + splits
    split_mask = splits < num_live
    part_max = tl.load(part_max_ptr + part, mask=split_mask, other=float("-inf"))
    part_sum = tl.load(part_sum_ptr + part, mask=split_mask, other=0.0)
    part_out = tl.load(part_out_ptr + part[:, None] * HEAD_DIM + dims[None, :],
                       mask=split_mask[:, None] & (dims[None, :] < HEAD_DIM), other=0.0)
    weight = tl.exp2(part_max - tl.max(part_max, axis=0))  # split 0 is live, so the max is finite
    out = tl.sum(part_out * weight[:, None], axis=0) / tl.sum(part_sum * weight, axis=0)
    tl.store(out_ptr + seq * out_seq_stride + head * out_head_stride + dims,
             out.to(out_ptr.dtype.element_ty), mask=dims < HEAD_DIM)


@triton.jit
def _decode_split_len(context_len, NUM_SPLITS: tl.constexpr, TILE_N: tl.constexpr):
    # Keys per split: the live context cut into NUM_SPLITS pieces, rounded up to whole key tiles (>= 1 tile).
    return tl.cdiv(tl.cdiv(tl.maximum(context_len, 1), NUM_SPLITS), TILE_N) * TILE_N


@triton.jit
def _decode_reduce_kernel(
    out_ptr, part_out_ptr, part_max_ptr, part_sum_ptr, context_lens_ptr, out_seq_stride, out_head_stride,
    NUM_Q_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    NUM_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr, TILE_N: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    # The splits the decode kernel ran (the empty ones exited without writing their partials).
    context_len = tl.load(context_lens_ptr + seq)
    num_live = tl.cdiv(context_len, _decode_split_len(context_len, NUM_SPLITS, TILE_N))
    _combine_head(out_ptr, part_out_ptr, part_max_ptr, part_sum_ptr, seq, head, num_live, out_seq_stride,
                  out_head_stride, NUM_Q_HEADS, HEAD_DIM, BLOCK_D, NUM_SPLITS, BLOCK_S)


def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 4  # the CPU interpreter: pretend a tiny GPU so tests exercise several splits
    return torch.cuda.get_device_properties(device).multi_processor_count


def _decode_partials(
    batch: int, num_q_heads: int, num_splits: int, head_dim: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Split-K scratch: partial outputs [B, Hq, S, D], maxima and sums [B, Hq, S] (float32). Left
    uninitialized: only the live splits' entries are written, and only those are read (tests poison it)."""
    part_out = torch.empty(batch, num_q_heads, num_splits, head_dim, dtype=torch.float32, device=device)
    part_max = torch.empty(batch, num_q_heads, num_splits, dtype=torch.float32, device=device)
    return part_out, part_max, torch.empty_like(part_max)


def decode_num_splits(batch: int, num_kv_heads: int, max_context: int, sm_count: int, tile_n: int) -> int:
    """Enough (seq, kv head, split) programs for ~2 waves over the SMs, but never a split shorter than one
    key tile. At small batches the kernel is latency-bound (a 640-token context is ~2.6 MB per layer, under
    a microsecond of bandwidth): one tile per program halves the serial loop of the old two-tile minimum,
    while the extra partials (8 KB each) and the wider reduce cost next to nothing.
    Depends only on shapes, not on context_lens values, so it needs no host sync and is CUDA-graph safe.
    max_context is the block table's width in tokens: at eager launches the runner sizes the table to the
    batch's longest live context, so the count already follows the live context; inside a CUDA graph the
    table is the static one (max_model_len wide) and the grid stays fixed per bucket: splits past a short
    context then exit at once (the kernel computes each split's range from the live context_lens, so the
    live splits share the work evenly). Choosing the count from the live maximum inside a graph would need
    that maximum on the host (a sync) or a grid per context bucket (more captures): not worth it while the
    empty programs cost one load of context_lens each."""
    wanted = triton.cdiv(DECODE_SPLIT_WAVES * sm_count, max(1, batch * num_kv_heads))
    return max(1, min(wanted, triton.cdiv(max_context, tile_n), DECODE_MAX_SPLITS))


# decode_num_splits' programs (waves over the SMs) and its cap on splits. Constants so that a bench can A/B them
# (`ops/bench.py --decode-kernels auto,auto+set=attention.DECODE_MAX_SPLITS=4`): W1's decode attention is 8.2 us a
# layer on the critical path (session 19), most of it the split combine's chain (store, arrival add, loads of the
# partials), and with the key tiles pipelined (decode_table_ahead) fewer, longer splits may pay at batch 1 (not
# measured yet).
DECODE_SPLIT_WAVES = 2
DECODE_MAX_SPLITS = 64


# The key tiles' block numbers loaded one tile ahead of the tile (a loop-carried value) instead of inside it. Why:
# Triton 3.6's software pipeliner treats a load whose address comes from another load of the same iteration (the
# paged cache's block table, then K / V) as indirect and waits for every copy at the top of each tile
# (`DEPBAR.LE SB0, 0x0` in the sm_90 SASS, both kernels, every cache dtype): nothing of the next tile is in flight
# while one is computed. ncu (H200, session 20, B = 1,024 ctx 640) had the FP8 cache's decode kernel at 60 % of
# DRAM bandwidth, 36 % issue-busy, its top stall that wait; with the numbers a tile ahead the K / V copies are
# multi-buffered (`DEPBAR.LE SB0, 0x2`), at more shared memory (FP8 n128 74 -> 106 KB, bf16 n64 39 -> 72 KB).
# Measured (H200, session 20, ops/bench_decode_attention_fp8.py --w2 --prefill --ahead and
# ops/bench_prefill_attention.py --ahead; us, in the loop -> ahead): W2's decode at B = 1,024 ctx 640, bf16 cache
# 629.1 -> 626.1, FP8 f16-vwords n64 555.5 -> **464.3** (the old default, n128 in the loop, 469.2; n128 ahead 519.5:
# 2 blocks an SM), ctx 768 FP8 n64 654.8 -> 549.3 (n128 in the loop 558.2); W2's 8,192-token prefill step, bf16
# m64 n64 187.9 -> 169.9, m64 n32 175.7 -> **154.8**, FP8 f16 n64 210.6 -> 198.7. What limits the FP8 decode kernel
# now is shared memory (ncu: L1 84 % busy, 6.7-way bank conflicts on the V tile's stores, short-scoreboard
# stalls), not the wait for HBM.
# Not at small batches: with W1's 16 splits of one 64-key tile over a 1,024-token table the pipelined loop's
# prologue and the larger buffers cost, 4.157 against 4.065 ms a token (8B bf16, call 3 of session 20), so the
# decode kernel takes the numbers ahead only where a split spans DECODE_AHEAD_MIN_TILES tiles of the table or more
# (decode_table_ahead: W2's B = 1,024, one split of 16 tiles, yes; B <= 16, 3-16 splits, no).
DECODE_TABLE_AHEAD = True
DECODE_AHEAD_MIN_TILES = 8
PREFILL_TABLE_AHEAD = True


def decode_table_ahead(num_splits: int, max_context: int, tile_n: int) -> bool:
    """Whether the decode kernel loads its block numbers a tile ahead (DECODE_TABLE_AHEAD): splits of at least
    DECODE_AHEAD_MIN_TILES key tiles of a table max_context tokens wide."""
    return DECODE_TABLE_AHEAD and max_context >= DECODE_AHEAD_MIN_TILES * num_splits * tile_n

# Keys per step of the decode kernel's loop for a cache in q's dtype on the GPU (decode_num_splits makes a split at
# least one such tile, so at batch 1 it also sets how many programs share a short context).
DECODE_TILE_N = 64


# The FP8 cache's decode attention by decode_fp8_mma.py's Gluon kernel (one warp a program, K and V copied by
# cp.async into a shared-memory ring and read back in the MMA operands' layouts) instead of DEFAULT_DECODE's split
# kernel, where it runs and the launch has one split (batch * Hkv >= 2 waves of programs: W2's decode, where it was
# measured), at DECODE_FP8_MMA_TILE_N keys a tile. Measured (H200, session 22 call 1, ops/bench_decode_attention_fp8.py
# --w2, us, B = 1,024 ctx 640 / 768): the split kernel 465.4 / 557.2, the Gluon kernel **342.1 / 407.7** (its
# register form of session 21: 409.9 / 486.9; decode_fp8_mma.py has the rest); W2 with FP8 weights and the FP8
# cache on that machine 14.30 s against 14.77 with the register form, its decode phase 6.21 s against 6.62. Smaller
# batches keep the split kernel and its fused combine (the Gluon kernel's splits take a second kernel to combine).
# Constants so that ops/bench.py can A/B them (`--decode-kernels auto+set=attention.DECODE_FP8_MMA=False`).
DECODE_FP8_MMA = True
DECODE_FP8_MMA_TILE_N = 16


def _fp8_config_that_runs(q: torch.Tensor, k_cache: torch.Tensor, fp8_config: Fp8AttentionConfig | None
                          ) -> tuple[Fp8AttentionConfig, bool]:
    """(the FP8 cache's decode config as given, or DEFAULT_DECODE, whether decode_fp8_mma.py's kernel runs it). A
    config of mode "mma" where that kernel cannot run falls back to the split kernel's words at tile 64
    (kv_fp8_tiles.py)."""
    config = fp8_config or DEFAULT_DECODE
    if config.mode != "mma":
        return config, False
    if decode_fp8_mma.supported(q, k_cache):
        return config, True
    return Fp8AttentionConfig("f16-vwords", 64, config.num_warps, config.num_stages), False


def _decode_fp8_config(q: torch.Tensor, k_cache: torch.Tensor, fp8_config: Fp8AttentionConfig | None,
                       num_splits: int) -> tuple[Fp8AttentionConfig, bool]:
    """(the FP8 cache's decode config that runs a launch of num_splits splits, whether decode_fp8_mma.py's kernel
    runs it). No config: the Gluon kernel for a launch of one split (DECODE_FP8_MMA), else DEFAULT_DECODE. The
    split count comes first, from DEFAULT_DECODE's tile (decode_splits) or the CUDA-graph bucket that would hold
    the rows (decode_bucket_launch), so a mixed step's decode rows run the kernel their bucket's capture compiled."""
    if fp8_config is None and DECODE_FP8_MMA and num_splits == 1 and decode_fp8_mma.supported(q, k_cache):
        return Fp8AttentionConfig("mma", DECODE_FP8_MMA_TILE_N, 1, 1), True
    return _fp8_config_that_runs(q, k_cache, fp8_config)


def _decode_tile_n(q: torch.Tensor, k_cache: torch.Tensor, fp8_config: Fp8AttentionConfig | None) -> int:
    """Keys per step of the decode kernel's loop, for choosing the split count (no config: DEFAULT_DECODE's tile,
    also where one split then runs decode_fp8_mma.py's kernel at its own tile)."""
    if not q.is_cuda:
        return 16  # the interpreter pays per element: small tiles keep tests fast
    if not is_fp8_cache(k_cache):
        return DECODE_TILE_N
    return _fp8_config_that_runs(q, k_cache, fp8_config)[0].tile_n


def decode_splits(
    batch: int, max_context: int, q: torch.Tensor, k_cache: torch.Tensor, fp8_config: Fp8AttentionConfig | None = None
) -> int:
    """The split count paged_decode_attention_triton picks for `batch` sequences over a block table max_context
    tokens wide (q, k_cache: for the device, dtype and tile). A mixed step's decode rows ask for the count of the
    CUDA-graph bucket that would hold them (layers/attention.py): a variant the capture compiled already."""
    tile_n = _decode_tile_n(q, k_cache, fp8_config)
    return decode_num_splits(batch, k_cache.shape[2], max_context, _sm_count(q.device), tile_n)


def decode_bucket_launch(batch: int, max_context: int, q: torch.Tensor, k_cache: torch.Tensor) -> tuple[int, bool]:
    """(split count, block numbers ahead) of the launch a CUDA-graph bucket of `batch` sequences over a table
    max_context tokens wide makes: what a mixed step's decode rows launch as (layers/attention.py), so they run a
    variant the capture compiled. Both follow the table's width, and a mixed step's eager table is narrower than the
    graph's: choosing from its own would compile new variants mid-run (tests/test_mixed_decode_launch.py)."""
    num_splits = decode_splits(batch, max_context, q, k_cache)
    return num_splits, decode_table_ahead(num_splits, max_context, _decode_tile_n(q, k_cache, None))


def _combine_chunk(num_splits: int, block_gp: int, block_d: int, on_gpu: bool) -> int:
    """Splits per step of the fused combine (_combine_group): its [BLOCK_GP, CHUNK_S, BLOCK_D] float32 tile at
    <= 8192 elements (64 registers a thread at 4 warps): all 16 splits of W1's 8B step in one step. The
    interpreter takes 2, so the tests' few splits still take several steps and a masked tail."""
    if not on_gpu:
        return 2
    return max(1, min(triton.next_power_of_2(num_splits), 8192 // (block_gp * block_d)))


def decode_combine_counters(max_batch: int, num_kv_heads: int, device: torch.device | str) -> torch.Tensor:
    """The fused combine's arrival counters, one per (sequence, kv head) of up to max_batch sequences: zeroed
    once here, and left zeroed by every launch (the last split of each pair resets its counter). One buffer
    per attention layer: two launches sharing one must never run at the same time (a layer's steps are
    ordered on its stream)."""
    return torch.zeros(max_batch * num_kv_heads, dtype=torch.int32, device=device)


def _check_counters(counters: torch.Tensor, needed: int, device: torch.device) -> None:
    if counters.dtype != torch.int32 or counters.dim() != 1 or counters.device != device or counters.stride(0) != 1:
        raise ValueError(f"decode attention: counters must be a contiguous int32 vector on {device} "
                         f"(decode_combine_counters), got {counters.dtype} {tuple(counters.shape)} on {counters.device}")
    if counters.numel() < needed:
        raise ValueError(f"decode attention: counters hold {counters.numel()} entries, the batch needs "
                         f"B * Hkv = {needed}; make them with decode_combine_counters(max_batch, ...)")


def _check_out(out: torch.Tensor | None, q: torch.Tensor) -> torch.Tensor:
    """The launchers' output: `out` when it fits q (the kernels write through its row and head strides), else a
    new uninitialized tensor (every row is written)."""
    if out is None:
        return torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if out.shape != q.shape or out.dtype != q.dtype or out.device != q.device or out.stride(2) != 1:
        raise ValueError(f"attention: out must be {tuple(q.shape)} {q.dtype} on {q.device} with a contiguous "
                         f"head_dim, got {tuple(out.shape)} {out.dtype} on {out.device}")
    return out


def paged_decode_attention_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    num_splits: int | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    fp8_config: Fp8AttentionConfig | None = None,
    counters: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    pdl: bool = False,
    table_ahead: bool | None = None,
) -> torch.Tensor:
    """num_splits: None picks from the shapes (decode_num_splits); tests force 1 or several. k_scale/v_scale:
    an FP8 cache's scales (kv_quant.py), ignored for a cache in q's dtype. fp8_config: the FP8 cache's
    conversion and tile (kv_fp8_tiles.py; None: its DEFAULT_DECODE); benches and tests pick others. counters: a
    zeroed int32 buffer of >= B * Hkv entries (decode_combine_counters) that the kernel leaves zeroed: with it
    the last split of each (sequence, kv head) combines the partials (one launch); without it a second kernel
    does. out: where to write [B, Hq, D] (a view of a mixed step's output); None allocates. pdl: launch with
    programmatic dependent launch after the qkv kernel (decode_pdl.py; the split kernel, an FP8 cache too); under
    the interpreter the same peeled first tile runs without the launch attribute and the griddepcontrol PTX.
    table_ahead: each key tile's block numbers loaded a tile ahead (None: decode_table_ahead's choice)."""
    _check_cache(q, k_cache, v_cache, k_scale, v_scale)
    if q.shape[0] != context_lens.shape[0] or block_tables.dim() != 2 or block_tables.shape[0] != q.shape[0]:
        raise ValueError(f"decode attention: q [B, Hq, D], block_tables [B, max_blocks], context_lens [B] "
                         f"expected, got {tuple(q.shape)}, {tuple(block_tables.shape)}, {tuple(context_lens.shape)}")
    _check_kernel_inputs(q, k_cache, v_cache, block_tables, context_lens)
    batch, num_q_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    out = _check_out(out, q)
    if batch == 0:
        return out
    group = num_q_heads // num_kv_heads
    max_context = block_tables.shape[1] * block_size  # a bound on every context length, known without sync
    if num_splits is None:
        num_splits = decode_splits(batch, max_context, q, k_cache, fp8_config)
    fp8 = is_fp8_cache(k_cache)
    fp8_config, mma = _decode_fp8_config(q, k_cache, fp8_config, num_splits) if fp8 else (None, False)
    if pdl and mma:  # the Gluon kernel reads no early tile: a PDL launch runs the split kernel at its own config
        fp8_config, mma = _fp8_config_that_runs(q, k_cache, DEFAULT_DECODE)
    tile_n = _decode_tile_n(q, k_cache, fp8_config)
    fp8_args, launch = _fp8_launch(fp8, fp8_config or DEFAULT_DECODE, q, decode=True)
    if pdl:
        fp8_args |= {"USE_PDL": True, "PDL_GDC": not interpreting()}
        launch |= {"launch_pdl": True} if not interpreting() else {}
    part_out = part_max = part_sum = out  # placeholders, unused when there is one split
    if num_splits > 1:
        part_out, part_max, part_sum = _decode_partials(batch, num_q_heads, num_splits, head_dim, q.device)
    block_d = triton.next_power_of_2(head_dim)
    k_scale_arg, v_scale_arg = (k_scale, v_scale) if fp8 else (out, out)  # placeholders when not FP8
    fused_combine = num_splits > 1 and counters is not None
    block_gp = triton.next_power_of_2(group)
    if counters is not None:
        _check_counters(counters, batch * num_kv_heads, q.device)
    qk_scale = scale * _LOG2E  # both kernels keep the scores in the log2 domain
    if mma:  # no fused combine there: the reduce kernel combines its splits
        assert k_scale is not None and v_scale is not None  # an FP8 cache's scales (_check_cache requires them)
        decode_fp8_mma.decode_fp8_mma(q, k_cache, v_cache, block_tables, context_lens, qk_scale, k_scale, v_scale,
                                      out, (part_out, part_max, part_sum), num_splits, tile_n)
        fused_combine = False
    else:
        _decode_split_kernel[(batch, num_kv_heads, num_splits)](
            q, k_cache, v_cache, block_tables, context_lens, out, part_out, part_max, part_sum, k_scale_arg,
            v_scale_arg, counters if counters is not None else context_lens,  # a placeholder without the combine
            qk_scale, q.stride(0), q.stride(1), block_tables.stride(0), out.stride(0), out.stride(1),
            NUM_KV_HEADS=num_kv_heads, GROUP=group, BLOCK_G=max(16, triton.next_power_of_2(group)),
            HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_SIZE=block_size, TILE_N=tile_n,
            NUM_SPLITS=num_splits, DOT_PRECISION=_dot_precision(q.dtype), FP8_CACHE=fp8,
            FUSED_COMBINE=fused_combine, BLOCK_S=triton.next_power_of_2(num_splits), BLOCK_GP=block_gp,
            CHUNK_S=_combine_chunk(num_splits, block_gp, block_d, q.is_cuda),
            TABLE_AHEAD=decode_table_ahead(num_splits, max_context, tile_n) if table_ahead is None else table_ahead,
            **fp8_args, **launch,
        )
    if num_splits > 1 and not fused_combine:
        _decode_reduce_kernel[(batch, num_q_heads)](
            out, part_out, part_max, part_sum, context_lens, out.stride(0), out.stride(1),
            NUM_Q_HEADS=num_q_heads, HEAD_DIM=head_dim, BLOCK_D=block_d,
            NUM_SPLITS=num_splits, BLOCK_S=triton.next_power_of_2(num_splits), TILE_N=tile_n, num_warps=4,
        )
    return out


@triton.jit
def _zero_padding_rows(
    out_ptr, query_start_loc_ptr, num_seqs, num_tokens, pad_program, kv_head, out_token_stride, out_head_stride,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, PAD_ROWS: tl.constexpr,
):
    # Rows query_start_loc[B] .. T-1 (batch padding) belong to no sequence: zero this program's PAD_ROWS of
    # them for the GROUP heads of kv_head. Most such programs cover real rows only and store nothing.
    token = (pad_program * PAD_ROWS + tl.arange(0, PAD_ROWS)).to(tl.int64)
    token_mask = (token >= tl.load(query_start_loc_ptr + num_seqs)) & (token < num_tokens)
    dims = tl.arange(0, BLOCK_D)
    mask = token_mask[:, None] & (dims[None, :] < HEAD_DIM)
    zeros = tl.zeros([PAD_ROWS, BLOCK_D], out_ptr.dtype.element_ty)
    for g in tl.static_range(GROUP):
        head = kv_head * GROUP + g
        tl.store(out_ptr + token[:, None] * out_token_stride + head * out_head_stride + dims[None, :], zeros,
                 mask=mask)


@triton.jit(do_not_specialize=["num_seqs", "num_tokens", "num_tiles", "block_table_stride"])
def _prefill_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, query_start_loc_ptr, context_lens_ptr, out_ptr,
    k_scale_ptr, v_scale_ptr, qk_scale, num_seqs, num_tokens, num_tiles,
    q_token_stride, q_head_stride, block_table_stride, out_token_stride, out_head_stride,
    NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, TILE_N: tl.constexpr,
    PAD_ROWS: tl.constexpr, DOT_PRECISION: tl.constexpr, FP8_CACHE: tl.constexpr,
    FP8_MODE: tl.constexpr = 0, DOT_FP16: tl.constexpr = False, TABLE_AHEAD: tl.constexpr = False,
):
    # Program (query tile, kv head). A tile is up to BLOCK_Q consecutive tokens of ONE sequence times the
    # GROUP query heads of this kv head: BLOCK_M = BLOCK_Q * GROUP rows (padded to a power of two), so
    # each K/V tile is loaded once for the whole group. Sequence b's tiles are numbered from
    # query_start_loc[b] // BLOCK_Q + b on, which leaves gaps but needs no host-side prefix sum: the grid
    # is sized by the bound T // BLOCK_Q + B and a binary search finds each tile's sequence.
    # Programs past num_tiles write the batch padding's rows instead (the output is allocated empty).
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    if tile >= num_tiles:
        _zero_padding_rows(out_ptr, query_start_loc_ptr, num_seqs, num_tokens, tile - num_tiles, kv_head,
                           out_token_stride, out_head_stride, GROUP, HEAD_DIM, BLOCK_D, PAD_ROWS)
        return
    lo = 0
    hi = num_seqs
    while lo < hi:  # first sequence whose tiles start after this one, minus one
        mid = (lo + hi) // 2
        if tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid <= tile:
            lo = mid + 1
        else:
            hi = mid
    seq = lo - 1
    seq_start = tl.load(query_start_loc_ptr + seq)
    num_queries = tl.load(query_start_loc_ptr + seq + 1) - seq_start
    first_query = (tile - (seq_start // BLOCK_Q + seq)) * BLOCK_Q
    if first_query < num_queries:
        context_len = tl.load(context_lens_ptr + seq)
        rows = tl.arange(0, BLOCK_M)
        query = first_query + rows // GROUP  # index of the query within its sequence
        heads = kv_head * GROUP + rows % GROUP
        dims = tl.arange(0, BLOCK_D)
        row_mask = (rows < BLOCK_Q * GROUP) & (query < num_queries)
        dim_mask = dims[None, :] < HEAD_DIM
        token = (seq_start + query).to(tl.int64)
        q = tl.load(q_ptr + token[:, None] * q_token_stride + heads[:, None] * q_head_stride + dims[None, :],
                    mask=row_mask[:, None] & dim_mask, other=0.0)
        if FP8_CACHE:  # kv_fp8_tiles.py
            qk_scale = qk_scale * tl.load(k_scale_ptr) * fp8_unit(FP8_MODE)
            q = q_for_dots(q, DOT_FP16)
        query_pos = context_len - num_queries + query
        running_max = tl.full([BLOCK_M], float("-inf"), tl.float32)
        running_sum = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        # Keys 0 .. the tile's last query position; every row sees key 0, so no row's max stays -inf.
        key_end = tl.minimum(context_len - num_queries + first_query + BLOCK_Q, context_len)
        table_row = block_tables_ptr + seq * block_table_stride
        block_next = _first_blocks_ahead(table_row, 0, key_end, BLOCK_SIZE, TILE_N, TABLE_AHEAD)
        for tile_start in range(0, key_end, TILE_N):
            pos = tile_start + tl.arange(0, TILE_N)
            key_mask = pos < key_end
            block, block_next = _tile_blocks(table_row, pos, key_end, block_next, BLOCK_SIZE, TILE_N, TABLE_AHEAD)
            slot = block.to(tl.int64) * BLOCK_SIZE + pos % BLOCK_SIZE
            kv_offset = slot[:, None] * (NUM_KV_HEADS * HEAD_DIM) + kv_head * HEAD_DIM + dims[None, :]
            k = kv_for_dots(tl.load(k_cache_ptr + kv_offset, mask=key_mask[:, None] & dim_mask, other=0.0), q.dtype,
                            FP8_MODE)
            scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
            visible = key_mask[None, :] & (pos[None, :] <= query_pos[:, None])
            scores = tl.where(visible, scores, float("-inf"))
            new_max = tl.maximum(running_max, tl.max(scores, axis=1))
            correction = tl.exp2(running_max - new_max)
            probs = tl.exp2(scores - new_max[:, None])
            running_sum = running_sum * correction + tl.sum(probs, axis=1)
            v = kv_for_dots(tl.load(v_cache_ptr + kv_offset, mask=key_mask[:, None] & dim_mask, other=0.0), q.dtype,
                            FP8_MODE)
            acc = acc * correction[:, None] + tl.dot(probs.to(v.dtype), v, input_precision=DOT_PRECISION)
            running_max = new_max
        out = acc / running_sum[:, None]
        if FP8_CACHE:
            out = out * (tl.load(v_scale_ptr) * fp8_unit(FP8_MODE))
        tl.store(out_ptr + token[:, None] * out_token_stride + heads[:, None] * out_head_stride + dims[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & dim_mask)


@dataclass(frozen=True, slots=True)
class PrefillTiles:
    """The prefill kernel's CUDA launch: query rows per program (block_m // GROUP tokens x the GROUP query heads of
    one kv head), keys per loop step, warps, software-pipeline stages."""

    block_m: int = 64
    tile_n: int = 64
    num_warps: int = 4
    num_stages: int = 3

    @property
    def label(self) -> str:
        return f"m{self.block_m} n{self.tile_n} w{self.num_warps} s{self.num_stages}"


# 64 rows x 64 keys x 128 dims in 16 bits keeps q, k, v tiles at 16 KiB each (fits with 4 warps): 188.9 us a
# layer at W2's 8,192-token step (182 TFLOP/s, H200, 18:20 UTC, ops/bench_prefill_attention.py); the sweep's best,
# m128 n32 w4 s3, 173.6 us: ~0.03 s of W2, not worth a change then (BENCHMARKS.md). With the block numbers a tile
# ahead (PREFILL_TABLE_AHEAD, session 20) the sweep's best is m64 n32 w4 s3 at 154.8 us (m64 n64 169.9, m128 n32
# 158.3; m128 n64 w4 338.1): 32-key tiles keep 4-5 programs' copies in flight.
PREFILL_TILES = PrefillTiles(64, 32, 4, 3)


def paged_attention_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    fp8_config: Fp8AttentionConfig | None = None,
    tiles: PrefillTiles | None = None,
    table_ahead: bool | None = None,
) -> torch.Tensor:
    """out: where to write [T, Hq, D] (every row is written, padding rows with zeros); None allocates.
    fp8_config: as for paged_decode_attention_triton (None: kv_fp8_tiles.DEFAULT_PREFILL). tiles: the CUDA
    launch's tiles for a cache in q's dtype (None: PREFILL_TILES; benches sweep others); an FP8 cache takes its
    key tile, warps and stages from fp8_config, its query rows from tiles. table_ahead: as the decode kernel's
    (None: PREFILL_TABLE_AHEAD)."""
    _check_cache(q, k_cache, v_cache, k_scale, v_scale)
    _check_batch(q.shape[0], block_tables, query_start_loc, context_lens)
    _check_kernel_inputs(q, k_cache, v_cache, block_tables, query_start_loc, context_lens)
    num_tokens, num_q_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    num_seqs = context_lens.shape[0]
    # Empty, not zeros: the kernel writes every row, the batch padding's (past query_start_loc[-1]) with
    # zeros like the reference. A memset of T*Hq*D was ~67 MB per layer per 8k-token step at the 8B shape.
    out = _check_out(out, q)
    if num_tokens == 0:
        return out
    if num_seqs == 0:
        return out.zero_()
    group = num_q_heads // num_kv_heads
    tiles = tiles or PREFILL_TILES
    block_m = tiles.block_m if q.is_cuda else 16  # the interpreter pays per element: small tiles keep tests fast
    block_m = max(block_m, triton.next_power_of_2(group))
    block_q = block_m // group
    num_tiles = num_tokens // block_q + num_seqs
    # Padding programs: which rows are padding is known only on the device, so cover all T rows; the ones
    # over real rows load one int and store nothing (T=8192: 128 programs per kv head, ~1% of the grid).
    pad_rows = 64 if q.is_cuda else 16
    fp8 = is_fp8_cache(k_cache)
    fp8_args, launch = _fp8_launch(fp8, fp8_config or DEFAULT_PREFILL, q, decode=False)
    tile_n = tiles.tile_n if q.is_cuda else 16
    if not fp8 and q.is_cuda:
        launch = {"num_warps": tiles.num_warps, "num_stages": tiles.num_stages}
    if fp8 and q.is_cuda:
        tile_n = (fp8_config or DEFAULT_PREFILL).tile_n
    k_scale_arg, v_scale_arg = (k_scale, v_scale) if fp8 else (out, out)  # placeholders when not FP8
    _prefill_kernel[(num_tiles + triton.cdiv(num_tokens, pad_rows), num_kv_heads)](
        q, k_cache, v_cache, block_tables, query_start_loc, context_lens, out, k_scale_arg, v_scale_arg,
        scale * _LOG2E, num_seqs, num_tokens, num_tiles,
        q.stride(0), q.stride(1), block_tables.stride(0), out.stride(0), out.stride(1),
        NUM_KV_HEADS=num_kv_heads, GROUP=group, HEAD_DIM=head_dim, BLOCK_D=triton.next_power_of_2(head_dim),
        BLOCK_SIZE=block_size, BLOCK_Q=block_q, BLOCK_M=block_m, TILE_N=tile_n,
        PAD_ROWS=pad_rows, DOT_PRECISION=_dot_precision(q.dtype), FP8_CACHE=fp8,
        TABLE_AHEAD=PREFILL_TABLE_AHEAD if table_ahead is None else table_ahead, **fp8_args, **launch,
    )
    return out
