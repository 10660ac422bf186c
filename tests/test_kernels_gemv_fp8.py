"""The fused decode GEMVs (engine/kernels/gemv.py) with FP8 weights (issue 14 part 2): E4M3 [N, K] and one
float32 scale per output row, the scale applied to the float32 sums before the norm, bias, SiLU-mul, residual
add, rotary and KV-cache write. Against the plain-torch reference (gemv_ref with weight_scale: the weight
dequantized to the activation dtype, then the unfused ops) and the float64 truth of the same chain.

Row magnitudes spread over two decades, so every row has its own scale: a missing scale, or the scale of
another row (the up half of gate | up, the partner row of a rotary pair), is an O(1) error. Runs like
tests/test_kernels_gemv.py: fp32/fp16 under TRITON_INTERPRET=1 (the driver at the bottom), bf16/fp16 on CUDA.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch

triton = pytest.importorskip("triton")
from kernel_harness import INTERPRET, TOLERANCE, cases, run_under_interpreter  # noqa: E402
from stoker.engine.kernels import rope_cos_sin  # noqa: E402
from stoker.engine.kernels.fp8_linear import quantize_rows  # noqa: E402
from stoker.engine.kernels.gemv import (  # noqa: E402
    GemvConfig,
    gemv_ref,
    gemv_rotary_cache_ref,
    gemv_rotary_cache_triton,
    gemv_triton,
)

CASES = cases((torch.bfloat16, torch.float16))
K = 136  # not a power of two: a masked K tail


def fp8_weight(n: int, k: int, device: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(float8 [n, k], float32 row scales [n], the float64 dequantized weight)."""
    rows = torch.randn(n, k) * k**-0.5 * torch.logspace(-1, 1, n)[torch.randperm(n)][:, None]
    w8, scale = quantize_rows(rows)
    return w8.to(device), scale.to(device), w8.double().to(device) * scale.double().to(device)[:, None]


def rand(*shape: int, device: str, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, device=device) * scale).to(dtype)


def close_to_truth(actual: torch.Tensor, ref: torch.Tensor, truth: torch.Tensor, dtype: torch.dtype) -> None:
    """Within twice the reference's own error from the float64 truth plus the dtype's tolerance: the kernel
    scales the float32 sums, the reference rounds the dequantized weight to the dtype first."""
    ref_err = (ref.double() - truth).abs().max().item()
    scale_of = truth.abs().max().item()
    torch.testing.assert_close(actual.double(), truth, atol=TOLERANCE[dtype] * scale_of + 2 * ref_err,
                               rtol=TOLERANCE[dtype])


# Triton's cast of the float8 tile in every case; the int32-word conversions of fp8_convert.py (PTX on the GPU
# only) on every case on the GPU, on the two epilogue shapes (one and two weight streams) in the interpreter,
# which pays per program and op (the file's interpreter run must stay well inside its driver's timeout).
WORD_CONVERTS = ["bits-join"] if INTERPRET else ["bits-join", "asm-join"]
# CUDA cores (the launcher's shape; runs of 4 and of 16 codes a thread summed in registers, gemv.W_SUM, over a
# masked tail), tl.dot, tl.dot
M_PATHS = [(1, None), (1, GemvConfig(1, 4, 128, False, 1, 1)), (1, GemvConfig(1, 2, 512, False, 1, 2)),
           (1, GemvConfig(16, 16, 64, True, 4, 2)), (5, None)]
FUSIONS = ["plain_bias", "add", "silu_mul", "norm_residual_silu_mul_add"]
FUSION_CONVERTS = [(f, "cast") for f in FUSIONS] + [
    (f, c) for c in WORD_CONVERTS for f in (FUSIONS if not INTERPRET else ["add", "silu_mul"])]


