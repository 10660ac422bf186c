"""The FP8 linear kernels (engine/kernels/fp8_linear.py) against their plain-torch reference on odd shapes.

The W8A16 GEMV: cases marked gpu run bf16/fp16 on CUDA; under TRITON_INTERPRET=1 (it handles float8 loads
and the conversion in registers, checked with Triton 3.6) the CPU cases run fp32/fp16, and the driver at the
bottom re-runs this file in an interpreter subprocess, as tests/test_kernels_gemv.py does. The _scaled_mm
path needs FP8 tensor cores: gpu only.
"""
from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")
from kernel_harness import GPU, INTERPRET, NO_CUDA, TOLERANCE, cases, run_under_interpreter  # noqa: E402
from stoker.engine.kernels import fp8_linear  # noqa: E402
from stoker.engine.kernels.fp8_convert import BITS_SCALE, e4m3_bits_ref  # noqa: E402
from stoker.engine.kernels.fp8_linear import (  # noqa: E402
    FP8_DTYPE,
    FP8_GEMV_CONFIGS,
    Fp8GemvConfig,
    fp8_gemv_config,
    fp8_linear_ref,
    gemv_fp8_triton,
    quantize_activations,
    quantize_rows,
    scaled_mm_fp8,
    scaled_mm_quantized,
)

CASES = cases((torch.bfloat16, torch.float16))


