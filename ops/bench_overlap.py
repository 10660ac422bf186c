#!/usr/bin/env python
"""Measure before building the overlap (issue 13 item 4): does running one half's GEMMs beside the other half's
decode attention pay, on the 8B shape (bf16, random weights, no model folder)?

    PYTHONPATH=. python3 ops/bench_overlap.py [--layers 8] [--batches 1024,512] [--context 640] [--json F]
    PYTHONPATH=. python3 ops/bench_overlap.py --shape tiny      # the CPU dry run (timings meaningless)

(a) one layer's four projection GEMMs (the engine's Linear: F.linear, cuBLAS) at M = the half and the whole;
(b) our decode attention (engine PagedAttention -> _decode_split_kernel) for each batch at context ~640
    (uniform in context +- 128), with the K/V bytes it must read -> TB/s;
(c) both against the SMs they may use: the attention on a persistent grid of k programs
    (engine/kernels/decode_persistent.py: one program per SM up to the SM count), the GEMMs at cuBLAS's SM
    count target (torch._C._set_sm_carveout_experimental, honoured on the cublasLt path, so that backend is
    picked meanwhile), and both in a green context of k SMs (torch.cuda.green_contexts, beta in torch 2.11;
    SM counts in multiples of 8 on Hopper); eager launches timed with events in their stream, except the
    persistent attention (graph-timed);
(d) the engine's own decode layers (LlamaModel, `--layers` of them) over a whole decode step in one CUDA graph:
    the plain order, the two halves in sequence on one stream (the cost of splitting alone), the two halves
    overlapped on two streams (engine/models/nano_batches.py), and the overlap with the GEMMs' SM count target
    lowered so attention keeps some SMs. (d) is the deciding figure at full clock;
(e) `--sustained S`: (d)'s graphs (plain, halves, overlapped at each carve-out) replayed in alternating rounds for
    S seconds on one hot GPU, the SM clock and power logged (ops/gpu_clock.py): W2 runs at the 700 W cap, where a
    memory-bound kernel beside a power-bound GEMM may pay although it does not at full clock.
--w2 auto,auto+overlap instead runs ops/bench.py's W2 once per setting on fresh engines (see w2_ab).
Each section prints its rows as it finishes and the JSON (--json, or $OUT/bench_overlap.json) is rewritten after
each, so a run cut short keeps what it measured.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a bare checkout too

from stoker.engine import kernels  # noqa: E402
from stoker.engine.batch import AttentionMetadata  # noqa: E402
from stoker.engine.kernels.decode_persistent import paged_decode_attention_persistent  # noqa: E402
from stoker.engine.model_config import ModelConfig  # noqa: E402
from stoker.engine.models.llama import LlamaModel  # noqa: E402
from stoker.engine.models.nano_batches import NanoBatchPlan  # noqa: E402

SHAPES: dict[str, dict[str, int]] = {
    "8b": {"hidden": 4096, "inter": 14336, "heads": 32, "kv_heads": 8, "head_dim": 128},
    "tiny": {"hidden": 256, "inter": 512, "heads": 4, "kv_heads": 2, "head_dim": 64},
}
BLOCK = 16


def model_config(shape: dict[str, int], layers: int) -> ModelConfig:
    return ModelConfig(
        architecture="LlamaForCausalLM", vocab_size=1024, hidden_size=shape["hidden"],
        intermediate_size=shape["inter"], num_layers=layers, num_heads=shape["heads"],
        num_kv_heads=shape["kv_heads"], head_dim=shape["head_dim"], rms_norm_eps=1e-5, rope_theta=500000.0,
        rope_scaling=None, max_position_embeddings=8192, tie_word_embeddings=False, attention_bias=False,
        qk_norm=False, eos_token_ids=[], bos_token_id=None, sliding_window=None,
    )


def build_model(cfg: ModelConfig, dtype: torch.dtype, device: torch.device) -> LlamaModel:
    """Random weights (std 0.02, norms 1): only the shapes matter for time, but finite values keep it honest."""
    with torch.device(device):
        model = LlamaModel(cfg, dtype, cfg.max_position_embeddings)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.02) if p.dim() >= 2 else p.fill_(1.0)
    return model.eval()


class Batch:
    """A decode step of `rows` sequences at contexts uniform in [context - 128, context + 128] (>= 2), their
    blocks shuffled over one cache per layer; the step writes its token at position context - 1."""

    def __init__(self, cfg: ModelConfig, rows: int, context: int, layers: int, dtype: torch.dtype,
                 device: torch.device, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        spread = min(128, context // 2)
        lens = torch.randint(context - spread, context + spread + 1, (rows,), generator=g).clamp(min=2)
        per_seq = -(-int(lens.max()) // BLOCK)
        blocks = torch.randperm(rows * per_seq, generator=g).view(rows, per_seq)
        pos = lens - 1
        slots = blocks[torch.arange(rows), pos // BLOCK] * BLOCK + pos % BLOCK
        self.rows, self.context_tokens = rows, int(lens.sum())
        self.positions = pos.to(device)
        self.meta = AttentionMetadata(slots.to(device), blocks.to(torch.int32).to(device),
                                      torch.arange(rows + 1, dtype=torch.int32, device=device),
                                      lens.to(torch.int32).to(device), decode_only=True)
        shape = (rows * per_seq, BLOCK, cfg.num_kv_heads, cfg.head_dim)
        self.kv_caches = [(torch.randn(shape, dtype=dtype, device=device),
                           torch.randn(shape, dtype=dtype, device=device)) for _ in range(layers)]
        self.input_ids = torch.randint(0, cfg.vocab_size, (rows,), generator=g).to(device)

    def kv_bytes(self, cfg: ModelConfig, dtype: torch.dtype) -> int:
        """K and V bytes one layer's decode attention must read."""
        return 2 * self.context_tokens * cfg.num_kv_heads * cfg.head_dim * torch.finfo(dtype).bits // 8


