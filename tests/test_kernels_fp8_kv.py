"""The Triton kernels' FP8 KV cache variants (FP8_CACHE constexpr) against their plain-torch references.

Runs like test_kernels.py: on CUDA (marked gpu) in bf16/fp16/fp32, and on the CPU under TRITON_INTERPRET=1
(fp32/fp16) through the driver at the bottom. What the interpreter can check (triton 3.6):
- float8_e4m3fn loads and their conversion to fp16/fp32 are exact there, so both attention kernels' FP8
  variants run on random caches under it;
- its float32 -> float8 store is not the GPU's: `_convert_float` drops the carry when a mantissa rounds up
  past a power of two (7.92 is stored as 4, not 8; 87 of 4096 random values differed). So on the CPU the
  cache write is checked on values that need no rounding (e4m3 numbers times a power-of-two scale, at
  position 0 where rotary is the identity), which still tests the scale division, saturation and addressing
  bit for bit; random values and positions, i.e. the rounding itself, are checked on the GPU only.
"""
from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")
from kernel_harness import GPU, INTERPRET, NO_CUDA, cases, close, run_under_interpreter  # noqa: E402
from stoker.engine.kernels import (  # noqa: E402  (after the interpreter fix above)
    paged_attention_ref,
    paged_attention_triton,
    paged_decode_attention_ref,
    paged_decode_attention_triton,
    rope_cos_sin,
    rotary_and_cache_ref,
    rotary_and_cache_triton,
)
from stoker.engine.kernels._triton import tl  # noqa: E402
from stoker.engine.kernels.kv_fp8_tiles import BITS_UNIT, Fp8AttentionConfig, e4m3_bits_to_f16  # noqa: E402
from stoker.engine.kernels.kv_quant import FP8_KV_DTYPE, quantize_kv  # noqa: E402
from test_kernels import ATTN_SHAPES, paged_batch  # noqa: E402

CASES = cases()
MIXED_SHAPES = [(17, 17), (5, 40), (1, 100), (1, 1), (0, 9), (3, 3), (37, 50)]  # (new queries, context)


