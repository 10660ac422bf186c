"""The plain-torch kernel references (which define the semantics the Triton kernels must match) against
independent naive formulations: Hugging Face's own modules and formulas where importable, and attention
computed densely per sequence from K/V that the test holds before scattering them into a paged cache."""
from __future__ import annotations

import math

import pytest
import torch
from stoker.engine.kernels import (
    paged_attention,
    paged_attention_ref,
    paged_decode_attention_ref,
    rms_norm_ref,
    rope_cos_sin,
    rotary_and_cache_ref,
    silu_and_mul_ref,
)

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}  # atol = rtol, per dtype


def close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    torch.testing.assert_close(actual.double(), expected.double(), atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


# ---------------------------------------------------------------------------------------------- rms_norm
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_matches_hf_llama_rmsnorm(dtype: torch.dtype, with_residual: bool) -> None:
    llama = pytest.importorskip("transformers.models.llama.modeling_llama")
    x, residual = torch.randn(7, 48, dtype=dtype), torch.randn(7, 48, dtype=dtype)
    hf = llama.LlamaRMSNorm(48, eps=1e-5).to(dtype)
    with torch.no_grad():
        hf.weight.copy_(torch.randn(48))
        summed = residual + x if with_residual else x  # HF: residual + hidden in the model dtype
        expected = hf(summed)
    out, new_residual = rms_norm_ref(x, hf.weight.detach(), 1e-5, residual if with_residual else None)
    assert out.dtype == dtype and new_residual.dtype == dtype
    torch.testing.assert_close(new_residual, summed, rtol=0, atol=0)
    torch.testing.assert_close(out, expected, rtol=0, atol=0)


def test_rms_norm_per_head_view_and_errors() -> None:
    # Qwen3's q/k norm normalises each head: x = q.view(-1, head_dim) with a [head_dim] weight.
    q, weight = torch.randn(5, 6, 16), torch.randn(16)
    out, _ = rms_norm_ref(q.view(-1, 16), weight, 1e-6)
    naive = q / torch.sqrt(q.pow(2).mean(-1, keepdim=True) + 1e-6) * weight
    torch.testing.assert_close(out.view(5, 6, 16), naive, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="weight"):
        rms_norm_ref(torch.randn(3, 8), torch.randn(9), 1e-6)
    with pytest.raises(ValueError, match="residual"):
        rms_norm_ref(torch.randn(3, 8), torch.randn(8), 1e-6, torch.randn(3, 9))


# ------------------------------------------------------------------------------------------------- rope
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 8192}


@pytest.mark.parametrize("scaling", [None, {"rope_type": "default"}, {"type": "linear", "factor": 4.0}, LLAMA3])
def test_rope_cos_sin_matches_hf_rotary_embedding(scaling: dict | None) -> None:
    llama = pytest.importorskip("transformers.models.llama.modeling_llama")
    from transformers import LlamaConfig

    base, head_dim, max_pos = 500000.0, 128, 20000
    params = {"rope_type": "default", **(scaling or {}), "rope_theta": base}
    params["rope_type"] = params.pop("type", params["rope_type"])
    config = LlamaConfig(hidden_size=head_dim * 4, num_attention_heads=4, head_dim=head_dim,
                         max_position_embeddings=max_pos * 2, rope_parameters=params)
    positions = torch.tensor([[0, 1, 2, 17, 100, 4095, 8191, 8192, 19999]])
    hf_cos, hf_sin = llama.LlamaRotaryEmbedding(config)(torch.zeros(1, dtype=torch.float32), positions)
    table = rope_cos_sin(head_dim, max_pos, base, scaling)
    assert table.shape == (max_pos, head_dim) and table.dtype == torch.float32
    half = head_dim // 2
    # HF's cos is cat(cos, cos) of the same p * inv_freq, so compare against its first half.
    torch.testing.assert_close(table[positions[0], :half], hf_cos[0, :, :half], rtol=0, atol=2e-5)
    torch.testing.assert_close(table[positions[0], half:], hf_sin[0, :, :half], rtol=0, atol=2e-5)


def test_rope_llama3_inv_freq_matches_hf_formula() -> None:
    rope_utils = pytest.importorskip("transformers.modeling_rope_utils")
    from transformers import LlamaConfig

    config = LlamaConfig(hidden_size=512, num_attention_heads=4, head_dim=128,
                         rope_parameters={**LLAMA3, "rope_theta": 500000.0})
    inv_freq, attention_factor = rope_utils._compute_llama3_parameters(config, torch.device("cpu"))
    assert attention_factor == 1.0
    table = rope_cos_sin(128, 2, 500000.0, LLAMA3)  # row 1 holds cos/sin(1 * inv_freq)
    torch.testing.assert_close(torch.atan2(table[1, 64:], table[1, :64]), inv_freq.float(), rtol=1e-5, atol=1e-7)


