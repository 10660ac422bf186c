"""A decode step's inputs into the decode graphs' static buffers in one launch (cuda_graphs.DecodeGraphs.run).

Why: the step's inputs arrive as slices of one upload; the graph reads fixed buffers. Six device copies and two
fills put them there, and five small kernels inside the graph resolved the pending token ids (resolve_pending):
thirteen launches, each with its gap, ~20 us of a W1 step at batch 1 (H200, 8B bf16: the W1 profile of
BENCHMARKS.md 2026-12-04, session 25). Here one program per row of the graph's bucket: a live row (< n) takes its
token id (a pending one, -1 - r, read from prev_tokens[r] as resolve_pending reads it), position, slot, context
length and block-table row; a padding row (n .. bucket) gets slot -1 (it writes no K/V) and context length 1 (it
reads one real cache row), its id, position and table left as an earlier step wrote them (valid values: ids
resolved, tables of real blocks), as the copies left them before.
"""

from __future__ import annotations

import torch
from stoker.engine import kernels
from stoker.engine.batch import resolve_pending
from stoker.engine.kernels._triton import check_launchable, tl, triton

TABLE_BLOCK = 64  # block-table columns a step of a row's copy loop


@triton.jit
def _decode_inputs_kernel(
    ids_ptr, prev_ptr, num_prev, pos_ptr, slots_ptr, ctx_ptr, tables_ptr, table_stride, width, n,
    s_ids_ptr, s_pos_ptr, s_slots_ptr, s_ctx_ptr, s_tables_ptr, s_table_stride,
    HAS_PREV: tl.constexpr, BLOCK_W: tl.constexpr,
):
    r = tl.program_id(0)
    if r < n:
        tok = tl.load(ids_ptr + r)
        if HAS_PREV:  # resolve_pending: -1 - row of prev_tokens, the row clamped into them
            row = tl.minimum(tl.maximum(-1 - tok, 0), num_prev - 1)
            tok = tl.where(tok < 0, tl.load(prev_ptr + row), tok)
        tl.store(s_ids_ptr + r, tok)
        tl.store(s_pos_ptr + r, tl.load(pos_ptr + r))
        tl.store(s_slots_ptr + r, tl.load(slots_ptr + r))
        tl.store(s_ctx_ptr + r, tl.load(ctx_ptr + r))
        cols = tl.arange(0, BLOCK_W)
        src = tables_ptr + r.to(tl.int64) * table_stride
        dst = s_tables_ptr + r.to(tl.int64) * s_table_stride
        for w0 in range(0, width, BLOCK_W):
            c = w0 + cols
            live = c < width
            tl.store(dst + c, tl.load(src + c, mask=live), mask=live)
    else:
        tl.store(s_slots_ptr + r, -1)
        tl.store(s_ctx_ptr + r, 1)


def _check(inp: tuple[torch.Tensor, ...], prev_tokens: torch.Tensor | None, static: tuple[torch.Tensor, ...],
           bucket: int) -> None:
    ids, positions, slots, ctx, tables = inp
    s_ids, s_pos, s_slots, s_ctx, s_tables = static
    n, width = ids.shape[0], tables.shape[1]
    if not (positions.shape == slots.shape == ctx.shape == (n,) and tables.shape[0] == n):
        raise ValueError(f"decode inputs: ids, positions, slots, context lengths [n] and tables [n, W] expected, got "
                         f"{[tuple(t.shape) for t in inp]}")
    if not n <= bucket <= s_ids.shape[0] or width > s_tables.shape[1]:
        raise ValueError(f"decode inputs: {n} rows of {width} table columns do not fit bucket {bucket} of static "
                         f"buffers [{s_ids.shape[0]}], [{s_tables.shape[0]}, {s_tables.shape[1]}]")
    wanted = (torch.int64, torch.int64, torch.int64, torch.int32, torch.int32)
    for name, a, b, dt in zip(("ids", "positions", "slots", "context_lens", "tables"), inp, static, wanted, strict=True):
        if a.dtype != dt or b.dtype != dt or a.stride(-1) != 1 or b.stride(-1) != 1:
            raise ValueError(f"decode inputs: {name} must be contiguous {dt} (and its static buffer), got {a.dtype} / "
                             f"{b.dtype}")
    if prev_tokens is not None and (prev_tokens.dtype != torch.int64 or prev_tokens.dim() != 1
                                    or not prev_tokens.shape[0]):
        raise ValueError(f"decode inputs: prev_tokens must be a non-empty int64 vector, got {prev_tokens.dtype} "
                         f"{tuple(prev_tokens.shape)}")


def decode_inputs_ref(inp: tuple[torch.Tensor, ...], prev_tokens: torch.Tensor | None,
                      static: tuple[torch.Tensor, ...], bucket: int) -> None:
    """The definition (and the path before the kernel): (ids, positions, slots, context_lens, tables) of n rows
    into the static buffers' first n rows (ids resolved against prev_tokens), rows n .. bucket padding."""
    _check(inp, prev_tokens, static, bucket)
    ids, positions, slots, ctx, tables = inp
    s_ids, s_pos, s_slots, s_ctx, s_tables = static
    n, width = ids.shape[0], tables.shape[1]
    s_ids[:n].copy_(resolve_pending(ids, prev_tokens))
    s_pos[:n].copy_(positions)
    s_slots[:n].copy_(slots)
    s_ctx[:n].copy_(ctx)
    s_tables[:n, :width].copy_(tables)
    s_slots[n:bucket].fill_(-1)
    s_ctx[n:bucket].fill_(1)


def decode_inputs_triton(inp: tuple[torch.Tensor, ...], prev_tokens: torch.Tensor | None,
                         static: tuple[torch.Tensor, ...], bucket: int) -> None:
    """decode_inputs_ref in one launch of `bucket` programs (CUDA, or CPU tensors under TRITON_INTERPRET=1)."""
    _check(inp, prev_tokens, static, bucket)
    ids, positions, slots, ctx, tables = inp
    s_ids, s_pos, s_slots, s_ctx, s_tables = static
    check_launchable(*inp, *static, *(() if prev_tokens is None else (prev_tokens,)))
    if bucket == 0:
        return
    prev = prev_tokens if prev_tokens is not None else ids
    _decode_inputs_kernel[(bucket,)](
        ids, prev, prev.shape[0], positions, slots, ctx, tables, tables.stride(0), tables.shape[1], ids.shape[0],
        s_ids, s_pos, s_slots, s_ctx, s_tables, s_tables.stride(0),
        HAS_PREV=prev_tokens is not None, BLOCK_W=TABLE_BLOCK, num_warps=1,
    )


def decode_inputs(inp: tuple[torch.Tensor, ...], prev_tokens: torch.Tensor | None,
                  static: tuple[torch.Tensor, ...], bucket: int) -> None:
    """The kernel on CUDA, the copies elsewhere (the CPU runs of the graphs' bookkeeping, which fake the replays:
    tests/test_decode_step_ops.py) and under EngineConfig(use_triton=False) (kernels.use_triton)."""
    fill = decode_inputs_triton if kernels.use_triton(inp[0]) else decode_inputs_ref
    fill(inp, prev_tokens, static, bucket)
