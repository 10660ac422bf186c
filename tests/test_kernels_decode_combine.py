"""The decode attention's fused combine (issue 13 item 1): with counters, the last split of each (sequence,
kv head) to finish combines the partials inside the split kernel, so a multi-split decode is one launch.

Runs like tests/test_kernels.py: fp32/fp16 on the CPU under TRITON_INTERPRET=1 (the driver at the bottom
re-runs this file so), bf16/fp16/fp32 on CUDA (marked gpu), plus a CUDA-graph replay case on the GPU only:
the interpreter runs programs one after another, so only the GPU races the splits against each other.
"""
from __future__ import annotations

import warnings

import pytest
import torch

triton = pytest.importorskip("triton")
from kernel_harness import GPU, INTERPRET, NO_CUDA, cases, close, run_under_interpreter  # noqa: E402
from stoker.engine.kernels import attention  # noqa: E402
from stoker.engine.kernels.attention import (  # noqa: E402
    decode_combine_counters,
    paged_decode_attention_ref,
    paged_decode_attention_triton,
)
from stoker.engine.layers.attention import FUSED_COMBINE_BATCHES, PagedAttention  # noqa: E402
from test_kernels import paged_batch  # noqa: E402

CASES = cases()


class _NoSecondKernel:
    """Stands in for the reduce kernel: the fused combine must never launch it."""

    def __getitem__(self, grid: object) -> None:
        raise AssertionError("the separate reduce kernel ran although counters were given")


@pytest.fixture
def one_launch(monkeypatch: pytest.MonkeyPatch) -> None:
    """No reduce kernel, and split-K scratch poisoned with NaN: only the live splits' partials may be read."""
    real = attention._decode_partials

    def poisoned(*args: object, **kwargs: object) -> tuple[torch.Tensor, ...]:
        return tuple(t.fill_(float("nan")) for t in real(*args, **kwargs))

    monkeypatch.setattr(attention, "_decode_partials", poisoned)
    monkeypatch.setattr(attention, "_decode_reduce_kernel", _NoSecondKernel())


