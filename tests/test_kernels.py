"""Every Triton kernel against its plain-torch reference, on odd shapes, fresh random inputs each run,
with tolerances tied to the dtype.

Two ways this module runs:
- on CUDA (tests marked gpu): bf16, fp16 and fp32 on the GPU;
- on the CPU under TRITON_INTERPRET=1, which must be set before any kernel is decorated, i.e. before
  engine.kernels is first imported. Other test modules import engine.kernels first, so the driver test
  at the bottom re-runs this file in a fresh interpreter-mode subprocess; in that subprocess the CPU cases
  run (fp32/fp16 only: the interpreter mishandles bf16) and the driver skips itself.
"""
from __future__ import annotations

import math

import pytest
import torch

triton = pytest.importorskip("triton")
from kernel_harness import GPU, INTERPRET, NO_CUDA, cases, close, run_under_interpreter  # noqa: E402
from stoker.engine.kernels import (  # noqa: E402  (after the interpreter fix above)
    paged_attention,
    paged_attention_ref,
    paged_attention_triton,
    paged_decode_attention,
    paged_decode_attention_ref,
    paged_decode_attention_triton,
    rms_norm,
    rms_norm_ref,
    rms_norm_triton,
    rope_cos_sin,
    rotary_and_cache_ref,
    rotary_and_cache_triton,
    silu_and_mul_ref,
    silu_and_mul_triton,
)
from stoker.engine.kernels.attention import decode_num_splits  # noqa: E402

CASES = cases()


# ---------------------------------------------------------------------------------------------- rms_norm
@pytest.mark.parametrize("device,dtype", CASES)
@pytest.mark.parametrize("rows,hidden", [(7, 48), (1, 4096), (3, 80)])
def test_rms_norm(device: str, dtype: torch.dtype, rows: int, hidden: int) -> None:
    wide = torch.randn(rows, hidden + 16, device=device, dtype=dtype)
    x = wide[:, :hidden]  # a row stride != hidden must be honoured
    residual = torch.randn(rows, hidden, device=device, dtype=dtype)
    weight = torch.randn(hidden, device=device, dtype=dtype)
    out, same = rms_norm_triton(x, weight, 1e-5)
    close(out, rms_norm_ref(x, weight, 1e-5)[0], dtype)
    assert same is x
    out, summed = rms_norm_triton(x, weight, 1e-5, residual)
    ref_out, ref_summed = rms_norm_ref(x, weight, 1e-5, residual)
    close(out, ref_out, dtype)
    torch.testing.assert_close(summed, ref_summed, rtol=0, atol=0)  # the sum is rounded exactly like torch
    # pdl (the fused decode chain's norm): the same kernel, launched with PDL on the GPU: the same bits
    pdl_out, pdl_summed = rms_norm_triton(x, weight, 1e-5, residual, pdl=True)
    torch.testing.assert_close(pdl_out, out, rtol=0, atol=0)
    torch.testing.assert_close(pdl_summed, summed, rtol=0, atol=0)


@pytest.mark.parametrize("device,dtype", CASES)
def test_rms_norm_per_head_view(device: str, dtype: torch.dtype) -> None:
    q = torch.randn(5, 6, 64, device=device, dtype=dtype)  # Qwen3 q-norm: one row per (token, head)
    weight = torch.randn(64, device=device, dtype=dtype)
    close(rms_norm_triton(q.view(-1, 64), weight, 1e-6)[0], rms_norm_ref(q.view(-1, 64), weight, 1e-6)[0], dtype)


# ------------------------------------------------------------------------------------------- activation
@pytest.mark.parametrize("device,dtype", CASES)
@pytest.mark.parametrize("rows,inter", [(7, 45), (3, 1500), (1, 1)])
def test_silu_and_mul(device: str, dtype: torch.dtype, rows: int, inter: int) -> None:
    x = torch.randn(rows, 2 * inter, device=device, dtype=dtype) * 3
    out = silu_and_mul_triton(x)
    assert out.shape == (rows, inter) and out.dtype == dtype
    close(out, silu_and_mul_ref(x), dtype)


