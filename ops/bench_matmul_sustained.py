"""The bf16 matmul rate the GPU sustains beside the burst the floors use (ops/bench.py: 8192^3, a few products).

On the H200 a long GEMM load runs at the 700 W power cap, its SM clock ~1,500 MHz (throttle reason 0x4), so W2's
prefill, FLOP-bound, cannot reach the burst rate that its floor counts. This prints both, the rate per round of
products over --seconds, and the SM clock and power nvidia-smi saw meanwhile (ops/gpu_clock.py).

    PYTHONPATH=. python3 ops/bench_matmul_sustained.py [--seconds 15] [--round 200]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from stoker.ops.gpu_clock import ClockLog

N = 8192


def rate(a: torch.Tensor, b: torch.Tensor, n: int) -> float:
    """TFLOP/s of n products a @ b, timed from the host between two syncs."""
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        a @ b
    torch.cuda.synchronize()
    return n * 2 * N**3 / (time.perf_counter() - t) / 1e12


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=15.0)
    ap.add_argument("--round", type=int, default=200, help="products per timed round")
    args = ap.parse_args(argv)
    a = torch.randn(N, N, device="cuda", dtype=torch.bfloat16)
    b = torch.randn_like(a)
    rate(a, b, 20)  # cuBLAS picks its kernel
    burst = rate(a, b, 50)
    rounds: list[float] = []
    with ClockLog() as clocks:
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < args.seconds:
            rounds.append(rate(a, b, args.round))
    c = clocks.summary()
    print("| figure | value |\n|---|---|")
    print(f"| burst, 50 products (the floors' way) | {burst:.0f} TFLOP/s |")
    print(f"| sustained, {len(rounds)} rounds of {args.round} over {args.seconds:.0f} s: median (min-max) | "
          f"{statistics.median(rounds):.0f} TFLOP/s ({min(rounds):.0f}-{max(rounds):.0f}) |")
    print(f"| sustained / burst | {statistics.median(rounds) / burst:.2f}x |")
    if "error" in c:
        print(f"| SM clock / power | not sampled: {c['error']} |")
    else:
        reasons = ", ".join(f"{k}: {n}" for k, n in c["throttle_reasons"].items())
        print(f"| SM clock median (p10-p90, max) | {c['sm_mhz_median']:.0f} MHz ({c['sm_mhz_p10']:.0f}-"
              f"{c['sm_mhz_p90']:.0f}, {c['sm_mhz_max']:.0f}) |")
        print(f"| power median (max) | {c['power_w_median']:.0f} W ({c['power_w_max']:.0f}) |")
        print(f"| throttle reasons (samples) | {reasons} (0x4: SW power cap) |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
