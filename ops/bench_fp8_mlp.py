#!/usr/bin/env python
"""Times the decode MLP on FP8 weights (issue 14, FP8 W1): the two W8A16 GEMVs the fused decode path runs today
(gate_up + SiLU-and-mul, down + residual add; gemv.py with the launch shape and E4M3 conversion fp8_launch picks)
against kernels/fused_mlp_fp8.py (the activations as two E4M3 terms on the FP8 tensor cores) at several launch
shapes, at M tokens. From the repo root:

    PYTHONPATH=. python3 ops/bench_fp8_mlp.py [--shape 8b] [--ms 1,2,4,8,16]          # CUDA, ~1 min
    TRITON_INTERPRET=1 PYTHONPATH=. python3 ops/bench_fp8_mlp.py --dry-run              # CPU, tiny shapes

Timing as ops/bench_gemv.py: layer copies rotating in one CUDA graph (>= 512 MB of FP8 weights, so every call
streams from HBM), us per layer; TB/s counts the FP8 bytes and the row scales; % copy against the copy bandwidth
of the same run. Both paths normalise in their prologue at M <= 2 (norm weight applied to x, as the engine under
"fused-folded" with its default prologue cap) and take normalised x above. Each row's error is its largest
absolute difference from fused_mlp_fp8_ref (the two GEMVs' arithmetic on the dequantized weights, plain torch) on
the first copy, beside the output's own largest magnitude; with $OUT set the rows go to $OUT/fp8_mlp.json.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a bare checkout too
sys.path.insert(0, str(Path(__file__).resolve().parent))  # the timing helpers of bench_gemv.py

if os.environ.get("TRITON_INTERPRET") == "1":  # numpy >= 2.4 under the interpreter: the tests' index patch
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    import kernel_harness  # noqa: E402, F401

from bench_fp8_gemv import wall_us  # noqa: E402
from bench_gemv import MODELS, copy_bandwidth, graph_us  # noqa: E402
from stoker.engine.kernels.fp8_linear import quantize_rows  # noqa: E402
from stoker.engine.kernels.fused_mlp_fp8 import Fp8MlpConfig, fused_mlp_fp8_ref, fused_mlp_fp8_triton  # noqa: E402
from stoker.engine.kernels.gemv import gemv_triton  # noqa: E402
from stoker.engine.models.fused_decode import fp8_launch  # noqa: E402

EPS = 1e-5
PROLOGUE_MAX_M = 2  # EngineConfig.decode_prologue_norm_max_m's default
# (bi, bk, bh, warps, stages): the engine's pick first; ptxas on the CPU (sm_90) gave bi 128 bk 128 bh 256 w4 s3
# 232 registers and 108 KB of shared memory, bi 64 138 registers and 60 KB, w8 134 registers.
CONFIGS = [Fp8MlpConfig(128, 128, 256, 4, 3), Fp8MlpConfig(64, 128, 256, 4, 3), Fp8MlpConfig(128, 128, 256, 8, 3),
           Fp8MlpConfig(64, 128, 256, 4, 4), Fp8MlpConfig(64, 256, 256, 4, 3), Fp8MlpConfig(128, 128, 128, 4, 4),
           Fp8MlpConfig(64, 128, 128, 4, 4), Fp8MlpConfig(128, 256, 256, 8, 2), Fp8MlpConfig(64, 128, 256, 8, 3),
           Fp8MlpConfig(32, 128, 256, 4, 4)]


class Layer:
    """One layer's FP8 MLP weights (row scales) and its norm weight."""

    def __init__(self, hidden: int, inter: int, device: str):
        gate_up = torch.randn(2 * inter, hidden, device=device) * hidden**-0.5
        down = torch.randn(hidden, inter, device=device) * inter**-0.5
        self.gate_up, self.gate_up_scale = quantize_rows(gate_up)
        self.down, self.down_scale = quantize_rows(down)
        self.g = (1 + 0.1 * torch.randn(hidden, device=device)).to(torch.bfloat16)
        self.nbytes = (self.gate_up.numel() + self.down.numel()) + 4 * (2 * inter + hidden)


def gemvs(layer: Layer, x: torch.Tensor, residual: torch.Tensor, norm: bool) -> torch.Tensor:
    """The fused decode path's two FP8 GEMVs, launched as fused_decode.py launches them."""
    m, on_gpu = x.shape[0], x.is_cuda
    n, k = layer.gate_up.shape
    cfg, convert = fp8_launch("silu", n, k, m, on_gpu)
    act, _ = gemv_triton(x, layer.gate_up, silu_mul=True, eps=EPS, weight_scale=layer.gate_up_scale,
                         weight_convert=convert, config=cfg, norm_weight=layer.g if norm else None)
    n, k = layer.down.shape
    cfg, convert = fp8_launch("add", n, k, m, on_gpu)
    return gemv_triton(act, layer.down, add=residual, weight_scale=layer.down_scale, weight_convert=convert,
                       config=cfg)[0]


