"""The gate|up GEMM with SiLU-and-mul in its epilogue (engine/kernels/gated_gemm.py) against its plain-torch
reference and against the unfused pair it replaces (F.linear, then silu_and_mul): odd token counts, widths that are
not a multiple of the tile, a K that is not a multiple of the K step, strided inputs; bad shapes refused.

Runs like tests/test_kernels.py: fp32 / fp16 on the CPU under TRITON_INTERPRET=1 (the driver at the bottom re-runs
this file so), bf16 / fp16 / fp32 on CUDA, plus the 8B shape on the GPU at every tile config the bench sweeps."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

triton = pytest.importorskip("triton")
from kernel_harness import GPU, INTERPRET, NO_CUDA, cases, close, run_under_interpreter  # noqa: E402
from stoker.engine.kernels.activation import silu_and_mul_ref  # noqa: E402
from stoker.engine.kernels.gated_gemm import (  # noqa: E402
    GATED_GEMM_SWEEP,
    GatedGemmConfig,
    gate_up_silu_ref,
    gate_up_silu_triton,
)

CASES = cases()


def _inputs(tokens: int, k: int, inter: int, dtype: torch.dtype, device: str, seed: int = 0
            ) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, k, generator=g).to(dtype).to(device)
    w = (torch.randn(2 * inter, k, generator=g) / k**0.5).to(dtype).to(device)
    return x, w


@pytest.mark.parametrize("device,dtype", CASES)
@pytest.mark.parametrize("tokens,k,inter", [(1, 64, 16), (5, 48, 24), (33, 96, 40), (70, 40, 72)])
def test_gate_up_silu_matches_reference(device: str, dtype: torch.dtype, tokens: int, k: int, inter: int) -> None:
    x, w = _inputs(tokens, k, inter, dtype, device, seed=tokens)
    out = gate_up_silu_triton(x, w)
    assert out.shape == (tokens, inter) and out.dtype == dtype
    close(out, gate_up_silu_ref(x, w), dtype)
    # the unfused pair the engine ran before: the product, then the activation kernel's reference
    close(out, silu_and_mul_ref(F.linear(x, w)), dtype)


@pytest.mark.parametrize("device,dtype", CASES[:1])
def test_gate_up_silu_gate_and_up_are_not_swapped(device: str, dtype: torch.dtype) -> None:
    """Gate rows 0..I-1, up rows I..2I-1: with up = 1 and gate = x, the output is silu(x); swapped it would be x."""
    k, inter = 32, 16
    x = torch.zeros(3, k, dtype=dtype, device=device)
    x[:, 0] = torch.tensor([-2.0, 0.5, 3.0], dtype=dtype)
    x[:, 1] = 1.0
    w = torch.zeros(2 * inter, k, dtype=dtype, device=device)
    w[:inter, 0] = 1.0  # gate = x[:, 0]
    w[inter:, 1] = 1.0  # up = 1
    out = gate_up_silu_triton(x, w)
    expected = F.silu(x[:, :1].float()).expand(3, inter).to(dtype)
    close(out, expected, dtype)


@pytest.mark.parametrize("device,dtype", CASES[:1])
def test_gate_up_silu_strided_input_and_empty(device: str, dtype: torch.dtype) -> None:
    x, w = _inputs(9, 2 * 40, 24, dtype, device, seed=3)
    view = x[:, :40]  # rows 80 elements apart, 40 used
    close(gate_up_silu_triton(view, w[:, :40].contiguous()), gate_up_silu_ref(view, w[:, :40]), dtype)
    assert gate_up_silu_triton(x[:0], w).shape == (0, 24)


@pytest.mark.parametrize("device,dtype", CASES[:1])
def test_gate_up_silu_rejects_bad_shapes(device: str, dtype: torch.dtype) -> None:
    x, w = _inputs(4, 32, 8, dtype, device)
    with pytest.raises(ValueError, match=r"\[2I, K\]"):
        gate_up_silu_triton(x, w[:15])  # an odd number of rows
    with pytest.raises(ValueError, match="K = x's 32"):
        gate_up_silu_triton(x, w[:, :16].contiguous())
    with pytest.raises(ValueError, match="float"):
        gate_up_silu_triton(x, w.double())
    with pytest.raises(ValueError, match="contiguous"):
        gate_up_silu_triton(x.t().contiguous().t(), w)


@GPU
@NO_CUDA
@pytest.mark.parametrize("config", GATED_GEMM_SWEEP, ids=lambda c: c.label)
def test_gate_up_silu_8b_shape_every_swept_config(config: GatedGemmConfig) -> None:
    """The 8B MLP (K 4,096, I 14,336) at a token count that is not a multiple of any tile: each config the bench
    sweeps computes the same as cuBLAS's product then the activation, within bf16's error of that pair."""
    x, w = _inputs(777, 4096, 14336, torch.bfloat16, "cuda", seed=7)
    expected = silu_and_mul_ref(F.linear(x, w))
    out = gate_up_silu_triton(x, w, config)
    # both sides round the product to bf16 before the activation; they differ by the summation order only
    close(out, expected, torch.bfloat16)
    reference32 = gate_up_silu_ref(x.float(), w.float())
    assert (out.float() - reference32).abs().max() <= 2 * (expected.float() - reference32).abs().max() + 1e-3


@pytest.mark.slow
@pytest.mark.skipif(INTERPRET, reason="this is the interpreter run itself")
def test_gated_gemm_under_triton_interpreter() -> None:
    run_under_interpreter(__file__)
