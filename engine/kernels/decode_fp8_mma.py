"""Decode attention over the FP8 KV cache with every K / V byte going from memory into tensor-core operand
registers in the layout the MMA wants (issue 14): a Gluon kernel, one warp a program.

Why: the Triton split kernel (attention.py) reads the FP8 cache at 60 % of the H200's bandwidth (ncu, session 20:
W2's decode, B = 1,024, context 640), held by the V tile's trip through shared memory (converted to fp16 in
registers, stored with 6.7-way bank conflicts to reach the MMA's layout, read back). Triton picks those layouts
itself; Gluon (triton.experimental.gluon, Triton 3.6) lets the kernel name them, so each tile arrives in the
layout the mma_v2 instruction wants its operand in, is converted in registers, and multiplied.

How the tiles land in operand registers. A program is (sequence, kv head, split), one warp; m16n8k16 fp16 MMAs
with float32 accumulators, the keys as the MMAs' rows and the group's query heads as their 8 (or 16) columns:
- scores^T = K q^T [TILE_N, BLOCK_G]: K is the A operand with k_width 4, so a lane holds 4 consecutive head dims
  of a key per 16-dim chunk. The dot does not care in which order it meets the head dims, so logical dim
  k = c*16 + t*4 + b reads physical dim t*(D/4) + c*4 + b: a lane then holds D/4 contiguous bytes of its key (two
  16-byte loads at D = 128), and q is read in the same order (once a program).
- out^T += V^T P^T [D, BLOCK_G]: V^T is the A operand with k_width 2; a lane holds rows (head dims)
  n = lane // 4 + 8 j, and row n is taken to be physical dim (n % 8) * (D/8) + n // 8, so a lane holds D/8
  contiguous bytes of each of its keys (one 16-byte load); the output is stored back through the same map. P^T
  reaches the B operand from the scores' accumulators by warp shuffles.
For K and V the layout of a lane's bytes is written out (load_layouts) and the relabelled tensor converted to the
operand layout with `assert_trivial=True`: the compiler refuses to build the kernel if any data would move. Keys
as rows rather than queries: with a group of 4 the 16 query rows an MMA needs would be 3/4 padding; as the N of
the instruction they are 8 wide, so the kernel issues half the MMAs and holds half the accumulators.

How the bytes get there (STAGES). Loaded straight into registers (STAGES = 0, no shared memory, sm_90: 94
registers at tile 16), ptxas sinks each 16-byte load to its first use: the sm_90 SASS waits for K's first half,
then its second, then V, one after the other in every tile, three dependent trips to memory (a higher register
cap moved V's loads only behind the first four MMAs). With STAGES > 0 (the default) each tile's K and V are
copied by cp.async into a ring of STAGES shared-memory slots, STAGES - 1 tiles ahead of the math: no register
waits for a copy in flight, so nothing can be sunk; the ring is swizzled (16-byte chunks XOR the row) so that
the reads back, 16 bytes a lane in the same layouts, meet no bank conflict. The block numbers of the next tile
to copy are loaded one tile early. The grid walks a sequence's kv heads first (HEAD_MAJOR): their rows lie side
by side in each cache block.

Measured (H200, ops/bench_decode_attention_fp8.py --w2, W2's decode B = 1,024, us, contexts 640 / 768; session 22
call 1): the split kernel's default 465.4 / 557.2; this kernel at tile 16 in registers 409.9 / 486.9, with the
block numbers a tile ahead 407.8 / 485.4 (not kept), heads first 400.5 / 475.4; the cp.async ring of 2 / 3 / 4
slots 347.3 / 350.5 / 346.5 at ctx 640 (411.4 / 416.0 / 412.4 at 768), tile 32 349.4 / 349.3; **3 slots, heads
first 342.1 / 407.7** (3.92 / 3.95 TB/s of FP8 bytes, ~92 % of copy bandwidth; the bf16 cache 626.2 / 746.6).
Earlier forms (session 21, removed): queries as the MMA's rows (404.3 at 32), the next tile's K and V prefetched
into registers (594.1 at 16, spills at 32). Splits > 1 write partials that attention._decode_reduce_kernel
combines. Needs sm_89+ (hardware e4m3 -> fp16 conversion), GROUP <= 16, HEAD_DIM a power of two in [32, 256];
`supported` says so and the caller falls back to the Triton split kernel otherwise.
"""
from __future__ import annotations