def fp8_batch(lens: list[int], hkv: int, head_dim: int, block_size: int, device: str
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """test_kernels.paged_batch's caches (NaN in every slot no sequence may read) quantized with distinct
    scales: NaN stays NaN in e4m3fn, so a kernel reading outside a context still poisons its output."""
    k, v, block_tables = paged_batch(lens, hkv, head_dim, block_size, device, torch.float32)
    k_scale = torch.tensor([0.013], device=device)  # values of about +-3 sit near e4m3's top (448)
    v_scale = torch.tensor([0.31], device=device)
    return quantize_kv(k * 2.0, k_scale), quantize_kv(v, v_scale), block_tables, k_scale, v_scale


@pytest.mark.parametrize("device,dtype", CASES)
@pytest.mark.parametrize("hq,hkv,head_dim,block_size", ATTN_SHAPES)
def test_fp8_paged_attention_mixed_batch(device: str, dtype: torch.dtype, hq: int, hkv: int, head_dim: int,
                                         block_size: int) -> None:
    k8, v8, block_tables, k_scale, v_scale = fp8_batch([c for _, c in MIXED_SHAPES], hkv, head_dim, block_size, device)
    query_start_loc = torch.tensor([0] + [n for n, _ in MIXED_SHAPES], device=device).cumsum(0).to(torch.int32)
    context_lens = torch.tensor([c for _, c in MIXED_SHAPES], dtype=torch.int32, device=device)
    num_real = int(query_start_loc[-1])
    q = torch.randn(num_real + 3, hq, head_dim, device=device, dtype=dtype)  # 3 rows of batch padding
    args = (q, k8, v8, block_tables, query_start_loc, context_lens, head_dim**-0.5, k_scale, v_scale)
    out, ref = paged_attention_triton(*args), paged_attention_ref(*args)
    assert out.dtype == dtype and ref[:num_real].abs().max() > 0.1
    close(out[:num_real], ref[:num_real], dtype)
    assert torch.equal(out[num_real:], torch.zeros_like(out[num_real:]))


@pytest.mark.parametrize("device,dtype", CASES)
@pytest.mark.parametrize("hq,hkv,head_dim,block_size", ATTN_SHAPES)
@pytest.mark.parametrize("num_splits", [None, 1, 3])
def test_fp8_paged_decode_attention(device: str, dtype: torch.dtype, hq: int, hkv: int, head_dim: int,
                                    block_size: int, num_splits: int | None) -> None:
    lens = [1, 17, 100, 33]
    k8, v8, block_tables, k_scale, v_scale = fp8_batch(lens, hkv, head_dim, block_size, device)
    context_lens = torch.tensor(lens, dtype=torch.int32, device=device)
    q = torch.randn(len(lens), hq, head_dim, device=device, dtype=dtype)
    out = paged_decode_attention_triton(q, k8, v8, block_tables, context_lens, 0.1, num_splits,
                                        k_scale=k_scale, v_scale=v_scale)
    ref = paged_decode_attention_ref(q, k8, v8, block_tables, context_lens, 0.1, k_scale, v_scale)
    close(out, ref, dtype)


# The FP8 cache's other conversions (kv_fp8_tiles.py). Small: one shape each, so the interpreter run stays short.
MODE_CASES = [Fp8AttentionConfig("f16"), Fp8AttentionConfig("bits"), Fp8AttentionConfig("f16", 128, 8, 2),
              Fp8AttentionConfig("f16-vwords"),  # the interpreter converts its words' bytes by cast, not PTX
              pytest.param(Fp8AttentionConfig("f16-vwords", 128, 8, 3), marks=[GPU, NO_CUDA]),
              pytest.param(Fp8AttentionConfig("f16-vwords", 128, 4, 3), marks=[GPU, NO_CUDA])]  # the default
MODE_IDS = ["f16", "bits", "f16-n128-w8-s2", "f16-vwords", "f16-vwords-n128-w8", "f16-vwords-n128-w4"]


@pytest.mark.parametrize("device,dtype", CASES)
@pytest.mark.parametrize("config", MODE_CASES, ids=MODE_IDS)
def test_fp8_decode_attention_modes(device: str, dtype: torch.dtype, config: Fp8AttentionConfig) -> None:
    lens = [1, 17, 100, 33]
    k8, v8, block_tables, k_scale, v_scale = fp8_batch(lens, 2, 40, 8, device)
    context_lens = torch.tensor(lens, dtype=torch.int32, device=device)
    q = torch.randn(len(lens), 6, 40, device=device, dtype=dtype)
    for num_splits in (1, 3):
        out = paged_decode_attention_triton(q, k8, v8, block_tables, context_lens, 0.1, num_splits,
                                            k_scale=k_scale, v_scale=v_scale, fp8_config=config)
        close(out, paged_decode_attention_ref(q, k8, v8, block_tables, context_lens, 0.1, k_scale, v_scale), dtype)


@pytest.mark.parametrize("device,dtype", CASES)
@pytest.mark.parametrize("config", MODE_CASES, ids=MODE_IDS)
def test_fp8_paged_attention_modes(device: str, dtype: torch.dtype, config: Fp8AttentionConfig) -> None:
    shapes = [(17, 17), (5, 40), (1, 1), (0, 9)]
    k8, v8, block_tables, k_scale, v_scale = fp8_batch([c for _, c in shapes], 2, 40, 8, device)
    query_start_loc = torch.tensor([0] + [n for n, _ in shapes], device=device).cumsum(0).to(torch.int32)
    context_lens = torch.tensor([c for _, c in shapes], dtype=torch.int32, device=device)
    q = torch.randn(int(query_start_loc[-1]), 6, 40, device=device, dtype=dtype)
    args = (q, k8, v8, block_tables, query_start_loc, context_lens, 40**-0.5, k_scale, v_scale)
    close(paged_attention_triton(*args, fp8_config=config), paged_attention_ref(*args), dtype)


@GPU
@NO_CUDA
def test_fp8_f16_dots_clamp_bf16_queries_beyond_fp16() -> None:
    """bf16 q past fp16's range (the 'f16' mode casts q to fp16): clamped, so the output stays finite and equals
    the reference run on the clamped q."""
    lens = [40, 9]
    k8, v8, block_tables, k_scale, v_scale = fp8_batch(lens, 2, 64, 16, "cuda")
    context_lens = torch.tensor(lens, dtype=torch.int32, device="cuda")
    q = torch.randn(2, 6, 64, device="cuda", dtype=torch.bfloat16)
    q[0, 0, 3] = 2.0e5
    out = paged_decode_attention_triton(q, k8, v8, block_tables, context_lens, 1e-4, k_scale=k_scale,
                                        v_scale=v_scale, fp8_config=Fp8AttentionConfig("f16"))
    clamped = q.float().clamp(-65504, 65504).to(torch.bfloat16)
    ref = paged_decode_attention_ref(clamped, k8, v8, block_tables, context_lens, 1e-4, k_scale, v_scale)
    assert torch.isfinite(out).all()
    close(out, ref, torch.bfloat16)


@triton.jit
def _bits_to_f16_kernel(codes_ptr, out_ptr):
    offs = tl.arange(0, 256)
    tl.store(out_ptr + offs, e4m3_bits_to_f16(tl.load(codes_ptr + offs)))


@pytest.mark.skipif(not INTERPRET and not torch.cuda.is_available(), reason="needs the interpreter or CUDA")
def test_e4m3_bit_trick_on_all_256_codes() -> None:
    """kv_fp8_tiles.e4m3_bits_to_f16 gives every finite e4m3fn code's value times 2^-8 exactly (normals,
    subnormals, +-0, +-448), and the two NaN codes +-480 * 2^-8 (documented there). The interpreter runs it
    on the CPU; on a GPU machine the same kernel runs compiled."""
    device = "cuda" if torch.cuda.is_available() and not INTERPRET else "cpu"
    codes = torch.arange(256, dtype=torch.int32, device=device).to(torch.uint8)
    out = torch.empty(256, dtype=torch.float16, device=device)
    _bits_to_f16_kernel[(1,)](codes, out)
    values = codes.view(FP8_KV_DTYPE).float()
    nan = values.isnan()
    assert int(nan.sum()) == 2
    assert torch.equal(out[~nan].float() * BITS_UNIT, values[~nan])
    assert torch.equal(torch.signbit(out[~nan]), torch.signbit(values[~nan]))  # -0 stays -0
    assert out[nan].float().abs().tolist() == [480 / BITS_UNIT] * 2


def _write_both(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                k_scale: torch.Tensor, v_scale: torch.Tensor, block_size: int
                ) -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    """The cache write into two FP8 caches (pre-filled with 1.0: untouched slots must stay so): the Triton
    kernel's and the reference's. Returns ((k, v) kernel, (k, v) reference)."""
    device, (_, hkv, head_dim) = q.device, k.shape
    cos_sin = rope_cos_sin(head_dim, 64, 10000.0, None, device=device)
    shape = (8, block_size, hkv, head_dim)
    caches = [torch.ones(shape, device=device).to(FP8_KV_DTYPE) for _ in range(4)]
    rotary_and_cache_triton(q.clone(), k.clone(), v.clone(), positions, cos_sin, caches[0], caches[1], slots,
                            k_scale, v_scale)
    rotary_and_cache_ref(q.clone(), k.clone(), v.clone(), positions, cos_sin, caches[2], caches[3], slots,
                         k_scale, v_scale)
    return (caches[0], caches[1]), (caches[2], caches[3])


def _same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8))


