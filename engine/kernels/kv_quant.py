"""The FP8 KV cache's number format, defined once: what a cache write stores and what a cache read means.

A cache of dtype float8_e4m3fn holds x / scale, saturated to e4m3's finite range (+-448: e4m3fn has no
infinity, and torch's cast would turn an overflow into NaN) and rounded to nearest even; a read gives
stored * scale. One float32 scale per layer for k and one for v (per tensor, vLLM's `k_scale`/`v_scale`),
from the checkpoint's kv_cache_scheme or 1.0. A cache in the model's dtype is written and read as is.
The Triton kernels (rotary.py, attention.py) implement the same rule; these functions are their reference.
"""
from __future__ import annotations

import torch

FP8_KV_DTYPE = torch.float8_e4m3fn
FP8_E4M3_MAX = float(torch.finfo(FP8_KV_DTYPE).max)  # 448.0


def is_fp8_cache(cache: torch.Tensor) -> bool:
    return cache.dtype == FP8_KV_DTYPE


def check_scale(scale: torch.Tensor | None, what: str, device: torch.device) -> None:
    """An FP8 cache needs its scale as a float32 tensor of one element on the cache's device (the kernels
    read it through a pointer: a host tensor would fault there)."""
    if scale is None or scale.numel() != 1 or scale.dtype != torch.float32 or scale.device != device:
        got = None if scale is None else f"{scale.dtype} {tuple(scale.shape)} on {scale.device}"
        raise ValueError(f"{what}: an FP8 KV cache needs a float32 one-element scale tensor on {device}, got {got}")


def quantize_kv(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x (any float dtype) -> float8_e4m3fn holding x / scale, saturated; the division in float32 (IEEE,
    as the kernels' div_rn), so both paths store the same bytes."""
    return (x.float() / scale.float()).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(FP8_KV_DTYPE)


def dequantize_kv(stored: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """Cache rows -> float32 values: stored * scale for an FP8 cache (exact: e4m3 fits float32), else as is."""
    if not is_fp8_cache(stored):
        return stored.float()
    check_scale(scale, "dequantize_kv", stored.device)
    assert scale is not None
    return stored.float() * scale.float()
