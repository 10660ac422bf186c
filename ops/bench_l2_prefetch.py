#!/usr/bin/env python
"""Does warming L2 with o_proj's weights during the decode attention pay? (issue 13, W1 at batch 1.)

At batch 1 the decode attention (~6 us a layer at the 8B shape, 768-token context) moves ~3 MB while HBM could
move ~25 MB in that time. engine/kernels/l2_prefetch.py issues L2 prefetches of the leading fraction of each
o_proj row on a side stream forked after qkv and joined before o_proj. This times, in CUDA-graph replay:

- `attn+o`: attention then o_proj (+ residual), over 16 rotating o_proj weights (512 MB: each from HBM);
- `layer`: the whole fused-folded decode layer (qkv + rotary + KV write, attention, o + add, gate_up + SiLU,
  down + add) over 3 rotating layers' weights (1.2 GB), 32 layers a replay,

each without a prefetch and with every (mode, fraction) asked for, and with the fused attention combine off
and on (`--combine`). From the repo root:

    PYTHONPATH=. python3 ops/bench_l2_prefetch.py [--modes evict-last,normal,bulk] [--fractions 0.25,0.5,0.75,1]
    TRITON_INTERPRET=1 PYTHONPATH=. python3 ops/bench_l2_prefetch.py --dry-run   # CPU, tiny, a check of the script

Each variant's outputs are compared bitwise with the no-prefetch run once (a prefetch must change nothing).
Prints a table (us per layer); writes $OUT/l2_prefetch.json when OUT is set.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a bare checkout too
sys.path.insert(0, str(Path(__file__).resolve().parent))

from stoker.engine.kernels._triton import interpreting  # noqa: E402
from stoker.engine.kernels.attention import decode_combine_counters, paged_decode_attention_triton  # noqa: E402
from stoker.engine.kernels.gemv import fold_norm_weight, gemv_rotary_cache_triton, gemv_triton  # noqa: E402
from stoker.engine.kernels.l2_prefetch import L2Prefetcher  # noqa: E402
from stoker.engine.kernels.rotary import rope_cos_sin  # noqa: E402

MODELS = {"8b": (4096, 32, 8, 128, 14336), "1b": (2048, 32, 8, 64, 8192), "tiny": (256, 4, 2, 32, 384)}
BLOCK_SIZE = 16
EPS = 1e-5


class Layer:
    """One decoder layer's weights (qkv and gate_up with the norm folded in), its caches and activations."""

    def __init__(self, model: str, context: int, width: int, device: str, dtype: torch.dtype, seed: int):
        hidden, hq, hkv, head_dim, inter = MODELS[model]
        gen = torch.Generator(device=device).manual_seed(seed)

        def rand(*shape: int, scale: float = 1.0) -> torch.Tensor:
            return (torch.randn(*shape, generator=gen, device=device, dtype=torch.float32) * scale).to(dtype)

        g1, g2 = (torch.rand(hidden, generator=gen, device=device) + 0.5).to(dtype), \
            (torch.rand(hidden, generator=gen, device=device) + 0.5).to(dtype)
        self.hq, self.hkv, self.head_dim = hq, hkv, head_dim
        self.qkv = fold_norm_weight(rand((hq + 2 * hkv) * head_dim, hidden, scale=hidden**-0.5), g1)
        self.o = rand(hidden, hq * head_dim, scale=(hq * head_dim) ** -0.5)
        self.gate_up = fold_norm_weight(rand(2 * inter, hidden, scale=hidden**-0.5), g2)
        self.down = rand(hidden, inter, scale=inter**-0.5)
        blocks = -(-width // BLOCK_SIZE)
        self.k_cache = rand(blocks, BLOCK_SIZE, hkv, head_dim)
        self.v_cache = rand(blocks, BLOCK_SIZE, hkv, head_dim)
        self.table = torch.arange(blocks, device=device, dtype=torch.int32)[None, :]
        self.context_lens = torch.tensor([context], device=device, dtype=torch.int32)
        self.positions = torch.tensor([context - 1], device=device, dtype=torch.int64)
        self.slots = torch.tensor([context - 1], device=device, dtype=torch.int64)
        self.cos_sin = rope_cos_sin(head_dim, width, 500000.0, None, device=device)
        self.counters = decode_combine_counters(1, hkv, device)
        self.prefetchers: dict[tuple[str, float], L2Prefetcher] = {}

    def prefetcher(self, mode: str, fraction: float) -> L2Prefetcher:
        key = (mode, fraction)
        if key not in self.prefetchers:
            self.prefetchers[key] = L2Prefetcher(self.o, fraction, mode)
        return self.prefetchers[key]

    def attention(self, qkv: torch.Tensor, combine: bool) -> torch.Tensor:
        q = qkv[:, : self.hq * self.head_dim].view(1, self.hq, self.head_dim)
        out = paged_decode_attention_triton(q, self.k_cache, self.v_cache, self.table, self.context_lens,
                                            self.head_dim**-0.5, counters=self.counters if combine else None)
        return out.reshape(1, -1)

    def qkv_rotary(self, x: torch.Tensor) -> torch.Tensor:
        qkv, _ = gemv_rotary_cache_triton(
            x, self.qkv, None, num_heads=self.hq, num_kv_heads=self.hkv, positions=self.positions,
            cos_sin=self.cos_sin, k_cache=self.k_cache, v_cache=self.v_cache, slot_mapping=self.slots,
            norm_folded=True, eps=EPS)
        return qkv


class Runner:
    """Builds the measured calls; `prefetch` = (mode, fraction) or None; side: the fork stream (None on CPU)."""

    def __init__(self, layers: list[Layer], x: torch.Tensor, side: torch.cuda.Stream | None):
        self.layers, self.x, self.side = layers, x, side
        self.heads: dict[tuple[int, float], L2Prefetcher] = {}

    @contextlib.contextmanager
    def _forked(self) -> Iterator[None]:
        """Runs the body on the side stream after everything queued so far; the caller joins later."""
        if self.side is None:
            yield
            return
        self.side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.side):
            yield

    def _join(self) -> None:
        if self.side is not None:
            torch.cuda.current_stream().wait_stream(self.side)

    def attn_o(self, layer: Layer, qkv: torch.Tensor, stream: torch.Tensor, prefetch: tuple[str, float] | None,
               combine: bool, head_of_next: torch.Tensor | None = None, heads_mb: float = 0.0) -> torch.Tensor:
        if prefetch is not None:
            with self._forked():
                layer.prefetcher(*prefetch)()
        attn = layer.attention(qkv, combine)
        if prefetch is not None:
            self._join()
        if head_of_next is not None:
            self._head(head_of_next, heads_mb)
        out, _ = gemv_triton(attn, layer.o, add=stream)
        if head_of_next is not None:
            self._join()
        return out

    def _head(self, weight: torch.Tensor, heads_mb: float) -> None:
        """Forks an evict-last prefetch of the leading heads_mb of `weight` (spread over its rows): it runs while
        the kernel launched next on the main stream streams its own weights (joined after that kernel)."""
        if heads_mb > 0:
            fraction = min(1.0, heads_mb * 2**20 / (weight.numel() * weight.element_size()))
            key = (weight.data_ptr(), fraction)
            if key not in self.heads:
                self.heads[key] = L2Prefetcher(weight, fraction, "load" if interpreting() else "evict-last")
            with self._forked():
                self.heads[key]()

    def full_layer(self, index: int, stream: torch.Tensor, prefetch: tuple[str, float] | None,
                   combine: bool, heads_mb: float = 0.0) -> torch.Tensor:
        """heads_mb > 0: during each GEMV, the next GEMV's first heads_mb are prefetched (o_proj's only by
        `prefetch`, during the attention)."""
        layer, next_layer = self.layers[index % len(self.layers)], self.layers[(index + 1) % len(self.layers)]
        qkv = layer.qkv_rotary(stream)
        stream = self.attn_o(layer, qkv, stream, prefetch, combine, layer.gate_up if heads_mb else None, heads_mb)
        self._head(layer.down, heads_mb)
        act, _ = gemv_triton(stream, layer.gate_up, silu_mul=True, norm_folded=True, eps=EPS)
        self._join_if(heads_mb)
        self._head(next_layer.qkv, heads_mb)
        out, _ = gemv_triton(act, layer.down, add=stream)
        self._join_if(heads_mb)
        return out

    def _join_if(self, heads_mb: float) -> None:
        if heads_mb > 0:
            self._join()

    def chain(self, kind: str, steps: int, prefetch: tuple[str, float] | None,
              combine: bool, heads_mb: float = 0.0) -> Callable[[], torch.Tensor]:
        def run() -> torch.Tensor:
            stream = self.x
            for i in range(steps):
                if kind == "layer":
                    stream = self.full_layer(i, stream, prefetch, combine, heads_mb)
                else:  # attn+o: a fixed qkv row (the first layer's), so only attention and o_proj run
                    layer = self.layers[i % len(self.layers)]
                    stream = self.attn_o(layer, self.qkv0, self.x, prefetch, combine)
            return stream
        return run

    def prepare(self) -> None:
        self.qkv0 = self.layers[0].qkv_rotary(self.x)