# ---------------------------------------------------------------------------------------------- timing


def graph_ms(fn: Callable[[], Any], device: torch.device, reps: int, keep: list[Any] | None = None) -> float:
    """Mean time of fn as a replayed CUDA graph (one capture of one call); CPU: wall time of plain calls.
    keep: gets the output of the last replay (call) appended."""
    if device.type != "cuda":
        out = fn()
        if keep is not None:
            keep.append(out)
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        return (time.perf_counter() - t0) / reps * 1e3
    graph, out = capture(fn, device)
    ms = replay_ms(graph, reps)
    if keep is not None:
        keep.append(out.clone())
    del graph
    return ms


def replay_ms(graph: Any, n: int) -> float:
    """Mean time of n back-to-back replays of a captured graph (CUDA events on the current stream)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(n):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / n


def capture(fn: Callable[[], Any], device: torch.device) -> tuple[Any, Any]:
    """fn warmed up off the capture stream (compiles, cuBLAS picks algorithms), then captured -> (graph, its
    output tensor, rewritten by each replay)."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    graph.replay()
    torch.cuda.synchronize(device)
    return graph, out


def stream_ms(fn: Callable[[], Any], device: torch.device, reps: int, stream: Any = None) -> float:
    """Mean time of `reps` back-to-back eager calls of fn on `stream` (default: current), events in that stream
    (ms-long kernels: the launch gaps are noise)."""
    if device.type != "cuda":
        return graph_ms(fn, device, reps)
    stream = stream or torch.cuda.current_stream()
    with torch.cuda.stream(stream):
        fn()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(stream)
        for _ in range(reps):
            fn()
        end.record(stream)
    end.synchronize()
    return start.elapsed_time(end) / reps


