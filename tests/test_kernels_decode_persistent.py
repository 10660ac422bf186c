"""The persistent-grid decode attention (engine/kernels/decode_persistent.py, the overlap measurement's SM-capped
attention) against the plain-torch reference: odd shapes, fewer programs than work items (each program loops),
more programs than items, one program for everything; on the CPU under the Triton interpreter (fp32/fp16)."""
from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")
from kernel_harness import INTERPRET, cases, close, run_under_interpreter  # noqa: E402
from stoker.engine.kernels import paged_decode_attention_ref  # noqa: E402
from stoker.engine.kernels.decode_persistent import paged_decode_attention_persistent  # noqa: E402
from test_kernels import paged_batch  # noqa: E402

CASES = cases()


@pytest.mark.parametrize("device,dtype", CASES)
@pytest.mark.parametrize("hq,hkv,head_dim,block_size,num_programs", [
    (6, 2, 32, 8, 3),  # 10 items over 3 programs: uneven loops
    (4, 4, 24, 16, 1),  # one program walks every item; head_dim not a power of two
    (3, 1, 16, 4, 64),  # more programs than items
])
def test_persistent_decode_attention(
    device: str, dtype: torch.dtype, hq: int, hkv: int, head_dim: int, block_size: int, num_programs: int
) -> None:
    lens = [1, 19, 70, 33, 5]
    k_cache, v_cache, block_tables = paged_batch(lens, hkv, head_dim, block_size, device, dtype)
    context_lens = torch.tensor(lens, dtype=torch.int32, device=device)
    q = torch.randn(len(lens), hq, head_dim, device=device, dtype=dtype)
    out = paged_decode_attention_persistent(q, k_cache, v_cache, block_tables, context_lens, 0.15, num_programs)
    close(out, paged_decode_attention_ref(q, k_cache, v_cache, block_tables, context_lens, 0.15), dtype)


def test_persistent_decode_attention_rejects_no_programs() -> None:
    q = torch.zeros(1, 2, 16)
    cache = torch.zeros(1, 4, 1, 16)
    with pytest.raises(ValueError, match="num_programs"):
        paged_decode_attention_persistent(q, cache, cache, torch.zeros(1, 1, dtype=torch.int32),
                                          torch.ones(1, dtype=torch.int32), 1.0, 0)


@pytest.mark.skipif(INTERPRET, reason="this is the interpreter run itself")
def test_persistent_decode_attention_under_triton_interpreter() -> None:
    run_under_interpreter(__file__)


@pytest.mark.parametrize("device,dtype", CASES)
def test_bench_overlap_patch_takes_the_attention_layers_keywords(device: str, dtype: torch.dtype) -> None:
    """ops/bench_overlap.py puts this kernel in place of the engine's decode attention, which the attention layer
    calls with pdl= and out= (session 27's GPU run failed there): the result lands in out, and the engine's own
    function is back afterwards."""
    from stoker.engine import kernels
    from stoker.ops.bench_overlap import persistent_attention

    lens = [3, 40, 17]
    k_cache, v_cache, block_tables = paged_batch(lens, 2, 32, 8, device, dtype)
    context_lens = torch.tensor(lens, dtype=torch.int32, device=device)
    q = torch.randn(len(lens), 4, 32, device=device, dtype=dtype)
    out = torch.full_like(q, float("nan"))
    engine_fn = kernels.paged_decode_attention
    with persistent_attention(2):
        assert kernels.paged_decode_attention is not engine_fn
        got = kernels.paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, 0.2, None, None, None,
                                             pdl=True, out=out)
    assert kernels.paged_decode_attention is engine_fn
    assert got is out
    close(out, paged_decode_attention_ref(q, k_cache, v_cache, block_tables, context_lens, 0.2), dtype)