@pytest.mark.parametrize("device,dtype", CASES)
@pytest.mark.parametrize("hq,hkv,head_dim", [(6, 2, 64), (4, 4, 40)])
def test_fp8_cache_write_on_values_that_need_no_rounding(device: str, dtype: torch.dtype, hq: int, hkv: int,
                                                         head_dim: int) -> None:
    """Every k and v is an e4m3 number times a power-of-two scale (so x / scale is exact and e4m3-exact), at
    position 0 (rotary is the identity): the stored bytes must be the reference's, with one value saturated."""
    tokens, block_size = 6, 4
    k_scale = torch.tensor([0.25], device=device)
    v_scale = torch.tensor([4.0], device=device)

    def grid(scale: torch.Tensor, *shape: int) -> torch.Tensor:
        x = torch.randn(*shape, device=device) * 8
        x = torch.where(x.abs() < 2**-6, 1.0, x)  # normal e4m3 numbers (the interpreter's subnormals aside)
        e4m3 = x.to(FP8_KV_DTYPE).float()
        return (e4m3 * scale).to(dtype)  # a power of two times a number of 4 significant bits: exact in fp16

    q = torch.randn(tokens, hq, head_dim, device=device, dtype=dtype)
    k, v = grid(k_scale, tokens, hkv, head_dim), grid(v_scale, tokens, hkv, head_dim)
    v[4, -1, 1] = 600 * 4.0  # 600 > 448: saturates (token 4 goes to slot 4)
    positions = torch.zeros(tokens, dtype=torch.int64, device=device)
    slots = torch.tensor([9, 0, 31, -1, 4, 17], device=device)
    (k_out, v_out), (k_ref, v_ref) = _write_both(q, k, v, positions, slots, k_scale, v_scale, block_size)
    assert _same_bytes(k_out, k_ref) and _same_bytes(v_out, v_ref)
    assert v_out.view(-1, hkv, head_dim)[4, -1, 1].float().item() == 448.0
    assert (k_out.view(-1, hkv, head_dim)[slots[slots >= 0]].float() != 1.0).any()  # the write did happen


