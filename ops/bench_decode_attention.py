#!/usr/bin/env python
"""Decode attention's two ways to combine its splits, timed at the 8B and 1B shapes (issue 13 item 1):
"2 kernels" = the split kernel then the reduce kernel; "fused" = the last split of each (sequence, kv head)
combines in the split kernel (counters). From the repo root:

    PYTHONPATH=. python3 ops/bench_decode_attention.py [--cases 8b:1x768x1024,1b:16x4096x8192]
    TRITON_INTERPRET=1 PYTHONPATH=. python3 ops/bench_decode_attention.py --dry-run   # CPU, tiny, no timing worth reading

Timing as in a decode graph: each variant is captured in a CUDA graph as a chain of CHAIN launches over
rotating layers' caches (>= 256 MB in all, so K/V come from HBM as in the engine) and the graph is replayed;
us per launch = replay time / CHAIN. The block table is static and 1024 or 8192 tokens wide (the engine's
graphs use max_model_len), contexts are live lengths inside it. Each
output is checked against the reference once before timing. Prints a table; writes
$OUT/decode_attention.json when OUT is set.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a bare checkout too
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_gemv import graph_us  # noqa: E402
from stoker.engine.kernels.attention import (  # noqa: E402
    decode_combine_counters,
    paged_decode_attention_ref,
    paged_decode_attention_triton,
)

SHAPES = {"8b": (32, 8, 128), "1b": (32, 8, 64), "tiny": (4, 2, 16)}  # Hq, Hkv, head_dim
BLOCK_SIZE = 16
LAYERS = 32
CHAIN = 64
ROTATE_BYTES = 256 * 2**20  # well past the H200's 50 MB L2
DEFAULT_CASES = ("8b:1x768x1024,8b:4x768x1024,8b:16x768x1024,8b:64x768x1024,8b:1x4096x8192,8b:8x4096x8192,"
                 "1b:1x768x1024,1b:16x768x1024")


class Case:
    """One shape, batch and context: enough layers' caches to rotate through ROTATE_BYTES (so K/V stream from
    HBM), each row owning its context's blocks; the table's columns past them point at block 0, never read."""

    def __init__(self, shape: str, batch: int, context: int, width: int, device: str, dtype: torch.dtype,
                 max_layers: int):
        hq, hkv, head_dim = SHAPES[shape]
        owned = -(-context // BLOCK_SIZE)
        num_blocks = batch * owned
        layer_bytes = 2 * num_blocks * BLOCK_SIZE * hkv * head_dim * dtype.itemsize
        self.layers = max(2, min(max_layers, -(-ROTATE_BYTES // layer_bytes)))
        self.caches = [(torch.randn(num_blocks, BLOCK_SIZE, hkv, head_dim, device=device, dtype=dtype),
                        torch.randn(num_blocks, BLOCK_SIZE, hkv, head_dim, device=device, dtype=dtype))
                       for _ in range(self.layers)]
        order = torch.randperm(num_blocks, device=device).to(torch.int32)
        self.tables = torch.zeros(batch, width // BLOCK_SIZE, dtype=torch.int32, device=device)
        self.tables[:, :owned] = order.view(batch, owned)
        self.context_lens = torch.full((batch,), context, dtype=torch.int32, device=device)
        self.q = torch.randn(batch, hq, head_dim, device=device, dtype=dtype)
        self.counters = [decode_combine_counters(batch, hkv, device) for _ in range(self.layers)]
        self.scale = head_dim**-0.5

    def call(self, layer: int, fused: bool) -> Callable[[], torch.Tensor]:
        k, v = self.caches[layer]
        counters = self.counters[layer] if fused else None
        return lambda: paged_decode_attention_triton(self.q, k, v, self.tables, self.context_lens, self.scale,
                                                     counters=counters)

    def check(self, fused: bool, dtype: torch.dtype) -> float:
        k, v = self.caches[0]
        out = self.call(0, fused)()
        ref = paged_decode_attention_ref(self.q, k, v, self.tables, self.context_lens, self.scale)
        err = (out.float() - ref.float()).abs().max().item()
        if err > {torch.bfloat16: 3e-2, torch.float16: 4e-3, torch.float32: 2e-4}[dtype]:
            raise SystemExit(f"decode attention ({'fused' if fused else '2 kernels'}) is off the reference by {err}")
        return err


def time_chain(calls: list[Callable[[], torch.Tensor]], on_gpu: bool, replays: int = 10) -> float:
    """us per call: CUDA-graph replay of the chain on the GPU (ops/bench_gemv.py's graph_us); eager wall clock
    in a CPU dry run."""
    if on_gpu:
        return graph_us(calls, replays)
    start = time.perf_counter()
    for call in calls:
        call()
    return (time.perf_counter() - start) * 1e6 / len(calls)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cases", default=DEFAULT_CASES, help="shape:BATCHxCONTEXTxTABLE_WIDTH, comma-separated")
    ap.add_argument("--dry-run", action="store_true", help="CPU under TRITON_INTERPRET=1, tiny shapes")
    opts = ap.parse_args()
    on_gpu = not opts.dry_run
    if on_gpu and not torch.cuda.is_available():
        sys.exit("bench_decode_attention needs a CUDA GPU (or --dry-run under TRITON_INTERPRET=1)")
    if opts.dry_run and os.environ.get("TRITON_INTERPRET") != "1":
        sys.exit("--dry-run runs the kernels in Triton's interpreter: set TRITON_INTERPRET=1")
    if opts.dry_run:  # triton 3.6's interpreter needs tests/kernel_harness.py's numpy >= 2.4 fix
        sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
        import kernel_harness  # noqa: F401
    device, dtype = ("cuda", torch.bfloat16) if on_gpu else ("cpu", torch.float32)
    cases = opts.cases.split(",") if on_gpu else ["tiny:1x40x64", "tiny:3x40x64"]
    max_layers, chain = (LAYERS, CHAIN) if on_gpu else (2, 2)
    torch.manual_seed(0)
    if on_gpu:
        print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}  bf16, block_size {BLOCK_SIZE}")
    print("| shape | batch | context | table width | 2 kernels us | fused us | saved us | fused err |")
    print("|---|---|---|---|---|---|---|---|")
    rows = []
    for spec in cases:
        shape, dims = spec.split(":")
        batch, context, width = (int(v) for v in dims.split("x"))
        case = Case(shape, batch, context, width, device, dtype, max_layers)
        err = case.check(True, dtype)
        case.check(False, dtype)
        us = {}
        for fused in (False, True):
            us[fused] = time_chain([case.call(i % case.layers, fused) for i in range(chain)], on_gpu)
        rows.append({"shape": shape, "batch": batch, "context": context, "width": width,
                     "two_kernels_us": us[False], "fused_us": us[True], "fused_err": err})
        print(f"| {shape} | {batch} | {context} | {width} | {us[False]:.2f} | {us[True]:.2f} | "
              f"{us[False] - us[True]:+.2f} | {err:.1e} |", flush=True)
        del case
        if on_gpu:
            torch.cuda.empty_cache()
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "decode_attention.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