def timed(fn: Callable[[], torch.Tensor], on_gpu: bool, replays: int) -> tuple[float, torch.Tensor]:
    """Wall us of one call of fn: CUDA-graph replay on the GPU, eager on the CPU; and fn's output."""
    if not on_gpu:
        start = time.perf_counter()
        out = fn()
        return (time.perf_counter() - start) * 1e6, out
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    end.synchronize()
    us = start.elapsed_time(end) * 1e3 / replays
    result = out.clone()
    del graph
    return us, result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="8b", choices=sorted(MODELS))
    ap.add_argument("--modes", default="evict-last,normal,bulk")
    ap.add_argument("--fractions", default="0.25,0.5,0.75,1")
    ap.add_argument("--context", type=int, default=768)
    ap.add_argument("--width", type=int, default=1024, help="block table width in tokens (the graphs' max_model_len)")
    ap.add_argument("--kinds", default="attn+o,layer")
    ap.add_argument("--combine", default="0,1", help="fused attention combine off / on (comma-separated 0/1)")
    ap.add_argument("--heads-mb", default="2,6", help="layer chain: MB of the next GEMV prefetched during each GEMV "
                    "(with no o_proj prefetch, and with the o_proj variant of --heads-with)")
    ap.add_argument("--heads-with", default="evict-last:0.5", help="MODE:FRACTION of o_proj's prefetch combined "
                    "with the heads")
    ap.add_argument("--dry-run", action="store_true", help="CPU under TRITON_INTERPRET=1, tiny shape, mode 'load'")
    opts = ap.parse_args()
    on_gpu = not opts.dry_run
    if on_gpu and not torch.cuda.is_available():
        sys.exit("bench_l2_prefetch needs a CUDA GPU (or --dry-run under TRITON_INTERPRET=1)")
    if opts.dry_run:
        if os.environ.get("TRITON_INTERPRET") != "1":
            sys.exit("--dry-run runs the kernels in Triton's interpreter: set TRITON_INTERPRET=1")
        sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
        import kernel_harness  # noqa: F401  (triton 3.6's interpreter needs its numpy fix)
    device, dtype = ("cuda", torch.bfloat16) if on_gpu else ("cpu", torch.float32)
    model = opts.model if on_gpu else "tiny"
    context, width = (opts.context, opts.width) if on_gpu else (40, 64)
    modes = opts.modes.split(",") if on_gpu else ["load"]
    fractions = [float(f) for f in opts.fractions.split(",")] if on_gpu else [0.5]
    copies = {"attn+o": 16, "layer": 3} if on_gpu else {"attn+o": 2, "layer": 2}
    steps = {"attn+o": 64, "layer": 32} if on_gpu else {"attn+o": 2, "layer": 2}
    variants: list[tuple[str, float] | None] = [None] + [(m, f) for m in modes for f in fractions]
    if on_gpu:
        print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}  {model} bf16, batch 1, context "
              f"{context} / table {width}")
    print("| chain | combine | prefetch | fraction | MB a layer | us a layer | vs none | equal |")
    print("|---|---|---|---|---|---|---|---|")
    rows = []
    side = torch.cuda.Stream() if on_gpu else None
    x = torch.randn(1, MODELS[model][0], device=device, dtype=dtype)
    for kind in opts.kinds.split(","):
        layers = [Layer(model, context, width, device, dtype, seed) for seed in range(copies[kind])]
        runner = Runner(layers, x, side)
        runner.prepare()
        for combine in (c == "1" for c in opts.combine.split(",")):
            base_us = None
            base_out = None
            mode, fraction = opts.heads_with.split(":")
            with_heads = [(variant, 0.0) for variant in variants]
            if kind == "layer":
                with_heads += [(v, float(mb)) for mb in (opts.heads_mb.split(",") if on_gpu else ["0.001"])
                               for v in (None, (mode if on_gpu else "load", float(fraction)))]
            for variant, heads_mb in with_heads:
                us, out = timed(runner.chain(kind, steps[kind], variant, combine, heads_mb), on_gpu, 10)
                us /= steps[kind]
                base_us = us if base_us is None else base_us
                base_out = out if base_out is None else base_out
                equal = bool(torch.equal(out, base_out))
                mb = layers[0].prefetcher(*variant).nbytes / 2**20 if variant else 0.0
                row = {"chain": kind, "combine": combine, "mode": variant[0] if variant else "none",
                       "fraction": variant[1] if variant else 0.0, "mb": mb, "heads_mb": heads_mb, "us": us,
                       "equal": equal}
                rows.append(row)
                heads = f" + heads {heads_mb:g} MB" if heads_mb else ""
                print(f"| {kind} | {int(combine)} | {row['mode']}{heads} | {row['fraction']:.2f} | {mb:.1f} | "
                      f"{us:.2f} | {us - base_us:+.2f} | {equal} |", flush=True)
        del layers, runner
        if on_gpu:
            torch.cuda.empty_cache()
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "l2_prefetch.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
