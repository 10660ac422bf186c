"""The bf16 matmul rate the GPU sustains beside the burst the floors use (ops/bench.py: 8192^3, a few products),
and whether the BLAS library torch picks changes it.

On the H200 a long GEMM load runs at the 700 W power cap, its SM clock ~1,500 MHz (throttle reason 0x4), so W2's
prefill, FLOP-bound, cannot reach the burst rate that its floor counts. Under a power cap the rate is set by the
energy a FLOP costs, which differs between kernels of the same speed at full clock; so this can time several BLAS
libraries (torch.backends.cuda.preferred_blas_library: cuBLAS, cuBLASLt) in alternating rounds on one warm GPU.
Workloads: `square` (8192^3 `a @ b`, the floors' product) and `w2-prefill` / `w2-decode` (one 8B layer's four
projections as the engine runs them, `F.linear(x, W)` at M = 8,192 / 1,024 tokens). Prints the burst and the
sustained rate per library, and the SM clock and power nvidia-smi saw meanwhile (ops/gpu_clock.py).

    PYTHONPATH=. python3 ops/bench_matmul_sustained.py [--seconds 15] [--workload square] [--libs default]
    PYTHONPATH=. python3 ops/bench_matmul_sustained.py --workload w2-prefill --libs cublas,cublaslt --seconds 40
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from stoker.ops.gpu_clock import ClockLog

N = 8192
# One Llama-3-8B layer's projections (out features, in features): q|k|v, o, gate|up, down.
LAYER_8B = ((6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336))
TOKENS = {"w2-prefill": 8192, "w2-decode": 1024}


def workload(name: str) -> tuple[Callable[[], None], float]:
    """(one product or layer, its FLOPs)."""
    if name == "square":
        a = torch.randn(N, N, device="cuda", dtype=torch.bfloat16)
        b = torch.randn_like(a)
        return (lambda: a @ b, 2.0 * N**3)  # noqa: E731 (the loop's callable)
    m = TOKENS[name]
    weights = [torch.randn(o, i, device="cuda", dtype=torch.bfloat16) * 0.02 for o, i in LAYER_8B]
    inputs = {i: torch.randn(m, i, device="cuda", dtype=torch.bfloat16) for _, i in LAYER_8B}

    def layer() -> None:
        for w in weights:
            F.linear(inputs[w.shape[1]], w)

    return layer, float(sum(2 * m * o * i for o, i in LAYER_8B))


def rate(fn: Callable[[], None], flops: float, n: int) -> float:
    """TFLOP/s of n calls, timed from the host between two syncs."""
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    return n * flops / (time.perf_counter() - t) / 1e12


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=15.0)
    ap.add_argument("--round", type=int, default=0, help="calls per timed round (0: ~0.3 s of them)")
    ap.add_argument("--workload", choices=["square", *TOKENS], default="square")
    ap.add_argument(
        "--libs",
        default="default",
        help="comma-separated torch.backends.cuda.preferred_blas_library values, timed in alternating "
        "rounds (default, cublas, cublaslt)",
    )
    args = ap.parse_args(argv)
    fn, flops = workload(args.workload)
    libs = [lib.strip() for lib in args.libs.split(",") if lib.strip()]
    burst: dict[str, float] = {}
    for lib in libs:
        torch.backends.cuda.preferred_blas_library(lib)
        rate(fn, flops, 20)  # the library picks its kernel
        burst[lib] = rate(fn, flops, 50 if args.workload == "square" else 10)
    per_round = args.round or max(1, int(0.3 * burst[libs[0]] * 1e12 / flops))
    rounds: dict[str, list[float]] = {lib: [] for lib in libs}
    with ClockLog() as clocks:
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < args.seconds:
            for lib in libs:
                torch.backends.cuda.preferred_blas_library(lib)
                rounds[lib].append(rate(fn, flops, per_round))
    c = clocks.summary()
    print(
        f"workload {args.workload} ({flops / 1e12:.3f} TFLOP a call), {per_round} calls a round, "
        f"{args.seconds:.0f} s, libraries in alternating rounds: {', '.join(libs)}"
    )
    print(
        "| library | burst (the floors' way), TFLOP/s | sustained: median (min-max) of rounds | sustained / burst |"
    )
    print("|---|---|---|---|")
    for lib in libs:
        r = rounds[lib]
        print(
            f"| {lib} | {burst[lib]:.0f} | {statistics.median(r):.0f} ({min(r):.0f}-{max(r):.0f}), {len(r)} rounds "
            f"| {statistics.median(r) / burst[lib]:.2f}x |"
        )
    if "error" in c:
        print(f"SM clock / power: not sampled: {c['error']}")
    else:
        reasons = ", ".join(f"{k}: {n}" for k, n in c["throttle_reasons"].items())
        print(
            f"SM clock median {c['sm_mhz_median']:.0f} MHz (p10-p90 {c['sm_mhz_p10']:.0f}-{c['sm_mhz_p90']:.0f}, "
            f"max {c['sm_mhz_max']:.0f}); power median {c['power_w_median']:.0f} W (max {c['power_w_max']:.0f}); "
            f"throttle reasons (samples) {reasons} (0x4: SW power cap)"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
