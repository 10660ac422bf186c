"""Token embedding and the LM head (which may share the embedding's weight)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from stoker.engine.layers.weights import WeightModule, empty_param


class VocabEmbedding(WeightModule):
    def __init__(self, vocab_size: int, hidden_size: int, *, dtype: torch.dtype):
        super().__init__()
        self.weight = empty_param(vocab_size, hidden_size, dtype=dtype)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """[T] int64 -> [T, H]"""
        return F.embedding(input_ids, self.weight)


class LMHead(WeightModule):
    """hidden -> float32 logits. Tied (tie_word_embeddings): the embedding's parameter, registered there, so
    this module owns and loads nothing (a checkpoint's lm_head.weight is then skipped, as transformers does)."""

    def __init__(
        self, vocab_size: int, hidden_size: int, *, dtype: torch.dtype, tied_to: VocabEmbedding | None = None
    ):
        super().__init__()
        self.tied = tied_to is not None
        self.weight = tied_to.weight if tied_to is not None else empty_param(vocab_size, hidden_size, dtype=dtype)

    def owns(self, param_name: str) -> bool:
        return not self.tied and super().owns(param_name)

    def expected_shards(self) -> list[tuple[str, str]]:
        return [] if self.tied else super().expected_shards()

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, H] (only the rows we sample) -> [N, vocab] float32."""
        return F.linear(hidden, self.weight).float()
