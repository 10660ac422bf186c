"""The fused decode MLP (engine/kernels/fused_mlp.py: gate_up + SiLU-mul + down + residual in a partials kernel and
a reduce kernel) against the two GEMVs it replaces and their float64 truth, on odd shapes (the intermediate not a
multiple of the program's rows, hidden not a multiple of the down step), M in {1, 3}.

Runs like tests/test_kernels.py: the GPU cases bf16/fp16/fp32 on CUDA; under TRITON_INTERPRET=1 fp32/fp16 on the
CPU, re-run in an interpreter subprocess by the driver at the bottom.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

triton = pytest.importorskip("triton")
from kernel_harness import GPU, INTERPRET, NO_CUDA, TOLERANCE, cases, run_under_interpreter  # noqa: E402
from stoker.engine.kernels.fused_mlp import MlpConfig, fused_mlp_ref, fused_mlp_triton, mlp_config  # noqa: E402
from stoker.engine.kernels.gemv import fold_norm_weight, gemv_ref  # noqa: E402

CASES = cases()
HIDDEN, INTER = 200, 75  # 200: several bh steps and a masked tail; 75: the last program's rows partly padding


def rand(*shape: int, device: str, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, device=device) * scale).to(dtype)


def _inputs(num_rows: int, device: str, dtype: torch.dtype, hidden: int = HIDDEN, inter: int = INTER):
    wide = rand(num_rows, hidden + 8, device=device, dtype=dtype, scale=3.0)
    x = wide[:, :hidden]  # a row stride != hidden must be honoured; rms far from 1 so a missing norm shows
    gate_up = rand(2 * inter, hidden, device=device, dtype=dtype, scale=hidden**-0.5)
    down = rand(hidden, inter, device=device, dtype=dtype, scale=inter**-0.5)
    residual = rand(num_rows, hidden, device=device, dtype=dtype)
    g = rand(hidden, device=device, dtype=dtype) + 1
    return x, gate_up, down, residual, g


def _close_to_truth(out: torch.Tensor, ref: torch.Tensor, truth: torch.Tensor, dtype: torch.dtype) -> None:
    """Within twice the reference's own worst error from the float64 truth, plus the dtype's tolerance (the kernel
    sums the down projection in another order than the reference, so neither is the other's rounding)."""
    ref_err = (ref.double() - truth).abs().max().item()
    torch.testing.assert_close(out.double(), truth, atol=TOLERANCE[dtype] + 2 * ref_err, rtol=TOLERANCE[dtype])


def _config(device: str, dtype: torch.dtype, atomic: bool) -> MlpConfig:
    return dataclasses.replace(mlp_config(device == "cuda", dtype.itemsize), atomic=atomic)


@pytest.mark.parametrize("device,dtype", CASES)
@pytest.mark.parametrize("num_rows", [1, 3])
@pytest.mark.parametrize("norm", ["folded", "none"])
@pytest.mark.parametrize("atomic", [False, True], ids=["slots", "atomic"])
def test_fused_mlp_matches_the_two_gemvs(device: str, dtype: torch.dtype, num_rows: int, norm: str,
                                         atomic: bool) -> None:
    x, gate_up, down, residual, g = _inputs(num_rows, device, dtype)
    folded = norm == "folded"
    out = fused_mlp_triton(x, fold_norm_weight(gate_up, g) if folded else gate_up, down, residual, eps=1e-5,
                           norm_folded=folded, config=_config(device, dtype, atomic))
    assert out.shape == residual.shape and out.dtype == dtype
    # The reference: the norm with its weight g (unfolded), silu-mul, down, residual add: what the model computes.
    act, _ = gemv_ref(x, gate_up, silu_mul=True, norm_weight=g if folded else None, eps=1e-5)
    ref = gemv_ref(act, down, add=residual)[0]
    wide = [t.double() for t in (x, gate_up, down, residual, g)]
    act64, _ = gemv_ref(wide[0], wide[1], silu_mul=True, norm_weight=wide[4] if folded else None, eps=1e-5)
    truth = gemv_ref(act64, wide[2], add=wide[3])[0]
    _close_to_truth(out, ref, truth, dtype)


@pytest.mark.parametrize("device,dtype", CASES)
def test_fused_mlp_norm_is_per_row_and_rows_are_independent(device: str, dtype: torch.dtype) -> None:
    # Rows of very different scale: each normalised by its own rms; and a row's output is the one it gets alone.
    x, gate_up, down, residual, _ = _inputs(3, device, dtype)
    x = (x.float() * torch.tensor([[0.01], [1.0], [30.0]], device=device)).to(dtype)
    together = fused_mlp_triton(x, gate_up, down, residual, eps=1e-6)
    for i in range(3):
        alone = fused_mlp_triton(x[i : i + 1], gate_up, down, residual[i : i + 1], eps=1e-6)
        torch.testing.assert_close(together[i : i + 1], alone, rtol=0, atol=0)
    ref = fused_mlp_ref(x, gate_up, down, residual, eps=1e-6)
    torch.testing.assert_close(together.float(), ref.float(), atol=TOLERANCE[dtype] * 4, rtol=TOLERANCE[dtype] * 4)


@pytest.mark.parametrize("device,dtype", CASES)
def test_fused_mlp_is_repeatable_and_uses_given_partials(device: str, dtype: torch.dtype) -> None:
    """No atomics: two runs give the same bits; a caller's scratch (CUDA graphs' static buffer) is used, and stale
    values in it (a larger step before) change nothing."""
    x, gate_up, down, residual, _ = _inputs(1, device, dtype)
    cfg = MlpConfig(bi=16, bk=32, bh=32, num_warps=4, num_stages=1)
    programs = triton.cdiv(INTER, cfg.bi)
    scratch = torch.full((programs * 3 * HIDDEN,), float("nan"), device=device)
    first = fused_mlp_triton(x, gate_up, down, residual, eps=1e-5, config=cfg, partials=scratch)
    assert not torch.isnan(scratch[: programs * HIDDEN]).any()  # the kernel wrote its slots there
    second = fused_mlp_triton(x, gate_up, down, residual, eps=1e-5, config=cfg)
    torch.testing.assert_close(first, second, rtol=0, atol=0)
    with pytest.raises(ValueError, match="partials must be contiguous float32"):
        fused_mlp_triton(x, gate_up, down, residual, eps=1e-5, config=cfg, partials=scratch[:10])


@pytest.mark.parametrize("device,dtype", CASES)
def test_fused_mlp_atomic_leaves_its_accumulator_zero(device: str, dtype: torch.dtype) -> None:
    """The atomic form adds every program's partials into one [M, H] float32 buffer that the reduce reads and zeroes:
    a layer after a layer (or a step after a step) finds it zero again, so the static buffer is reused as is."""
    x, gate_up, down, residual, _ = _inputs(3, device, dtype)
    cfg = _config(device, dtype, atomic=True)
    acc = torch.zeros(3 * HIDDEN, device=device)
    first = fused_mlp_triton(x, gate_up, down, residual, eps=1e-5, config=cfg, partials=acc)
    assert torch.count_nonzero(acc) == 0
    second = fused_mlp_triton(x, gate_up, down, residual, eps=1e-5, config=cfg, partials=acc)
    slots = fused_mlp_triton(x, gate_up, down, residual, eps=1e-5, config=dataclasses.replace(cfg, atomic=False))
    tol = TOLERANCE[dtype]  # the atomic order may differ from run to run: equal within rounding, not bitwise
    torch.testing.assert_close(second.float(), first.float(), atol=tol, rtol=tol)
    torch.testing.assert_close(slots.float(), first.float(), atol=tol, rtol=tol)


def test_fused_mlp_rejects_bad_arguments() -> None:
    x, gate_up, down, residual, _ = _inputs(1, "cpu", torch.float32)
    with pytest.raises(ValueError, match="shapes disagree"):
        fused_mlp_triton(x, gate_up, down[:, :-1], residual, eps=1e-5)
    with pytest.raises(ValueError, match="one dtype expected"):
        fused_mlp_triton(x, gate_up, down.half(), residual, eps=1e-5)
    with pytest.raises(ValueError, match="1..16 tokens"):
        big = torch.zeros(17, HIDDEN)
        fused_mlp_triton(big, gate_up, down, big, eps=1e-5)


@GPU
@NO_CUDA
@pytest.mark.parametrize("atomic", [False, True], ids=["slots", "atomic"])
def test_fused_mlp_8b_shape_bf16_in_a_cuda_graph(atomic: bool) -> None:
    """The engine's launch at the 8B shape (bi 128: 112 programs), replayed from a CUDA graph with a static
    scratch, against the two GEMVs it replaces (bf16: both within the dtype's tolerance of each other)."""
    from stoker.engine.kernels.gemv import gemv_triton

    torch.manual_seed(0)
    x, gate_up, down, residual, _ = _inputs(1, "cuda", torch.bfloat16, hidden=4096, inter=14336)
    cfg = _config("cuda", torch.bfloat16, atomic)
    scratch = torch.zeros((1 if atomic else triton.cdiv(14336, cfg.bi)) * 4096, device="cuda")
    fused_mlp_triton(x, gate_up, down, residual, eps=1e-5, partials=scratch, config=cfg)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused_mlp_triton(x, gate_up, down, residual, eps=1e-5, partials=scratch, config=cfg)
    x.copy_(rand(1, 4096, device="cuda", dtype=torch.bfloat16, scale=3.0))
    graph.replay()
    act, _ = gemv_triton(x, gate_up, silu_mul=True, norm_folded=True, eps=1e-5)
    two = gemv_triton(act, down, add=residual)[0]
    torch.testing.assert_close(out.float(), two.float(), atol=TOLERANCE[torch.bfloat16], rtol=TOLERANCE[torch.bfloat16])


@pytest.mark.skipif(INTERPRET, reason="this is the interpreter run itself")
def test_fused_mlp_under_triton_interpreter() -> None:
    run_under_interpreter(__file__)
