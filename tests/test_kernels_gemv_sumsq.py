"""Carried sums of squares (engine/kernels/gemv.py: gemv_add_sumsq_triton -> sumsq_partials): the o_proj / down
GEMV leaves per-program partial sums of squares of the rows it writes, and the next GEMV's folded prologue norm
reads them after its weight stream instead of re-reading x for its rms before it.

Runs like tests/test_kernels_gemv.py: fp32/fp16 on the CPU under TRITON_INTERPRET=1 (the driver at the bottom
re-runs this file so), bf16/fp16/fp32 on CUDA (marked gpu); plus an sm_90 compile of the new flags (no GPU).
"""
from __future__ import annotations

from typing import Any

import pytest
import torch

triton = pytest.importorskip("triton")
from kernel_harness import INTERPRET, TOLERANCE, cases, run_under_interpreter  # noqa: E402
from stoker.engine.kernels import gemv, rope_cos_sin  # noqa: E402
from stoker.engine.kernels.gemv import (  # noqa: E402
    GEMV_MAX_M,
    GemvConfig,
    fold_norm_weight,
    gemv_add_sumsq_triton,
    gemv_ref,
    gemv_rotary_cache_ref,
    gemv_rotary_cache_triton,
    gemv_triton,
)

CASES = cases()
K, N = 200, 72  # neither a power of two: several BLOCK_K slices, masked tails
PATHS = [(1, None), (3, None), (7, GemvConfig(16, 16, 64, True, 4, 2))]  # (M, config): CUDA cores, then tl.dot


def rand(*shape: int, device: str, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, device=device) * scale).to(dtype)


def close_to_truth(actual: torch.Tensor, ref: torch.Tensor, truth: torch.Tensor, dtype: torch.dtype) -> None:
    """Within twice the reference's own error from the float64 truth (plus the dtype's tolerance)."""
    ref_err = (ref.double() - truth).abs().max().item()
    torch.testing.assert_close(actual.double(), truth, atol=TOLERANCE[dtype] + 2 * ref_err, rtol=TOLERANCE[dtype])


def _producer(num_rows: int, device: str, dtype: torch.dtype, cfg: GemvConfig | None) -> tuple[torch.Tensor, ...]:
    """o_proj-like: stream = a @ Wo^T + residual, with its partials; the residual's rms is far from 1."""
    a = rand(num_rows, N, device=device, dtype=dtype)
    wo = rand(K, N, device=device, dtype=dtype, scale=N**-0.5)
    residual = rand(num_rows, K, device=device, dtype=dtype, scale=3.0)
    stream, partials = gemv_add_sumsq_triton(a, wo, residual, config=cfg)
    return a, wo, residual, stream, partials


@pytest.mark.parametrize("device,dtype", CASES)
@pytest.mark.parametrize("num_rows,cfg", PATHS)
def test_partials_sum_to_each_rows_squares_as_stored(device: str, dtype: torch.dtype, num_rows: int,
                                                     cfg: GemvConfig | None) -> None:
    a, wo, residual, stream, partials = _producer(num_rows, device, dtype, cfg)
    plain, _ = gemv_triton(a, wo, add=residual, config=cfg)
    assert torch.equal(stream, plain)  # the same output: the partials are written beside it
    assert partials.dtype == torch.float32 and partials.shape[1] == GEMV_MAX_M
    want = (stream.float() ** 2).sum(dim=1)
    torch.testing.assert_close(partials.sum(dim=0)[:num_rows], want, rtol=1e-5, atol=1e-5)


