"""The decode attention's part in a programmatic-dependent-launch chain (issue 13): the split kernel of
attention.py, launched with PDL after the qkv GEMV, reads everything that is older than that GEMV before
griddepcontrol.wait, and only q and this step's key / value after it.

Why this order is safe: every kernel of the fused decode chain issues griddepcontrol.launch_dependents only after
its own griddepcontrol.wait, so when a PDL kernel starts, the kernel before its predecessor has completed. The
block table and context lengths (copied before the graph's replay), and every cached key but the newest (written
by earlier steps), are therefore final when the attention starts; the newest key and value (context_len - 1)
and q are written by the qkv kernel it depends on, so they are read after the wait.

At W1's shape (8B, batch 1, context 512-768) each live split holds exactly one key tile, so the whole K / V read
moves in front of the wait and a program has only q, one key / value row and its math left once qkv is done.
"""
from __future__ import annotations

from stoker.engine.kernels._triton import tl, triton
from stoker.engine.kernels.kv_fp8_tiles import kv_for_dots

try:  # inline PTX, never under the interpreter (PDL_GDC is False there)
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except Exception:  # triton without the extra module: kernels with PDL_GDC=False never name them
    gdc_launch_dependents = gdc_wait = None


@triton.jit
def _first_tile_offsets(block_tables_ptr, seq, kv_head, block_table_stride, start, end, dims,
                        NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                        TILE_N: tl.constexpr):
    """Positions [TILE_N] of the split's first key tile, their live mask and K / V element offsets [TILE_N, D]."""
    pos = start + tl.arange(0, TILE_N)
    key_mask = pos < end
    block = tl.load(block_tables_ptr + seq * block_table_stride + pos // BLOCK_SIZE, mask=key_mask, other=0)
    slot = block.to(tl.int64) * BLOCK_SIZE + pos % BLOCK_SIZE
    return pos, key_mask, slot[:, None] * (NUM_KV_HEADS * HEAD_DIM) + kv_head * HEAD_DIM + dims[None, :]


@triton.jit
def pdl_first_tile_early(k_cache_ptr, v_cache_ptr, block_tables_ptr, seq, kv_head, block_table_stride, start, end,
                         context_len, dims, dim_mask, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                         BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr, GDC: tl.constexpr):
    """Before the wait: the first tile's keys and values except the newest (zeros there), then (GDC) wait for
    the qkv kernel and let the o_proj GEMV launch. Returns (k, v) [TILE_N, D] in the cache's dtype."""
    pos, key_mask, offsets = _first_tile_offsets(block_tables_ptr, seq, kv_head, block_table_stride, start, end,
                                                 dims, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE, TILE_N)
    older = (key_mask & (pos != context_len - 1))[:, None] & dim_mask[None, :]
    k = tl.load(k_cache_ptr + offsets, mask=older, other=0.0)
    v = tl.load(v_cache_ptr + offsets, mask=older, other=0.0)
    if GDC:
        gdc_wait()
        gdc_launch_dependents()
    return k, v


@triton.jit
def pdl_first_tile(q, k_early, v_early, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq, kv_head, block_table_stride,
                   start, end, context_len, dims, dim_mask, qk_scale, running_max, running_sum, acc,
                   NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr,
                   DOT_PRECISION: tl.constexpr, FP8_MODE: tl.constexpr = 0):
    """After the wait: the newest key / value row joined into the early tile, then the split kernel's online
    softmax step on it (the same operations as its loop body, so the result is the same bits as without PDL).
    An FP8 cache's tiles go to the dots' dtype as the loop's do (kv_for_dots; the loop's F16_VWORDS V path is the
    same exact e4m3 -> float16 conversion by words); its scales are in qk_scale and after the loop, as there.
    Returns (running_max, running_sum, acc)."""
    pos, key_mask, offsets = _first_tile_offsets(block_tables_ptr, seq, kv_head, block_table_stride, start, end,
                                                 dims, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE, TILE_N)
    newest = (key_mask & (pos == context_len - 1))[:, None]
    both = newest & dim_mask[None, :]
    k = tl.where(newest, kv_for_dots(tl.load(k_cache_ptr + offsets, mask=both, other=0.0), q.dtype, FP8_MODE),
                 kv_for_dots(k_early, q.dtype, FP8_MODE))
    v = tl.where(newest, kv_for_dots(tl.load(v_cache_ptr + offsets, mask=both, other=0.0), q.dtype, FP8_MODE),
                 kv_for_dots(v_early, q.dtype, FP8_MODE))
    scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
    scores = tl.where(key_mask[None, :], scores, float("-inf"))
    new_max = tl.maximum(running_max, tl.max(scores, axis=1))
    correction = tl.exp2(running_max - new_max)
    probs = tl.exp2(scores - new_max[:, None])
    running_sum = running_sum * correction + tl.sum(probs, axis=1)
    acc = acc * correction[:, None] + tl.dot(probs.to(v.dtype), v, input_precision=DOT_PRECISION)
    return new_max, running_sum, acc
