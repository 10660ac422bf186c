"""Warm the L2 cache with a weight matrix's leading bytes while the GPU's memory bus would otherwise idle.

Why: at batch 1 a decode layer streams ~416 MB of bf16 weights (8B shape) in four GEMVs, but between qkv and
o_proj sits the decode attention, ~6 us of latency-bound work that reads ~3 MB. HBM idles for that long. A
kernel on a side stream, forked before the attention and joined before o_proj, asks the memory system to pull
the first bytes of every o_proj row into L2 in that window; o_proj then finds them there. Prefetches are hints
with no result: the kernel issues them and exits, nothing waits for the lines to arrive, and no value of any
tensor changes (a line that has not arrived yet is simply read from HBM by o_proj's own load).

Measured on the H200 (2026-12-01 17:57 UTC, ops/bench_l2_prefetch.py, BENCHMARKS.md): it does NOT pay. Every mode
and fraction made attention + o_proj slower (17.28 us -> 19.09-25.70) and the fused layer too (124.10 -> 124.89-
131.15); so the engine does not use it. Kept with its bench as the record, for a later attempt without the fork.

Which bytes: the leading `lines_per_row` 128-byte lines of each of `num_rows` rows (row stride in bytes), so
every program of the row-parallel GEMV finds the same share of its rows in L2 and none finishes far earlier
than the others. Modes (constexpr MODE):
- 0 `prefetch.global.L2::evict_last` per line (the lines outlive the normal streaming traffic until read);
- 1 `prefetch.global.L2` per line (normal eviction priority);
- 2 one `cp.async.bulk.prefetch.L2` per row (Hopper's bulk copy engine: a single instruction a row);
- 3 plain loads of each line's first byte, summed into a value that is stored only when a flag that the engine
  never sets is set: the one mode the CPU interpreter runs (no inline PTX there), so the index arithmetic and
  the launcher are tested on the CPU (the tests set the flag and check the sum); it costs registers and waits,
  which the hint modes do not.
"""
from __future__ import annotations

import math

import torch
from stoker.engine.kernels._triton import check_launchable, interpreting, tl, triton

LINE_BYTES = 128  # an L2 line on Hopper
MODES = {"evict-last": 0, "normal": 1, "bulk": 2, "load": 3}


@triton.jit
def _line_hint(ptrs, MODE: tl.constexpr):
    """One L2 prefetch per element's address (inline PTX: never under the interpreter)."""
    if MODE == 0:
        done = tl.inline_asm_elementwise("prefetch.global.L2::evict_last [$1];\n\tmov.u32 $0, 0;", "=r,l", [ptrs],
                                         dtype=tl.int32, is_pure=False, pack=1)
    else:
        done = tl.inline_asm_elementwise("prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;", "=r,l", [ptrs],
                                         dtype=tl.int32, is_pure=False, pack=1)
    return done