@pytest.fixture(params=[False, True], ids=["late", "early"])
def partials_load(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> bool:
    """Both ways the consumer reads the partials: after its weight stream, or loaded before it."""
    monkeypatch.setattr(gemv, "CARRIED_SUMSQ_EARLY", request.param)
    return bool(request.param)


@pytest.mark.parametrize("device,dtype", CASES)
@pytest.mark.parametrize("num_rows,cfg", PATHS)
@pytest.mark.usefixtures("partials_load")
def test_folded_silu_gemv_on_carried_partials_matches_the_reference(device: str, dtype: torch.dtype,
                                                                     num_rows: int, cfg: GemvConfig | None) -> None:
    """o_proj -> gate_up: the SiLU GEMV with the norm folded, its rms from o_proj's partials."""
    *_, stream, partials = _producer(num_rows, device, dtype, cfg)
    w = rand(2 * 45, K, device=device, dtype=dtype, scale=K**-0.5)
    g = rand(K, device=device, dtype=dtype) + 1
    out, _ = gemv_triton(stream, fold_norm_weight(w, g), silu_mul=True, norm_folded=True, eps=1e-5,
                         sumsq_partials=partials, config=cfg)
    ref, _ = gemv_ref(stream, w, norm_weight=g, eps=1e-5, silu_mul=True)
    truth, _ = gemv_ref(stream.double(), w.double(), norm_weight=g.double(), eps=1e-5, silu_mul=True)
    close_to_truth(out, ref, truth, dtype)


@pytest.mark.parametrize("device,dtype", CASES)
@pytest.mark.parametrize("num_rows", [1, 5])
@pytest.mark.usefixtures("partials_load")
def test_folded_rotary_gemv_on_carried_partials_matches_the_reference(device: str, dtype: torch.dtype,
                                                                       num_rows: int) -> None:
    """down -> the next layer's qkv: rotary + KV write with the folded norm's rms from down's partials."""
    hq, hkv, head_dim, block_size, num_blocks = 4, 2, 40, 8, 4
    *_, stream, partials = _producer(num_rows, device, dtype, None)
    n_total = (hq + 2 * hkv) * head_dim
    w = rand(n_total, K, device=device, dtype=dtype, scale=K**-0.5)
    g = rand(K, device=device, dtype=dtype) + 1
    caches = [rand(num_blocks, block_size, hkv, head_dim, device=device, dtype=dtype) for _ in range(2)]
    ref_caches = [c.clone() for c in caches]
    common: dict[str, Any] = dict(num_heads=hq, num_kv_heads=hkv, cos_sin=rope_cos_sin(head_dim, 256, 10000.0, None,
                                  device=device), positions=torch.randint(0, 256, (num_rows,), device=device),
                                  slot_mapping=torch.randperm(num_blocks * block_size, device=device)[:num_rows],
                                  eps=1e-5)
    out, _ = gemv_rotary_cache_triton(stream, fold_norm_weight(w, g), None, k_cache=caches[0], v_cache=caches[1],
                                      norm_folded=True, sumsq_partials=partials, **common)
    ref, _ = gemv_rotary_cache_ref(stream, w, None, k_cache=ref_caches[0], v_cache=ref_caches[1], norm_weight=g,
                                   **common)
    torch.testing.assert_close(out.float(), ref.float(), atol=4 * TOLERANCE[dtype], rtol=4 * TOLERANCE[dtype])
    for got, want in zip(caches, ref_caches, strict=True):
        torch.testing.assert_close(got.float(), want.float(), atol=4 * TOLERANCE[dtype], rtol=4 * TOLERANCE[dtype])


@pytest.mark.parametrize("device,dtype", CASES)
@pytest.mark.usefixtures("partials_load")
def test_the_partials_replace_the_rms_pass(device: str, dtype: torch.dtype) -> None:
    """Partials of 2x the stream (4x its sums of squares) halve the normalised output: the kernel takes its rms
    from them, not from x."""
    *_, stream, _ = _producer(3, device, dtype, None)
    _, doubled = gemv_add_sumsq_triton(torch.zeros(3, N, device=device, dtype=dtype),
                                       torch.zeros(K, N, device=device, dtype=dtype), stream * 2)
    w = rand(N, K, device=device, dtype=dtype, scale=K**-0.5)
    out, _ = gemv_triton(stream, w, norm_folded=True, eps=1e-6, sumsq_partials=doubled)  # rows' rms ~3
    ref, _ = gemv_ref(stream, w, norm_folded=True, eps=1e-6)
    torch.testing.assert_close(out.float(), ref.float() / 2, atol=2 * TOLERANCE[dtype], rtol=2 * TOLERANCE[dtype])


def test_partials_are_refused_where_they_cannot_apply() -> None:
    x = torch.randn(2, K)
    w = torch.randn(N, K)
    good = torch.zeros(5, GEMV_MAX_M)
    with pytest.raises(ValueError, match="with a norm"):
        gemv_triton(x, w, sumsq_partials=good)
    with pytest.raises(ValueError, match="without norm_residual"):
        gemv_triton(x, w, norm_folded=True, norm_residual=x.clone(), sumsq_partials=good)
    with pytest.raises(ValueError, match="float32"):
        gemv_triton(x, w, norm_folded=True, sumsq_partials=torch.zeros(5, GEMV_MAX_M, dtype=torch.float64))
    with pytest.raises(ValueError, match=f"\\[P, {GEMV_MAX_M}\\]"):
        gemv_triton(x, w, norm_folded=True, sumsq_partials=torch.zeros(5, 8))


@pytest.mark.skipif(INTERPRET, reason="compiling for sm_90 needs Triton's JIT, not its interpreter")
@pytest.mark.parametrize("kind,mode", [("add", 0), ("silu", 1), ("rope", 1), ("rope", 2)])
def test_sumsq_flags_compile_for_sm90(kind: str, mode: int) -> None:
    """The producer (ADD + SUMSQ_OUT) and consumer (NORM + SUMSQ_IN) kernels of the 8B batch-1 configs compile
    for the H200 and fit its shared memory (a constexpr global read in the kernel compiles only as such)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    cfg = gemv.gemv_config({"add": "plain", "silu": "silu-norm", "rope": "rope-norm"}[kind], 1,
                           {"add": 4096, "silu": 14336, "rope": 3072}[kind], 4096, True)
    pointers = ("x_ptr", "w_ptr", "out_ptr", "bias_ptr", "norm_ptr", "hres_ptr", "res_out_ptr", "add_ptr",
                "positions_ptr", "cos_sin_ptr", "k_cache_ptr", "v_cache_ptr", "slot_ptr", "q_norm_ptr", "k_norm_ptr",
                "w_scale_ptr")
    sig = {name: "*bf16" for name in pointers}
    sig.update(positions_ptr="*i64", slot_ptr="*i64", cos_sin_ptr="*fp32", w_scale_ptr="*fp32", eps="fp32",
               sumsq_out_ptr="*fp32", sumsq_in_ptr="*fp32", num_partials="i32")
    sig.update({n: "i32" for n in ("M", "N_OUT", "K", "x_stride", "w_stride", "out_stride", "hres_stride",
                                   "res_out_stride", "add_stride", "NUM_Q_HEADS", "NUM_KV_HEADS")})
    block_k = min(cfg.block_k, max(32, 4096 // cfg.block_n)) if kind == "rope" else cfg.block_k
    constexprs = dict(BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=block_k, USE_DOT=cfg.use_dot,
                      DOT_PRECISION="tf32", NORM=kind != "add", PRO_RESIDUAL=False, APPLY_G=False, HAS_BIAS=False,
                      SILU_MUL=kind == "silu", ADD=kind == "add", ROTARY=kind == "rope", QK_NORM=False, HALF=64,
                      SPLITS_PER_HEAD=8, PAIRED=kind != "add", USE_PDL=False,
                      NORM_CHUNK=gemv.norm_chunk(4096, cfg.num_warps, True), W_SCALED=False, W_CONVERT=0,
                      EARLY_W=False, SUMSQ_OUT=kind == "add", SUMSQ_IN=0 if kind == "add" else mode,
                      PARTIALS_P2=256)
    sig.update({name: "constexpr" for name in constexprs})
    try:
        kernel = triton.compile(ASTSource(gemv._gemv_kernel, sig, constexprs=constexprs),
                                target=GPUTarget("cuda", 90, 32),
                                options={"num_warps": cfg.num_warps, "num_stages": cfg.num_stages})
    except RuntimeError as e:  # no ptxas in this triton install
        if "ptxas" in str(e).lower():
            pytest.skip(f"no ptxas for sm_90 here: {e}")
        raise
    assert kernel.metadata.shared <= 232_448


@pytest.mark.slow
@pytest.mark.skipif(INTERPRET, reason="this is the interpreter run itself")
def test_gemv_sumsq_under_triton_interpreter() -> None:
    run_under_interpreter(__file__)
