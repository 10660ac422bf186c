#!/usr/bin/env python
"""Times the fused decode GEMVs with FP8 weights (engine/kernels/gemv.py with weight_scale; issue 14 part 2)
on the Llama-3-8B projections as the fused decode path runs them: qkv + rotary + KV-cache write, o_proj +
residual add, gate_up + SiLU-and-mul, down + residual add; per E4M3 conversion (fp8_convert.py: "cast",
"bits-join", "asm-join") and launch shape (the one the engine picks, and a CUDA-core alternative). From the
repo root:

    PYTHONPATH=. python3 ops/bench_fp8_fused.py [--ms 1] [--budget-s 30]          # CUDA, ~30 s
    TRITON_INTERPRET=1 PYTHONPATH=. python3 ops/bench_fp8_fused.py --dry-run      # CPU, tiny shapes

Timing as ops/bench_gemv.py (CUDA-graph replay over rotating FP8 weight copies, >= 512 MB, so every call
streams its weights from HBM). TB/s counts the FP8 weight bytes plus the row scales; % copy against the copy
bandwidth of the same run. Each variant's output is checked once against gemv_ref on the dequantized weights
(a wrong one is reported, never timed). With $OUT set, the rows go to $OUT/fp8_fused_gemv.json.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a bare checkout too
sys.path.insert(0, str(Path(__file__).resolve().parent))  # the timing helpers of bench_gemv.py

from bench_fp8_gemv import wall_us  # noqa: E402
from bench_gemv import MODELS, copies_for, copy_bandwidth, graph_us  # noqa: E402
from stoker.engine.kernels import gemv as gemv_mod  # noqa: E402
from stoker.engine.kernels import rope_cos_sin  # noqa: E402
from stoker.engine.kernels.fp8_convert import CONVERTS  # noqa: E402
from stoker.engine.kernels.fp8_linear import fp8_gemv_config, quantize_rows  # noqa: E402
from stoker.engine.kernels.gemv import (  # noqa: E402
    GemvConfig,
    gemv_config,
    gemv_ref,
    gemv_rotary_cache_ref,
    gemv_rotary_cache_triton,
    gemv_triton,
)
from stoker.engine.models.fused_decode import fp8_launch  # noqa: E402

KINDS = ("down+add", "qkv+rope", "o+add", "gate_up+silu")  # gate_up last: it was measured at 14:45


def kind_shape(model: tuple[int, int, int, int, int], kind: str) -> tuple[int, int]:
    """(K, N) of the projection behind `kind`."""
    hidden, hq, hkv, head_dim, inter = model
    return {"qkv+rope": (hidden, (hq + 2 * hkv) * head_dim), "o+add": (hq * head_dim, hidden),
            "gate_up+silu": (hidden, 2 * inter), "down+add": (inter, hidden)}[kind]


def fused_kernel(kind: str) -> str:
    """fused_decode's kernel name (FP8_FUSED_M1's first key, fp8_launch's argument) of a bench kind."""
    return {"qkv+rope": "rope", "gate_up+silu": "silu"}.get(kind, "add")


# --grid: tl.dot launch shapes beside the engine's (rows per program, K step, warps, stages). The 14:45 UTC run
# had gate_up + SiLU at 84 % of copy bandwidth on the dot tile 16x32x128 w2 s5 with "asm-join", the CUDA-core
# configs of the others at 45-59 %: do the tensor-core shapes carry over to qkv, o and down?
# Session 15 added two shapes a kind for an fp16-MMA form of "cast" (gemv.FP8_DOT_F16), removed in session 16:
# no faster than asm-join on gate_up (33.8 vs 33.9 us) and slower on the others (down 16x256 40.3 vs 25.8).
DOT_GRID = {
    "add": [(16, 128, 1, 5), (32, 128, 2, 5), (16, 256, 2, 4), (64, 128, 4, 4), (32, 256, 4, 3)],
    "gate_up+silu": [(16, 128, 1, 5), (64, 128, 4, 5), (32, 256, 2, 4), (32, 128, 2, 5), (64, 128, 4, 3)],
    "qkv+rope": [(16, 128, 1, 5), (32, 128, 2, 5), (16, 256, 2, 4), (64, 128, 4, 4), (32, 256, 4, 3)],
}


