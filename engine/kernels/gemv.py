"""Fused small-M GEMV for the decode path: y = x @ W^T for M = 1..16 tokens, with the ops around a
projection folded into its prologue and epilogue (cuBLAS stays for larger M).

Row-parallel: each program owns BLOCK_N output columns (weight rows) for all M tokens and streams the full K
of its rows (no split-K, so no partials and no reduce kernel), accumulating in float32. Variants, all through
constexpr flags of one kernel:

- prologue RMSNorm: each program sums the squares of its x rows in a short pass of its own (x is M*K
  elements, an L2 hit for every program after the first), and 1/rms scales the accumulator at the end
  (sum_k W[n,k] g[k] x[k] / rms). The fast form takes the norm weight folded into W at load time
  (`fold_norm_weight`, `norm_folded=True`), so the weight loop is exactly the plain GEMV; with `norm_weight`
  unfolded, x is scaled by g inside the loop, which costs 2-3x on the tl.dot path (measured, see
  gemv_config). Optionally with the residual add before it (`norm_residual`, an in-loop variant): s = x +
  residual, rounded to the model dtype like torch; program 0 writes s out exactly once (into a new buffer:
  other programs still read the old residual, so it must never be updated in place). The decode path does
  not need it (the residual add lives in the o_proj / down epilogue) but where fused_decode.MLP_FINISH_IN_QKV
  is on: there qkv's x is the fused MLP's float32 accumulator, rounded to the model dtype before the add
  (`x_accumulator`, the X_ACC variant), and the launch after it zeroes that accumulator (`zero_accumulator`).
  Measured cost (H200, bf16, 2026-12-01) of the first pre-pass, BLOCK_K-wide slices of all BLOCK_M rows:
  K / BLOCK_K L2 round trips per program before its weight stream starts, +12 us on the 8B qkv (26.3 vs
  14.2 us plain at M = 1) and +21 us on gate_up (78.9 vs 57.7), slower than a separate RMSNorm kernel
  (~2 us). It now reads each live row in slices as wide as the registers allow (_row_sumsq: 1-4 round trips
  at M = 1); its H200 figure is ops/bench_gemv.py --ablate's "fold" columns;
- bias (Qwen2's q/k/v bias);
- SiLU-and-mul epilogue (`silu_mul`): weight rows are [gate; up] as in engine/models/llama.py; each program
  streams gate row n and up row I + n and writes silu(gate) * up;
- residual-add epilogue (`add`): out = x @ W^T + add (o_proj, down);
- rotary + paged KV-cache write in the QKV epilogue (`gemv_rotary_cache_triton`), optionally with Qwen3's
  per-head q/k RMSNorm before the rotation: a program owns rows (d, d + D/2) of one head. The cache is in the
  model dtype or float8_e4m3fn (the FP8_CACHE store: k / k_scale and v / v_scale as kv_quant.py defines them);
- FP8 weights (`weight_scale`, issue 14): E4M3 [N, K] with a float32 scale per output row, converted in
  registers (`weight_convert`: Triton's cast of the float8 tile, or int32-word loads through fp8_convert.py's
  bit trick / inline cvt.rn.f16x2.e4m3x2, joined back into the tile), the scale applied to the float32 sums
  before every epilogue above; what each costs is in engine/models/fused_decode.py (FP8_WEIGHT_CONVERT). At one
  token on the CUDA cores each thread sums its run of products in registers every K step (ROW_SUM_FP8): the
  accumulator's registers, not the arithmetic, were what held these GEMVs below the copy bandwidth;
- programmatic dependent launch (`pdl`): the kernel may start while the previous one drains; before
  `griddepcontrol.wait` it touches only weights (the first tile, into registers), and it lets the next kernel
  launch right after the wait. Every kernel of the chain must wait before reading its predecessor's outputs and
  trigger only after its own wait: then a kernel that starts early finds everything older than its predecessor
  complete (engine/kernels/decode_pdl.py, the attention's part). Off under the CPU interpreter.

Rounding follows the unfused path where it is cheap (the projection output is rounded to the model dtype
before SiLU, before rotary and before a residual add); the prologue norm is applied in float32 to the
accumulator instead of rounding the normalised x first, a difference well inside the dtype's tolerance.

Weight layout: the checkpoint's [N, K] (K contiguous) already gives 16-byte loads (8 bf16 along K: ld.global.v4
on the CUDA-core path, cp.async of 16 bytes on the tl.dot path, checked in the sm_90 PTX) when K and the row
stride are multiples of 8 elements, which holds for every model we load (Triton specialises on 16-divisible
strides), so no transposition or tiling re-layout is needed; the one load-time change that pays is folding
the RMSNorm weight into the next projection (fold_norm_weight).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from stoker.engine.kernels._triton import check_launchable, interpreting, tl, triton
from stoker.engine.kernels.activation import silu_and_mul_ref
from stoker.engine.kernels.fp8_convert import CONVERT_CODE, e4m3_words_to_tile
from stoker.engine.kernels.kv_quant import check_scale, is_fp8_cache
from stoker.engine.kernels.rmsnorm import rms_norm_ref
from stoker.engine.kernels.rotary import _to_fp8, rotary_and_cache_ref

try:  # inline PTX (griddepcontrol.*): only reached when PDL_GDC is set (USE_PDL on the GPU), never under the interpreter
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except Exception:  # triton missing or without the extra module: the USE_PDL=False kernels never name them
    gdc_launch_dependents = gdc_wait = None

GEMV_MAX_M = 16  # above this the unfused path (cuBLAS) is used: the kernel's dot tile is 16 tokens tall


# -------------------------------------------------------------------------------------------- reference
def check_gemv_args(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    norm_weight: torch.Tensor | None,
    norm_residual: torch.Tensor | None,
    silu_mul: bool,
    add: torch.Tensor | None,
    norm_folded: bool = False,
    weight_scale: torch.Tensor | None = None,
) -> int:
    """Validates shapes and dtypes; returns the output width."""
    if norm_folded and norm_weight is not None:
        raise ValueError("gemv: norm_folded means the norm weight is already in `weight`; pass no norm_weight")
    if x.dim() != 2 or weight.dim() != 2 or weight.shape[1] != x.shape[1]:
        raise ValueError(f"gemv: x [M, K] and weight [N, K] expected, got {tuple(x.shape)}, {tuple(weight.shape)}")
    num_rows, hidden = x.shape
    n_total = weight.shape[0]
    if weight_scale is not None:  # FP8 weights (W8A16): one float32 scale per output row
        if weight.dtype != torch.float8_e4m3fn or weight_scale.dtype != torch.float32 or weight_scale.shape != (n_total,):
            raise ValueError(f"gemv: weight_scale means float8_e4m3fn weights with float32 [{n_total}] row scales, got "
                             f"{weight.dtype} and {weight_scale.dtype} {tuple(weight_scale.shape)}")
    elif weight.dtype != x.dtype:
        raise ValueError(f"gemv: weight dtype {weight.dtype} differs from x dtype {x.dtype}")
    if silu_mul and n_total % 2:
        raise ValueError(f"gemv: silu_mul needs weight rows [gate; up], got an odd {n_total}")
    n_out = n_total // 2 if silu_mul else n_total
    if bias is not None and (bias.shape != (n_total,) or bias.dtype != x.dtype):
        raise ValueError(f"gemv: bias must be [{n_total}] {x.dtype}, got {tuple(bias.shape)} {bias.dtype}")
    if norm_weight is not None and (norm_weight.shape != (hidden,) or norm_weight.dtype != x.dtype):
        raise ValueError(f"gemv: norm_weight must be [{hidden}] {x.dtype}, got "
                         f"{tuple(norm_weight.shape)} {norm_weight.dtype}")
    if norm_residual is not None:
        if norm_weight is None and not norm_folded:
            raise ValueError("gemv: norm_residual is the residual add before the prologue norm; pass norm_weight")
        if norm_residual.shape != x.shape or norm_residual.dtype != x.dtype:
            raise ValueError(f"gemv: norm_residual must match x ({tuple(x.shape)}, {x.dtype}), got "
                             f"{tuple(norm_residual.shape)}, {norm_residual.dtype}")
    if add is not None and (add.shape != (num_rows, n_out) or add.dtype != x.dtype):
        raise ValueError(f"gemv: add must be [{num_rows}, {n_out}] {x.dtype}, got {tuple(add.shape)} {add.dtype}")
    return n_out


def fold_norm_weight(weight: torch.Tensor, norm_weight: torch.Tensor) -> torch.Tensor:
    """Load-time re-layout for the fast prologue norm: W' = W diag(g), in float32 then rounded to W's dtype,
    so that x @ W'^T / rms(x) = (x / rms(x) * g) @ W^T. Only for a norm whose output feeds this one
    projection (input_layernorm -> qkv, post_attention_layernorm -> gate_up, norm -> lm_head)."""
    if weight.dim() != 2 or norm_weight.shape != (weight.shape[1],):
        raise ValueError(f"fold_norm_weight: weight [N, K] and norm_weight [K] expected, got "
                         f"{tuple(weight.shape)}, {tuple(norm_weight.shape)}")
    return (weight.float() * norm_weight.float()[None, :]).to(weight.dtype)


def gemv_ref(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    norm_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
    norm_residual: torch.Tensor | None = None,
    silu_mul: bool = False,
    add: torch.Tensor | None = None,
    norm_folded: bool = False,
    weight_scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The unfused ops the kernel replaces, in order; returns (out, s).

    s = x + norm_residual (rounded to x.dtype) or x; h = rms_norm(s) * norm_weight if norm_weight is given,
    else s; y = F.linear(h, weight, bias); y = silu(y[:, :I]) * y[:, I:] if silu_mul; out = y + add if add.
    norm_folded: `weight` is fold_norm_weight(W, g): h = rms_norm(s) with a weight of ones.
    weight_scale: `weight` is FP8 with these row scales; F.linear takes it dequantized to x.dtype (as
    fp8_linear_ref does; the kernel applies the scale to its float32 sums instead, within the dtype's tolerance).
    """
    check_gemv_args(x, weight, bias, norm_weight, norm_residual, silu_mul, add, norm_folded, weight_scale)
    if weight_scale is not None:
        weight = (weight.float() * weight_scale[:, None]).to(x.dtype)
    if norm_folded:
        h, s = rms_norm_ref(x, torch.ones(x.shape[1], dtype=x.dtype, device=x.device), eps, norm_residual)
    elif norm_weight is not None:
        h, s = rms_norm_ref(x, norm_weight, eps, norm_residual)
    else:
        h = s = x
    y = F.linear(h, weight, bias)
    if silu_mul:
        y = silu_and_mul_ref(y)
    if add is not None:
        y = y + add
    return y, s