class Report:
    def __init__(self, path: str | None):
        self.path, self.data = path, {"rows": []}

    def row(self, section: str, name: str, ms: float | None, **extra: Any) -> None:
        text = "n/a" if ms is None else f"{ms:9.3f}"
        notes = "  ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in extra.items())
        print(f"{section:<4} {name:<52} {text:>9} ms  {notes}", flush=True)
        self.data["rows"].append({"section": section, "name": name, "ms": ms, **extra})
        self.save()

    def note(self, key: str, value: Any) -> None:
        print(f"# {key}: {value}", flush=True)
        self.data[key] = value
        self.save()

    def save(self) -> None:
        if self.path:
            with open(self.path, "w") as f:
                json.dump(self.data, f, indent=1)


# ---------------------------------------------------------------------------------------------- sections


def projections(model: LlamaModel, rows: int, dtype: torch.dtype, device: torch.device) -> dict[str, Callable[[], Any]]:
    """One layer's four GEMMs at M = rows (the engine's modules: F.linear)."""
    layer: Any = model.layers[0]
    x = torch.randn(rows, layer.self_attn.qkv_proj.input_size, dtype=dtype, device=device)
    xi = torch.randn(rows, layer.mlp.down_proj.input_size, dtype=dtype, device=device)
    return {"qkv": lambda: layer.self_attn.qkv_proj(x), "o_proj": lambda: layer.self_attn.o_proj(x),
            "gate_up": lambda: layer.mlp.gate_up_proj(x), "down": lambda: layer.mlp.down_proj(xi)}


def gemm_flops(model: LlamaModel, rows: int) -> float:
    layer: Any = model.layers[0]
    mods = (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj)
    return sum(2.0 * rows * m.input_size * m.output_size for m in mods)


def attention_fn(model: LlamaModel, batch: Batch, dtype: torch.dtype, device: torch.device) -> Callable[[], Any]:
    attn: Any = model.layers[0].self_attn
    q = torch.randn(batch.rows, attn.num_heads, attn.head_dim, dtype=dtype, device=device)
    k, v = batch.kv_caches[0]
    return lambda: attn.attn(q, k, v, batch.meta)