# ------------------------------------------------------------------------------------------------- rope
@pytest.mark.parametrize("device,dtype", CASES)
@pytest.mark.parametrize("hq,hkv,head_dim,block_size", [(6, 2, 64, 16), (6, 2, 80, 8), (4, 4, 32, 8)])
def test_rotary_and_cache(device: str, dtype: torch.dtype, hq: int, hkv: int, head_dim: int, block_size: int) -> None:
    num_tokens, num_blocks = 7, 4
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}
    cos_sin = rope_cos_sin(head_dim, 512, 500000.0, scaling, device=device)
    qkv = torch.randn(num_tokens, (hq + 2 * hkv) * head_dim, device=device, dtype=dtype)
    positions = torch.randint(0, 512, (num_tokens,), device=device)
    slots = torch.randperm(num_blocks * block_size, device=device)[:num_tokens]
    slots[[1, 4]] = -1  # padding
    k_cache = torch.randn(num_blocks, block_size, hkv, head_dim, device=device).to(dtype)
    v_cache = torch.randn_like(k_cache)

    def fused_views(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q, k, v = t.split([hq * head_dim, hkv * head_dim, hkv * head_dim], -1)
        return q.view(num_tokens, -1, head_dim), k.view(num_tokens, -1, head_dim), v.view(num_tokens, -1, head_dim)

    ref_qkv, ref_k_cache, ref_v_cache = qkv.clone(), k_cache.clone(), v_cache.clone()
    rotary_and_cache_triton(*fused_views(qkv), positions, cos_sin, k_cache, v_cache, slots)
    rotary_and_cache_ref(*fused_views(ref_qkv), positions, cos_sin, ref_k_cache, ref_v_cache, slots)
    close(qkv, ref_qkv, dtype)
    close(k_cache, ref_k_cache, dtype)
    torch.testing.assert_close(v_cache, ref_v_cache, rtol=0, atol=0)


@pytest.mark.parametrize("device,dtype", CASES)
def test_rotary_and_cache_into_q_out(device: str, dtype: torch.dtype) -> None:
    """q_out (the piecewise graphs' static q): the rotated q lands there, as the in-place rotation would leave it,
    q itself is untouched, and k and the caches are as without q_out."""
    num_tokens, hq, hkv, head_dim, block_size = 9, 6, 2, 64, 8
    cos_sin = rope_cos_sin(head_dim, 256, 10000.0, None, device=device)
    qkv = torch.randn(num_tokens, (hq + 2 * hkv) * head_dim, device=device, dtype=dtype)
    positions = torch.randint(0, 256, (num_tokens,), device=device)
    slots = torch.randperm(4 * block_size, device=device)[:num_tokens]
    slots[2] = -1
    caches = [torch.zeros(4, block_size, hkv, head_dim, device=device, dtype=dtype) for _ in range(4)]

    def views(t: torch.Tensor) -> list[torch.Tensor]:
        return [x.view(num_tokens, -1, head_dim) for x in t.split([hq * head_dim, hkv * head_dim, hkv * head_dim], -1)]

    in_place, untouched = qkv.clone(), qkv.clone()
    q_out = torch.full((num_tokens, hq, head_dim), float("nan"), device=device, dtype=dtype)
    rotary_and_cache_triton(*views(in_place), positions, cos_sin, caches[0], caches[1], slots)
    rotary_and_cache_triton(*views(qkv), positions, cos_sin, caches[2], caches[3], slots, q_out=q_out)
    torch.testing.assert_close(q_out, views(in_place)[0], rtol=0, atol=0)
    torch.testing.assert_close(views(qkv)[0], views(untouched)[0], rtol=0, atol=0)  # q left as it was
    torch.testing.assert_close(views(qkv)[1], views(in_place)[1], rtol=0, atol=0)  # k rotated in place as before
    for a, b in zip(caches[:2], caches[2:], strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    ref_out = torch.empty_like(q_out)
    rotary_and_cache_ref(*views(untouched.clone()), positions, cos_sin, caches[0].clone(), caches[1].clone(), slots,
                         q_out=ref_out)
    close(q_out, ref_out, dtype)
    with pytest.raises(ValueError, match="q_out"):
        rotary_and_cache_triton(*views(qkv), positions, cos_sin, caches[2], caches[3], slots, q_out=q_out[:, :2])


# -------------------------------------------------------------------------------------------- attention
def paged_batch(
    lens: list[int], hkv: int, head_dim: int, block_size: int, device: str, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random caches whose blocks are handed out in shuffled order; the blocks no sequence owns hold NaN
    and block_tables entries past each sequence's last block are out-of-range garbage, so a kernel that
    reads anything it should not either poisons its output or faults."""
    owned = [math.ceil(n / block_size) for n in lens]
    num_blocks = sum(owned) + 2
    k_cache = torch.randn(num_blocks, block_size, hkv, head_dim, device=device).to(dtype)
    v_cache = torch.randn_like(k_cache)
    order = torch.randperm(num_blocks).tolist()
    k_cache[order[-2:]] = float("nan")
    v_cache[order[-2:]] = float("nan")
    block_tables = torch.full((len(lens), max(owned) + 3), 1 << 24, dtype=torch.int32)
    taken = 0
    for seq, n_blocks in enumerate(owned):
        block_tables[seq, :n_blocks] = torch.tensor(order[taken:taken + n_blocks])
        taken += n_blocks
        # The last block's slots past the context hold NaN too: only positions < context may be read.
        tail = lens[seq] % block_size
        if tail:
            k_cache[block_tables[seq, n_blocks - 1], tail:] = float("nan")
            v_cache[block_tables[seq, n_blocks - 1], tail:] = float("nan")
    return k_cache, v_cache, block_tables.to(device)


ATTN_SHAPES = [(6, 2, 64, 16), (6, 2, 80, 8), (8, 1, 32, 16), (4, 4, 64, 8)]  # Hq, Hkv, D, block_size


@pytest.mark.parametrize("device,dtype", CASES)
@pytest.mark.parametrize("hq,hkv,head_dim,block_size", ATTN_SHAPES)
def test_paged_attention_mixed_batch(
    device: str, dtype: torch.dtype, hq: int, hkv: int, head_dim: int, block_size: int
) -> None:
    # (new queries, context): fresh prefill, chunk after a cached prefix, decodes, context 1, an empty
    # sequence in the middle, and a prefill longer than one query tile.
    shapes = [(17, 17), (5, 40), (1, 100), (1, 1), (0, 9), (3, 3), (37, 50)]
    k_cache, v_cache, block_tables = paged_batch([c for _, c in shapes], hkv, head_dim, block_size, device, dtype)
    query_start_loc = torch.tensor([0] + [n for n, _ in shapes], device=device).cumsum(0).to(torch.int32)
    context_lens = torch.tensor([c for _, c in shapes], dtype=torch.int32, device=device)
    num_real = int(query_start_loc[-1])
    q = torch.randn(num_real + 3, hq, head_dim, device=device, dtype=dtype)  # 3 rows of batch padding
    scale = head_dim**-0.5
    # The output is not zero-filled first: into a NaN-poisoned buffer the kernel must write every row.
    poisoned = torch.full_like(q, float("nan"))
    out = paged_attention_triton(q, k_cache, v_cache, block_tables, query_start_loc, context_lens, scale,
                                 out=poisoned)
    ref = paged_attention_ref(q, k_cache, v_cache, block_tables, query_start_loc, context_lens, scale)
    assert out is poisoned
    close(out[:num_real], ref[:num_real], dtype)
    assert torch.equal(out[num_real:], torch.zeros_like(out[num_real:]))


@pytest.mark.parametrize("device,dtype", CASES)
def test_paged_attention_padding_rows_past_many_programs(device: str, dtype: torch.dtype) -> None:
    # More padding rows than one padding program covers, and padding starting mid-program.
    k_cache, v_cache, block_tables = paged_batch([9, 4], 1, 16, 8, device, dtype)
    query_start_loc = torch.tensor([0, 9, 13], dtype=torch.int32, device=device)
    context_lens = torch.tensor([9, 4], dtype=torch.int32, device=device)
    q = torch.randn(13 + 37, 2, 16, device=device, dtype=dtype)
    ref = paged_attention_ref(q, k_cache, v_cache, block_tables, query_start_loc, context_lens, 0.25)
    for out in (None, torch.full_like(q, float("nan"))):  # allocated by the launcher, or poisoned
        out = paged_attention_triton(q, k_cache, v_cache, block_tables, query_start_loc, context_lens, 0.25,
                                     out=out)
        assert out.shape == q.shape and out.dtype == dtype
        close(out[:13], ref[:13], dtype)
        assert torch.equal(out[13:], torch.zeros_like(out[13:]))


@pytest.mark.parametrize("device,dtype", CASES)
@pytest.mark.parametrize("hq,hkv,head_dim,block_size", ATTN_SHAPES)
@pytest.mark.parametrize("num_splits", [None, 1, 3, 8])
def test_paged_decode_attention(
    device: str, dtype: torch.dtype, hq: int, hkv: int, head_dim: int, block_size: int, num_splits: int | None
) -> None:
    lens = [1, 17, 100, 33, 64]  # with 8 splits most splits of the short sequences are empty
    k_cache, v_cache, block_tables = paged_batch(lens, hkv, head_dim, block_size, device, dtype)
    context_lens = torch.tensor(lens, dtype=torch.int32, device=device)
    q = torch.randn(len(lens), hq, head_dim, device=device, dtype=dtype)
    out = paged_decode_attention_triton(q, k_cache, v_cache, block_tables, context_lens, 0.1, num_splits)
    close(out, paged_decode_attention_ref(q, k_cache, v_cache, block_tables, context_lens, 0.1), dtype)


@pytest.mark.parametrize("device,dtype", CASES)
def test_paged_decode_attention_reads_only_live_splits(
    device: str, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Empty splits (a short context in a grid sized for a long one, as inside a CUDA graph) write no
    partials and the reduce must not read them: the split-K scratch starts as NaN here."""
    from stoker.engine.kernels import attention

    def poisoned(*args: object, **kwargs: object) -> tuple[torch.Tensor, ...]:
        return tuple(t.fill_(float("nan")) for t in real(*args, **kwargs))

    real = attention._decode_partials
    monkeypatch.setattr(attention, "_decode_partials", poisoned)
    lens = [1, 20, 3, 50]
    k_cache, v_cache, block_tables = paged_batch(lens, 2, 32, 8, device, dtype)
    wide = torch.zeros(len(lens), 40, dtype=torch.int32, device=device)  # a static table, 320 tokens wide
    wide[:, : block_tables.shape[1]] = block_tables
    context_lens = torch.tensor(lens, dtype=torch.int32, device=device)
    q = torch.randn(len(lens), 6, 32, device=device, dtype=dtype)
    ref = paged_decode_attention_ref(q, k_cache, v_cache, block_tables, context_lens, 0.2)
    for num_splits in (None, 7):
        out = paged_decode_attention_triton(q, k_cache, v_cache, wide, context_lens, 0.2, num_splits)
        close(out, ref, dtype)


@pytest.mark.parametrize("device,dtype", CASES)
@pytest.mark.parametrize("num_splits", [None, 1, 3])
def test_decode_attention_table_ahead_is_the_same_attention(
    device: str, dtype: torch.dtype, num_splits: int | None
) -> None:
    """The block numbers loaded a tile ahead (attention.DECODE_TABLE_AHEAD) change where they come from, not the
    arithmetic: the same output to the bit as the numbers loaded in the loop, and the reference's within the
    dtype. Tables end in out-of-range entries and unowned blocks hold NaN, so reading one tile too far shows."""
    lens = [1, 17, 100, 33, 64, 16]  # contexts of exactly whole tiles too (the last look-ahead fully masked)
    k_cache, v_cache, block_tables = paged_batch(lens, 2, 32, 8, device, dtype)
    context_lens = torch.tensor(lens, dtype=torch.int32, device=device)
    q = torch.randn(len(lens), 6, 32, device=device, dtype=dtype)
    ahead, in_loop = (paged_decode_attention_triton(q, k_cache, v_cache, block_tables, context_lens, 0.1, num_splits,
                                                    table_ahead=flag) for flag in (True, False))
    assert torch.equal(ahead, in_loop)
    close(ahead, paged_decode_attention_ref(q, k_cache, v_cache, block_tables, context_lens, 0.1), dtype)


@pytest.mark.parametrize("device,dtype", CASES)
def test_prefill_attention_table_ahead_is_the_same_attention(device: str, dtype: torch.dtype) -> None:
    """As the decode kernel's: the prefill kernel with the block numbers a tile ahead against in the loop."""
    shapes = [(17, 17), (5, 40), (1, 100), (0, 9), (3, 3), (37, 50), (16, 32)]
    k_cache, v_cache, block_tables = paged_batch([c for _, c in shapes], 2, 32, 8, device, dtype)
    query_start_loc = torch.tensor([0] + [n for n, _ in shapes], device=device).cumsum(0).to(torch.int32)
    context_lens = torch.tensor([c for _, c in shapes], dtype=torch.int32, device=device)
    num_real = int(query_start_loc[-1])
    q = torch.randn(num_real + 2, 6, 32, device=device, dtype=dtype)
    ahead, in_loop = (paged_attention_triton(q, k_cache, v_cache, block_tables, query_start_loc, context_lens, 0.2,
                                             table_ahead=flag) for flag in (True, False))
    assert torch.equal(ahead, in_loop)
    ref = paged_attention_ref(q, k_cache, v_cache, block_tables, query_start_loc, context_lens, 0.2)
    close(ahead[:num_real], ref[:num_real], dtype)


def test_decode_takes_the_block_numbers_ahead_only_for_long_splits(monkeypatch: pytest.MonkeyPatch) -> None:
    from stoker.engine.kernels import attention

    # W2's decode (B = 1,024 on the 8B heads: one split over a 1,024-token table of 64-key tiles): ahead.
    assert attention.decode_table_ahead(1, 1024, 64)
    # W1 (16 splits of one tile) and the fused decode path's 16 tokens (3 splits of ~5 tiles): in the loop.
    assert not attention.decode_table_ahead(16, 1024, 64)
    assert not attention.decode_table_ahead(3, 1024, 64)
    assert attention.decode_table_ahead(2, 1024, 64)  # B = 32: 2 splits of 8 tiles
    monkeypatch.setattr(attention, "DECODE_TABLE_AHEAD", False)
    assert not attention.decode_table_ahead(1, 1024, 64)


def test_decode_num_splits_fills_the_gpu() -> None:
    # Batch 1, 8 kv heads, 132 SMs (H200): 33 splits give 264 programs, 2 waves.
    assert decode_num_splits(1, 8, 8192, 132, 64) == 33
    assert decode_num_splits(1, 8, 512, 132, 64) == 8  # short context: no split under one tile
    assert decode_num_splits(1, 8, 1024, 132, 64) == 16  # W1's graphs (max_model_len 1024): 128 programs
    assert decode_num_splits(64, 8, 4096, 132, 64) == 1  # 512 programs already
    assert decode_num_splits(1, 1, 1 << 20, 132, 64) == 64  # capped: scratch and reduce stay small


def test_decode_num_splits_follows_its_constants(monkeypatch: pytest.MonkeyPatch) -> None:
    from stoker.engine.kernels import attention

    monkeypatch.setattr(attention, "DECODE_MAX_SPLITS", 4)
    assert decode_num_splits(1, 8, 1024, 132, 64) == 4
    monkeypatch.setattr(attention, "DECODE_MAX_SPLITS", 64)
    monkeypatch.setattr(attention, "DECODE_SPLIT_WAVES", 1)
    assert decode_num_splits(1, 8, 8192, 132, 64) == 17  # one wave: 132 / 8 programs a split, rounded up


# ----------------------------------------------------------------------------- dispatch and bad inputs
@pytest.mark.parametrize("device,dtype", CASES)
def test_launchers_reject_bad_layouts(device: str, dtype: torch.dtype) -> None:
    x = torch.randn(4, 32, device=device, dtype=dtype)
    with pytest.raises(ValueError, match="contiguous"):
        rms_norm_triton(x.t().contiguous().t(), torch.randn(32, device=device, dtype=dtype), 1e-6)
    with pytest.raises(ValueError, match="contiguous"):
        silu_and_mul_triton(x.t().contiguous().t())
    k_cache = torch.randn(4, 8, 2, 16, device=device, dtype=dtype)
    q = torch.randn(2, 4, 16, device=device, dtype=dtype)
    with pytest.raises(ValueError, match="int32 or int64"):
        paged_decode_attention_triton(q, k_cache, k_cache, torch.zeros(2, 4, device=device),
                                      torch.ones(2, dtype=torch.int32, device=device), 1.0)
    with pytest.raises(ValueError, match="contiguous"):
        paged_attention_triton(q, k_cache.transpose(0, 1), k_cache.transpose(0, 1),
                               torch.zeros(1, 4, dtype=torch.int32, device=device),
                               torch.tensor([0, 2], dtype=torch.int32, device=device),
                               torch.tensor([2], dtype=torch.int32, device=device), 1.0)


@GPU
@NO_CUDA
def test_dispatch_uses_triton_on_cuda_and_reference_with_stoker_triton_0(monkeypatch: pytest.MonkeyPatch) -> None:
    lens = [5, 40]
    k_cache, v_cache, block_tables = paged_batch(lens, 2, 64, 16, "cuda", torch.float16)
    context_lens = torch.tensor(lens, dtype=torch.int32, device="cuda")
    q = torch.randn(2, 6, 64, device="cuda", dtype=torch.float16)
    qsl = torch.tensor([0, 1, 2], dtype=torch.int32, device="cuda")
    fast = paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, 0.1)
    mixed = paged_attention(q, k_cache, v_cache, block_tables, qsl, context_lens, 0.1)
    torch.testing.assert_close(fast, paged_decode_attention_triton(q, k_cache, v_cache, block_tables,
                                                                   context_lens, 0.1), rtol=0, atol=0)
    monkeypatch.setattr("stoker.engine.kernels._triton_enabled", False)  # EngineConfig(use_triton=False)
    slow = paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, 0.1)
    x = torch.randn(3, 48, device="cuda", dtype=torch.float16)
    torch.testing.assert_close(rms_norm(x, torch.ones(48, device="cuda", dtype=torch.float16), 1e-6)[0],
                               rms_norm_ref(x, torch.ones(48, device="cuda", dtype=torch.float16), 1e-6)[0],
                               rtol=0, atol=0)
    close(fast, slow, torch.float16)
    close(mixed, slow, torch.float16)


@pytest.mark.slow
@pytest.mark.skipif(INTERPRET, reason="this is the interpreter run itself")
def test_kernels_under_triton_interpreter() -> None:
    run_under_interpreter(__file__)
