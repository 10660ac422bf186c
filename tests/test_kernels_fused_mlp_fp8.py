"""The fused decode MLP on FP8 weights with the activations as two E4M3 terms (engine/kernels/fused_mlp_fp8.py):
against a plain-torch replay of its own arithmetic (the terms per K slice and per program, each term's dot on the
E4M3 codes, the scales after), against the two FP8 GEMVs' arithmetic on the dequantized weights (fused_mlp_fp8_ref,
what the model computes) within the 16-bit dtypes' tolerance, and against the same kernel with one term: the
second term must take at least three quarters of the one-term error away, so a kernel that dropped it fails.

Runs like tests/test_kernels.py: bf16/fp16/fp32 on CUDA; fp32/fp16 under TRITON_INTERPRET=1 on the CPU, re-run in
an interpreter subprocess by the driver at the bottom.
"""
from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")
from kernel_harness import GPU, INTERPRET, NO_CUDA, TOLERANCE, cases, run_under_interpreter  # noqa: E402
from stoker.engine.kernels.fp8_linear import quantize_rows  # noqa: E402
from stoker.engine.kernels.fused_mlp_fp8 import (  # noqa: E402
    Fp8MlpConfig,
    fp8_mlp_config,
    fused_mlp_fp8_ref,
    fused_mlp_fp8_triton,
)

CASES = cases()
HIDDEN, INTER = 200, 75  # 200: K slices with a masked tail; 75: the last program's rows partly padding
EPS = 1e-5


def _inputs(num_rows: int, device: str, dtype: torch.dtype, hidden: int = HIDDEN, inter: int = INTER):
    gen = torch.Generator().manual_seed(1234 + num_rows)

    def rand(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * scale).to(device)

    wide = rand(num_rows, hidden + 8, scale=3.0).to(dtype)
    x = wide[:, :hidden]  # a row stride != hidden must be honoured; rms far from 1 so a missing norm shows
    gate_up, gate_up_scale = quantize_rows(rand(2 * inter, hidden, scale=hidden**-0.5))
    down, down_scale = quantize_rows(rand(hidden, inter, scale=inter**-0.5))
    residual = rand(num_rows, hidden).to(dtype)
    g = (rand(hidden) * 0.2 + 1).to(dtype)
    return x, gate_up, gate_up_scale, down, down_scale, residual, g


