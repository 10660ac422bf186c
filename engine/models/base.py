"""What the model runner needs of a model (every architecture under engine/models subclasses this)."""

from __future__ import annotations

import torch
from stoker.engine.batch import AttentionMetadata
from torch import nn


class CausalLM(nn.Module):
    # Checkpoint module name -> (our fused module, its shard), read by engine.loader.WeightMap.
    packed_modules: dict[str, tuple[str, str]] = {}

    def forward(
        self,
        input_ids: torch.Tensor,  # [T] int64
        positions: torch.Tensor,  # [T] int64
        meta: AttentionMetadata,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],  # per layer (k_cache, v_cache)
    ) -> torch.Tensor:
        """-> final hidden states [T, H] (normed)."""
        raise NotImplementedError

    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """[N, H] (only the rows we sample) -> [N, vocab] float32 (into `out` when given: CUDA graphs)."""
        raise NotImplementedError
