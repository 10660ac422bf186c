#!/usr/bin/env python
"""What limits a one-token FP8 GEMV on the H200: the loads, the conversion, or the accumulator? (issue 14)

Session 16's probes (.dev/s16/fp8_probe.py and dot_probe.py, same kernels) gathered into one script so
BENCHMARKS.md's figures of 2026-12-03 can be run again; this script's timing path has not itself run on a GPU yet
(only --sass, here). One plain GEMV y = W x per 8B
projection (gate_up as one 28672-row GEMV), E4M3 weights [N, K], bf16 x, in the loop structure of gemv.py's one-token
CUDA-core path (a program owns BN rows and streams K in BK steps, each thread a run of VEC codes), in these forms:

- load:   the weight stream as int32 words summed with integer adds: no conversion, no FMA (the loads' own ceiling);
- f32:    gemv.py's loop before the run sums: cast to float32, FFMA into a [BN, BK] float32 accumulator;
- f16J:   products and J steps of sums in fp16 (packed HFMA2), flushed to float32 (fewer instructions a weight);
- sums:   each thread's run of VEC products summed in registers every step, a [BN, BK / VEC] accumulator, the
          weights as int32 words through fp8_convert's inline cvt (what gemv.ROW_SUM_FP8 does; needs CUDA);
- dot-*:  the 16-row tl.dot tile with x and w as bf16 (Triton's cast), x cast to fp16 in the loop, x already fp16
          in memory, and both E4M3 (a no-conversion bound, not a usable GEMV).

From the repo root:

    PYTHONPATH=. python3 ops/probe_fp8_row_loop.py [--forms load,f32,f16,sums,dot] [--shapes down,gate_up,qkv,o]
    PYTHONPATH=. python3 ops/probe_fp8_row_loop.py --sass        # no GPU: sm_90 registers and loop instructions

Timing as ops/bench_gemv.py (CUDA-graph replay over rotating weight copies, >= 512 MB); each form's output is
checked against the float32 product first (the relative error is printed; "load" computes nothing). --sass compiles
the row forms for sm_90 with Triton's ptxas and reads the cubin with its cuobjdump / nvdisasm: registers a thread
(what bounds the blocks an SM) and the SASS instructions of the weight loop per weight code.
"""

from __future__ import annotations

import argparse
import collections
import itertools
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from stoker.engine.kernels._triton import tl, triton  # noqa: E402
from stoker.engine.kernels.fp8_convert import e4m3_words_to_tile  # noqa: E402

SHAPES = {"down": (4096, 14336), "gate_up": (28672, 4096), "qkv": (6144, 4096), "o": (4096, 4096)}
ROW_FORMS = {"f32": 0, "f16": 4, "sums": -1}  # row_gemv's J (f16: J = 4; --f16-steps changes it)
# (BN, BK, warps, VEC) around session 16's best; "sums" also with 16 codes a thread
ROW_SHAPES = [(4, 1024, 4, 8), (8, 1024, 4, 8), (4, 2048, 4, 16), (8, 2048, 4, 16), (8, 2048, 8, 8), (4, 4096, 4, 16)]
DOT_SHAPES = [(16, 256, 1, 4), (16, 256, 2, 4), (32, 128, 2, 5), (64, 128, 4, 4), (32, 256, 4, 3), (16, 512, 2, 3)]
DOT_MODES = {"dot-bf16": 0, "dot-f16x": 1, "dot-f16": 2, "dot-fp8": 3}


@triton.jit
def load_kernel(w_ptr, out_ptr, K4, BN: tl.constexpr, BK4: tl.constexpr, VEC4: tl.constexpr):
    pid = tl.program_id(0)
    rows = pid * BN + tl.arange(0, BN)
    ks = tl.max_contiguous(tl.arange(0, BK4), VEC4)
    ptrs = w_ptr + rows.to(tl.int64)[:, None] * K4 + ks[None, :]
    acc = tl.zeros([BN, BK4], tl.int32)
    for k0 in range(0, K4, BK4):
        acc += tl.load(ptrs + k0)
    tl.store(out_ptr + rows, tl.sum(acc, 1).to(tl.float32))