@triton.jit
def _bulk_hint(ptrs, nbytes):
    """One bulk L2 prefetch of nbytes (a multiple of 16, 16-byte aligned) from each element's address."""
    return tl.inline_asm_elementwise("cp.async.bulk.prefetch.L2.global [$1], $2;\n\tmov.u32 $0, 0;", "=r,l,r",
                                     [ptrs, nbytes], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _l2_prefetch_kernel(
    base_ptr,  # uint8 view of the weight
    sink_ptr,  # int32 [1]: MODE 3 adds the bytes it read here when never_ptr[0] != 0 (keeps the loads alive)
    never_ptr,
    num_rows, row_stride, lines_per_row,
    BLOCK: tl.constexpr, MODE: tl.constexpr,
):
    pid = tl.program_id(0)
    step = tl.num_programs(0) * BLOCK
    if MODE == 2:  # a row per element: one bulk request each
        for start in range(pid * BLOCK, num_rows, step):
            rows = start + tl.arange(0, BLOCK)
            ptrs = base_ptr + tl.where(rows < num_rows, rows, 0).to(tl.int64) * row_stride
            nbytes = tl.where(rows < num_rows, lines_per_row * 128, 16).to(tl.int32)
            _bulk_hint(ptrs, nbytes)
    else:  # a line per element, rows' leading lines in row-major order
        total = num_rows * lines_per_row
        folded = tl.zeros([BLOCK], dtype=tl.int32)
        for start in range(pid * BLOCK, total, step):
            idx = start + tl.arange(0, BLOCK)
            live = idx < total
            idx = tl.where(live, idx, 0)
            ptrs = base_ptr + (idx // lines_per_row).to(tl.int64) * row_stride + (idx % lines_per_row) * 128
            if MODE == 3:
                folded += tl.load(ptrs, mask=live, other=0, eviction_policy="evict_last").to(tl.int32)
            else:
                _line_hint(ptrs, MODE)
        if MODE == 3:  # noqa: SIM102 (a constexpr branch around a runtime one: Triton cannot join them by `and`)
            # the sum of the loaded bytes, kept only on request (the tests check which lines were read)
            if tl.load(never_ptr) != 0:
                tl.atomic_add(sink_ptr, tl.sum(folded, axis=0))


def prefetch_plan(weight: torch.Tensor, fraction: float) -> tuple[int, int, int]:
    """(num_rows, row_stride_bytes, lines_per_row) that cover the leading `fraction` of each row of `weight`
    [N, K] (rounded up to whole 128-byte lines, never past the row)."""
    if weight.dim() != 2 or weight.stride(1) != 1:
        raise ValueError(f"l2_prefetch: a 2-d weight with contiguous rows expected, got {tuple(weight.shape)}")
    if not 0.0 < fraction <= 1.0:
        raise ValueError(f"l2_prefetch: fraction must be in (0, 1], got {fraction}")
    row_bytes = weight.shape[1] * weight.element_size()
    lines = max(1, min(-(-row_bytes // LINE_BYTES), math.ceil(fraction * row_bytes / LINE_BYTES)))
    return weight.shape[0], weight.stride(0) * weight.element_size(), lines


class L2Prefetcher:
    """Issues the prefetch of one weight's leading bytes; built once per weight (its scratch tensors live here
    so that the call is capturable in a CUDA graph: no allocation per call)."""

    def __init__(self, weight: torch.Tensor, fraction: float, mode: str = "evict-last", programs: int = 132):
        if mode not in MODES:
            raise ValueError(f"l2_prefetch: mode {mode!r} is not one of {sorted(MODES)}")
        if MODES[mode] != 3 and interpreting():
            raise ValueError(f"l2_prefetch: mode {mode!r} is inline PTX; the interpreter runs only 'load'")
        if mode == "bulk" and (weight.data_ptr() % 16 or (weight.stride(0) * weight.element_size()) % 16):
            raise ValueError("l2_prefetch: 'bulk' needs 16-byte aligned rows")
        check_launchable(weight)
        self.weight = weight
        self.mode = MODES[mode]
        self.num_rows, self.row_stride, self.lines_per_row = prefetch_plan(weight, fraction)
        if self.mode == 2:  # the bulk size must stay a multiple of 16 and inside the row
            self.lines_per_row = min(self.lines_per_row, weight.shape[1] * weight.element_size() // LINE_BYTES)
        self.programs = programs
        self.sink = torch.zeros(1, dtype=torch.int32, device=weight.device)
        self.never = torch.zeros(1, dtype=torch.int32, device=weight.device)

    @property
    def nbytes(self) -> int:
        return self.num_rows * self.lines_per_row * LINE_BYTES

    def __call__(self) -> None:
        if self.lines_per_row == 0:
            return
        block = 32 if interpreting() else 128
        units = self.num_rows if self.mode == 2 else self.num_rows * self.lines_per_row
        grid = max(1, min(self.programs, triton.cdiv(units, block)))
        _l2_prefetch_kernel[(grid,)](self.weight.view(torch.uint8), self.sink, self.never, self.num_rows,
                                     self.row_stride, self.lines_per_row, BLOCK=block, MODE=self.mode,
                                     num_warps=4)


def prefetch_beside(prefetcher: L2Prefetcher, side: torch.cuda.Stream | None) -> None:
    """Queues the prefetch on `side` behind everything queued so far on the current stream (a fork: in a CUDA
    graph it becomes a branch parallel to what the current stream queues next); join_side() before the kernel
    that reads the weight. side None (the CPU): the prefetch runs in line."""
    if side is None:
        prefetcher()
        return
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        prefetcher()


def join_side(side: torch.cuda.Stream | None) -> None:
    """The current stream waits for what prefetch_beside queued on `side` (every fork must be joined before a
    graph capture ends)."""
    if side is not None:
        torch.cuda.current_stream().wait_stream(side)
