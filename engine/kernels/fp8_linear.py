"""FP8 (E4M3) linear: y = x @ (W * scale)^T (+ b), W stored as float8_e4m3fn [N, K] with float32 scales.

Scales are either one per output row (`weight_scale` [N]: per-channel checkpoints, and per-tensor ones whose
scalar per fused shard is repeated over that shard's rows, so q | k | v with three scales needs no
requantization) or one per 128 x 128 tile (`weight_scale` [ceil(N/128), ceil(K/128)], block checkpoints).

- `fp8_linear_ref`: dequantize W to the activation dtype (float32 products, rounded once) and F.linear. This
  defines the semantics: the CPU runs it, the tests compare the GPU paths with it.
- `gemv_fp8_triton` (M <= 16, the decode path): W8A16, the FP8 weight tile converted to the activation dtype
  in registers, row scales applied once to the float32 accumulator in the epilogue (block scales per K tile
  inside the loop, since they change along K). Reads 1 byte per weight: the batch-1 floor halves. Launch
  shape (tl.dot or CUDA cores, block sizes, warps, stages) from FP8_GEMV_CONFIGS per shape class and M,
  which ops/bench_fp8_gemv.py sweeps on the GPU.
- `scaled_mm_fp8` (M > 16 on CUDA, bfloat16): activations quantized per token (dynamic) or with the
  checkpoint's per-tensor input_scale (static) in one kernel (fp8_quant.py), then `torch._scaled_mm` with
  row-wise scales (scale_a [M, 1], scale_b [1, N]) on the FP8 tensor cores; 1.3-1.9x bf16 from M = 512 up
  on the H200 (shared/notes/h200-gemm-facts.md). Activation quantization adds the FP8 rounding of x to the
  reference.
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from stoker.engine.kernels._triton import check_launchable, interpreting, tl, triton
from stoker.engine.kernels.fp8_convert import CONVERT_CODE, CONVERTS, e4m3_words_to_tile, e4m3x4_to_f32
from stoker.engine.kernels.fp8_quant import (
    FP8_DTYPE,
    FP8_MAX,
    QUANT_MAX_K,
    quantize_activations_ref,
    quantize_activations_triton,
)
from stoker.engine.kernels.gemv import GemvConfig

FP8_GEMV_MAX_M = 16  # the dot tile is 16 tokens tall; above it the tensor-core GEMM wins (h200-gemm-facts)
# cuBLASLt's FP8 "fast accumulation" (_scaled_mm use_fast_accum): the tensor cores' own accumulator over the
# whole K loop instead of promoting partial sums to float32 every few steps. H200, 2026-12-01 21:09 UTC
# (ops/bench_fp8_prefill.py), 8B shapes, us at M = 8,192: qkv 302 -> 269, o 203 -> 181, gate_up 1,442 ->
# 1,311, down 700 -> 684 (1,334-1,374 -> 1,406-1,532 TFLOP/s); M = 1,024: 51.4 -> 46.2, 38.0 -> 34.3, 192.8 ->
# 169.5, 86.4 -> 81.4. Its cost: 1.3e-3 (K = 4,096) and 2.9e-3 (K = 14,336) relative (Frobenius) difference
# from the promoted sums, against the ~3 % the E4M3 rounding of the activations already adds.
SCALED_MM_FAST_ACCUM = True


# -------------------------------------------------------------------------------------------- reference
def quantize_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] float -> (float8 [N, K], float32 scale [N]) with scale = amax(|row|) / 448 (zero rows: scale 1)."""
    w32 = w.float()
    amax = w32.abs().amax(dim=1)
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    return (w32 / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale


def dequantize(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None, dtype: torch.dtype) -> torch.Tensor:
    """float8 [N, K] and its scales (row [N] or block [ceil(N/bn), ceil(K/bk)]) -> [N, K] in `dtype`."""
    w32 = weight.float()
    if block is None:
        return (w32 * scale.float()[:, None]).to(dtype)
    bn, bk = block
    n, k = weight.shape
    full = scale.float().repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]
    return (w32 * full).to(dtype)