# --row-grid: one-token CUDA-core launch shapes (rows per program, K step, warps) of gemv.py's W_VEC loop with
# the in-register run sums (gemv.ROW_SUM_FP8, W_SUM), and the engine's FP8_FUSED_M1 shapes with and without them.
# For gate_up and rope, rows are pairs (gate and up rows, a half-head's d and d + D/2): two weight streams. The
# shapes are around session 16's probe's best (one plain GEMV per 8B projection: 4-8 rows, K steps of 1024-4096,
# 4 warps); a K step of 2048 at 4 warps gives each thread 16 codes (16-byte weight loads).
ROW_GRID = {
    "add": [(4, 1024, 4), (4, 2048, 4), (8, 2048, 4), (8, 2048, 8), (4, 4096, 4), (2, 1024, 4), (8, 1024, 4)],
    "gate_up+silu": [(2, 2048, 4), (2, 4096, 4), (4, 2048, 4), (4, 1024, 4), (2, 1024, 4), (4, 2048, 8)],
    "qkv+rope": [(2, 1024, 4), (2, 2048, 4), (2, 4096, 4), (4, 1024, 4), (4, 2048, 8), (1, 1024, 4), (2, 512, 2)],
}


def row_configs(kind: str, n: int, k: int, dry_run: bool) -> dict[str, tuple[GemvConfig | None, bool, bool]]:
    """label -> (launch shape, gemv.ROW_ACC_FP8, gemv.ROW_SUM_FP8) for --row-grid: the grid with the run sums, the
    engine's one-token shape without and with them (gate_up also on its tl.dot tile when that is the engine's)."""
    key = "add" if kind.endswith("add") else kind
    grid = [(2, 64, 1), (4, 32, 1)] if dry_run else ROW_GRID[key]
    out: dict[str, tuple[GemvConfig | None, bool, bool]] = {
        f"row {bn}x{bk} w{w}": (GemvConfig(1, bn, bk, False, w, 3), True, True) for bn, bk, w in grid}
    engine, _ = fp8_launch(fused_kernel(kind), n, k, 1, not dry_run)
    if engine is not None:
        out["engine"] = (engine, True, False)
        if not engine.use_dot:
            out["engine + sums"] = (engine, True, True)
    return out


