#!/usr/bin/env python
"""What the folded RMSNorm's rms pass still costs the batch-1 qkv and gate_up GEMVs, and whether loading the first
weight tile before it (gemv.EARLY_WEIGHT_TILE, the kernel's EARLY_W) or carried sums of squares (sumsq_partials,
read after the weight stream or loaded before it: gemv.CARRIED_SUMSQ_EARLY) remove it; and what writing those
partials costs the o_proj / down GEMVs (issue 13, W1).

For each projection (qkv + rotary + KV write, gate_up + SiLU-mul) at M = 1: the kernel without a prologue norm
(what the norm adds to), then with the folded norm under each launch config asked for, EARLY_W off and on.
us per call in CUDA-graph chains over rotating weights (ops/bench_gemv.py's Proj and graph_us: >= 512 MB, so
every call streams from HBM). From the repo root:

    PYTHONPATH=. python3 ops/bench_norm_prologue.py [--model 8b]
    TRITON_INTERPRET=1 PYTHONPATH=. python3 ops/bench_norm_prologue.py --dry-run   # CPU, tiny, checks the script

Each EARLY_W output is compared with the EARLY_W-off output of the same config (they must be equal). Prints a
table; writes $OUT/norm_prologue.json when OUT is set.
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

import bench_gemv  # noqa: E402
from stoker.engine.kernels import gemv as gemv_mod  # noqa: E402
from stoker.engine.kernels.gemv import (  # noqa: E402
    GemvConfig,
    gemv_add_sumsq_triton,
    gemv_rotary_cache_triton,
    gemv_triton,
)

CONFIGS = {  # the tuned M = 1 entry first, then the base rule's (gemv._gpu_gemv_config), then one more
    "qkv": [GemvConfig(1, 8, 512, False, 4, 3), GemvConfig(1, 4, 512, False, 4, 3), GemvConfig(1, 2, 1024, False, 4, 3)],
    "gate_up": [GemvConfig(16, 64, 128, True, 4, 4), GemvConfig(16, 32, 128, True, 2, 5),
                GemvConfig(16, 32, 256, True, 4, 4)],
}


def call(proj: bench_gemv.Proj, index: int, norm: bool, cfg: GemvConfig | None,
         partials: torch.Tensor | None = None) -> Callable[[], object]:
    """One fused call on weight copy `index` (folded when norm; its rms from `partials` when given). o / down:
    the residual-add GEMV, writing partials when `norm` (gemv_add_sumsq_triton)."""
    w = proj.ws_folded[index] if norm and proj.name in ("qkv", "gate_up") else proj.ws[index]
    x = proj.x
    if proj.name == "qkv":
        return lambda: gemv_rotary_cache_triton(
            x, w, None, num_heads=proj.hq, num_kv_heads=proj.hkv, positions=proj.positions, cos_sin=proj.cos_sin,
            k_cache=proj.k_cache, v_cache=proj.v_cache, slot_mapping=proj.slots, norm_folded=norm,
            eps=bench_gemv.EPS, config=cfg, sumsq_partials=partials)[0]
    if proj.name in ("o", "down"):
        if norm:
            return lambda: gemv_add_sumsq_triton(x, w, proj.add, config=cfg)[0]
        return lambda: gemv_triton(x, w, add=proj.add, config=cfg)[0]
    return lambda: gemv_triton(x, w, silu_mul=True, norm_folded=norm, eps=bench_gemv.EPS, config=cfg,
                               sumsq_partials=partials)[0]


def measure(proj: bench_gemv.Proj, norm: bool, cfg: GemvConfig | None, early: bool, on_gpu: bool,
            partials: torch.Tensor | None = None) -> tuple[float, torch.Tensor]:
    """early: EARLY_WEIGHT_TILE without partials, CARRIED_SUMSQ_EARLY with them."""
    gemv_mod.EARLY_WEIGHT_TILE = early and partials is None
    gemv_mod.CARRIED_SUMSQ_EARLY = early and partials is not None
    try:
        out = call(proj, 0, norm, cfg, partials)()
        calls = [call(proj, i, norm, cfg, partials) for i in range(len(proj.ws))]
        calls = calls * max(1, 16 // len(calls))
        if on_gpu:
            return bench_gemv.graph_us(calls), out
        start = time.perf_counter()
        for c in calls:
            c()
        return (time.perf_counter() - start) * 1e6 / len(calls), out
    finally:
        gemv_mod.EARLY_WEIGHT_TILE = gemv_mod.CARRIED_SUMSQ_EARLY = False


def carried_rows(proj: bench_gemv.Proj, base_us: float, on_gpu: bool) -> list[dict[str, object]]:
    """The folded GEMV on carried partials (the engine's launch shape, read late / early), against the rms pass
    on the same shape's rows: partials as the 8B o_proj / down leave them (256 programs; values immaterial)."""
    partials = torch.rand(256 if on_gpu else 7, gemv_mod.GEMV_MAX_M, device=proj.x.device)
    rows = []
    for early in (False, True):
        us, _ = measure(proj, True, None, early, on_gpu, partials)
        label = "carried, " + ("early" if early else "late")
        rows.append({"proj": proj.name, "norm": True, "config": label, "early": early, "us": us})
        print(f"| {proj.name} | {label} | auto | {'yes' if early else 'no'} | {us:.2f} | {us - base_us:+.2f} | |",
              flush=True)
    return rows


def producer_rows(model: str, dtype: torch.dtype, on_gpu: bool) -> list[dict[str, object]]:
    """o_proj / down: the residual-add GEMV alone, and writing the partials too (gemv_add_sumsq_triton)."""
    rows = []
    for name in ("o", "down"):
        proj = bench_gemv.Proj(model, name, 1, dtype, n_copies=None if on_gpu else 2)
        plain, _ = measure(proj, False, None, False, on_gpu)
        with_sums, _ = measure(proj, True, None, False, on_gpu)
        for label, us in (("add", plain), ("add + partials", with_sums)):
            rows.append({"proj": name, "norm": label != "add", "config": label, "early": False, "us": us})
            print(f"| {name} | {label} | auto | no | {us:.2f} | {us - plain:+.2f} | |", flush=True)
        del proj
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="8b", choices=("8b", "1b"))
    ap.add_argument("--dry-run", action="store_true", help="CPU under TRITON_INTERPRET=1, tiny shape")
    opts = ap.parse_args()
    on_gpu = not opts.dry_run
    if on_gpu and not torch.cuda.is_available():
        sys.exit("bench_norm_prologue needs a CUDA GPU (or --dry-run under TRITON_INTERPRET=1)")
    if opts.dry_run:
        if os.environ.get("TRITON_INTERPRET") != "1":
            sys.exit("--dry-run runs the kernels in Triton's interpreter: set TRITON_INTERPRET=1")
        sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
        import kernel_harness  # noqa: F401  (triton 3.6's interpreter needs its numpy fix)
        bench_gemv.DEVICE = "cpu"
    dtype = torch.bfloat16 if on_gpu else torch.float32
    model = opts.model if on_gpu else "tiny"
    torch.manual_seed(0)
    print("| proj | norm | config | early W | us | vs no norm | equal |")
    print("|---|---|---|---|---|---|---|")
    rows = []
    for name in ("qkv", "gate_up"):
        proj = bench_gemv.Proj(model, name, 1, dtype, n_copies=None if on_gpu else 2)
        base_us, _ = measure(proj, False, None, False, on_gpu)
        rows.append({"proj": name, "norm": False, "config": "default", "early": False, "us": base_us})
        print(f"| {name} | no | default | no | {base_us:.2f} | | |", flush=True)
        configs = CONFIGS[name] if on_gpu else [None]
        for cfg in configs:
            ref = None
            for early in (False, True):
                us, out = measure(proj, True, cfg, early, on_gpu)
                ref = out if ref is None else ref
                equal = bool(torch.equal(out, ref))
                label = cfg.label() if cfg else "interp"
                rows.append({"proj": name, "norm": True, "config": label, "early": early, "us": us, "equal": equal})
                print(f"| {name} | folded | {label} | {'yes' if early else 'no'} | {us:.2f} | {us - base_us:+.2f} | "
                      f"{equal} |", flush=True)
        rows += carried_rows(proj, base_us, on_gpu)
        del proj
        if on_gpu:
            torch.cuda.empty_cache()
    rows += producer_rows(model, dtype, on_gpu)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "norm_prologue.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