def weights(n: int, k: int, block: bool, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    weight, scale = quantize_rows(torch.randn(n, k, device=device))
    if block:  # random per-tile scales, so that a misplaced tile shows
        scale = torch.rand(-(-n // 128), -(-k // 128), device=device) * 0.02 + 0.005
    return weight, scale


@pytest.mark.parametrize("device,dtype", CASES)
@pytest.mark.parametrize("num_rows", [1, 3, 16])
@pytest.mark.parametrize("block", [False, True], ids=["rows", "block"])
@pytest.mark.parametrize("bias", [False, True], ids=["", "bias"])
def test_gemv_fp8_matches_reference(device: str, dtype: torch.dtype, num_rows: int, block: bool, bias: bool) -> None:
    n, k = 200, 300  # neither a power of two nor a multiple of the 128 tile: masked tails in N, K and scales
    weight, scale = weights(n, k, block, device)
    x = torch.randn(num_rows, k, device=device).to(dtype)
    b = torch.randn(n, device=device).to(dtype) if bias else None
    blk = (128, 128) if block else None
    out = gemv_fp8_triton(x, weight, scale, b, blk)
    ref = fp8_linear_ref(x, weight, scale, b, blk)
    scale_of = ref.float().abs().max().item()
    torch.testing.assert_close(out.float() / scale_of, ref.float() / scale_of, atol=TOLERANCE[dtype],
                               rtol=TOLERANCE[dtype])


# Explicit launch shapes beyond the launcher's interpreter pick: the CUDA-core path with block scales (the
# scale applied per element inside the loop), K steps of 256 / 512 that must shrink to the 128-column scale
# tile, several programs along N with a masked last one; small, since the interpreter pays per program.
CONFIGS = [Fp8GemvConfig(4, 16, 256, False, 4, 1), Fp8GemvConfig(16, 64, 512, True, 4, 1),
           Fp8GemvConfig(16, 16, 256, True, 1, 2)]


@pytest.mark.parametrize("device,dtype", CASES)
@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: c.label().replace(" ", "-"))
@pytest.mark.parametrize("block", [False, True], ids=["rows", "block"])
def test_gemv_fp8_configs_match_reference(device: str, dtype: torch.dtype, config: Fp8GemvConfig, block: bool) -> None:
    n, k = 72, 400  # N not a multiple of 16 rows x 64; K spans 4 scale tiles, the last one partial
    weight, scale = weights(n, k, block, device)
    x = torch.randn(3, k, device=device).to(dtype)
    blk = (128, 128) if block else None
    out = gemv_fp8_triton(x, weight, scale, None, blk, config=config)
    ref = fp8_linear_ref(x, weight, scale, None, blk)
    scale_of = ref.float().abs().max().item()
    torch.testing.assert_close(out.float() / scale_of, ref.float() / scale_of, atol=TOLERANCE[dtype],
                               rtol=TOLERANCE[dtype])


@GPU
@NO_CUDA
@pytest.mark.parametrize("config", sorted(set(FP8_GEMV_CONFIGS.values()), key=Fp8GemvConfig.label),
                         ids=lambda c: c.label().replace(" ", "-"))
@pytest.mark.parametrize("block", [False, True], ids=["rows", "block"])
def test_gemv_fp8_table_configs_on_cuda(config: Fp8GemvConfig, block: bool) -> None:
    """Every config the table holds (the GPU picks them by shape, which the small cases above do not reach)
    at each M it may serve, on an odd shape, bf16."""
    n, k = 200, 1000
    weight, scale = weights(n, k, block, "cuda")
    blk = (128, 128) if block else None
    for num_rows in sorted({1, min(3, config.block_m), config.block_m}):
        x = torch.randn(num_rows, k, device="cuda").bfloat16()
        out = gemv_fp8_triton(x, weight, scale, None, blk, config=config)
        ref = fp8_linear_ref(x, weight, scale, None, blk)
        scale_of = ref.float().abs().max().item()
        torch.testing.assert_close(out.float() / scale_of, ref.float() / scale_of, atol=TOLERANCE[torch.bfloat16],
                                   rtol=TOLERANCE[torch.bfloat16])


def test_gemv_fp8_config_table_holds_every_m() -> None:
    """Each table entry (and the lookup for every Llama projection at M = 1..16) can hold its M tokens, so no
    decode step hits the launcher's refusal; the GPU lookup comes from the table, not the fallback."""
    for (cls, m), cfg in FP8_GEMV_CONFIGS.items():
        assert cfg.block_m >= m and (not cfg.use_dot or cfg.block_m == 16), (cls, m, cfg)
    for n, k in [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (3072, 2048), (2048, 8192)]:
        for m in range(1, 17):
            cfg = fp8_gemv_config(n, k, m, True)
            assert cfg.block_m >= m and cfg in FP8_GEMV_CONFIGS.values()
    with pytest.raises(ValueError, match="cannot hold M = 3"):
        gemv_fp8_triton(torch.randn(3, 64), *weights(64, 64, False, "cpu"), config=Fp8GemvConfig(2, 16, 64, False))


def test_gemv_fp8_rejects_bad_inputs() -> None:
    weight, scale = weights(64, 64, False, "cpu")
    with pytest.raises(ValueError, match="M = 17"):
        gemv_fp8_triton(torch.randn(17, 64), weight, scale)
    with pytest.raises(ValueError, match="scale shape"):
        fp8_linear_ref(torch.randn(2, 64), weight, scale[:10])
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        fp8_linear_ref(torch.randn(2, 64), weight.float(), scale)


def test_quantize_rows_round_trip() -> None:
    w = torch.randn(37, 91) * torch.logspace(-3, 2, 37)[:, None]  # rows of very different magnitude
    w[5] = 0
    q, s = quantize_rows(w)
    assert q.dtype == FP8_DTYPE and s.shape == (37,)
    back = q.float() * s[:, None]
    # E4M3: 3 mantissa bits, relative rounding error <= 2^-4 for normal values; the row max is exact-ish.
    assert ((back - w).abs() <= w.abs() * 2**-4 + s[:, None] * 2**-9).all()
    assert back[5].eq(0).all()


@GPU
@NO_CUDA
@pytest.mark.parametrize("num_rows", [1, 16, 17, 64, 301])
@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
def test_dispatch_on_cuda_matches_reference(num_rows: int, static: bool) -> None:
    """fp8_linear on CUDA: the GEMV up to 16 rows, _scaled_mm (FP8 activations) above. The tolerance of the
    latter includes activation quantization: relative Frobenius error under 4% (E4M3 rounding is <= 6.25%
    per element, averaging down over K = 512)."""
    n, k = 384, 512
    weight, scale = weights(n, k, False, "cuda")
    x = torch.randn(num_rows, k, device="cuda", dtype=torch.bfloat16)
    input_scale = (x.float().abs().max() / 448).reshape(1) if static else None
    out = fp8_linear(x, weight, scale, None, None, input_scale)
    ref = fp8_linear_ref(x, weight, scale)
    rel = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
    assert rel < (0.01 if num_rows <= 16 else 0.04), rel
    if num_rows > 16:
        torch.testing.assert_close(out, scaled_mm_fp8(x, weight, scale, None, input_scale))


@GPU
@NO_CUDA
@pytest.mark.parametrize("k", [4096, 14336])
def test_scaled_mm_accumulation_error(k: int) -> None:
    """The engine's _scaled_mm (fast FP8 accumulation, SCALED_MM_FAST_ACCUM) against float32 sums of the same
    FP8 operands: within 5e-3 relative (measured 1.3e-3 at K = 4,096, 2.9e-3 at 14,336), an order below the
    activations' E4M3 rounding that test_dispatch_on_cuda_matches_reference allows."""
    weight, scale = weights(512, k, False, "cuda")
    xq, x_scale = quantize_activations(torch.randn(256, k, device="cuda", dtype=torch.bfloat16), None)
    out = scaled_mm_quantized(xq, x_scale, weight, scale, None, torch.float32)
    exact = (xq.float() * x_scale) @ (weight.float() * scale[:, None]).t()
    rel = ((out - exact).norm() / exact.norm()).item()
    assert rel < 5e-3, rel


def _all_codes() -> torch.Tensor:
    """Every E4M3 code but the two NaNs (0x7F, 0xFF), as uint8."""
    codes = torch.arange(256, dtype=torch.int32)
    return codes[(codes & 0x7F) != 0x7F].to(torch.uint8)


def test_e4m3_bit_trick_is_exact_for_every_code() -> None:
    """The "bits" conversion's statement in torch: value * 2^-8 exactly, normals, subnormals, both zeros."""
    codes = _all_codes()
    want = codes.view(FP8_DTYPE).to(torch.float16)
    got = e4m3_bits_ref(codes)
    assert torch.equal(got.float() * BITS_SCALE, want.float())
    assert torch.equal(torch.signbit(got), torch.signbit(want))  # -0 stays -0


def _every_code_gemv(device: str, dtype: torch.dtype, convert: str) -> None:
    """A weight holding each code once (row r: code r at column r % K), x = ones, scale 1: out[r] is code r's
    value, so any code the conversion maps wrongly shows by row. K = 36: whole int32 words, 9 of them."""
    codes = _all_codes()
    n, k = codes.numel(), 36
    weight = torch.zeros(n, k, dtype=torch.uint8)
    weight[torch.arange(n), torch.arange(n) % k] = codes
    weight = weight.view(FP8_DTYPE).to(device)
    scale = torch.ones(n, device=device)
    x = torch.ones(1, k, device=device, dtype=dtype)
    out = gemv_fp8_triton(x, weight, scale, convert=convert, config=Fp8GemvConfig(1, 32, 16, False, 4, 1))
    want = codes.view(FP8_DTYPE).to(dtype).to(device)[None, :]
    torch.testing.assert_close(out, want, atol=0, rtol=0)


WORD_CONVERTS = ["bits", "bits-join"] if INTERPRET else ["bits", "bits-join", "asm", "asm-join"]


@pytest.mark.parametrize("device,dtype", CASES)
@pytest.mark.parametrize("convert", WORD_CONVERTS)
def test_gemv_fp8_word_conversions_are_exact_for_every_code(device: str, dtype: torch.dtype, convert: str) -> None:
    _every_code_gemv(device, dtype, convert)


@pytest.mark.parametrize("device,dtype", CASES)
@pytest.mark.parametrize("convert", WORD_CONVERTS)
@pytest.mark.parametrize("num_rows", [1, 3])
@pytest.mark.parametrize("bias", [False, True], ids=["", "bias"])
def test_gemv_fp8_word_conversions_match_reference(device: str, dtype: torch.dtype, convert: str, num_rows: int,
                                                   bias: bool) -> None:
    """Odd N and a K that is whole words but not whole K steps (the masked last words), several programs."""
    n, k = 45, 212
    weight, scale = weights(n, k, False, device)
    x = torch.randn(num_rows, k, device=device).to(dtype)
    b = torch.randn(n, device=device).to(dtype) if bias else None
    cfg = Fp8GemvConfig(triton.next_power_of_2(num_rows), 16, 64, False, 4, 1)
    out = gemv_fp8_triton(x, weight, scale, b, config=cfg, convert=convert)
    ref = fp8_linear_ref(x, weight, scale, b)
    scale_of = ref.float().abs().max().item()
    torch.testing.assert_close(out.float() / scale_of, ref.float() / scale_of, atol=TOLERANCE[dtype],
                               rtol=TOLERANCE[dtype])


def test_gemv_fp8_word_conversions_refuse_what_they_cannot_run() -> None:
    weight, scale = weights(64, 64, False, "cpu")
    x = torch.randn(1, 64)
    with pytest.raises(ValueError, match="not one of"):
        gemv_fp8_triton(x, weight, scale, convert="fast")
    with pytest.raises(ValueError, match="CUDA cores only"):
        gemv_fp8_triton(x, weight, scale, convert="bits", config=Fp8GemvConfig(16, 16, 64, True))
    block_scale = torch.ones(1, 1)
    with pytest.raises(ValueError, match="row scales only"):
        gemv_fp8_triton(x, weight, block_scale, None, (128, 128), convert="bits")
    odd, odd_scale = weights(8, 66, False, "cpu")
    with pytest.raises(ValueError, match="whole int32 words"):
        gemv_fp8_triton(torch.randn(1, 66), odd, odd_scale, convert="bits")


@pytest.mark.slow
@pytest.mark.skipif(INTERPRET, reason="this is the interpreter run itself")
def test_gemv_fp8_under_triton_interpreter() -> None:
    run_under_interpreter(__file__)
