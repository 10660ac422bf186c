#!/usr/bin/env python
"""The FP8 prefill GEMM's pieces at W2's step sizes, 8B shapes (issue 14): activation quantization, row-wise
`torch._scaled_mm` (with and without cuBLAS's fast FP8 accumulation), bf16 F.linear beside them, and the
fused norm / SiLU-mul + quantization kernels (fp8_quant.py) against the two kernels each replaces.

    PYTHONPATH=. python3 ops/bench_fp8_prefill.py                 # the H200: ~10 s
    TRITON_INTERPRET=1 PYTHONPATH=. python3 ops/bench_fp8_prefill.py --tiny   # CPU dry run (tiny, wall clock)

Each row: us per call (CUDA events around `reps` eager calls after warm-up), TFLOP/s for GEMMs, GB/s of the
bytes the op must move for the rest. Eager: an op shorter than its host launch (~60-70 us for these Triton
launchers on the H200, 21:37 UTC) reads as the launch time, so the small quantizations (K = 4,096, and all at
M = 1,024) are host-bound readings; ops/step_profile.py's device times are the kernels'. A table on stdout,
JSON under $OUT when set.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a bare checkout too

from stoker.engine.kernels import rms_norm, silu_and_mul  # noqa: E402
from stoker.engine.kernels.fp8_linear import quantize_activations, quantize_rows  # noqa: E402
from stoker.engine.kernels.fp8_quant import rms_norm_quant_fp8_triton, silu_mul_quant_fp8_triton  # noqa: E402
from stoker.ops.step_profile import event_ms  # noqa: E402

PROJECTIONS_8B = {"qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 28672), "down": (14336, 4096)}


def time_us(fn: Callable[[], object], cuda: bool, reps: int = 20) -> float:
    """Mean us of fn() (step_profile's CUDA-event timing; host time on the CPU dry run)."""
    return event_ms(torch.device("cuda" if cuda else "cpu"), fn, warm=3, reps=reps) * 1e3


def row(rows: list[dict], m: int, name: str, us: float, flops: float = 0.0, nbytes: float = 0.0) -> None:
    rate = f"{flops / us / 1e6:.0f} TFLOP/s" if flops else f"{nbytes / us / 1e3:.0f} GB/s"
    rows.append({"m": m, "op": name, "us": round(us, 2), "tflops": round(flops / us / 1e6, 1) if flops else None,
                 "gb_s": round(nbytes / us / 1e3, 1) if nbytes else None})
    print(f"| {m} | {name} | {us:.1f} | {rate} |", flush=True)


def gemms(rows: list[dict], m: int, projections: dict[str, tuple[int, int]], device: str, cuda: bool) -> None:
    dtype = torch.bfloat16 if cuda else torch.float32
    for name, (k, n) in projections.items():
        x = torch.randn(m, k, device=device, dtype=dtype)
        w = torch.randn(n, k, device=device, dtype=dtype) * 0.02
        w8, ws = quantize_rows(w)
        flops = 2.0 * m * k * n
        row(rows, m, f"{name} quantize x [{m}x{k}]", time_us(lambda x=x: quantize_activations(x, None), cuda),
            nbytes=3.0 * m * k)
        row(rows, m, f"{name} bf16 F.linear", time_us(lambda x=x, w=w: F.linear(x, w), cuda), flops)
        if not cuda:
            continue
        xq, xs = quantize_activations(x, None)
        for fast in (False, True):
            def mm(fast: bool = fast, xq: torch.Tensor = xq, xs: torch.Tensor = xs, w8: torch.Tensor = w8,
                   ws: torch.Tensor = ws) -> torch.Tensor:
                return torch._scaled_mm(xq, w8.t(), scale_a=xs, scale_b=ws.view(1, -1), out_dtype=dtype,
                                        use_fast_accum=fast)
            row(rows, m, f"{name} _scaled_mm{' fast_accum' if fast else ''}", time_us(mm, cuda), flops)
        exact = torch._scaled_mm(xq, w8.t(), scale_a=xs, scale_b=ws.view(1, -1), out_dtype=torch.float32)
        fast_out = torch._scaled_mm(xq, w8.t(), scale_a=xs, scale_b=ws.view(1, -1), out_dtype=torch.float32,
                                    use_fast_accum=True)
        rel = ((fast_out - exact).norm() / exact.norm()).item()
        print(f"|   | {name} fast_accum vs exact accumulation: relative error {rel:.2e} | | |", flush=True)
        rows.append({"m": m, "op": f"{name} fast_accum rel err", "rel": rel})


def fusions(rows: list[dict], m: int, hidden: int, inter: int, device: str, cuda: bool) -> None:
    dtype = torch.bfloat16 if cuda else torch.float16
    x, res = torch.randn(m, hidden, device=device, dtype=dtype), torch.randn(m, hidden, device=device, dtype=dtype)
    g = torch.ones(hidden, device=device, dtype=dtype)
    two = lambda: quantize_activations(rms_norm(x, g, 1e-5, res)[0], None)  # noqa: E731
    row(rows, m, f"rmsnorm+residual then quantize [{m}x{hidden}]", time_us(two, cuda), nbytes=9.0 * m * hidden)
    row(rows, m, "rms_norm_quant_fp8 (fused)", time_us(lambda: rms_norm_quant_fp8_triton(x, g, 1e-5, res, None), cuda),
        nbytes=7.0 * m * hidden)
    gate_up = torch.randn(m, 2 * inter, device=device, dtype=dtype)
    row(rows, m, f"silu_and_mul then quantize [{m}x{inter}]",
        time_us(lambda: quantize_activations(silu_and_mul(gate_up), None), cuda), nbytes=9.0 * m * inter)
    row(rows, m, "silu_mul_quant_fp8 (fused)", time_us(lambda: silu_mul_quant_fp8_triton(gate_up, None), cuda),
        nbytes=5.0 * m * inter)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tiny", action="store_true", help="tiny shapes (the CPU dry run)")
    parser.add_argument("--ms", default="8192,1024", help="token counts (W2's prefill step, its decode batch)")
    opts = parser.parse_args()
    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    if not cuda and not opts.tiny:
        sys.exit("bench_fp8_prefill needs a CUDA GPU (or --tiny)")
    projections = {"qkv": (64, 96), "down": (224, 64)} if opts.tiny else PROJECTIONS_8B
    hidden, inter = (64, 224) if opts.tiny else (4096, 14336)
    ms = [32] if opts.tiny else [int(m) for m in opts.ms.split(",")]
    print(f"{torch.cuda.get_device_name() if cuda else 'cpu'}  torch {torch.__version__}")
    print("| M | op | us | rate |\n|---|---|---|---|")
    rows: list[dict] = []
    for m in ms:
        fusions(rows, m, hidden, inter, device, cuda)
        gemms(rows, m, projections, device, cuda)
        if os.environ.get("OUT"):  # after every M, so a cut run keeps what it measured
            Path(os.environ["OUT"], "bench_fp8_prefill.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
