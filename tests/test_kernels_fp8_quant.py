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
from stoker.engine import kernels  # noqa: E402
from stoker.engine.kernels import fp8_linear_ref, rms_norm_ref  # noqa: E402
from stoker.engine.kernels.fp8_linear import quantize_rows  # noqa: E402
from stoker.engine.kernels.fp8_quant import (  # noqa: E402
    quantize_activations_ref,
    quantize_activations_triton,
    rms_norm_quant_fp8_ref,
    rms_norm_quant_fp8_triton,
    silu_mul_quant_fp8_ref,
    silu_mul_quant_fp8_triton,
)
from stoker.engine.layers import fp8 as fp8_layers  # noqa: E402
from stoker.engine.quant_config import Fp8Scheme  # noqa: E402

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


@pytest.mark.parametrize("device,dtype", CASES)
@pytest.mark.parametrize("rows,k", SHAPES)
@pytest.mark.parametrize("static", [False, True], ids=["per-token", "static"])
def test_silu_mul_quant_matches_reference(device: str, dtype: torch.dtype, rows: int, k: int, static: bool) -> None:
    """gate | up of different magnitudes per half, so a swapped or dropped half changes the result (gates within
    +-80: the interpreter's float32 exp(-gate) would overflow past ~88, a warning that fails the test)."""
    gate = activations(rows, k, dtype, device).clamp(-80, 80)
    gate_up = torch.cat([gate, (torch.randn(rows, k, device=device) * 3).to(dtype)], 1)
    input_scale = torch.tensor([0.02], device=device) if static else None
    xq, scale = silu_mul_quant_fp8_triton(gate_up, input_scale)
    xq_ref, scale_ref = silu_mul_quant_fp8_ref(gate_up, input_scale)
    assert xq.shape == (rows, k) and scale.shape == (rows, 1)
    # The kernel's sigmoid (Triton's) and torch's silu may differ in the last float32 bit, which can flip the
    # dtype rounding of a product now and then, and so the row's amax (the scale) by one dtype step.
    torch.testing.assert_close(scale, scale_ref, atol=0, rtol=2 * 2**-8)
    near_fp8(xq, xq_ref)


@GPU
@NO_CUDA
@pytest.mark.parametrize("rows,k", [(37, 4096), (300, 14336)])
def test_silu_mul_quant_equals_the_two_kernels(rows: int, k: int) -> None:
    """On the GPU the fused kernel does activation.py's arithmetic, then the quantization's: bit for bit what
    the two kernels it replaces give (the engine's unfused path)."""
    gate_up = torch.randn(rows, 2 * k, device="cuda").bfloat16()
    xq, scale = silu_mul_quant_fp8_triton(gate_up, None)
    xq_two, scale_two = quantize_activations_triton(kernels.silu_and_mul_triton(gate_up), None)
    torch.testing.assert_close(scale, scale_two, atol=0, rtol=0)
    same_fp8(xq, xq_two)


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
    with pytest.raises(ValueError, match="gate | up"):
        silu_mul_quant_fp8_triton(x[:, :63], None)


@GPU
@NO_CUDA
def test_quant_handles_zero_rows() -> None:
    xq, scale = quantize_activations_triton(torch.empty(0, 128, device="cuda", dtype=torch.bfloat16), None)
    assert xq.shape == (0, 128) and scale.shape == (0, 1)


def fp8_layer(k: int, n: int, static: bool, device: str) -> fp8_layers.Fp8Linear:
    """An Fp8Linear loaded as from a compressed-tensors channel checkpoint (static: with an input_scale)."""
    scheme = Fp8Scheme("compressed-tensors", "channel", "static" if static else "dynamic")
    with torch.device(device):
        layer = fp8_layers.Fp8Linear(k, n, dtype=torch.bfloat16, scheme=scheme)
    weight, scale = quantize_rows(torch.randn(n, k, device=device))
    layer.load_weight("weight", weight)
    layer.load_weight("weight_scale", scale[:, None])
    if static:
        layer.load_weight("input_scale", torch.tensor([0.05]))
    layer.finish_loading()
    return layer


