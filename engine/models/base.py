"""What the model runner needs of a model (every architecture under engine/models subclasses this)."""

from __future__ import annotations

from typing import Any

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

    # The forward cut at every attention (engine/piecewise_graphs.py captures each piece as a CUDA graph and runs
    # the attentions eagerly between them). Pieces 0 .. num_pieces - 1: piece 0 takes the input ids, piece i > 0
    # layer i-1's attention output [T, Hq, D] and the running residual sum; each returns (layer i's q [T, Hq, D],
    # written into q_out, the sum), the last (the final hidden states [T, H] normed, the sum). Each piece reads
    # only meta.slot_mapping (the cache write). attend(i, q, meta, kv_caches, out) is layer i's attention into
    # `out`. num_pieces 0: no such cut (the batch step stays eager).
    @property
    def num_pieces(self) -> int:
        return 0

    def piece(self, i: int, x: torch.Tensor, residual: torch.Tensor | None, positions: torch.Tensor,
              meta: AttentionMetadata, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], q_out: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def attend(self, i: int, q: torch.Tensor, meta: AttentionMetadata,
               kv_caches: list[tuple[torch.Tensor, torch.Tensor]], out: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def plan_decode(self, mode: str, pdl: bool | None, kv_dtype: torch.dtype, fused_mlp: bool,
                    prologue_max_m: int) -> dict[str, Any]:
        """Called once after loading: pick each layer's decode path for `mode` (a resolved
        EngineConfig.decode_kernels: "fused", "fused-folded" or "cublas"; engine/models/fused_decode.py) and
        re-lay weights it needs re-laid; fused_mlp and prologue_max_m are EngineConfig.decode_fused_mlp and
        decode_prologue_norm_max_m. Returns the startup report's entry. This default has no fused path."""
        return {"mode": "cublas", "fused_layers": 0, "fallback": f"{type(self).__name__} has no fused decode path"}

    def plan_nano_batches(self, plan: Any) -> dict[str, Any]:
        """Called once after loading: `plan` (models/nano_batches.NanoBatchPlan, or None = off) for large decode
        steps. Returns the startup report's entry. This default has no two-half path."""
        if plan is not None:
            raise ValueError(f"decode_overlap: {type(self).__name__} has no two-nano-batch decode path")
        return {"enabled": False}
