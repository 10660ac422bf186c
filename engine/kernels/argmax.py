"""Greedy argmax over each row of the logits in one launch, for the decode CUDA graphs.

Why: at batch 1 the sampler's greedy path was four kernels outside the graph after the LM head (a max over 256
pieces, an argmax over their maxima, a gather, an add; greedy_argmax in sampler.py), each with its own launch gap:
~20 us of a W1 step's ~3.95 ms (H200, 8B bf16, the W1 profile of BENCHMARKS.md 2026-12-04 session 25). Here one
kernel, captured in the decode graph behind the LM head: program (row, piece) reduces PIECE logits to the best
(value, index) pair, stores it packed in one int64, and bumps the row's arrival ticket; the piece that arrives last
reduces the row's packed pairs and writes the token id, then puts the ticket back to 0, so the buffer stays zeroed
between launches and a graph replays it as is (the decode attention's fused combine does the same).

The result equals torch.argmax (and sampler.greedy_argmax) bit for bit, ties and non-finite values included:
- the first index among equal maxima;
- a NaN beats everything (torch's max propagates NaN, and argmax returns the first NaN);
- -0.0 equals +0.0 (they compare equal, so the first of them wins);
- a row of -inf gives 0.
Each value becomes an int32 key monotone in the float's order (the float's bits, the low 31 flipped for negative
numbers; NaN the largest key, both zeros key 0), and the pair packs as key << 32 | (2^31 - 1 - index): the int64
maximum is the largest key at the smallest index.
"""

from __future__ import annotations

import torch
from stoker.engine.kernels._triton import check_launchable, tl, triton

PIECE = 2048  # logits a program: 63 programs a row at a 128,256 vocabulary


@triton.jit
def _order_key(x):
    """float32 -> int32, monotone (x < y => key(x) < key(y)); NaN the largest; -0.0 and +0.0 both 0."""
    bits = x.to(tl.int32, bitcast=True)
    key = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
    key = tl.where(x == 0.0, 0, key)
    return tl.where(x != x, 0x7FFFFFFF, key)


@triton.jit
def _argmax_kernel(
    x_ptr, x_stride, vocab, part_ptr, tickets_ptr, out_ptr,
    PIECES: tl.constexpr, BLOCK: tl.constexpr, BLOCK_P: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    piece = tl.program_id(1)
    offs = piece * BLOCK + tl.arange(0, BLOCK)
    live = offs < vocab
    x = tl.load(x_ptr + row * x_stride + offs, mask=live, other=0.0).to(tl.float32)
    key = tl.where(live, _order_key(x), -2147483647 - 1)  # padding below every value's key (-inf's included)
    best = tl.max(key, axis=0)
    first = tl.min(tl.where(key == best, offs, 2147483647), axis=0)
    packed = (best.to(tl.int64) << 32) | (2147483647 - first).to(tl.int64)
    tl.store(part_ptr + row * PIECES + piece, packed)
    # The store above and the release below may be issued by different threads: the barrier orders them (as the
    # decode attention's fused combine does).
    tl.debug_barrier()
    arrived = tl.atomic_add(tickets_ptr + row, 1, sem="acq_rel", scope="gpu")
    if arrived == PIECES - 1:  # every piece's pair is visible here (their release, this acquire)
        tl.store(tickets_ptr + row, 0)
        p = tl.arange(0, BLOCK_P)
        parts = tl.load(part_ptr + row * PIECES + p, mask=p < PIECES, other=-9223372036854775807 - 1)
        top = tl.max(parts, axis=0)
        tl.store(out_ptr + row, 2147483647 - (top & 0xFFFFFFFF))


class GreedyArgmax:
    """argmax over the last dim of [N, V] logits (N <= max_rows), into an int64 [N] tensor, one launch. Holds the
    kernel's scratch (the packed pairs and the zeroed tickets), so a call allocates nothing and is capturable in
    a CUDA graph; one instance per stream of use (two launches in flight at once would share the tickets)."""

    def __init__(self, max_rows: int, vocab: int, device: torch.device | str):
        if max_rows < 1 or vocab < 1:
            raise ValueError(f"GreedyArgmax: max_rows and vocab must be >= 1, got {max_rows}, {vocab}")
        self.max_rows, self.vocab = max_rows, vocab
        self.pieces = triton.cdiv(vocab, PIECE)
        self.parts = torch.empty(max_rows, self.pieces, dtype=torch.int64, device=device)
        self.tickets = torch.zeros(max_rows, dtype=torch.int32, device=device)

    def __call__(self, logits: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        n, v = logits.shape
        if v != self.vocab or n > self.max_rows or logits.stride(1) != 1:
            raise ValueError(f"GreedyArgmax: logits [<= {self.max_rows}, {self.vocab}] with contiguous rows "
                             f"expected, got {tuple(logits.shape)} strides {logits.stride()}")
        if out.dtype != torch.int64 or out.shape != (n,) or out.stride(0) != 1:
            raise ValueError(f"GreedyArgmax: out must be a contiguous int64 [{n}], got {out.dtype} {tuple(out.shape)}")
        check_launchable(logits, out, self.tickets)
        if n:
            _argmax_kernel[(n, self.pieces)](logits, logits.stride(0), v, self.parts, self.tickets, out,
                                             PIECES=self.pieces, BLOCK=PIECE,
                                             BLOCK_P=max(16, triton.next_power_of_2(self.pieces)), num_warps=4)
        return out
