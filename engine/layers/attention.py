"""Attention over the paged KV cache: the split-K decode kernel when every sequence has one query token,
the prefill kernel (chunks and decodes mixed) otherwise."""

from __future__ import annotations

import torch
from stoker.engine import kernels
from stoker.engine.batch import AttentionMetadata
from torch import nn


class PagedAttention(nn.Module):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim, self.scale = num_heads, num_kv_heads, head_dim, scale

    def forward(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """q [T, Hq, D] (this step's keys and values already in the cache) -> [T, Hq, D]."""
        if meta.decode_only:
            return kernels.paged_decode_attention(
                q, k_cache, v_cache, meta.block_tables, meta.context_lens, self.scale
            )
        return kernels.paged_attention(
            q, k_cache, v_cache, meta.block_tables, meta.query_start_loc, meta.context_lens, self.scale
        )
