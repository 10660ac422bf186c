"""SiLU-and-multiply: the gated MLP's activation on the fused gate/up projection."""
from __future__ import annotations

import torch

from engine.kernels._triton import check_launchable, tl, triton


def _check(x: torch.Tensor) -> None:
    if x.dim() != 2 or x.shape[1] % 2:
        raise ValueError(f"silu_and_mul: x must be [T, 2*I], got shape {tuple(x.shape)}")


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """[T, 2I] -> [T, I] = silu(x[:, :I]) * x[:, I:], float32 math, output in x.dtype."""
    _check(x)
    gate, up = x.float().chunk(2, dim=-1)
    return (torch.nn.functional.silu(gate) * up).to(x.dtype)
