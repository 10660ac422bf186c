"""RMSNorm with the residual add that precedes it in every Llama block fused in."""

from __future__ import annotations

import torch
from stoker.engine import kernels
from stoker.engine.layers.weights import WeightModule, empty_param


class RMSNorm(WeightModule):
    def __init__(self, hidden_size: int, eps: float, *, dtype: torch.dtype):
        super().__init__()
        self.eps = eps
        self.weight = empty_param(hidden_size, dtype=dtype)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None, pdl: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H] (+ residual [T, H]) -> (normed sum, the sum: the next block's residual). pdl: the kernel
        launched with programmatic dependent launch (the fused decode chain)."""
        return kernels.rms_norm(x, self.weight, self.eps, residual, pdl)