def _terms(t: torch.Tensor, count: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """float32 [R, C] -> `count` (E4M3 codes as float32 [R, C], scale [R]) terms, each on the remainder before it,
    as fp8_quant.quantize_rows_e4m3: scale = max(amax / 448, 1e-12) by IEEE division, times its reciprocal."""
    out, rest = [], t
    for _ in range(count):
        amax = rest.abs().amax(dim=1)
        scale = (amax / torch.full_like(amax, 448.0)).clamp(min=1e-12)
        codes = (rest * (1.0 / scale)[:, None]).clamp(-448.0, 448.0).to(torch.float8_e4m3fn).float()
        out.append((codes, scale))
        rest = rest - codes * scale[:, None]
    return out


def replay(x, gate_up, gate_up_scale, down, down_scale, residual, *, norm: bool, g, cfg: Fp8MlpConfig,
           count: int = 2) -> torch.Tensor:
    """The kernel's arithmetic in plain torch (float32 sums in another order): x (times g) split into `count` terms
    per K slice of cfg.bk, the gate / up sums scaled by the row scales and the rms, rounded, SiLU-and-mul, the
    product split per cfg.bi intermediate columns, down's partials scaled by its row scales, rounded, residual."""
    dtype = x.dtype
    x32 = x.float()
    xg = x32 * g.float() if g is not None else x32
    wgu, wd = gate_up.float(), down.float()
    inter = wgu.shape[0] // 2
    acc = torch.zeros(x.shape[0], 2 * inter, device=x.device)
    for k0 in range(0, x.shape[1], cfg.bk):
        for codes, scale in _terms(xg[:, k0 : k0 + cfg.bk], count):
            acc += (codes @ wgu[:, k0 : k0 + cfg.bk].T) * scale[:, None]
    acc = acc * gate_up_scale[None, :]
    if norm:
        acc = acc * torch.rsqrt(x32.square().sum(dim=1, keepdim=True) / x.shape[1] + EPS)
    gate, up = acc[:, :inter].to(dtype).float(), acc[:, inter:].to(dtype).float()
    act = (gate * torch.sigmoid(gate) * up).to(dtype).float()
    out = torch.zeros_like(x32)
    for i0 in range(0, inter, cfg.bi):
        for codes, scale in _terms(act[:, i0 : i0 + cfg.bi], count):
            out += (codes @ wd[:, i0 : i0 + cfg.bi].T) * scale[:, None]
    out = (out * down_scale[None, :]).to(dtype).float()
    return (out + residual.float()).to(dtype)


@pytest.mark.parametrize("device,dtype", CASES)
@pytest.mark.parametrize("num_rows", [1, 3])
@pytest.mark.parametrize("norm", ["g", "unit", "none"])
def test_fp8_terms_mlp_is_its_arithmetic_and_near_the_dequantized_gemvs(device: str, dtype: torch.dtype,
                                                                       num_rows: int, norm: str) -> None:
    x, gate_up, gus, down, ds, residual, g = _inputs(num_rows, device, dtype)
    g = g if norm == "g" else None
    cfg = fp8_mlp_config(device == "cuda", INTER)
    acc = torch.zeros(num_rows * HIDDEN, device=device)
    out = fused_mlp_fp8_triton(x, gate_up, gus, down, ds, residual, eps=EPS, norm=norm != "none", norm_weight=g,
                               config=cfg, accumulator=acc)
    assert out.shape == residual.shape and out.dtype == dtype
    assert torch.count_nonzero(acc) == 0, "the finishing kernel must leave the accumulator zero"
    two = replay(x, gate_up, gus, down, ds, residual, norm=norm != "none", g=g, cfg=cfg)
    tol = TOLERANCE[dtype]  # the same arithmetic: equal up to the float32 sums' order (and a rounding it flips)
    torch.testing.assert_close(out.float(), two.float(), atol=tol, rtol=tol)
    ref = fused_mlp_fp8_ref(x, gate_up, gus, down, ds, residual, eps=EPS, norm=norm != "none", norm_weight=g).float()
    one = replay(x, gate_up, gus, down, ds, residual, norm=norm != "none", g=g, cfg=cfg, count=1).float()
    err, one_err = (out.float() - ref).abs().max().item(), (one - ref).abs().max().item()
    assert err < one_err / 4, f"the second term did not pay: {err:.3e} vs one term's {one_err:.3e}"
    if dtype != torch.float32:  # two terms keep ~2^-8 of each element: within bf16's rounding (not fp16's, 2^-11)
        bf16 = TOLERANCE[torch.bfloat16]
        torch.testing.assert_close(out.float(), ref, atol=bf16, rtol=bf16)


@pytest.mark.parametrize("device,dtype", CASES)
def test_fp8_terms_mlp_rows_are_independent(device: str, dtype: torch.dtype) -> None:
    """Tokens of very different scale: each gets its own terms' scales (and rms), so a row's output is the one it
    gets alone (each normalised by its own rms first)."""
    x, gate_up, gus, down, ds, residual, g = _inputs(3, device, dtype)
    x = (x.float() * torch.tensor([[0.01], [1.0], [30.0]], device=device)).to(dtype)
    together = fused_mlp_fp8_triton(x, gate_up, gus, down, ds, residual, eps=EPS, norm_weight=g)
    tol = TOLERANCE[dtype]
    for i in range(3):
        alone = fused_mlp_fp8_triton(x[i : i + 1], gate_up, gus, down, ds, residual[i : i + 1], eps=EPS,
                                     norm_weight=g)
        torch.testing.assert_close(together[i : i + 1].float(), alone.float(), atol=tol, rtol=tol)


def test_fp8_terms_mlp_rejects_bad_arguments() -> None:
    x, gate_up, gus, down, ds, residual, g = _inputs(1, "cpu", torch.float32)
    with pytest.raises(ValueError, match="shapes disagree"):
        fused_mlp_fp8_triton(x, gate_up, gus, down[:, :-1], ds, residual, eps=EPS)
    with pytest.raises(ValueError, match="E4M3 weights expected"):
        fused_mlp_fp8_triton(x, gate_up.float(), gus, down, ds, residual, eps=EPS)
    with pytest.raises(ValueError, match="float32 row scales"):
        fused_mlp_fp8_triton(x, gate_up, gus[:-1], down, ds, residual, eps=EPS)
    with pytest.raises(ValueError, match="norm_weight"):
        fused_mlp_fp8_triton(x, gate_up, gus, down, ds, residual, eps=EPS, norm=False, norm_weight=g)
    with pytest.raises(ValueError, match="1..16 tokens"):
        big = torch.zeros(17, HIDDEN)
        fused_mlp_fp8_triton(big, gate_up, gus, down, ds, big, eps=EPS)
    with pytest.raises(ValueError, match="the accumulator must be contiguous float32"):
        fused_mlp_fp8_triton(x, gate_up, gus, down, ds, residual, eps=EPS, accumulator=torch.zeros(3))


@GPU
@NO_CUDA
@pytest.mark.parametrize("inter", [14336, 8192], ids=["8b", "1b"])
def test_fp8_terms_mlp_engine_shapes_in_a_cuda_graph(inter: int) -> None:
    """The engine's launches at the 8B and 1B MLP shapes, replayed from a CUDA graph with a static accumulator, against
    the two FP8 GEMVs the fused decode path ran before (bf16: within the dtype's tolerance of each other)."""
    from stoker.engine.kernels.gemv import gemv_triton

    hidden = 4096 if inter == 14336 else 2048
    x, gate_up, gus, down, ds, residual, g = _inputs(1, "cuda", torch.bfloat16, hidden=hidden, inter=inter)
    acc = torch.zeros(hidden, device="cuda")
    fused_mlp_fp8_triton(x, gate_up, gus, down, ds, residual, eps=EPS, norm_weight=g, accumulator=acc)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused_mlp_fp8_triton(x, gate_up, gus, down, ds, residual, eps=EPS, norm_weight=g, accumulator=acc)
    x.copy_((torch.randn(1, hidden, device="cuda") * 3).to(torch.bfloat16))
    graph.replay()
    act, _ = gemv_triton(x, gate_up, silu_mul=True, norm_weight=g, eps=EPS, weight_scale=gus)
    two = gemv_triton(act, down, add=residual, weight_scale=ds)[0]
    tol = TOLERANCE[torch.bfloat16]
    torch.testing.assert_close(out.float(), two.float(), atol=tol, rtol=tol)
    assert torch.count_nonzero(acc) == 0


@pytest.mark.skipif(INTERPRET, reason="this is the interpreter run itself")
def test_fp8_terms_mlp_under_triton_interpreter() -> None:
    run_under_interpreter(__file__)
