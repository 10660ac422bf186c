"""Does W2's batch step get faster under the H200's power cap when the elementwise kernels between its GEMMs go into
the GEMMs? Two fusions, timed as one 8B layer's projections and norms run them (attention left out):

- `silu`: the gate|up GEMM with SiLU-and-mul in its epilogue (engine/kernels/gated_gemm.py, Triton) instead of
  cuBLAS's gate_up then silu_and_mul (0.7 GB written and reread a layer at 8,192 tokens);
- `addmm`: o_proj and down add their product into the residual in cuBLAS's epilogue (`residual.addmm_(x, W.t())`,
  beta = 1), so the next RMSNorm reads one tensor and writes one instead of adding two and writing two.

W2 runs at the 700 W cap (SM ~1,500 MHz): a fused kernel that is faster at full clock can still lose if its GEMM
spends more energy a FLOP than cuBLAS's. So the variants run in alternating rounds on one hot GPU for a while, the
SM clock and power logged beside them (ops/gpu_clock.py). First a burst table of the gate|up step alone (cuBLAS +
the activation against each config of gated_gemm.GATED_GEMM_SWEEP), which picks the config the rounds use.

    PYTHONPATH=. python3 ops/bench_mlp_fusion.py [--tokens 8192,1024] [--seconds 30]
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
from stoker.engine.kernels.gated_gemm import GATED_GEMM_SWEEP, GatedGemmConfig, gate_up_silu_triton
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

    def run(self, silu: GatedGemmConfig | None, addmm: bool) -> torch.Tensor:
        residual = self.residual0.clone()  # the engine's residual is a fresh tensor each layer (the norm's sum)
        if addmm:
            residual.addmm_(self.attn, self.w_o.t())
            h = rms_norm_triton(residual, self.norm, EPS)[0]
        else:
            h, residual = rms_norm_triton(F.linear(self.attn, self.w_o), self.norm, EPS, residual)
        act = silu_and_mul_triton(F.linear(h, self.w_gu)) if silu is None else gate_up_silu_triton(h, self.w_gu, silu)
        if addmm:
            residual.addmm_(act, self.w_down.t())
            h = rms_norm_triton(residual, self.norm, EPS)[0]
        else:
            h, residual = rms_norm_triton(F.linear(act, self.w_down), self.norm, EPS, residual)
        return F.linear(h, self.w_qkv)


def burst_gate_up(layer: Layer, calls: int) -> tuple[list[str], GatedGemmConfig]:
    """Rows of the gate|up table and the fastest config."""
    h = torch.randn(layer.tokens, HIDDEN, device="cuda", dtype=torch.bfloat16)
    flops = 2.0 * layer.tokens * HIDDEN * 2 * INTER
    base = ms_per_call(lambda: silu_and_mul_triton(F.linear(h, layer.w_gu)), 3)
    base = ms_per_call(lambda: silu_and_mul_triton(F.linear(h, layer.w_gu)), calls)
    gemm = ms_per_call(lambda: F.linear(h, layer.w_gu), calls)
    rows = [f"| cuBLAS gate_up + silu_and_mul | {base:.3f} | {flops / base / 1e9:.0f} | (the GEMM alone {gemm:.3f} ms, "
            f"{flops / gemm / 1e9:.0f} TFLOP/s) |"]
    best: tuple[float, GatedGemmConfig] | None = None
    expected = silu_and_mul_triton(F.linear(h, layer.w_gu)).float()
    for cfg in GATED_GEMM_SWEEP:
        try:
            out = gate_up_silu_triton(h, layer.w_gu, cfg)
            err = (out.float() - expected).abs().max().item()
            t = ms_per_call(partial(gate_up_silu_triton, h, layer.w_gu, cfg), calls)
        except Exception as e:  # a config that does not compile here (shared memory): say so, keep going
            rows.append(f"| fused {cfg.label} | failed: {type(e).__name__}: {str(e)[:80]} | | |")
            continue
        rows.append(f"| fused {cfg.label} | {t:.3f} | {flops / t / 1e9:.0f} | max diff vs the pair {err:.2e} |")
        if best is None or t < best[0]:
            best = (t, cfg)
    assert best is not None, "no gated GEMM config ran"
    return rows, best[1]


def bench_tokens(tokens: int, seconds: float) -> None:
    layer = Layer(tokens)
    rows, best = burst_gate_up(layer, 20 if tokens >= 4096 else 100)
    print(f"\n## gate|up at {tokens} tokens, burst (a cool-ish GPU)\n")
    print("| step | ms | TFLOP/s | note |\n|---|---|---|---|")
    print("\n".join(rows))
    variants = {"unfused": (None, False), "addmm": (None, True), f"silu {best.label}": (best, False),
                f"both {best.label}": (best, True)}
    reference = layer.run(None, False).float()
    errors = {name: (layer.run(*v).float() - reference).abs().max().item() for name, v in variants.items()}
    per_round = max(1, int(0.3e3 / ms_per_call(lambda: layer.run(None, False), 3)))
    times: dict[str, list[float]] = {name: [] for name in variants}
    with ClockLog() as clocks:
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            for name, (silu, addmm) in variants.items():
                times[name].append(ms_per_call(partial(layer.run, silu, addmm), per_round))
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
