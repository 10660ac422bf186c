"""The one-launch greedy argmax (engine/kernels/argmax.py) against torch.argmax, bit for bit: random rows, ties
across and within pieces, infinities, NaN, signed zeros, a vocabulary that is not a multiple of the piece, and the
tickets left at zero so that the next launch (a graph replay) starts clean.

Runs like tests/test_kernels.py: fp32 / fp16 on the CPU under TRITON_INTERPRET=1 (the driver at the bottom
re-runs this file so), float32 / bf16 on CUDA, and a CUDA-graph replay on the GPU."""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")
from kernel_harness import GPU, INTERPRET, NO_CUDA, cases, run_under_interpreter  # noqa: E402
from stoker.engine.kernels.argmax import PIECE, GreedyArgmax  # noqa: E402
from stoker.engine.sampler import greedy_argmax  # noqa: E402

CASES = cases((torch.float32, torch.bfloat16))
VOCAB = 2 * PIECE + 77  # three pieces, the last one short


def _rows(kind: str, n: int, vocab: int, dtype: torch.dtype, device: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(11)
    x = torch.randn(n, vocab, generator=g).to(dtype)
    if kind == "ties":  # the maximum at several places: in one piece, across pieces, the last short piece
        top = x.max() + 1
        x[0, [5, 9, PIECE + 3]] = top
        x[1 % n, [PIECE + 1, 2 * PIECE + 2, 2 * PIECE + 76]] = top
    elif kind == "inf":  # +inf wins over finite values; a row of -inf gives 0; -inf elsewhere is ignored
        x[0, [PIECE + 7, 2 * PIECE]] = float("inf")
        x[1 % n] = float("-inf")
        x[2 % n, : PIECE] = float("-inf")
    elif kind == "nan":  # the first NaN wins over +inf
        x[0, 2 * PIECE + 5] = float("nan")
        x[0, 40] = float("inf")
        x[0, 2 * PIECE + 9] = float("nan")
        x[1 % n, PIECE + 2] = float("nan")
    elif kind == "zeros":  # the maximum is zero, first as -0.0 then as +0.0: they are equal, the first wins
        x = -x.abs() - 1
        x[0, 17] = -0.0
        x[0, 33] = 0.0
        x[1 % n, PIECE + 4] = 0.0
        x[1 % n, 2 * PIECE + 1] = -0.0
    return x.to(device)


@pytest.mark.parametrize("device,dtype", CASES)
@pytest.mark.parametrize("kind", ["random", "ties", "inf", "nan", "zeros"])
@pytest.mark.parametrize("n", [1, 3])
def test_greedy_argmax_kernel_equals_torch_argmax(device: str, dtype: torch.dtype, kind: str, n: int) -> None:
    x = _rows(kind, n, VOCAB, dtype, device)
    argmax = GreedyArgmax(4, VOCAB, device)
    out = torch.full((n,), -5, dtype=torch.int64, device=device)
    for _ in range(2):  # a second launch on the same scratch: the tickets were put back to zero
        argmax(x, out)
        assert out.tolist() == x.argmax(dim=-1).tolist()
        assert not argmax.tickets.any()
    if dtype == torch.float32:  # and the sampler's own greedy path agrees
        assert out.tolist() == greedy_argmax(x.clone()).tolist()


@pytest.mark.parametrize("device,dtype", CASES[:1])
def test_greedy_argmax_rejects_bad_shapes(device: str, dtype: torch.dtype) -> None:
    argmax = GreedyArgmax(2, VOCAB, device)
    out = torch.empty(3, dtype=torch.int64, device=device)
    with pytest.raises(ValueError, match="logits"):
        argmax(torch.zeros(3, VOCAB, device=device), out)  # more rows than the scratch holds
    with pytest.raises(ValueError, match="logits"):
        argmax(torch.zeros(1, VOCAB + 1, device=device), out[:1])  # another vocabulary
    with pytest.raises(ValueError, match="out must be"):
        argmax(torch.zeros(2, VOCAB, device=device), torch.empty(2, dtype=torch.int32, device=device))
    with pytest.raises(ValueError, match="max_rows"):
        GreedyArgmax(0, VOCAB, device)


@GPU
@NO_CUDA
def test_greedy_argmax_replays_in_a_cuda_graph() -> None:
    """Captured once behind a kernel that writes the logits (the LM head's place), replayed on new logits: each
    replay gives torch.argmax's ids, at the 8B vocabulary and 16 rows."""
    vocab, n = 128256, 16
    src = torch.randn(n, vocab, device="cuda")
    logits = torch.empty_like(src)
    argmax = GreedyArgmax(n, vocab, "cuda")
    ids = torch.empty(n, dtype=torch.int64, device="cuda")

    def step() -> None:
        torch.mul(src, 1.0, out=logits)
        argmax(logits, ids)

    step()  # compile outside the capture
    stream = torch.cuda.Stream()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        step()
    for i in range(4):
        src.copy_(torch.randn(n, vocab, device="cuda"))
        if i == 3:  # a tie across pieces in a row
            src[5, [100, 70000]] = src.max() + 1
        graph.replay()
        torch.cuda.synchronize()
        assert ids.tolist() == logits.argmax(dim=-1).tolist()
    assert not argmax.tickets.any()


@pytest.mark.slow
@pytest.mark.skipif(INTERPRET, reason="this is the interpreter run itself")
def test_argmax_under_triton_interpreter() -> None:
    run_under_interpreter(__file__)
