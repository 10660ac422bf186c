"""The fused FP8 activation quantization (engine/kernels/fp8_quant.py) against its plain-torch reference.

The kernel promises the reference's rounding bit for bit (IEEE division, round-to-nearest-even to E4M3), so
the FP8 bytes and the scales are compared exactly, not within a tolerance. Cases marked gpu run bf16/fp16
on CUDA; under TRITON_INTERPRET=1 the CPU cases run fp32/fp16 on small odd shapes, and the driver at the
bottom re-runs this file in an interpreter subprocess.
"""
from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")
from kernel_harness import GPU, INTERPRET, NO_CUDA, cases, run_under_interpreter  # noqa: E402
from stoker.engine.kernels.fp8_quant import (  # noqa: E402
    quantize_activations_ref,
    quantize_activations_triton,
    rms_norm_quant_fp8_ref,
    rms_norm_quant_fp8_triton,
)

CASES = cases((torch.bfloat16, torch.float16))
SHAPES = [(1, 40), (5, 300)] if INTERPRET else [(1, 40), (5, 300), (37, 4096), (130, 14336)]


def activations(rows: int, k: int, dtype: torch.dtype, device: str) -> torch.Tensor:
    """Rows of very different magnitudes (per-token scales must differ), one all-zero row, and in fp32 one
    row past the E4M3 range after the static scale (saturation)."""
    x = torch.randn(rows, k, device=device) * torch.logspace(-2, 2, rows, device=device)[:, None]
    if rows > 2:
        x[1] = 0
    return x.to(dtype)


def same_fp8(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert actual.dtype == expected.dtype == torch.float8_e4m3fn and actual.shape == expected.shape
    mismatched = (actual.view(torch.uint8) != expected.view(torch.uint8)).sum().item()
    assert mismatched == 0, f"{mismatched} of {actual.numel()} FP8 values differ from the reference"


def near_fp8(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Every FP8 value at most one E4M3 step from the reference's (adjacent codes of one sign; +0 and -0
    alike), and under 1% of them off at all."""
    a, e = actual.view(torch.uint8).int(), expected.view(torch.uint8).int()
    same_sign = (a ^ e) < 128
    assert (same_sign | ((a | e) & 127 == 0)).all(), "an FP8 value has the wrong sign"
    assert ((a - e).abs() <= 1)[same_sign].all(), "an FP8 value is more than one E4M3 step off"
    off = a != e
    assert off.float().mean().item() < 0.01, f"{off.sum().item()} of {a.numel()} FP8 values off by one step"


@pytest.mark.parametrize("device,dtype", CASES)
@pytest.mark.parametrize("rows,k", SHAPES)
@pytest.mark.parametrize("static", [False, True], ids=["per-token", "static"])
def test_quantize_activations_matches_reference(device: str, dtype: torch.dtype, rows: int, k: int,
                                                static: bool) -> None:
    x = activations(rows, k, dtype, device)
    # A static scale below the largest rows' amax / 448: those rows saturate at +-448.
    input_scale = (x.float().abs().max() / 448 / 4).reshape(1) if static else None
    xq, scale = quantize_activations_triton(x, input_scale)
    xq_ref, scale_ref = quantize_activations_ref(x, input_scale)
    assert scale.shape == (rows, 1) and scale.dtype == torch.float32
    torch.testing.assert_close(scale, scale_ref, atol=0, rtol=0)
    same_fp8(xq, xq_ref)
    if static:  # the saturation is really exercised
        assert xq.float().abs().max().item() == 448.0


@pytest.mark.parametrize("device,dtype", CASES)
@pytest.mark.parametrize("rows,k", SHAPES)
@pytest.mark.parametrize("residual", [False, True], ids=["", "residual"])
def test_rms_norm_quant_matches_reference(device: str, dtype: torch.dtype, rows: int, k: int, residual: bool) -> None:
    x = activations(rows, k, dtype, device)
    res = torch.randn(rows, k, device=device).to(dtype) if residual else None
    weight = (torch.rand(k, device=device) + 0.5).to(dtype)
    xq, scale, s = rms_norm_quant_fp8_triton(x, weight, 1e-5, res, None)
    xq_ref, scale_ref, s_ref = rms_norm_quant_fp8_ref(x, weight, 1e-5, res, None)
    torch.testing.assert_close(s, s_ref, atol=0, rtol=0)
    # The kernel sums the squares in another order than torch's mean: the rms can differ in its last
    # float32 bit, and that reaches the scale (fp32) or, rarely, flips the dtype rounding of an element.
    torch.testing.assert_close(scale, scale_ref, atol=0, rtol=1e-6 if dtype == torch.float32 else 2 * 2**-8)
    near_fp8(xq, xq_ref)


@pytest.mark.parametrize("device,dtype", CASES[:1])
def test_quant_launchers_reject_bad_inputs(device: str, dtype: torch.dtype) -> None:
    x = torch.randn(4, 64, device=device).to(dtype)
    with pytest.raises(ValueError, match="one value"):
        quantize_activations_triton(x, torch.ones(2, device=device))
    with pytest.raises(ValueError, match="unit stride"):
        quantize_activations_triton(x.t(), None)
    with pytest.raises(ValueError, match="residual must match"):
        rms_norm_quant_fp8_triton(x, torch.ones(64, device=device, dtype=dtype), 1e-5, x[:2], None)
    with pytest.raises(ValueError, match="norm weight"):
        rms_norm_quant_fp8_triton(x, torch.ones(63, device=device, dtype=dtype), 1e-5, None, None)


@GPU
@NO_CUDA
def test_quant_handles_zero_rows() -> None:
    xq, scale = quantize_activations_triton(torch.empty(0, 128, device="cuda", dtype=torch.bfloat16), None)
    assert xq.shape == (0, 128) and scale.shape == (0, 1)


@pytest.mark.slow
@pytest.mark.skipif(INTERPRET, reason="this is the interpreter run itself")
def test_fp8_quant_under_triton_interpreter() -> None:
    run_under_interpreter(__file__)