import torch
from stoker.engine.kernels._triton import HAS_TRITON, interpreting

try:  # Gluon ships with Triton >= 3.5; without it `supported` is False and nothing here is launched
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy, mma_v2

    HAS_GLUON = HAS_TRITON
except Exception:  # triton missing, too old, or broken
    HAS_GLUON = False

    class _Jit:
        @staticmethod
        def jit(fn=None, **_):  # noqa: ANN001, ANN205
            return fn if fn is not None else (lambda f: f)

    gluon, gl, mma_v2, async_copy = _Jit(), None, None, None

MAX_GROUP = 16  # query heads a kv head: two 8-wide MMA columns
# > 0: K and V tiles copied by cp.async into a ring of this many shared-memory slots, STAGES - 1 tiles ahead of
# the math; 0: loaded straight into registers (also where a cache is not 16-byte aligned).
STAGES = 3
# The grid's fastest axis over a sequence's kv heads instead of the batch.
HEAD_MAJOR = True


def _bits(n: int) -> list[int]:
    return [1 << i for i in range(n.bit_length() - 1)]


def load_layouts(tile_n: int, head_dim: int) -> tuple:
    """The register layouts the K and V tiles [tile_n, head_dim] are loaded in (one warp).
    K: lane // 4 picks the key (+8, +16, ... in registers), lane % 4 a quarter of D, D/4 contiguous bytes a lane.
    V: 2 * (lane % 4) + {0, 1} picks the key (+8, ... in registers), lane // 4 an eighth of D, D/8 bytes a lane."""
    k = gl.DistributedLinearLayout(
        reg_bases=[[0, b] for b in _bits(head_dim // 4)] + [[b, 0] for b in _bits(tile_n) if b >= 8],
        lane_bases=[[0, head_dim // 4], [0, head_dim // 2], [1, 0], [2, 0], [4, 0]],
        warp_bases=[], block_bases=[], shape=[tile_n, head_dim])
    v = gl.DistributedLinearLayout(
        reg_bases=[[0, b] for b in _bits(head_dim // 8)] + [[1, 0]] + [[b, 0] for b in _bits(tile_n) if b >= 8],
        lane_bases=[[2, 0], [4, 0]] + [[0, head_dim // 8 * b] for b in (1, 2, 4)],
        warp_bases=[], block_bases=[], shape=[tile_n, head_dim])
    return k, v


@gluon.jit
def _tile_blocks(table_row, tile_start, end, BLOCK_SIZE: gl.constexpr, TILE_N: gl.constexpr, LAYOUT: gl.constexpr):
    """The cache block numbers of the keys tile_start.. (0 past end): one scalar where the tile lies in one block
    (TILE_N divides BLOCK_SIZE; the tiles start at multiples of TILE_N), else one a key along LAYOUT's rows.
    attention._tile_blocks is the Triton kernels' twin (Gluon cannot call triton.jit functions)."""
    if BLOCK_SIZE % TILE_N == 0:
        return gl.load(table_row + tile_start // BLOCK_SIZE, mask=tile_start < end, other=0)
    else:
        keys = tile_start + gl.arange(0, TILE_N, layout=gl.SliceLayout(1, LAYOUT))
        return gl.load(table_row + keys // BLOCK_SIZE, mask=keys < end, other=0)


@gluon.jit
def _tile_pointers(cache_ptr, blocks, tile_start, kv_head, NUM_KV_HEADS: gl.constexpr, HEAD_DIM: gl.constexpr,
                   BLOCK_SIZE: gl.constexpr, TILE_N: gl.constexpr, LAYOUT: gl.constexpr, FIXED_ROWS: gl.constexpr):
    """Pointers to the cache's [TILE_N, D] tile of keys tile_start.. for kv_head, in LAYOUT (blocks: _tile_blocks'
    numbers for the tile). Where the tile lies in one block: its first row as a scalar and each lane's offsets
    from it 32-bit, either fixed (FIXED_ROWS: loop-invariant, fewer instructions a tile, more registers held;
    sm_90: 118 against 94 in the register form) or from the keys' positions in the block."""
    dims = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, LAYOUT))
    rows = gl.arange(0, TILE_N, layout=gl.SliceLayout(1, LAYOUT))
    if BLOCK_SIZE % TILE_N == 0:
        if FIXED_ROWS:
            first = (blocks.to(gl.int64) * BLOCK_SIZE + tile_start % BLOCK_SIZE) * NUM_KV_HEADS + kv_head
            return cache_ptr + first * HEAD_DIM + (rows[:, None] * (NUM_KV_HEADS * HEAD_DIM) + dims[None, :])
        else:
            base = cache_ptr + (blocks.to(gl.int64) * (BLOCK_SIZE * NUM_KV_HEADS) + kv_head) * HEAD_DIM
            return base + ((tile_start + rows) % BLOCK_SIZE)[:, None] * (NUM_KV_HEADS * HEAD_DIM) + dims[None, :]
    else:
        slot = blocks.to(gl.int64) * BLOCK_SIZE + (tile_start + rows) % BLOCK_SIZE
        return cache_ptr + slot[:, None] * (NUM_KV_HEADS * HEAD_DIM) + kv_head * HEAD_DIM + dims[None, :]


@gluon.jit
def _kv_tile(cache_ptr, blocks, tile_start, end, kv_head, NUM_KV_HEADS: gl.constexpr, HEAD_DIM: gl.constexpr,
             BLOCK_SIZE: gl.constexpr, TILE_N: gl.constexpr, LAYOUT: gl.constexpr):
    """The cache's [TILE_N, D] e4m3 tile of keys tile_start.. for kv_head, loaded into registers in LAYOUT; rows
    past end are 0."""
    keys = tile_start + gl.arange(0, TILE_N, layout=gl.SliceLayout(1, LAYOUT))
    pointers = _tile_pointers(cache_ptr, blocks, tile_start, kv_head, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE, TILE_N,
                              LAYOUT, False)
    return gl.load(pointers, mask=(keys < end)[:, None], other=0.0)


@gluon.jit
def _tile_math(k8, v8, q, tile_start, end, qk_scale, running_max, running_sum, acc, TILE_N: gl.constexpr,
               HEAD_DIM: gl.constexpr, BLOCK_G: gl.constexpr):
    """One key tile's update of the online softmax: k8 / v8 the e4m3 tiles in K_LOAD / V_LOAD, q^T the scores
    dot's B operand -> (running_max, running_sum, acc)."""
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, 1], instr_shape=[16, 8])
    a2: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
    b2: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=2)
    a4: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=4)
    k = gl.reshape(k8.to(gl.float16), [TILE_N, 4, HEAD_DIM // 16, 4])
    k = gl.reshape(gl.permute(k, [0, 2, 1, 3]), [TILE_N, HEAD_DIM])
    k = gl.convert_layout(k, a4, assert_trivial=True)
    scores = mma_v2(k, q, gl.full([TILE_N, BLOCK_G], 0.0, gl.float32, layout=mma)) * qk_scale
    keys = tile_start + gl.arange(0, TILE_N, layout=gl.SliceLayout(1, mma))
    scores = gl.where((keys < end)[:, None], scores, float("-inf"))
    new_max = gl.maximum(running_max, gl.max(scores, axis=0))
    correction = gl.exp2(running_max - new_max)
    probs = gl.exp2(scores - new_max[None, :])
    running_sum = running_sum * correction + gl.sum(probs, axis=0)
    p = gl.convert_layout(probs.to(gl.float16), b2)  # shuffles within the warp
    v = gl.reshape(v8.to(gl.float16), [TILE_N, 8, HEAD_DIM // 8])
    v = gl.reshape(gl.permute(v, [0, 2, 1]), [TILE_N, HEAD_DIM])
    v = gl.convert_layout(gl.permute(v, [1, 0]), a2, assert_trivial=True)
    acc = mma_v2(v, p, acc * correction[None, :])
    return new_max, running_sum, acc


@gluon.jit
def _copy_tile(k_slot, v_slot, k_cache_ptr, v_cache_ptr, k_blocks, v_blocks, tile_start, end, kv_head,
               NUM_KV_HEADS: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_SIZE: gl.constexpr, TILE_N: gl.constexpr,
               K_LOAD: gl.constexpr, V_LOAD: gl.constexpr):
    """Start the cp.async copies of one tile's K and V into shared-memory slots (rows past end are zero-filled) and
    commit them as one group."""
    k_keys = tile_start + gl.arange(0, TILE_N, layout=gl.SliceLayout(1, K_LOAD))
    v_keys = tile_start + gl.arange(0, TILE_N, layout=gl.SliceLayout(1, V_LOAD))
    async_copy.async_copy_global_to_shared(
        k_slot, _tile_pointers(k_cache_ptr, k_blocks, tile_start, kv_head, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE,
                               TILE_N, K_LOAD, True), mask=(k_keys < end)[:, None])
    async_copy.async_copy_global_to_shared(
        v_slot, _tile_pointers(v_cache_ptr, v_blocks, tile_start, kv_head, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE,
                               TILE_N, V_LOAD, True), mask=(v_keys < end)[:, None])
    async_copy.commit_group()


# Integer arguments that vary between launches are not specialized on (as attention._decode_split_kernel).
@gluon.jit(do_not_specialize=["block_table_stride"])
def _decode_fp8_mma_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, context_lens_ptr, out_ptr,
    part_out_ptr, part_max_ptr, part_sum_ptr, k_scale_ptr, v_scale_ptr,
    qk_scale, q_seq_stride, q_head_stride, block_table_stride, out_seq_stride, out_head_stride,
    NUM_KV_HEADS: gl.constexpr, GROUP: gl.constexpr, BLOCK_G: gl.constexpr, HEAD_DIM: gl.constexpr,
    BLOCK_SIZE: gl.constexpr, TILE_N: gl.constexpr, NUM_SPLITS: gl.constexpr,
    K_LOAD: gl.constexpr, V_LOAD: gl.constexpr, HEAD_MAJOR: gl.constexpr, STAGES: gl.constexpr,
):
    if HEAD_MAJOR:  # the grid's fastest axis walks a sequence's kv heads (their rows lie side by side in a block)
        kv_head = gl.program_id(0)
        seq = gl.program_id(1).to(gl.int64)
    else:
        seq = gl.program_id(0).to(gl.int64)
        kv_head = gl.program_id(1)
    split = gl.program_id(2)
    context_len = gl.load(context_lens_ptr + seq)
    split_len = gl.cdiv(gl.cdiv(gl.maximum(context_len, 1), NUM_SPLITS), TILE_N) * TILE_N
    start = split * split_len
    end = gl.minimum(start + split_len, context_len)
    if (split > 0) & (start >= context_len):
        return
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, 1], instr_shape=[16, 8])
    b4: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=4)

    # q^T [D, BLOCK_G] as the scores dot's B operand, its head dims in K's relabelled order
    kq = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(1, b4))
    g = gl.arange(0, BLOCK_G, layout=gl.SliceLayout(0, b4))
    dq = (kq // 4 % 4) * (HEAD_DIM // 4) + (kq // 16) * 4 + kq % 4
    q = gl.load(q_ptr + seq * q_seq_stride + (kv_head * GROUP + g)[None, :] * q_head_stride + dq[:, None],
                mask=(g < GROUP)[None, :], other=0.0)
    q = gl.minimum(gl.maximum(q.to(gl.float32), -65504.0), 65504.0).to(gl.float16)
    qk_scale = qk_scale * gl.load(k_scale_ptr)

    running_max = gl.full([BLOCK_G], float("-inf"), gl.float32, layout=gl.SliceLayout(0, mma))
    running_sum = gl.full([BLOCK_G], 0.0, gl.float32, layout=gl.SliceLayout(0, mma))
    acc = gl.full([HEAD_DIM, BLOCK_G], 0.0, gl.float32, layout=mma)
    table_row = block_tables_ptr + seq * block_table_stride
    ONE_BLOCK: gl.constexpr = BLOCK_SIZE % TILE_N == 0  # a tile's keys share one block number
    if STAGES > 0:
        # cp.async copies STAGES - 1 tiles ahead of the math into a ring of shared-memory slots (swizzled so that
        # the loads below, 16 bytes a lane in K_LOAD / V_LOAD, meet no bank conflict); no register holds a copy in
        # flight, so ptxas cannot sink the loads to their first use (it did: K and V were waited for one after
        # the other in every tile of the register form).
        smem: gl.constexpr = gl.SwizzledSharedLayout(16, max(1, 128 // HEAD_DIM), min(8, HEAD_DIM // 16),
                                                      [1, 0])
        k_ring = gl.allocate_shared_memory(k_cache_ptr.dtype.element_ty, [STAGES, TILE_N, HEAD_DIM], smem)
        v_ring = gl.allocate_shared_memory(v_cache_ptr.dtype.element_ty, [STAGES, TILE_N, HEAD_DIM], smem)
        for s in gl.static_range(STAGES - 1):
            kb = _tile_blocks(table_row, start + s * TILE_N, end, BLOCK_SIZE, TILE_N, K_LOAD)
            vb = kb if ONE_BLOCK else _tile_blocks(table_row, start + s * TILE_N, end, BLOCK_SIZE, TILE_N, V_LOAD)
            _copy_tile(k_ring.index(s), v_ring.index(s), k_cache_ptr, v_cache_ptr, kb, vb, start + s * TILE_N, end,
                       kv_head, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE, TILE_N, K_LOAD, V_LOAD)
        ahead = start + (STAGES - 1) * TILE_N  # the next tile to copy; its block numbers loaded one tile early
        k_next = _tile_blocks(table_row, ahead, end, BLOCK_SIZE, TILE_N, K_LOAD)
        v_next = k_next if ONE_BLOCK else _tile_blocks(table_row, ahead, end, BLOCK_SIZE, TILE_N, V_LOAD)
        for tile in range(gl.cdiv(end - start, TILE_N)):
            slot = (tile + STAGES - 1) % STAGES
            _copy_tile(k_ring.index(slot), v_ring.index(slot), k_cache_ptr, v_cache_ptr, k_next, v_next, ahead, end,
                       kv_head, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE, TILE_N, K_LOAD, V_LOAD)
            ahead += TILE_N
            k_next = _tile_blocks(table_row, ahead, end, BLOCK_SIZE, TILE_N, K_LOAD)
            v_next = k_next if ONE_BLOCK else _tile_blocks(table_row, ahead, end, BLOCK_SIZE, TILE_N, V_LOAD)
            async_copy.wait_group(STAGES - 1)  # this tile's group has landed (this lane's copies)
            gl.thread_barrier()  # and every lane's
            k8 = k_ring.index(tile % STAGES).load(K_LOAD)
            v8 = v_ring.index(tile % STAGES).load(V_LOAD)
            running_max, running_sum, acc = _tile_math(k8, v8, q, start + tile * TILE_N, end, qk_scale, running_max,
                                                       running_sum, acc, TILE_N, HEAD_DIM, BLOCK_G)
    else:
        for tile_start in range(start, end, TILE_N):
            k_blocks = _tile_blocks(table_row, tile_start, end, BLOCK_SIZE, TILE_N, K_LOAD)
            v_blocks = k_blocks if ONE_BLOCK else _tile_blocks(table_row, tile_start, end, BLOCK_SIZE, TILE_N, V_LOAD)
            k8 = _kv_tile(k_cache_ptr, k_blocks, tile_start, end, kv_head, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE,
                          TILE_N, K_LOAD)
            v8 = _kv_tile(v_cache_ptr, v_blocks, tile_start, end, kv_head, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE,
                          TILE_N, V_LOAD)
            running_max, running_sum, acc = _tile_math(k8, v8, q, tile_start, end, qk_scale, running_max,
                                                       running_sum, acc, TILE_N, HEAD_DIM, BLOCK_G)
    acc = acc * gl.load(v_scale_ptr)

    columns = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(1, mma))
    dims = (columns % 8) * (HEAD_DIM // 8) + columns // 8
    og = gl.arange(0, BLOCK_G, layout=gl.SliceLayout(0, mma))
    heads = kv_head * GROUP + og
    head_mask = og < GROUP
    if NUM_SPLITS == 1:
        gl.store(out_ptr + seq * out_seq_stride + heads[None, :] * out_head_stride + dims[:, None],
                 (acc / running_sum[None, :]).to(out_ptr.dtype.element_ty), mask=head_mask[None, :])
    else:
        part = (seq * (NUM_KV_HEADS * GROUP) + heads) * NUM_SPLITS + split
        gl.store(part_max_ptr + part, running_max, mask=head_mask)
        gl.store(part_sum_ptr + part, running_sum, mask=head_mask)
        gl.store(part_out_ptr + part[None, :] * HEAD_DIM + dims[:, None], acc, mask=head_mask[None, :])


def supported(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Whether this kernel runs these shapes here (else the Triton split kernel does)."""
    if not (HAS_GLUON and q.is_cuda and not interpreting() and k_cache.dtype == torch.float8_e4m3fn):
        return False
    if q.dtype not in (torch.float16, torch.bfloat16) or torch.cuda.get_device_capability(q.device) < (8, 9):
        return False
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    group = q.shape[1] // num_kv_heads
    return 1 <= group <= MAX_GROUP and head_dim in (32, 64, 128, 256)


def decode_fp8_mma(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                   context_lens: torch.Tensor, qk_scale: float, k_scale: torch.Tensor, v_scale: torch.Tensor,
                   out: torch.Tensor, partials: tuple[torch.Tensor, torch.Tensor, torch.Tensor], num_splits: int,
                   tile_n: int = 16, head_major: bool | None = None, stages: int | None = None) -> None:
    """out [B, Hq, D] = attention of q [B, Hq, D] over the FP8 cache [blocks, block_size, Hkv, D], qk_scale the
    softmax scale times log2(e) (the scores stay in the log2 domain, as attention.py's kernels keep them). With
    num_splits > 1, partials (attention._decode_partials: outputs, maxima, sums) receive the splits and out is left
    to the reduce; with one split they are not touched. head_major / stages: None takes HEAD_MAJOR / STAGES."""
    batch, num_q_heads, head_dim = q.shape
    num_kv_heads, block_size = k_cache.shape[2], k_cache.shape[1]
    group = num_q_heads // num_kv_heads
    k_load, v_load = load_layouts(tile_n, head_dim)
    part_out, part_max, part_sum = partials
    head_major = HEAD_MAJOR if head_major is None else head_major
    stages = STAGES if stages is None else stages
    if k_cache.data_ptr() % 16 or v_cache.data_ptr() % 16:  # cp.async copies 16 bytes from 16-byte boundaries
        stages = 0
    grid = (num_kv_heads, batch, num_splits) if head_major else (batch, num_kv_heads, num_splits)
    _decode_fp8_mma_kernel[grid](
        q, k_cache, v_cache, block_tables, context_lens, out, part_out, part_max, part_sum, k_scale, v_scale,
        qk_scale, q.stride(0), q.stride(1), block_tables.stride(0), out.stride(0), out.stride(1),
        NUM_KV_HEADS=num_kv_heads, GROUP=group, BLOCK_G=max(8, 1 << (group - 1).bit_length()), HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size, TILE_N=tile_n, NUM_SPLITS=num_splits, K_LOAD=k_load, V_LOAD=v_load,
        HEAD_MAJOR=head_major, STAGES=stages, num_warps=1)
