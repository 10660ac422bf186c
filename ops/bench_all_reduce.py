"""The tensor-parallel all-reduce at decode's message sizes (issue 17 item 3): NCCL's (the engine's compute group,
captured in a CUDA graph as the decode graphs capture it, and eager) against the one-shot all-reduce over
symmetric memory (engine/parallel/symm_mem.py), per message size; the faster at each size is what the engine
should use there. One process per GPU (ops/rank_processes.py), bf16, the sum checked against NCCL's at every size.

    PYTHONPATH=. python3 ops/bench_all_reduce.py [--ranks 2] [--sizes 4096,8192,32768,...] [--iters 200]
    PYTHONPATH=. python3 ops/bench_all_reduce.py --device cpu --ranks 2      # the harness alone: gloo, no one-shot

NVLink multicast stays off (NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1, NVSHMEM_DISABLE_NVLS=1, as the
engine's ranks run). Not yet run on GPUs: written before a machine with several was lent.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

import torch
from stoker.ops.rank_processes import run_ranks

NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
# Elements (bf16) of decode's all-reduces: a token's hidden state at 8B (4,096) and 70B (8,192), 8 and 64 tokens
# of it, and a 512-token prefill chunk at 8B.
DEFAULT_SIZES = "4096,8192,32768,65536,524288,2097152"


def _timed_cuda(fn: Any, iters: int, graph: bool) -> float:
    """Microseconds per call of fn() (one all-reduce), iters calls captured in one CUDA graph (graph) or launched."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    if graph:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, stream=stream):
            for _ in range(iters):
                fn()
        g.replay()  # warm
        torch.cuda.synchronize()
        run = g.replay
    else:

        def run() -> None:
            for _ in range(iters):
                fn()

    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    run()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / iters


def _timed_cpu(fn: Any, iters: int) -> float:
    fn()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - t0) * 1e6 / iters


def _measure(rank: int, size: int, comm: Any, sizes: list[int], iters: int) -> list[dict[str, float]]:
    """One rank's rows (ops/rank_processes.py runs it in every rank, the rows compared across ranks by none)."""
    dev = comm.device
    one_shot = None
    if dev.type == "cuda":
        from stoker.engine.parallel.symm_mem import OneShotAllReduce

        one_shot = OneShotAllReduce(comm.store, rank, size, dev, max(sizes), torch.bfloat16, name="bench-ar")
    rows = []
    for n in sizes:
        gen = torch.Generator(device=dev).manual_seed(rank * 1000 + n)
        x = torch.randn(
            n, generator=gen, device=dev, dtype=torch.bfloat16 if dev.type == "cuda" else torch.float32
        )
        want = comm.all_reduce(x.clone())
        buf = (
            x.clone()
        )  # summed in place again and again while timed (it overflows to inf: speed is the same)
        comm.gather_ints(0)  # every rank at the same point before each size's timings
        if dev.type == "cuda":
            assert one_shot is not None
            err = ((one_shot(x.clone()).float() - want.float()).abs().max() / want.float().abs().max()).item()
            row = {
                "elements": n,
                "nccl_graph_us": _timed_cuda(lambda b=buf: comm.all_reduce(b), iters, True),
                "nccl_eager_us": _timed_cuda(lambda b=buf: comm.all_reduce(b), iters, False),
                "one_shot_graph_us": _timed_cuda(lambda b=buf: one_shot(b), iters, True),
                "one_shot_rel_err": err,
            }
        else:
            row = {"elements": n, "gloo_us": _timed_cpu(lambda b=buf: comm.all_reduce(b), iters)}
        rows.append(row)
    return rows


def run(
    size: int, device: str, sizes: list[int], iters: int, timeout_s: float = 600.0
) -> list[dict[str, float]]:
    """Rank 0's rows (every rank must give its own)."""
    return run_ranks(_measure, size, sizes, iters, timeout_s=timeout_s, device=device, env=NO_MULTICAST)[0]


def table(rows: list[dict[str, float]], size: int, device: str) -> str:
    if device == "cpu":
        lines = [
            f"gloo all-reduce, {size} ranks on the CPU (the harness; no GPU figure)",
            "| elements | gloo us |",
            "|---|---|",
        ]
        lines += [f"| {r['elements']:,} | {r['gloo_us']:.1f} |" for r in rows]
        return "\n".join(lines)
    lines = [
        f"bf16 all-reduce, {size} ranks, us a call (CUDA events; graph: the calls captured in one CUDA graph)",
        "| elements (bytes) | NCCL, graph | NCCL, eager | one-shot symm_mem, graph | faster in a graph | "
        "one-shot rel. error vs NCCL |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        faster = "one-shot" if r["one_shot_graph_us"] < r["nccl_graph_us"] else "NCCL"
        lines.append(
            f"| {r['elements']:,} ({r['elements'] * 2:,}) | {r['nccl_graph_us']:.2f} | "
            f"{r['nccl_eager_us']:.2f} | {r['one_shot_graph_us']:.2f} | {faster} | "
            f"{r['one_shot_rel_err']:.1e} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--sizes", default=DEFAULT_SIZES, help="comma-separated message sizes in elements")
    ap.add_argument("--iters", type=int, default=200, help="all-reduces a timing")
    args = ap.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",") if s.strip()]
    if args.device == "cuda" and torch.cuda.device_count() < args.ranks:
        print(
            f"ops/bench_all_reduce.py: {args.ranks} ranks need {args.ranks} GPUs, "
            f"{torch.cuda.device_count()} visible",
            file=sys.stderr,
        )
        return 2
    print(table(run(args.ranks, args.device, sizes, args.iters), args.ranks, args.device))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
