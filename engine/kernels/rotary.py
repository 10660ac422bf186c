"""Rotary position embedding (neox / HF rotate_half style) fused with the paged KV-cache write."""
from __future__ import annotations

import math
from typing import Any

import torch

from engine.kernels._triton import check_launchable, tl, triton


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
) -> None:
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
    if k_cache.dtype != k.dtype or v_cache.dtype != v.dtype:
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
) -> None:
    """Rotates q [T, Hq, D] and k [T, Hkv, D] in place (float32 math), then writes k and v into the paged
    caches [num_blocks, block_size, Hkv, D] at flat slot_mapping[t]; slots < 0 (padding) are skipped."""
    _check(q, k, v, positions, cos_sin, k_cache, v_cache, slot_mapping)
    half = q.shape[-1] // 2
    table = cos_sin[positions]  # [T, D]
    cos, sin = table[:, None, :half], table[:, None, half:]
    _rotate_in_place(q, cos, sin)
    _rotate_in_place(k, cos, sin)
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    num_kv_heads, head_dim = k.shape[1:]
    k_cache.view(-1, num_kv_heads, head_dim)[slots] = k[keep]
    v_cache.view(-1, num_kv_heads, head_dim)[slots] = v[keep]
