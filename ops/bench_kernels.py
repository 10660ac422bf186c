#!/usr/bin/env python
"""Times each Triton kernel against its plain-torch reference on Llama-3-8B-like shapes and prints a
table with the achieved memory bandwidth. CUDA only; one command from the repo root:

    $(ops/bootstrap)/bin/python ops/bench_kernels.py [--dtype bf16] [--quick]

H=4096, I=14336, Hq=32, Hkv=8, D=128, block_size=16; batch 1/8/64 decode at context 512/4096, plus a
single-sequence prefill. GB/s counts the bytes a kernel must move at least (inputs read once, outputs
written once), so it is comparable with the GPU's peak (H200: ~4.8 TB/s).
"""
from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a bare checkout too

from stoker.engine.kernels import (  # noqa: E402
    paged_attention_ref,
    paged_attention_triton,
    paged_decode_attention_ref,
    paged_decode_attention_triton,
    rms_norm_ref,
    rms_norm_triton,
    rope_cos_sin,
    rotary_and_cache_ref,
    rotary_and_cache_triton,
    silu_and_mul_ref,
    silu_and_mul_triton,
)

HIDDEN, INTER, HQ, HKV, HEAD_DIM, BLOCK = 4096, 14336, 32, 8, 128, 16
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 8192}


def bench(fn: Callable[[], object]) -> float:
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=25, rep=100)) * 1e3  # ms -> us


def row(name: str, shape: str, ref: Callable[[], object] | None, fast: Callable[[], object], nbytes: float) -> None:
    fast_us = bench(fast)
    ref_us = bench(ref) if ref is not None else float("nan")
    print(f"{name:<22} {shape:<26} {ref_us:>10.1f} {fast_us:>10.1f} {ref_us / fast_us:>8.2f}x "
          f"{nbytes / fast_us / 1e3:>9.0f}")


def paged_cache(batch: int, ctx: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    blocks_per_seq = math.ceil(ctx / BLOCK)
    k_cache = torch.randn(batch * blocks_per_seq, BLOCK, HKV, HEAD_DIM, device="cuda", dtype=dtype)
    v_cache = torch.randn_like(k_cache)
    # Shuffled block ids: a real cache after some churn is not laid out sequence by sequence.
    tables = torch.randperm(batch * blocks_per_seq, device="cuda").view(batch, blocks_per_seq).int()
    return k_cache, v_cache, tables


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dtype", default="bf16", choices=["bf16", "fp16"])
    parser.add_argument("--quick", action="store_true", help="batch 8 and context 4096 only")
    opts = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_kernels needs a CUDA GPU")
    dtype = torch.bfloat16 if opts.dtype == "bf16" else torch.float16
    size = 2  # bytes per element of bf16/fp16
    batches = [8] if opts.quick else [1, 8, 64]
    contexts = [4096] if opts.quick else [512, 4096]
    torch.manual_seed(0)
    print(f"{torch.cuda.get_device_name()}  dtype={opts.dtype}  "
          f"SMs={torch.cuda.get_device_properties(0).multi_processor_count}")
    print(f"{'op':<22} {'shape':<26} {'ref us':>10} {'triton us':>10} {'speedup':>9} {'GB/s':>9}")

    for tokens in batches + [4096]:
        x = torch.randn(tokens, HIDDEN, device="cuda", dtype=dtype)
        res = torch.randn_like(x)
        w = torch.randn(HIDDEN, device="cuda", dtype=dtype)
        row("rms_norm+residual", f"T={tokens} H={HIDDEN}", partial(rms_norm_ref, x, w, 1e-5, res),
            partial(rms_norm_triton, x, w, 1e-5, res), 4 * tokens * HIDDEN * size)
        gate_up = torch.randn(tokens, 2 * INTER, device="cuda", dtype=dtype)
        row("silu_and_mul", f"T={tokens} I={INTER}", partial(silu_and_mul_ref, gate_up),
            partial(silu_and_mul_triton, gate_up), 3 * tokens * INTER * size)
        cos_sin = rope_cos_sin(HEAD_DIM, 8192, 500000.0, LLAMA3, device="cuda")
        qkv = torch.randn(tokens, (HQ + 2 * HKV) * HEAD_DIM, device="cuda", dtype=dtype)
        q, k, v = (t.view(tokens, -1, HEAD_DIM) for t in qkv.split([HQ * HEAD_DIM, HKV * HEAD_DIM, HKV * HEAD_DIM], -1))
        positions = torch.randint(0, 8192, (tokens,), device="cuda")
        k_cache = torch.empty(math.ceil(tokens / BLOCK) + 1, BLOCK, HKV, HEAD_DIM, device="cuda", dtype=dtype)
        v_cache = torch.empty_like(k_cache)
        slots = torch.randperm(k_cache.shape[0] * BLOCK, device="cuda")[:tokens]
        rope_args = (q, k, v, positions, cos_sin, k_cache, v_cache, slots)
        row("rotary_and_cache", f"T={tokens}", partial(rotary_and_cache_ref, *rope_args),
            partial(rotary_and_cache_triton, *rope_args), tokens * (2 * HQ + 5 * HKV) * HEAD_DIM * size)

    for batch in batches:
        for ctx in contexts:
            k_cache, v_cache, tables = paged_cache(batch, ctx, dtype)
            lens = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
            q = torch.randn(batch, HQ, HEAD_DIM, device="cuda", dtype=dtype)
            kv_bytes = 2 * batch * ctx * HKV * HEAD_DIM * size
            decode = (q, k_cache, v_cache, tables, lens, HEAD_DIM**-0.5)
            row("decode_attention", f"B={batch} ctx={ctx}", partial(paged_decode_attention_ref, *decode),
                partial(paged_decode_attention_triton, *decode), kv_bytes)
            row("  (one split)", f"B={batch} ctx={ctx}", None,
                partial(paged_decode_attention_triton, *decode, num_splits=1), kv_bytes)
            qsl = torch.arange(batch + 1, dtype=torch.int32, device="cuda")
            row("  (prefill kernel)", f"B={batch} ctx={ctx}", None,
                partial(paged_attention_triton, q, k_cache, v_cache, tables, qsl, lens, HEAD_DIM**-0.5), kv_bytes)

    for ctx in contexts:  # one causal prefill of ctx tokens: compute bound, so also print TFLOP/s
        k_cache, v_cache, tables = paged_cache(1, ctx, dtype)
        q = torch.randn(ctx, HQ, HEAD_DIM, device="cuda", dtype=dtype)
        qsl = torch.tensor([0, ctx], dtype=torch.int32, device="cuda")
        lens = torch.tensor([ctx], dtype=torch.int32, device="cuda")
        prefill = (q, k_cache, v_cache, tables, qsl, lens, HEAD_DIM**-0.5)
        nbytes = (2 * ctx * HQ + 2 * ctx * HKV) * HEAD_DIM * size
        row("prefill_attention", f"T=ctx={ctx}", partial(paged_attention_ref, *prefill),
            partial(paged_attention_triton, *prefill), nbytes)
        flops = 2 * 2 * HQ * HEAD_DIM * ctx * ctx / 2  # QK^T and PV over the causal half
        print(f"{'':<22} {'':<26} {'':>10} {'':>10} {'':>9} {flops / bench(partial(paged_attention_triton, *prefill)) / 1e6:>6.0f} TFLOP/s")


if __name__ == "__main__":
    main()
