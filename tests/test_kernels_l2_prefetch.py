"""The L2 prefetch of a weight's leading bytes (engine/kernels/l2_prefetch.py): which lines it touches, that it
changes no tensor, and (GPU) that its inline-PTX hint modes run beside a GEMV on a side stream inside a CUDA graph
without changing the GEMV's output.

The CPU runs the 'load' mode under TRITON_INTERPRET=1 (the driver at the bottom re-runs this file so): with the
flag the engine never sets, that mode adds the first byte of every line it read into `sink`, so the test can
check the lines exactly. The hint modes have no observable result but speed (ops/bench_l2_prefetch.py).
"""
from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")
from kernel_harness import GPU, INTERPRET, NO_CUDA, cases, run_under_interpreter  # noqa: E402
from stoker.engine.kernels.gemv import gemv_triton  # noqa: E402
from stoker.engine.kernels.l2_prefetch import (  # noqa: E402
    L2Prefetcher,
    join_side,
    prefetch_beside,
    prefetch_plan,
)

CASES = cases((torch.bfloat16,))


def _expected_sum(weight: torch.Tensor, lines: int) -> int:
    """The first byte of each of the leading `lines` 128-byte lines of every row, summed (what 'load' reads)."""
    rows = weight.view(torch.uint8)  # [N, K * elem] over the same storage: row stride in bytes
    offsets = torch.arange(lines) * 128
    return int(rows[:, offsets].to(torch.int64).sum())


@pytest.mark.parametrize("device,dtype", CASES)
@pytest.mark.parametrize("rows,cols,fraction", [(7, 200, 0.3), (7, 200, 1.0), (33, 72, 0.5), (130, 64, 0.01)])
def test_load_mode_reads_the_leading_lines_of_every_row(device: str, dtype: torch.dtype, rows: int, cols: int,
                                                        fraction: float) -> None:
    weight = torch.randn(rows, cols, device=device, dtype=dtype)
    before = weight.clone()
    prefetcher = L2Prefetcher(weight, fraction, "load", programs=3)
    row_bytes = cols * weight.element_size()
    lines = prefetcher.lines_per_row
    assert lines == max(1, min(-(-row_bytes // 128), -(-int(fraction * row_bytes) // 128)))
    prefetcher.never.fill_(1)  # the tests' switch: the kernel reports the bytes it read
    prefetcher()
    assert int(prefetcher.sink) == _expected_sum(weight.cpu(), lines)  # < 2^31 at these sizes
    assert torch.equal(weight, before)


@pytest.mark.parametrize("device,dtype", CASES)
def test_load_mode_follows_a_row_stride_wider_than_the_row(device: str, dtype: torch.dtype) -> None:
    """A weight that is a column slice of a wider tensor (e.g. the gate half of gate_up): rows at the parent's
    stride, lines only of the slice's own bytes."""
    parent = torch.randn(9, 320, device=device, dtype=dtype)
    weight = parent[:, :256]
    prefetcher = L2Prefetcher(weight, 1.0, "load", programs=2)
    lines = 256 * parent.element_size() // 128
    assert prefetcher.row_stride == 320 * parent.element_size() and prefetcher.lines_per_row == lines
    prefetcher.never.fill_(1)
    prefetcher()
    as_bytes = parent.view(torch.uint8).cpu()
    assert int(prefetcher.sink) == int(as_bytes[:, torch.arange(lines) * 128].to(torch.int64).sum())


def test_prefetch_plan_and_launcher_refusals() -> None:
    weight = torch.zeros(4, 100, dtype=torch.float16)
    assert prefetch_plan(weight, 1.0) == (4, 200, 2)
    assert prefetch_plan(weight, 0.001) == (4, 200, 1)
    with pytest.raises(ValueError, match="fraction"):
        prefetch_plan(weight, 0.0)
    with pytest.raises(ValueError, match="2-d"):
        prefetch_plan(weight[0], 0.5)
    with pytest.raises(ValueError, match="mode"):
        L2Prefetcher(weight, 0.5, "evict-first")
    if INTERPRET:
        with pytest.raises(ValueError, match="interpreter runs only 'load'"):
            L2Prefetcher(weight, 0.5, "evict-last")


@GPU
@NO_CUDA
@pytest.mark.parametrize("mode", ["evict-last", "normal", "bulk", "load"])
def test_hint_modes_beside_a_gemv_in_a_cuda_graph(mode: str) -> None:
    """bf16 8B o_proj shape: the prefetch forked on a side stream while the GEMV's input is made, joined before
    the GEMV, all captured in a graph; every replay's output equals the GEMV's without any prefetch."""
    torch.manual_seed(0)
    weight = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16) * 4096**-0.5
    x = torch.randn(1, 4096, device="cuda", dtype=torch.bfloat16)
    add = torch.randn(1, 4096, device="cuda", dtype=torch.bfloat16)
    prefetcher = L2Prefetcher(weight, 0.5, mode)
    side = torch.cuda.Stream()

    def step() -> torch.Tensor:
        prefetch_beside(prefetcher, side)
        h = x * 2  # work on the main stream that the prefetch runs beside
        join_side(side)
        return gemv_triton(h, weight, add=add)[0]

    step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    for _ in range(3):
        x.copy_(torch.randn_like(x))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, gemv_triton(x * 2, weight, add=add)[0])
    assert int(prefetcher.sink) == 0  # the flag stays off in the engine: nothing is written


@pytest.mark.slow
@pytest.mark.skipif(INTERPRET, reason="this is the interpreter run itself")
def test_l2_prefetch_under_triton_interpreter() -> None:
    run_under_interpreter(__file__)
