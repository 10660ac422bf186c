"""The fused small-M GEMV (engine/kernels/gemv.py) against its plain-torch reference, one fusion per case, on
odd shapes (K and N not powers of two, M in {1, 3, 7}), fresh random inputs, tolerances tied to the dtype.

Runs like tests/test_kernels.py: cases marked gpu run bf16/fp16/fp32 on CUDA; under TRITON_INTERPRET=1 the
CPU cases run fp32/fp16, and the driver at the bottom re-runs this file in an interpreter subprocess.
Both of the kernel's multiply paths are exercised (CUDA-core broadcast-and-sum, tensor-core tl.dot). The qkv
kernel's FP8 cache write runs on values that need no rounding everywhere (the interpreter's float32 -> float8
cast drops a carry) and on random values on the GPU.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch

triton = pytest.importorskip("triton")
from kernel_harness import (  # noqa: E402
    GPU,
    INTERPRET,
    NO_CUDA,
    TOLERANCE,
    cases,
    close,
    run_under_interpreter,
)
from stoker.engine.kernels import fused_linear, rope_cos_sin  # noqa: E402
from stoker.engine.kernels.gemv import (  # noqa: E402
    GEMV_MAX_M,
    NORM_SUM_UNIT,
    GemvConfig,
    NormCarryOut,
    fold_norm_weight,
    gemv_carried_ref,
    gemv_config,
    gemv_ref,
    gemv_rotary_cache_ref,
    gemv_rotary_cache_triton,
    gemv_triton,
    norm_sums_buffer,
)
from stoker.engine.kernels.kv_quant import FP8_KV_DTYPE, quantize_kv  # noqa: E402

CASES = cases()

# (M, path): "auto" is the launcher's own choice (CUDA cores for small M, tl.dot above), "dot" forces the
# 16-row tensor-core tile, "cores" forces the CUDA-core path at a small block.
M_PATHS = [(1, "auto"), (1, "dot"), (3, "auto"), (7, "auto")]
if not INTERPRET:
    M_PATHS += [(3, "cores"), (16, "auto")]
K, N = 200, 72  # neither a power of two; K spans several BLOCK_K slices and a masked tail


def close_to_truth(actual: torch.Tensor, ref: torch.Tensor, truth: torch.Tensor, dtype: torch.dtype) -> None:
    """actual within twice the reference's own worst error from the float64 truth (plus the dtype's
    tolerance): for chains of roundings where the kernel and the reference round at different points."""
    ref_err = (ref.double() - truth).abs().max().item()
    torch.testing.assert_close(actual.double(), truth, atol=TOLERANCE[dtype] + 2 * ref_err, rtol=TOLERANCE[dtype])


def config(path: str, num_rows: int) -> GemvConfig | None:
    if path == "dot":
        return GemvConfig(16, 16, 64, True, 4, 2)
    if path == "cores":
        return GemvConfig(triton.next_power_of_2(num_rows), 8, 64, False, 4, 2)
    return None


def rand(*shape: int, device: str, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, device=device) * scale).to(dtype)


# ------------------------------------------------------------------------------------------ the fusions
FUSIONS = ["plain", "norm", "norm_residual", "bias", "silu_mul", "add", "norm_residual_silu_mul_add",
           "norm_folded", "norm_folded_silu_mul"]


@pytest.mark.parametrize("device,dtype", CASES)
@pytest.mark.parametrize("num_rows,path", M_PATHS)
@pytest.mark.parametrize("fusion", FUSIONS)
def test_gemv_fusion(device: str, dtype: torch.dtype, num_rows: int, path: str, fusion: str) -> None:
    silu_mul = "silu_mul" in fusion
    n_total = 2 * 45 if silu_mul else N  # I = 45: odd
    n_out = n_total // 2 if silu_mul else n_total
    wide = rand(num_rows, K + 24, device=device, dtype=dtype, scale=3.0)
    x = wide[:, :K]  # a row stride != K must be honoured; rms far from 1 so a missing norm shows
    weight = rand(n_total, K, device=device, dtype=dtype, scale=K**-0.5)
    kwargs: dict[str, Any] = {"silu_mul": silu_mul}
    if "norm" in fusion:
        kwargs["norm_weight"] = rand(K, device=device, dtype=dtype) + 1
        kwargs["eps"] = 1e-5
    if "residual" in fusion:
        kwargs["norm_residual"] = rand(num_rows, K, device=device, dtype=dtype, scale=3.0)
    if "bias" in fusion:
        kwargs["bias"] = rand(n_total, device=device, dtype=dtype)
    if "add" in fusion:
        kwargs["add"] = rand(num_rows, n_out, device=device, dtype=dtype)
    if "folded" in fusion:  # the kernel gets W diag(g), the reference the original W and g
        fast = {**kwargs, "norm_weight": None, "norm_folded": True}
        out, s = gemv_triton(x, fold_norm_weight(weight, kwargs["norm_weight"]), **fast,
                             config=config(path, num_rows))
    else:
        out, s = gemv_triton(x, weight, **kwargs, config=config(path, num_rows))
    ref, ref_s = gemv_ref(x, weight, **kwargs)
    assert out.shape == (num_rows, n_out) and out.dtype == dtype
    # bf16 SiLU-mul outputs reach ~10 before the add rounds them (half an ulp: 0.03), so compare against the
    # float64 truth of the same chain, within twice the reference's own error (see close_to_truth).
    wide = {k: v.double() if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
    truth, _ = gemv_ref(x.double(), weight.double(), **wide)
    close_to_truth(out, ref, truth, dtype)
    if "residual" in fusion:  # written once, rounded exactly like torch's `x + residual`, into a new buffer
        torch.testing.assert_close(s, ref_s, rtol=0, atol=0)
        assert s.data_ptr() not in (x.data_ptr(), kwargs["norm_residual"].data_ptr())
    else:
        assert s is x


@pytest.mark.parametrize("device,dtype", CASES)
def test_gemv_norm_is_per_row(device: str, dtype: torch.dtype) -> None:
    # Rows of very different scale: the prologue must normalise each token by its own rms.
    x = rand(3, K, device=device, dtype=dtype) * torch.tensor([[0.01], [1.0], [30.0]], device=device).to(dtype)
    weight = rand(N, K, device=device, dtype=dtype, scale=K**-0.5)
    norm_weight = rand(K, device=device, dtype=dtype)
    out, _ = gemv_triton(x, weight, norm_weight=norm_weight, eps=1e-6)
    ref, _ = gemv_ref(x, weight, norm_weight=norm_weight, eps=1e-6)
    close(out, ref, dtype)


# ------------------------------------------------------------------------------ rotary + KV-cache write
ROPE_SHAPES = [(6, 2, 64, 8), (4, 2, 80, 16)]  # Hq, Hkv, D (D/2 = 40: not a power of two), block_size


@pytest.mark.parametrize("device,dtype", CASES)
@pytest.mark.parametrize("hq,hkv,head_dim,block_size", ROPE_SHAPES)
@pytest.mark.parametrize("num_rows", [1, 7])
@pytest.mark.parametrize("variant", ["llama", "llama_folded", "qwen2_bias_residual", "qwen3_qk_norm", "qwen2_bias_carried"])
def test_gemv_rotary_cache(
    device: str, dtype: torch.dtype, hq: int, hkv: int, head_dim: int, block_size: int,
    num_rows: int, variant: str,
) -> None:
    hidden, num_blocks = 136, 4
    n_total = (hq + 2 * hkv) * head_dim
    x = rand(num_rows, hidden, device=device, dtype=dtype, scale=2.0)
    # Qwen3: q/k come out of the projection with rms ~3, so a missing per-head norm shows; its weights ~1.
    weight_scale = (3.0 if variant == "qwen3_qk_norm" else 1.0) * hidden**-0.5
    weight = rand(n_total, hidden, device=device, dtype=dtype, scale=weight_scale)
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}
    cos_sin = rope_cos_sin(head_dim, 512, 500000.0, scaling, device=device)
    positions = torch.randint(1, 512, (num_rows,), device=device)
    slots = torch.randperm(num_blocks * block_size, device=device)[:num_rows]
    if num_rows > 1:
        slots[1] = -1  # a padding token: its k/v must not reach the cache
    k_cache = rand(num_blocks, block_size, hkv, head_dim, device=device, dtype=dtype)
    v_cache = rand(num_blocks, block_size, hkv, head_dim, device=device, dtype=dtype)
    kwargs: dict[str, Any] = {"norm_weight": rand(hidden, device=device, dtype=dtype), "eps": 1e-6}
    if variant == "qwen2_bias_residual":
        kwargs["bias"] = rand(n_total, device=device, dtype=dtype)
        kwargs["norm_residual"] = rand(num_rows, hidden, device=device, dtype=dtype)
    if variant == "qwen3_qk_norm":
        kwargs["q_norm"] = rand(head_dim, device=device, dtype=dtype, scale=0.25) + 1
        kwargs["k_norm"] = rand(head_dim, device=device, dtype=dtype, scale=0.25) + 1
    common = {"num_heads": hq, "num_kv_heads": hkv, "positions": positions, "cos_sin": cos_sin,
              "slot_mapping": slots, **kwargs}
    bias = common.pop("bias", None)
    ref_k, ref_v, k_cache_init, v_cache_init = k_cache.clone(), v_cache.clone(), k_cache.clone(), v_cache.clone()
    out, s = _rotary_cache_variant(variant, x, weight, bias, k_cache, v_cache, common)
    ref, ref_s = gemv_rotary_cache_ref(x, weight, bias, k_cache=ref_k, v_cache=ref_v, **common)
    # The float64 truth of the same chain: the kernel may round a few ulps differently from the reference
    # (projection, per-head norm, rotation each round), so it must be as close to the truth as the reference.
    wide = {k: v.double() if isinstance(v, torch.Tensor) and v.is_floating_point() and k != "cos_sin" else v
            for k, v in common.items()}
    true_k, true_v = k_cache_init.double(), v_cache_init.double()
    truth, _ = gemv_rotary_cache_ref(x.double(), weight.double(), None if bias is None else bias.double(),
                                     k_cache=true_k, v_cache=true_v, **wide)
    close_to_truth(out, ref, truth, dtype)
    close_to_truth(k_cache, ref_k, true_k, dtype)
    close_to_truth(v_cache, ref_v, true_v, dtype)
    if "norm_residual" in kwargs:
        torch.testing.assert_close(s, ref_s, rtol=0, atol=0)


def carried_norm(s: torch.Tensor, g: torch.Tensor, rows: int = GEMV_MAX_M) -> tuple[torch.Tensor, torch.Tensor]:
    """What a carrying producer leaves for s (NormCarryOut): x = s * g rounded to s's dtype, and each row's sum(s^2) in
    NORM_SUM_UNIT fixed point, spread over the first and last of NORM_SLOTS int64 slots (rows past M zero)."""
    from stoker.engine.kernels import gemv

    sums = norm_sums_buffer(rows, s.device)
    total = (s.double() ** 2).sum(dim=1) * NORM_SUM_UNIT
    if gemv.NORM_SLOTS == 1:
        sums[: s.shape[0], 0] = total.round().long()
    else:  # a third in the first slot, the rest in the last
        sums[: s.shape[0], 0] = (total / 3).round().long()
        last = (gemv.NORM_SLOTS - 1) * gemv.NORM_SLOT_STRIDE
        sums[: s.shape[0], last] = (total - (total / 3).round()).round().long()
    return (s.float() * g.float()).to(s.dtype), sums


# ------------------------------------------------------------------- rotary + an FP8 (float8_e4m3fn) KV cache
# (cos, sin) rotations every float format holds exactly: the identity, the two quarter turns, the half turn
EXACT_ROTATIONS = ((1.0, 0.0), (0.0, 1.0), (0.0, -1.0), (-1.0, 0.0))


def exact_rope_table(head_dim: int, device: str) -> torch.Tensor:
    """A float32 cos | sin table [5, D]: position p < 4 turns every pair (d, d + D/2) by EXACT_ROTATIONS[p], position
    4 each pair by one of them at random. Rotated values need no rounding, yet a kernel that caches k unrotated, swaps
    its halves or pairs the wrong rows stores other numbers."""
    half = head_dim // 2
    pick = torch.cat([torch.arange(4)[:, None].expand(4, half), torch.randint(0, 4, (1, half))])
    table = torch.tensor(EXACT_ROTATIONS)[pick]  # [5, half, (cos, sin)]
    return torch.cat([table[..., 0], table[..., 1]], dim=1).to(device)


def fp8_caches(num_blocks: int, block_size: int, hkv: int, head_dim: int, device: str) -> list[torch.Tensor]:
    """A k and a v float8_e4m3fn cache of random finite codes (the NaN codes replaced by 1.0), so a slot written by
    mistake shows whatever the kernel stored there."""
    codes = torch.randint(0, 256, (2, num_blocks, block_size, hkv, head_dim), dtype=torch.uint8)
    codes[(codes & 0x7F) == 0x7F] = 0x38
    return [c.to(device).view(FP8_KV_DTYPE) for c in codes]


def assert_only_slots_written(cache: torch.Tensor, before: torch.Tensor, slots: torch.Tensor) -> None:
    """Every slot of `cache` but the live tokens' (slot >= 0) still holds `before`'s bytes."""
    flat, old = cache.view(torch.uint8).flatten(0, 1), before.view(torch.uint8).flatten(0, 1)
    kept = torch.ones(flat.shape[0], dtype=torch.bool, device=flat.device)
    kept[slots[slots >= 0]] = False
    assert torch.equal(flat[kept], old[kept]), "the kernel wrote a slot outside the live tokens'"


FP8_CACHE_VARIANTS = ["llama", "qwen2_bias", "qwen3_qk_norm", "fp8_weights"]



def _rotary_cache_variant(variant: str, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                          k_cache: torch.Tensor, v_cache: torch.Tensor, common: dict[str, Any]):
    """gemv_rotary_cache_triton as the decode path runs each variant: "llama_folded" with the norm weight folded
    into W at load time; "qwen2_bias_carried" with the norm carried by the producer before it (x * g and sum(x^2)
    slots); the others with the norm in the prologue (common's norm_weight). -> (out, the residual stream)."""
    if variant == "llama_folded":
        folded = fold_norm_weight(weight, common["norm_weight"])
        return gemv_rotary_cache_triton(x, folded, bias, k_cache=k_cache, v_cache=v_cache,
                                        **{**common, "norm_weight": None, "norm_folded": True})
    if variant == "qwen2_bias_carried":
        xg, sums = carried_norm(x, common["norm_weight"])
        return gemv_rotary_cache_triton(xg, weight, bias, k_cache=k_cache, v_cache=v_cache,
                                        **{**common, "norm_weight": None, "norm_sums": sums})
    return gemv_rotary_cache_triton(x, weight, bias, k_cache=k_cache, v_cache=v_cache, **common)

@pytest.mark.parametrize("device,dtype", CASES)
@pytest.mark.parametrize("hq,hkv,head_dim,block_size", ROPE_SHAPES)
@pytest.mark.parametrize("num_rows", [1, 7])
@pytest.mark.parametrize("variant", FP8_CACHE_VARIANTS)
def test_gemv_rotary_cache_fp8_on_values_that_need_no_rounding(
    device: str, dtype: torch.dtype, hq: int, hkv: int, head_dim: int, block_size: int, num_rows: int, variant: str,
) -> None:
    """The FP8 cache write (the kernel's FP8_CACHE store) against gemv_rotary_cache_ref with the same scales, value for
    value, and no other slot touched. The interpreter's float32 -> float8 cast drops a carry (tests/test_kernels_fp8_kv.py
    says how), so as there every stored value needs no rounding: x one-hot (+-1), weights and bias quarter-integers
    (k and v come out as n / 4 with |n| <= 15, 4 significant bits), scales powers of two, rotations by quarter and half
    turns (exact_rope_table). Qwen3's k rows are +-1/2 in every column, so the per-head norm gives +-1 before its weight
    (eps 2^-40 vanishes against the mean square 1/4 in float32; 0 would make the tl.dot tile's empty rows divide by
    zero, which the interpreter raises). v_scale 2^-7 saturates |n| >= 15 (480 -> 448): one v is forced there. FP8 weights hold the quarter-
    integers over power-of-two row scales. The rounding itself (random values at random positions) is the GPU test's."""
    hidden, num_blocks = 136, 4
    n_total = (hq + 2 * hkv) * head_dim
    q_size, kv_size = hq * head_dim, hkv * head_dim

    def signs(*shape: int) -> torch.Tensor:
        return torch.randint(0, 2, shape) * 2 - 1

    cols = torch.randperm(hidden)[:num_rows]
    x = torch.zeros(num_rows, hidden)
    x[torch.arange(num_rows), cols] = signs(num_rows).float()
    ints = torch.randint(1, 8, (n_total, hidden)) * signs(n_total, hidden)
    ints[q_size + kv_size, cols[0]] = 15  # token 0's first v: past v_scale's range
    if variant == "qwen3_qk_norm":
        ints[q_size : q_size + kv_size] = 2 * signs(kv_size, hidden)
    weight = (ints / 4).to(device, dtype)
    bias = None
    if variant == "qwen2_bias":
        bias = torch.randint(-8, 9, (n_total,)) / 4
        bias[q_size + kv_size] = 0.0  # keeps the forced v at 15 / 4
        bias = bias.to(device, dtype)
    kwargs: dict[str, Any] = {}
    if variant == "qwen3_qk_norm":
        for name in ("q_norm", "k_norm"):
            kwargs[name] = (torch.randint(1, 8, (head_dim,)) * signs(head_dim) / 4).to(device, dtype)
    if variant == "fp8_weights":
        row_scale = 2.0 ** -torch.randint(0, 3, (n_total,)).float()
        kwargs["weight_scale"] = row_scale.to(device)
        weight = (ints / 4 / row_scale[:, None]).to(FP8_KV_DTYPE).to(device)
    slots = torch.randperm(num_blocks * block_size)[:num_rows]
    if num_rows > 1:
        slots[1] = -1  # a padding token: its k/v must not reach the cache
    k_scale, v_scale = torch.tensor([2.0**-4], device=device), torch.tensor([2.0**-7], device=device)
    common = {"num_heads": hq, "num_kv_heads": hkv, "positions": torch.randint(0, 5, (num_rows,)).to(device),
              "cos_sin": exact_rope_table(head_dim, device), "slot_mapping": slots.to(device), "eps": 2.0**-40,
              "k_scale": k_scale, "v_scale": v_scale, **kwargs}
    k_cache, v_cache = fp8_caches(num_blocks, block_size, hkv, head_dim, device)
    k_before, v_before = k_cache.clone(), v_cache.clone()
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    x = x.to(device, dtype)
    out, _ = gemv_rotary_cache_triton(x, weight, bias, k_cache=k_cache, v_cache=v_cache, **common)
    ref, _ = gemv_rotary_cache_ref(x, weight, bias, k_cache=ref_k, v_cache=ref_v, **common)
    close(out, ref, dtype)  # q (Qwen3: normalised, so rounded) within the dtype's tolerance
    torch.testing.assert_close(out[:, q_size:], ref[:, q_size:], rtol=0, atol=0)  # k, v: exact by construction
    assert torch.equal(k_cache.float(), ref_k.float()) and torch.equal(v_cache.float(), ref_v.float())
    assert v_cache.view(-1, hkv, head_dim)[slots[0], 0, 0].float().abs().item() == 448.0  # the forced v, saturated
    assert_only_slots_written(k_cache, k_before, slots)
    assert_only_slots_written(v_cache, v_before, slots)
    assert not torch.equal(k_cache.view(torch.uint8), k_before.view(torch.uint8))  # the write did happen


@GPU
@NO_CUDA
@pytest.mark.parametrize("hq,hkv,head_dim,block_size", ROPE_SHAPES + [(32, 8, 128, 16)])
@pytest.mark.parametrize("num_rows", [1, 5, 16])
@pytest.mark.parametrize("variant", ["llama", "llama_folded", "qwen2_bias_residual", "qwen3_qk_norm",
                                     "qwen2_bias_carried", "fp8_weights"])
def test_gemv_rotary_cache_fp8_matches_the_reference_on_the_gpu(
    hq: int, hkv: int, head_dim: int, block_size: int, num_rows: int, variant: str,
) -> None:
    """bf16, random values at random positions (the real rope table), scales that saturate some values and leave a
    few subnormal: the stored bytes are kv_quant.quantize_kv of the rotated k and of v as the kernel's own qkv
    output holds them, exactly (IEEE division, round to nearest even, saturation: the unfused path's arithmetic);
    against the reference's cache, each value within the two paths' k / v difference (qkv as close to the float64
    truth as the reference: the projection, norms and rotation round at other points, and a small rotated value
    can differ by a bf16 ulp of its inputs: measured, up to 89 e4m3 steps near zero) plus one e4m3 step; no slot
    but the live tokens' written."""
    from stoker.engine.kernels.fp8_linear import quantize_rows

    device, dtype = "cuda", torch.bfloat16
    hidden, num_blocks = 136, 8
    n_total = (hq + 2 * hkv) * head_dim
    q_size, kv_size = hq * head_dim, hkv * head_dim
    x = rand(num_rows, hidden, device=device, dtype=dtype, scale=2.0)
    weight = rand(n_total, hidden, device=device, dtype=dtype,
                  scale=(3.0 if variant == "qwen3_qk_norm" else 1.0) * hidden**-0.5)
    cos_sin = rope_cos_sin(head_dim, 512, 500000.0, None, device=device)
    slots = torch.randperm(num_blocks * block_size, device=device)[:num_rows]
    if num_rows > 1:
        slots[1] = -1
    kwargs: dict[str, Any] = {"norm_weight": rand(hidden, device=device, dtype=dtype), "eps": 1e-6}
    bias = None
    if variant.startswith("qwen2"):
        bias = rand(n_total, device=device, dtype=dtype)
    if variant == "qwen2_bias_residual":
        kwargs["norm_residual"] = rand(num_rows, hidden, device=device, dtype=dtype)
    if variant == "qwen3_qk_norm":
        kwargs["q_norm"] = rand(head_dim, device=device, dtype=dtype, scale=0.25) + 1
        kwargs["k_norm"] = rand(head_dim, device=device, dtype=dtype, scale=0.25) + 1
    if variant == "fp8_weights":
        weight, kwargs["weight_scale"] = (t.to(device) for t in quantize_rows(weight.float().cpu()))
    # Measured on the reference (16 tokens, 5 draws a shape): k and v reach 4-6 (Qwen3's normalised k 12-15), so at
    # these scales 0.02-0.6 % of the values saturate (Qwen3: 4-7 %) and about 1 in 10,000 is subnormal (< 2^-6).
    scales = {"k_scale": torch.tensor([0.008], device=device), "v_scale": torch.tensor([0.011], device=device)}
    common = {"num_heads": hq, "num_kv_heads": hkv, "positions": torch.randint(1, 512, (num_rows,), device=device),
              "cos_sin": cos_sin, "slot_mapping": slots, **kwargs, **scales}
    k_cache, v_cache = fp8_caches(num_blocks, block_size, hkv, head_dim, device)
    k_before, v_before = k_cache.clone(), v_cache.clone()
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    out, _ = _rotary_cache_variant(variant, x, weight, bias, k_cache, v_cache, common)
    ref, _ = gemv_rotary_cache_ref(x, weight, bias, k_cache=ref_k, v_cache=ref_v, **common)
    # the float64 truth of the same chain, on a float64 cache and the dequantized weights
    wide = {k: v.double() if isinstance(v, torch.Tensor) and v.is_floating_point() and k != "cos_sin" else v
            for k, v in common.items() if k not in ("k_scale", "v_scale", "weight_scale")}
    w64 = weight.double() * kwargs["weight_scale"].double()[:, None] if variant == "fp8_weights" else weight.double()
    true_k, true_v = (torch.zeros(k_cache.shape, dtype=torch.float64, device=device) for _ in range(2))
    truth, _ = gemv_rotary_cache_ref(x.double(), w64, None if bias is None else bias.double(), k_cache=true_k,
                                     v_cache=true_v, **wide)
    close_to_truth(out, ref, truth, dtype)
    live = slots >= 0
    for i, (cache, ref_cache, before) in enumerate(((k_cache, ref_k, k_before), (v_cache, ref_v, v_before))):
        scale = scales[("k_scale", "v_scale")[i]]
        cols = slice(q_size + i * kv_size, q_size + (i + 1) * kv_size)
        rows, ref_rows = (t[live, cols].reshape(-1, hkv, head_dim).float() for t in (out, ref))
        stored, ref_stored = (c.view(-1, hkv, head_dim)[slots[live]] for c in (cache, ref_cache))
        assert torch.equal(stored.view(torch.uint8), quantize_kv(rows, scale).view(torch.uint8)), "not quantize_kv"
        # each store is off its input by at most half an e4m3 step (2^-4 relative, 2^-10 * scale among the
        # subnormals), and saturating moves two values no further apart (1.0001: float32's rounding of these sums)
        got, want = stored.float() * scale, ref_stored.float() * scale
        bound = (rows - ref_rows).abs() + 2.0**-3 * torch.maximum(got.abs(), want.abs()) + 2.0**-9 * scale
        assert ((got - want).abs() <= 1.0001 * bound).all(), ((got - want).abs() - bound).max().item()
        assert_only_slots_written(cache, before, slots)


# -------------------------------------------------------------------------------- the carried norm
def producer_inputs(num_rows: int, device: str, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """A carrying producer's operands: x [M, K], o_proj-like W [N, K], the residual [M, N] and the next norm's g."""
    x = rand(num_rows, K, device=device, dtype=dtype)
    w_o = rand(N, K, device=device, dtype=dtype, scale=K**-0.5)
    add = rand(num_rows, N, device=device, dtype=dtype, scale=2.0)
    return x, w_o, add, rand(N, device=device, dtype=dtype) + 1


@pytest.mark.parametrize("device,dtype", CASES)
@pytest.mark.parametrize("num_rows,path", M_PATHS)
@pytest.mark.parametrize("slots, stride, at_end", [(1, 1, False), (4, 16, True)],
                         ids=["1-slot", "4-slots-lines-apart-summed-at-end"])
def test_gemv_carried_norm(device: str, dtype: torch.dtype, num_rows: int, path: str, slots: int, stride: int,
                           at_end: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """The norm carried between two GEMVs (fused_decode.NormCarry): the producer (o_proj / down: the residual add)
    stores out as without the carry, bit for bit, x = out * g, and adds each row's sum(out^2) into the int64 slots
    (fixed point: within a unit a program of the float64 sum), and zeroes the buffer it is given; the consumer
    (gate_up: SiLU-and-mul) on x and those sums equals the norm-then-GEMV reference: in the default layout (one slot a
    token, summed before the weight loop) and with programs spread over several slots a line apart, summed in the
    epilogue (gemv.NORM_SLOTS, NORM_SLOT_STRIDE, NORM_SUMS_AT_END)."""
    from stoker.engine.kernels import gemv

    monkeypatch.setattr(gemv, "NORM_SUMS_AT_END", at_end)
    monkeypatch.setattr(gemv, "NORM_SLOTS", slots)
    monkeypatch.setattr(gemv, "NORM_SLOT_STRIDE", stride)
    torch.manual_seed(5)
    cfg = config(path, num_rows)
    x, w_o, add, g = producer_inputs(num_rows, device, dtype)
    carried_x = torch.full((num_rows, N), float("nan"), device=device, dtype=dtype)
    sums = gemv.norm_sums_buffer(GEMV_MAX_M, device)
    stale = gemv.norm_sums_buffer(GEMV_MAX_M, device) + 7
    out, _ = gemv_triton(x, w_o, add=add, config=cfg, carry=NormCarryOut(g, carried_x, sums), zero_sums=stale)
    plain, _ = gemv_triton(x, w_o, add=add, config=cfg)
    torch.testing.assert_close(out, plain, rtol=0, atol=0)
    torch.testing.assert_close(carried_x, (out.float() * g.float()).to(dtype), rtol=0, atol=0)
    programs = triton.cdiv(N, (cfg or gemv_config("plain", num_rows, N, K, device == "cuda")).block_n)
    total = sums.sum(dim=1).double() / NORM_SUM_UNIT
    torch.testing.assert_close(total[:num_rows], (out.double() ** 2).sum(dim=1), rtol=1e-6,
                               atol=programs / NORM_SUM_UNIT)
    assert not sums[num_rows:].any() and not stale[:, ::stride].any()
    if slots > 1:  # the programs' shares went into several slots
        assert (sums[:num_rows, ::stride] != 0).sum(dim=1).min().item() == min(slots, programs)
    w_gu = rand(2 * 45, N, device=device, dtype=dtype, scale=N**-0.5)
    act, _ = gemv_triton(carried_x, w_gu, silu_mul=True, norm_sums=sums, eps=1e-5, config=cfg)
    ref, _ = gemv_ref(out, w_gu, norm_weight=g, eps=1e-5, silu_mul=True)
    truth, _ = gemv_ref(out.double(), w_gu.double(), norm_weight=g.double(), eps=1e-5, silu_mul=True)
    close_to_truth(act, ref, truth, dtype)
    close(act, gemv_carried_ref(carried_x, w_gu, sums, 1e-5, silu_mul=True), dtype)


@pytest.mark.parametrize("device,dtype", CASES)
@pytest.mark.parametrize("num_rows,path", M_PATHS)
def test_gemv_carried_sums_only(device: str, dtype: torch.dtype, num_rows: int, path: str) -> None:
    """The carried norm's folded form (fused_decode.FOLDED_NORM_CARRY): NormCarryOut(None, None, sums) adds only each
    row's sum(out^2) (out bit for bit as without the carry, no x stored); a consumer whose weights hold g (folded) reads
    out itself with those sums and equals the norm-then-GEMV reference."""
    from stoker.engine.kernels import gemv

    torch.manual_seed(6)
    cfg = config(path, num_rows)
    x, w_o, add, g = producer_inputs(num_rows, device, dtype)
    sums = gemv.norm_sums_buffer(GEMV_MAX_M, device)
    out, _ = gemv_triton(x, w_o, add=add, config=cfg, carry=NormCarryOut(None, None, sums))
    plain, _ = gemv_triton(x, w_o, add=add, config=cfg)
    torch.testing.assert_close(out, plain, rtol=0, atol=0)
    programs = triton.cdiv(N, (cfg or gemv_config("plain", num_rows, N, K, device == "cuda")).block_n)
    torch.testing.assert_close(sums.sum(dim=1).double()[:num_rows] / NORM_SUM_UNIT, (out.double() ** 2).sum(dim=1),
                               rtol=1e-6, atol=programs / NORM_SUM_UNIT)
    w_gu = rand(2 * 45, N, device=device, dtype=dtype, scale=N**-0.5)
    act, _ = gemv_triton(out, fold_norm_weight(w_gu, g), silu_mul=True, norm_sums=sums, eps=1e-5, config=cfg)
    ref, _ = gemv_ref(out, w_gu, norm_weight=g, eps=1e-5, silu_mul=True)
    truth, _ = gemv_ref(out.double(), w_gu.double(), norm_weight=g.double(), eps=1e-5, silu_mul=True)
    close_to_truth(act, ref, truth, dtype)


@pytest.mark.parametrize("device,dtype", CASES)
def test_gemv_carried_norm_rejects_bad_buffers(device: str, dtype: torch.dtype) -> None:
    x = rand(2, K, device=device, dtype=dtype)
    w = rand(N, K, device=device, dtype=dtype)
    add = rand(2, N, device=device, dtype=dtype)
    g = rand(N, device=device, dtype=dtype)
    sums = norm_sums_buffer(GEMV_MAX_M, device)
    carried_x = torch.empty(2, N, device=device, dtype=dtype)
    with pytest.raises(ValueError, match="int64"):
        gemv_triton(x, w, norm_sums=sums.float())
    with pytest.raises(ValueError, match="carried norm; pass no norm_weight"):
        gemv_triton(x, w, norm_sums=sums, norm_weight=rand(K, device=device, dtype=dtype))
    with pytest.raises(ValueError, match="pass add"):
        gemv_triton(x, w, carry=NormCarryOut(g, carried_x, sums))
    with pytest.raises(ValueError, match="carry.x must be"):
        gemv_triton(x, w, add=add, carry=NormCarryOut(g, carried_x[:1], sums))
    with pytest.raises(ValueError, match="carry.norm_weight must be"):
        gemv_triton(x, w, add=add, carry=NormCarryOut(g[:5], carried_x, sums))
    with pytest.raises(ValueError, match="go together"):
        gemv_triton(x, w, add=add, carry=NormCarryOut(g, None, sums))


# ------------------------------------------------ the fused MLP finished by the next qkv (MLP_FINISH_IN_QKV)
# (M, path) as M_PATHS, and "pdl4": four K tiles peeled before the (interpreter: absent) wait, against the loop
PENDING_PATHS = [(1, "auto"), (1, "dot"), (1, "pdl4"), (7, "auto")]
if not INTERPRET:
    PENDING_PATHS += [(3, "cores"), (16, "auto")]


def rope_case(num_rows: int, hkv: int, head_dim: int, block_size: int, device: str, dtype: torch.dtype,
              num_blocks: int = 4) -> dict[str, Any]:
    """A decode step's rotary and cache operands: positions, a llama3-scaled cos | sin table, slots (the second token
    a padding one, slot -1), and random k / v caches."""
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}
    slots = torch.randperm(num_blocks * block_size, device=device)[:num_rows]
    if num_rows > 1:
        slots[1] = -1
    return {"positions": torch.randint(1, 512, (num_rows,), device=device),
            "cos_sin": rope_cos_sin(head_dim, 512, 500000.0, scaling, device=device), "slot_mapping": slots,
            "k_cache": rand(num_blocks, block_size, hkv, head_dim, device=device, dtype=dtype),
            "v_cache": rand(num_blocks, block_size, hkv, head_dim, device=device, dtype=dtype)}


@pytest.mark.parametrize("device,dtype", CASES)
@pytest.mark.parametrize("hq,hkv,head_dim,block_size", ROPE_SHAPES)
@pytest.mark.parametrize("num_rows,path", PENDING_PATHS)
@pytest.mark.parametrize("variant", ["llama", "qwen_bias_qk_norm"])
def test_gemv_rotary_cache_finishes_a_pending_mlp(
    device: str, dtype: torch.dtype, hq: int, hkv: int, head_dim: int, block_size: int, num_rows: int, path: str,
    variant: str,
) -> None:
    """fused_decode.MLP_FINISH_IN_QKV: the qkv GEMV on the previous MLP's float32 accumulator (x_accumulator) and the
    stream it adds to (norm_residual), the norm folded into W. The stream it stores is the finishing kernel's rounding,
    round(round(acc) + r) (fused_mlp_finish_ref), bit for bit; qkv and the caches equal the folded-norm reference on
    that stream (the rms summed in the K loop); the carried slots it is given are zeroed. Then the o_proj GEMV after
    it zeroes the accumulator's first M * H floats (zero_accumulator) and nothing past them, its output as without.
    The accumulator holds values between the dtype's numbers (added unrounded, fp16 stores other bits) and rows far
    from rms 1 (a missing norm shows). "qwen_bias_qk_norm": Qwen2's bias and Qwen3's per-head norm, one program a
    head (another grid: each program still reads all of K, program 0 still stores the stream)."""
    from stoker.engine.kernels.fused_mlp import fused_mlp_finish_ref

    torch.manual_seed(11)
    hidden = 136
    n_total = (hq + 2 * hkv) * head_dim
    qwen = variant == "qwen_bias_qk_norm"
    acc_buf = torch.full((GEMV_MAX_M * hidden,), 5.0, device=device)  # past M * H: never touched
    acc = acc_buf[: num_rows * hidden].view(num_rows, hidden)
    acc.copy_(torch.randn(num_rows, hidden, device=device) * 3)
    r = rand(num_rows, hidden, device=device, dtype=dtype, scale=2.0)
    g = rand(hidden, device=device, dtype=dtype) + 1
    weight = rand(n_total, hidden, device=device, dtype=dtype, scale=(3.0 if qwen else 1.0) * hidden**-0.5)
    bias = rand(n_total, device=device, dtype=dtype) if qwen else None
    case = rope_case(num_rows, hkv, head_dim, block_size, device, dtype)
    caches = {"k_cache": case.pop("k_cache"), "v_cache": case.pop("v_cache")}
    common: dict[str, Any] = {"num_heads": hq, "num_kv_heads": hkv, "eps": 1e-5, **case}
    if qwen:
        common["q_norm"] = rand(head_dim, device=device, dtype=dtype, scale=0.25) + 1
        common["k_norm"] = rand(head_dim, device=device, dtype=dtype, scale=0.25) + 1
    initial = {name: c.clone() for name, c in caches.items()}
    ref_caches = {name: c.clone() for name, c in caches.items()}
    cfg = {"dot": GemvConfig(16, 16, 64, True, 4, 2), "cores": GemvConfig(4, 8, 64, False, 4, 2),
           "pdl4": GemvConfig(1, 8, 64, False, 4, 2, pdl_tiles=4)}.get(path)
    sums = norm_sums_buffer(GEMV_MAX_M, device) + 7  # the slots the unfinished MLP read: to be zeroed
    folded = fold_norm_weight(weight, g)
    pending = {"norm_residual": r, "norm_folded": True, "x_accumulator": True}
    out, s = gemv_rotary_cache_triton(acc, folded, bias, **caches, **common, **pending, zero_sums=sums,
                                      pdl=path == "pdl4", config=cfg)
    ref, ref_s = gemv_rotary_cache_ref(acc, weight, bias, **ref_caches, **common, norm_weight=g, norm_residual=r,
                                       x_accumulator=True)
    assert out.dtype == s.dtype == dtype and s.data_ptr() != r.data_ptr()
    torch.testing.assert_close(s, fused_mlp_finish_ref(acc, r), rtol=0, atol=0)
    torch.testing.assert_close(ref_s, s, rtol=0, atol=0)
    assert not sums.any(), "the slots given as zero_sums were not zeroed"
    # the float64 truth of the rest of the chain, from the stream (exactly defined above)
    wide = {k: v.double() if isinstance(v, torch.Tensor) and v.is_floating_point() and k != "cos_sin" else v
            for k, v in common.items()}
    true_caches = {name: c.double() for name, c in initial.items()}
    truth, _ = gemv_rotary_cache_ref(s.double(), weight.double(), None if bias is None else bias.double(),
                                     **true_caches, **wide, norm_weight=g.double())
    close_to_truth(out, ref, truth, dtype)
    for name in caches:
        close_to_truth(caches[name], ref_caches[name], true_caches[name], dtype)
    if path == "pdl4":  # the peeled tiles take the accumulator as the loop does: the same bits
        loop, loop_s = gemv_rotary_cache_triton(acc, folded, bias, **initial, **common, **pending,
                                                config=dataclasses.replace(cfg, pdl_tiles=1))
        torch.testing.assert_close(out, loop, rtol=0, atol=0)
        torch.testing.assert_close(s, loop_s, rtol=0, atol=0)
    # the next GEMV (o_proj: the attention's output, plus the stream) zeroes the accumulator qkv read
    attn = out[:, : hq * head_dim]  # (rows n_total apart: a row stride of its own)
    w_o = rand(hidden, hq * head_dim, device=device, dtype=dtype, scale=(hq * head_dim) ** -0.5)
    o_sums = norm_sums_buffer(GEMV_MAX_M, device)
    o, _ = gemv_triton(attn, w_o, add=s, carry=NormCarryOut(None, None, o_sums), zero_accumulator=acc_buf)
    torch.testing.assert_close(o, gemv_triton(attn, w_o, add=s)[0], rtol=0, atol=0)
    assert not acc_buf[: num_rows * hidden].any(), "the accumulator was not zeroed"
    assert bool((acc_buf[num_rows * hidden :] == 5.0).all()), "zeroed past M * H"


@pytest.mark.parametrize("device,dtype", CASES)
def test_gemv_pending_mlp_arguments_are_checked(device: str, dtype: torch.dtype) -> None:
    x, w = rand(2, K, device=device, dtype=dtype), rand(N, K, device=device, dtype=dtype)
    acc = torch.zeros(2, K, device=device)
    rope = {"num_heads": 1, "num_kv_heads": 1, "norm_folded": True, "x_accumulator": True,
            **rope_case(2, 1, N // 3, 8, device, dtype)}
    with pytest.raises(ValueError, match="x_accumulator rounds x and adds norm_residual"):
        gemv_rotary_cache_triton(acc, w, None, **rope)
    with pytest.raises(ValueError, match="x_accumulator means float32 x shaped as norm_residual"):
        gemv_rotary_cache_triton(acc[:, :-1], w, None, **rope, norm_residual=x)
    with pytest.raises(ValueError, match="x_accumulator means float32 x"):
        gemv_rotary_cache_triton(acc.double(), w, None, **rope, norm_residual=x)
    with pytest.raises(ValueError, match="pass it"):
        gemv_rotary_cache_ref(acc, w, None, **rope)
    for bad in (torch.zeros(2 * N - 1, device=device), torch.zeros(2 * N, device=device, dtype=torch.float64)):
        with pytest.raises(ValueError, match="zero_accumulator must be contiguous float32"):
            gemv_triton(x, w, zero_accumulator=bad)


# --------------------------------------------------------------------------------------- bad inputs
@pytest.mark.parametrize("device,dtype", CASES)
def test_gemv_rejects_bad_inputs(device: str, dtype: torch.dtype) -> None:
    x = rand(2, 32, device=device, dtype=dtype)
    w = rand(16, 32, device=device, dtype=dtype)
    with pytest.raises(ValueError, match="x \\[M, K\\]"):
        gemv_triton(x, rand(16, 31, device=device, dtype=dtype))
    with pytest.raises(ValueError, match="odd"):
        gemv_triton(x, rand(15, 32, device=device, dtype=dtype), silu_mul=True)
    with pytest.raises(ValueError, match="pass norm_weight"):
        gemv_triton(x, w, norm_residual=x.clone())
    with pytest.raises(ValueError, match="add must be"):
        gemv_triton(x, w, add=rand(2, 8, device=device, dtype=dtype))
    with pytest.raises(ValueError, match="contiguous"):
        gemv_triton(x, w.t().contiguous().t())
    with pytest.raises(ValueError, match="cuBLAS"):
        gemv_triton(rand(GEMV_MAX_M + 1, 32, device=device, dtype=dtype), w)


def test_fused_linear_dispatch_falls_back_on_cpu_and_large_m() -> None:
    x, w = torch.randn(GEMV_MAX_M + 3, 24), torch.randn(10, 24)
    g, add = torch.randn(24), torch.randn(GEMV_MAX_M + 3, 5)
    out, s = fused_linear(x, w, norm_weight=g, eps=1e-6, silu_mul=True, add=add)
    ref, _ = gemv_ref(x, w, norm_weight=g, eps=1e-6, silu_mul=True, add=add)
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
    assert s is x


# ------------------------------------------------------------------------- PDL: tiles before the wait
@pytest.mark.parametrize("device,dtype", CASES)
@pytest.mark.parametrize("num_rows,block", [(1, GemvConfig(1, 8, 64, False, 4, 2)), (3, GemvConfig(16, 16, 64, True, 4, 2))],
                         ids=["cores-m1", "dot-m3"])
@pytest.mark.parametrize("k", [K, 150], ids=["k200", "k150"])
@pytest.mark.parametrize("fusion", ["add", "norm_folded_silu_mul"])
def test_gemv_pdl_tiles_before_the_wait(device: str, dtype: torch.dtype, num_rows: int, block: GemvConfig, k: int,
                                        fusion: str) -> None:
    """GemvConfig.pdl_tiles: under pdl the first 1-4 K tiles are loaded before griddepcontrol.wait (on the CPU the
    same tiles are peeled without it) and summed in K order, so every count gives the loop's result bit for bit
    and the reference's within the dtype's tolerance: K = 200 is 4 slices of 64 (the last a masked tail of 8),
    K = 150 leaves the fourth early tile wholly past K."""
    torch.manual_seed(3)
    silu_mul = "silu_mul" in fusion
    n_total = 2 * 45 if silu_mul else N
    x = rand(num_rows, k, device=device, dtype=dtype, scale=3.0)
    weight = rand(n_total, k, device=device, dtype=dtype, scale=k**-0.5)
    if silu_mul:
        g = rand(k, device=device, dtype=dtype) + 1
        fast: dict[str, Any] = {"silu_mul": True, "norm_folded": True, "eps": 1e-5}
        ref, _ = gemv_ref(x, weight, norm_weight=g, eps=1e-5, silu_mul=True)
        weight = fold_norm_weight(weight, g)
    else:
        fast = {"add": rand(num_rows, N, device=device, dtype=dtype)}
        ref, _ = gemv_ref(x, weight, **fast)
    outs = [gemv_triton(x, weight, **fast, pdl=True, config=dataclasses.replace(block, pdl_tiles=t))[0]
            for t in (1, 2, 3, 4)]
    loop = gemv_triton(x, weight, **fast, pdl=False, config=block)[0]
    for out in outs:
        torch.testing.assert_close(out, loop, rtol=0, atol=0)
    close(outs[-1], ref, dtype)


def test_gemv_config_pdl_tiles_are_bounded() -> None:
    assert GemvConfig(1, 4, 1024, False, 4, 3, pdl_tiles=4).label() == "cores 1x4x1024 w4 s3 p4"
    for bad in (0, 5):
        with pytest.raises(ValueError, match="pdl_tiles must be 1-4"):
            GemvConfig(1, 4, 1024, False, 4, 3, pdl_tiles=bad)


# ------------------------------------------------------------------------------------ GPU only: PDL
@GPU
@NO_CUDA
@pytest.mark.parametrize("num_rows", [1, 5])
@pytest.mark.parametrize("form", ["prologue", "norms", "carry"])
def test_gemv_pdl_chain_survives_cuda_graph_capture(num_rows: int, form: str) -> None:
    """A decoder layer's worth of PDL launches (norm+qkv-like, residual-add, norm+gate_up+silu, down+add),
    captured in a CUDA graph and replayed on new inputs, equals the same chain launched without PDL. "norms": the
    FP8 chain's form, PDL RMSNorm kernels (each lets the next GEMV in before it normalises) and GEMVs that load all
    four K tiles before their wait. "carry": the norms carried (fused_decode.NormCarry) as the FP8 layers run them,
    the second layer's first GEMV on the first layer's down's sums: the slots one kernel zeroes and the next adds
    into under PDL, in the graph, give what the plain launches give, bit for bit (integer sums)."""
    from stoker.engine.kernels.rmsnorm import rms_norm_triton

    torch.manual_seed(0)
    dt, hidden, inter = torch.bfloat16, 512, 1376
    w_o = rand(hidden, hidden, device="cuda", dtype=dt, scale=hidden**-0.5)
    w_gu = rand(2 * inter, hidden, device="cuda", dtype=dt, scale=hidden**-0.5)
    w_d = rand(hidden, inter, device="cuda", dtype=dt, scale=inter**-0.5)
    g1, g2 = rand(hidden, device="cuda", dtype=dt) + 1, rand(hidden, device="cuda", dtype=dt) + 1
    static_x = rand(num_rows, hidden, device="cuda", dtype=dt)
    early = GemvConfig(1, 4, 128, False, 4, 3, 4) if num_rows == 1 else GemvConfig(16, 16, 128, True, 4, 2, 4)
    x_post, x_next = (torch.empty(GEMV_MAX_M, hidden, device="cuda", dtype=dt) for _ in range(2))
    sums_post, sums_next = (norm_sums_buffer(GEMV_MAX_M, "cuda") for _ in range(2))

    def carried_layer(x: torch.Tensor, pdl: bool, first: bool) -> torch.Tensor:
        m = x.shape[0]
        if first:
            h = rms_norm_triton(x, g1, 1e-5, pdl=pdl)[0]
        else:
            h, _ = gemv_triton(x_next[:m], w_o, norm_sums=sums_next, eps=1e-5, pdl=pdl)
        r, _ = gemv_triton(h, w_o, add=x, pdl=pdl, config=early, carry=NormCarryOut(g2, x_post[:m], sums_post),
                           zero_sums=sums_next)
        a, _ = gemv_triton(x_post[:m], w_gu, silu_mul=True, norm_sums=sums_post, eps=1e-5, pdl=pdl)
        nxt = {"carry": NormCarryOut(g1, x_next[:m], sums_next)} if first else {}
        return gemv_triton(a, w_d, add=r, pdl=pdl, zero_sums=sums_post, **nxt)[0]

    def layer(x: torch.Tensor, pdl: bool, first: bool = False) -> torch.Tensor:
        if form == "carry":
            return carried_layer(x, pdl, first)
        if form == "norms":  # K = 512: all of it before the wait
            h = rms_norm_triton(x, g1, 1e-5, pdl=pdl)[0]
            r, _ = gemv_triton(h, w_o, add=x, pdl=pdl, config=early)
            n2 = rms_norm_triton(r, g2, 1e-5, pdl=pdl)[0]
            a, _ = gemv_triton(n2, w_gu, silu_mul=True, pdl=pdl, config=early)
        else:
            h, _ = gemv_triton(x, w_o, norm_weight=g1, eps=1e-5, pdl=pdl)
            r, _ = gemv_triton(h, w_o, add=x, pdl=pdl)
            a, _ = gemv_triton(r, w_gu, norm_weight=g2, eps=1e-5, silu_mul=True, pdl=pdl)
        return gemv_triton(a, w_d, add=r, pdl=pdl)[0]

    for _ in range(2):  # compile and warm up outside the capture
        layer(layer(static_x, True, first=True), True)
    stream = torch.cuda.Stream()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        static_out = layer(layer(static_x, True, first=True), True)
    for _ in range(3):
        static_x.copy_(rand(num_rows, hidden, device="cuda", dtype=dt))
        graph.replay()
        expected = layer(layer(static_x, False, first=True), False)
        torch.testing.assert_close(static_out, expected, rtol=0, atol=0)
    if form == "carry":  # and every slot is back to zero after a step; the plain chain agrees with the reference
        assert not sums_post.any() and not sums_next.any()
        s1, _ = gemv_ref(rms_norm_triton(static_x, g1, 1e-5)[0], w_o, add=static_x)
        a1, _ = gemv_ref(s1, w_gu, norm_weight=g2, eps=1e-5, silu_mul=True)
        out1, _ = gemv_ref(a1, w_d, add=s1)
        h2, _ = gemv_ref(out1, w_o, norm_weight=g1, eps=1e-5)
        s2, _ = gemv_ref(h2, w_o, add=out1)
        a2, _ = gemv_ref(s2, w_gu, norm_weight=g2, eps=1e-5, silu_mul=True)
        torch.testing.assert_close(expected.float(), gemv_ref(a2, w_d, add=s2)[0].float(), rtol=0.05, atol=0.05)


@pytest.mark.slow
@pytest.mark.skipif(INTERPRET, reason="this is the interpreter run itself")
def test_gemv_under_triton_interpreter() -> None:
    run_under_interpreter(__file__)