def pick(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """--pick: per kind the fastest (launch shape, conversion) of the rows, as fused_decode.FP8_FUSED_M1 entries
    (kernel, weight rows n, K) -> ([block_m, block_n, block_k, use_dot, warps, stages], conversion)."""
    best: dict[str, dict[str, Any]] = {}
    for row in rows:
        if not row.get("row_sum", True):  # timed without the engine's run sums: a comparison, not a pick
            continue
        for conv, us in row["us"].items():
            if us is not None and row["config"] is not None and (row["kind"] not in best or us < best[row["kind"]]["us"]):
                best[row["kind"]] = {"kernel": fused_kernel(row["kind"]), "n": row["n"], "k": row["k"],
                                     "config": row["config"], "convert": conv, "us": us, "launch": row["launch"]}
    return list(best.values())


def engine_launches(kind: str, m: int, n: int, k: int, on_gpu: bool) -> dict[str, tuple[GemvConfig | None, str, bool]]:
    """--engine: label -> (launch shape, conversion, prologue norm) as engine/models/fused_decode.py launches the
    kind at M tokens (fused_decode.fp8_launch), without and (qkv, gate_up) with the unfolded prologue norm."""
    kernel = fused_kernel(kind)
    cfg, convert = fp8_launch(kernel, n, k, m, on_gpu)
    out = {"engine": (cfg, convert, False)}
    if kernel != "add":
        out["engine + norm"] = (cfg, convert, True)
    if m > 1:  # what 2-16 tokens ran before FP8_FUSED_DOT (the 14:45 conversions, the W8A16 table for o / down)
        before = fp8_gemv_config(n, k, m, on_gpu) if kernel == "add" and on_gpu else None
        out["before"] = (before, "asm-join" if kernel == "silu" and on_gpu else "cast", False)
    return out


def configs(kind: str, m: int, n: int, k: int, on_gpu: bool, grid: bool = False) -> dict[str, GemvConfig | None]:
    """label -> launch shape: "engine" is what engine/models/fused_decode.py launches today."""
    bm = 1 << (m - 1).bit_length()
    out: dict[str, GemvConfig | None]
    if kind.endswith("add"):
        engine = fp8_gemv_config(n, k, m, on_gpu) if on_gpu else None
        out = {"engine": engine, "bf16 table": gemv_config("plain", m, n, k, on_gpu)}
    elif kind == "gate_up+silu":
        out = {"engine": None, "cores 4x1024": GemvConfig(bm, 4, max(128, 1024 // bm), False, 4, 3)}
    else:
        out = {"engine": None, "cores 8x512": GemvConfig(bm, 8, max(64, 512 // bm), False, 4, 3)}
    if grid:
        for bn, bk, warps, stages in DOT_GRID["add" if kind.endswith("add") else kind]:
            out[f"dot {bn}x{bk}"] = GemvConfig(16, bn, bk, True, warps, stages)
    return out


class Proj:
    """Rotating FP8 copies of one projection and the activations / caches its fused kernel needs at M."""

    def __init__(self, model: tuple[int, int, int, int, int], kind: str, m: int, dtype: torch.dtype, device: str,
                 copies: int | None):
        self.kind, self.m, self.dtype = kind, m, dtype
        self.k, self.n = kind_shape(model, kind)
        hidden, self.hq, self.hkv, self.head_dim, _ = model
        count = copies or copies_for(self.n * self.k)
        pairs = [quantize_rows(torch.randn(self.n, self.k, device=device) * self.k**-0.5) for _ in range(count)]
        self.ws = [w for w, _ in pairs]
        self.scales = [s for _, s in pairs]
        self.x = torch.randn(m, self.k, device=device).to(dtype)
        n_out = self.n // 2 if kind == "gate_up+silu" else self.n
        self.add = torch.randn(m, n_out, device=device).to(dtype)
        blocks = 4 * m
        self.k_cache = torch.zeros(blocks, 16, self.hkv, self.head_dim, device=device, dtype=dtype)
        self.v_cache = torch.zeros_like(self.k_cache)
        self.cos_sin = rope_cos_sin(self.head_dim, 4096, 500000.0, None, device=device)
        self.positions = torch.arange(m, device=device) + 100
        self.slots = torch.arange(m, device=device) * 16
        self.norm = False  # the prologue RMSNorm with its weight unfolded (qkv, gate_up: FP8 "fused-folded")
        self.g = (torch.randn(self.k, device=device) * 0.1 + 1).to(dtype)

    def call(self, i: int, cfg: GemvConfig | None, convert: str, ref: bool = False) -> torch.Tensor:
        w, s = self.ws[i], self.scales[i]
        norm = {"norm_weight": self.g, "eps": 1e-5} if self.norm and self.kind in ("qkv+rope", "gate_up+silu") else {}
        if self.kind == "qkv+rope":
            fn: Any = gemv_rotary_cache_ref if ref else gemv_rotary_cache_triton
            extra = {} if ref else {"config": cfg, "weight_convert": convert}
            return fn(self.x, w, None, num_heads=self.hq, num_kv_heads=self.hkv, positions=self.positions,
                      cos_sin=self.cos_sin, k_cache=self.k_cache, v_cache=self.v_cache, slot_mapping=self.slots,
                      weight_scale=s, **extra, **norm)[0]
        kw: dict[str, Any] = {"silu_mul": True} if self.kind == "gate_up+silu" else {"add": self.add}
        if ref:
            return gemv_ref(self.x, w, weight_scale=s, **kw, **norm)[0]
        return gemv_triton(self.x, w, weight_scale=s, config=cfg, weight_convert=convert, **kw, **norm)[0]

    def nbytes(self) -> int:
        return self.n * self.k + 4 * self.n


def measure(proj: Proj, cfg: GemvConfig | None, convert: str, timer: Callable[[list], float]) -> float | None:
    """us per call, or None (printed why) when the variant fails or computes wrong."""
    try:
        out = proj.call(0, cfg, convert).float()
        ref = proj.call(0, cfg, convert, ref=True).float()
        err = ((out - ref).norm() / ref.norm().clamp(min=1e-30)).item()
        if not err < 2e-2:  # bf16 rounding is ~4e-3; a wrong scale or tile is O(1)
            print(f"  {proj.kind} {convert}: WRONG (relative error {err:.3g})", flush=True)
            return None
        calls = [lambda i=i: proj.call(i, cfg, convert) for i in range(len(proj.ws))]
        return timer(calls * max(1, 16 // len(calls)))
    except Exception as e:  # a variant that does not compile or fit: report it, keep going
        print(f"  {proj.kind} {convert}: {type(e).__name__}: {str(e)[:200]}", flush=True)
        return None


Launch = tuple[GemvConfig | None, bool, bool, bool, list[str]]  # shape, ROW_ACC_FP8, ROW_SUM_FP8, norm, converts


def resolved_config(kind: str, m: int, proj: Proj) -> GemvConfig | None:
    """The shape a launch without a config gets from its launcher (gemv_config), for the JSON rows."""
    if kind == "gate_up+silu":
        return gemv_config("silu", m, proj.n // 2, proj.k, True)
    if kind == "qkv+rope":
        return None  # the rotary launcher reshapes its config per head: only explicit shapes are picked
    return gemv_config("plain", m, proj.n, proj.k, True)


def launch_set(opts: argparse.Namespace, kind: str, m: int, proj: Proj, on_gpu: bool,
               converts: list[str]) -> dict[str, Launch]:
    """label -> Launch for the mode the command line asked for."""
    if opts.engine:
        return {label: (cfg, gemv_mod.ROW_ACC_FP8, gemv_mod.ROW_SUM_FP8, norm, [conv])
                for label, (cfg, conv, norm) in engine_launches(kind, m, proj.n, proj.k, on_gpu).items()}
    if opts.row_grid:
        return {label: (cfg, row_acc, row_sum, False, converts)
                for label, (cfg, row_acc, row_sum) in row_configs(kind, proj.n, proj.k, opts.dry_run).items()}
    return {label: (cfg, gemv_mod.ROW_ACC_FP8, gemv_mod.ROW_SUM_FP8, False, converts)
            for label, cfg in configs(kind, m, proj.n, proj.k, on_gpu, opts.grid).items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ms", default="1")
    parser.add_argument("--converts", default="cast,bits-join,asm-join")
    parser.add_argument("--budget-s", type=float, default=30.0, help="start no projection after this long")
    parser.add_argument("--grid", action="store_true", help="also the tl.dot launch shapes of DOT_GRID")
    parser.add_argument("--row-grid", action="store_true", help="M = 1 CUDA-core shapes of ROW_GRID with the run "
                        "sums, and the engine's shape without them (instead of the engine / --grid launches)")
    parser.add_argument("--pick", default=None, help="write the fastest launch per kind here as JSON, the "
                        "FP8_FUSED_M1 entries ops/bench.py --fp8-m1-table applies")
    parser.add_argument("--engine", action="store_true", help="what the engine launches at each M (its conversion "
                        "only), and qkv / gate_up with the prologue norm (FP8 under fused-folded)")
    parser.add_argument("--dry-run", action="store_true", help="CPU under TRITON_INTERPRET=1: tiny shapes")
    opts = parser.parse_args()
    t0 = time.time()
    converts = opts.converts.split(",")
    if opts.engine:
        converts = [c for c in CONVERTS if c == "cast" or c.endswith("-join")]  # each row times the engine's own
    if opts.dry_run:
        if os.environ.get("TRITON_INTERPRET") != "1":
            sys.exit("--dry-run runs the kernels under the Triton interpreter: set TRITON_INTERPRET=1")
        sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
        import kernel_harness  # noqa: F401  (its numpy patch for triton 3.6's interpreter)
        model, device, dtype, timer, copies, bw = (64, 2, 1, 16, 48), "cpu", torch.float16, wall_us, 2, 0.0
        converts = [c for c in converts if not c.startswith("asm")]  # no PTX in the interpreter
    else:
        if not torch.cuda.is_available():
            sys.exit("bench_fp8_fused needs a CUDA GPU (or --dry-run under TRITON_INTERPRET=1)")
        model, device, dtype, timer, copies = MODELS["8b"], "cuda", torch.bfloat16, graph_us, None
        bw = copy_bandwidth()
        print(f"{torch.cuda.get_device_name()}  copy bandwidth {bw / 1e12:.2f} TB/s  torch {torch.__version__}")
    torch.manual_seed(0)
    print("\n## fused decode GEMVs, FP8 weights (us per call; TB/s of the FP8 bytes)")
    print("| kernel | M | launch | " + " | ".join(converts) + " | best TB/s | % copy |")
    print("|---|---|---|" + "---|" * (len(converts) + 2))
    rows = []
    for kind in KINDS:
        for m in [int(v) for v in opts.ms.split(",")]:
            if time.time() - t0 > opts.budget_s:
                print(f"| {kind} | {m} | skipped: past --budget-s {opts.budget_s:.0f} |", flush=True)
                continue
            proj = Proj(model, kind, m, dtype, device, copies)
            launches = launch_set(opts, kind, m, proj, device == "cuda", converts)
            for label, (cfg, row_acc, row_sum, norm, conv_set) in launches.items():
                gemv_mod.ROW_ACC_FP8, gemv_mod.ROW_SUM_FP8, proj.norm = row_acc, row_sum, norm
                us = {conv: measure(proj, cfg, conv, timer) if conv in conv_set else None for conv in converts}
                timed = [v for v in us.values() if v is not None]
                best = min(timed) if timed else None
                tbs = proj.nbytes() / best / 1e6 if best else 0.0
                pct = f"{tbs * 1e12 / bw:.0%}" if bw and best else "n/a"
                cells = " | ".join(f"{v:.1f}" if v is not None else "-" for v in us.values())
                name = label if cfg is None else f"{label} ({cfg.label()})"
                print(f"| {kind} | {m} | {name} | {cells} | {tbs:.2f} | {pct} |", flush=True)
                shape = cfg or resolved_config(kind, m, proj)
                rows.append({"kind": kind, "m": m, "launch": name, "us": us, "bytes": proj.nbytes(), "n": proj.n,
                             "k": proj.k, "config": None if shape is None else list(dataclasses.astuple(shape)),
                             "row_sum": row_sum})
            if opts.pick:  # after every projection: a call cut by its timeout still leaves the picks so far
                Path(opts.pick).write_text(json.dumps(pick([r for r in rows if r["m"] == 1]), indent=1))
            del proj
            if device == "cuda":
                torch.cuda.empty_cache()
    print(f"(took {time.time() - t0:.0f} s)")
    if os.environ.get("OUT"):
        path = Path(os.environ["OUT"]) / "fp8_fused_gemv.json"
        path.write_text(json.dumps({"copy_bandwidth_tbs": bw / 1e12, "rows": rows}, indent=1))
        print(f"wrote {path}")
    if opts.pick and Path(opts.pick).exists():
        for entry in json.loads(Path(opts.pick).read_text()):
            print(f"pick: {entry['kernel']} {entry['n']}x{entry['k']}: {entry['launch']} {entry['convert']} "
                  f"{entry['us']:.1f} us")


if __name__ == "__main__":
    main()