def gemv_carried_ref(
    x: torch.Tensor, weight: torch.Tensor, norm_sums: torch.Tensor, eps: float, *, silu_mul: bool = False,
    bias: torch.Tensor | None = None, weight_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """What a consumer of the carried norm computes: x = s * g (the producer's carry.x), the sums of s^2 in
    norm_sums' slots; y = (x @ W^T) / sqrt(sum / K + eps) in float32, rounded to x's dtype, then the bias, then
    SiLU-and-mul. Equal to F.linear(rms_norm(s) * g, W) up to where the rounding falls."""
    if weight_scale is not None:
        weight = (weight.float() * weight_scale[:, None]).to(x.dtype)
    sumsq = norm_sums[: x.shape[0]].sum(dim=1).float() / NORM_SUM_UNIT
    inv_rms = torch.rsqrt(sumsq / x.shape[1] + eps)[:, None]
    y = (F.linear(x.float(), weight.float()) * inv_rms).to(x.dtype)
    if bias is not None:
        y = y + bias
    return silu_and_mul_ref(y) if silu_mul else y


def gemv_rotary_cache_ref(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    *,
    num_heads: int,
    num_kv_heads: int,
    positions: torch.Tensor,
    cos_sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    norm_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
    norm_residual: torch.Tensor | None = None,
    q_norm: torch.Tensor | None = None,
    k_norm: torch.Tensor | None = None,
    norm_folded: bool = False,
    weight_scale: torch.Tensor | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    x_accumulator: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The QKV block of a Llama decoder layer up to attention: [norm ->] qkv = F.linear(h, W, b) -> (Qwen3)
    per-head RMSNorm of q and k -> rotary of q and k + k/v written into the paged caches. Returns (qkv, s)
    with qkv [M, (Hq + 2 Hkv) D] holding rotated q and k (the decode attention reads q from it).
    k_scale, v_scale: an FP8 cache's per-tensor scales (rotary_and_cache_ref stores quantize_kv of the rotated k
    as qkv holds it, and of v); unused for a cache in the model dtype.
    x_accumulator: x is the float32 sums of the projection before, rounded to norm_residual's dtype first (then
    s = x + norm_residual as ever: together fused_mlp_finish_ref's rounding)."""
    if x_accumulator:
        if norm_residual is None:
            raise ValueError("gemv_rotary_cache: x_accumulator rounds x before norm_residual's add: pass it")
        x = x.to(norm_residual.dtype)
    qkv, s = gemv_ref(x, weight, bias, norm_weight=norm_weight, eps=eps, norm_residual=norm_residual,
                      norm_folded=norm_folded, weight_scale=weight_scale)
    num_tokens = x.shape[0]
    head_dim = k_cache.shape[-1]
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    if qkv.shape[1] != q_size + 2 * kv_size:
        raise ValueError(f"gemv_rotary_cache: weight has {qkv.shape[1]} rows, expected (Hq + 2 Hkv) * D = "
                         f"{q_size + 2 * kv_size}")
    if (q_norm is None) != (k_norm is None):
        raise ValueError("gemv_rotary_cache: q_norm and k_norm go together")
    q = qkv[:, :q_size].view(num_tokens, num_heads, head_dim)
    k = qkv[:, q_size : q_size + kv_size].view(num_tokens, num_kv_heads, head_dim)
    v = qkv[:, q_size + kv_size :].view(num_tokens, num_kv_heads, head_dim)
    if q_norm is not None and k_norm is not None:
        q.copy_(rms_norm_ref(q.reshape(-1, head_dim), q_norm, eps)[0].view_as(q))
        k.copy_(rms_norm_ref(k.reshape(-1, head_dim), k_norm, eps)[0].view_as(k))
    rotary_and_cache_ref(q, k, v, positions, cos_sin, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    return qkv, s


# ----------------------------------------------------------------------------------------------- kernel
@triton.jit
def _load_w(wa_ptrs, wb_ptrs, k0, w_mask_rows, ks, K, PAIRED: tl.constexpr, W_CONVERT: tl.constexpr):
    if W_CONVERT != 0:  # FP8 as int32 words (4 codes each): ks counts words, the pointers step in words
        mask = w_mask_rows[:, None] & (k0 // 4 + ks[None, :] < K // 4)
        wa = tl.load(wa_ptrs + k0 // 4, mask=mask, other=0)
        wb = tl.load(wb_ptrs + k0 // 4, mask=mask, other=0) if PAIRED else wa
    else:
        mask = w_mask_rows[:, None] & (k0 + ks[None, :] < K)
        wa = tl.load(wa_ptrs + k0, mask=mask, other=0.0)
        wb = tl.load(wb_ptrs + k0, mask=mask, other=0.0) if PAIRED else wa
    return wa, wb


@triton.jit
def _accumulate(acc, x, w, USE_DOT: tl.constexpr, DOT_PRECISION: tl.constexpr, W_CONVERT: tl.constexpr,
                W_VEC: tl.constexpr, W_SUM: tl.constexpr):
    if W_CONVERT != 0:  # FP8 words -> the float32 [BN, BK] tile (fp8_convert.py; "bits": times 2^-8)
        w = e4m3_words_to_tile(w, W_CONVERT, w.shape[0], 4 * w.shape[1])
    if USE_DOT:  # x [BM, BK] (model dtype) . w^T [BK, BN] on the tensor cores -> [BM, BN]
        acc = tl.dot(x, tl.trans(w.to(x.dtype)), acc, input_precision=DOT_PRECISION)  # FP8 w: to x's dtype
    elif W_SUM:  # one token, each thread's runs of W_VEC products summed in registers into [BN, BK / W_VEC]
        acc += tl.sum(tl.reshape(x * w.to(tl.float32), [w.shape[0], w.shape[1] // W_VEC, W_VEC]), axis=2)
    elif W_VEC != 0:  # one token: x [1, BK] * w [BN, BK] into a [BN, BK] tile in the weight load's layout
        acc += x * w.to(tl.float32)
    else:  # [BM, 1, BK] * [1, BN, BK] on the CUDA cores, summed over K once after the loop
        acc += x[:, None, :] * w.to(tl.float32)[None, :, :]
    return acc


@triton.jit
def _gemv_step(
    k0, wa, wb, acc_a, acc_b, sumsq,
    x_ptr, x_stride, hres_ptr, hres_stride, res_out_ptr, res_out_stride, norm_ptr,
    m, m_mask, ks, K, write_residual,
    PRO_RESIDUAL: tl.constexpr, APPLY_G: tl.constexpr, PAIRED: tl.constexpr,
    USE_DOT: tl.constexpr, DOT_PRECISION: tl.constexpr, W_CONVERT: tl.constexpr, W_VEC: tl.constexpr,
    W_SUM: tl.constexpr, X_ACC: tl.constexpr,
):
    """One BLOCK_K slice: load (and norm-prepare) the x slice of every token, multiply-accumulate."""
    k = k0 + ks
    k_mask = k < K
    xm = m_mask[:, None] & k_mask[None, :]
    x = tl.load(x_ptr + m[:, None] * x_stride + k[None, :], mask=xm, other=0.0)
    if PRO_RESIDUAL:
        r = tl.load(hres_ptr + m[:, None] * hres_stride + k[None, :], mask=xm, other=0.0)
        model_dtype = hres_ptr.dtype.element_ty  # the residual's: x's too, unless x is a float32 accumulator
        if X_ACC:  # the previous projection's float32 sums: rounded to the model dtype first (fused_mlp's finish)
            x = x.to(model_dtype)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(model_dtype)  # rounded like `x + r`
        tl.store(res_out_ptr + m[:, None] * res_out_stride + k[None, :], x, mask=xm & write_residual)
    if PRO_RESIDUAL or APPLY_G or not USE_DOT:
        x32 = x.to(tl.float32)
        if PRO_RESIDUAL:  # the rms of s = x + residual can only be summed here, slice by slice
            sumsq += tl.sum(x32 * x32, axis=1)
        if APPLY_G:  # an unfolded norm weight: scale x by it in the loop (slower, see gemv_config)
            x32 = x32 * tl.load(norm_ptr + k, mask=k_mask, other=0.0).to(tl.float32)[None, :]
        xo = x32.to(x.dtype) if USE_DOT else x32  # the dot's operands in the model dtype (x's after the add)
    else:
        xo = x  # straight from the pipelined load into the dot: the fast path
    acc_a = _accumulate(acc_a, xo, wa, USE_DOT, DOT_PRECISION, W_CONVERT, W_VEC, W_SUM)
    if PAIRED:
        acc_b = _accumulate(acc_b, xo, wb, USE_DOT, DOT_PRECISION, W_CONVERT, W_VEC, W_SUM)
    return acc_a, acc_b, sumsq


@triton.jit
def _row_sumsq(x_ptr, x_stride, M, K, BLOCK_M: tl.constexpr, CHUNK: tl.constexpr):
    """[BLOCK_M] float32 sums of squares of the M live rows of x. One live row at a time in CHUNK-wide
    slices (CHUNK = K rounded up to a power of two, at most 32 elements a thread): at M = 1 that is one to
    four L2 round trips before the weight stream starts, where BLOCK_K-wide slices of all BLOCK_M rows (the
    tile's 15 padding rows included on the tl.dot path) took K / BLOCK_K = 32 of them at the 8B shape."""
    rows = tl.arange(0, BLOCK_M)
    cols = tl.arange(0, CHUNK)
    sumsq = tl.zeros([BLOCK_M], dtype=tl.float32)
    for row in range(0, M):
        row_sum = tl.zeros([CHUNK], dtype=tl.float32)
        for c0 in range(0, K, CHUNK):
            xr = tl.load(x_ptr + row * x_stride + c0 + cols, mask=c0 + cols < K, other=0.0).to(tl.float32)
            row_sum += xr * xr
        sumsq = tl.where(rows == row, tl.sum(row_sum, axis=0), sumsq)
    return sumsq


@triton.jit
def _load_slots(sums_ptr, m, m_mask, NUM_SLOTS: tl.constexpr, SLOT_STRIDE: tl.constexpr):
    """A carried norm's int64 slots [BLOCK_M, NUM_SLOTS] of tokens m (norm_sums_buffer's layout; 0 past M)."""
    slots = tl.arange(0, NUM_SLOTS) * SLOT_STRIDE
    return tl.load(sums_ptr + m[:, None] * (NUM_SLOTS * SLOT_STRIDE) + slots[None, :], mask=m_mask[:, None], other=0)


@triton.jit
def _slots_sumsq(sums, SUM_UNIT: tl.constexpr):
    """_load_slots' slots -> each token's float32 sum of squares."""
    return tl.sum(sums, axis=1).to(tl.float32) * (1.0 / SUM_UNIT)


@triton.jit
def _fixed_point(total, SUM_UNIT: tl.constexpr):
    """A float32 share of a sum of squares -> int64 units of 1 / SUM_UNIT: integer adds give the same total in any
    order (float atomics would not: the step's result would change from run to run)."""
    return (total * SUM_UNIT + 0.5).to(tl.int64)


@triton.jit
def _zero_slots(sums_ptr, enabled, SUMS_ROWS: tl.constexpr, NUM_SLOTS: tl.constexpr, SLOT_STRIDE: tl.constexpr):
    """Every slot of SUMS_ROWS tokens set to zero, where `enabled` (one program of the grid)."""
    slot_ids = tl.arange(0, SUMS_ROWS * NUM_SLOTS)
    tl.store(sums_ptr + slot_ids * SLOT_STRIDE, tl.zeros([SUMS_ROWS * NUM_SLOTS], tl.int64),
             mask=(slot_ids >= 0) & enabled)


@triton.jit
def _gemv_kernel(
    x_ptr, w_ptr, out_ptr, bias_ptr, norm_ptr, hres_ptr, res_out_ptr, add_ptr,
    positions_ptr, cos_sin_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, q_norm_ptr, k_norm_ptr, w_scale_ptr,
    sums_in_ptr, sums_out_ptr, sums_zero_ptr, carry_g_ptr, carry_out_ptr, k_scale_ptr, v_scale_ptr, acc_zero_ptr,
    M, N_OUT, K, eps,
    x_stride, w_stride, out_stride, hres_stride, res_out_stride, add_stride, carry_out_stride,
    NUM_Q_HEADS, NUM_KV_HEADS,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    USE_DOT: tl.constexpr, DOT_PRECISION: tl.constexpr,
    NORM: tl.constexpr, PRO_RESIDUAL: tl.constexpr, APPLY_G: tl.constexpr, HAS_BIAS: tl.constexpr,
    SILU_MUL: tl.constexpr, ADD: tl.constexpr,
    ROTARY: tl.constexpr, QK_NORM: tl.constexpr, HALF: tl.constexpr, SPLITS_PER_HEAD: tl.constexpr,
    PAIRED: tl.constexpr, USE_PDL: tl.constexpr, NORM_CHUNK: tl.constexpr, W_SCALED: tl.constexpr,
    W_CONVERT: tl.constexpr, W_VEC: tl.constexpr, W_SUM: tl.constexpr,
    PDL_TILES: tl.constexpr = 1, PDL_GDC: tl.constexpr = True, PDL_TRIGGER_FIRST: tl.constexpr = False,
    NORM_SUMS: tl.constexpr = False, CARRY: tl.constexpr = False, CARRY_X: tl.constexpr = True,
    ZERO_SUMS: tl.constexpr = False,
    NUM_SLOTS: tl.constexpr = 16, SUMS_ROWS: tl.constexpr = 16, SUM_UNIT: tl.constexpr = 1048576.0,
    SLOT_STRIDE: tl.constexpr = 1, SUMS_AT_END: tl.constexpr = True, FP8_CACHE: tl.constexpr = False,
    X_ACC: tl.constexpr = False, ZERO_ACC: tl.constexpr = False,
):
    pid = tl.program_id(0)
    j = tl.arange(0, BLOCK_N)
    if ROTARY:
        # Program = (head, slice of its first half): rows d and d + HALF of one head, the rotation's pairs.
        head = pid // SPLITS_PER_HEAD
        d = (pid % SPLITS_PER_HEAD) * BLOCK_N + j
        col_mask = d < HALF
        rows_a = head * (2 * HALF) + d
        rows_b = rows_a + HALF
    else:
        rows_a = pid * BLOCK_N + j
        col_mask = rows_a < N_OUT
        rows_b = rows_a + N_OUT  # SiLU-and-mul: the up row of gate row n is I + n
    m = tl.arange(0, BLOCK_M)
    m_mask = m < M
    ks = tl.arange(0, BLOCK_K)
    kw = tl.arange(0, BLOCK_K // 4) if W_CONVERT != 0 else ks  # FP8 as int32 words: w_stride is in words
    if W_VEC != 0:  # M = 1 on the CUDA cores: the weight tile's K run per thread = x's (see _row_vec)
        kw = tl.max_contiguous(kw, W_VEC // 4 if W_CONVERT != 0 else W_VEC)
    wa_ptrs = w_ptr + rows_a.to(tl.int64)[:, None] * w_stride + kw[None, :]
    wb_ptrs = w_ptr + rows_b.to(tl.int64)[:, None] * w_stride + kw[None, :]
    if USE_DOT:
        acc_a = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    elif W_SUM:
        acc_a = tl.zeros([BLOCK_N, BLOCK_K // W_VEC], dtype=tl.float32)
    elif W_VEC != 0:
        acc_a = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    else:
        acc_a = tl.zeros([BLOCK_M, BLOCK_N, BLOCK_K], dtype=tl.float32)
    acc_b = acc_a
    sumsq = tl.zeros([BLOCK_M], dtype=tl.float32)
    write_residual = pid == 0
    k_start = 0
    if PDL_GDC and PDL_TRIGGER_FIRST:  # (PDL_GDC: USE_PDL on the GPU)
        # The next kernel in before this one waits: only for a successor that reads nothing before its own wait
        # that this kernel's predecessor writes (the decode attention after qkv: see gemv_rotary_cache_triton's
        # pdl_trigger_first).
        gdc_launch_dependents()
    # FP8 with the prologue norm (unfolded g, the FP8 "fused-folded"): the first weight tile is in flight during
    # the rms pass's L2 round trips, as under PDL while the previous kernel drains.
    if USE_PDL or (NORM and W_SCALED and not PRO_RESIDUAL):
        wa, wb = _load_w(wa_ptrs, wb_ptrs, 0, col_mask, kw, K, PAIRED, W_CONVERT)
    if USE_PDL:
        # Weights never depend on the previous kernel: load the first PDL_TILES tiles while it drains (more than
        # one where the predecessor leaves the memory bus idle: the attention before o_proj), then wait for its
        # outputs (x, the residual) to be visible and let the next kernel launch. Without PDL_GDC (the
        # interpreter) the same tiles are peeled, with no griddepcontrol.
        if PDL_TILES > 1:
            wa1, wb1 = _load_w(wa_ptrs, wb_ptrs, BLOCK_K, col_mask, kw, K, PAIRED, W_CONVERT)
        if PDL_TILES > 2:
            wa2, wb2 = _load_w(wa_ptrs, wb_ptrs, 2 * BLOCK_K, col_mask, kw, K, PAIRED, W_CONVERT)
        if PDL_TILES > 3:
            wa3, wb3 = _load_w(wa_ptrs, wb_ptrs, 3 * BLOCK_K, col_mask, kw, K, PAIRED, W_CONVERT)
        if PDL_GDC:
            gdc_wait()
            if not PDL_TRIGGER_FIRST:
                gdc_launch_dependents()
    if NORM_SUMS:
        # The carried norm (NormCarry): x is s * g, written by the producer's epilogue, which also added sum(s^2) into
        # NUM_SLOTS int64 slots per token (fixed point, SUM_UNIT a unit); one load of them instead of the rms pass.
        # SUMS_AT_END: loaded here, summed in the epilogue, so the load's L2 round trip overlaps the weight loop.
        sums = _load_slots(sums_in_ptr, m, m_mask, NUM_SLOTS, SLOT_STRIDE)
        if not SUMS_AT_END:
            sumsq = _slots_sumsq(sums, SUM_UNIT)
    elif NORM and not PRO_RESIDUAL:
        # The rms of each x row in a pass of its own (x is M*K elements, read from L2 by every program),
        # so that the weight loop below stays a plain pipelined GEMV: normalising x inside the loop took
        # the 8B qkv GEMV from 15 to 35-57 us at M = 8 on the tl.dot path (H200, ops/bench_gemv.py --ablate).
        sumsq = _row_sumsq(x_ptr, x_stride, M, K, BLOCK_M, NORM_CHUNK)
    if USE_PDL or (NORM and W_SCALED and not PRO_RESIDUAL):
        acc_a, acc_b, sumsq = _gemv_step(
            0, wa, wb, acc_a, acc_b, sumsq, x_ptr, x_stride, hres_ptr, hres_stride, res_out_ptr,
            res_out_stride, norm_ptr, m, m_mask, ks, K, write_residual,
            PRO_RESIDUAL, APPLY_G, PAIRED, USE_DOT, DOT_PRECISION, W_CONVERT, W_VEC, W_SUM, X_ACC)
        k_start = BLOCK_K
    if USE_PDL:  # the other tiles loaded before the wait, in K order (the same sums as the loop's)
        if PDL_TILES > 1:
            acc_a, acc_b, sumsq = _gemv_step(
                BLOCK_K, wa1, wb1, acc_a, acc_b, sumsq, x_ptr, x_stride, hres_ptr, hres_stride, res_out_ptr,
                res_out_stride, norm_ptr, m, m_mask, ks, K, write_residual,
                PRO_RESIDUAL, APPLY_G, PAIRED, USE_DOT, DOT_PRECISION, W_CONVERT, W_VEC, W_SUM, X_ACC)
            k_start = 2 * BLOCK_K
        if PDL_TILES > 2:
            acc_a, acc_b, sumsq = _gemv_step(
                2 * BLOCK_K, wa2, wb2, acc_a, acc_b, sumsq, x_ptr, x_stride, hres_ptr, hres_stride, res_out_ptr,
                res_out_stride, norm_ptr, m, m_mask, ks, K, write_residual,
                PRO_RESIDUAL, APPLY_G, PAIRED, USE_DOT, DOT_PRECISION, W_CONVERT, W_VEC, W_SUM, X_ACC)
            k_start = 3 * BLOCK_K
        if PDL_TILES > 3:
            acc_a, acc_b, sumsq = _gemv_step(
                3 * BLOCK_K, wa3, wb3, acc_a, acc_b, sumsq, x_ptr, x_stride, hres_ptr, hres_stride, res_out_ptr,
                res_out_stride, norm_ptr, m, m_mask, ks, K, write_residual,
                PRO_RESIDUAL, APPLY_G, PAIRED, USE_DOT, DOT_PRECISION, W_CONVERT, W_VEC, W_SUM, X_ACC)
            k_start = 4 * BLOCK_K
    for k0 in range(k_start, K, BLOCK_K):
        wa, wb = _load_w(wa_ptrs, wb_ptrs, k0, col_mask, kw, K, PAIRED, W_CONVERT)
        acc_a, acc_b, sumsq = _gemv_step(
            k0, wa, wb, acc_a, acc_b, sumsq, x_ptr, x_stride, hres_ptr, hres_stride, res_out_ptr,
            res_out_stride, norm_ptr, m, m_mask, ks, K, write_residual,
            PRO_RESIDUAL, APPLY_G, PAIRED, USE_DOT, DOT_PRECISION, W_CONVERT, W_VEC, W_SUM, X_ACC)
    if W_VEC != 0:  # [BN, BK] (or [BN, BK / W_VEC]) -> [1, BN]
        acc_a = tl.sum(acc_a, axis=1)[None, :]
        if PAIRED:
            acc_b = tl.sum(acc_b, axis=1)[None, :]
    elif not USE_DOT:
        acc_a = tl.sum(acc_a, axis=2)
        if PAIRED:
            acc_b = tl.sum(acc_b, axis=2)
    if W_SCALED:  # FP8 weights: the row scales on the float32 sums, before everything that follows
        unbias = 256.0 if W_CONVERT == 1 else 1.0  # "bits" read each weight as value * 2^-8
        acc_a = acc_a * (tl.load(w_scale_ptr + rows_a, mask=col_mask, other=0.0) * unbias)[None, :]
        if PAIRED:
            acc_b = acc_b * (tl.load(w_scale_ptr + rows_b, mask=col_mask, other=0.0) * unbias)[None, :]
    if NORM_SUMS and SUMS_AT_END:
        sumsq = _slots_sumsq(sums, SUM_UNIT)
    if NORM:
        inv_rms = tl.rsqrt(sumsq / K + eps)[:, None]
        acc_a = acc_a * inv_rms
        if PAIRED:
            acc_b = acc_b * inv_rms
    if HAS_BIAS:
        acc_a += tl.load(bias_ptr + rows_a, mask=col_mask, other=0.0).to(tl.float32)[None, :]
        if PAIRED:
            acc_b += tl.load(bias_ptr + rows_b, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    dtype = out_ptr.dtype.element_ty
    # The unfused path rounds the projection to the model dtype here; do the same.
    a = acc_a.to(dtype).to(tl.float32)
    out_mask = m_mask[:, None] & col_mask[None, :]
    if SILU_MUL:
        b = acc_b.to(dtype).to(tl.float32)
        a = a * tl.sigmoid(a) * b
    if ADD:
        r = tl.load(add_ptr + m[:, None] * add_stride + rows_a[None, :], mask=out_mask, other=0.0)
        a = a.to(dtype).to(tl.float32) + r.to(tl.float32)
        if CARRY:  # the next norm's half (NormCarry): s * g for its GEMV, and this program's share of sum(s^2)
            s_out = tl.where(out_mask, a.to(dtype).to(tl.float32), 0.0)  # s as stored below
            if CARRY_X:  # (without: g is folded into the consumer's weights, which reads s itself)
                g = tl.load(carry_g_ptr + rows_a, mask=col_mask, other=0.0).to(tl.float32)
                tl.store(carry_out_ptr + m[:, None] * carry_out_stride + rows_a[None, :],
                         (s_out * g[None, :]).to(dtype), mask=out_mask)
            share = _fixed_point(tl.sum(s_out * s_out, axis=1), SUM_UNIT)
            slot = sums_out_ptr + m * (NUM_SLOTS * SLOT_STRIDE) + (pid % NUM_SLOTS) * SLOT_STRIDE
            tl.atomic_add(slot, share, mask=m_mask, sem="relaxed")
    if ZERO_SUMS:
        # Put back to zero the slots an earlier kernel of the chain read (fused_decode.NormCarry says why they are
        # free by now), after the wait as every store here; program 0 only, SUMS_ROWS tokens' worth.
        _zero_slots(sums_zero_ptr, pid == 0, SUMS_ROWS, NUM_SLOTS, SLOT_STRIDE)
    if ZERO_ACC:
        # A float32 [M, N_OUT] buffer an earlier kernel of the chain read, set to zero (fused_decode.MLP_FINISH_IN_QKV:
        # the previous layer's fused-MLP accumulator, which this layer's qkv read; fused_decode.NormCarry says why it
        # is free by now): each program its own columns, after the wait as every store here.
        tl.store(acc_zero_ptr + m[:, None] * N_OUT + rows_a[None, :], tl.zeros([BLOCK_M, BLOCK_N], tl.float32),
                 mask=out_mask)
    if ROTARY:
        b = acc_b.to(dtype).to(tl.float32)
        is_q = head < NUM_Q_HEADS
        is_k = (head >= NUM_Q_HEADS) & (head < NUM_Q_HEADS + NUM_KV_HEADS)
        if QK_NORM:  # Qwen3: RMSNorm over each q / k head (this program holds the whole head), rounded
            norm_w = tl.where(is_q, q_norm_ptr, k_norm_ptr)
            # the head's own columns only: a padding column (d >= HALF) must not reach the sum whatever it holds
            live = col_mask[None, :]
            sq = tl.where(live, a * a, 0.0) + tl.where(live, b * b, 0.0)
            inv = tl.rsqrt(tl.sum(sq, axis=1) / (2 * HALF) + eps)[:, None]
            wa_n = tl.load(norm_w + d, mask=col_mask & (is_q | is_k), other=1.0).to(tl.float32)[None, :]
            wb_n = tl.load(norm_w + HALF + d, mask=col_mask & (is_q | is_k), other=1.0).to(tl.float32)[None, :]
            na = ((a * inv).to(dtype).to(tl.float32) * wa_n).to(dtype).to(tl.float32)
            nb = ((b * inv).to(dtype).to(tl.float32) * wb_n).to(dtype).to(tl.float32)
            a = tl.where(is_q | is_k, na, a)
            b = tl.where(is_q | is_k, nb, b)
        pos = tl.load(positions_ptr + m, mask=m_mask, other=0).to(tl.int64)
        table = cos_sin_ptr + pos[:, None] * (2 * HALF) + d[None, :]
        cos = tl.load(table, mask=out_mask, other=1.0)
        sin = tl.load(table + HALF, mask=out_mask, other=0.0)
        rotate = is_q | is_k
        ra = tl.where(rotate, a * cos - b * sin, a)
        rb = tl.where(rotate, b * cos + a * sin, b)
        out_rows = out_ptr + m[:, None] * out_stride + rows_a[None, :]
        tl.store(out_rows, ra.to(dtype), mask=out_mask)
        tl.store(out_rows + HALF, rb.to(dtype), mask=out_mask)
        # k and v heads also go into the paged caches [slots, Hkv, D] (slot < 0: a padding token).
        slot = tl.load(slot_ptr + m, mask=m_mask, other=-1).to(tl.int64)
        kv_head = tl.where(is_k, head - NUM_Q_HEADS, head - NUM_Q_HEADS - NUM_KV_HEADS)
        cache_off = slot[:, None] * (NUM_KV_HEADS * 2 * HALF) + kv_head * (2 * HALF) + d[None, :]
        cache_mask = out_mask & (slot[:, None] >= 0) & (head >= NUM_Q_HEADS)
        cache = tl.where(is_k, k_cache_ptr, v_cache_ptr)
        if FP8_CACHE:
            # kv_quant.quantize_kv, as rotary.py's cache write: the value `out` holds (the rotated k, or v, in the
            # model dtype) over its tensor's scale in IEEE float32 and saturated; the store's cast rounds to nearest
            # even. (A q head's program loads v's scale and stores nothing: cache_mask.)
            scale = tl.load(tl.where(is_k, k_scale_ptr, v_scale_ptr))
            fp8 = k_cache_ptr.dtype.element_ty
            tl.store(cache + cache_off, _to_fp8(ra.to(dtype), scale).to(fp8), mask=cache_mask)
            tl.store(cache + cache_off + HALF, _to_fp8(rb.to(dtype), scale).to(fp8), mask=cache_mask)
        else:
            tl.store(cache + cache_off, ra.to(dtype), mask=cache_mask)
            tl.store(cache + cache_off + HALF, rb.to(dtype), mask=cache_mask)
    else:
        tl.store(out_ptr + m[:, None] * out_stride + rows_a[None, :], a.to(dtype), mask=out_mask)


# ---------------------------------------------------------------------------------------------- launcher
# A carried norm's sum of squares goes into NORM_SLOTS int64 slots a token (slot = program % NORM_SLOTS) that the
# consumer loads and sums; NORM_SLOT_STRIDE int64 elements apart. The sums are fixed point with NORM_SUM_UNIT units to
# 1 (each program's share rounded to a unit): integer atomics make the total independent of the programs' order, so
# a step is reproducible. Resolution: at most 2^-21 off per producer program, ~1e-7 of a mean square over a 4096
# row of 1024 programs (RMSNorm adds eps >= 1e-6 to it); range: a row sum up to 2^43 (an RMS of ~46,000 over 4096
# elements; beyond it the int64 wraps). H200, W1 FP8 8B, each A/B on one machine (session 18): spreading the adds
# only cost: 16 slots a 128-byte line apart 2.427-2.430 ms against 2.393 in one line (call 2; 64 slots a line each
# 2.627); 16 / 4 / 1 slots in one line 2.403-2.405 / 2.366 / 2.353 (call 3): the 1,024 producer programs' adds are
# fire-and-forget (sm_90 REDG), and what the slots cost is each consumer program's load of them.
NORM_SLOTS = 1
NORM_SUM_UNIT = 2.0**20
NORM_SLOT_STRIDE = 1
# The consumer sums its slots in the epilogue (loaded after the PDL wait, before the weight loop) instead of before
# the loop: slower (call 3: 2.403-2.405 against 2.373 ms with 16 slots).
NORM_SUMS_AT_END = False


def norm_sums_buffer(rows: int, device: torch.device | str) -> torch.Tensor:
    """A zeroed carried-norm sums buffer for up to `rows` tokens (the layout gemv_triton's norm_sums, carry.sums and
    zero_sums take; rows a power of two for zero_sums)."""
    return torch.zeros(rows, NORM_SLOTS * NORM_SLOT_STRIDE, dtype=torch.int64, device=device)


@dataclass(frozen=True, slots=True)
class NormCarryOut:
    """An `add` GEMV's epilogue doing the next RMSNorm's first half (fused_decode.NormCarry): with s the output it
    stores, x = s * norm_weight (rounded to the model dtype) into `x` [M, N], and each token's sum(s^2) added into
    `sums` (norm_sums_buffer: NORM_SLOTS int64 slots a token, fixed point in NORM_SUM_UNIT), zero before the launch.
    The consumer GEMV takes x and the sums (gemv_triton's norm_sums) and scales its float32 sums by 1 / rms. With
    norm_weight and x None only the sums are added: where g is folded into the consumer's weights (bf16
    "fused-folded"), its x is s, the output itself."""

    norm_weight: torch.Tensor | None  # [N] model dtype; None with x None: the sums only
    x: torch.Tensor | None  # [M, N] model dtype, contiguous rows; None: the consumer reads the output itself
    sums: torch.Tensor  # norm_sums_buffer(>= M)


def _check_norm_sums(sums: torch.Tensor, num_rows: int, device: torch.device, name: str) -> None:
    width = NORM_SLOTS * NORM_SLOT_STRIDE
    if (sums.dtype != torch.int64 or sums.dim() != 2 or sums.shape[0] < num_rows or sums.shape[1] != width
            or not sums.is_contiguous() or sums.device != device):
        raise ValueError(f"gemv: {name} must be a contiguous int64 [>= {num_rows}, {width}] on {device} "
                         f"(norm_sums_buffer), got "
                         f"{sums.dtype} {tuple(sums.shape)} on {sums.device}")


def _check_carry(norm_sums: torch.Tensor | None, carry: NormCarryOut | None, zero_sums: torch.Tensor | None,
                 x: torch.Tensor, n_out: int, add: torch.Tensor | None, norm: bool) -> None:
    """The carried norm's arguments: norm_sums (a consumer; no other norm), carry (an `add` producer), zero_sums."""
    num_rows = x.shape[0]
    if norm_sums is not None:
        if norm:
            raise ValueError("gemv: norm_sums is the carried norm; pass no norm_weight, norm_folded or norm_residual")
        _check_norm_sums(norm_sums, num_rows, x.device, "norm_sums")
    if carry is not None:
        if add is None:
            raise ValueError("gemv: carry (the next norm's first half) is an epilogue of the residual add: pass add")
        _check_norm_sums(carry.sums, num_rows, x.device, "carry.sums")
        if (carry.norm_weight is None) != (carry.x is None):
            raise ValueError("gemv: carry.norm_weight and carry.x go together (both None: the sums only)")
        if carry.norm_weight is None or carry.x is None:
            return _check_zero_sums(zero_sums, x)
        if carry.norm_weight.shape != (n_out,) or carry.norm_weight.dtype != x.dtype:
            raise ValueError(f"gemv: carry.norm_weight must be [{n_out}] {x.dtype}, got "
                             f"{tuple(carry.norm_weight.shape)} {carry.norm_weight.dtype}")
        if (carry.x.shape != (num_rows, n_out) or carry.x.dtype != x.dtype or carry.x.stride(1) != 1
                or carry.x.device != x.device):
            raise ValueError(f"gemv: carry.x must be [{num_rows}, {n_out}] {x.dtype} with contiguous rows, got "
                             f"{tuple(carry.x.shape)} {carry.x.dtype}")
    _check_zero_sums(zero_sums, x)


def _check_zero_sums(zero_sums: torch.Tensor | None, x: torch.Tensor) -> None:
    if zero_sums is not None:
        _check_norm_sums(zero_sums, 0, x.device, "zero_sums")
        if zero_sums.shape[0] & (zero_sums.shape[0] - 1):
            raise ValueError(f"gemv: zero_sums needs a power-of-two row count, got {zero_sums.shape[0]}")


@dataclass(frozen=True, slots=True)
class GemvConfig:
    """Launch shape of a GEMV (this module's and the W8A16 one of fp8_linear): BLOCK_M tokens x BLOCK_N weight
    rows per program, BLOCK_K columns per step; use_dot: the 16-token tl.dot tile on the tensor cores
    (block_m 16), else CUDA-core multiply-adds."""

    block_m: int
    block_n: int
    block_k: int
    use_dot: bool
    num_warps: int = 4
    num_stages: int = 3
    pdl_tiles: int = 1  # under PDL: K tiles loaded before griddepcontrol.wait (1-4)
    # A cap on registers a thread (ptxas .maxnreg; None: the compiler's choice), where a few registers more than a
    # power of two cost a block an SM (e.g. 68 -> 7 blocks of 128 threads instead of 8: a second wave for 1,024
    # programs). The GPU only.
    maxnreg: int | None = None

    def __post_init__(self) -> None:
        if not 1 <= self.pdl_tiles <= 4:
            raise ValueError(f"GemvConfig: pdl_tiles must be 1-4, got {self.pdl_tiles}")
        if self.maxnreg is not None and not 24 <= self.maxnreg <= 255:
            raise ValueError(f"GemvConfig: maxnreg must be 24-255 or None, got {self.maxnreg}")

    def label(self) -> str:
        return (f"{'dot' if self.use_dot else 'cores'} {self.block_m}x{self.block_n}x{self.block_k} "
                f"w{self.num_warps} s{self.num_stages}" + (f" p{self.pdl_tiles}" if self.pdl_tiles != 1 else "")
                + (f" r{self.maxnreg}" if self.maxnreg is not None else ""))


# M = 1 launch shapes per (kind, n_out, hidden) as gemv_config sees them, each the fastest candidate of
# ops/bench_gemv.py --sweep-fused for that projection (H200, bf16, 2026-12-01 14:43 UTC; us per call in
# CUDA-graph chains, the rule below -> this entry). Listed where the gain passed 0.3 us; the rule below was
# already the best or within 0.2 us for the others (8B rope / silu / o / down, 1B silu / o / down). The folded
# norm's rms pass wants more rows per program than the plain kinds: fewer programs repeat it.
_TUNED_M1: dict[tuple[str, int, int], GemvConfig] = {
    ("rope-norm", 3072, 4096): GemvConfig(1, 8, 512, False, 4, 3),  # 8B qkv, folded norm: 21.2 -> 16.1
    # 8B o_proj: the CUDA-core loop with run sums, all of K loaded before the wait under PDL (fused_decode.O_PROJ_PDL:
    # W1 4.15-4.19 -> 4.11-4.15 ms, session 17); without PDL as fast as the dot tile 16x16x256 w1 (4.182 vs 4.186)
    ("plain", 4096, 4096): GemvConfig(1, 4, 1024, False, 4, 3, pdl_tiles=4),
    ("silu-norm", 14336, 4096): GemvConfig(16, 64, 128, True, 4, 4),  # 8B gate_up, folded norm: 60.3 -> 58.0
    ("rope", 1536, 2048): GemvConfig(1, 2, 1024, False, 4, 3),  # 1B qkv: 5.7 -> 5.4
    ("rope-norm", 1536, 2048): GemvConfig(1, 2, 1024, False, 4, 3),  # 1B qkv, folded norm: 6.3 -> 5.9
    ("silu-norm", 8192, 2048): GemvConfig(16, 64, 128, True, 4, 4),  # 1B gate_up, folded norm: 18.8 -> 18.2
}


def gemv_config(kind: str, num_rows: int, n_out: int, hidden: int, on_gpu: bool, elem_bytes: int = 2) -> GemvConfig:
    """Block sizes for M tokens; kind is "plain" (also the bias / add / unfolded-norm variants), "silu" or
    "rope", with "-norm" for the folded prologue norm (its rms pass changes which shape is fastest; without a
    tuned entry it takes its base kind's config). For "rope", n_out is half the qkv rows (a program's pairs).
    elem_bytes: the operands' element size. The sweeps were of 16-bit operands; a float32 tile of the same
    shape needs twice the shared memory per pipeline stage (the SiLU config's 5 stages then asked 240 KB of the
    H200's 227 KB and failed to launch), so 4-byte operands take half the K slice: the same bytes per stage.

    From the H200 sweeps of ops/bench_gemv.py (--sweep, --ablate; bf16, us per call in CUDA-graph replay):
    - M = 1, >= 4096 outputs: the tl.dot path with ONE warp and 16 rows per program (8B qkv 14.6 us vs 15.1
      on the CUDA cores and 16.5 for cuBLAS; o_proj 11.0 vs 12.5 cuBLAS): cp.async-pipelined 16-byte
      loads, and one warp does not replicate the 16x16 MMA tile four times as 4 warps do;
    - M = 1, fewer outputs (1B: 2048-3072): the CUDA cores, 4 rows x 1024 per program, for 4x the programs
      (1B o_proj 4.6 us vs 6.0 cuBLAS, down 11.4 vs 12.7);
    - SiLU-mul (two weight streams): tl.dot 32 rows x 128, 2 warps, 5 stages (8B gate_up 58.0 us at M = 1,
      58.6 at M = 8, vs 60.6 cuBLAS + 1.5 SiLU kernel);
    - rotary: programs own half-heads, so 4-row CUDA-core programs at M = 1 (8B 15.4 us), tl.dot above;
    - M > 1 pads to the 16-row tl.dot tile; few outputs with a long K (1B down) want 16 x 512 slices.
    """
    if not on_gpu:  # the interpreter pays per program and numpy op: few wide programs, several K slices
        if num_rows <= 4:
            return GemvConfig(triton.next_power_of_2(num_rows), 32, 64, False, 4, 1)
        return GemvConfig(16, 32, 64, True, 4, 1)
    cfg = _gpu_gemv_config(kind, num_rows, n_out, hidden)
    if elem_bytes > 2:
        return dataclasses.replace(cfg, block_k=max(16, cfg.block_k * 2 // elem_bytes))
    return cfg


def _gpu_gemv_config(kind: str, num_rows: int, n_out: int, hidden: int) -> GemvConfig:
    tuned = _TUNED_M1.get((kind, n_out, hidden)) if num_rows == 1 else None
    if tuned is not None:
        return tuned
    kind = kind.removesuffix("-norm")
    if kind == "silu":
        return GemvConfig(16, 32, 128, True, 2, 5)
    if kind == "rope":
        if num_rows == 1:
            return GemvConfig(1, 4, 512 if 2 * n_out >= 4096 else 1024, False, 4, 3)
        return GemvConfig(16, 32, 256, True, 4, 4)
    if n_out >= 4096:
        return GemvConfig(16, 16, 256, True, 1, 4)
    if num_rows == 1:
        return GemvConfig(1, 4, 1024, False, 4, 3)
    return GemvConfig(16, 16, 512, True, 4, 3) if hidden >= 8192 else GemvConfig(16, 32, 256, True, 4, 4)


def norm_chunk(hidden: int, num_warps: int, on_gpu: bool) -> int:
    """Slice width of the prologue norm's rms pass (_row_sumsq): the whole row up to 32 float32 registers a
    thread; in the interpreter 64, so the tests' K = 200 takes several slices and a masked tail."""
    if not on_gpu:
        return 64
    return min(triton.next_power_of_2(hidden), 1024 * num_warps)


def _dot_precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"  # tf32 is ignored for 16-bit inputs


def _contiguous_last(name: str, t: torch.Tensor | None) -> None:
    if t is not None and t.stride(-1) != 1:
        raise ValueError(f"gemv: the last dim of {name} must be contiguous")


# The one-token CUDA-core loop with a [BN, BK] accumulator in the weight load's own layout (W_VEC), for FP8
# weights; the 3-D [1, BN, BK] product before it made Triton pick a layout of one K element per thread and
# convert every weight tile to it through shared memory (sm_90 PTX of the 8B o_proj config 1x8x1024: an 8 KB
# st.shared + ldmatrix round trip and 3 barriers per K step; with W_VEC none). ROW_ACC_BF16: the same loop for
# 16/32-bit weights (on since session 17: W1 bf16 with it and ROW_SUM_BF16 on every one-token CUDA-core GEMV, the
# 8B qkv's included, 4.182 against 4.186 ms before; 1B W1 0.952 against 0.945 ms, inside its runs' spread: unsettled).
ROW_ACC_FP8 = True
# The word conversions with Qwen3's q/k norm on CUDA: refused while they gave NaN (H200 15:50 UTC); after the norm's
# sum was held to the head's live columns, ops/probe_qk_norm_words.py found no NaN (18:25 UTC: asm-join and
# bits-join, head_dim 40 and 128, M = 1 and 5, relative error 3.4e-3 to 5.0e-3), so no longer refused.
REFUSE_WORDS_WITH_QK_NORM = False
ROW_ACC_BF16 = True
# FP8 in that loop with each thread's W_VEC products summed in registers every K step, so the accumulator is
# [BN, BK / W_VEC] instead of [BN, BK] (W_SUM): the 8B down config 1x8x1024 w4 needed 118 registers a thread for
# its 64 float32 sums (4 blocks an SM, too few weight loads in flight), ~70 this way. H200 probe (session 16, one-
# token FP8 GEMVs alone, us; some shapes with 16 codes a thread):
# 8B gate_up as one 28672-row GEMV 33.8 -> 28.5 (82 -> 97 % of copy; int32 loads with no math: 28.0), down 16.7 ->
# 16.1 (load-only 15.0), qkv 10.2 -> 8.1, o 6.7 -> 6.2. What the fused kernels gain is ops/bench_fp8_fused.py's.
ROW_SUM_FP8 = True
# The same run sums for 16/32-bit weights in the one-token loop (with ROW_ACC_BF16): the 8B o_proj config 1x4x1024
# w4 with four tiles before its wait needs 128 registers a thread with them, 118 without and 52 with one tile
# (sm_90 compile); W1 bf16 with both on and the o_proj entry above, session 17: see _TUNED_M1.
ROW_SUM_BF16 = True
# (The next K step's weight tile loaded into registers before this step's math, W_PREFETCH, was slower on the H200,
# 8B down 17.5 -> 26.1 us, and is gone: sm_90 SASS shows why, a loop-carried 8-bit tile is held a code a register
# and repacked byte by byte every step. Carried as int32 words it is clean but no faster: session 16's probe.)


# Programmatic dependent launch (pdl=True, EngineConfig.decode_pdl: by default FP8 layers only): the first weight
# tile (GemvConfig.pdl_tiles of them) is loaded before griddepcontrol.wait, the next kernel let in right after it.
# It pays on FP8 weights (W1 2.72 vs 2.81 ms, session 15), and on bf16 only on the attention -> o_proj boundary
# with all of o_proj's K early (fused_decode.O_PROJ_PDL, session 17), but not on the whole bf16 chain at batch 1
# (H200, 8B bf16, ops/bench_pdl_chain.py, us per layer of the fused chain in a CUDA graph: plain 121.9, this form
# 128.6; BENCHMARKS.md 21:07 UTC): in the graph the plain kernels are already back to back, and a successor resident
# before its predecessor ends slows it. The other forms measured there (bulk L2 prefetches before the wait, the
# trigger after all or part of the weight loop, the next projection's rows prefetched into L2 after the stores)
# all lost too and were removed; the record is BENCHMARKS.md and the git history. So did, in session 25, bulk L2
# prefetches from o_proj's programs before their wait while the attention runs (their own rows past the early tiles,
# or the rows of the grid's not-yet-resident second wave): the attention's charge on the critical path went 8.07 ->
# 10.04 us a layer and o_proj's 7.46 -> 7.05, W1 3.953 -> 3.98-4.02 ms (commit 4b323db, reverted).


def _row_vec(cfg: GemvConfig, elem_bytes: int, fp8: bool) -> int:
    """W_VEC: 0 for the [BM, BN, BK] accumulator, else the K elements per thread of x's [1, BK] load (16 bytes,
    fewer when BK does not cover the block's threads); the weight's loads are held to the same run so the
    product needs no layout conversion (FP8: 8-byte loads of 8 codes instead of 16). FP8 under ROW_SUM_FP8 takes
    runs of up to 16 codes where BK gives each thread that many: 16-byte weight loads, but on sm_90 the weight tile
    then goes through shared memory into x's layout every K step, and still the 8B down was faster that way (16.2
    against 16.4 us; W1 2.65-2.67 ms with it on two machines, 2.78 without on a third: session 16, BENCHMARKS.md)."""
    if cfg.use_dot or cfg.block_m != 1 or not (ROW_ACC_FP8 if fp8 else ROW_ACC_BF16):
        return 0
    widest = 16 // elem_bytes * (2 if fp8 and ROW_SUM_FP8 else 1)
    return max(1, min(widest, cfg.block_k // (32 * cfg.num_warps)))


def row_sum(w_vec: int, fp8: bool) -> bool:
    """W_SUM: the one-token loop (W_VEC) sums each thread's run in registers (ROW_SUM_FP8 for FP8 weights,
    ROW_SUM_BF16 for the others)."""
    return w_vec != 0 and (ROW_SUM_FP8 if fp8 else ROW_SUM_BF16)


def _check_weight_convert(weight_convert: str, weight: torch.Tensor, weight_scale: torch.Tensor | None) -> int:
    """The kernel's W_CONVERT for FP8 weights: 0 Triton's cast of the float8 tile, 1 / 2 the int32-word "bits-join"
    / "asm-join" of fp8_convert.py (x stays contiguous here, so only the joined forms)."""
    if weight_convert == "cast":
        return 0
    if weight_convert not in ("bits-join", "asm-join"):
        raise ValueError(f"gemv: weight_convert {weight_convert!r} is not 'cast', 'bits-join' or 'asm-join'")
    if weight_scale is None:
        raise ValueError("gemv: weight_convert is for FP8 weights (with weight_scale)")
    if weight.shape[1] % 4 or weight.stride(0) % 4 or weight.storage_offset() % 4:
        raise ValueError("gemv: the word conversions need K, the row stride and the offset in multiples of 4")
    if weight_convert == "asm-join" and interpreting():
        raise ValueError("gemv: inline PTX ('asm-join') does not run under the Triton interpreter")
    return CONVERT_CODE[weight_convert] - 2


def _launch(
    x: torch.Tensor,
    weight: torch.Tensor,
    out: torch.Tensor,
    n_out: int,
    grid: int,
    cfg: GemvConfig,
    bias: torch.Tensor | None,
    norm_weight: torch.Tensor | None,
    eps: float,
    norm_residual: torch.Tensor | None,
    s: torch.Tensor,
    silu_mul: bool,
    add: torch.Tensor | None,
    pdl: bool,
    rotary: tuple[torch.Tensor, ...] | None = None,
    heads: tuple[int, int, int, int] = (0, 0, 1, 1),
    qk_norm: tuple[torch.Tensor, torch.Tensor] | None = None,
    norm_folded: bool = False,
    weight_scale: torch.Tensor | None = None,
    weight_convert: str = "cast",
    trigger_first: bool = False,
    norm_sums: torch.Tensor | None = None,
    carry: NormCarryOut | None = None,
    zero_sums: torch.Tensor | None = None,
    kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None,
    x_accumulator: bool = False,
    zero_accumulator: torch.Tensor | None = None,
) -> None:
    """kv_scales: (k_scale, v_scale) of an FP8 cache (with rotary), the kernel's FP8_CACHE store. s: the stream in
    the model dtype (x itself without norm_residual), so its dtype is the operands' where x is a float32
    accumulator (x_accumulator, the kernel's X_ACC). zero_accumulator: ZERO_ACC's float32 [M, n_out] buffer."""
    num_rows, hidden = x.shape
    if cfg.use_dot and cfg.block_m < 16:
        raise ValueError("gemv: a tl.dot tile needs block_m >= 16")
    if cfg.block_m < num_rows:
        raise ValueError(f"gemv: block_m {cfg.block_m} < M {num_rows}")
    positions, cos_sin, k_cache, v_cache, slots = rotary if rotary is not None else (x,) * 5
    q_norm, k_norm = qk_norm if qk_norm is not None else (x, x)
    hres = norm_residual if norm_residual is not None else x
    add_t = add if add is not None else x
    num_q_heads, num_kv_heads, half, splits = heads
    gdc = pdl and not interpreting()  # griddepcontrol and the launch attribute: the GPU only
    w_convert = _check_weight_convert(weight_convert, weight, weight_scale)
    w_vec = _row_vec(cfg, s.element_size(), weight_scale is not None)
    paired = silu_mul or rotary is not None
    if w_convert:
        weight = weight.view(torch.int32)  # [N, K / 4]: four E4M3 codes a word (w_stride in words)
    placeholder = weight_scale if weight_scale is not None else x  # any tensor: its pointer is never read
    sums_out = carry.sums if carry is not None else placeholder
    zero = zero_sums if zero_sums is not None else placeholder
    carry_g = carry.norm_weight if carry is not None and carry.norm_weight is not None else placeholder
    carry_x = carry.x if carry is not None and carry.x is not None else x
    k_scale, v_scale = kv_scales if kv_scales is not None else (placeholder, placeholder)
    _gemv_kernel[(grid,)](
        x, weight, out, bias if bias is not None else x, norm_weight if norm_weight is not None else x,
        hres, s, add_t, positions, cos_sin, k_cache, v_cache, slots, q_norm, k_norm,
        weight_scale if weight_scale is not None else x,
        norm_sums if norm_sums is not None else placeholder, sums_out, zero, carry_g, carry_x, k_scale, v_scale,
        zero_accumulator if zero_accumulator is not None else placeholder, num_rows, n_out, hidden, eps,
        x.stride(0), weight.stride(0), out.stride(0), hres.stride(0), s.stride(0), add_t.stride(0),
        carry_x.stride(0), num_q_heads, num_kv_heads,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        USE_DOT=cfg.use_dot, DOT_PRECISION=_dot_precision(s.dtype),
        NORM=norm_weight is not None or norm_folded or norm_sums is not None, PRO_RESIDUAL=norm_residual is not None,
        APPLY_G=norm_weight is not None, HAS_BIAS=bias is not None,
        SILU_MUL=silu_mul, ADD=add is not None,
        ROTARY=rotary is not None, QK_NORM=qk_norm is not None, HALF=half, SPLITS_PER_HEAD=splits,
        PAIRED=paired, USE_PDL=pdl, NORM_CHUNK=norm_chunk(hidden, cfg.num_warps, x.is_cuda),
        W_SCALED=weight_scale is not None, W_CONVERT=w_convert, W_VEC=w_vec,
        W_SUM=row_sum(w_vec, weight_scale is not None), PDL_TILES=cfg.pdl_tiles, PDL_GDC=gdc,
        PDL_TRIGGER_FIRST=trigger_first, NORM_SUMS=norm_sums is not None, CARRY=carry is not None,
        CARRY_X=carry is not None and carry.x is not None,
        ZERO_SUMS=zero_sums is not None,
        NUM_SLOTS=NORM_SLOTS, SUM_UNIT=NORM_SUM_UNIT, SLOT_STRIDE=NORM_SLOT_STRIDE, SUMS_AT_END=NORM_SUMS_AT_END,
        SUMS_ROWS=zero_sums.shape[0] if zero_sums is not None else GEMV_MAX_M, FP8_CACHE=kv_scales is not None,
        X_ACC=x_accumulator, ZERO_ACC=zero_accumulator is not None,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        **({"launch_pdl": True} if gdc else {}),
        **({"maxnreg": cfg.maxnreg} if cfg.maxnreg is not None and not interpreting() else {}),
    )


def gemv_triton(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    norm_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
    norm_residual: torch.Tensor | None = None,
    silu_mul: bool = False,
    add: torch.Tensor | None = None,
    pdl: bool = False,
    config: GemvConfig | None = None,
    norm_folded: bool = False,
    weight_scale: torch.Tensor | None = None,
    weight_convert: str = "cast",
    norm_sums: torch.Tensor | None = None,
    carry: NormCarryOut | None = None,
    zero_sums: torch.Tensor | None = None,
    zero_accumulator: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """gemv_ref's semantics for M <= GEMV_MAX_M in one kernel. pdl: launch with programmatic dependent
    launch (the previous kernel in the stream may still be running when this one starts loading weights).
    config: override the block sizes (tests force both the CUDA-core and the tensor-core paths).
    weight_scale: FP8 weights (W8A16; converted in registers, the row scale on the float32 sums), converted by
    `weight_convert` ("cast", "bits-join", "asm-join": fp8_convert.py).
    The carried norm (fused_decode.NormCarry; gemv_carried_ref says what it computes): norm_sums (norm_sums_buffer),
    each token's sum of squares of s spread over its slots in NORM_SUM_UNIT units, where x = s * g: the sums are
    scaled by 1 / sqrt(sum / K + eps) before the epilogue. carry (with add): the epilogue also writes carry.x = out *
    carry.norm_weight and adds each token's sum(out^2) into carry.sums. zero_sums: a norm_sums_buffer this launch
    sets to zero after its PDL wait. zero_accumulator: a contiguous float32 buffer whose first M * N elements (an
    [M, N] accumulator in out's layout: fused_decode.MLP_FINISH_IN_QKV's) this launch sets to zero after its wait."""
    n_out = check_gemv_args(x, weight, bias, norm_weight, norm_residual, silu_mul, add, norm_folded, weight_scale)
    _check_carry(norm_sums, carry, zero_sums, x, n_out, add,
                 norm_weight is not None or norm_folded or norm_residual is not None)
    if zero_accumulator is not None and (
            zero_accumulator.dtype != torch.float32 or not zero_accumulator.is_contiguous()
            or zero_accumulator.numel() < x.shape[0] * n_out or zero_accumulator.device != x.device):
        raise ValueError(f"gemv: zero_accumulator must be contiguous float32 of >= M * N = {x.shape[0] * n_out} "
                         f"elements on {x.device}, got {zero_accumulator.dtype} {tuple(zero_accumulator.shape)} "
                         f"on {zero_accumulator.device}")
    tensors = [t for t in (x, weight, bias, norm_weight, norm_residual, add, weight_scale) if t is not None]
    check_launchable(*tensors)
    for name, t in (("x", x), ("weight", weight), ("bias", bias), ("norm_weight", norm_weight),
                    ("norm_residual", norm_residual), ("add", add)):
        _contiguous_last(name, t)
    num_rows, hidden = x.shape
    if num_rows > GEMV_MAX_M:
        raise ValueError(f"gemv: M = {num_rows} > {GEMV_MAX_M}; use F.linear (cuBLAS) for larger batches")
    out = torch.empty(num_rows, n_out, dtype=x.dtype, device=x.device)
    s = x if norm_residual is None else torch.empty_like(x, memory_format=torch.contiguous_format)
    if num_rows == 0 or n_out == 0:
        return out, s
    kind = ("silu" if silu_mul else "plain") + ("-norm" if norm_folded else "")
    cfg = config or gemv_config(kind, num_rows, n_out, hidden, x.is_cuda,
                                x.element_size())
    _launch(x, weight, out, n_out, triton.cdiv(n_out, cfg.block_n), cfg, bias, norm_weight, eps,
            norm_residual, s, silu_mul, add, pdl, norm_folded=norm_folded, weight_scale=weight_scale,
            weight_convert=weight_convert, norm_sums=norm_sums, carry=carry, zero_sums=zero_sums,
            zero_accumulator=zero_accumulator)
    return out, s


def gemv_rotary_cache_triton(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    *,
    num_heads: int,
    num_kv_heads: int,
    positions: torch.Tensor,
    cos_sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    norm_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
    norm_residual: torch.Tensor | None = None,
    q_norm: torch.Tensor | None = None,
    k_norm: torch.Tensor | None = None,
    pdl: bool = False,
    config: GemvConfig | None = None,
    norm_folded: bool = False,
    weight_scale: torch.Tensor | None = None,
    weight_convert: str = "cast",
    pdl_trigger_first: bool = False,
    norm_sums: torch.Tensor | None = None,
    zero_sums: torch.Tensor | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    x_accumulator: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """gemv_rotary_cache_ref in one kernel. With q_norm/k_norm (Qwen3) a program must hold a whole head,
    so the grid is one program per head (fewer, longer programs: slower at batch 1 than without).
    weight_scale: FP8 weights, as in gemv_triton (the scale before the q/k norm and the rotation).
    pdl_trigger_first (with pdl): griddepcontrol.launch_dependents before this kernel's own wait, so the decode
    attention after it becomes resident while it streams and reads its older keys then. Sound only because what
    the attention reads before its wait (block tables, context lengths, keys and values of earlier steps) is
    written by no kernel of this step that could still be running: when this kernel starts, its predecessor's
    predecessor has finished (every other kernel of the chain triggers after its wait), or, after a fused MLP
    whose finishing kernel lets this one in early (fused_decode.FINISH_EARLY), the two MLP kernels may still run,
    and they write only the MLP's accumulator, the residual stream and the carried sums (under
    fused_decode.MLP_FINISH_IN_QKV only the streaming kernel, which writes only the accumulator); the attention reads
    this kernel's outputs (q, the newest key and value) only after its own wait, which covers this kernel.
    norm_sums, zero_sums: the carried norm, as in gemv_triton (x = s * g).
    k_scale, v_scale: a float8_e4m3fn cache's per-tensor scales (kv_quant.py): the epilogue stores the rotated k as
    `out` holds it over k_scale, and v over v_scale, as rotary_and_cache does; unused for a cache in x's dtype.
    x_accumulator (with norm_residual and the prologue norm): x is a float32 accumulator of the projection before
    (the fused MLP's down sums, fused_decode.MLP_FINISH_IN_QKV), rounded to norm_residual's dtype (the model's)
    before the add, as fused_mlp's finishing kernel rounds: s = round(round(x) + norm_residual); the rms is summed
    over these s in the K loop (every program reads all of K), program 0 stores s, returned with out."""
    # x_accumulator: every check below is of the model-dtype operand the kernel makes of x (norm_residual's shape)
    model_x = _check_accumulated_x(x, norm_residual) if x_accumulator else x
    check_gemv_args(model_x, weight, bias, norm_weight, norm_residual, False, None, norm_folded, weight_scale)
    _check_carry(norm_sums, None, zero_sums, model_x, weight.shape[0], None,
                 norm_weight is not None or norm_folded or norm_residual is not None)
    head_dim = k_cache.shape[-1]
    num_rows, hidden = x.shape
    n_total = weight.shape[0]
    if n_total != (num_heads + 2 * num_kv_heads) * head_dim:
        raise ValueError(f"gemv_rotary_cache: weight has {n_total} rows, expected (Hq + 2 Hkv) * D = "
                         f"{(num_heads + 2 * num_kv_heads) * head_dim}")
    if (q_norm is None) != (k_norm is None):
        raise ValueError("gemv_rotary_cache: q_norm and k_norm go together")
    if q_norm is not None and weight_convert != "cast" and x.is_cuda and REFUSE_WORDS_WITH_QK_NORM:
        # Off by default (REFUSE_WORDS_WITH_QK_NORM). On the H200 (2026-12-01 15:50 UTC) the asm-join words with
        # the per-head q/k norm gave NaN at M = 1, head_dim 40, in the q and k heads only (240 of 320 outputs: the
        # normed ones), whose norm also summed the padding columns d >= HALF (12 of 32); with that sum held to the
        # live columns the probe found no NaN (18:25 UTC). Which padding value was NaN was not found out.
        raise ValueError(f"gemv_rotary_cache: weight_convert={weight_convert!r} with q_norm/k_norm is refused on CUDA "
                         "(NaN measured on the H200 with the per-head norm): use 'cast'")
    for t in (q_norm, k_norm):
        if t is not None and (t.shape != (head_dim,) or t.dtype != model_x.dtype):
            raise ValueError(f"gemv_rotary_cache: q_norm / k_norm must be [{head_dim}] {model_x.dtype}")
    if positions.shape != (num_rows,) or slot_mapping.shape != (num_rows,):
        raise ValueError(f"gemv_rotary_cache: positions and slot_mapping must be [{num_rows}]")
    if cos_sin.dim() != 2 or cos_sin.shape[1] != head_dim or cos_sin.dtype != torch.float32:
        raise ValueError(f"gemv_rotary_cache: cos_sin must be float32 [max_pos, {head_dim}]")
    fp8_cache = is_fp8_cache(k_cache)
    cache_dtype = k_cache.dtype if fp8_cache else model_x.dtype
    if (k_cache.dim() != 4 or k_cache.shape[2:] != (num_kv_heads, head_dim) or v_cache.shape != k_cache.shape
            or k_cache.dtype != cache_dtype or v_cache.dtype != cache_dtype):
        raise ValueError(f"gemv_rotary_cache: caches must be [blocks, block_size, {num_kv_heads}, {head_dim}] "
                         f"{model_x.dtype} or float8_e4m3fn, got {tuple(k_cache.shape)} {k_cache.dtype}, "
                         f"{tuple(v_cache.shape)} {v_cache.dtype}")
    kv_scales = None
    if fp8_cache:
        check_scale(k_scale, "gemv_rotary_cache k_scale", k_cache.device)
        check_scale(v_scale, "gemv_rotary_cache v_scale", k_cache.device)
        assert k_scale is not None and v_scale is not None  # check_scale
        kv_scales = (k_scale, v_scale)
    if not (k_cache.is_contiguous() and v_cache.is_contiguous() and cos_sin.is_contiguous()):
        raise ValueError("gemv_rotary_cache: k_cache, v_cache and cos_sin must be contiguous")
    if head_dim % 2:
        raise ValueError(f"gemv_rotary_cache: head_dim must be even, got {head_dim}")
    tensors = [t for t in (x, weight, bias, norm_weight, norm_residual, q_norm, k_norm, weight_scale) if t is not None]
    check_launchable(*tensors, positions, cos_sin, k_cache, v_cache, slot_mapping)
    for name, t in (("x", x), ("weight", weight), ("bias", bias), ("norm_weight", norm_weight),
                    ("norm_residual", norm_residual)):
        _contiguous_last(name, t)
    if num_rows > GEMV_MAX_M:
        raise ValueError(f"gemv: M = {num_rows} > {GEMV_MAX_M}; use F.linear (cuBLAS) for larger batches")
    out = torch.empty(num_rows, n_total, dtype=model_x.dtype, device=x.device)
    s = x if norm_residual is None else torch.empty_like(norm_residual, memory_format=torch.contiguous_format)
    if num_rows == 0:
        return out, s
    half = head_dim // 2
    kind = "rope-norm" if norm_folded else "rope"
    cfg = rope_launch_config(config or gemv_config(kind, num_rows, n_total // 2, hidden, x.is_cuda,
                                                   model_x.element_size()), half, q_norm is not None,
                             model_x.element_size())
    block_n = cfg.block_n
    splits = triton.cdiv(half, block_n)
    num_total_heads = num_heads + 2 * num_kv_heads
    qk = (q_norm, k_norm) if q_norm is not None and k_norm is not None else None
    _launch(x, weight, out, n_total, num_total_heads * splits, cfg, bias, norm_weight, eps, norm_residual, s,
            False, None, pdl, rotary=(positions, cos_sin, k_cache, v_cache, slot_mapping),
            heads=(num_heads, num_kv_heads, half, splits), qk_norm=qk, norm_folded=norm_folded,
            weight_scale=weight_scale, weight_convert=weight_convert, trigger_first=pdl_trigger_first,
            norm_sums=norm_sums, zero_sums=zero_sums, kv_scales=kv_scales, x_accumulator=x_accumulator)
    return out, s


def rope_launch_config(cfg: GemvConfig, half: int, qk_norm: bool, elem_bytes: int) -> GemvConfig:
    """gemv_rotary_cache_triton's launch shape from gemv_config's: a program's rows are pairs (d, d + half) of one
    head, so at most half of them; with the per-head q / k norm the whole head's (the norm needs it in one program).
    Where that widens a float32 tensor-core tile, its K slice shrinks by as much, so a pipeline stage keeps the
    bytes the config was sized for (a 64-row float32 tile at 2-16 tokens asked 254,208 bytes of shared memory, the
    H200 has 232,448: Qwen3's head_dim 80 in the GPU tests, session 24)."""
    block_n = min(cfg.block_n, triton.next_power_of_2(half))
    block_k = cfg.block_k
    if qk_norm:
        wide = triton.next_power_of_2(half)
        if cfg.use_dot and elem_bytes > 2 and wide > block_n:
            block_k = max(16, block_k * block_n // wide)
        block_n = wide
    if cfg.use_dot:
        block_n = max(block_n, 16)
    else:  # two [BLOCK_N, BLOCK_K] float32 accumulators live in registers: keep them at <= 4096 elements
        block_k = min(block_k, max(32, 4096 // block_n))
    return dataclasses.replace(cfg, block_n=block_n, block_k=block_k)


def _check_accumulated_x(x: torch.Tensor, norm_residual: torch.Tensor | None) -> torch.Tensor:
    """x_accumulator's x: float32 [M, K] beside norm_residual [M, K] in the model dtype -> norm_residual (what the
    launcher's checks take for x: the operand the kernel rounds x to has its dtype and shape)."""
    if norm_residual is None:
        raise ValueError("gemv: x_accumulator rounds x and adds norm_residual before the prologue norm: pass both")
    if x.dtype != torch.float32 or x.shape != norm_residual.shape:
        raise ValueError(f"gemv: x_accumulator means float32 x shaped as norm_residual {tuple(norm_residual.shape)}, "
                         f"got {x.dtype} {tuple(x.shape)}")
    return norm_residual
