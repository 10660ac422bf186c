"""Does W2's batch step get faster under the H200's power cap when the residual add goes into the GEMM before it?
`addmm`: o_proj and down add their product into the running sum in cuBLAS's epilogue (`residual.addmm_(x, W.t())`,
beta = 1; Linear.forward_add), so the RMSNorm after each reads one tensor and writes one instead of adding two and
writing two (67 MB each at 8,192 tokens of the 8B shape). Timed as one 8B layer's projections and norms run them
(attention left out), against the unfused layer.

W2 runs at the 700 W cap (SM ~1,500 MHz): what a change saves there is energy as much as time, so the variants run
in alternating rounds on one hot GPU for a while, the SM clock and power logged beside them (ops/gpu_clock.py).
(Session 26 also timed a Triton gate|up GEMM with SiLU-and-mul in its epilogue here, 63d0973: 13 % slower than
cuBLAS's GEMM at full clock, +9 % a layer under the cap; dropped, BENCHMARKS.md.)

    PYTHONPATH=. python3 ops/bench_epilogue_fusion.py [--tokens 8192,1024] [--seconds 30]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from functools import partial

import torch
import torch.nn.functional as F
from stoker.engine.kernels.activation import silu_and_mul_triton
from stoker.engine.kernels.rmsnorm import rms_norm_triton
from stoker.ops.gpu_clock import ClockLog

HIDDEN, INTER, QKV = 4096, 14336, 6144  # Llama-3-8B
EPS = 1e-5


def ms_per_call(fn: Callable[[], object], calls: int) -> float:
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / calls * 1e3


class Layer:
    """One layer's o_proj -> norm -> gate|up -> activation -> down -> norm -> next qkv at `tokens` rows."""

    def __init__(self, tokens: int) -> None:
        def weight(out: int, inp: int) -> torch.Tensor:
            return torch.randn(out, inp, device="cuda", dtype=torch.bfloat16) * 0.02

        self.w_o, self.w_gu, self.w_down, self.w_qkv = (
            weight(HIDDEN, HIDDEN), weight(2 * INTER, HIDDEN), weight(HIDDEN, INTER), weight(QKV, HIDDEN))
        self.norm = torch.ones(HIDDEN, device="cuda", dtype=torch.bfloat16)
        self.attn = torch.randn(tokens, HIDDEN, device="cuda", dtype=torch.bfloat16)
        self.residual0 = torch.randn(tokens, HIDDEN, device="cuda", dtype=torch.bfloat16)
        self.tokens = tokens
        self.flops = 2.0 * tokens * HIDDEN * (HIDDEN + 2 * INTER + INTER + QKV)

    def run(self, addmm: bool) -> torch.Tensor:
        residual = self.residual0.clone()  # the engine's residual is a fresh tensor each layer (the norm's sum)
        if addmm:
            residual.addmm_(self.attn, self.w_o.t())
            h = rms_norm_triton(residual, self.norm, EPS)[0]
        else:
            h, residual = rms_norm_triton(F.linear(self.attn, self.w_o), self.norm, EPS, residual)
        act = silu_and_mul_triton(F.linear(h, self.w_gu))
        if addmm:
            residual.addmm_(act, self.w_down.t())
            h = rms_norm_triton(residual, self.norm, EPS)[0]
        else:
            h, residual = rms_norm_triton(F.linear(act, self.w_down), self.norm, EPS, residual)
        return F.linear(h, self.w_qkv)


def bench_tokens(tokens: int, seconds: float) -> None:
    layer = Layer(tokens)
    variants = {"unfused": False, "addmm": True}
    reference = layer.run(False).float()
    errors = {name: (layer.run(v).float() - reference).abs().max().item() for name, v in variants.items()}
    per_round = max(1, int(0.3e3 / ms_per_call(partial(layer.run, False), 3)))
    times: dict[str, list[float]] = {name: [] for name in variants}
    with ClockLog() as clocks:
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            for name, addmm in variants.items():
                times[name].append(ms_per_call(partial(layer.run, addmm), per_round))
    c = clocks.summary()
    base = statistics.median(times["unfused"])
    print(f"\n## one layer's projections and norms at {tokens} tokens, sustained: {seconds:.0f} s of "
          f"alternating rounds of {per_round} layers\n")
    print("| variant | ms a layer, median (min-max) | TFLOP/s | vs unfused | x 32 layers | max diff vs unfused |")
    print("|---|---|---|---|---|---|")
    for name, ts in times.items():
        med = statistics.median(ts)
        print(f"| {name} | {med:.3f} ({min(ts):.3f}-{max(ts):.3f}) | {layer.flops / med / 1e9:.0f} | "
              f"{med / base:.3f}x | {32 * (med - base):+.2f} ms a step | {errors[name]:.2e} |")
    if "error" in c:
        print(f"SM clock / power: not sampled: {c['error']}")
    else:
        print(f"SM clock median {c['sm_mhz_median']:.0f} MHz (p10-p90 {c['sm_mhz_p10']:.0f}-{c['sm_mhz_p90']:.0f}); "
              f"power median {c['power_w_median']:.0f} W; throttle reasons {c['throttle_reasons']}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", default="8192,1024", help="comma-separated row counts (W2's prefill and decode steps)")
    ap.add_argument("--seconds", type=float, default=30.0, help="sustained rounds per token count")
    args = ap.parse_args(argv)
    print(f"device {torch.cuda.get_device_name()}, torch {torch.__version__}")
    for tokens in (int(t) for t in args.tokens.split(",")):
        bench_tokens(tokens, args.seconds)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
