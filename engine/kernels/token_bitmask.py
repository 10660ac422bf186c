"""Grammar masks on the logits: a packed token bitmask (bit j of word k allows token 32k + j, llguidance's
layout) sets every disallowed logit to -inf, in place, for the constrained rows only.

On CUDA a Triton kernel (one program per row and WORDS_PER_PROGRAM words of its mask) reads only the bitmask and
writes -inf where a bit is 0: it never reads the logits. Elsewhere a plain-torch op (unpack the bytes, one
masked_fill over the constrained rows). apply_token_bitmask_ref is the definition both are tested against.
Why the kernel: the torch op's uint8 and bool intermediates ([R, V] each) and its read of the logits cost
0.9-1.0 ms of GPU time a step at batch 1,024 over a 128,256-wide vocabulary (H200, 17:54 UTC, bench_guided's
apply column), on the step's critical path between the forward and the next one.
"""

from __future__ import annotations

import torch
from stoker.engine import kernels
from stoker.engine.kernels._triton import check_launchable, tl, triton

WORDS_PER_PROGRAM = 64  # 2,048 tokens a program: 63 programs a row at a 128,256 vocabulary

_BIT_OF_BYTE = torch.tensor([1 << j for j in range(8)], dtype=torch.uint8)
# The table on each device, copied there once: a copy per call from pageable host memory made CUDA synchronize
# the stream first, so every constrained step's sampling launch waited for its forward on the host (H200, 17:54
# UTC, batch 1,024: 14 ms a step blocked in the sampling launch, then the GPU idle 7 ms for the next forward)
_BIT_OF_BYTE_ON: dict[torch.device, torch.Tensor] = {}


def _bit_of_byte(device: torch.device) -> torch.Tensor:
    table = _BIT_OF_BYTE_ON.get(device)
    if table is None:
        table = _BIT_OF_BYTE_ON.setdefault(device, _BIT_OF_BYTE.to(device))
    return table


def _check(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor | None) -> None:
    num_rows = logits.shape[0] if rows is None else rows.shape[0]
    if logits.dim() != 2 or bitmask.dim() != 2 or (rows is not None and rows.dim() != 1):
        raise ValueError(
            f"apply_token_bitmask: want logits [N, V], bitmask [R, W], rows [R] or None; got {tuple(logits.shape)}, "
            f"{tuple(bitmask.shape)}, {None if rows is None else tuple(rows.shape)}"
        )
    if bitmask.dtype != torch.int32 or bitmask.shape[0] != num_rows:
        raise ValueError("apply_token_bitmask: bitmask must be int32 with one row per entry of rows (per logits row "
                         "when rows is None)")
    if bitmask.shape[1] * 32 < logits.shape[1]:
        raise ValueError(
            f"apply_token_bitmask: bitmask width {bitmask.shape[1]} covers fewer than V={logits.shape[1]} tokens"
        )


def apply_token_bitmask_ref(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor | None) -> None:
    """The definition, token by token (slow): logits[rows[r], t] = -inf where bit t of bitmask[r] is 0; rows None
    means every row, in order (rows = 0 .. N-1)."""
    _check(logits, bitmask, rows)
    masks = bitmask.tolist()
    for r, row in enumerate(range(logits.shape[0]) if rows is None else rows.tolist()):
        for t in range(logits.shape[1]):
            if not (masks[r][t // 32] >> (t % 32)) & 1:
                logits[row, t] = float("-inf")


@triton.jit
def _token_bitmask_kernel(
    logits_ptr, bitmask_ptr, rows_ptr, logits_row_stride, bitmask_row_stride, vocab,
    HAS_ROWS: tl.constexpr, WORDS: tl.constexpr,
):
    r = tl.program_id(0).to(tl.int64)  # bitmask row
    if HAS_ROWS:  # noqa: SIM108  (a constexpr branch: the load exists only in the kernel that has rows)
        row = tl.load(rows_ptr + r).to(tl.int64)  # its logits row
    else:
        row = r
    word = tl.program_id(1) * WORDS + tl.arange(0, WORDS)
    bit = tl.arange(0, 32)
    token = word[:, None] * 32 + bit[None, :]  # [WORDS, 32]
    packed = tl.load(bitmask_ptr + r * bitmask_row_stride + word, mask=word * 32 < vocab, other=-1)
    allowed = (packed[:, None] >> bit[None, :]) & 1  # the arithmetic shift's sign bits are masked off
    minus_inf = tl.full((WORDS, 32), float("-inf"), tl.float32).to(logits_ptr.dtype.element_ty)
    tl.store(logits_ptr + row * logits_row_stride + token, minus_inf, mask=(token < vocab) & (allowed == 0))


def apply_token_bitmask_triton(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor | None) -> None:
    """apply_token_bitmask's kernel (CUDA, or CPU tensors under TRITON_INTERPRET=1): in place."""
    _check(logits, bitmask, rows)
    check_launchable(logits, bitmask, *(() if rows is None else (rows,)))
    if logits.stride(1) != 1 or bitmask.stride(1) != 1:
        raise ValueError("apply_token_bitmask: logits and bitmask rows must be contiguous (stride 1 along V / W)")
    words = (logits.shape[1] + 31) // 32
    grid = (bitmask.shape[0], triton.cdiv(words, WORDS_PER_PROGRAM))
    if grid[0] == 0:
        return
    _token_bitmask_kernel[grid](
        logits, bitmask, bitmask if rows is None else rows, logits.stride(0), bitmask.stride(0), logits.shape[1],
        HAS_ROWS=rows is not None, WORDS=WORDS_PER_PROGRAM,
    )


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor | None) -> None:
    """logits [N, V] float, bitmask [R, ceil(V/32)+] int32 on the logits' device, rows [R] int64 (or None: every
    row, R = N, masked in place without gathering them and scattering them back: [256, 32000] float32 on one
    CPU thread, best of 3 on the loaded 2-core VM, 91 -> 69 ms): in place. The Triton kernel on CUDA (unless
    EngineConfig(use_triton=False): kernels.use_triton)."""
    if kernels.use_triton(logits):
        apply_token_bitmask_triton(logits, bitmask, rows)
        return
    _check(logits, bitmask, rows)
    vocab = logits.shape[1]
    # Unpack bytes, not int32 words: the [R, W * 4, 8] intermediate is uint8, a quarter of the memory traffic
    # (one CPU thread, [256, 128256] float32, all rows constrained: 1,089 ms with int32 shifts -> 393 ms; 16
    # rows: 37 -> 17.5 ms). Little-endian: byte 4k + b of word k holds tokens 32k + 8b .. 32k + 8b + 7.
    packed = bitmask.contiguous().view(torch.uint8)  # [R, W * 4]
    disallowed = (packed[:, :, None] & _bit_of_byte(packed.device)).eq(0).flatten(1)[:, :vocab]  # [R, V]
    if rows is None:
        logits.masked_fill_(disallowed, float("-inf"))
        return
    picked = logits.index_select(0, rows).masked_fill_(disallowed, float("-inf"))
    logits.index_copy_(0, rows, picked)