def check_fp8_args(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None) -> None:
    if x.dim() != 2 or weight.dim() != 2 or weight.shape[1] != x.shape[1]:
        raise ValueError(f"fp8_linear: x [M, K] and weight [N, K] expected, got {tuple(x.shape)}, {tuple(weight.shape)}")
    if weight.dtype != FP8_DTYPE or scale.dtype != torch.float32:
        raise ValueError(f"fp8_linear: weight float8_e4m3fn and float32 scales expected, got {weight.dtype}, {scale.dtype}")
    n, k = weight.shape
    if block is None:
        expected: tuple[int, ...] = (n,)
    else:
        expected = (-(-n // block[0]), -(-k // block[1]))
    if tuple(scale.shape) != expected:
        raise ValueError(f"fp8_linear: scale shape {tuple(scale.shape)}, expected {expected}")


def fp8_linear_ref(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    block: tuple[int, int] | None = None,
) -> torch.Tensor:
    """[M, K] -> [M, N] in x.dtype: F.linear(x, dequantize(W, scale) in x.dtype, bias)."""
    check_fp8_args(x, weight, scale, block)
    return F.linear(x, dequantize(weight, scale, block, x.dtype), bias)


# --------------------------------------------------------------------------- tensor cores (M > 16, CUDA)
def takes_scaled_mm(x: torch.Tensor, weight: torch.Tensor, block: tuple[int, int] | None) -> bool:
    """Whether the CUDA dispatch runs this linear on the FP8 tensor cores: more than 16 bfloat16 tokens, row
    scales (no block GEMM yet), N and K multiples of 16 (cuBLASLt's FP8 layout rule)."""
    return (x.shape[0] > FP8_GEMV_MAX_M and block is None and x.dtype == torch.bfloat16
            and weight.shape[0] % 16 == 0 and weight.shape[1] % 16 == 0)


def scaled_mm_fp8(
    x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
    input_scale: torch.Tensor | None,
) -> torch.Tensor:
    """Row-wise scaled FP8 GEMM (bfloat16 out): x quantized per token or per tensor, W's row scales."""
    xq, x_scale = quantize_activations(x, input_scale)
    return scaled_mm_quantized(xq, x_scale, weight, scale, bias, x.dtype)


def quantize_activations(x: torch.Tensor, input_scale: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """fp8_quant's one kernel on CUDA (the eager reference was six kernels a linear); rows past its register
    tile (K > QUANT_MAX_K, e.g. a 70B down_proj) take the reference."""
    if x.is_cuda and x.shape[1] <= QUANT_MAX_K and x.stride(1) == 1:
        return quantize_activations_triton(x, input_scale)
    return quantize_activations_ref(x, input_scale)


def scaled_mm_quantized(
    xq: torch.Tensor, x_scale: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """_scaled_mm on activations already in FP8 (xq [M, K], x_scale [M, 1]): row scales on both sides."""
    # weight [N, K] row-major is the column-major [K, N] operand _scaled_mm wants; scales float32.
    out = torch._scaled_mm(xq, weight.t(), scale_a=x_scale, scale_b=scale.view(1, -1), out_dtype=out_dtype,
                           use_fast_accum=SCALED_MM_FAST_ACCUM)
    return out if bias is None else out + bias


# ------------------------------------------------------------------------------------- W8A16 GEMV kernel
# The launch shape is the bf16 GEMV's (block sizes, tl.dot or CUDA cores, warps, stages); with CUDA cores the
# W8A16 kernel sums a [BLOCK_M, BLOCK_N, BLOCK_K] float32 accumulator over K once at the end. The name stays:
# FP8_GEMV_CONFIGS and ops/bench_fp8_gemv.py --apply write it.
Fp8GemvConfig = GemvConfig


@triton.jit
def _words_loop(x_ptr, w_ptr, M, N, K, x_stride, w_stride, n, n_mask, m, m_mask,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, CONVERT: tl.constexpr,
                ROW_VEC: tl.constexpr):
    """CUDA-core W8A16 over int32 weight words ([N, K / 4], w_stride in words): sum_k x[m, k] w[n, k] in float32
    for the word conversions (fp8_convert.py). Element 4j + p of a row is byte p of word j. CONVERT 1 / 2:
    x read as four stride-4 slices, one product each; 3 / 4 (the "-join" twins): the four converted slices
    joined back into the [BLOCK_N, BLOCK_K] tile and x read contiguously, as the cast loop does (which of
    the two layouts costs fewer register shuffles is the sweep's question)."""
    js = tl.arange(0, BLOCK_K // 4)
    jw = tl.max_contiguous(js, max(1, ROW_VEC // 4)) if ROW_VEC != 0 else js  # see gemv_fp8_triton's row_vec
    w_ptrs = w_ptr + n.to(tl.int64)[:, None] * w_stride + jw[None, :]
    x_rows = x_ptr + m[:, None] * x_stride
    if ROW_VEC != 0:
        acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    elif CONVERT >= 3:
        acc = tl.zeros([BLOCK_M, BLOCK_N, BLOCK_K], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N, BLOCK_K // 4], dtype=tl.float32)
    for j0 in range(0, K // 4, BLOCK_K // 4):
        j = j0 + js
        j_mask = j < K // 4
        words = tl.load(w_ptrs + j0, mask=n_mask[:, None] & j_mask[None, :], other=0)
        if CONVERT >= 3:
            w = e4m3_words_to_tile(words, CONVERT - 2, BLOCK_N, BLOCK_K)
            kk = 4 * j0 + tl.arange(0, BLOCK_K)
            x = tl.load(x_rows + kk[None, :], mask=m_mask[:, None] & (kk < K)[None, :], other=0.0).to(tl.float32)
            if ROW_VEC != 0:
                acc += x * w
            else:
                acc += x[:, None, :] * w[None, :, :]
        else:
            f0, f1, f2, f3 = e4m3x4_to_f32(words, CONVERT)
            xm = m_mask[:, None] & j_mask[None, :]
            x0 = tl.load(x_rows + 4 * j[None, :], mask=xm, other=0.0).to(tl.float32)
            x1 = tl.load(x_rows + 4 * j[None, :] + 1, mask=xm, other=0.0).to(tl.float32)
            x2 = tl.load(x_rows + 4 * j[None, :] + 2, mask=xm, other=0.0).to(tl.float32)
            x3 = tl.load(x_rows + 4 * j[None, :] + 3, mask=xm, other=0.0).to(tl.float32)
            acc += (x0[:, None, :] * f0[None, :, :] + x1[:, None, :] * f1[None, :, :]
                    + x2[:, None, :] * f2[None, :, :] + x3[:, None, :] * f3[None, :, :])
    acc = tl.sum(acc, axis=1)[None, :] if ROW_VEC != 0 else tl.sum(acc, axis=2)
    if CONVERT % 2 == 1:  # "bits" read every weight as value * 2^-8
        acc = acc * 256.0
    return acc


@triton.jit(do_not_specialize=["M"])  # one compiled kernel per config for every M, not one for M = 1, one for 16
def _gemv_fp8_kernel(
    x_ptr, w_ptr, scale_ptr, bias_ptr, out_ptr,
    M, N, K, x_stride, w_stride, out_stride, scale_stride,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, USE_DOT: tl.constexpr,
    BLOCK_SCALES: tl.constexpr, SCALE_BN: tl.constexpr, SCALE_BK: tl.constexpr,
    HAS_BIAS: tl.constexpr, DOT_PRECISION: tl.constexpr, CONVERT: tl.constexpr, ROW_VEC: tl.constexpr,
):
    pid = tl.program_id(0)
    n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = n < N
    m = tl.arange(0, BLOCK_M)
    m_mask = m < M
    if CONVERT != 0:  # int32 words, row scales, CUDA cores (the launcher checks)
        acc = _words_loop(x_ptr, w_ptr, M, N, K, x_stride, w_stride, n, n_mask, m, m_mask,
                          BLOCK_M, BLOCK_N, BLOCK_K, CONVERT, ROW_VEC)
    else:
        acc = _cast_loop(x_ptr, w_ptr, scale_ptr, M, N, K, x_stride, w_stride, scale_stride, n, n_mask, m, m_mask,
                         BLOCK_M, BLOCK_N, BLOCK_K, USE_DOT, BLOCK_SCALES, SCALE_BN, SCALE_BK, DOT_PRECISION,
                         ROW_VEC)
    if not BLOCK_SCALES:  # row scales: once, on the float32 sums (block scales were applied per K tile)
        acc = acc * tl.load(scale_ptr + n, mask=n_mask, other=0.0)[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    out_mask = m_mask[:, None] & n_mask[None, :]
    tl.store(out_ptr + m[:, None] * out_stride + n[None, :], acc.to(out_ptr.dtype.element_ty), mask=out_mask)


@triton.jit
def _cast_loop(x_ptr, w_ptr, scale_ptr, M, N, K, x_stride, w_stride, scale_stride, n, n_mask, m, m_mask,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, USE_DOT: tl.constexpr,
               BLOCK_SCALES: tl.constexpr, SCALE_BN: tl.constexpr, SCALE_BK: tl.constexpr,
               DOT_PRECISION: tl.constexpr, ROW_VEC: tl.constexpr):
    """The float8 tile loaded as such and converted by Triton's cast ("cast"): [BLOCK_M, BLOCK_N] float32 sums."""
    ks = tl.arange(0, BLOCK_K)
    kw = tl.max_contiguous(ks, ROW_VEC) if ROW_VEC != 0 else ks  # see gemv_fp8_triton's row_vec
    w_ptrs = w_ptr + n.to(tl.int64)[:, None] * w_stride + kw[None, :]
    if USE_DOT:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    elif ROW_VEC != 0:
        acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + ks
        k_mask = kk < K
        x = tl.load(x_ptr + m[:, None] * x_stride + kk[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        w = tl.load(w_ptrs + k0, mask=n_mask[:, None] & k_mask[None, :], other=0.0)
        if BLOCK_SCALES:  # one scale per (SCALE_BN-row, SCALE_BK-col) tile; BLOCK_K divides SCALE_BK
            s = tl.load(scale_ptr + (n // SCALE_BN) * scale_stride + k0 // SCALE_BK, mask=n_mask, other=0.0)
            if USE_DOT:  # FP8 -> x dtype in registers; the tile's scale on its float32 partial
                acc += tl.dot(x, tl.trans(w.to(x.dtype)), input_precision=DOT_PRECISION) * s[None, :]
            elif ROW_VEC != 0:
                acc += x.to(tl.float32) * (w.to(tl.float32) * s[:, None])
            else:
                acc += x.to(tl.float32)[:, None, :] * (w.to(tl.float32) * s[:, None])[None, :, :]
        elif USE_DOT:
            acc = tl.dot(x, tl.trans(w.to(x.dtype)), acc, input_precision=DOT_PRECISION)
        elif ROW_VEC != 0:
            acc += x.to(tl.float32) * w.to(tl.float32)
        else:
            acc += x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :]
    if ROW_VEC != 0:  # [BN, BK] -> [1, BN]
        acc = tl.sum(acc, axis=1)[None, :]
    elif not USE_DOT:
        acc = tl.sum(acc, axis=2)
    return acc


# One config per (shape class, M rounded up to a power of two), picked at launch by a cached lookup.
# From ops/bench_fp8_gemv.py's sweep (NVIDIA H200, 2026-12-01 11:30 UTC, BENCHMARKS.md):
# per class and M the config with the least summed slowdown over the class's shapes. Comments: us per
# call of that config on each shape (CUDA-graph replay over >= 512 MB of weights) and the shape's own
# best. A class the sweep did not see takes _FALLBACK_CONFIG.
FP8_GEMV_CONFIGS: dict[tuple[str, int], Fp8GemvConfig] = {
    # 8b gate_up 44.8 us (best 44.8), 1b gate_up 16.3 us (best 15.7)
    ("n_large", 1): Fp8GemvConfig(1, 8, 1024, False, 4, 3),
    # 8b gate_up 45.8 us (best 45.8), 1b gate_up 16.7 us (best 15.7)
    ("n_large", 2): Fp8GemvConfig(16, 32, 512, True, 4, 3),
    # 8b gate_up 45.8 us (best 45.8), 1b gate_up 16.6 us (best 15.7)
    ("n_large", 4): Fp8GemvConfig(16, 32, 512, True, 4, 3),
    # 8b gate_up 45.5 us (best 45.5), 1b gate_up 16.6 us (best 15.8)
    ("n_large", 8): Fp8GemvConfig(16, 32, 512, True, 4, 3),
    # 8b gate_up 45.6 us (best 45.6), 1b gate_up 16.7 us (best 15.8)
    ("n_large", 16): Fp8GemvConfig(16, 32, 512, True, 4, 3),
    # 8b qkv 13.0 us (best 12.3), 8b o 8.6 us (best 8.6)
    ("n_mid", 1): Fp8GemvConfig(1, 8, 1024, False, 4, 3),
    # 8b qkv 15.7 us (best 15.7), 8b o 11.8 us (best 11.7)
    ("n_mid", 2): Fp8GemvConfig(16, 32, 512, True, 4, 3),
    # 8b qkv 15.7 us (best 15.7), 8b o 11.8 us (best 11.8)
    ("n_mid", 4): Fp8GemvConfig(16, 32, 512, True, 4, 3),
    # 8b qkv 15.7 us (best 15.7), 8b o 11.9 us (best 11.9)
    ("n_mid", 8): Fp8GemvConfig(16, 32, 512, True, 4, 3),
    # 8b qkv 15.7 us (best 15.7), 8b o 11.8 us (best 11.8)
    ("n_mid", 16): Fp8GemvConfig(16, 32, 512, True, 4, 3),
    # 8b down 23.0 us (best 23.0)
    ("n_mid_long_k", 1): Fp8GemvConfig(1, 8, 1024, False, 4, 3),
    # 8b down 33.7 us (best 33.7)
    ("n_mid_long_k", 2): Fp8GemvConfig(16, 32, 512, True, 4, 3),
    # 8b down 33.7 us (best 33.7)
    ("n_mid_long_k", 4): Fp8GemvConfig(16, 32, 512, True, 4, 3),
    # 8b down 33.9 us (best 33.9)
    ("n_mid_long_k", 8): Fp8GemvConfig(16, 32, 512, True, 4, 3),
    # 8b down 33.8 us (best 33.8)
    ("n_mid_long_k", 16): Fp8GemvConfig(16, 32, 512, True, 4, 3),
    # 1b qkv 5.1 us (best 5.1), 1b o 4.5 us (best 4.2)
    ("n_small", 1): Fp8GemvConfig(1, 8, 1024, False, 4, 3),
    # 1b qkv 7.0 us (best 6.3), 1b o 4.8 us (best 4.8)
    ("n_small", 2): Fp8GemvConfig(2, 4, 1024, False, 4, 3),
    # 1b qkv 7.2 us (best 7.2), 1b o 6.9 us (best 6.9)
    ("n_small", 4): Fp8GemvConfig(16, 32, 512, True, 4, 3),
    # 1b qkv 7.2 us (best 7.2), 1b o 6.9 us (best 6.9)
    ("n_small", 8): Fp8GemvConfig(16, 32, 512, True, 4, 3),
    # 1b qkv 7.2 us (best 7.2), 1b o 6.9 us (best 6.9)
    ("n_small", 16): Fp8GemvConfig(16, 32, 512, True, 4, 3),
    # 1b down 8.7 us (best 8.7)
    ("n_small_long_k", 1): Fp8GemvConfig(1, 4, 2048, False, 4, 3),
    # 1b down 11.7 us (best 11.7)
    ("n_small_long_k", 2): Fp8GemvConfig(2, 4, 1024, False, 4, 3),
    # 1b down 18.5 us (best 18.5)
    ("n_small_long_k", 4): Fp8GemvConfig(16, 16, 1024, True, 4, 3),
    # 1b down 18.4 us (best 18.4)
    ("n_small_long_k", 8): Fp8GemvConfig(16, 16, 1024, True, 4, 3),
    # 1b down 18.8 us (best 18.8)
    ("n_small_long_k", 16): Fp8GemvConfig(16, 16, 1024, True, 4, 3),
}
_FALLBACK_CONFIG = Fp8GemvConfig(16, 32, 256, True, 4, 4)
# The E4M3 conversion of CUDA-core launches (fp8_convert.py); tl.dot configs and block scales always "cast".
# "cast" until ops/bench_fp8_gemv.py --converts has measured the others on the H200.
FP8_CONVERT = "cast"


def shape_class(n: int, k: int) -> str:
    """What sets a GEMV's speed at one M: the number of programs (N outputs) and the loop's length (K).
    Llama 8B: qkv/o n_mid, gate_up n_large, down n_mid_long_k; 1B: qkv/o n_small, down n_small_long_k."""
    rows = "n_large" if n >= 16384 else "n_mid" if n >= 4096 else "n_small"
    return rows + ("_long_k" if k >= 8192 else "")


@functools.lru_cache(maxsize=256)
def fp8_gemv_config(n: int, k: int, num_tokens: int, on_gpu: bool) -> Fp8GemvConfig:
    """The table's config for weight [n, k] and M tokens (a dict hit after the first launch of a shape)."""
    m = triton.next_power_of_2(num_tokens)
    if not on_gpu:  # the interpreter pays per program and numpy op: few wide programs, a few K slices
        return Fp8GemvConfig(m, 32, 64, False, 4, 1) if m <= 4 else Fp8GemvConfig(16, 32, 64, True, 4, 1)
    return FP8_GEMV_CONFIGS.get((shape_class(n, k), m), _FALLBACK_CONFIG)


def _fit_block_k(block_k: int, scale_bk: int) -> int:
    """Block scales change every scale_bk columns: the K step must divide it (halve it until it does)."""
    while block_k > 16 and scale_bk % block_k:
        block_k //= 2
    if scale_bk % block_k:
        raise ValueError(f"gemv_fp8: weight block {scale_bk} along K is not a multiple of 16")
    return block_k


def words_convert_problem(weight: torch.Tensor, block: tuple[int, int] | None, cfg: Fp8GemvConfig,
                          convert: str) -> str | None:
    """Why the int32-word conversions ("bits", "asm") cannot run this launch, or None."""
    if block is not None:
        return "block scales change along K inside a word loop that has none (row scales only)"
    if cfg.use_dot:
        return "the word loop runs on the CUDA cores only (a tl.dot config was given)"
    if weight.shape[1] % 4 or weight.stride(0) % 4 or weight.storage_offset() % 4 or cfg.block_k < 4:
        return "the weight rows must be whole int32 words (K, row stride and offset multiples of 4)"
    if convert.startswith("asm") and interpreting():
        return "inline PTX does not run under the Triton interpreter"
    return None


def _pick_convert(convert: str | None, weight: torch.Tensor, block: tuple[int, int] | None,
                  cfg: Fp8GemvConfig) -> str:
    """An explicit `convert` is honoured or refused; the default falls back to "cast" where it cannot run."""
    if convert is not None and convert not in CONVERTS:
        raise ValueError(f"gemv_fp8: convert {convert!r} is not one of {CONVERTS}")
    how = convert or FP8_CONVERT
    problem = None if how == "cast" else words_convert_problem(weight, block, cfg, how)
    if problem is None:
        return how
    if convert is not None:
        raise ValueError(f"gemv_fp8: convert {convert!r} cannot run here: {problem}")
    return "cast"


def gemv_fp8_triton(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    block: tuple[int, int] | None = None,
    *,
    config: Fp8GemvConfig | None = None,
    convert: str | None = None,
) -> torch.Tensor:
    """fp8_linear_ref's semantics for M <= 16 tokens, weights read once as FP8; config overrides the table
    (the sweep uses it), convert the E4M3 conversion (fp8_convert.CONVERTS; default FP8_CONVERT where the
    launch allows it, else "cast")."""
    check_fp8_args(x, weight, scale, block)
    num_tokens, k = x.shape
    n = weight.shape[0]
    if num_tokens > FP8_GEMV_MAX_M:
        raise ValueError(f"gemv_fp8: M = {num_tokens} > {FP8_GEMV_MAX_M}; use scaled_mm_fp8")
    if bias is not None and (bias.shape != (n,) or bias.dtype != x.dtype):
        raise ValueError(f"gemv_fp8: bias must be [{n}] {x.dtype}, got {tuple(bias.shape)} {bias.dtype}")
    if x.stride(1) != 1 or weight.stride(1) != 1:
        raise ValueError("gemv_fp8: x and weight need unit stride along K")
    if config is not None and (config.block_m < num_tokens or (config.use_dot and config.block_m < 16)):
        raise ValueError(f"gemv_fp8: config {config.label()} cannot hold M = {num_tokens} (tl.dot needs block_m 16)")
    cfg = config or fp8_gemv_config(n, k, num_tokens, x.is_cuda)  # the table's entries hold their M (tested)
    block_k = cfg.block_k if block is None else _fit_block_k(cfg.block_k, block[1])
    how = _pick_convert(convert, weight, block, cfg)
    check_launchable(x, weight, scale)
    w = weight if how == "cast" else weight.view(torch.int32)  # [N, K / 4] words: 4 codes each
    out = torch.empty(num_tokens, n, dtype=x.dtype, device=x.device)
    _gemv_fp8_kernel[(triton.cdiv(n, cfg.block_n),)](
        x, w, scale, bias if bias is not None else scale, out,
        num_tokens, n, k, x.stride(0), w.stride(0), out.stride(0), scale.stride(0),
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=block_k, USE_DOT=cfg.use_dot,
        BLOCK_SCALES=block is not None, SCALE_BN=block[0] if block else 1, SCALE_BK=block[1] if block else 1,
        HAS_BIAS=bias is not None, DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        CONVERT=CONVERT_CODE[how], ROW_VEC=row_vec(cfg, block_k, x.element_size(), how),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return out


# The one-token CUDA-core loop of gemv.py (W_VEC) here too: a [BN, BK] accumulator in the weight load's layout,
# the weight's contiguous run held to x's, instead of the [1, BN, BK] one whose layout cost a shared-memory
# conversion of every weight tile (the fused GEMV's H200 figures with it, 17:56 UTC: down 23.4 -> 17.5 us, o 8.8
# -> 7.1). Not for the stride-4 word layouts ("bits", "asm"), which read x in four slices.
ROW_VEC_FP8 = True


def row_vec(cfg: Fp8GemvConfig, block_k: int, elem_bytes: int, convert: str) -> int:
    """ROW_VEC: 0 for the [BM, BN, BK] accumulator, else the K elements per thread of x's [1, BK] load (block_k:
    the launch's K step, which block scales may have narrowed)."""
    if not ROW_VEC_FP8 or cfg.use_dot or cfg.block_m != 1 or convert in ("bits", "asm"):
        return 0
    return max(1, min(16 // elem_bytes, block_k // (32 * cfg.num_warps)))
