"""Kernels behind the model: each op dispatches to its Triton launcher for CUDA tensors and to the
plain-torch reference (which defines the semantics) otherwise, or everywhere after set_triton(False)
(EngineConfig.use_triton=False)."""
from __future__ import annotations

import torch
from stoker.engine.kernels._triton import HAS_TRITON
from stoker.engine.kernels.activation import silu_and_mul_ref, silu_and_mul_triton
from stoker.engine.kernels.attention import (
    paged_attention_ref,
    paged_attention_triton,
    paged_decode_attention_ref,
    paged_decode_attention_triton,
)
from stoker.engine.kernels.rmsnorm import rms_norm_ref, rms_norm_triton
from stoker.engine.kernels.rotary import rope_cos_sin, rotary_and_cache_ref, rotary_and_cache_triton

__all__ = [
    "paged_attention", "paged_attention_ref", "paged_decode_attention", "paged_decode_attention_ref",
    "rms_norm", "rms_norm_ref", "rope_cos_sin", "rotary_and_cache", "rotary_and_cache_ref",
    "silu_and_mul", "silu_and_mul_ref", "use_triton",
    "paged_attention_triton", "paged_decode_attention_triton", "rms_norm_triton", "rotary_and_cache_triton",
    "silu_and_mul_triton", "set_triton",
]

# A process-wide backend switch (like torch.backends' flags), not per engine: the layers call these ops
# without an engine at hand. The engine sets it from EngineConfig.use_triton; tests flip it.
_triton_enabled = True


def set_triton(enabled: bool) -> None:
    global _triton_enabled
    _triton_enabled = enabled


def use_triton(x: torch.Tensor) -> bool:
    return x.is_cuda and HAS_TRITON and _triton_enabled


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    if use_triton(x):
        return rms_norm_triton(x, weight, eps, residual)
    return rms_norm_ref(x, weight, eps, residual)


def rotary_and_cache(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    cos_sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    op = rotary_and_cache_triton if use_triton(q) else rotary_and_cache_ref
    op(q, k, v, positions, cos_sin, k_cache, v_cache, slot_mapping)


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    op = paged_attention_triton if use_triton(q) else paged_attention_ref
    return op(q, k_cache, v_cache, block_tables, query_start_loc, context_lens, scale)


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    op = paged_decode_attention_triton if use_triton(q) else paged_decode_attention_ref
    return op(q, k_cache, v_cache, block_tables, context_lens, scale)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    return silu_and_mul_triton(x) if use_triton(x) else silu_and_mul_ref(x)
