"""The fused decode layer's kernel chain at batch 1, plain and with PDL, in a CUDA graph (issue 13).

    PYTHONPATH=. python3 ops/bench_pdl_chain.py [--shape 8b] [--layers 8] [--context 640] \
        [--variants plain,pdl] [--dry-run]

One layer = qkv GEMV (folded-norm prologue, rotary, KV write) -> decode attention (fused combine) -> o_proj GEMV +
residual -> gate_up GEMV (folded-norm prologue, SiLU-mul) -> down GEMV + residual, as engine/models/fused_decode.py
launches them for bf16 "fused-folded" (weights the 8B shape's, random; every layer its own copy, so each streams
from HBM). Per variant (plain; pdl: EngineConfig.decode_pdl's form, the attention in the chain; mlp: gate_up + down
as engine/kernels/fused_mlp.py's two kernels, EngineConfig.decode_fused_mlp): us per layer over the
graph's replays (CUDA events), and from one profiled replay (torch.profiler, CUPTI) the median gap between each
kernel's end and the next one's start (negative: the next kernel was already running, i.e. PDL overlapped them)
and each kernel's median duration. Table to stdout, $OUT/pdl_chain.json when OUT is set. --dry-run: the tiny
shape eagerly on the CPU under TRITON_INTERPRET=1 (no graph, no profiler): checks the script, not the GPU.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any

import torch

SHAPES = {  # hidden, heads, kv heads, head_dim, intermediate
    "8b": (4096, 32, 8, 128, 14336),
    "1b": (2048, 32, 8, 64, 8192),
    "tiny": (256, 4, 2, 64, 384),
}
STAGES = ("qkv", "attention", "o_proj", "gate_up", "down")


class Layer:
    """One decoder layer's fused-decode weights (norms folded: unit gains) and its paged KV cache."""

    def __init__(self, shape: str, context: int, device: str, dtype: torch.dtype, block_size: int = 16) -> None:
        from stoker.engine.kernels import rope_cos_sin
        from stoker.engine.kernels.attention import decode_combine_counters

        hidden, heads, kv_heads, head_dim, inter = SHAPES[shape]
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim

        def weight(n: int, k: int) -> torch.Tensor:
            return (torch.randn(n, k, device=device) * k**-0.5).to(dtype)

        self.w_qkv = weight((heads + 2 * kv_heads) * head_dim, hidden)
        self.w_o, self.w_gu, self.w_d = weight(hidden, heads * head_dim), weight(2 * inter, hidden), weight(hidden, inter)
        self.cos_sin = rope_cos_sin(head_dim, context + 1, 500000.0, None, device=device)
        blocks = (context + block_size - 1) // block_size
        self.k_cache = torch.randn(blocks, block_size, kv_heads, head_dim, device=device).to(dtype)
        self.v_cache = torch.randn_like(self.k_cache)
        # A table as wide as the engine's graphs (max_model_len 1024): the split count follows its width.
        width = max(blocks, 1024 // block_size)
        self.block_tables = torch.zeros(1, width, dtype=torch.int32, device=device)
        self.block_tables[0, :blocks] = torch.randperm(blocks, device=device, dtype=torch.int32)
        self.context_lens = torch.tensor([context], dtype=torch.int32, device=device)
        self.positions = torch.tensor([context - 1], dtype=torch.int64, device=device)
        last = self.block_tables[0, (context - 1) // block_size].long()
        self.slots = (last * block_size + (context - 1) % block_size).view(1)
        self.counters = decode_combine_counters(1, kv_heads, device)
        self.mlp_acc = torch.zeros(hidden, dtype=torch.float32, device=device)  # the fused MLP's (left zero)

    def forward(self, stream: torch.Tensor, pdl: bool, mlp: bool = False) -> torch.Tensor:
        from stoker.engine.kernels.attention import paged_decode_attention_triton
        from stoker.engine.kernels.fused_mlp import fused_mlp_triton
        from stoker.engine.kernels.gemv import gemv_rotary_cache_triton, gemv_triton

        qkv, _ = gemv_rotary_cache_triton(
            stream, self.w_qkv, None, num_heads=self.heads, num_kv_heads=self.kv_heads, positions=self.positions,
            cos_sin=self.cos_sin, k_cache=self.k_cache, v_cache=self.v_cache, slot_mapping=self.slots,
            norm_folded=True, eps=1e-5, pdl=pdl)
        q = qkv[:, : self.heads * self.head_dim].view(1, self.heads, self.head_dim)
        attn = paged_decode_attention_triton(q, self.k_cache, self.v_cache, self.block_tables, self.context_lens,
                                             self.head_dim**-0.5, counters=self.counters, pdl=pdl)
        stream, _ = gemv_triton(attn.reshape(1, -1), self.w_o, add=stream, pdl=pdl)
        if mlp:  # EngineConfig.decode_fused_mlp: one streaming kernel and a reduce (engine/kernels/fused_mlp.py)
            return fused_mlp_triton(stream, self.w_gu, self.w_d, stream, eps=1e-5, accumulator=self.mlp_acc)
        act, _ = gemv_triton(stream, self.w_gu, silu_mul=True, norm_folded=True, eps=1e-5, pdl=pdl)
        return gemv_triton(act, self.w_d, add=stream, pdl=pdl)[0]


VARIANTS = {"plain": (False, False), "pdl": (True, False), "mlp": (False, True)}  # variant -> (pdl, fused MLP)
MLP_STAGES = ("qkv", "attention", "o_proj", "mlp", "mlp_finish")


def run_chain(layers: list[Layer], x: torch.Tensor, pdl: bool, mlp: bool = False) -> torch.Tensor:
    for layer in layers:
        x = layer.forward(x, pdl, mlp)
    return x


def time_variant(layers: list[Layer], x: torch.Tensor, variant: str, replays: int) -> dict[str, Any]:
    pdl, mlp = VARIANTS[variant]
    for _ in range(2):  # compile outside the capture
        run_chain(layers, x, pdl, mlp)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run_chain(layers, x, pdl, mlp)
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    end.synchronize()
    result: dict[str, Any] = {"us_per_layer": start.elapsed_time(end) * 1e3 / replays / len(layers)}
    try:
        result |= profile_gaps(graph, len(layers), MLP_STAGES if mlp else STAGES)
    except Exception as e:  # the timing above stands without the profile
        result["profile_error"] = f"{type(e).__name__}: {e}"[:300]
    expected = run_chain(layers, x, False)
    result["bitwise_equal_to_plain"] = bool(torch.equal(out, expected))
    result["max_abs_diff_to_plain"] = (out.float() - expected.float()).abs().max().item()
    del graph
    return result


def profile_gaps(graph: torch.cuda.CUDAGraph, num_layers: int, stages: tuple[str, ...] = STAGES) -> dict[str, Any]:
    """Median gap (next start - this end, us) after each stage and median duration of each, from one replay."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        graph.replay()
        torch.cuda.synchronize()
    return gaps_from_events(prof.events(), num_layers, stages)


def gaps_from_events(events: Any, num_layers: int, stages: tuple[str, ...] = STAGES) -> dict[str, Any]:
    kernels = sorted((e for e in events if str(e.device_type).endswith("CUDA")
                      and e.name.startswith(("_gemv", "_decode", "_mlp"))), key=lambda e: e.time_range.start)
    if len(kernels) != len(stages) * num_layers:
        return {"profile_error": f"{len(kernels)} kernels for {num_layers} layers: "
                                 f"{sorted({k.name for k in kernels})}"}
    gaps: dict[str, list[float]] = {s: [] for s in stages}
    durations: dict[str, list[float]] = {s: [] for s in stages}
    for i, k in enumerate(kernels):
        stage = stages[i % len(stages)]
        durations[stage].append(k.time_range.end - k.time_range.start)
        if i + 1 < len(kernels):
            gaps[stage].append(kernels[i + 1].time_range.start - k.time_range.end)
    return {"gap_after_us": {s: statistics.median(v) for s, v in gaps.items() if v},
            "duration_us": {s: statistics.median(v) for s, v in durations.items()}}


def dry_run(variants: list[str]) -> None:
    """Each variant eagerly on the CPU (interpreter: the GEMVs run without PDL, the attention's peeled tile runs)."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
    import kernel_harness  # noqa: F401  (under TRITON_INTERPRET=1 it patches the interpreter for numpy >= 2.4)

    torch.manual_seed(0)
    layers = [Layer("tiny", 40, "cpu", torch.float32) for _ in range(2)]
    x = torch.randn(1, SHAPES["tiny"][0])
    plain = run_chain(layers, x, False)
    for variant in variants:
        out = run_chain(layers, x, *VARIANTS[variant])
        print(f"dry-run {variant}: max |out - plain| = {(out - plain).abs().max().item():.3g}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="8b")
    ap.add_argument("--layers", type=int, default=8, help="layers in the graph, each with its own weights")
    ap.add_argument("--context", type=int, default=640, help="W1's mean context (512 + 256 / 2)")
    ap.add_argument("--replays", type=int, default=20)
    ap.add_argument("--variants", default="plain,pdl", help="comma-separated: plain, pdl, mlp")
    ap.add_argument("--budget-s", type=float, default=60.0, help="stop starting new variants after this")
    ap.add_argument("--dry-run", action="store_true")
    args = ap.parse_args()
    variants = args.variants.split(",")
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:  # a typo fails before any work
        ap.error(f"unknown variants {unknown}: choose from {sorted(VARIANTS)}")
    if args.dry_run:
        dry_run(variants)
        return 0
    t0 = time.perf_counter()
    torch.manual_seed(0)
    layers = [Layer(args.shape, args.context, "cuda", torch.bfloat16) for _ in range(args.layers)]
    x = torch.randn(1, SHAPES[args.shape][0], device="cuda").to(torch.bfloat16)
    results: dict[str, Any] = {"shape": args.shape, "layers": args.layers, "context": args.context,
                               "gpu": torch.cuda.get_device_name(), "variants": {}}
    print("| variant | us / layer | gap after qkv / attn / o / gate_up / down (us) | qkv / attn / o / gate_up / down us |"
          " bitwise |")
    print("|---|---|---|---|---|")
    for variant in variants:
        if time.perf_counter() - t0 > args.budget_s:
            print(f"budget spent: {variant} not run")
            break
        r = results["variants"][variant] = time_variant(layers, x, variant, args.replays)
        stages = MLP_STAGES if VARIANTS[variant][1] else STAGES
        gaps = " / ".join(f"{r['gap_after_us'][s]:.2f}" for s in stages if s in r.get("gap_after_us", {}))
        durs = " / ".join(f"{r['duration_us'][s]:.2f}" for s in stages if s in r.get("duration_us", {}))
        print(f"| {variant} | {r['us_per_layer']:.2f} | {gaps or r.get('profile_error')} | {durs} | "
              f"{r['bitwise_equal_to_plain']} |", flush=True)
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "pdl_chain.json"), "w") as f:
            json.dump(results, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
