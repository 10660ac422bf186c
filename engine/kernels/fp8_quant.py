"""FP8 (E4M3) activation quantization for the tensor-core FP8 GEMM (fp8_linear.scaled_mm_fp8), one kernel.

x [M, K] -> (xq float8_e4m3fn [M, K], scale float32 [M, 1]) with x ~= xq * scale: per token (dynamic:
scale = max(amax(|row|) / 448, 1e-12)) or with the checkpoint's static per-tensor scale [1] repeated per row
(row-wise `_scaled_mm` takes scale_a [M, 1]). Values past +-448 saturate.

The eager form (`quantize_activations_ref`) is six kernels over float32 copies of x (float, abs, amax, div,
clamp, cast): about 13 bytes moved per element for the 2 + 1 the op needs, and six launches per linear in
every prefill step and every batch decode step above M = 16 (W2 decodes 1024 tokens a step through
_scaled_mm). This kernel reads x once and writes xq and the scale: one program per token row, the whole
row in registers (K <= 16384 here: 32 float32 a thread at 16 warps, as rmsnorm.py).

Variant (`rms_norm_quant_fp8`): the RMSNorm (with the residual add before it) that precedes the qkv and
gate_up projections, fused in front of the quantization, so the normed activations never go to memory in
bf16: h = rms_norm_ref(x, weight, eps, residual) rounded exactly as that reference rounds, then quantized as
above; the sum s = x + residual is written for the next block as rms_norm writes it.

Variant (`silu_mul_quant_fp8`): SiLU-and-multiply of the gate | up GEMM's output fused in front of the
quantization that feeds down_proj: x [M, 2K] -> the quantized silu(x[:, :K]) * x[:, K:], rounded to the model
dtype first as activation.py's kernel rounds it (so it equals that kernel then the quantization, bit for bit).
The [M, K] product never goes to memory in bf16: at W2's 8,192-token step, 8B, 235 MB written and read again
less a layer (~110 us at 4.3 TB/s of the ~180 us the two kernels move), one launch fewer.

Rounding matches the references bit for bit: the scale by IEEE division (div_rn; Triton's `/` is an
approximate divide on the GPU), then each element times the scale's IEEE reciprocal (one multiply an element,
not a division: on the H200 the 8,192 x 4,096 quantization took 38-71 us for ~25 us of bytes, 21:09 UTC, and
a division plus the integer rounding below are some 40 instructions an element by count), round-to-nearest-even float32 -> E4M3 as torch's `.to(torch.float8_e4m3fn)`:
the GPU's own conversion (cvt.rn.satfinite), and under the interpreter, whose cast rounds wrongly,
_round_to_e4m3's float32 arithmetic.
"""
from __future__ import annotations

import torch
from stoker.engine.kernels._triton import check_launchable, interpreting, tl, triton
from stoker.engine.kernels.activation import silu_and_mul_ref
from stoker.engine.kernels.rmsnorm import rms_norm_ref

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite E4M3 value
QUANT_MAX_K = 16384  # the longest row one program holds in registers (32 float32 a thread at 16 warps)
MIN_SCALE = 1e-12  # an all-zero row: any positive scale quantizes it to zeros; this one avoids 0 / 0
# The kernels' copies: a @triton.jit function reads module globals only when they are constexpr (the CPU
# interpreter reads any global, so only the GPU compile failed on the plain floats).
_FP8_MAX_C = tl.constexpr(FP8_MAX)
_MIN_SCALE_C = tl.constexpr(MIN_SCALE)