@pytest.mark.skipif(INTERPRET, reason="no kernel on the CPU path")
def test_linear_after_norm_on_cpu_is_norm_then_linear() -> None:
    """The fallback's wiring: the residual added before the norm, the sum returned, the norm weight applied."""
    layer = fp8_layer(96, 48, False, "cpu")
    x, res = torch.randn(5, 96).bfloat16(), torch.randn(5, 96).bfloat16()
    g = (torch.rand(96) + 0.5).bfloat16()
    out, summed = layer.forward_after_norm(x, res, g, 1e-5)
    h, s = rms_norm_ref(x, g, 1e-5, res)
    torch.testing.assert_close(summed, s, atol=0, rtol=0)
    torch.testing.assert_close(out, fp8_linear_ref(h, layer.weight, layer.weight_scale), atol=0, rtol=0)


@pytest.mark.skipif(INTERPRET, reason="no kernel on the CPU path")
def test_linear_after_silu_on_cpu_is_silu_mul_then_linear() -> None:
    layer = fp8_layer(96, 48, False, "cpu")
    gate_up = torch.randn(5, 192).bfloat16()
    expected = fp8_linear_ref(kernels.silu_and_mul_ref(gate_up), layer.weight, layer.weight_scale)
    torch.testing.assert_close(layer.forward_after_silu(gate_up), expected, atol=0, rtol=0)


@GPU
@NO_CUDA
@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
def test_linear_after_silu_fuses_on_cuda(monkeypatch: pytest.MonkeyPatch, static: bool) -> None:
    """Above 16 tokens SiLU-mul and the quantization run as one kernel and give exactly what the unfused pair
    (the SiLU-mul kernel, then the layer's own _scaled_mm path) gives; at 16 tokens (the GEMV) the pair runs."""
    layer = fp8_layer(512, 384, static, "cuda")
    calls = []
    monkeypatch.setattr(fp8_layers, "silu_mul_quant_fp8_triton",
                        lambda *a: calls.append(a[0].shape[0]) or silu_mul_quant_fp8_triton(*a))
    for rows in (64, 16):
        gate_up = torch.randn(rows, 1024, device="cuda").bfloat16()
        torch.testing.assert_close(layer.forward_after_silu(gate_up), layer(kernels.silu_and_mul(gate_up)),
                                   atol=0, rtol=0)
    assert calls == [64]


@GPU
@NO_CUDA
@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
def test_linear_after_norm_fuses_on_cuda(monkeypatch: pytest.MonkeyPatch, static: bool) -> None:
    """Above 16 tokens the norm and the quantization run as one kernel and give what the unfused pair (the
    norm kernel, then the layer's own _scaled_mm path) gives; at 16 tokens (the GEMV) the unfused pair runs."""
    layer = fp8_layer(512, 384, static, "cuda")
    g = (torch.rand(512, device="cuda") + 0.5).bfloat16()
    calls = []
    monkeypatch.setattr(fp8_layers, "rms_norm_quant_fp8_triton",
                        lambda *a: calls.append(a[0].shape[0]) or rms_norm_quant_fp8_triton(*a))
    for rows in (64, 16):
        x, res = torch.randn(rows, 512, device="cuda").bfloat16(), torch.randn(rows, 512, device="cuda").bfloat16()
        out, summed = layer.forward_after_norm(x, res, g, 1e-5)
        h, s = kernels.rms_norm(x, g, 1e-5, res)
        torch.testing.assert_close(summed, s, atol=0, rtol=0)
        expected = layer(h)
        rel = ((out.float() - expected.float()).norm() / expected.float().norm()).item()
        assert rel < 1e-2, rel  # the same FP8 activations but for the rms's last bit
    assert calls == [64]


@pytest.mark.slow
@pytest.mark.skipif(INTERPRET, reason="this is the interpreter run itself")
def test_fp8_quant_under_triton_interpreter() -> None:
    run_under_interpreter(__file__)
