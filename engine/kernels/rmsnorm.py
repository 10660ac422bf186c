"""RMSNorm, optionally fused with the residual add that precedes it in every Llama block."""
from __future__ import annotations

import torch

from engine.kernels._triton import check_launchable, tl, triton


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