@GPU
@NO_CUDA
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_fp8_cache_write_rounds_like_torch_on_the_gpu(dtype: torch.dtype) -> None:
    """Random k/v at random positions: the GPU's float32 -> e4m3 conversion (round to nearest even,
    saturating) must store exactly quantize_kv of the k the kernel rotated (left in k: its rotary may round
    differently from torch's, FMA contraction, which test_kernels.py tolerates) and of v. The interpreter
    cannot run this (see above)."""
    tokens, hq, hkv, head_dim, block_size = 9, 6, 2, 64, 4
    q = torch.randn(tokens, hq, head_dim, device="cuda", dtype=dtype)
    k = torch.randn(tokens, hkv, head_dim, device="cuda", dtype=dtype) * 5
    v = torch.randn(tokens, hkv, head_dim, device="cuda", dtype=dtype) * 5
    v[0, 0, :4] = torch.tensor([100.0, -100.0, 3e-5, 0.0])  # saturates at +-448 / a subnormal / zero
    positions = torch.randint(0, 64, (tokens,), device="cuda")
    slots = torch.randperm(8 * block_size, device="cuda")[:tokens]
    slots[2] = -1
    k_scale, v_scale = torch.tensor([0.0421], device="cuda"), torch.tensor([0.0173], device="cuda")
    cos_sin = rope_cos_sin(head_dim, 64, 10000.0, None, device="cuda")
    shape = (8, block_size, hkv, head_dim)
    k8, v8 = torch.zeros(shape, device="cuda").to(FP8_KV_DTYPE), torch.zeros(shape, device="cuda").to(FP8_KV_DTYPE)
    rotated = k.clone()
    rotary_and_cache_triton(q.clone(), rotated, v, positions, cos_sin, k8, v8, slots, k_scale, v_scale)
    keep = slots >= 0
    flat_k, flat_v = k8.view(-1, hkv, head_dim), v8.view(-1, hkv, head_dim)
    assert _same_bytes(flat_k[slots[keep]], quantize_kv(rotated[keep], k_scale))
    assert _same_bytes(flat_v[slots[keep]], quantize_kv(v[keep], v_scale))


@pytest.mark.slow
@pytest.mark.skipif(INTERPRET, reason="this is the interpreter run itself")
def test_fp8_kv_kernels_under_triton_interpreter() -> None:
    run_under_interpreter(__file__)