def test_rope_rejects_unknown_scaling() -> None:
    with pytest.raises(ValueError, match="yarn"):
        rope_cos_sin(64, 16, 10000.0, {"rope_type": "yarn", "factor": 4.0})
    with pytest.raises(ValueError, match="low_freq_factor"):
        rope_cos_sin(64, 16, 10000.0, {"rope_type": "llama3", "factor": 8.0})
    with pytest.raises(ValueError, match="even"):
        rope_cos_sin(63, 16, 10000.0, None)


def hf_rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """HF's apply_rotary_pos_emb in float32: x * cos + rotate_half(x) * sin, with cos = cat(c, c)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * torch.cat([cos, cos], -1) + rotated * torch.cat([sin, sin], -1)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_and_cache_on_fused_qkv_views(dtype: torch.dtype) -> None:
    num_tokens, hq, hkv, head_dim, block_size, num_blocks = 7, 6, 2, 64, 8, 5
    table = rope_cos_sin(head_dim, 256, 10000.0, LLAMA3)
    qkv = torch.randn(num_tokens, (hq + 2 * hkv) * head_dim, dtype=dtype)
    q, k, v = (t.view(num_tokens, -1, head_dim)
               for t in qkv.split([hq * head_dim, hkv * head_dim, hkv * head_dim], dim=-1))
    assert not q.is_contiguous()  # the real case: views of the fused projection
    q0, k0, v0 = q.clone(), k.clone(), v.clone()
    positions = torch.randint(0, 256, (num_tokens,))
    slots = torch.randperm(num_blocks * block_size)[:num_tokens]
    slots[[2, 5]] = -1  # padding tokens: must not be written
    k_cache = torch.randn(num_blocks, block_size, hkv, head_dim).to(dtype)
    v_cache = torch.randn_like(k_cache)
    k_before, v_before = k_cache.clone(), v_cache.clone()

    rotary_and_cache_ref(q, k, v, positions, table, k_cache, v_cache, slots)

    cos, sin = table[positions, None, :head_dim // 2], table[positions, None, head_dim // 2:]
    close(q, hf_rotate(q0.float(), cos, sin).to(dtype), dtype)
    close(k, hf_rotate(k0.float(), cos, sin).to(dtype), dtype)
    torch.testing.assert_close(v, v0, rtol=0, atol=0)
    flat_k, flat_v = k_cache.view(-1, hkv, head_dim), v_cache.view(-1, hkv, head_dim)
    written = slots >= 0
    torch.testing.assert_close(flat_k[slots[written]], k[written], rtol=0, atol=0)
    torch.testing.assert_close(flat_v[slots[written]], v0[written], rtol=0, atol=0)
    untouched = torch.ones(num_blocks * block_size, dtype=torch.bool)
    untouched[slots[written]] = False
    assert torch.equal(flat_k[untouched], k_before.view(-1, hkv, head_dim)[untouched])
    assert torch.equal(flat_v[untouched], v_before.view(-1, hkv, head_dim)[untouched])


# -------------------------------------------------------------------------------------------- attention
def scatter_into_paged_cache(
    keys: list[torch.Tensor], values: list[torch.Tensor], block_size: int, spare_blocks: int = 3
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Writes each sequence's contiguous K/V [ctx, Hkv, D] into randomly chosen blocks of a fresh cache
    whose unused blocks hold NaN, and pads block_tables with entries pointing at NaN blocks: a kernel that
    reads past a sequence's context poisons its output."""
    hkv, head_dim, dtype = keys[0].shape[1], keys[0].shape[2], keys[0].dtype
    blocks_per_seq = [math.ceil(k.shape[0] / block_size) for k in keys]
    num_blocks = sum(blocks_per_seq) + spare_blocks
    k_cache = torch.full((num_blocks, block_size, hkv, head_dim), float("nan"), dtype=dtype)
    v_cache = k_cache.clone()
    order = torch.randperm(num_blocks).tolist()
    free_nan_blocks, used = order[-spare_blocks:], 0
    max_blocks = max(blocks_per_seq) + 2
    block_tables = torch.tensor(free_nan_blocks[:1] * max_blocks, dtype=torch.int32).repeat(len(keys), 1)
    for b, (k, v) in enumerate(zip(keys, values, strict=True)):
        for j in range(blocks_per_seq[b]):
            block = order[used]
            used += 1
            block_tables[b, j] = block
            rows = slice(j * block_size, min((j + 1) * block_size, k.shape[0]))
            n = rows.stop - rows.start
            k_cache[block, :n], v_cache[block, :n] = k[rows], v[rows]
    return k_cache, v_cache, block_tables