def _decode(lens: list[int], hq: int, hkv: int, head_dim: int, block_size: int, device: str,
            dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    k_cache, v_cache, block_tables = paged_batch(lens, hkv, head_dim, block_size, device, dtype)
    context_lens = torch.tensor(lens, dtype=torch.int32, device=device)
    q = torch.randn(len(lens), hq, head_dim, device=device, dtype=dtype)
    return q, k_cache, v_cache, block_tables, context_lens


@pytest.mark.parametrize("device,dtype", CASES)
@pytest.mark.parametrize("hq,hkv,head_dim,block_size", [(6, 2, 80, 8), (8, 1, 32, 16)])
@pytest.mark.parametrize("num_splits", [None, 3, 7])
@pytest.mark.usefixtures("one_launch")
def test_fused_combine_matches_reference_in_one_launch(
    device: str, dtype: torch.dtype, hq: int, hkv: int, head_dim: int, block_size: int, num_splits: int | None
) -> None:
    counters = decode_combine_counters(6, hkv, device)
    # Two batches through the same counters: the first launch must leave them zeroed for the second.
    for lens in ([1, 17, 100, 33, 5], [50, 3, 29]):
        q, k_cache, v_cache, block_tables, context_lens = _decode(lens, hq, hkv, head_dim, block_size, device, dtype)
        out = paged_decode_attention_triton(q, k_cache, v_cache, block_tables, context_lens, 0.1, num_splits,
                                            counters=counters)
        close(out, paged_decode_attention_ref(q, k_cache, v_cache, block_tables, context_lens, 0.1), dtype)
        assert torch.count_nonzero(counters) == 0


@pytest.mark.parametrize("device,dtype", CASES)
@pytest.mark.usefixtures("one_launch")
def test_fused_combine_resets_the_counter_of_an_empty_context(device: str, dtype: torch.dtype) -> None:
    """A context of 0 (never a real decode, but a grid row all the same) still runs split 0, which must
    count as the pair's only live split and reset its counter, or the next launch combines too early."""
    counters = decode_combine_counters(2, 1, device)
    q, k_cache, v_cache, block_tables, context_lens = _decode([40, 40], 4, 1, 32, 8, device, dtype)
    context_lens[0] = 0
    with warnings.catch_warnings():  # that row's output is 0/0 (undefined): numpy warns under the interpreter
        warnings.simplefilter("ignore", RuntimeWarning)
        paged_decode_attention_triton(q, k_cache, v_cache, block_tables, context_lens, 0.2, 5, counters=counters)
    assert torch.count_nonzero(counters) == 0
    context_lens[0] = 40
    out = paged_decode_attention_triton(q, k_cache, v_cache, block_tables, context_lens, 0.2, 5, counters=counters)
    close(out, paged_decode_attention_ref(q, k_cache, v_cache, block_tables, context_lens, 0.2), dtype)


@pytest.mark.parametrize("device,dtype", CASES)
def test_fused_combine_rejects_counters_it_cannot_use(device: str, dtype: torch.dtype) -> None:
    q, k_cache, v_cache, block_tables, context_lens = _decode([9, 12, 3], 4, 2, 16, 8, device, dtype)
    args = (q, k_cache, v_cache, block_tables, context_lens, 0.1, 2)
    with pytest.raises(ValueError, match="B \\* Hkv = 6"):
        paged_decode_attention_triton(*args, counters=decode_combine_counters(2, 2, device))
    with pytest.raises(ValueError, match="int32"):
        paged_decode_attention_triton(*args, counters=torch.zeros(8, dtype=torch.int64, device=device))


def test_the_layer_hands_counters_to_the_listed_batches_only(monkeypatch: pytest.MonkeyPatch) -> None:
    from stoker.engine.layers import attention as layer_module

    layer = PagedAttention(num_heads=8, num_kv_heads=2, head_dim=16, scale=0.25)
    assert layer._counters_for(torch.zeros(max(FUSED_COMBINE_BATCHES) + 1, 8, 16)) is None
    monkeypatch.setattr(layer_module, "FUSED_COMBINE_BATCHES", frozenset({1, 5}))
    small = layer._counters_for(torch.zeros(5, 8, 16))
    assert small is not None and small.numel() == 5 * 2 and small.dtype == torch.int32
    assert layer._counters_for(torch.zeros(1, 8, 16)) is small  # one buffer per layer, made once
    assert layer._counters_for(torch.zeros(2, 8, 16)) is None  # between the listed batches: two kernels
    assert layer._counters_for(torch.zeros(6, 8, 16)) is None


@GPU
@NO_CUDA
@pytest.mark.parametrize("hq,hkv,head_dim", [(32, 8, 128), (32, 8, 64), (14, 2, 64)])
def test_fused_combine_replays_in_a_cuda_graph(hq: int, hkv: int, head_dim: int) -> None:
    """bf16, a graph captured once and replayed over changing contexts (33+ splits racing on the GPU): every
    replay equals the two-kernel combine and the reference, and the counters stay zeroed between replays."""
    dtype, block_size, max_blocks = torch.bfloat16, 16, 256  # a static table 4096 tokens wide, as in a graph
    lens = [4000, 700, 1]
    # Every row owns 4000 tokens of blocks, so each may take any context up to that on a replay.
    k_cache, v_cache, tables = paged_batch([4000] * len(lens), hkv, head_dim, block_size, "cuda", dtype)
    static_tables = torch.zeros(len(lens), max_blocks, dtype=torch.int32, device="cuda")
    static_tables[:, : tables.shape[1]] = tables
    context_lens = torch.tensor(lens, dtype=torch.int32, device="cuda")
    q = torch.randn(len(lens), hq, head_dim, device="cuda", dtype=dtype)
    counters = decode_combine_counters(len(lens), hkv, "cuda")
    paged_decode_attention_triton(q, k_cache, v_cache, static_tables, context_lens, 0.09, counters=counters)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = paged_decode_attention_triton(q, k_cache, v_cache, static_tables, context_lens, 0.09,
                                            counters=counters)
    for live in ([4000, 700, 1], [129, 4000, 64], [1, 2, 3999], [4000, 700, 1]):
        context_lens.copy_(torch.tensor(live, dtype=torch.int32))
        q.copy_(torch.randn_like(q))
        for _ in range(5):
            graph.replay()
        two_kernels = paged_decode_attention_triton(q, k_cache, v_cache, static_tables, context_lens, 0.09)
        close(out, two_kernels, dtype)
        close(out, paged_decode_attention_ref(q, k_cache, v_cache, tables, context_lens, 0.09), dtype)
        assert torch.count_nonzero(counters) == 0


@pytest.mark.slow
@pytest.mark.skipif(INTERPRET, reason="this is the interpreter run itself")
def test_decode_combine_under_triton_interpreter() -> None:
    run_under_interpreter(__file__)
