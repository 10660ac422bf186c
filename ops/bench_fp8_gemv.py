#!/usr/bin/env python
"""Sweeps the launch configs of the W8A16 FP8 GEMV (engine/kernels/fp8_linear.py) at the Llama-3-8B and
1B-class projections for M = 1, 2, 4, 8, 16, and prints the best per (shape, M) and the config table
(FP8_GEMV_CONFIGS, one config per shape class and M) those bests give. From the repo root:

    PYTHONPATH=. python3 ops/bench_fp8_gemv.py [--models 8b,1b] [--ms 1,2,4,8,16]      # CUDA, ~2 min
    TRITON_INTERPRET=1 PYTHONPATH=. python3 ops/bench_fp8_gemv.py --dry-run            # CPU, tiny shape
    python3 ops/bench_fp8_gemv.py --apply fp8_gemv_sweep.json     # write its table into fp8_linear.py
    PYTHONPATH=. python3 ops/bench_fp8_gemv.py --quant --skip-gemv    # activation quantization only, ~20 s

Timing as ops/bench_gemv.py (its helpers): each config is captured in a CUDA graph as a chain of calls over
rotating FP8 weight copies (>= 512 MB in all, far past the L2, so every call streams its weights from HBM),
the graph replayed, us per call = replay time / chain length. TB/s counts the bytes a call must move (FP8
weights, their float32 row scales, bf16 x in and y out) against the copy bandwidth measured in the same run.
Each config's output is checked once against F.linear on the dequantized weights (a config that compiles
but computes wrong is reported and never picked). Columns: cuBLAS = bf16 F.linear on bf16 weights of the
same shape (what FP8 must beat), _scaled_mm (M = 16 only) = the path above the GEMV (activation quantization
kernel + row-wise torch._scaled_mm), table = the config FP8_GEMV_CONFIGS picks today. With $OUT set, the rows
and the derived table go to $OUT/fp8_gemv_sweep.json. The --dry-run (no CUDA: wall-clock timing, no
graphs, one tiny shape, two configs) exists so the GPU run cannot die on a typo. --quant times the
activation quantization in front of _scaled_mm (eager six ops, the fused kernel, RMSNorm fused in) at the
prefill / W2-decode sizes, to say whether fusing the norm pays (fp8_quant.py, Fp8Linear.forward_after_norm).
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
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a bare checkout too
sys.path.insert(0, str(Path(__file__).resolve().parent))  # the timing helpers of bench_gemv.py

from bench_gemv import MODELS, copies_for, copy_bandwidth, graph_us  # noqa: E402
from stoker.engine.kernels import rms_norm_triton  # noqa: E402
from stoker.engine.kernels.fp8_convert import CONVERTS  # noqa: E402
from stoker.engine.kernels.fp8_linear import (  # noqa: E402
    FP8_DTYPE,
    Fp8GemvConfig,
    fp8_gemv_config,
    gemv_fp8_triton,
    scaled_mm_fp8,
    shape_class,
)
from stoker.engine.kernels.fp8_quant import (  # noqa: E402
    quantize_activations_ref,
    quantize_activations_triton,
    rms_norm_quant_fp8_triton,
)

DTYPE = torch.bfloat16  # the --dry-run uses float16: the Triton interpreter mishandles bfloat16 dots
# tl.dot path (16-token tile): (rows per program, K step, warps, stages). One warp with 16 rows won the
# bf16 sweep at >= 4096 outputs; FP8 rows are half the bytes, so longer K steps are in the grid.
DOT_GRID = [(16, 256, 1, 4), (16, 512, 1, 4), (16, 512, 2, 3), (16, 1024, 4, 3), (32, 256, 2, 4),
            (32, 512, 4, 3), (32, 128, 2, 5), (64, 256, 4, 3), (64, 128, 4, 4), (128, 128, 8, 3)]
# CUDA-core path (block_m = M, M <= 4): (rows, K step at M = 1, warps, stages); the K step shrinks with M
# so the [M, rows, K] float32 accumulator stays at <= 8K elements (64 registers a thread at 4 warps).
CORES_GRID = [(2, 2048, 4, 3), (4, 1024, 4, 3), (4, 2048, 4, 3), (8, 512, 4, 3), (8, 1024, 4, 3),
              (16, 512, 8, 3)]


# --converts (the E4M3 conversion sweep, fp8_convert.py): every conversion on a smaller CUDA-core grid, at every
# M up to 16 (the [M, rows, K] accumulator kept at <= 8K elements), beside the two tl.dot configs the table
# holds today ("cast" only: the word conversions run on the CUDA cores). Kept small: each (config, conversion,
# block_m) is one compile on the GPU machine, and the call has 150 s.
CONVERT_CORES_GRID = [(8, 1024, 4, 3), (4, 2048, 4, 3)]
CONVERT_DOT_GRID = [(32, 512, 4, 3), (16, 1024, 4, 3)]
Candidate = tuple[Fp8GemvConfig, str]  # (launch shape, conversion)


def label_of(cand: Candidate) -> str:
    cfg, convert = cand
    return cfg.label() if convert == "cast" else f"{cfg.label()} {convert}"


def candidates(m: int, converts: list[str] | None = None) -> list[Candidate]:
    """The configs swept at M tokens; with `converts`, the conversion sweep's grid instead (see above)."""
    bm = 1 << (m - 1).bit_length()
    if converts:
        dot = [(Fp8GemvConfig(16, bn, bk, True, nw, st), "cast") for bn, bk, nw, st in CONVERT_DOT_GRID]
        grid = CONVERT_CORES_GRID if m <= 4 else CONVERT_CORES_GRID[1:]
        cores = [(Fp8GemvConfig(bm, bn, max(128, bk // bm), False, nw, st), conv)
                 for bn, bk, nw, st in grid for conv in converts]
        return cores + dot
    dot = [(Fp8GemvConfig(16, bn, bk, True, nw, st), "cast") for bn, bk, nw, st in DOT_GRID]
    if m > 4:
        return dot
    cores = [(Fp8GemvConfig(bm, bn, max(128, bk // bm), False, nw, st), "cast") for bn, bk, nw, st in CORES_GRID]
    return cores + dot


def shapes(models: list[str]) -> list[tuple[str, str, int, int]]:
    """(model, projection, K, N) for each projection of each model."""
    out = []
    for model in models:
        hidden, hq, hkv, head_dim, inter = MODELS[model]
        for name, (k, n) in {"qkv": (hidden, (hq + 2 * hkv) * head_dim), "o": (hq * head_dim, hidden),
                             "gate_up": (hidden, 2 * inter), "down": (inter, hidden)}.items():
            out.append((model, name, k, n))
    return out


def wall_us(calls: list[Callable[[], object]], replays: int = 1) -> float:
    """The CPU dry run's stand-in for graph_us: wall-clock per call (interpreter speed, not a figure)."""
    for call in calls[:1]:
        call()
    start = time.perf_counter()
    for _ in range(replays):
        for call in calls:
            call()
    return (time.perf_counter() - start) * 1e6 / replays / len(calls)


class Shape:
    """Rotating FP8 weight copies of one [N, K] projection (and bf16 ones for the cuBLAS column)."""

    def __init__(self, k: int, n: int, device: str, copies: int | None):
        self.k, self.n, self.device = k, n, device
        count = copies or copies_for(n * k)
        self.ws = [(torch.randn(n, k, device=device) * 8).to(FP8_DTYPE) for _ in range(count)]
        self.scale = torch.rand(n, device=device) * 0.01 + 0.001
        self.bf16 = [torch.randn(n, k, device=device, dtype=DTYPE) for _ in range(copies or copies_for(2 * n * k))]
        self.ref_w = (self.ws[0].float() * self.scale[:, None]).to(DTYPE)  # dequantized copy 0

    def nbytes(self, m: int) -> int:
        return self.n * self.k + 4 * self.n + DTYPE.itemsize * m * (self.k + self.n)

    def chain(self, make: Callable[[torch.Tensor], Callable[[], object]], ws: list[torch.Tensor]) -> list:
        calls = [make(w) for w in ws]
        return calls * max(1, 16 // len(calls))


def check(shape: Shape, x: torch.Tensor, cfg: Fp8GemvConfig, convert: str = "cast") -> float:
    """Relative Frobenius error of the config's output against F.linear on the dequantized weights."""
    out = gemv_fp8_triton(x, shape.ws[0], shape.scale, config=cfg, convert=convert).float()
    ref = F.linear(x, shape.ref_w).float()
    return ((out - ref).norm() / ref.norm().clamp(min=1e-30)).item()


def sweep_point(shape: Shape, m: int, cands: list[Candidate], timer: Callable[[list], float]) -> dict:
    """us per candidate (None: failed or wrong), cuBLAS bf16 and the table's pick at this M."""
    x = torch.randn(m, shape.k, device=shape.device, dtype=DTYPE)
    results: dict[str, float | None] = {}
    for cfg, conv in cands:
        label = label_of((cfg, conv))
        try:
            err = check(shape, x, cfg, conv)
            if not err < 2e-2:  # bf16 output rounding is ~4e-3; a wrong tile layout is O(1)
                print(f"  {label}: WRONG (relative error {err:.3g})", flush=True)
                results[label] = None
                continue
            results[label] = timer(shape.chain(
                lambda w, c=cfg, v=conv: (lambda: gemv_fp8_triton(x, w, shape.scale, config=c, convert=v)),
                shape.ws))
        except Exception as e:  # a config that does not compile or fit: report it, keep going
            print(f"  {label}: {type(e).__name__}: {str(e)[:160]}", flush=True)
            results[label] = None
    table_cfg = fp8_gemv_config(shape.n, shape.k, m, shape.device != "cpu")
    table_us = timer(shape.chain(lambda w: (lambda: gemv_fp8_triton(x, w, shape.scale)), shape.ws))
    cublas_us = timer(shape.chain(lambda w: (lambda: F.linear(x, w)), shape.bf16))
    scaled_mm_us = None
    if m == 16 and shape.device == "cuda":  # the GEMV's upper end against the path above it (activation
        try:  # quantization kernel + row-wise _scaled_mm): says whether FP8_GEMV_MAX_M is where it should be
            scaled_mm_us = timer(shape.chain(lambda w: (lambda: scaled_mm_fp8(x, w, shape.scale, None, None)),
                                             shape.ws))
        except Exception as e:  # report, keep the sweep going
            print(f"  scaled_mm at M = 16: {type(e).__name__}: {str(e)[:160]}", flush=True)
    timed = {label: us for label, us in results.items() if us is not None}
    if not timed:
        raise RuntimeError(f"no config ran at [{shape.n}, {shape.k}] M = {m}: see the errors above")
    best = min(timed, key=lambda label: timed[label])
    return {"m": m, "configs": results, "best": best, "best_us": timed[best], "table": table_cfg.label(),
            "table_us": table_us, "cublas_bf16_us": cublas_us, "scaled_mm_us": scaled_mm_us, "bytes": shape.nbytes(m)}


def print_convert_summary(rows: list[dict], converts: list[str]) -> None:
    """Per (shape, M): each conversion's best us over its configs, the one that wins."""
    print("\n## E4M3 conversion: best us per conversion (CUDA cores) and the best tl.dot cast")
    print("| proj | M | " + " | ".join(converts) + " | dot cast | winner |")
    print("|---|---|" + "---|" * (len(converts) + 2))
    for row in rows:
        best: dict[str, float] = {}
        for label, us in row["configs"].items():
            if us is None:
                continue
            conv = "dot cast" if label.startswith("dot") else next(
                (c for c in converts if c != "cast" and label.endswith(" " + c)), "cast")
            best[conv] = min(us, best.get(conv, float("inf")))
        cells = [f"{best[c]:.1f}" if c in best else "-" for c in [*converts, "dot cast"]]
        winner = min(best, key=lambda c: best[c]) if best else "-"
        print(f"| {row['model']} {row['proj']} | {row['m']} | " + " | ".join(cells) + f" | {winner} |", flush=True)


def derive_table(rows: list[dict]) -> dict[str, str]:
    """Per (shape class, M): the config with the least summed slowdown (us / that shape's best us) over the
    shapes of the class; only configs that ran on every shape of the class qualify."""
    groups: dict[tuple[str, int], list[dict]] = {}
    for row in rows:
        groups.setdefault((row["class"], row["m"]), []).append(row)
    table = {}
    for (cls, m), members in sorted(groups.items()):
        labels = set.intersection(*({lbl for lbl, us in r["configs"].items() if us is not None} for r in members))
        pick = min(labels, key=lambda lbl: sum(r["configs"][lbl] / r["best_us"] for r in members))
        table[f"{cls}, {m}"] = pick
    return table


def quant_rows(shapes: list[tuple[int, int]], device: str, timer: Callable[[list], float], copies: int | None) -> list:
    """us per call of the activation quantization before _scaled_mm, three ways: eager (the six-op reference),
    the fused kernel alone after the RMSNorm kernel, and RMSNorm + quantization as one kernel; over rotating
    activation copies (>= 512 MB) so each call reads them from HBM, as after a previous layer's kernels."""
    print("\n## activation quantization before _scaled_mm (us per call; norm = RMSNorm with the residual add)")
    print("| M x K | eager quant | quant kernel | norm kernel + quant kernel | norm+quant one kernel | saved |")
    print("|---|---|---|---|---|---|")
    rows = []
    for m, k in shapes:
        n_copies = copies or copies_for(4 * m * k)  # x and residual, bf16
        xs = [torch.randn(m, k, device=device, dtype=DTYPE) for _ in range(n_copies)]
        rs = [torch.randn(m, k, device=device, dtype=DTYPE) for _ in range(n_copies)]
        g = torch.rand(k, device=device, dtype=DTYPE) + 0.5
        pairs = list(zip(xs, rs, strict=True))
        row = {"m": m, "k": k, **{name: timer(chain(pairs, make)) for name, make in quant_ops(g).items()}}
        rows.append(row)
        print(f"| {m} x {k} | {row['eager']:.1f} | {row['kernel']:.1f} | {row['norm_then_kernel']:.1f} | "
              f"{row['fused']:.1f} | {row['norm_then_kernel'] - row['fused']:.1f} |", flush=True)
        del xs, rs, pairs
    return rows


def chain(pairs: list[tuple[torch.Tensor, torch.Tensor]], make: Callable) -> list[Callable[[], object]]:
    return [make(x, r) for x, r in pairs] * max(1, 16 // len(pairs))


def quant_ops(g: torch.Tensor) -> dict[str, Callable]:
    """name -> (x, residual) -> the call to time."""
    return {
        "eager": lambda x, r: lambda: quantize_activations_ref(x, None),
        "kernel": lambda x, r: lambda: quantize_activations_triton(x, None),
        "norm_then_kernel": lambda x, r: lambda: quantize_activations_triton(rms_norm_triton(x, g, 1e-5, r)[0], None),
        "fused": lambda x, r: lambda: rms_norm_quant_fp8_triton(x, g, 1e-5, r, None),
    }


KERNEL_FILE = Path(__file__).resolve().parents[1] / "engine" / "kernels" / "fp8_linear.py"
TABLE_START = "# One config per (shape class"
TABLE_END = "\n}\n"


def table_source(sweep: dict) -> str:
    """The FP8_GEMV_CONFIGS block of fp8_linear.py for a sweep's JSON, each entry with its measured us."""
    meta = sweep["meta"]
    lines = [
        "# One config per (shape class, M rounded up to a power of two), picked at launch by a cached lookup.",
        f"# From ops/bench_fp8_gemv.py's sweep ({meta['device']}, {meta.get('date', 'date not recorded')}):",
        "# per class and M the config with the least summed slowdown over the class's shapes. Comments: us per",
        "# call of that config on each shape (CUDA-graph replay over >= 512 MB of weights) and the shape's own",
        "# best. A class the sweep did not see takes _FALLBACK_CONFIG.",
        "FP8_GEMV_CONFIGS: dict[tuple[str, int], Fp8GemvConfig] = {",
    ]
    by_label = {label_of(cand): cand[0] for m in (1, 2, 4, 8, 16) for cand in candidates(m)}
    for key, label in sweep["table"].items():
        cls, m = key.split(", ")
        if label not in by_label:
            sys.exit(f"the table's {label!r} is a --converts pick: set FP8_CONVERT / the table by hand")
        c = by_label[label]
        members = [r for r in sweep["rows"] if r["class"] == cls and r["m"] == int(m)]
        lines.append("    # " + ", ".join(f"{r['model']} {r['proj']} {r['configs'][label]:.1f} us (best "
                                          f"{r['best_us']:.1f})" for r in members))
        args = f"{c.block_m}, {c.block_n}, {c.block_k}, {c.use_dot}, {c.num_warps}, {c.num_stages}"
        lines.append(f'    ("{cls}", {m}): Fp8GemvConfig({args}),')
    return "\n".join(lines) + TABLE_END


def apply(sweep_path: str, kernel_file: Path = KERNEL_FILE) -> None:
    """Replace FP8_GEMV_CONFIGS (from its comment to its closing brace) with the sweep's table."""
    sweep = json.loads(Path(sweep_path).read_text())
    if not sweep.get("table"):
        sys.exit(f"{sweep_path} holds no table (a run without the GEMV sweep?)")
    source = kernel_file.read_text()
    start = source.index(TABLE_START)
    end = source.index(TABLE_END, source.index("FP8_GEMV_CONFIGS: dict", start)) + len(TABLE_END)
    kernel_file.write_text(source[:start] + table_source(sweep) + source[end:])
    print(f"wrote the sweep's table into {kernel_file}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default="8b,1b")
    parser.add_argument("--ms", default="1,2,4,8,16")
    parser.add_argument("--quant", action="store_true",
                        help="also time the activation quantization (eager, kernel, fused with RMSNorm)")
    parser.add_argument("--skip-gemv", action="store_true", help="no GEMV sweep (with --quant: that alone)")
    parser.add_argument("--apply", metavar="SWEEP_JSON", help="write a sweep's table into fp8_linear.py, then exit")
    parser.add_argument("--budget-s", type=float, default=180.0, help="skip the shapes left after this long")
    parser.add_argument("--dry-run", action="store_true", help="CPU under TRITON_INTERPRET=1: tiny shape, 2 configs")
    parser.add_argument("--converts", default="",
                        help="the E4M3 conversion sweep: comma-separated fp8_convert.CONVERTS (e.g. cast,bits,asm)")
    opts = parser.parse_args()
    if opts.apply:
        apply(opts.apply)
        return
    t0 = time.time()
    converts = [c for c in opts.converts.split(",") if c]
    if any(c not in CONVERTS for c in converts):
        sys.exit(f"--converts: each of {converts} must be one of {CONVERTS}")
    if opts.dry_run:
        if os.environ.get("TRITON_INTERPRET") != "1":
            sys.exit("--dry-run runs the kernels under the Triton interpreter: set TRITON_INTERPRET=1")
        sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
        import kernel_harness  # noqa: F401  (its import patches triton 3.6's interpreter for numpy >= 2.4)
        global DTYPE
        device, timer, bw, copies, DTYPE = "cpu", wall_us, 0.0, 2, torch.float16
        work = [("tiny", "proj", 72, 40)]
        ms = [1, 3]
        quant_shapes = [(5, 72)]
    else:
        if not torch.cuda.is_available():
            sys.exit("bench_fp8_gemv needs a CUDA GPU (or --dry-run under TRITON_INTERPRET=1)")
        device, timer, copies = "cuda", graph_us, None
        bw = copy_bandwidth()
        work = shapes(opts.models.split(","))
        ms = [int(m) for m in opts.ms.split(",")]
        quant_shapes = [(1024, 4096), (8192, 4096), (1024, 14336), (8192, 14336)]
        print(f"{torch.cuda.get_device_name()}  SMs={torch.cuda.get_device_properties(0).multi_processor_count}  "
              f"copy bandwidth {bw / 1e12:.2f} TB/s  torch {torch.__version__}", flush=True)
    torch.manual_seed(0)
    quant = quant_rows(quant_shapes, device, timer, copies) if opts.quant else []
    if opts.skip_gemv:
        work = []
    if work:
        print("\n## W8A16 GEMV configs (us per call; TB/s of the FP8 bytes a call moves)")
        print("| proj | M | FP8 MB | cuBLAS bf16 us | _scaled_mm us | table us | best us | TB/s | % copy | vs cuBLAS "
              "| best config | table config |")
        print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    rows = []
    for model, name, k, n in work:
        if time.time() - t0 > opts.budget_s:
            print(f"| {model} {name} {k}x{n} | skipped: past --budget-s {opts.budget_s:.0f} |", flush=True)
            continue
        shape = Shape(k, n, device, copies)
        for m in ms:
            cands = candidates(m, converts)
            if opts.dry_run:  # one CUDA-core config per conversion and one tl.dot config
                cands = cands[: max(1, len(converts))] + cands[-1:]
            row = sweep_point(shape, m, cands, timer)
            row.update(model=model, proj=name, k=k, n=n, **{"class": shape_class(n, k)})
            rows.append(row)
            tbs = row["bytes"] / row["best_us"] / 1e6
            pct = f"{tbs * 1e12 / bw:5.0%}" if bw else "  n/a"
            smm = f"{row['scaled_mm_us']:7.1f}" if row["scaled_mm_us"] is not None else "    n/a"
            print(f"| {model} {name} {k}x{n} | {m:>2} | {n * k / 2**20:6.1f} | {row['cublas_bf16_us']:7.1f} | {smm} | "
                  f"{row['table_us']:7.1f} | {row['best_us']:7.1f} | {tbs:5.2f} | {pct} | "
                  f"{row['cublas_bf16_us'] / row['best_us']:4.2f}x | {row['best']} | {row['table']} |", flush=True)
        del shape
        if device == "cuda":
            torch.cuda.empty_cache()
    table = derive_table(rows) if rows else {}
    by_label = {label_of(cand): cand for m in ms for cand in candidates(m, converts)}
    if table:
        print("\n## FP8_GEMV_CONFIGS from this sweep (or --apply its JSON); the conversion after the config")
    for key, label in table.items():
        cls, m = key.split(", ")
        cfg, conv = by_label[label]
        print(f"    ({cls!r}, {m}): {cfg!r},  # {label} [{conv}]")
    if converts and rows:
        print_convert_summary(rows, converts)
    print(f"(sweep took {time.time() - t0:.0f} s)")
    out_dir = os.environ.get("OUT")
    if out_dir:
        meta = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu (dry run)",
                "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                "copy_bandwidth_tbs": bw / 1e12, "torch": torch.__version__, "seconds": time.time() - t0}
        path = Path(out_dir) / ("fp8_gemv_sweep.json" if rows else "fp8_quant_bench.json")
        path.write_text(json.dumps({"meta": meta, "rows": rows, "table": table, "quant": quant}, indent=1))
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
