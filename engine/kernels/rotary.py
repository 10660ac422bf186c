"""Rotary position embedding (neox / HF rotate_half style) fused with the paged KV-cache write."""
from __future__ import annotations

import math
from typing import Any

import torch
from stoker.engine.kernels._triton import check_launchable, tl, triton
from stoker.engine.kernels.kv_quant import FP8_E4M3_MAX, check_scale, is_fp8_cache, quantize_kv


def _inv_freq(head_dim: int, base: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    """[head_dim // 2] float32 inverse frequencies, after HF's rope_scaling / rope_parameters."""
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    rope_type = "default" if scaling is None else scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type == "default":
        return inv_freq
    assert scaling is not None
    if rope_type == "linear":
        return inv_freq / float(scaling["factor"])
    if rope_type == "llama3":
        try:
            factor = float(scaling["factor"])
            low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
            original = float(scaling["original_max_position_embeddings"])
        except KeyError as e:
            raise ValueError(f"llama3 rope scaling is missing {e.args[0]!r} (have {sorted(scaling)})") from e
        # Wavelengths longer than original/low are slowed by `factor`, shorter than original/high are kept,
        # and the band between is interpolated linearly in original/wavelen.
        wavelen = 2 * math.pi / inv_freq
        smooth = ((original / wavelen - low) / (high - low)).clamp(0.0, 1.0)
        return (1 - smooth) * inv_freq / factor + smooth * inv_freq
    raise ValueError(f"unsupported rope scaling type {rope_type!r}: supported are default, linear, llama3")


def rope_cos_sin(
    head_dim: int,
    max_position: int,
    base: float,
    scaling: dict[str, Any] | None,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """[max_position, head_dim] float32 table: cos(p * inv_freq) in the first half, sin in the second."""
    if head_dim <= 0 or head_dim % 2:
        raise ValueError(f"rope head_dim must be a positive even number, got {head_dim}")
    if max_position <= 0:
        raise ValueError(f"rope max_position must be positive, got {max_position}")
    inv_freq = _inv_freq(head_dim, base, scaling)
    freqs = torch.outer(torch.arange(max_position, dtype=torch.float32), inv_freq)
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1).to(device)


def _check(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    cos_sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
    q_out: torch.Tensor | None = None,
) -> None:
    if q_out is not None and (q_out.shape != q.shape or q_out.dtype != q.dtype or q_out.device != q.device):
        raise ValueError(f"rotary_and_cache: q_out must be like q {tuple(q.shape)} {q.dtype}, "
                         f"got {tuple(q_out.shape)} {q_out.dtype} on {q_out.device}")
    if q.dim() != 3 or k.dim() != 3 or v.shape != k.shape:
        raise ValueError(
            f"rotary_and_cache: q [T, Hq, D], k and v [T, Hkv, D] expected, "
            f"got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    num_tokens, _, head_dim = q.shape
    if k.shape[0] != num_tokens or k.shape[2] != head_dim:
        raise ValueError(f"rotary_and_cache: k {tuple(k.shape)} does not match q {tuple(q.shape)}")
    if positions.shape != (num_tokens,) or slot_mapping.shape != (num_tokens,):
        raise ValueError(
            f"rotary_and_cache: positions and slot_mapping must be [{num_tokens}], "
            f"got {tuple(positions.shape)}, {tuple(slot_mapping.shape)}"
        )
    if cos_sin.dim() != 2 or cos_sin.shape[1] != head_dim or cos_sin.dtype != torch.float32:
        raise ValueError(f"rotary_and_cache: cos_sin must be float32 [max_pos, {head_dim}], got "
                         f"{tuple(cos_sin.shape)} {cos_sin.dtype}")
    expect = (k.shape[1], head_dim)
    if k_cache.dim() != 4 or k_cache.shape[2:] != expect or v_cache.shape != k_cache.shape:
        raise ValueError(
            f"rotary_and_cache: caches must be [num_blocks, block_size, {expect[0]}, {expect[1]}], "
            f"got {tuple(k_cache.shape)}, {tuple(v_cache.shape)}"
        )
    if v_cache.dtype != k_cache.dtype:
        raise ValueError(f"rotary_and_cache: k_cache is {k_cache.dtype} but v_cache {v_cache.dtype}")
    if is_fp8_cache(k_cache):  # the FP8 KV cache (kv_quant.py): stores k / k_scale, v / v_scale
        check_scale(k_scale, "rotary_and_cache k_scale", k_cache.device)
        check_scale(v_scale, "rotary_and_cache v_scale", k_cache.device)
    elif k_cache.dtype != k.dtype or v.dtype != k.dtype:
        raise ValueError(f"rotary_and_cache: cache dtype {k_cache.dtype} differs from k/v dtype {k.dtype}")


def _rotate_in_place(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    half = x.shape[-1] // 2
    x32 = x.float()
    x1, x2 = x32[..., :half], x32[..., half:]
    x.copy_(torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1))


def rotary_and_cache_ref(
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
    """Rotates q [T, Hq, D] and k [T, Hkv, D] in place (float32 math), then writes k and v into the paged
    caches [num_blocks, block_size, Hkv, D] at flat slot_mapping[t]; slots < 0 (padding) are skipped. An FP8
    cache stores quantize_kv(k, k_scale) and quantize_kv(v, v_scale) (the rotated k, as the model dtype
    holds it); q and k themselves stay unquantized. q_out ([T, Hq, D], q's dtype): the rotated q goes there
    and q is left as it was (the piecewise graphs' static q buffer)."""
    _check(q, k, v, positions, cos_sin, k_cache, v_cache, slot_mapping, k_scale, v_scale, q_out)
    half = q.shape[-1] // 2
    table = cos_sin[positions]  # [T, D]
    cos, sin = table[:, None, :half], table[:, None, half:]
    if q_out is not None:
        q = q_out.copy_(q)
    _rotate_in_place(q, cos, sin)
    _rotate_in_place(k, cos, sin)
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    num_kv_heads, head_dim = k.shape[1:]
    k_rows, v_rows = k[keep], v[keep]
    if is_fp8_cache(k_cache):
        assert k_scale is not None and v_scale is not None  # _check
        k_rows, v_rows = quantize_kv(k_rows, k_scale), quantize_kv(v_rows, v_scale)
    k_cache.view(-1, num_kv_heads, head_dim)[slots] = k_rows
    v_cache.view(-1, num_kv_heads, head_dim)[slots] = v_rows


@triton.jit
def _rotate_heads(
    x_ptr, out_ptr, token, token_stride, head_stride, out_token_stride, out_head_stride, num_heads, cos, sin,
    HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr,
):
    """Rotates all heads of one token into out (x itself when out_ptr is x_ptr with x's strides); returns the
    rotated halves (float32) for the cache write."""
    heads = tl.arange(0, BLOCK_H)[:, None]
    dims = tl.arange(0, BLOCK_HALF)[None, :]
    mask = (heads < num_heads) & (dims < HALF)
    ptr = x_ptr + token * token_stride + heads * head_stride + dims
    x1 = tl.load(ptr, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(ptr + HALF, mask=mask, other=0.0).to(tl.float32)
    out1 = x1 * cos - x2 * sin
    out2 = x2 * cos + x1 * sin
    out = out_ptr + token * out_token_stride + heads * out_head_stride + dims
    tl.store(out, out1.to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(out + HALF, out2.to(out_ptr.dtype.element_ty), mask=mask)
    return out1, out2


FP8_MAX: tl.constexpr = tl.constexpr(FP8_E4M3_MAX)


@triton.jit
def _to_fp8(x, scale):
    """x / scale saturated to e4m3's range, still float32 (the store casts it, rounding to nearest even)."""
    return tl.clamp(tl.math.div_rn(x.to(tl.float32), scale), -FP8_MAX, FP8_MAX)


@triton.jit
def _rotary_and_cache_kernel(
    q_ptr, k_ptr, v_ptr, positions_ptr, cos_sin_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr,
    k_scale_ptr, v_scale_ptr, q_token_stride, q_head_stride, k_token_stride, k_head_stride, v_token_stride, v_head_stride,
    q_out_ptr, q_out_token_stride, q_out_head_stride, num_q_heads, num_kv_heads,
    HALF: tl.constexpr, BLOCK_HQ: tl.constexpr, BLOCK_HKV: tl.constexpr, BLOCK_HALF: tl.constexpr,
    FP8_CACHE: tl.constexpr,
):
    # One program per token, all heads at once: cos/sin are loaded once and reused by every head.
    token = tl.program_id(0).to(tl.int64)
    dims = tl.arange(0, BLOCK_HALF)[None, :]
    position = tl.load(positions_ptr + token).to(tl.int64)
    table = cos_sin_ptr + position * (2 * HALF) + dims
    cos = tl.load(table, mask=dims < HALF, other=0.0)
    sin = tl.load(table + HALF, mask=dims < HALF, other=0.0)
    _rotate_heads(q_ptr, q_out_ptr, token, q_token_stride, q_head_stride, q_out_token_stride, q_out_head_stride,
                  num_q_heads, cos, sin, HALF, BLOCK_HQ, BLOCK_HALF)
    k1, k2 = _rotate_heads(k_ptr, k_ptr, token, k_token_stride, k_head_stride, k_token_stride, k_head_stride,
                           num_kv_heads, cos, sin, HALF, BLOCK_HKV, BLOCK_HALF)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    heads = tl.arange(0, BLOCK_HKV)[:, None]
    mask = (heads < num_kv_heads) & (dims < HALF) & (slot >= 0)  # slot < 0: a padding token
    cache_offset = slot * (num_kv_heads * 2 * HALF) + heads * (2 * HALF) + dims
    v_ptr = v_ptr + token * v_token_stride + heads * v_head_stride + dims
    v1 = tl.load(v_ptr, mask=mask)
    v2 = tl.load(v_ptr + HALF, mask=mask)
    if FP8_CACHE:
        # kv_quant.quantize_kv: k is rounded to the model dtype first (what the unfused path caches), then
        # divided in IEEE float32 (div_rn: plain "/" is approximate on the GPU) and saturated.
        k_scale = tl.load(k_scale_ptr)
        v_scale = tl.load(v_scale_ptr)
        k1 = _to_fp8(k1.to(k_ptr.dtype.element_ty), k_scale)
        k2 = _to_fp8(k2.to(k_ptr.dtype.element_ty), k_scale)
        v1 = _to_fp8(v1, v_scale)
        v2 = _to_fp8(v2, v_scale)
    dtype = k_cache_ptr.dtype.element_ty
    tl.store(k_cache_ptr + cache_offset, k1.to(dtype), mask=mask)
    tl.store(k_cache_ptr + cache_offset + HALF, k2.to(dtype), mask=mask)
    tl.store(v_cache_ptr + cache_offset, v1.to(dtype), mask=mask)
    tl.store(v_cache_ptr + cache_offset + HALF, v2.to(dtype), mask=mask)


def rotary_and_cache_triton(
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
    """As rotary_and_cache_ref."""
    _check(q, k, v, positions, cos_sin, k_cache, v_cache, slot_mapping, k_scale, v_scale, q_out)
    q_out = q if q_out is None else q_out
    check_launchable(q, k, v, positions, cos_sin, k_cache, v_cache, slot_mapping, q_out)
    if q.stride(2) != 1 or k.stride(2) != 1 or v.stride(2) != 1 or q_out.stride(2) != 1:
        raise ValueError("rotary_and_cache: the head_dim of q, k, v and q_out must be contiguous (row strides may "
                         "vary)")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous() and cos_sin.is_contiguous()):
        raise ValueError("rotary_and_cache: k_cache, v_cache and cos_sin must be contiguous")
    num_tokens, num_q_heads, head_dim = q.shape
    if num_tokens == 0:
        return
    num_kv_heads = k.shape[1]
    fp8 = is_fp8_cache(k_cache)
    k_scale_arg, v_scale_arg = (k_scale, v_scale) if fp8 else (cos_sin, cos_sin)  # placeholders when not FP8
    _rotary_and_cache_kernel[(num_tokens,)](
        q, k, v, positions, cos_sin, k_cache, v_cache, slot_mapping, k_scale_arg, v_scale_arg,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        q_out, q_out.stride(0), q_out.stride(1), num_q_heads, num_kv_heads,
        HALF=head_dim // 2,
        BLOCK_HQ=triton.next_power_of_2(num_q_heads),
        BLOCK_HKV=triton.next_power_of_2(num_kv_heads),
        BLOCK_HALF=triton.next_power_of_2(head_dim // 2),
        FP8_CACHE=fp8,
        num_warps=4,
    )
