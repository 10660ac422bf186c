"""A mixed step's attention split in two (issue 13): the decode rows at the head of the flat batch through the
decode kernel, the prompt chunks after them through the prefill kernel, each writing its rows of one output.
Checked against the plain-torch reference of the whole batch, on the GPU (bf16/fp16/fp32) and on the CPU under
TRITON_INTERPRET=1 (fp32/fp16; the driver at the bottom re-runs this file there). The engine-level check (greedy
tokens equal transformers with the split on, and the split really taken) is in tests/test_engine_models.py."""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")
from kernel_harness import INTERPRET, cases, close, run_under_interpreter  # noqa: E402
from stoker.engine.batch import AttentionMetadata  # noqa: E402
from stoker.engine.kernels import (  # noqa: E402  (after the interpreter fix above)
    paged_attention_ref,
    paged_decode_attention_ref,
    paged_decode_attention_triton,
)
from stoker.engine.layers.attention import PagedAttention  # noqa: E402
from test_kernels import paged_batch  # noqa: E402

CASES = cases()


def mixed_meta(shapes: list[tuple[int, int]], num_decodes: int, block_tables: torch.Tensor,
               device: str) -> AttentionMetadata:
    """(new queries, context) per sequence, the first num_decodes with one query each."""
    qsl = torch.tensor([0] + [n for n, _ in shapes], device=device).cumsum(0).to(torch.int32)
    num_tokens = int(qsl[-1])
    return AttentionMetadata(
        slot_mapping=torch.zeros(num_tokens, dtype=torch.int64, device=device), block_tables=block_tables,
        query_start_loc=qsl, context_lens=torch.tensor([c for _, c in shapes], dtype=torch.int32, device=device),
        decode_only=False, num_decodes=num_decodes, prompt_query_start_loc=qsl[num_decodes:] - num_decodes,
    )


@pytest.mark.parametrize("device,dtype", CASES)
@pytest.mark.parametrize("hq,hkv,head_dim,block_size", [(6, 2, 64, 16), (8, 1, 32, 8), (4, 4, 80, 16)])
def test_mixed_step_split_matches_whole_batch_reference(
    device: str, dtype: torch.dtype, hq: int, hkv: int, head_dim: int, block_size: int
) -> None:
    # Decode rows of odd contexts (a context of 1 among them: a one-token prompt's chunk sorts with them),
    # then prompt chunks: a fresh prompt, a chunk after a cached prefix, one longer than a query tile.
    shapes = [(1, 37), (1, 1), (1, 100), (1, 18), (17, 17), (5, 40), (37, 50)]
    num_decodes = 4
    k_cache, v_cache, block_tables = paged_batch([c for _, c in shapes], hkv, head_dim, block_size, device, dtype)
    meta = mixed_meta(shapes, num_decodes, block_tables, device)
    num_tokens = int(meta.query_start_loc[-1])
    # q as the model makes it: a view of the fused qkv output (rows strided past the k and v columns).
    qkv = torch.randn(num_tokens, (hq + 2 * hkv) * head_dim, device=device, dtype=dtype)
    q = qkv[:, : hq * head_dim].view(num_tokens, hq, head_dim)
    attn = PagedAttention(hq, hkv, head_dim, head_dim**-0.5).to(device)
    out = attn(q, k_cache, v_cache, meta)
    ref = paged_attention_ref(q, k_cache, v_cache, block_tables, meta.query_start_loc, meta.context_lens,
                              head_dim**-0.5)
    assert out.shape == q.shape and not out.isnan().any()
    close(out, ref, dtype)


@pytest.mark.parametrize("device,dtype", CASES)
@pytest.mark.parametrize("num_splits", [1, 3])
def test_decode_attention_writes_only_its_rows_of_out(device: str, dtype: torch.dtype, num_splits: int) -> None:
    lens = [9, 33, 1]
    k_cache, v_cache, block_tables = paged_batch(lens, 2, 32, 8, device, dtype)
    context_lens = torch.tensor(lens, dtype=torch.int32, device=device)
    q = torch.randn(3, 4, 32, device=device, dtype=dtype)
    whole = torch.full((7, 4, 32), float("nan"), device=device, dtype=dtype)  # rows 2..4 are this call's
    got = paged_decode_attention_triton(q, k_cache, v_cache, block_tables, context_lens, 0.2, num_splits,
                                        out=whole[2:5])
    assert got.data_ptr() == whole[2].data_ptr()
    close(whole[2:5], paged_decode_attention_ref(q, k_cache, v_cache, block_tables, context_lens, 0.2), dtype)
    assert whole[:2].isnan().all() and whole[5:].isnan().all()
    with pytest.raises(ValueError, match="out must be"):
        paged_decode_attention_triton(q, k_cache, v_cache, block_tables, context_lens, 0.2, out=whole[:2])


@pytest.mark.slow
@pytest.mark.skipif(INTERPRET, reason="this is the interpreter run itself")
def test_mixed_attention_under_triton_interpreter() -> None:
    run_under_interpreter(__file__)
