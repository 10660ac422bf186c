"""Kernel tables of one W2 decode step and one full-budget prefill step (issue 13 item 3): where the batch
step's GPU time goes, kernel by kernel.

ops/bench.py --profile calls profile_w2_steps() on its warm engine. Run alone it is the CPU dry run of the
same code on a tiny model (no GPU: CPU-side op times only, no graph replay):

    PYTHONPATH=. python ops/step_profile.py --shape tiny [--requests 8] [--prompt 64]

and on a GPU, alone (writes the bench's random 8B folder first when it is missing):

    PYTHONPATH=. python ops/step_profile.py --shape 8b --requests 1024 --prompt 512

How: run_requests-like adds of `requests` prompts; a hook on the runner's forward waits for the first
forward that is decode-only at full batch (and the first pure prefill of `prefill_tokens` tokens), lets it
run as usual, then repeats exactly that input under torch.profiler. Repeating a forward rewrites the same
K/V values into the same slots, so the engine's state is unchanged. The decode repeat bypasses the CUDA
graph (a replay is one opaque entry for the profiler): the table is of the same step run eagerly, and the
replay's own wall time (CUDA events, mean of a few replays) is given beside it. A third table covers a few
whole engine steps with graphs on: the replay plus every op that still runs eagerly around it (input
upload, the pending-token gather, static-buffer copies, sampling). The prefill step also gets its host cost:
the forward's launching timed unprofiled (thread CPU and wall, call to return) and its ops by host time (W2's
prefill steps cost the H200's host 32 ms each against 4.5 for a 1,024-row decode step: BENCHMARKS.md).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile


def _activities(device: torch.device) -> list[ProfilerActivity]:
    acts = [ProfilerActivity.CPU]
    if device.type == "cuda":
        acts.append(ProfilerActivity.CUDA)
    return acts


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def kernel_table(prof: Any, device: torch.device, rows: int = 40) -> str:
    """Per-kernel totals (count, total and mean time), sorted by device time (CPU time off the GPU)."""
    key = "cuda_time_total" if device.type == "cuda" else "cpu_time_total"
    return prof.key_averages().table(sort_by=key, row_limit=rows, max_name_column_width=90)


def _device_total_ms(prof: Any, device: torch.device) -> float:
    """Sum of the device time of kernels (not of the CPU ops that launched them, to count each once)."""
    if device.type != "cuda":
        return 0.0
    total_us = 0.0
    for e in prof.key_averages():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            total_us += e.self_device_time_total
    return total_us / 1e3


def op_rows(prof: Any, device: torch.device) -> list[dict[str, Any]]:
    """Every op and kernel by name and input shapes (count, self device us, device us with children): the GEMMs'
    shapes give their FLOPs, so each can be set beside its floor after the run (ops/fp8_account.py)."""
    rows = []
    for e in prof.key_averages(group_by_input_shape=True):
        dev_self = float(getattr(e, "self_device_time_total", 0.0) or 0.0)
        dev_all = float(getattr(e, "device_time_total", 0.0) or 0.0)
        if device.type == "cuda" and dev_self == 0.0 and dev_all == 0.0:
            continue
        rows.append({"name": e.key, "shapes": str(e.input_shapes), "count": int(e.count),
                     "kernel": e.device_type == torch.autograd.DeviceType.CUDA, "self_us": dev_self,
                     "total_us": dev_all, "cpu_us": float(e.cpu_time_total)})
    return rows


def _replay_ms(runner: Any, inp: Any, reps: int = 5) -> float | None:
    """Mean wall time of the decode graph's replay of `inp` (CUDA events around graphs.run), or None when
    this step has no graph (CPU, graphs off, a batch over the largest bucket)."""
    graphs = runner.graphs
    if graphs is None or not graphs.fits(inp):
        return None
    graphs.run(inp)  # warm: the same writes as the step itself
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        graphs.run(inp)
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / reps


def host_forward_ms(runner: Any, inp: Any, reps: int = 3) -> dict[str, float]:
    """The eager forward's host cost, the device idle before each call: the calling thread's CPU and the wall
    from the call to its return, mean of reps. On the GPU that is the launching (the kernels run after it
    returns: a W2 prefill step is all launch work on the host, no graph); on the CPU the whole forward."""
    device = runner.device
    cpu = wall = 0.0
    with torch.inference_mode():
        for _ in range(reps):
            _sync(device)
            c0, w0 = time.thread_time(), time.perf_counter()
            _eager_forward(runner, inp)
            cpu += time.thread_time() - c0
            wall += time.perf_counter() - w0
        _sync(device)
    return {"cpu_ms": cpu / reps * 1e3, "wall_ms": wall / reps * 1e3}


def host_table(prof: Any, rows: int = 25) -> str:
    """Ops by the host time spent in them, children excluded (cuBLAS's setup under aten::mm, the driver's launch
    calls). A Triton kernel's Python launch work (its JIT binder) sits under no op: it is the forward's host total
    less these rows."""
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows, max_name_column_width=90)


def _eager_forward(runner: Any, inp: Any) -> torch.Tensor:
    """The forward without the CUDA graph: the same kernels the graph holds, launched one by one."""
    from stoker.engine.batch import resolve_pending

    hidden = runner.model(resolve_pending(inp.input_ids, inp.prev_tokens), inp.positions, inp.meta,
                          runner.kv_caches)
    return runner.model.compute_logits(hidden[inp.sample_indices])


class _StepHook:
    """Wraps runner.forward; calls on_match(inp) after the first forward for which match(inp) holds."""

    def __init__(self, runner: Any, match: Callable[[Any], bool], on_match: Callable[[Any], None]):
        self.runner, self.match, self.on_match = runner, match, on_match
        self.done = False
        self._orig = runner.forward

        def forward(inp: Any) -> torch.Tensor:
            logits = self._orig(inp)
            if not self.done and self.match(inp):
                self.done = True
                self.on_match(inp)
            return logits

        runner.forward = forward

    def close(self) -> None:
        self.runner.forward = self._orig


def profile_w2_steps(eng: Any, vocab: int, requests: int, prompt: int, prefill_tokens: int,
                     out_dir: str, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Writes w2_decode_profile.txt and w2_prefill_profile.txt under out_dir; returns the headline figures."""
    from stoker.engine import EngineRequest, SamplingParams

    runner = eng.runner
    device = runner.device
    acts = _activities(device)
    res: dict[str, Any] = {}
    texts: dict[str, str] = {}

    def profiled(inp: Any) -> Any:
        """The step's forward again, eagerly, under the profiler (the same K/V written to the same slots)."""
        _sync(device)
        with torch.inference_mode(), profile(activities=acts, record_shapes=True) as prof:
            _eager_forward(runner, inp)
            _sync(device)
        return prof

    def on_prefill(inp: Any) -> None:
        prof = profiled(inp)
        res["prefill_tokens"] = int(inp.input_ids.shape[0])
        res["prefill_kernel_ms"] = _device_total_ms(prof, device)
        res["prefill_ops"] = op_rows(prof, device)
        res["prefill_host"] = host = host_forward_ms(runner, inp)
        texts["prefill"] = (
            f"ONE prefill step of {res['prefill_tokens']} tokens ({int(inp.meta.context_lens.shape[0])} prompt "
            f"chunks of prompts of {prompt}), eager (prefill never uses a graph); device kernel time summed: "
            f"{res['prefill_kernel_ms']:.2f} ms; the forward's host cost unprofiled (thread CPU / wall from the "
            f"call to its return, device idle before): {host['cpu_ms']:.2f} / {host['wall_ms']:.2f} ms\n"
            + kernel_table(prof, device) + "\nthe same step's ops by host time (self CPU):\n" + host_table(prof)
        )

    def on_decode(inp: Any) -> None:
        prof = profiled(inp)
        res["decode_batch"] = int(inp.input_ids.shape[0])
        res["decode_context_max"] = int(inp.meta.context_lens.max())
        res["decode_eager_kernel_ms"] = _device_total_ms(prof, device)
        res["decode_ops"] = op_rows(prof, device)
        res["decode_context_sum"] = int(inp.meta.context_lens.sum())
        with torch.inference_mode():
            res["decode_replay_ms"] = _replay_ms(runner, inp)
        replay = res["decode_replay_ms"]
        texts["decode"] = (
            f"ONE decode step at batch {res['decode_batch']} (max context {res['decode_context_max']}), run "
            f"EAGERLY with the CUDA graph bypassed (a replay is opaque to the profiler): same kernels as the "
            f"graph; device kernel time summed: {res['decode_eager_kernel_ms']:.2f} ms. The graph's own "
            f"replay of this step: {'n/a (no graph)' if replay is None else f'{replay:.2f} ms wall (CUDA events, mean of 5)'}\n"
            + kernel_table(prof, device)
        )

    hooks = [
        # The batch's first forward is all prompt chunks (the engine ran nothing before): a budget's worth.
        _StepHook(runner, lambda inp: not inp.meta.decode_only and inp.input_ids.shape[0] >= prefill_tokens,
                  on_prefill),
        _StepHook(runner, lambda inp: inp.meta.decode_only and inp.input_ids.shape[0] == requests, on_decode),
    ]
    gen = torch.Generator().manual_seed(21)
    # Every request must still be running when the last prompt chunk is in: the budget takes requests x
    # prompt / budget steps to prefill them all, and a request prefilled in the first step decodes in each
    # one after (with 8 tokens, the first ones finished long before: no decode step ever held all of them).
    prefill_steps = -(-requests * prompt // max(1, eng.config.max_num_batched_tokens))
    params = SamplingParams(temperature=0.0, max_tokens=prefill_steps + 8, ignore_eos=True)
    for i, p in enumerate(torch.randint(2, vocab, (requests, prompt), generator=gen).tolist()):
        eng.add_request(EngineRequest(f"stepprof{i}", prompt_token_ids=p, params=params))
    steps_with_graphs = None
    try:
        while eng.has_unfinished():
            if hooks[1].done and steps_with_graphs is None:
                steps_with_graphs = _profile_engine_steps(eng, acts, device, 3)
            eng.step()
    finally:
        for h in hooks:
            h.close()
    for name in ("prefill", "decode"):
        text = texts.get(name, f"no {name} step matched (requests={requests}, prefill_tokens={prefill_tokens})\n")
        if name == "decode" and steps_with_graphs is not None:
            text += "\n" + steps_with_graphs
        with open(os.path.join(out_dir, f"w2_{name}_profile.txt"), "w") as f:
            f.write(text)
        log(f"W2 {name} step profile:\n{text}")
    return res


def _profile_engine_steps(eng: Any, acts: list[ProfilerActivity], device: torch.device, steps: int) -> str:
    """A few whole engine steps as they run (graphs on): the replay is one entry (cudaGraphLaunch); the rest
    is what still runs eagerly around it."""
    _sync(device)
    t0 = time.perf_counter()
    with profile(activities=acts) as prof:
        for _ in range(steps):
            eng.step()
        _sync(device)
    wall = (time.perf_counter() - t0) / steps * 1e3
    return (f"{steps} whole engine decode steps as they run (graphs on where they fit; {wall:.2f} ms wall per "
            f"step): the replay is opaque, every other row ran eagerly around it\n" + kernel_table(prof, device))


def event_ms(device: torch.device, fn: Callable[[], Any], warm: int = 2, reps: int = 10) -> float:
    """Mean device ms of fn() (CUDA events around reps calls); host ms on the CPU."""
    for _ in range(warm):
        fn()
    if device.type != "cuda":
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        return (time.perf_counter() - t0) / reps * 1e3
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / reps


def mixed_attention_split(runner: Any, inp: Any, num_decodes: int) -> dict[str, float]:
    """One layer's attention of a mixed step, timed four ways on layer 0's cache (random q: the time does not
    depend on its values), ms per layer: the whole batch through the prefill kernel (what the step runs),
    its decode rows alone and its prompt chunks alone through the same kernel, and the decode rows through
    the decode kernel. Decode rows come first in the flat batch (model_runner.prepare)."""
    from stoker.engine.kernels import paged_attention, paged_decode_attention

    meta, device = inp.meta, runner.device
    mc = runner.model_config
    k_cache, v_cache = runner.kv_caches[0]
    num_tokens = int(inp.input_ids.shape[0])
    q = torch.randn(num_tokens, mc.num_heads, mc.head_dim, dtype=k_cache.dtype, device=device)
    scale, nd = mc.head_dim**-0.5, num_decodes
    bt, qsl, ctx = meta.block_tables, meta.query_start_loc, meta.context_lens
    prompt_qsl = qsl[nd:] - nd  # the prompt chunks' query starts, relative to their first token
    cases = {
        "whole_batch_prefill_kernel": lambda: paged_attention(q, k_cache, v_cache, bt, qsl, ctx, scale),
        "decode_rows_prefill_kernel": lambda: paged_attention(q[:nd], k_cache, v_cache, bt[:nd], qsl[: nd + 1],
                                                              ctx[:nd], scale),
        "prompt_chunks_prefill_kernel": lambda: paged_attention(q[nd:], k_cache, v_cache, bt[nd:], prompt_qsl,
                                                                ctx[nd:], scale),
        "decode_rows_decode_kernel": lambda: paged_decode_attention(q[:nd], k_cache, v_cache, bt[:nd], ctx[:nd],
                                                                    scale),
    }
    with torch.inference_mode():
        return {name: event_ms(device, fn) for name, fn in cases.items()}


def profile_mixed_step(runner: Any, inp: Any, num_decodes: int, composition: dict[str, Any]) -> tuple[dict[str, Any], str]:
    """A mixed step's kernels (its forward again, eagerly, under the profiler: the same K/V rewritten to the
    same slots) and its attention split (mixed_attention_split) -> (figures, text)."""
    device = runner.device
    whole = dataclasses.replace(inp, meta=dataclasses.replace(inp.meta, num_decodes=0, prompt_query_start_loc=None))
    variants = {"as run": inp} | ({"whole batch in the prefill kernel": whole} if inp.meta.num_decodes else {})
    tables, kernel_ms = [], {}
    for name, variant in variants.items():
        _sync(device)
        with torch.inference_mode(), profile(activities=_activities(device)) as prof:
            _eager_forward(runner, variant)
            _sync(device)
        kernel_ms[name] = _device_total_ms(prof, device)
        tables.append(f"-- the step {name} (decode rows to the decode kernel: {variant.meta.num_decodes}), device "
                      f"kernel time summed {kernel_ms[name]:.2f} ms\n" + kernel_table(prof, device))
    layers = runner.model_config.num_layers
    split = mixed_attention_split(runner, inp, num_decodes)
    res = {"composition": composition, "kernel_ms": kernel_ms, "attention_ms_per_layer": split,
           "attention_ms_per_step": {k: v * layers for k, v in split.items()}}
    lines = [f"ONE mixed step ({composition}), eager under the profiler: device kernel time summed {kernel_ms}",
             f"its attention, ms per layer / per step of {layers} layers:"]
    lines += [f"  {k:<32}{v:>9.3f}{v * layers:>10.2f}" for k, v in split.items()]
    return res, "\n".join(lines + tables)


def main(argv: list[str] | None = None) -> int:
    """CPU dry run (or a GPU run of its own) on a bench shape."""
    from stoker.ops import bench  # the shapes, the model writer and the engine settings

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=sorted(bench.SHAPES), default="tiny")
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", choices=["bf16", "fp8"], default="bf16", help="fp8: weights quantized at load")
    ap.add_argument("--kv-cache-dtype", choices=["auto", "fp8"], default="auto")
    args = ap.parse_args(argv)
    # The bench's folder on a GPU (its weights are reused when there); a folder of its own for CPU dry runs.
    path = f"/tmp/stoker-bench-{args.shape}" + ("" if args.device.startswith("cuda") else "-cpu")
    bench.write_model(path, bench.SHAPES[args.shape], device=args.device)
    eng, _ = bench.start_engine(path, args.requests, device=args.device,
                                quantization="fp8" if args.dtype == "fp8" else None, kv_cache_dtype=args.kv_cache_dtype)
    try:
        # The first step of a fresh batch: as many whole prompts as the token budget holds, nothing else.
        prefill_tokens = min(args.requests, eng.config.max_num_batched_tokens // args.prompt) * args.prompt
        res = profile_w2_steps(eng, bench.SHAPES[args.shape]["vocab_size"], args.requests, args.prompt,
                               prefill_tokens, os.environ.get("OUT") or ".")
    finally:
        eng.close()
    print(json.dumps(res))
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "w2_step_profile.json"), "w") as f:
            json.dump(res, f, indent=2)
    return 0 if "decode_batch" in res and "prefill_tokens" in res else 1


if __name__ == "__main__":
    sys.exit(main())