def terms(layer: Layer, x: torch.Tensor, residual: torch.Tensor, norm: bool, cfg: Fp8MlpConfig | None,
          acc: torch.Tensor) -> torch.Tensor:
    return fused_mlp_fp8_triton(x, layer.gate_up, layer.gate_up_scale, layer.down, layer.down_scale, residual,
                                eps=EPS, norm=norm, norm_weight=layer.g if norm else None, config=cfg, accumulator=acc)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=sorted(MODELS), default="8b")
    ap.add_argument("--ms", default="1,2,4,8,16")
    ap.add_argument("--dry-run", action="store_true", help="CPU interpreter, tiny shape, the engine's configs")
    opts = ap.parse_args()
    dry = opts.dry_run
    device = "cpu" if dry else "cuda"
    hidden, _, _, _, inter = MODELS["tiny" if dry else opts.shape]
    torch.manual_seed(0)
    layer_bytes = (3 * hidden * inter) + 4 * (2 * inter + hidden)
    count = 2 if dry else max(4, -(-512 * 2**20 // layer_bytes))
    layers = [Layer(hidden, inter, device) for _ in range(count)]
    bw = 0.0 if dry else copy_bandwidth()
    timer: Callable[[list], float] = (lambda calls: wall_us(calls)) if dry else graph_us
    acc = torch.zeros(16 * hidden, dtype=torch.float32, device=device)
    rows: list[dict] = []
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s; {opts.shape if not dry else 'tiny'}: H {hidden} I {inter}, "
          f"{count} layer copies of {layers[0].nbytes / 1e6:.1f} MB")
    print("| M | variant | us a layer | TB/s | % copy | max abs err vs ref | max abs out |")
    print("|---|---|---|---|---|---|---|")
    variants: list[tuple[str, Fp8MlpConfig | None]] = [("gemvs", None)]
    variants += [("terms " + ("engine" if dry else f"bi{c.bi} bk{c.bk} bh{c.bh} w{c.num_warps} s{c.num_stages}"), c)
                 for c in ([None] if dry else CONFIGS)]
    for m in [int(v) for v in opts.ms.split(",")]:
        norm = m <= PROLOGUE_MAX_M
        x = (torch.randn(m, hidden, device=device) * (3.0 if norm else 1.0)).to(torch.bfloat16 if not dry else
                                                                                 torch.float16)
        res = torch.randn(m, hidden, device=device).to(x.dtype)
        first = layers[0]
        if dry:
            first.g = first.g.to(x.dtype)
            for lay in layers:
                lay.g = lay.g.to(x.dtype)
        ref = fused_mlp_fp8_ref(x, first.gate_up, first.gate_up_scale, first.down, first.down_scale, res, eps=EPS,
                                norm=norm, norm_weight=first.g if norm else None).float()
        for label, cfg in variants:
            def call(lay: Layer, cfg: Fp8MlpConfig | None = cfg, label: str = label, x: torch.Tensor = x,
                     res: torch.Tensor = res, norm: bool = norm) -> torch.Tensor:
                if label == "gemvs":
                    return gemvs(lay, x, res, norm)
                return terms(lay, x, res, norm, cfg, acc)
            try:
                err = (call(first).float() - ref).abs().max().item()
                us = timer([lambda lay=lay: call(lay) for lay in layers])
            except Exception as exc:  # a launch shape that does not compile or fit must not cost the others
                print(f"| {m} | {label} | failed: {type(exc).__name__}: {str(exc)[:160]} | | | | |", flush=True)
                continue
            tbs = first.nbytes / us / 1e6
            pct = 100 * tbs * 1e12 / bw if bw else 0.0
            rows.append({"m": m, "variant": label, "us": round(us, 2), "tb_s": round(tbs, 3), "pct_copy": round(pct, 1),
                         "err": err, "out_max": ref.abs().max().item()})
            print(f"| {m} | {label} | {us:.2f} | {tbs:.2f} | {pct:.0f} | {err:.2e} | {ref.abs().max().item():.2f} |",
                  flush=True)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "fp8_mlp.json").write_text(json.dumps({"copy_bw": bw, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