def section_a_b(rep: Report, model: LlamaModel, cfg: ModelConfig, batch: Batch, dtype: torch.dtype,
                device: torch.device, reps: int) -> None:
    """(a) the GEMMs at M = the batch and its half; (b) the batch's attention."""
    for rows in (batch.rows, batch.rows // 2):
        total = 0.0
        for name, fn in projections(model, rows, dtype, device).items():
            ms = graph_ms(fn, device, reps)
            total += ms
            rep.row("a", f"GEMM {name} M={rows}", ms)
        rep.row("a", f"GEMMs of one layer M={rows}", total, tflops=gemm_flops(model, rows) / total / 1e9)
    ms = graph_ms(attention_fn(model, batch, dtype, device), device, reps)
    rep.row("b", f"attention B={batch.rows} ctx~{batch.context_tokens // batch.rows}", ms,
            tb_s=batch.kv_bytes(cfg, dtype) / ms / 1e9)


def section_d(rep: Report, model: LlamaModel, cfg: ModelConfig, batch: Batch, device: torch.device,
              reps: int, carveouts: list[int], programs: list[int]) -> None:
    """Whole decode step over the layers, graph-timed: plain, halves on one stream, halves on two streams, and
    the overlap with the SMs split: GEMMs at a lower cuBLAS SM target, attention on a persistent grid."""
    rows, layers = batch.rows, cfg.num_layers

    def step() -> Any:
        return model(batch.input_ids, batch.positions, batch.meta, batch.kv_caches)

    cuda = device.type == "cuda"
    sms = torch.cuda.get_device_properties(device).multi_processor_count if cuda else 0
    side = torch.cuda.Stream(device) if cuda else None
    # A high-priority attention lane: its programs go first whenever an SM frees up during a GEMM.
    urgent = torch.cuda.Stream(device, priority=-1) if cuda else None
    two, one = NanoBatchPlan(2, side), NanoBatchPlan(2, None)
    # (name, plan, GEMMs leave this many SMs (cublasLt), attention on this many persistent programs)
    variants: list[tuple[str, NanoBatchPlan | None, int | None, int | None]] = [
        ("plain order", None, None, None), ("two halves, one stream", one, None, None),
        ("two halves overlapped (2 streams)", two, None, None),
        ("overlapped, attention stream high priority", NanoBatchPlan(2, urgent), None, None)]
    if cuda:  # the carve-out runs prefer cublasLt: the plain order on that backend is their baseline
        variants.append(("plain order, cublasLt", None, 0, None))
        variants.append((f"plain order, persistent attention {sms}", None, None, sms))
    # carve-out 0: cublasLt with the SM target at every SM
    variants += [(f"overlapped, cublasLt, GEMMs leave {c} SMs", two, c, None) for c in carveouts]
    # The engine's own split (NanoBatchPlan.attention_sms: persistent attention + the GEMMs' SM target lowered).
    variants += [(f"overlapped, attention {k} programs, GEMMs leave {k}", NanoBatchPlan(2, side, k), None, None)
                 for k in programs]
    plain: tuple[float, torch.Tensor] | None = None
    for name, plan, carveout, attn_programs in variants:
        model.nano_batches = plan
        outs: list[torch.Tensor] = []
        try:
            with gemm_carveout(carveout), persistent_attention(attn_programs):
                ms = graph_ms(step, device, reps, outs)
        except Exception as e:  # a carve-out the build refuses: say so, keep the others
            rep.row("d", f"B={rows} {name}", None, error=repr(e)[:160])
            continue
        finally:
            model.nano_batches = None
        plain = plain or (ms, outs[0].float())
        # The final hidden states against the plain order's (bf16: the halves' GEMMs round differently).
        diff = float((outs[0].float() - plain[1]).abs().max())
        rep.row("d", f"B={rows} {name}", ms, per_layer_ms=ms / layers, vs_plain=plain[0] / ms, max_diff=diff)


def section_e(rep: Report, model: LlamaModel, batch: Batch, device: torch.device, seconds: float,
              carveouts: list[int], round_s: float = 0.4) -> None:
    """(d)'s variants (the persistent grid aside) sustained: every graph captured first, then replayed in
    alternating rounds of ~round_s each for `seconds`, so that each variant sees the same clock, power and heat.
    Per variant: the median (min-max) of its rounds' mean replay time, and that median against the plain
    order's; the SM clock and power over the whole run."""
    from stoker.ops.gpu_clock import ClockLog

    def step() -> Any:
        return model(batch.input_ids, batch.positions, batch.meta, batch.kv_caches)

    rows, layers = batch.rows, len(model.layers)
    side = torch.cuda.Stream(device)
    two, one = NanoBatchPlan(2, side), NanoBatchPlan(2, None)
    variants: list[tuple[str, NanoBatchPlan | None, int | None]] = [
        ("plain order", None, None), ("plain order, cublasLt", None, 0), ("two halves, one stream", one, None),
        ("two halves overlapped (2 streams)", two, None)]
    variants += [(f"overlapped, cublasLt, GEMMs leave {c} SMs", two, c) for c in carveouts]
    graphs: dict[str, tuple[Any, torch.Tensor]] = {}
    for name, plan, carveout in variants:
        model.nano_batches = plan
        try:
            with gemm_carveout(carveout):
                graphs[name] = capture(step, device)
        except Exception as e:
            rep.row("e", f"B={rows} {name}", None, error=repr(e)[:160])
        finally:
            model.nano_batches = None
    if "plain order" not in graphs:
        return
    reference = graphs["plain order"][1].float().clone()
    diffs = {name: float((out.float() - reference).abs().max()) for name, (_, out) in graphs.items()}

    per_round = max(2, int(round_s * 1e3 / replay_ms(graphs["plain order"][0], 3)))
    times: dict[str, list[float]] = {name: [] for name in graphs}
    with ClockLog() as clocks:
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            for name, (graph, _) in graphs.items():
                times[name].append(replay_ms(graph, per_round))
    c = clocks.summary()
    rep.note("e_clock", c)
    base = statistics.median(times["plain order"])
    for name, ts in times.items():
        med = statistics.median(ts)
        rep.row("e", f"B={rows} sustained {name}", med, per_layer_ms=med / layers, vs_plain=base / med,
                min_ms=min(ts), max_ms=max(ts), rounds=len(ts), replays_a_round=per_round, max_diff=diffs[name])


class persistent_attention:
    """Decode attention through decode_persistent.py on n programs (patched where the layers look it up);
    None: the engine's kernel."""

    def __init__(self, n: int | None):
        self.n = n

    def __enter__(self) -> None:
        if self.n is not None:
            n = self.n
            self.saved = kernels.paged_decode_attention

            def attend(q: Any, k: Any, v: Any, tables: Any, lens: Any, scale: float, *_: Any,
                       out: Any = None, **__: Any) -> Any:  # the engine's other keywords (pdl, splits): n/a here
                result = paged_decode_attention_persistent(q, k, v, tables, lens, scale, n)
                return result if out is None else out.copy_(result)

            kernels.paged_decode_attention = attend  # type: ignore[assignment]

    def __exit__(self, *exc: Any) -> None:
        if self.n is not None:
            kernels.paged_decode_attention = self.saved  # type: ignore[assignment]


class gemm_carveout:
    """cuBLAS's SM count target = SMs - n (cublasLt path, so that backend is preferred meanwhile); None: off."""

    def __init__(self, n: int | None):
        self.n = n

    def __enter__(self) -> None:
        if self.n is not None:  # (0 keeps every SM: the cublasLt backend alone)
            self.backend = torch.backends.cuda.preferred_blas_library()
            torch.backends.cuda.preferred_blas_library("cublaslt")
            torch._C._set_sm_carveout_experimental(self.n)

    def __exit__(self, *exc: Any) -> None:
        if self.n is not None:
            torch._C._set_sm_carveout_experimental(None)
            torch.backends.cuda.preferred_blas_library(self.backend)


def section_c(rep: Report, model: LlamaModel, cfg: ModelConfig, batches: dict[int, Batch], dtype: torch.dtype,
              device: torch.device, reps: int, sm_counts: list[int]) -> None:
    """GEMM time and attention bandwidth against the SMs they may use (eager, timed in their stream)."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 0
    rep.note("sm_count", sms)
    for rows, batch in batches.items():
        gemms = projections(model, rows, dtype, device)
        attend = attention_fn(model, batch, dtype, device)
        nbytes, flops = batch.kv_bytes(cfg, dtype), gemm_flops(model, rows)
        ref = attend()
        ms = stream_ms(attend, device, reps)
        rep.row("c", f"attention B={rows}, whole chip, eager", ms, tb_s=nbytes / ms / 1e9)
        for k in sm_counts:
            with gemm_carveout(sms - k if k < sms else None):
                ms = sum(stream_ms(fn, device, reps) for fn in gemms.values())
            rep.row("c", f"GEMMs M={rows}, cuBLAS SM target {k}", ms, tflops=flops / ms / 1e9)
        persistent_rows(rep, model, cfg, batch, dtype, device, reps, sorted({*sm_counts, sms, 2 * sms} - {0}, reverse=True))
        for k in sm_counts:
            green_rows(rep, rows, k, gemms, attend, ref, nbytes, flops, device, reps)


def persistent_rows(rep: Report, model: LlamaModel, cfg: ModelConfig, batch: Batch, dtype: torch.dtype, device: torch.device,
                    reps: int, program_counts: list[int]) -> None:
    """The persistent-grid attention on each program count (4 and 8 warps), checked against the engine's."""
    attn: Any = model.layers[0].self_attn
    q = torch.randn(batch.rows, attn.num_heads, attn.head_dim, dtype=dtype, device=device)
    k_cache, v_cache = batch.kv_caches[0]
    engine_out = attn.attn(q, k_cache, v_cache, batch.meta).float()
    nbytes = batch.kv_bytes(cfg, dtype)
    for programs in program_counts:
        for warps in (4, 8):
            run = partial(paged_decode_attention_persistent, q, k_cache, v_cache, batch.meta.block_tables,
                          batch.meta.context_lens, attn.attn.scale, programs, warps)
            diff = float((run().float() - engine_out).abs().max())
            ms = graph_ms(run, device, reps)
            rep.row("c", f"persistent attention B={batch.rows}, {programs} programs, {warps} warps", ms,
                    tb_s=nbytes / ms / 1e9, max_diff_vs_engine=diff)


def green_rows(rep: Report, rows: int, k: int, gemms: dict[str, Callable[[], Any]], attend: Callable[[], Any],
               ref: torch.Tensor, nbytes: int, flops: float, device: torch.device, reps: int) -> None:
    """The GEMMs and the attention launched in a green context of k SMs (its own stream)."""
    from torch.cuda import green_contexts

    if device.type != "cuda" or not green_contexts.SUPPORTED:
        rep.row("c", f"green context {k} SMs", None, error="torch built without green contexts / no CUDA")
        return
    try:
        ctx = green_contexts.GreenContext.create(k, device.index or 0)
        ctx.set_context()
        try:
            stream = ctx.Stream()
            if not isinstance(stream, torch.cuda.Stream):  # a bare torch.Stream: wrap it for events / contexts
                stream = torch.cuda.Stream(stream_id=stream.stream_id, device_index=stream.device_index,
                                           device_type=stream.device_type)
            gemm_ms = sum(stream_ms(fn, device, reps, stream) for fn in gemms.values())
            attn_ms = stream_ms(attend, device, reps, stream)
            with torch.cuda.stream(stream):
                same = bool(torch.equal(attend(), ref))
            stream.synchronize()
        finally:
            ctx.pop_context()
    except Exception as e:
        rep.row("c", f"green context {k} SMs", None, error=repr(e)[:200])
        return
    rep.row("c", f"green ctx {k} SMs: GEMMs M={rows}", gemm_ms, tflops=flops / gemm_ms / 1e9)
    rep.row("c", f"green ctx {k} SMs: attention B={rows}", attn_ms, tb_s=nbytes / attn_ms / 1e9,
            equal_to_full_chip=same)


def w2_ab(rep: Report, settings: list[str], shape: str, requests: int, prompt: int, new: int) -> None:
    """W2 (ops/bench.py's: `requests` x `prompt` random tokens x `new`, all added at once) on a fresh engine per
    --decode-kernels setting (e.g. "auto" and "auto+overlap"), over bench.py's random model folder (written when
    missing): wall time, its prefill and decode phases, and the GPU time of one decode step (StepProbe: forward
    launch to the sampler's last kernel, mean over the decode steps, nearly all at the full batch)."""
    from stoker.ops import bench

    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    path = f"/tmp/stoker-bench-{shape}"
    rep.note("model_write_s", bench.write_model(path, bench.SHAPES[shape], device))
    for setting in settings:
        eng, ready_s = bench.start_engine(path, requests, device=device, decode=setting)
        vocab = eng.model_config.vocab_size
        bench.run_requests(eng, bench.random_prompts(1, prompt, vocab, 1), 16, "warm")  # compile prefill shapes
        probe = bench.StepProbe(eng) if cuda else None
        w2 = bench.run_requests(eng, bench.random_prompts(requests, prompt, vocab, 3), new, "w2", probe)
        gpu = probe.close() if probe is not None else {}
        steps = max(1, gpu.get("decode_steps", 0))
        rep.row("w2", f"W2 {requests}x{prompt}+{new}, {setting}", w2["wall_s"] * 1e3,
                prefill_phase_s=w2.get("prefill_phase_s", float("nan")),
                decode_phase_s=w2.get("decode_phase_s", float("nan")), tok_s=w2["tok_s"],
                decode_step_gpu_ms=gpu.get("decode_busy_ms", 0.0) / steps, decode_steps=gpu.get("decode_steps", 0),
                idle_share=gpu.get("idle_share", float("nan")), cpu_cores=w2["cpu_cores"], ready_s=ready_s,
                overlap=str(eng.runner.startup.get("decode_overlap")))
        bench.close_engine(eng) if cuda else eng.close()
        del eng


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="8b")
    ap.add_argument("--layers", type=int, default=8, help="decoder layers in (d)'s step")
    ap.add_argument("--batches", default="1024,512")
    ap.add_argument("--context", type=int, default=640)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--sms", default="128,96,64,48,32", help="SM counts for (c)")
    ap.add_argument("--carveouts", default="0,16,32,48", help="(d): SMs the GEMMs leave to attention")
    ap.add_argument("--programs", default="32,48,64",
                    help="(d): attention on this many persistent programs while the GEMMs leave as many SMs")
    ap.add_argument("--sustained", type=float, default=0.0, metavar="S",
                    help="(e): the step's variants in alternating rounds for S seconds (CUDA; 0 = off)")
    ap.add_argument("--skip", default="", help="sections to skip, e.g. 'c'")
    ap.add_argument("--w2", default=None, metavar="SETTINGS",
                    help="instead of the sections: W2 once per comma-separated --decode-kernels setting of ops/bench.py "
                         "(e.g. auto,auto+overlap), each on a fresh engine")
    ap.add_argument("--w2-shape", default="8b", help="ops/bench.py's --shape for --w2")
    ap.add_argument("--w2-size", default="1024,512,256", help="--w2: requests, prompt tokens, new tokens")
    ap.add_argument("--json", default=None, help="default $OUT/bench_overlap.json when OUT is set")
    args = ap.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") == "1":  # the CPU dry run: the tests' fix for triton 3.6's interpreter
        sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
        import kernel_harness  # noqa: F401  (patches on import)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    out = args.json or (os.path.join(os.environ["OUT"], "bench_overlap.json") if os.environ.get("OUT") else None)
    rep = Report(out)
    if args.w2:
        requests, prompt, new = (int(x) for x in args.w2_size.split(","))
        w2_ab(rep, args.w2.split(","), args.w2_shape, requests, prompt, new)
        return 0
    rep.note("setup", {"shape": args.shape, "layers": args.layers, "context": args.context, "dtype": str(dtype),
                       "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                       "torch": torch.__version__})
    cfg = model_config(SHAPES[args.shape], args.layers)
    with torch.inference_mode():
        model = build_model(cfg, dtype, device)
        batches = [Batch(cfg, int(b), args.context, args.layers, dtype, device) for b in args.batches.split(",")]
        carveouts = [int(c) for c in args.carveouts.split(",") if c] if device.type == "cuda" else []
        for batch in batches:
            if "a" not in args.skip:
                section_a_b(rep, model, cfg, batch, dtype, device, args.reps)
            if "d" not in args.skip:
                section_d(rep, model, cfg, batch, device, max(3, args.reps // 2), carveouts,
                          [int(k) for k in args.programs.split(",") if k] if device.type == "cuda" else [2])
            if args.sustained > 0 and device.type == "cuda":
                section_e(rep, model, batch, device, args.sustained, carveouts)
        # Last: green contexts are beta; a failure that poisons the CUDA context then costs nothing above.
        if "c" not in args.skip:
            section_c(rep, model, cfg, {b.rows: b for b in batches}, dtype, device, max(3, args.reps // 4),
                      [int(k) for k in args.sms.split(",")])
    return 0


if __name__ == "__main__":
    sys.exit(main())
