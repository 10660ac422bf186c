"""Rotary position embedding (neox / HF rotate_half style), applied in place and fused with the KV-cache write."""

from __future__ import annotations

from typing import Any

import torch
from stoker.engine import kernels
from torch import nn


class RotaryEmbedding(nn.Module):
    """Holds the [max_position, D] float32 cos|sin table; no weights (one instance serves every layer)."""

    def __init__(self, head_dim: int, max_position: int, base: float, scaling: dict[str, Any] | None):
        super().__init__()
        self.cos_sin: torch.Tensor
        self.register_buffer(
            "cos_sin", kernels.rope_cos_sin(head_dim, max_position, base, scaling), persistent=False
        )

    def forward(
        self,
        q: torch.Tensor,  # [T, Hq, D], rotated in place (may be a strided view)
        k: torch.Tensor,  # [T, Hkv, D], rotated in place, then written to the cache
        v: torch.Tensor,  # [T, Hkv, D], written to the cache
        positions: torch.Tensor,  # [T] int64
        k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,  # [T] int64
        k_scale: torch.Tensor | None = None,  # the FP8 KV cache's scales (layers/attention.py)
        v_scale: torch.Tensor | None = None,
        q_out: torch.Tensor | None = None,  # [T, Hq, D]: the rotated q goes there instead (q stays as it was)
    ) -> None:
        kernels.rotary_and_cache(q, k, v, positions, self.cos_sin, k_cache, v_cache, slot_mapping, k_scale, v_scale,
                                 q_out)
