"""Kernels behind the model: each op dispatches to its Triton launcher for CUDA tensors and to the
plain-torch reference (which defines the semantics) otherwise, or everywhere after set_triton(False)
(EngineConfig.use_triton=False)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from stoker.engine.kernels._triton import HAS_TRITON
from stoker.engine.kernels.activation import silu_and_mul_ref, silu_and_mul_triton
from stoker.engine.kernels.attention import (
    paged_attention_ref,
    paged_attention_triton,
    paged_decode_attention_ref,
    paged_decode_attention_triton,
)
from stoker.engine.kernels.fp8_linear import (
    FP8_GEMV_MAX_M,
    fp8_linear_ref,
    gemv_fp8_triton,
    scaled_mm_fp8,
    takes_scaled_mm,
)
from stoker.engine.kernels.gemv import (
    GEMV_MAX_M,
    check_gemv_args,
    gemv_ref,
    gemv_rotary_cache_ref,
    gemv_rotary_cache_triton,
    gemv_triton,
)
from stoker.engine.kernels.rmsnorm import rms_norm_ref, rms_norm_triton
from stoker.engine.kernels.rotary import rope_cos_sin, rotary_and_cache_ref, rotary_and_cache_triton

__all__ = [
    "FP8_GEMV_MAX_M", "GEMV_MAX_M", "fp8_linear", "fp8_linear_ref", "gemv_fp8_triton", "scaled_mm_fp8",
    "fused_linear", "fused_qkv_rotary_cache", "gemv_ref", "gemv_rotary_cache_ref",
    "gemv_rotary_cache_triton", "gemv_triton",
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
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None, pdl: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """pdl: the Triton kernel launched with programmatic dependent launch (fused decode chains)."""
    if use_triton(x):
        return rms_norm_triton(x, weight, eps, residual, pdl)
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
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    q_out: torch.Tensor | None = None,
) -> None:
    """k_scale/v_scale: the FP8 KV cache's per-tensor scales (kv_quant.py); unused for other caches. q_out: where
    the rotated q goes (None: q in place)."""
    op = rotary_and_cache_triton if use_triton(q) else rotary_and_cache_ref
    op(q, k, v, positions, cos_sin, k_cache, v_cache, slot_mapping, k_scale, v_scale, q_out)


def paged_attention(
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
) -> torch.Tensor:
    """out: where to write [T, Hq, D] (a view of a larger output); None allocates."""
    if use_triton(q):
        return paged_attention_triton(q, k_cache, v_cache, block_tables, query_start_loc, context_lens, scale,
                                      k_scale, v_scale, out=out)
    return _into(out, paged_attention_ref(q, k_cache, v_cache, block_tables, query_start_loc, context_lens, scale,
                                          k_scale, v_scale))


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    counters: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    num_splits: int | None = None,
    pdl: bool = False,
    table_ahead: bool | None = None,
) -> torch.Tensor:
    """counters: the fused combine's (attention.decode_combine_counters); the reference needs none. out: as for
    paged_attention. num_splits: the split-K count (None: the launcher's pick for these shapes). pdl: the Triton
    kernel launched with programmatic dependent launch (decode_pdl.py). table_ahead: the key tiles' block numbers
    loaded a tile ahead (None: the launcher's pick, attention.decode_table_ahead)."""
    if use_triton(q):
        return paged_decode_attention_triton(q, k_cache, v_cache, block_tables, context_lens, scale, num_splits,
                                             k_scale=k_scale, v_scale=v_scale, counters=counters, out=out, pdl=pdl,
                                             table_ahead=table_ahead)
    return _into(out, paged_decode_attention_ref(q, k_cache, v_cache, block_tables, context_lens, scale, k_scale,
                                                 v_scale))


def _into(out: torch.Tensor | None, result: torch.Tensor) -> torch.Tensor:
    """A reference's result written into the caller's `out` (when given), as the Triton launchers do."""
    if out is None:
        return result
    if out.shape != result.shape or out.dtype != result.dtype:
        raise ValueError(f"attention: out must be {tuple(result.shape)} {result.dtype}, "
                         f"got {tuple(out.shape)} {out.dtype}")
    return out.copy_(result)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    return silu_and_mul_triton(x) if use_triton(x) else silu_and_mul_ref(x)



def fused_linear(
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
) -> tuple[torch.Tensor, torch.Tensor]:
    """gemv_ref's semantics: one fused GEMV for M <= GEMV_MAX_M tokens on CUDA, else the unfused kernels
    (RMSNorm, cuBLAS, SiLU-and-mul, add). M is fixed per CUDA-graph bucket, so the branch is capture-safe."""
    if use_triton(x) and x.shape[0] <= GEMV_MAX_M:
        return gemv_triton(x, weight, bias, norm_weight=norm_weight, eps=eps, norm_residual=norm_residual,
                           silu_mul=silu_mul, add=add, pdl=pdl)
    check_gemv_args(x, weight, bias, norm_weight, norm_residual, silu_mul, add)
    h, s = rms_norm(x, norm_weight, eps, norm_residual) if norm_weight is not None else (x, x)
    y = F.linear(h, weight, bias)
    if silu_mul:
        y = silu_and_mul(y)
    return (y if add is None else y + add), s


def fused_qkv_rotary_cache(
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
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """gemv_rotary_cache_ref's semantics: the fused kernel for M <= GEMV_MAX_M on CUDA, else the unfused
    kernels (RMSNorm, cuBLAS, per-head RMSNorm, rotary_and_cache). k_scale/v_scale: an FP8 cache's scales."""
    if not use_triton(x):
        return gemv_rotary_cache_ref(
            x, weight, bias, num_heads=num_heads, num_kv_heads=num_kv_heads, positions=positions, cos_sin=cos_sin,
            k_cache=k_cache, v_cache=v_cache, slot_mapping=slot_mapping, norm_weight=norm_weight, eps=eps,
            norm_residual=norm_residual, q_norm=q_norm, k_norm=k_norm, k_scale=k_scale, v_scale=v_scale)
    if x.shape[0] <= GEMV_MAX_M:
        return gemv_rotary_cache_triton(
            x, weight, bias, num_heads=num_heads, num_kv_heads=num_kv_heads, positions=positions, cos_sin=cos_sin,
            k_cache=k_cache, v_cache=v_cache, slot_mapping=slot_mapping, norm_weight=norm_weight, eps=eps,
            norm_residual=norm_residual, q_norm=q_norm, k_norm=k_norm, pdl=pdl, k_scale=k_scale, v_scale=v_scale)
    qkv, s = fused_linear(x, weight, bias, norm_weight=norm_weight, eps=eps, norm_residual=norm_residual)
    num_tokens, head_dim = x.shape[0], k_cache.shape[-1]
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    q = qkv[:, :q_size].view(num_tokens, num_heads, head_dim)
    k = qkv[:, q_size : q_size + kv_size].view(num_tokens, num_kv_heads, head_dim)
    v = qkv[:, q_size + kv_size :].view(num_tokens, num_kv_heads, head_dim)
    if q_norm is not None and k_norm is not None:
        q.copy_(rms_norm(q.reshape(-1, head_dim), q_norm, eps)[0].view_as(q))
        k.copy_(rms_norm(k.reshape(-1, head_dim), k_norm, eps)[0].view_as(k))
    rotary_and_cache(q, k, v, positions, cos_sin, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    return qkv, s


def fp8_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    bias: torch.Tensor | None,
    block: tuple[int, int] | None,
    input_scale: torch.Tensor | None,
) -> torch.Tensor:
    """fp8_linear_ref's semantics (engine/kernels/fp8_linear.py). On CUDA: the W8A16 GEMV for M <= 16; above,
    torch._scaled_mm with FP8 activations (per token, or the static input_scale) for row scales in bfloat16
    with N and K multiples of 16; block-scaled weights above M = 16 still dequantize (no block GEMM yet). M is
    fixed per CUDA-graph bucket, so the branch is capture-safe."""
    if not use_triton(x):
        return fp8_linear_ref(x, weight, scale, bias, block)
    if x.shape[0] <= FP8_GEMV_MAX_M:
        return gemv_fp8_triton(x.contiguous(), weight, scale, bias, block)
    if takes_scaled_mm(x, weight, block):
        return scaled_mm_fp8(x.contiguous(), weight, scale, bias, input_scale)
    return fp8_linear_ref(x, weight, scale, bias, block)
