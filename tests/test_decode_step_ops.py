"""The small ops around a decode step (issue 13 item 2): the pending-token gather that runs eagerly or inside
the decode graph, and the LM head that writes float32 logits in one GEMM on CUDA."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from stoker.engine.batch import resolve_pending
from stoker.engine.layers.embedding import lm_head_logits

CUDA = torch.cuda.is_available()


def test_resolve_pending_reads_the_previous_steps_tokens() -> None:
    prev = torch.tensor([501, 502, 503, 504])
    # Known ids pass through; -1 - r takes row r of the previous step's sample.
    ids = torch.tensor([7, -1 - 2, 9, -1 - 0, -1 - 3])
    assert resolve_pending(ids, prev).tolist() == [7, 503, 9, 501, 504]
    assert resolve_pending(ids[[0, 2]], prev).tolist() == [7, 9]
    plain = torch.tensor([3, 4])
    assert resolve_pending(plain, None) is plain


def test_lm_head_logits_float32_into_out() -> None:
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(5, 24, generator=gen)
    weight = torch.randn(37, 24, generator=gen)
    ref = F.linear(hidden.double(), weight.double()).float()
    got = lm_head_logits(hidden, weight)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    buffer = torch.full((8, 37), float("nan"))
    into = lm_head_logits(hidden, weight, buffer[:5])
    assert into.data_ptr() == buffer.data_ptr()
    torch.testing.assert_close(buffer[:5], ref, rtol=1e-5, atol=1e-5)
    assert buffer[5:].isnan().all()  # rows past the batch are not touched


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_lm_head_logits_one_gemm_to_float32_on_cuda(dtype: torch.dtype) -> None:
    """bf16/fp16 operands: float32 logits straight from the GEMM (no cast kernel), as close to the float64
    product as the old bf16-rounded-then-cast logits were, or closer."""
    from torch.profiler import ProfilerActivity, profile

    gen = torch.Generator(device="cuda").manual_seed(0)
    hidden = torch.randn(67, 512, device="cuda", generator=gen).to(dtype)
    weight = (torch.randn(3001, 512, device="cuda", generator=gen) * 0.05).to(dtype)
    exact = F.linear(hidden.double(), weight.double())
    old = F.linear(hidden, weight).float()
    out = torch.empty(80, 3001, device="cuda")
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        got = lm_head_logits(hidden, weight, out[:67])
        torch.cuda.synchronize()
    assert got.dtype == torch.float32 and got.data_ptr() == out.data_ptr()
    assert (got.double() - exact).abs().max() <= (old.double() - exact).abs().max()
    kernels = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    assert not any("copy" in k.lower() or "elementwise" in k.lower() for k in kernels), kernels
