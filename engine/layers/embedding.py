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

    def forward(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """[N, H] (only the rows we sample) -> [N, vocab] float32, written into `out` when given."""
        return lm_head_logits(hidden, self.weight, out)


def lm_head_logits(hidden: torch.Tensor, weight: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """hidden [N, H] @ weight [V, H]^T -> float32 [N, V]. On CUDA with bf16/fp16 operands one cuBLAS GEMM writes
    float32 directly (torch.mm's out_dtype: fp32 accumulation, as before): F.linear(...).float() wrote the
    logits in the weight's dtype and cast them in a second kernel, reading and writing [N, V] again (at N=1024,
    V=128256: ~0.8 GB of traffic per decode step). Elsewhere (the CPU has no mm.dtype kernel) the old way."""
    if hidden.is_cuda and weight.dtype in (torch.bfloat16, torch.float16) and hidden.dtype == weight.dtype:
        if out is None:
            return torch.mm(hidden, weight.t(), out_dtype=torch.float32)
        return torch.mm(hidden, weight.t(), out_dtype=torch.float32, out=out)
    if out is not None and hidden.dtype == weight.dtype == torch.float32:
        return torch.mm(hidden, weight.t(), out=out)  # float32 already: straight into out, no copy
    logits = F.linear(hidden, weight).float()
    return logits if out is None else out.copy_(logits)
