"""RMSNorm, optionally fused with the residual add that precedes it in every Llama block."""
from __future__ import annotations

import torch
from stoker.engine.kernels._triton import check_launchable, interpreting, tl, triton

try:  # inline PTX (griddepcontrol.*): only reached when PDL_GDC is set, never under the interpreter
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except Exception:  # triton missing or without the extra module: kernels with PDL_GDC=False never name them
    gdc_launch_dependents = gdc_wait = None


def _check(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None) -> None:
    if x.dim() != 2:
        raise ValueError(f"rms_norm: x must be [T, H], got shape {tuple(x.shape)}")
    if weight.shape != (x.shape[1],):
        raise ValueError(f"rms_norm: weight must be [{x.shape[1]}], got {tuple(weight.shape)}")
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype):
        raise ValueError(
            f"rms_norm: residual must match x ({tuple(x.shape)}, {x.dtype}), "
            f"got {tuple(residual.shape)}, {residual.dtype}"
        )


def rms_norm_ref(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (rmsnorm(s) * weight, s) with s = x + residual (rounded to x.dtype), or s = x.

    Math as Hugging Face Llama: variance in float32, normalise in float32, round to x.dtype, then scale.
    """
    _check(x, weight, residual)
    s = x if residual is None else x + residual
    s32 = s.float()
    h = s32 * torch.rsqrt(s32.pow(2).mean(-1, keepdim=True) + eps)
    return (weight * h.to(x.dtype)).to(x.dtype), s


def _num_warps(block: int) -> int:
    # One row per program: wider rows get more warps so each thread holds <= ~16 elements (Liger's rule).
    return 16 if block >= 8192 else 8 if block >= 2048 else 4 if block >= 512 else 2


@triton.jit
def _rms_norm_kernel(
    x_ptr, residual_ptr, weight_ptr, out_ptr, sum_ptr,
    x_row_stride, residual_row_stride, out_row_stride, sum_row_stride,
    hidden, eps,
    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr, PDL_GDC: tl.constexpr = False,
):
    if PDL_GDC:
        # Launched with PDL in the fused decode chain: wait for the kernel that wrote x, then let the GEMV after
        # this one in at once, so its programs load their weight tiles while this one normalises (the GEMV
        # waits for this kernel to finish before it reads the output).
        gdc_wait()
        gdc_launch_dependents()
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    x = tl.load(x_ptr + row * x_row_stride + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        residual = tl.load(residual_ptr + row * residual_row_stride + cols, mask=mask, other=0.0)
        # Round the sum to the model dtype before normalising, exactly like `x + residual` in torch.
        x = (x.to(tl.float32) + residual.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(sum_ptr + row * sum_row_stride + cols, x, mask=mask)
    x32 = x.to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(x32 * x32, axis=0) / hidden + eps)
    normed = (x32 * inv_rms).to(x_ptr.dtype.element_ty).to(tl.float32)  # HF rounds before the weight
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * out_row_stride + cols, (weight * normed).to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm_triton(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None, pdl: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """pdl: launch with programmatic dependent launch (the fused decode chain's norm between two PDL GEMVs); the
    interpreter runs the same kernel without it."""
    _check(x, weight, residual)
    check_launchable(x, weight, *([] if residual is None else [residual]))
    if x.stride(1) != 1 or weight.stride(0) != 1 or (residual is not None and residual.stride(1) != 1):
        raise ValueError("rms_norm: the last dim of x, residual and weight must be contiguous")
    num_rows, hidden = x.shape
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    summed = x if residual is None else torch.empty_like(out)
    if num_rows == 0:
        return out, summed
    block = triton.next_power_of_2(hidden)
    res = x if residual is None else residual  # unused pointer when HAS_RESIDUAL is False
    gdc = pdl and not interpreting()
    _rms_norm_kernel[(num_rows,)](
        x, res, weight, out, summed,
        x.stride(0), res.stride(0), out.stride(0), summed.stride(0),
        hidden, eps,
        HAS_RESIDUAL=residual is not None, BLOCK=block, num_warps=_num_warps(block), PDL_GDC=gdc,
        **({"launch_pdl": True} if gdc else {}),
    )
    return out, summed
