"""Grammar masks on the logits: a packed token bitmask (bit j of word k allows token 32k + j, llguidance's
layout) sets every disallowed logit to -inf, in place, for the constrained rows only.

A plain-torch op (unpack with shifts, one masked_fill over the constrained rows). No Triton kernel yet: it
would have to beat one fused elementwise pass over [rows, V], which only the H200 benchmark can show.
"""

from __future__ import annotations

import torch

_BITS = torch.arange(32, dtype=torch.int32)


def _check(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> None:
    if logits.dim() != 2 or bitmask.dim() != 2 or rows.dim() != 1:
        raise ValueError(
            f"apply_token_bitmask: want logits [N, V], bitmask [R, W], rows [R]; got {tuple(logits.shape)}, "
            f"{tuple(bitmask.shape)}, {tuple(rows.shape)}"
        )
    if bitmask.dtype != torch.int32 or bitmask.shape[0] != rows.shape[0]:
        raise ValueError("apply_token_bitmask: bitmask must be int32 with one row per entry of rows")
    if bitmask.shape[1] * 32 < logits.shape[1]:
        raise ValueError(
            f"apply_token_bitmask: bitmask width {bitmask.shape[1]} covers fewer than V={logits.shape[1]} tokens"
        )


def apply_token_bitmask_ref(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> None:
    """The definition, token by token (slow): logits[rows[r], t] = -inf where bit t of bitmask[r] is 0."""
    _check(logits, bitmask, rows)
    masks = bitmask.tolist()
    for r, row in enumerate(rows.tolist()):
        for t in range(logits.shape[1]):
            if not (masks[r][t // 32] >> (t % 32)) & 1:
                logits[row, t] = float("-inf")


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> None:
    """logits [N, V] float, bitmask [R, ceil(V/32)+] int32 on the logits' device, rows [R] int64: in place."""
    _check(logits, bitmask, rows)
    vocab = logits.shape[1]
    bits = _BITS.to(bitmask.device)
    allowed = ((bitmask[:, :, None] >> bits) & 1).flatten(1)[:, :vocab].bool()  # [R, W * 32] -> [R, V]
    logits[rows] = logits[rows].masked_fill(~allowed, float("-inf"))