@triton.jit
def row_gemv(x_ptr, w_ptr, out_ptr, K, BN: tl.constexpr, BK: tl.constexpr, VEC: tl.constexpr, J: tl.constexpr):
    pid = tl.program_id(0)
    rows = pid * BN + tl.arange(0, BN)
    ks = tl.max_contiguous(tl.arange(0, BK), VEC)
    if J < 0:  # run sums: int32 words, the inline cvt, a [BN, BK / VEC] accumulator
        kw = tl.max_contiguous(tl.arange(0, BK // 4), VEC // 4)
        wq = w_ptr.to(tl.pointer_type(tl.int32)) + rows.to(tl.int64)[:, None] * (K // 4) + kw[None, :]
        sums = tl.zeros([BN, BK // VEC], tl.float32)
        for k0 in range(0, K, BK):
            w = e4m3_words_to_tile(tl.load(wq + k0 // 4), 2, BN, BK)
            x = tl.load(x_ptr + k0 + ks).to(tl.float32)
            sums += tl.sum(tl.reshape(x[None, :] * w, [BN, BK // VEC, VEC]), axis=2)
        tl.store(out_ptr + rows, tl.sum(sums, 1))
    else:
        wp = w_ptr + rows.to(tl.int64)[:, None] * K + ks[None, :]
        acc = tl.zeros([BN, BK], tl.float32)
        if J == 0:  # float32 products into a [BN, BK] float32 accumulator
            for k0 in range(0, K, BK):
                x = tl.load(x_ptr + k0 + ks).to(tl.float32)
                acc += x[None, :] * tl.load(wp + k0).to(tl.float32)
        else:  # fp16 products and J steps of fp16 sums, then float32
            for k0 in range(0, K, BK * J):
                acc16 = tl.zeros([BN, BK], tl.float16)
                for j in tl.static_range(J):
                    live = k0 + j * BK + ks < K
                    w = tl.load(wp + k0 + j * BK, mask=live[None, :], other=0.0)
                    x = tl.load(x_ptr + k0 + j * BK + ks, mask=live, other=0.0).to(tl.float16)
                    acc16 += x[None, :] * w.to(tl.float16)
                acc += acc16.to(tl.float32)
        tl.store(out_ptr + rows, tl.sum(acc, 1))


@triton.jit
def dot_gemv(x_ptr, w_ptr, out_ptr, N, K, BN: tl.constexpr, BK: tl.constexpr, MODE: tl.constexpr):
    pid = tl.program_id(0)
    rows = pid * BN + tl.arange(0, BN)
    m = tl.arange(0, 16)
    ks = tl.arange(0, BK)
    acc = tl.zeros([16, BN], tl.float32)
    for k0 in range(0, K, BK):
        x = tl.load(x_ptr + m[:, None] * K + k0 + ks[None, :], mask=(m < 1)[:, None], other=0.0)
        w = tl.load(w_ptr + rows.to(tl.int64)[:, None] * K + k0 + ks[None, :])
        if MODE == 0:  # bf16 x, w -> bf16 (Triton's cast)
            acc = tl.dot(x, tl.trans(w.to(tl.bfloat16)), acc)
        elif MODE == 1:  # bf16 x -> fp16 in the loop, w -> fp16
            acc = tl.dot(x.to(tl.float16), tl.trans(w.to(tl.float16)), acc)
        elif MODE == 2:  # x already fp16 in memory
            acc = tl.dot(x, tl.trans(w.to(tl.float16)), acc)
        else:  # both E4M3: no conversion (a bound)
            acc = tl.dot(x, tl.trans(w), acc)
    tl.store(out_ptr + m[:, None] * N + rows[None, :], acc, mask=(m < 1)[:, None])


def sm90_report() -> None:
    """Registers and weight-loop SASS of the row forms, compiled for sm_90 (no GPU needed)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    tools = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    print("| form | BN x BK, warps, VEC | registers | loop SASS a weight code | most frequent |")
    print("|---|---|---|---|---|")
    signature = {"x_ptr": "*bf16", "w_ptr": "*fp8e4nv", "out_ptr": "*fp32", "K": "i32", "BN": "constexpr",
                 "BK": "constexpr", "VEC": "constexpr", "J": "constexpr"}
    aligned = {(i,): [["tt.divisibility", 16]] for i in (0, 1, 3)}
    for (form, j), (bn, bk, warps, vec) in itertools.product(ROW_FORMS.items(), ROW_SHAPES[:2]):
        kernel = triton.compile(ASTSource(row_gemv, signature, constexprs=dict(BN=bn, BK=bk, VEC=vec, J=j),
                                          attrs=aligned),
                                target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "num_stages": 3})
        with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
            f.write(kernel.asm["cubin"])
            f.flush()
            usage = subprocess.run([str(tools / "cuobjdump"), "-res-usage", f.name], capture_output=True,
                                   text=True, check=True).stdout
            sass = subprocess.run([str(tools / "nvdisasm"), "-c", f.name], capture_output=True, text=True,
                                  check=True).stdout
        regs = re.search(r"REG:(\d+)", usage)
        ops = weight_loop_ops(sass)
        codes = bn * bk * max(j, 1) // (32 * warps)
        top = ", ".join(f"{op} {n}" for op, n in ops.most_common(4))
        print(f"| {form} | {bn} x {bk}, w{warps}, {vec} | {regs.group(1) if regs else '?'} | "
              f"{sum(ops.values()) / codes:.2f} | {top} |", flush=True)


def weight_loop_ops(sass: str) -> collections.Counter[str]:
    """Opcode counts of the longest loop (label .. backward branch) that converts E4M3 codes."""
    lines = sass.splitlines()
    labels: dict[str, int] = {}
    best: list[str] = []
    for i, line in enumerate(lines):
        label = re.match(r"\s*(\.L_x_\d+):", line)
        if label:
            labels[label.group(1)] = i
        branch = re.search(r"BRA\s+`\((\.L_x_\d+)\)", line)
        if branch and labels.get(branch.group(1), i) < i:
            body = lines[labels[branch.group(1)]: i + 1]
            if any("E4M3" in b for b in body) and len(body) > len(best):
                best = body
    ops: collections.Counter[str] = collections.Counter()
    for line in best:
        op = re.search(r"\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]+)", line)
        if op:
            ops[op.group(2)] += 1
    return ops


def time_forms(opts: argparse.Namespace) -> list[dict[str, Any]]:
    from bench_gemv import copy_bandwidth

    bw = copy_bandwidth()
    print(f"{torch.cuda.get_device_name()}  copy bandwidth {bw / 1e12:.2f} TB/s  torch {torch.__version__}")
    print("| projection | form | launch | us | % of copy | relative error |")
    print("|---|---|---|---|---|---|")
    rows: list[dict[str, Any]] = []
    for name in opts.shapes.split(","):
        rows += time_shape(name, opts.forms.split(","), opts.f16_steps, bw)
        torch.cuda.empty_cache()
    return rows


def time_shape(name: str, forms: list[str], f16_steps: int, bw: float) -> list[dict[str, Any]]:
    """Every asked form's launches on one projection: us a call and the output's error against float32."""
    from bench_gemv import graph_us

    n, k = SHAPES[name]
    copies = max(4, -(-512 * 2**20 // (n * k)))
    ws = [(torch.randn(n, k, device="cuda") * 0.05).to(torch.float8_e4m3fn) for _ in range(copies)]
    x = torch.randn(k, device="cuda", dtype=torch.bfloat16)
    xs = {0: x, 1: x, 2: x.half(), 3: x.to(torch.float8_e4m3fn)}  # dot_gemv's x by MODE
    out = torch.empty(16, n, device="cuda")
    launches: list[tuple[str, str, Callable[[int], object], torch.Tensor | None]] = []
    for bn, bk, warps, vec in ROW_SHAPES:
        if "load" in forms:
            launches.append(("load", f"{bn}x{bk} w{warps} v{vec}", lambda i, bn=bn, bk=bk, warps=warps, vec=vec:
                             load_kernel[(n // bn,)](ws[i].view(torch.int32), out, k // 4, BN=bn, BK4=bk // 4,
                                                     VEC4=vec // 4, num_warps=warps), None))
        for form, j in ROW_FORMS.items():
            if form not in forms or (form != "sums" and vec > 8):
                continue  # (16-byte FP8 loads beside 8-element x loads relay a tile through shared memory)
            j = f16_steps if form == "f16" else j
            launches.append((form if form != "f16" else f"f16 J{j}", f"{bn}x{bk} w{warps} v{vec}",
                             lambda i, bn=bn, bk=bk, warps=warps, vec=vec, j=j: row_gemv[(n // bn,)](
                                 x, ws[i], out, k, BN=bn, BK=bk, VEC=vec, J=j, num_warps=warps), x.float()))
    if "dot" in forms:
        for (mode_name, mode), (bn, bk, warps, stages) in itertools.product(DOT_MODES.items(), DOT_SHAPES):
            launches.append((mode_name, f"16x{bn}x{bk} w{warps} s{stages}",
                             lambda i, mode=mode, bn=bn, bk=bk, warps=warps, stages=stages: dot_gemv[(n // bn,)](
                                 xs[mode], ws[i], out, n, k, BN=bn, BK=bk, MODE=mode, num_warps=warps,
                                 num_stages=stages), xs[mode].float()))
    rows: list[dict[str, Any]] = []
    for form, launch, call, xref in launches:
        try:
            call(0)
            torch.cuda.synchronize()
            err = None
            if xref is not None:
                ref = ws[0].float() @ xref
                got = out[0] if form.startswith("dot") else out.view(-1)[:n]
                err = ((got - ref).norm() / ref.norm()).item()
            us = graph_us([lambda i=i, call=call: call(i) for i in range(copies)] * max(1, 16 // copies))
        except Exception as e:  # a form that does not compile or fit: report it, keep going
            print(f"| {name} | {form} | {launch} | {type(e).__name__}: {str(e)[:80]} | | |", flush=True)
            continue
        pct = n * k / us / 1e6 * 1e12 / bw
        print(f"| {name} | {form} | {launch} | {us:.1f} | {pct:.0%} | {'-' if err is None else f'{err:.1e}'} |",
              flush=True)
        rows.append({"shape": name, "form": form, "launch": launch, "us": us, "pct_copy": pct, "err": err})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--forms", default="load,f32,f16,sums,dot", help="comma list of load, f32, f16, sums, dot")
    ap.add_argument("--shapes", default="down,gate_up,qkv,o", help="comma list of " + ", ".join(SHAPES))
    ap.add_argument("--f16-steps", type=int, default=4, help="the f16 form's J: fp16 sums of this many K steps")
    ap.add_argument("--sass", action="store_true", help="no GPU: registers and loop SASS of the row forms on sm_90")
    opts = ap.parse_args()
    unknown = set(opts.forms.split(",")) - {"load", "f16", "dot", *ROW_FORMS}
    if unknown or set(opts.shapes.split(",")) - set(SHAPES):
        ap.error(f"--forms / --shapes: unknown {sorted(unknown or set(opts.shapes.split(',')) - set(SHAPES))}")
    if opts.sass:
        sm90_report()
        return
    if not torch.cuda.is_available():
        sys.exit("probe_fp8_row_loop times on a CUDA GPU (--sass compiles for sm_90 without one)")
    t0 = time.time()
    rows = time_forms(opts)
    print(f"(took {time.time() - t0:.0f} s)")
    if os.environ.get("OUT"):
        path = Path(os.environ["OUT"]) / "probe_fp8_row_loop.json"
        path.write_text(json.dumps(rows, indent=1))
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