# -------------------------------------------------------------------------------------------- reference
def quantize_activations_ref(x: torch.Tensor, input_scale: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """[M, K] -> (float8 [M, K], float32 [M, 1]): per token when input_scale is None, else the static [1]."""
    x32 = x.float()
    if input_scale is None:
        # A tensor divisor, not the Python float: on CUDA, torch divides by a scalar as a multiply by its
        # reciprocal (1 ulp off the kernel's correctly rounded division in about half the rows, seen on the H200).
        # full_like, not torch.tensor: no host-to-device copy, so this eager path stays legal in graph capture.
        amax = x32.abs().amax(dim=1, keepdim=True)
        scale = (amax / torch.full_like(amax, FP8_MAX)).clamp(min=MIN_SCALE)
    else:
        scale = input_scale.float().reshape(1, 1).expand(x.shape[0], 1).contiguous()
    # times the reciprocal (a tensor-by-tensor division: IEEE on CUDA too), as the kernel: one multiply an element
    inverse = torch.full_like(scale, 1.0) / scale
    return (x32 * inverse).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale


def silu_mul_quant_fp8_ref(x: torch.Tensor, input_scale: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """[M, 2K] -> quantize_activations_ref(silu_and_mul_ref(x)): (float8 [M, K], float32 [M, 1])."""
    return quantize_activations_ref(silu_and_mul_ref(x), input_scale)


def rms_norm_quant_fp8_ref(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None,
    input_scale: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(xq, scale, s): rms_norm_ref's output quantized by quantize_activations_ref, and its sum s."""
    h, s = rms_norm_ref(x, weight, eps, residual)
    xq, scale = quantize_activations_ref(h, input_scale)
    return xq, scale, s


# ----------------------------------------------------------------------------------------------- kernel
@triton.jit
def _round_to_e4m3(v):
    """float32 v (|v| <= 448) rounded to the nearest E4M3 value, ties to even, still in float32.

    Adding and subtracting M = 1.5 * 2^(e + 20) rounds v to a multiple of M's ulp 2^(e - 3), the E4M3
    spacing at v's exponent e (3 mantissa bits; e floored at -6, where the subnormals' fixed 2^-9 spacing
    starts), by the float32 adder's own round-to-nearest-even. The cast after it is then exact. Why not just
    cast: Triton 3.6's interpreter rounds float32 -> E4M3 wrongly when the mantissa carries into the
    exponent (126.8 -> 64, not 128), so the CPU tests could not check the rounding; with this they do, and
    the GPU runs the same arithmetic (a few integer ops an element in a memory-bound kernel)."""
    bits = v.to(tl.int32, bitcast=True)
    exponent = ((bits >> 23) & 0xFF) - 127
    magic = (((tl.maximum(exponent, -6) + 20 + 127) << 23) | 0x400000).to(tl.float32, bitcast=True)
    rounded = (tl.abs(v) + magic) - magic  # on |v|: a small negative v would come back as +0, not -0
    return (rounded.to(tl.int32, bitcast=True) | (bits & -2147483648)).to(tl.float32, bitcast=True)


@triton.jit
def _quant_fp8_kernel(
    x_ptr, residual_ptr, norm_ptr, sum_ptr, xq_ptr, scale_ptr, static_scale_ptr,
    x_stride, residual_stride, sum_stride, xq_stride, K, eps,
    NORM: tl.constexpr, HAS_RESIDUAL: tl.constexpr, STATIC: tl.constexpr, BLOCK: tl.constexpr,
    SILU: tl.constexpr = False, HW_CAST: tl.constexpr = True,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < K
    x = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0)
    dtype = x_ptr.dtype.element_ty
    if SILU:  # x is the gate half of [gate | up] (K each): activation.py's arithmetic, rounded to the dtype
        gate = x.to(tl.float32)
        up = tl.load(x_ptr + row * x_stride + K + cols, mask=mask, other=0.0).to(tl.float32)
        x = (gate * tl.sigmoid(gate) * up).to(dtype)
    if HAS_RESIDUAL:  # s = x + residual rounded to the model dtype, as torch's `x + residual`
        r = tl.load(residual_ptr + row * residual_stride + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(dtype)
        tl.store(sum_ptr + row * sum_stride + cols, x, mask=mask)
    x32 = x.to(tl.float32)
    if NORM:  # rms_norm_ref: normalise in float32, round, times the weight, round
        inv_rms = tl.rsqrt(tl.sum(x32 * x32, axis=0) / K + eps)
        g = tl.load(norm_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        x32 = (g * (x32 * inv_rms).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
    if STATIC:
        scale = tl.load(static_scale_ptr).to(tl.float32)
    else:
        scale = tl.maximum(tl.div_rn(tl.max(tl.abs(x32), axis=0), _FP8_MAX_C), _MIN_SCALE_C)
    q = tl.minimum(tl.maximum(x32 * tl.div_rn(1.0, scale), -_FP8_MAX_C), _FP8_MAX_C)
    if not HW_CAST:  # the interpreter: its own float32 -> E4M3 cast rounds wrongly (_round_to_e4m3)
        q = _round_to_e4m3(q)
    tl.store(xq_ptr + row * xq_stride + cols, q.to(xq_ptr.dtype.element_ty), mask=mask)
    tl.store(scale_ptr + row, scale)


def _num_warps(block: int) -> int:
    return 16 if block >= 8192 else 8 if block >= 2048 else 4 if block >= 512 else 2


def _launch(
    x: torch.Tensor, norm_weight: torch.Tensor | None, eps: float, residual: torch.Tensor | None,
    input_scale: torch.Tensor | None, silu: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    if x.dim() != 2 or x.stride(1) != 1:
        raise ValueError(f"fp8 quant: x must be [M, K] with unit stride along K, got {tuple(x.shape)}")
    if silu and (x.shape[1] % 2 or norm_weight is not None or residual is not None):
        raise ValueError(f"fp8 quant: SiLU-and-multiply takes [M, 2K] (gate | up) alone, got {tuple(x.shape)}")
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype or residual.stride(1) != 1):
        raise ValueError(f"fp8 quant: residual must match x ({tuple(x.shape)}, {x.dtype}), contiguous along K")
    if norm_weight is not None and (norm_weight.shape != (x.shape[1],) or norm_weight.stride(0) != 1):
        raise ValueError(f"fp8 quant: norm weight must be [{x.shape[1]}] contiguous, got {tuple(norm_weight.shape)}")
    if input_scale is not None and input_scale.numel() != 1:
        raise ValueError(f"fp8 quant: a static input scale is one value, got shape {tuple(input_scale.shape)}")
    check_launchable(*[t for t in (x, residual, norm_weight, input_scale) if t is not None])
    num_rows, k = x.shape[0], x.shape[1] // 2 if silu else x.shape[1]
    block = triton.next_power_of_2(k)
    if block > QUANT_MAX_K:
        raise ValueError(f"fp8 quant: rows of {k} > {QUANT_MAX_K} elements do not fit one program's registers")
    xq = torch.empty(num_rows, k, dtype=FP8_DTYPE, device=x.device)
    scale = torch.empty(num_rows, 1, dtype=torch.float32, device=x.device)
    summed = x if residual is None else torch.empty_like(x, memory_format=torch.contiguous_format)
    if num_rows == 0:
        return xq, scale, summed
    static = input_scale.float() if input_scale is not None else scale
    _quant_fp8_kernel[(num_rows,)](
        x, residual if residual is not None else x, norm_weight if norm_weight is not None else x, summed,
        xq, scale, static, x.stride(0), (residual if residual is not None else x).stride(0), summed.stride(0),
        xq.stride(0), k, eps,
        NORM=norm_weight is not None, HAS_RESIDUAL=residual is not None, STATIC=input_scale is not None,
        BLOCK=block, SILU=silu, HW_CAST=not interpreting(), num_warps=_num_warps(block),
    )
    return xq, scale, summed


def quantize_activations_triton(x: torch.Tensor, input_scale: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """quantize_activations_ref in one kernel."""
    xq, scale, _ = _launch(x, None, 0.0, None, input_scale)
    return xq, scale


def silu_mul_quant_fp8_triton(x: torch.Tensor, input_scale: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """silu_mul_quant_fp8_ref in one kernel (the bf16 product never reaches memory)."""
    xq, scale, _ = _launch(x, None, 0.0, None, input_scale, silu=True)
    return xq, scale


def rms_norm_quant_fp8_triton(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None,
    input_scale: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """rms_norm_quant_fp8_ref in one kernel (the normed bf16 activations never reach memory)."""
    if weight.dtype != x.dtype:
        raise ValueError(f"rms_norm_quant_fp8: norm weight dtype {weight.dtype} != x dtype {x.dtype}")
    return _launch(x, weight, eps, residual, input_scale)