def naive_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """q [n, Hq, D] at the last n positions of k/v [ctx, Hkv, D]; one query and head at a time."""
    n, hq, _ = q.shape
    ctx, hkv = k.shape[:2]
    out = torch.empty(n, hq, q.shape[2], dtype=torch.float64)
    for i in range(n):
        visible = ctx - n + i + 1
        for h in range(hq):
            kv = h // (hq // hkv)
            scores = (k[:visible, kv].double() @ q[i, h].double()) * scale
            out[i, h] = torch.softmax(scores, 0) @ v[:visible, kv].double()
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("block_size", [16, 8])
def test_paged_attention_matches_dense_per_sequence(dtype: torch.dtype, block_size: int) -> None:
    hq, hkv, head_dim, scale = 6, 2, 32, 32**-0.5
    # (new queries, context): a fresh prefill, a chunk after a cached prefix, decodes, a context of 1.
    shapes = [(17, 17), (5, 40), (1, 100), (1, 1), (3, 3), (0, 9)]
    keys = [torch.randn(ctx, hkv, head_dim, dtype=dtype) for _, ctx in shapes]
    values = [torch.randn(ctx, hkv, head_dim, dtype=dtype) for _, ctx in shapes]
    queries = [torch.randn(n, hq, head_dim, dtype=dtype) for n, _ in shapes]
    k_cache, v_cache, block_tables = scatter_into_paged_cache(keys, values, block_size)
    query_start_loc = torch.tensor([0] + [n for n, _ in shapes], dtype=torch.int32).cumsum(0).int()
    context_lens = torch.tensor([ctx for _, ctx in shapes], dtype=torch.int32)

    out = paged_attention_ref(torch.cat(queries), k_cache, v_cache, block_tables, query_start_loc,
                              context_lens, scale)
    assert out.shape == (sum(n for n, _ in shapes), hq, head_dim) and out.dtype == dtype
    for b, (start, end) in enumerate(zip(query_start_loc[:-1].tolist(), query_start_loc[1:].tolist(),
                                         strict=True)):
        expected = naive_causal_attention(queries[b], keys[b], values[b], scale)
        close(out[start:end].double(), expected, dtype)
    # The dispatching name is the reference on CPU.
    torch.testing.assert_close(out, paged_attention(torch.cat(queries), k_cache, v_cache, block_tables,
                                                    query_start_loc, context_lens, scale), rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_paged_decode_attention_matches_dense(dtype: torch.dtype) -> None:
    hq, hkv, head_dim, block_size = 8, 2, 64, 16
    lens = [1, 17, 100, 33]
    keys = [torch.randn(n, hkv, head_dim, dtype=dtype) for n in lens]
    values = [torch.randn(n, hkv, head_dim, dtype=dtype) for n in lens]
    q = torch.randn(len(lens), hq, head_dim, dtype=dtype)
    k_cache, v_cache, block_tables = scatter_into_paged_cache(keys, values, block_size)
    out = paged_decode_attention_ref(q, k_cache, v_cache, block_tables, torch.tensor(lens, dtype=torch.int32),
                                     0.125)
    for b in range(len(lens)):
        expected = naive_causal_attention(q[b:b + 1], keys[b], values[b], 0.125)
        close(out[b:b + 1].double(), expected, dtype)


def test_attention_rejects_bad_shapes() -> None:
    k_cache = torch.zeros(4, 8, 2, 16)
    bt, ctx = torch.zeros(1, 4, dtype=torch.int32), torch.tensor([4], dtype=torch.int32)
    with pytest.raises(ValueError, match="multiple of Hkv"):
        paged_attention_ref(torch.zeros(2, 3, 16), k_cache, k_cache, bt, torch.tensor([0, 2]), ctx, 1.0)
    with pytest.raises(ValueError, match="query_start_loc"):
        paged_attention_ref(torch.zeros(2, 4, 16), k_cache, k_cache, bt, torch.tensor([0]), ctx, 1.0)
    with pytest.raises(ValueError, match="5 queries"):
        paged_attention_ref(torch.zeros(5, 4, 16), k_cache, k_cache, bt, torch.tensor([0, 5]), ctx, 1.0)


# ------------------------------------------------------------------------------------------- activation
@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul_matches_formula(dtype: torch.dtype) -> None:
    x = torch.randn(7, 2 * 45, dtype=dtype)
    gate, up = x[:, :45].double(), x[:, 45:].double()
    expected = gate / (1 + torch.exp(-gate)) * up
    out = silu_and_mul_ref(x)
    assert out.shape == (7, 45) and out.dtype == dtype
    close(out.double(), expected, dtype)
    with pytest.raises(ValueError, match=r"\[T, 2\*I\]"):
        silu_and_mul_ref(torch.randn(3, 5))
