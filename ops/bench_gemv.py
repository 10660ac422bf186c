#!/usr/bin/env python
"""Times the fused small-M GEMV (engine/kernels/gemv.py) against cuBLAS and the unfused kernels it replaces,
on the Llama-3-8B and a 1B-class decoder's projections at M = 1, 2, 4, 8, 16, and prints one table.
CUDA only; from the repo root:

    PYTHONPATH=. python3 ops/bench_gemv.py [--sweep] [--ms 1,2,4,8,16] [--dtype bf16]

Timing: each measured op is captured in a CUDA graph as a chain of calls over rotating copies of its weights
(>= 512 MB in all, far past the 50-60 MB L2, so every call streams its weights from HBM, as in a decode step
of a real model), and the graph is replayed; the time per call is the replay time over the chain length. So
the figures include the gaps between back-to-back kernels, as in the engine's decode graphs, but no launch
cost. TB/s counts the bytes a call must move (weights + activations in and out) against the copy bandwidth
measured in the same run (a 2 GiB device copy, read + written bytes / time, as ops/bench.py).

Columns: cuBLAS = F.linear alone; unfused = the kernels the fused one replaces (RMSNorm(+residual) before
qkv and gate_up, SiLU-and-mul after gate_up, rotary + cache write after qkv; the o/down residual add is
done by the next RMSNorm in the unfused path and counted there); gemv = our kernel without fusions; fused
and fused+PDL = the fused kernel, without and with programmatic dependent launch. `layer` rows chain the four
projections of a decoder layer (no attention) over several layers' weights, unfused vs fused.
--sweep first times block-size configs of the plain GEMV per shape and M (used to pick gemv_config).
--sweep-fused times the decode path's fused kinds instead (rope + KV write, SiLU-mul, residual add, and the
folded prologue norm with rope / SiLU) over FUSED_SWEEP's configs, in --jobs processes that compile in parallel
and take turns on the GPU, and prints the best config per kind and shape; `--sweep-fused --dry-run` under
TRITON_INTERPRET=1 runs it on the CPU at a tiny shape (a check of the script, not a measurement).
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import fcntl
import json
import math
import multiprocessing
import os
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a bare checkout too

from stoker.engine.kernels import gemv as gemv_mod  # noqa: E402
from stoker.engine.kernels import (  # noqa: E402
    rms_norm_triton,
    rope_cos_sin,
    rotary_and_cache_triton,
    silu_and_mul_triton,
)
from stoker.engine.kernels.gemv import (  # noqa: E402
    GemvConfig,
    fold_norm_weight,
    gemv_rotary_cache_triton,
    gemv_triton,
)

MODELS = {  # hidden, q heads, kv heads, head_dim, intermediate
    "8b": (4096, 32, 8, 128, 14336),
    "1b": (2048, 32, 8, 64, 8192),
    "8b-rank2": (4096, 16, 4, 128, 7168),  # one rank of the 8B at TP = 2 (ops/bench.py --shape 8b-rank2)
    "tiny": (256, 4, 2, 32, 384),  # the CPU dry run's (--dry-run)
}
ROTATE_BYTES = 512 * 2**20
DEVICE = "cuda"
EPS = 1e-5


def copy_bandwidth() -> float:
    n = 2**30  # 2 GiB of bf16
    x = torch.randn(n, device=DEVICE, dtype=torch.bfloat16)
    y = torch.empty_like(x)
    for _ in range(3):
        y.copy_(x)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(20):
        y.copy_(x)
    end.record()
    end.synchronize()
    bw = 2 * x.numel() * 2 / (start.elapsed_time(end) / 1e3 / 20)
    del x, y
    torch.cuda.empty_cache()
    return bw


def graph_us(calls: list[Callable[[], object]], replays: int = 6) -> float:
    """Per-call microseconds of `calls` captured back to back in one CUDA graph."""
    for call in calls[:2]:
        call()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    graph.replay()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    end.synchronize()
    us = start.elapsed_time(end) * 1e3 / replays / len(calls)
    del graph
    return us


def copies_for(nbytes: int) -> int:
    return max(4, math.ceil(ROTATE_BYTES / nbytes))


class Proj:
    """One projection of a model at one M: rotating weight copies and the activations its ops need."""

    def __init__(self, model: str, name: str, m: int, dtype: torch.dtype, n_copies: int | None = None):
        hidden, hq, hkv, head_dim, inter = MODELS[model]
        self.model, self.name, self.m, self.dtype = model, name, m, dtype
        self.hq, self.hkv, self.head_dim = hq, hkv, head_dim
        k, n = {"qkv": (hidden, (hq + 2 * hkv) * head_dim), "o": (hq * head_dim, hidden),
                "gate_up": (hidden, 2 * inter), "down": (inter, hidden)}[name]
        self.k, self.n = k, n
        self.wbytes = n * k * dtype.itemsize
        count = n_copies or copies_for(self.wbytes)
        self.ws = [torch.randn(n, k, device=DEVICE, dtype=dtype) * k**-0.5 for _ in range(count)]
        self.x = torch.randn(m, k, device=DEVICE, dtype=dtype)
        self.res_in = torch.randn(m, k, device=DEVICE, dtype=dtype)
        self.g = torch.rand(k, device=DEVICE, dtype=dtype) + 0.5
        if name in ("qkv", "gate_up"):  # the fused path takes the norm weight folded in at load time
            self.ws_folded = [fold_norm_weight(w, self.g) for w in self.ws]
        n_out = n // 2 if name == "gate_up" else n
        self.add = torch.randn(m, n_out, device=DEVICE, dtype=dtype)
        if name == "qkv":
            self.cos_sin = rope_cos_sin(head_dim, 4096, 500000.0, None, device=DEVICE)
            self.positions = torch.randint(0, 4096, (m,), device=DEVICE)
            self.k_cache = torch.zeros(64, 16, hkv, head_dim, device=DEVICE, dtype=dtype)
            self.v_cache = torch.zeros_like(self.k_cache)
            self.slots = torch.randperm(64 * 16, device=DEVICE)[:m]
        # Bytes a call must move: weights + x in + out (+ residual in/out where the op has one).
        act = dtype.itemsize * m
        self.bytes = {"plain": self.wbytes + act * (k + n_out)}
        extra = {"qkv": act * 2 * k, "gate_up": act * 2 * k, "o": act * n_out, "down": act * n_out}[name]
        self.bytes["fused"] = self.bytes["plain"] + extra

    def cublas(self, w: torch.Tensor) -> Callable[[], object]:
        return lambda: F.linear(self.x, w)

    def plain(self, w: torch.Tensor, cfg: GemvConfig | None = None) -> Callable[[], object]:
        return lambda: gemv_triton(self.x, w, config=cfg)

    def unfused(self, w: torch.Tensor) -> Callable[[], object]:
        x, m = self.x, self.m

        def qkv() -> None:
            h, _ = rms_norm_triton(x, self.g, EPS, self.res_in)
            out = F.linear(h, w)
            q, k, v = out.split([self.hq * self.head_dim, self.hkv * self.head_dim, self.hkv * self.head_dim], -1)
            rotary_and_cache_triton(q.view(m, -1, self.head_dim), k.view(m, -1, self.head_dim),
                                    v.view(m, -1, self.head_dim), self.positions, self.cos_sin,
                                    self.k_cache, self.v_cache, self.slots)

        def gate_up() -> None:
            h, _ = rms_norm_triton(x, self.g, EPS, self.res_in)
            silu_and_mul_triton(F.linear(h, w))

        return {"qkv": qkv, "gate_up": gate_up, "o": self.cublas(w), "down": self.cublas(w)}[self.name]

    def fused(self, w: torch.Tensor, pdl: bool) -> Callable[[], object]:
        """w: one of self.ws; qkv and gate_up use its folded twin (same index in self.ws_folded)."""
        x = self.x
        if self.name in ("qkv", "gate_up"):
            w = self.ws_folded[next(i for i, v in enumerate(self.ws) if v is w)]
        if self.name == "qkv":
            return lambda: gemv_rotary_cache_triton(
                x, w, None, num_heads=self.hq, num_kv_heads=self.hkv, positions=self.positions,
                cos_sin=self.cos_sin, k_cache=self.k_cache, v_cache=self.v_cache, slot_mapping=self.slots,
                norm_folded=True, eps=EPS, pdl=pdl)
        if self.name == "gate_up":
            return lambda: gemv_triton(x, w, norm_folded=True, eps=EPS, silu_mul=True, pdl=pdl)
        return lambda: gemv_triton(x, w, add=self.add, pdl=pdl)

    def chain(self, make: Callable[[torch.Tensor], Callable[[], object]]) -> list[Callable[[], object]]:
        calls = [make(w) for w in self.ws]
        return calls * max(1, 16 // len(calls))


SWEEP_M1 = [GemvConfig(1, bn, bk, False, nw, st) for bn, bk, nw, st in [
    (4, 1024, 4, 3), (8, 512, 4, 3), (8, 1024, 4, 3), (16, 512, 4, 3), (16, 256, 4, 4), (8, 512, 4, 1),
    (16, 512, 8, 3), (32, 256, 8, 3)]]
SWEEP_DOT = [GemvConfig(16, bn, bk, True, nw, st) for bn, bk, nw, st in [
    (16, 256, 4, 4), (16, 128, 4, 6), (16, 512, 4, 3), (32, 256, 4, 4), (32, 128, 4, 5), (64, 128, 4, 4),
    (16, 256, 8, 4)]]
SWEEP_SMALL_M = [GemvConfig(4, bn, bk, False, nw, st) for bn, bk, nw, st in [
    (8, 256, 4, 3), (4, 512, 4, 3), (16, 128, 4, 3)]]


def sweep(ms: list[int], dtype: torch.dtype, bw: float) -> None:
    print("\n## sweep: plain GEMV block configs (us per call; best marked *)")
    for model in MODELS:
        for name in ("qkv", "o", "gate_up", "down"):
            for m in ms:
                p = Proj(model, name, m, dtype)
                cands = (SWEEP_M1 if m == 1 else SWEEP_SMALL_M if m <= 4 else []) + SWEEP_DOT
                res = []
                for cfg in cands:
                    try:
                        res.append((graph_us(p.chain(lambda w, c=cfg, p=p: p.plain(w, c))), cfg))
                    except Exception as e:  # a config that does not compile or fit: report, keep going
                        print(f"  {cfg}: {type(e).__name__}: {str(e)[:120]}")
                best = min(res, key=lambda r: r[0])
                cub = graph_us(p.chain(p.cublas))
                line = " ".join(f"{us:6.1f}{'*' if (us, c) == best else ' '}" for us, c in res)
                print(f"{model:>3} {name:<8} M={m:<2} cuBLAS {cub:6.1f} | {line} | best {best[0]:.1f} us "
                      f"{p.bytes['plain'] / best[0] / 1e6:.2f} TB/s ({p.bytes['plain'] / best[0] / 1e6 / bw * 1e12:.0%}) "
                      f"{best[1]}")
                del p
                torch.cuda.empty_cache()


ABLATE_CORES = [GemvConfig(1, bn, bk, False, nw, st) for bn, bk, nw, st in [
    (8, 512, 4, 3), (16, 512, 4, 3), (4, 1024, 4, 3), (8, 1024, 4, 3), (4, 512, 4, 3)]]
ABLATE_DOT = [GemvConfig(16, bn, bk, True, nw, st) for bn, bk, nw, st in [
    (16, 256, 1, 4), (16, 256, 2, 4), (32, 128, 4, 5), (32, 256, 4, 4), (64, 128, 4, 4), (64, 128, 8, 4),
    (32, 128, 2, 5), (64, 64, 4, 6)]]


def ablate(dtype: torch.dtype) -> None:
    """Which fusion costs what, per block config: us per call of each flag combination."""
    print("\n## ablation: us per call by fusion and config (cores = CUDA-core path, dot = 16-row tl.dot)")
    for model, name in [("8b", "gate_up"), ("8b", "qkv"), ("8b", "o"), ("1b", "gate_up"), ("1b", "qkv")]:
        for m in (1, 8):
            p = Proj(model, name, m, dtype)
            x = p.x

            def variants(w: torch.Tensor, cfg: GemvConfig, p: Proj = p, x: torch.Tensor = x, name: str = name) -> dict:
                out = {"plain": lambda: gemv_triton(x, w, config=cfg)}
                if name == "gate_up":
                    out["silu"] = lambda: gemv_triton(x, w, silu_mul=True, config=cfg)
                    out["norm+silu"] = lambda: gemv_triton(x, w, norm_weight=p.g, silu_mul=True, config=cfg)
                    out["fold+silu"] = lambda: gemv_triton(x, w, norm_folded=True, silu_mul=True, config=cfg)
                elif name == "qkv":
                    rope = {"num_heads": p.hq, "num_kv_heads": p.hkv, "positions": p.positions,
                            "cos_sin": p.cos_sin, "k_cache": p.k_cache, "v_cache": p.v_cache,
                            "slot_mapping": p.slots}
                    out["norm"] = lambda: gemv_triton(x, w, norm_weight=p.g, config=cfg)
                    out["fold"] = lambda: gemv_triton(x, w, norm_folded=True, config=cfg)
                    out["rope"] = lambda: gemv_rotary_cache_triton(x, w, None, **rope, config=cfg)
                    out["fold+rope"] = lambda: gemv_rotary_cache_triton(x, w, None, **rope, norm_folded=True,
                                                                         config=cfg)
                else:
                    out["add"] = lambda: gemv_triton(x, w, add=p.add, config=cfg)
                return out

            cfgs = (ABLATE_CORES if m == 1 else []) + ABLATE_DOT
            kinds = list(variants(p.ws[0], cfgs[0]))
            print(f"{model} {name} M={m}: cuBLAS {graph_us(p.chain(p.cublas)):.1f} us")
            print("  config                         " + " ".join(f"{k:>10}" for k in kinds))
            for cfg in cfgs:
                row = []
                for kind in kinds:
                    try:
                        row.append(f"{graph_us([variants(w, cfg)[kind] for w in p.ws] * max(1, 16 // len(p.ws))):10.1f}")
                    except Exception as e:  # e.g. out of shared memory: report and go on
                        row.append(f"{type(e).__name__[:10]:>10}")
                print(f"  {cfg.label():<30} " + " ".join(row), flush=True)
            del p
            torch.cuda.empty_cache()


def layer_rows(model: str, m: int, dtype: torch.dtype, bw: float) -> None:
    """A chain of decoder layers' four projections (no attention), rotating over enough layers' weights."""
    projs = {name: Proj(model, name, m, dtype, n_copies=1) for name in ("qkv", "o", "gate_up", "down")}
    layer_bytes = sum(p.wbytes for p in projs.values())
    n_layers = max(2, math.ceil(ROTATE_BYTES / layer_bytes))
    for p in projs.values():
        p.ws += [torch.randn_like(p.ws[0]) * p.k**-0.5 for _ in range(n_layers - 1)]
        if p.name in ("qkv", "gate_up"):
            p.ws_folded = [fold_norm_weight(w, p.g) for w in p.ws]

    def chain(kind: str, pdl: bool = False) -> list[Callable[[], object]]:
        calls: list[Callable[[], object]] = []
        for i in range(n_layers):
            for p in projs.values():
                calls.append(p.unfused(p.ws[i]) if kind == "unfused" else p.fused(p.ws[i], pdl))
        return calls

    per = len(projs)
    unf = graph_us(chain("unfused")) * per
    fus = graph_us(chain("fused")) * per
    pdl = graph_us(chain("fused", True)) * per
    floor = layer_bytes / bw * 1e6
    print(f"| {model} layer (4 proj) | {m:>2} | {layer_bytes / 2**20:7.1f} | {'':>7} | {unf:8.1f} | {'':>7} | "
          f"{fus:7.1f} | {pdl:8.1f} | {layer_bytes / min(fus, pdl) / 1e6:5.2f} | "
          f"{layer_bytes / min(fus, pdl) / 1e6 / bw * 1e12:5.0%} | {unf / min(fus, pdl):5.2f}x | floor {floor:.1f} us")


# ------------------------------------------------------------- the fused kinds' sweep (issue 13 item 3)
def _cores(bn: int, bk: int, warps: int = 4, stages: int = 3) -> GemvConfig:
    return GemvConfig(1, bn, bk, False, warps, stages)


def _dot(bn: int, bk: int, warps: int, stages: int) -> GemvConfig:
    return GemvConfig(16, bn, bk, True, warps, stages)


# Candidates at M = 1 per epilogue, around the configs gemv_config picks now (the first entry of each run is
# that pick itself, config=None). CUDA cores: 1-row programs, weights in registers; tl.dot: the 16-row tile.
FUSED_SWEEP: dict[str, list[GemvConfig]] = {
    "rope": [_cores(2, 1024), _cores(4, 512), _cores(4, 1024), _cores(8, 512), _cores(4, 512, 2),
             _cores(4, 256, 4, 4), _dot(16, 256, 1, 4), _dot(16, 128, 1, 5),
             _dot(32, 128, 2, 4), _dot(64, 128, 4, 4), _dot(32, 256, 2, 3)],  # wider programs for M = 2..16
    "silu": [_dot(32, 128, 2, 5), _dot(16, 128, 1, 5), _dot(16, 256, 1, 4), _dot(32, 128, 1, 5),
             _dot(32, 256, 2, 4), _dot(64, 128, 4, 4), _cores(4, 512), _cores(8, 512)],
    "add": [_dot(16, 256, 1, 4), _dot(16, 128, 1, 5), _dot(16, 512, 1, 3), _dot(32, 256, 2, 4),
            _dot(32, 128, 1, 5), _cores(4, 1024), _cores(8, 512), _cores(2, 1024),
            _dot(64, 128, 4, 4), _dot(64, 256, 4, 3), _dot(128, 128, 4, 3)],  # wider programs for M = 2..16
}
FUSED_TASKS = [("qkv", "rope"), ("qkv", "rope+fold"), ("gate_up", "silu"), ("gate_up", "silu+fold"),
               ("o", "add"), ("down", "add")]


def fused_call(p: Proj, kind: str, w: torch.Tensor, cfg: GemvConfig | None) -> Callable[[], object]:
    """One call of the decode path's kernel for this projection: rope (+ KV write), SiLU-mul or residual add;
    "+fold" adds the prologue norm (the weight's values do not change the time, so w is used as it is)."""
    fold, x = kind.endswith("+fold"), p.x
    if kind.startswith("rope"):
        return lambda: gemv_rotary_cache_triton(
            x, w, None, num_heads=p.hq, num_kv_heads=p.hkv, positions=p.positions, cos_sin=p.cos_sin,
            k_cache=p.k_cache, v_cache=p.v_cache, slot_mapping=p.slots, norm_folded=fold, eps=EPS, config=cfg)
    if kind.startswith("silu"):
        return lambda: gemv_triton(x, w, silu_mul=True, norm_folded=fold, eps=EPS, config=cfg)
    return lambda: gemv_triton(x, w, add=p.add, config=cfg)


@contextlib.contextmanager
def _gpu_lock(path: str) -> Iterator[None]:
    """One sweep worker on the GPU at a time; the others compile meanwhile (compiles are most of a sweep)."""
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _wall_us(calls: list[Callable[[], object]]) -> float:
    start = time.perf_counter()
    for call in calls:
        call()
    return (time.perf_counter() - start) * 1e6 / len(calls)


def _sweep_task(task: tuple[str, str, str, int, str, str, bool]) -> list[dict[str, Any]]:
    """A worker process: every candidate config of one (model, projection, kind, M)."""
    model, proj, kind, m, dtype_name, lock_path, dry = task
    global DEVICE
    if dry:
        DEVICE = "cpu"
        _interpreter_fix()
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[dtype_name]
    torch.manual_seed(0)
    with _gpu_lock(lock_path):
        p = Proj(model, proj, m, dtype, n_copies=2 if dry else None)
    rows: list[dict[str, Any]] = []
    # A dry run checks the script, not the configs: gemv_config's pick and one candidate.
    for cfg in [None, *FUSED_SWEEP[kind.split("+")[0]][: 1 if dry else None]]:
        row: dict[str, Any] = {"model": model, "proj": proj, "kind": kind, "m": m,
                               "config": "default" if cfg is None else cfg.label(),
                               "fields": None if cfg is None else dataclasses.astuple(cfg)}
        try:
            calls = p.chain(lambda w, c=cfg: fused_call(p, kind, w, c))
            calls[0]()  # compile outside the lock, while another worker times
            with _gpu_lock(lock_path):
                row["us"] = _wall_us(calls[:2]) if dry else graph_us(calls)
        except Exception as e:  # a config that does not compile or fit: report it, keep going
            row["error"] = f"{type(e).__name__}: {str(e)[:100]}"
        rows.append(row)
    row_bytes = p.bytes["fused"]
    for row in rows:
        row["tb_s"] = row_bytes / row["us"] / 1e6 if "us" in row else None
    return rows


def _interpreter_fix() -> None:
    """A CPU dry run only: triton 3.6's interpreter needs tests/kernel_harness.py's numpy >= 2.4 fix."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    import kernel_harness  # noqa: F401


def sweep_fused(models: list[str], ms: list[int], dtype_name: str, jobs: int, dry: bool) -> list[dict[str, Any]]:
    """Times FUSED_SWEEP's configs per (model, projection, fused kind, M) in `jobs` worker processes that
    compile in parallel and take turns on the GPU; prints each run and the best config per kind and shape."""
    print("\n## sweep of the fused kinds: us per call (CUDA-graph chains; 'default' = gemv_config's pick now)")
    lock_path = str(Path(tempfile.gettempdir()) / f"bench_gemv_sweep_{os.getpid()}.lock")
    tasks = [(model, proj, kind, m, dtype_name, lock_path, dry)
             for model in models for proj, kind in FUSED_TASKS for m in ms]
    rows: list[dict[str, Any]] = []
    with multiprocessing.get_context("spawn").Pool(jobs) as pool:
        for result in pool.imap_unordered(_sweep_task, tasks):
            rows += result
            head = result[0]
            cells = " ".join(f"{r['config']}={r['us']:.1f}" if "us" in r else f"{r['config']}=ERR({r['error'][:40]})"
                             for r in result)
            print(f"{head['model']} {head['proj']} {head['kind']} M={head['m']}: {cells}", flush=True)
    print("\n| model | proj | kind | M | default us | best us | TB/s | saved | best config | GemvConfig(...) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for model in models:
        for proj, kind in FUSED_TASKS:
            for m in ms:
                runs = [r for r in rows if (r["model"], r["proj"], r["kind"], r["m"]) == (model, proj, kind, m)
                        and "us" in r]
                if not runs:
                    print(f"| {model} | {proj} | {kind} | {m} | | | | | all failed | |")
                    continue
                default = next((r["us"] for r in runs if r["config"] == "default"), float("nan"))
                best = min(runs, key=lambda r: r["us"])
                print(f"| {model} | {proj} | {kind} | {m} | {default:.1f} | {best['us']:.1f} | {best['tb_s']:.2f} | "
                      f"{default - best['us']:+.1f} | {best['config']} | {best['fields']} |", flush=True)
    return rows


def ptx_load_widths() -> None:
    """How the compiled GEMV kernels load weights: 16-byte vector loads (ld.global.v4, or cp.async of 16 bytes
    on the pipelined tl.dot path) or narrower."""
    print("\n## PTX global loads per compiled _gemv_kernel variant (v4 / cp.async 0x10 = 16-byte)")
    try:
        for caches in gemv_mod._gemv_kernel.device_caches.values():
            for kernel in list(caches[0].values())[:12]:
                ptx = kernel.asm.get("ptx", "")
                print(f"  ld.global {ptx.count('ld.global'):3d} (v4 {ptx.count('ld.global.v4'):3d}, "
                      f"v2 {ptx.count('ld.global.v2'):3d}); cp.async {ptx.count('cp.async.cg'):3d} "
                      f"(16-byte {ptx.count('], 0x10;'):3d})")
    except Exception as e:  # introspection of Triton internals is best effort
        print(f"  (not available: {type(e).__name__}: {e})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dtype", default="bf16", choices=["bf16", "fp16"])
    parser.add_argument("--ms", default="1,2,4,8,16")
    parser.add_argument("--sweep", action="store_true", help="first time block configs of the plain GEMV")
    parser.add_argument("--sweep-ms", default="1,4,16")
    parser.add_argument("--ablate", action="store_true", help="time each fusion per block config")
    parser.add_argument("--models", default="8b,1b")
    parser.add_argument("--sweep-fused", action="store_true",
                        help="time FUSED_SWEEP's configs of the fused kinds (rope, silu, add, +fold), then stop")
    parser.add_argument("--sweep-fused-ms", default="1")
    parser.add_argument("--jobs", type=int, default=8, help="--sweep-fused's worker processes (parallel compiles)")
    parser.add_argument("--dry-run", action="store_true",
                        help="--sweep-fused on the CPU under TRITON_INTERPRET=1 at a tiny shape (checks the script)")
    opts = parser.parse_args()
    if opts.sweep_fused:
        if opts.dry_run and os.environ.get("TRITON_INTERPRET") != "1":
            sys.exit("--dry-run runs the kernels in Triton's interpreter: set TRITON_INTERPRET=1")
        if not opts.dry_run and not torch.cuda.is_available():
            sys.exit("bench_gemv needs a CUDA GPU (or --sweep-fused --dry-run under TRITON_INTERPRET=1)")
        t0 = time.time()
        models = ["tiny"] if opts.dry_run else opts.models.split(",")
        rows = sweep_fused(models, [int(m) for m in opts.sweep_fused_ms.split(",")],
                           "fp32" if opts.dry_run else opts.dtype, opts.jobs, opts.dry_run)
        if os.environ.get("OUT"):
            Path(os.environ["OUT"], "gemv_sweep_fused.json").write_text(json.dumps(rows, indent=1))
        print(f"(fused sweep took {time.time() - t0:.0f} s)")
        return
    if not torch.cuda.is_available():
        sys.exit("bench_gemv needs a CUDA GPU")
    dtype = torch.bfloat16 if opts.dtype == "bf16" else torch.float16
    torch.manual_seed(0)
    t0 = time.time()
    bw = copy_bandwidth()
    print(f"{torch.cuda.get_device_name()}  dtype={opts.dtype}  SMs={torch.cuda.get_device_properties(0).multi_processor_count}"
          f"  copy bandwidth {bw / 1e12:.2f} TB/s  torch {torch.__version__}")
    if opts.sweep:
        sweep([int(m) for m in opts.sweep_ms.split(",")], dtype, bw)
        print(f"(sweep took {time.time() - t0:.0f} s)")
    if opts.ablate:
        ablate(dtype)
        print(f"(ablation done at {time.time() - t0:.0f} s)")
    ms = [int(m) for m in opts.ms.split(",")]
    print("\n## fused GEMV vs cuBLAS (+ the unfused kernels it replaces); us per call, CUDA-graph replay")
    print("| proj | M | weights MB | cuBLAS | unfused | gemv | fused | fused+PDL | TB/s | % copy | speedup | config |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for model in opts.models.split(","):
        for name in ("qkv", "o", "gate_up", "down"):
            for m in ms:
                p = Proj(model, name, m, dtype)
                cub = graph_us(p.chain(p.cublas))
                unf = graph_us(p.chain(p.unfused))
                plain = graph_us(p.chain(p.plain))
                fus = graph_us(p.chain(lambda w, p=p: p.fused(w, False)))
                pdl = graph_us(p.chain(lambda w, p=p: p.fused(w, True)))
                best = min(fus, pdl)
                tbs = p.bytes["fused"] / best / 1e6
                n_out = p.n // 2 if name == "gate_up" else p.n
                cfg = gemv_mod.gemv_config({"gate_up": "silu", "qkv": "rope"}.get(name, "plain"), m, n_out // (2 if name == "qkv" else 1), p.k, True)
                label = f"{model} {name}{'+rope+cache' if name == 'qkv' else ''} {p.k}x{p.n}"
                print(f"| {label} | {m:>2} | {p.wbytes / 2**20:7.1f} | {cub:6.1f} | {unf:7.1f} | {plain:6.1f} | "
                      f"{fus:6.1f} | {pdl:7.1f} | {tbs:5.2f} | {tbs / bw * 1e12:5.0%} | {unf / best:5.2f}x | "
                      f"{cfg.label()} |", flush=True)
                del p
                torch.cuda.empty_cache()
        for m in ms:
            layer_rows(model, m, dtype, bw)
    ptx_load_widths()
    print(f"(bench took {time.time() - t0:.0f} s)")


if __name__ == "__main__":
    main()