@pytest.mark.parametrize("device,dtype", CASES)
@pytest.mark.parametrize("num_rows,cfg", M_PATHS, ids=["m1", "m1-runs", "m1-runs16", "m1-dot", "m5"])
@pytest.mark.parametrize("fusion,convert", FUSION_CONVERTS)
def test_fp8_gemv_fusion(device: str, dtype: torch.dtype, num_rows: int, cfg: GemvConfig | None, fusion: str,
                         convert: str) -> None:
    silu_mul = "silu_mul" in fusion
    n_total = 2 * 45 if silu_mul else 72
    n_out = n_total // 2 if silu_mul else n_total
    w8, scale, w64 = fp8_weight(n_total, K, device)
    x = rand(num_rows, K, device=device, dtype=dtype)  # outputs up to ~30: SiLU's exp stays in range
    kwargs: dict[str, Any] = {"silu_mul": silu_mul}
    if "norm" in fusion:
        kwargs.update(norm_weight=rand(K, device=device, dtype=dtype) + 1, eps=1e-5,
                      norm_residual=rand(num_rows, K, device=device, dtype=dtype, scale=3.0))
    if "bias" in fusion:
        kwargs["bias"] = rand(n_total, device=device, dtype=dtype)
    if "add" in fusion:
        kwargs["add"] = rand(num_rows, n_out, device=device, dtype=dtype)
    out, s = gemv_triton(x, w8, **kwargs, weight_scale=scale, config=cfg, weight_convert=convert)
    ref, ref_s = gemv_ref(x, w8, **kwargs, weight_scale=scale)
    wide = {k: v.double() if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
    truth, _ = gemv_ref(x.double(), w64, **wide)
    assert out.shape == (num_rows, n_out) and out.dtype == dtype
    close_to_truth(out, ref, truth, dtype)
    if "residual" in fusion:
        torch.testing.assert_close(s, ref_s, rtol=0, atol=0)


@pytest.mark.parametrize("device,dtype", CASES)
@pytest.mark.parametrize("fusion,convert", [("add", "cast"), ("silu_mul", WORD_CONVERTS[-1])])
def test_fp8_gemv_pdl_tiles_before_the_wait(device: str, dtype: torch.dtype, fusion: str, convert: str) -> None:
    """GemvConfig.pdl_tiles on the one-token FP8 loop with run sums (what o_proj takes after the attention): 1-4
    tiles of 128 loaded before the wait (peeled without it on the CPU) give the loop's result bit for bit and the
    truth's within tolerance; K = 520 is four whole tiles and a masked tail of 8 for the loop."""
    torch.manual_seed(5)
    k, silu_mul = 520, fusion == "silu_mul"
    n_total = 2 * 45 if silu_mul else 72
    w8, scale, w64 = fp8_weight(n_total, k, device)
    x = rand(1, k, device=device, dtype=dtype)
    kwargs: dict[str, Any] = {"silu_mul": silu_mul}
    if fusion == "add":
        kwargs["add"] = rand(1, n_total, device=device, dtype=dtype)
    block = GemvConfig(1, 4, 128, False, 1, 1)
    outs = [gemv_triton(x, w8, **kwargs, weight_scale=scale, weight_convert=convert, pdl=True,
                        config=dataclasses.replace(block, pdl_tiles=t))[0] for t in (1, 2, 3, 4)]
    loop = gemv_triton(x, w8, **kwargs, weight_scale=scale, weight_convert=convert, config=block)[0]
    for out in outs:
        torch.testing.assert_close(out, loop, rtol=0, atol=0)
    ref, _ = gemv_ref(x, w8, **kwargs, weight_scale=scale)
    wide = {key: v.double() if isinstance(v, torch.Tensor) else v for key, v in kwargs.items()}
    close_to_truth(outs[-1], ref, gemv_ref(x.double(), w64, **wide)[0], dtype)


@pytest.mark.parametrize("device,dtype", CASES)
@pytest.mark.parametrize("num_rows", [1, 5])
@pytest.mark.parametrize("variant,convert", [("llama", "cast"), ("qwen3_qk_norm_bias", "cast")]
                         + [("llama", c) for c in WORD_CONVERTS] + [("qwen3_qk_norm_bias", "asm-join")] * (not INTERPRET))
def test_fp8_gemv_rotary_cache(device: str, dtype: torch.dtype, num_rows: int, variant: str, convert: str) -> None:
    hq, hkv, head_dim, block_size, num_blocks = 4, 2, 40, 8, 3  # D/2 = 20: not a power of two
    n_total = (hq + 2 * hkv) * head_dim
    w8, scale, w64 = fp8_weight(n_total, K, device)
    x = rand(num_rows, K, device=device, dtype=dtype, scale=2.0)
    cos_sin = rope_cos_sin(head_dim, 256, 10000.0, None, device=device)
    slots = torch.randperm(num_blocks * block_size, device=device)[:num_rows]
    if num_rows > 1:
        slots[1] = -1  # padding: nothing reaches the cache
    caches = [rand(num_blocks, block_size, hkv, head_dim, device=device, dtype=dtype) for _ in range(2)]
    common: dict[str, Any] = {"num_heads": hq, "num_kv_heads": hkv, "slot_mapping": slots, "cos_sin": cos_sin,
                              "positions": torch.randint(1, 256, (num_rows,), device=device),
                              "norm_weight": rand(K, device=device, dtype=dtype) + 1, "eps": 1e-6}
    bias = None
    if variant == "qwen3_qk_norm_bias":
        common["q_norm"] = rand(head_dim, device=device, dtype=dtype, scale=0.25) + 1
        common["k_norm"] = rand(head_dim, device=device, dtype=dtype, scale=0.25) + 1
        bias = rand(n_total, device=device, dtype=dtype)
    k_out, v_out = (c.clone() for c in caches)
    k_ref, v_ref = (c.clone() for c in caches)
    k_true, v_true = (c.double() for c in caches)
    out, _ = gemv_rotary_cache_triton(x, w8, bias, k_cache=k_out, v_cache=v_out, weight_scale=scale,
                                      weight_convert=convert, **common)
    ref, _ = gemv_rotary_cache_ref(x, w8, bias, k_cache=k_ref, v_cache=v_ref, weight_scale=scale, **common)
    wide = {k: v.double() if isinstance(v, torch.Tensor) and v.is_floating_point() and k != "cos_sin" else v
            for k, v in common.items()}
    truth, _ = gemv_rotary_cache_ref(x.double(), w64, None if bias is None else bias.double(), k_cache=k_true,
                                     v_cache=v_true, **wide)
    close_to_truth(out, ref, truth, dtype)
    close_to_truth(k_out, k_ref, k_true, dtype)
    close_to_truth(v_out, v_ref, v_true, dtype)


def _launch_tables() -> list[Any]:
    """fused_decode's FP8 launches: FP8_FUSED_M1 at one token, FP8_FUSED_DOT at five."""
    from stoker.engine.models.fused_decode import FP8_FUSED_DOT, FP8_FUSED_M1

    return ([pytest.param(kernel, cfg, convert, 1, id=f"{kernel}-{n}x{k}-{convert}")
             for (kernel, n, k), (cfg, convert) in sorted(FP8_FUSED_M1.items())]
            + [pytest.param(kernel, cfg, convert, 5, id=f"dot-{kernel}-{convert}")
               for kernel, (cfg, convert) in sorted(FP8_FUSED_DOT.items())])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the one-token table is the GPU's")
@pytest.mark.parametrize("kernel,cfg,convert,num_rows", _launch_tables())
def test_fp8_launch_tables_on_the_gpu(kernel: str, cfg: GemvConfig, convert: str, num_rows: int) -> None:
    """fused_decode's FP8 launch shapes and conversions as the engine calls them (qkv and gate_up with the
    unfolded prologue norm), at small odd shapes against the reference."""
    device, dtype = "cuda", torch.bfloat16
    x = rand(num_rows, K, device=device, dtype=dtype)
    g = rand(K, device=device, dtype=dtype) + 1
    if kernel == "rope":
        hq, hkv, head_dim = 4, 2, 64
        w8, scale, w64 = fp8_weight((hq + 2 * hkv) * head_dim, K, device)
        caches = [rand(3, 8, hkv, head_dim, device=device, dtype=dtype) for _ in range(2)]
        common: dict[str, Any] = {"num_heads": hq, "num_kv_heads": hkv, "norm_weight": g, "eps": 1e-6,
                                  "slot_mapping": torch.tensor([5, -1, 9, 2, 11][:num_rows], device=device),
                                  "positions": torch.arange(num_rows, device=device) + 17,
                                  "cos_sin": rope_cos_sin(head_dim, 256, 10000.0, None, device=device)}
        kv_out, kv_ref = [c.clone() for c in caches], [c.clone() for c in caches]
        kv_true = [c.double() for c in caches]
        out, _ = gemv_rotary_cache_triton(x, w8, None, k_cache=kv_out[0], v_cache=kv_out[1], weight_scale=scale,
                                          weight_convert=convert, config=cfg, **common)
        ref, _ = gemv_rotary_cache_ref(x, w8, None, k_cache=kv_ref[0], v_cache=kv_ref[1], weight_scale=scale, **common)
        wide = {k: v.double() if k == "norm_weight" else v for k, v in common.items()}
        truth, _ = gemv_rotary_cache_ref(x.double(), w64, None, k_cache=kv_true[0], v_cache=kv_true[1], **wide)
        close_to_truth(out, ref, truth, dtype)
        close_to_truth(kv_out[0], kv_ref[0], kv_true[0], dtype)
        return
    kwargs: dict[str, Any] = ({"silu_mul": True, "norm_weight": g, "eps": 1e-5} if kernel == "silu"
                              else {"add": rand(num_rows, 72, device=device, dtype=dtype)})
    w8, scale, w64 = fp8_weight(90 if kernel == "silu" else 72, K, device)
    out, _ = gemv_triton(x, w8, **kwargs, weight_scale=scale, config=cfg, weight_convert=convert)
    ref, _ = gemv_ref(x, w8, **kwargs, weight_scale=scale)
    truth, _ = gemv_ref(x.double(), w64, **{k: v.double() if isinstance(v, torch.Tensor) else v
                                             for k, v in kwargs.items()})
    close_to_truth(out, ref, truth, dtype)


def test_fp8_gemv_refuses_mismatched_scales() -> None:
    w8, scale, _ = fp8_weight(16, 32, "cpu")
    x = torch.randn(1, 32)
    with pytest.raises(ValueError, match="row scales"):
        gemv_ref(x, w8, weight_scale=scale[:8])
    with pytest.raises(ValueError, match="row scales"):
        gemv_ref(x, w8.float(), weight_scale=scale)
    with pytest.raises(ValueError, match="differs from x dtype"):
        gemv_ref(x, w8)


@pytest.mark.skipif(not INTERPRET, reason="the launcher's checks follow its CUDA check: the interpreter run has them")
def test_fp8_gemv_refuses_conversions_it_cannot_run() -> None:
    w8, scale, _ = fp8_weight(16, 32, "cpu")
    x = torch.randn(1, 32)
    with pytest.raises(ValueError, match="is not 'cast'"):
        gemv_triton(x, w8, weight_scale=scale, weight_convert="bits")
    with pytest.raises(ValueError, match="for FP8 weights"):
        gemv_triton(x, torch.randn(16, 32), weight_convert="bits-join")
    w_odd, s_odd, _ = fp8_weight(16, 34, "cpu")
    with pytest.raises(ValueError, match="multiples of 4"):
        gemv_triton(torch.randn(1, 34), w_odd, weight_scale=s_odd, weight_convert="bits-join")


@pytest.mark.slow
@pytest.mark.skipif(INTERPRET, reason="this is the interpreter run itself")
def test_fp8_gemv_under_triton_interpreter() -> None:
    run_under_interpreter(__file__)

