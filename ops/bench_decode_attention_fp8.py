#!/usr/bin/env python
"""The attention kernels with the FP8 KV cache against the bf16 cache, per FP8 conversion and tile (issue 14).

    PYTHONPATH=. python3 ops/bench_decode_attention_fp8.py            # the H200: ~60 s, compiles included
    TRITON_INTERPRET=1 PYTHONPATH=. python ops/bench_decode_attention_fp8.py --tiny   # CPU dry run (seconds)
    PYTHONPATH=. python ops/bench_decode_attention_fp8.py --ptx     # no GPU: the variants' sm_90 PTX counts
    PYTHONPATH=. python3 ops/bench_decode_attention_fp8.py --w2 --prefill --ahead  # W2's shapes, block numbers
                                                                                    # in the loop and a tile ahead

Llama-3-8B's attention shape (Hq 32, Hkv 8, D 128, block_size 16, shuffled blocks). Decode at batch 1,024 / 256
/ 1 and context 640 / 4,096; the prefill kernel at W2's 8,192-token step (16 prompts of 512). Each row is timed
by replaying a CUDA graph of several launches (median of 5 replays); GB/s counts the K/V bytes that must move
(every cached K and V element once, in the cache's dtype). 'err' is the largest difference from the FP8
'cast' variant's output (the old path), so a variant that computes something else shows. A table on stdout,
JSON under $OUT (or --json) when set.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a bare checkout too

from stoker.engine.kernels import decode_fp8_mma, paged_attention_triton, paged_decode_attention_triton  # noqa: E402
from stoker.engine.kernels.kv_fp8_tiles import Fp8AttentionConfig  # noqa: E402
from stoker.engine.kernels.kv_quant import quantize_kv  # noqa: E402

if os.environ.get("TRITON_INTERPRET") == "1":  # the dry run: the interpreter's numpy >= 2.4 fix (kernel_harness)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # kernel_harness imports its neighbours
    import kernel_harness  # noqa: E402, F401

HQ, HKV, HEAD_DIM, BLOCK = 32, 8, 128, 16
K_SCALE, V_SCALE = torch.tensor([0.02]), torch.tensor([0.01])  # |k| ~ 2-8 and |v| ~ 1-4 land mid-range in e4m3
DECODE_VARIANTS = [Fp8AttentionConfig("cast", 64, 4, 3), Fp8AttentionConfig("f16", 64, 4, 3),
                   Fp8AttentionConfig("f16-vwords", 64, 4, 3), Fp8AttentionConfig("f16-vwords", 128, 4, 3),
                   Fp8AttentionConfig("f16-vwords", 128, 8, 3), Fp8AttentionConfig("bits", 64, 4, 3),
                   Fp8AttentionConfig("f16", 128, 8, 3), Fp8AttentionConfig("mma", 16, 1, 1),
                   Fp8AttentionConfig("mma", 32, 1, 1)]
# "mma": decode_fp8_mma.py's Gluon kernel (one warp a program; num_warps and num_stages unused there). Its
# queries-as-rows form and its prefetch of the next tile were timed in session 21 and removed (decode_fp8_mma.py).
# --w2: W2's decode shape only, the default against tile and stage choices and two splits per sequence (None:
# the launcher's count). The grid-order and V-prefetch variants of 21:09 UTC are gone (kv_fp8_tiles.py), as are
# q8x2 and tile_n 256 (session 15: 595-607 and 827-861 us against the default's 468, BENCHMARKS.md).
V = Fp8AttentionConfig
# The Gluon kernel's forms (decode_fp8_mma.py's module knobs, set around each launch): cp.async ring slots (0:
# loads into registers) and the grid's order (the default walks a sequence's kv heads first). Session 22 call 1
# also timed the register form with the block numbers a tile ahead (removed: 0.5 %).
MMA_FORMS: dict[str, dict[str, int | bool]] = {
    "regs": {"STAGES": 0, "HEAD_MAJOR": True},
    "regs batch-first": {"STAGES": 0, "HEAD_MAJOR": False},
    "async s2": {"STAGES": 2, "HEAD_MAJOR": True},
    "async s3": {"STAGES": 3, "HEAD_MAJOR": True},
    "async s4": {"STAGES": 4, "HEAD_MAJOR": True},
    "async s3 batch-first": {"STAGES": 3, "HEAD_MAJOR": False},
}
W2_VARIANTS: list[tuple[Fp8AttentionConfig, int | None, str | None]] = [  # the likeliest first: a cut run keeps them
    (V("f16-vwords", 64, 4, 3), None, None), (V("mma", 16, 1, 1), None, "async s3"),
    (V("mma", 16, 1, 1), None, "async s2"), (V("mma", 16, 1, 1), None, "async s4"),
    (V("mma", 32, 1, 1), None, "async s3"), (V("mma", 16, 1, 1), None, "regs"),
    (V("mma", 16, 1, 1), None, "async s3 batch-first"), (V("mma", 16, 1, 1), 2, "async s3"),
]
# --ahead: every variant with the block numbers in its loop and a tile ahead (attention.DECODE_TABLE_AHEAD); the
# default runs each with the launchers' default only (None).
AHEAD_LABEL = {None: "", False: " in-loop", True: " ahead"}
PREFILL_VARIANTS = [Fp8AttentionConfig("cast", 64, 4, 3), Fp8AttentionConfig("f16", 64, 4, 3),
                    Fp8AttentionConfig("bits", 64, 4, 3), Fp8AttentionConfig("f16", 32, 4, 3)]


def time_us(fn: Callable[[], torch.Tensor], nbytes: float) -> float:
    """Microseconds per call: a CUDA graph of enough launches for ~20 ms, median of 5 replays (CPU: wall time)."""
    fn()
    if not torch.cuda.is_available():
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e6
    launches = max(2, min(50, int(20e-3 / max(nbytes / 4.0e12, 5e-6))))
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(launches):
            fn()
    graph.replay()
    times = []
    for _ in range(5):
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(begin.elapsed_time(end) * 1e3 / launches)
    return statistics.median(times)


def paged_caches(num_seqs: int, ctx: int, device: str, dtype: torch.dtype
                 ) -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor], torch.Tensor]:
    """bf16 K/V caches of num_seqs contexts, their FP8 quantization (scales below), shuffled block tables."""
    blocks_per_seq = math.ceil(ctx / BLOCK)
    shape = (num_seqs * blocks_per_seq, BLOCK, HKV, HEAD_DIM)
    k = torch.randn(shape, device=device, dtype=dtype) * 2
    v = torch.randn(shape, device=device, dtype=dtype)
    k8, v8 = quantize_kv(k, K_SCALE.to(device)), quantize_kv(v, V_SCALE.to(device))
    tables = torch.randperm(shape[0], device=device).view(num_seqs, blocks_per_seq).int()
    return (k, v), (k8, v8), tables



def record(rows: list[dict], kernel: str, shape: str, variant: str, us: float, nbytes: float, err: float) -> None:
    rows.append({"kernel": kernel, "shape": shape, "variant": variant, "us": round(us, 2),
                 "gb_s": round(nbytes / us / 1e3, 1), "err": err})
    print(f"| {kernel} | {shape} | {variant} | {us:.1f} | {nbytes / us / 1e3:.0f} | {err:.1e} |", flush=True)


def bench_decode(rows: list[dict], batch: int, ctx: int, device: str, dtype: torch.dtype,
                 variants: list[tuple[Fp8AttentionConfig, int | None, str | None]] | None = None,
                 aheads: tuple[bool | None, ...] = (None,)) -> None:
    (k, v), (k8, v8), tables = paged_caches(batch, ctx, device, dtype)
    lens = torch.full((batch,), ctx, dtype=torch.int32, device=device)
    q = torch.randn(batch, HQ, HEAD_DIM, device=device, dtype=dtype)
    scale, shape = HEAD_DIM**-0.5, f"B={batch} ctx={ctx}"
    elems = 2 * batch * ctx * HKV * HEAD_DIM
    for ahead in aheads:
        record(rows, "decode", shape, "bf16 cache" + AHEAD_LABEL[ahead], time_us(
            lambda ahead=ahead: paged_decode_attention_triton(q, k, v, tables, lens, scale, table_ahead=ahead),
            elems * 2), elems * 2, 0.0)
    ks, vs = K_SCALE.to(device), V_SCALE.to(device)
    baseline = None
    defaults = {name: getattr(decode_fp8_mma, name) for name in ("STAGES", "HEAD_MAJOR")}
    chosen = variants or [(c, None, None) for c in DECODE_VARIANTS] + [(V("mma", 16, 1, 1), None, "regs")]
    for (config, splits, form), ahead in [(v, a) for v in chosen for a in aheads]:
        def call(config: Fp8AttentionConfig = config, splits: int | None = splits, ahead: bool = ahead,
                 form: str | None = form) -> torch.Tensor:
            for name, value in (MMA_FORMS[form] if form else defaults).items():
                setattr(decode_fp8_mma, name, value)
            try:
                return paged_decode_attention_triton(q, k8, v8, tables, lens, scale, splits, k_scale=ks, v_scale=vs,
                                                     fp8_config=config, table_ahead=ahead)
            finally:
                for name, value in defaults.items():
                    setattr(decode_fp8_mma, name, value)
        label = ("fp8 " + config.label() + (f" {form}" if form else "") + ("" if splits is None else f" splits {splits}")
                 + AHEAD_LABEL[ahead])
        try:
            out = call().float()
        except Exception as exc:  # a variant that fails to compile must not cost the others their rows
            print(f"| decode | {shape} | {label} | failed: {type(exc).__name__}: {str(exc)[:200]} | | |", flush=True)
            continue
        baseline = out if baseline is None else baseline
        record(rows, "decode", shape, label, time_us(call, elems), elems, (out - baseline).abs().max().item())


def bench_prefill(rows: list[dict], num_seqs: int, prompt: int, device: str, dtype: torch.dtype,
                  aheads: tuple[bool | None, ...] = (None,)) -> None:
    """One prefill step of num_seqs new prompts (W2: 16 x 512 = 8,192 tokens), the cache already written."""
    (k, v), (k8, v8), tables = paged_caches(num_seqs, prompt, device, dtype)
    qsl = torch.arange(num_seqs + 1, device=device, dtype=torch.int32) * prompt
    lens = torch.full((num_seqs,), prompt, dtype=torch.int32, device=device)
    q = torch.randn(num_seqs * prompt, HQ, HEAD_DIM, device=device, dtype=dtype)
    scale, shape = HEAD_DIM**-0.5, f"T={num_seqs * prompt} ({num_seqs}x{prompt})"
    elems = 2 * num_seqs * prompt * HKV * HEAD_DIM
    for ahead in aheads:
        record(rows, "prefill", shape, "bf16 cache" + AHEAD_LABEL[ahead], time_us(
            lambda ahead=ahead: paged_attention_triton(q, k, v, tables, qsl, lens, scale, table_ahead=ahead),
            elems * 2), elems * 2, 0.0)
    ks, vs = K_SCALE.to(device), V_SCALE.to(device)
    baseline = None
    for config, ahead in [(c, a) for c in PREFILL_VARIANTS for a in aheads]:
        def call(config: Fp8AttentionConfig = config, ahead: bool = ahead) -> torch.Tensor:
            return paged_attention_triton(q, k8, v8, tables, qsl, lens, scale, ks, vs, fp8_config=config,
                                          table_ahead=ahead)
        out = call().float()
        baseline = out if baseline is None else baseline
        record(rows, "prefill", shape, "fp8 " + config.label() + AHEAD_LABEL[ahead], time_us(call, elems), elems,
               (out - baseline).abs().max().item())


def ptx_table() -> None:
    """No GPU needed: each decode variant (and the bf16 cache) compiled for sm_90 by Triton and ptxas here, with
    the PTX counts that explain its speed (the bf16 cache's loop is the bar): instructions, pipelined copies,
    byte-wide shared-memory loads, per-element fp16 -> bf16 conversions, ldmatrix, shared memory."""
    import inspect
    import re

    from stoker.engine.kernels import attention
    from stoker.engine.kernels.kv_fp8_tiles import FP8_MODES
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, compile

    fn = attention._decode_split_kernel
    names = list(inspect.signature(fn.fn).parameters)
    print("| decode kernel, sm_90 PTX | instructions | cp.async* | ld.shared.b8 | cvt.bf16.f16 | ldmatrix | shared B |")
    print("|---|---|---|---|---|---|---|")
    split_variants = [c for c in DECODE_VARIANTS if c.mode != "mma"]  # "mma" is decode_fp8_mma.py's kernel (its
    # sm_90 compile: tests/test_decode_fp8_mma.py)
    for label, config in [("bf16 cache", None)] + [("fp8 " + c.label(), c) for c in split_variants]:
        cache = "bf16" if config is None else "fp8e4nv"
        types = {"k_cache_ptr": "*" + cache, "v_cache_ptr": "*" + cache, "block_tables_ptr": "*i32",
                 "context_lens_ptr": "*i32", "k_scale_ptr": "*fp32", "v_scale_ptr": "*fp32", "qk_scale": "fp32"}
        signature = {n: types.get(n, "*fp32" if n.startswith("part_") else "*bf16" if n.endswith("_ptr")
                                  else "constexpr" if n.isupper() else "i32") for n in names}
        aligned = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names)
                   if n.endswith("_ptr") or (n.endswith("_stride") and not n.startswith("block_table"))}
        mode = 0 if config is None else FP8_MODES[config.mode]
        constexprs = dict(NUM_KV_HEADS=HKV, GROUP=HQ // HKV, BLOCK_G=16, HEAD_DIM=HEAD_DIM, BLOCK_D=HEAD_DIM,
                          BLOCK_SIZE=BLOCK, TILE_N=64 if config is None else config.tile_n, NUM_SPLITS=1,
                          DOT_PRECISION="tf32", FP8_CACHE=config is not None, FP8_MODE=mode, DOT_FP16=mode != 0,
                          FP8_PTX=mode == 3)
        options = {"num_warps": 4} if config is None else {"num_warps": config.num_warps,
                                                           "num_stages": config.num_stages}
        kernel = compile(ASTSource(fn, signature, constexprs=constexprs, attrs=aligned),
                         target=GPUTarget("cuda", 90, 32), options=options)
        ptx = kernel.asm["ptx"]
        instructions = len(re.findall(r"^\s+[a-z@]", ptx, re.M))  # PTX lines of the whole kernel, not directives
        print(f"| {label} | {instructions} | {ptx.count('cp.async')} | "
              f"{ptx.count('ld.shared.b8')} | {ptx.count('cvt.bf16.f16')} | {ptx.count('ldmatrix')} | "
              f"{kernel.metadata.shared} |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tiny", action="store_true", help="tiny shapes (the CPU dry run under the interpreter)")
    parser.add_argument("--json", default=None, help="where to write the rows (default $OUT/... when OUT is set)")
    parser.add_argument("--ptx", action="store_true", help="no GPU: the variants' sm_90 PTX counts, then exit")
    parser.add_argument("--w2", action="store_true", help="W2's decode shape only (B=1,024 ctx 640, then B=1,024 "
                        "ctx 768), W2_VARIANTS")
    parser.add_argument("--ahead", action="store_true", help="each variant with the block numbers loaded in its "
                        "loop and a tile ahead (attention.DECODE_TABLE_AHEAD / PREFILL_TABLE_AHEAD)")
    parser.add_argument("--prefill", action="store_true", help="with --w2: W2's prefill step (16 x 512) too")
    parser.add_argument("--budget-s", type=float, default=1e9, help="start no new shape after this many seconds")
    opts = parser.parse_args()
    if opts.ptx:
        ptx_table()
        return
    cuda = torch.cuda.is_available()
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float16)
    if not cuda and not opts.tiny:
        sys.exit("bench_decode_attention_fp8 needs a CUDA GPU (or --tiny under TRITON_INTERPRET=1)")
    torch.manual_seed(0)
    # W2's shapes first (its decode batch, then its prefill step), so a cut budget loses the least.
    decode_shapes = [(2, 20)] if opts.tiny else [(1024, 640), (1024, 4096), (256, 640), (256, 4096),
                                                             (1, 640), (1, 4096)]
    prefill_shape = (1, 16) if opts.tiny else (16, 512)
    common = {"device": device, "dtype": dtype, "aheads": (False, True) if opts.ahead else (None,)}
    prefill_job = partial(bench_prefill, num_seqs=prefill_shape[0], prompt=prefill_shape[1], **common)
    jobs: list[Callable[[list[dict]], None]] = [partial(bench_decode, batch=b, ctx=c, **common)
                                                for b, c in decode_shapes]
    jobs.insert(1, prefill_job)
    if opts.w2:
        w2_shapes = [(2, 20), (3, 7)] if opts.tiny else [(1024, 640), (1024, 768)]
        jobs = [partial(bench_decode, batch=b, ctx=c, variants=W2_VARIANTS, **common) for b, c in w2_shapes]
        if opts.prefill:
            jobs.insert(1, prefill_job)
    print(f"{torch.cuda.get_device_name() if cuda else 'cpu (interpreter)'}  torch {torch.__version__}  "
          f"Hq {HQ} Hkv {HKV} D {HEAD_DIM} block {BLOCK}")
    print("| kernel | shape | cache / variant | us | GB/s | err vs fp8 cast |\n|---|---|---|---|---|---|")
    rows: list[dict] = []
    target = opts.json or (os.path.join(os.environ["OUT"], "bench_decode_attention_fp8.json") if os.environ.get("OUT") else None)
    started = time.monotonic()
    for job in jobs:
        if time.monotonic() - started > opts.budget_s:
            print(f"budget of {opts.budget_s:.0f} s spent: {len(jobs) - jobs.index(job)} shapes not run")
            break
        job(rows)
        if cuda:
            torch.cuda.empty_cache()
        if target:  # after every shape, so a run cut short keeps what it measured
            Path(target).write_text(json.dumps({"device": torch.cuda.get_device_name() if cuda else "cpu",
                                                "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
