"""Where W2's inter-token stalls come from: a per-step trace of the engine alone (issue 12: W2's inter-token p99
of ~400 ms, at both ends of the token budget and without preemption).

    PYTHONPATH=. python ops/step_trace.py --shape tiny --device cpu --requests 64 --prompt 32 --new 16   # CPU dry run
    PYTHONPATH=. python ops/step_trace.py --shape 8b --requests 1024 --prompt 512 --new 256            # the H200 (~30 s)

ops/bench.py's engine and random prompts, all requests added at once (W2), step() called back to back as the
bench does. Per step: its wall time (step() call to return), the tokens it launched and whether it mixed prompt
chunks with decodes (LLMEngine.last_step_tokens / last_step_mixed), running and waiting requests after it, the
outputs carrying tokens, and the garbage collections (generation, ms) that ran inside it (gc.callbacks). Each
inter-token gap of a request is the time between the step() returns that carried its tokens, as ops/bench.py and
ops/bench_e2e.py count them; a gap at or above the p99 is charged to the steps it spans, so the summary says
whether the slow gaps come from long mixed steps, from decode-only steps, from collections, or from steps
that returned none of the request's tokens. `--json-out` writes every step.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "ops")]


class PhaseClock:
    """Host seconds inside each named callable of the engine (an instance attribute wraps the bound method), per
    step: which part of a step() blocks (a host wait on the GPU shows up in the part that makes it)."""

    def __init__(self, eng: Any) -> None:
        self.ms: dict[str, float] = {}
        targets = {"schedule": (eng.scheduler, "schedule"), "prepare": (eng.runner, "prepare"),
                   "forward": (eng.runner, "forward"), "sample": (eng, "_sample"), "finish": (eng, "_finish_step")}
        for name, (obj, attr) in targets.items():
            setattr(obj, attr, self._timed(name, getattr(obj, attr)))

    def _timed(self, name: str, fn: Any) -> Any:
        def run(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.ms[name] = self.ms.get(name, 0.0) + (time.perf_counter() - t0) * 1000

        return run

    def take(self) -> dict[str, float]:
        out, self.ms = {k: round(v, 2) for k, v in self.ms.items()}, {}
        return out


class SyncLog:
    """torch's CUDA sync debug mode while installed: each synchronizing op's warning, counted by the engine
    frame that made it (file:line function), so a host wait hidden in a step is named."""

    def __init__(self) -> None:
        self.sites: dict[str, int] = {}

    def __enter__(self) -> SyncLog:
        import traceback
        import warnings

        import torch

        self._old = warnings.showwarning

        def show(message: Any, category: Any, filename: str, lineno: int, file: Any = None, line: Any = None) -> None:
            frames = [f for f in traceback.extract_stack()[:-1] if "/stoker/" in f.filename or "/engine/" in f.filename]
            site = " <- ".join(f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in frames[-3:][::-1])
            self.sites[site or f"{filename}:{lineno}"] = self.sites.get(site, 0) + 1

        warnings.showwarning = show
        warnings.simplefilter("always")
        self._cuda = torch.cuda.is_available()  # a CPU dry run has nothing to watch
        if self._cuda:
            torch.cuda.set_sync_debug_mode("warn")
        return self

    def __exit__(self, *exc: Any) -> None:
        import warnings

        import torch

        if self._cuda:
            torch.cuda.set_sync_debug_mode(0)
        warnings.showwarning = self._old


class GpuAccount:
    """Each launched step's GPU time and what it carried: a CUDA event before its input upload (prepare) and
    one after its sampling is launched (_sample), so start..end is the stream time the step's work took, and
    the previous step's end..this start is time the stream had nothing of ours queued (the GPU idle between
    steps). Composition from the SchedulerOutput that prepare() gets: decode rows (one token past the prompt)
    and their contexts, prompt chunks and their tokens and context ends. No events on a CPU dry run."""

    def __init__(self, eng: Any) -> None:
        import torch

        self._torch = torch
        self._cuda = eng.runner.device.type == "cuda"
        self.rows: list[dict[str, Any]] = []
        self._events: list[list[Any]] = []  # [start, end] per launched step
        runner_prepare, engine_sample = eng.runner.prepare, eng._sample

        def prepare(out: Any, *args: Any) -> Any:
            self._events.append([self._event(), None])
            self.rows.append(composition(out.chunks))
            return runner_prepare(out, *args)

        def sample(*args: Any) -> Any:
            result = engine_sample(*args)
            self._events[-1][1] = self._event()
            return result

        eng.runner.prepare, eng._sample = prepare, sample

    def _event(self) -> Any:
        if not self._cuda:
            return None
        ev = self._torch.cuda.Event(enable_timing=True)
        ev.record()
        return ev

    def close(self) -> list[dict[str, Any]]:
        """-> one row per launched step: its composition, gpu_ms (start..end) and idle_before_ms."""
        if self._cuda:
            self._torch.cuda.synchronize()
        prev_end = None
        for row, (start, end) in zip(self.rows, self._events, strict=True):
            if start is not None and end is not None:
                row["gpu_ms"] = round(start.elapsed_time(end), 3)
                row["idle_before_ms"] = None if prev_end is None else round(prev_end.elapsed_time(start), 3)
            prev_end = end
        return self.rows


def composition(chunks: list[Any]) -> dict[str, Any]:
    """What one step carries: decode rows (one token past the prompt) with their contexts after the step, and
    prompt chunks with their tokens and context ends."""
    decode_ctx = [c.start + 1 for c in chunks if c.num_tokens == 1 and c.start >= c.seq.num_prompt_tokens]
    prompt = [(c.num_tokens, c.start + c.num_tokens) for c in chunks
              if not (c.num_tokens == 1 and c.start >= c.seq.num_prompt_tokens)]
    return {
        "decode_rows": len(decode_ctx), "decode_ctx_mean": statistics.fmean(decode_ctx) if decode_ctx else 0.0,
        "decode_ctx_max": max(decode_ctx, default=0), "prompt_chunks": len(prompt),
        "prompt_tokens": sum(n for n, _ in prompt), "prompt_ctx_end_max": max((e for _, e in prompt), default=0),
    }


def account_summary(rows: list[dict[str, Any]], wall_ms: float) -> dict[str, Any]:
    """The launched steps in two groups, those with prompt chunks (the prefill phase) and decode-only ones:
    GPU ms of their work, idle ms before them, their count; and the whole run's wall vs GPU-busy ms."""
    res: dict[str, Any] = {"wall_ms": wall_ms}
    for name, group in (("prefill", [r for r in rows if r["prompt_tokens"]]),
                        ("decode", [r for r in rows if not r["prompt_tokens"]])):
        timed = [r for r in group if "gpu_ms" in r]
        res[f"{name}_steps"] = len(group)
        res[f"{name}_gpu_ms"] = sum(r["gpu_ms"] for r in timed)
        res[f"{name}_idle_before_ms"] = sum(r["idle_before_ms"] or 0.0 for r in timed)
        res[f"{name}_decode_rows"] = sum(r["decode_rows"] for r in group)
    res["gpu_busy_share"] = (res["prefill_gpu_ms"] + res["decode_gpu_ms"]) / max(1e-9, wall_ms)
    return res


def allocator_counts() -> dict[str, float]:
    """The CUDA caching allocators' growth counters (device: cudaMalloc / cuMemMap calls, flush-and-retry, syncs of
    all streams; pinned host: blocks created and the microseconds spent creating them); {} without CUDA. A step
    whose counters moved grew a pool inside it: a candidate for a host stall (such calls may wait on the GPU)."""
    import torch

    if not torch.cuda.is_available():
        return {}
    dev, host = torch.cuda.memory_stats(), torch.cuda.host_memory_stats()
    return {"device_allocs": dev.get("num_device_alloc", 0), "device_frees": dev.get("num_device_free", 0),
            "alloc_retries": dev.get("num_alloc_retries", 0), "sync_all_streams": dev.get("num_sync_all_streams", 0),
            "host_allocs": host.get("num_host_alloc", 0), "host_alloc_us": host.get("host_alloc_time.total", 0)}


class GcClock:
    """Collections as (generation, ms), appended by gc.callbacks while installed."""

    def __init__(self) -> None:
        self.events: list[tuple[int, float]] = []
        self._started = 0.0

    def __call__(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        else:
            self.events.append((info["generation"], (time.perf_counter() - self._started) * 1000))


def trace(eng: Any, prompts: list[list[int]], new: int, phased: bool = False,
          window: KernelWindow | None = None,
          max_steps: int | None = None) -> tuple[list[dict[str, Any]], dict[str, list[int]]]:
    """Runs the requests to the end (or max_steps steps: the engine is then left mid-run, for a last probe).
    -> (one row per step, request id -> indexes of the steps that returned its tokens). phased: each step also
    gets the host ms inside its parts (PhaseClock); window: the steps it names run under torch.profiler."""
    from stoker.engine import EngineRequest, SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        eng.add_request(EngineRequest(f"t{i}", prompt_token_ids=prompt, params=params))
    clock = GcClock()
    gc.callbacks.append(clock)
    phases = PhaseClock(eng) if phased else None
    steps: list[dict[str, Any]] = []
    token_steps: dict[str, list[int]] = {}
    try:
        while eng.has_unfinished() and (max_steps is None or len(steps) < max_steps):
            seen = len(clock.events)
            counts0 = allocator_counts()
            if window is not None:
                window.before(len(steps))
            t0 = time.perf_counter()
            with window.annotate(len(steps)) if window is not None else contextlib.nullcontext():
                outputs = eng.step()
            t1 = time.perf_counter()
            counts1 = allocator_counts()
            stats = eng.stats()
            with_tokens = 0
            for out in outputs:
                if out.new_token_ids:
                    with_tokens += 1
                    token_steps.setdefault(out.request_id, []).append(len(steps))
            steps.append({"start": t0, "end": t1, "wall_end": time.time(), "ms": (t1 - t0) * 1000,
                          "tokens": eng.last_step_tokens,
                          "mixed": eng.last_step_mixed, "running": stats.num_running, "waiting": stats.num_waiting,
                          "outputs_with_tokens": with_tokens, "gc": clock.events[seen:],
                          "allocator": {k: v - counts0[k] for k, v in counts1.items() if v != counts0[k]},
                          **({"phases_ms": phases.take()} if phases else {})})
    finally:
        gc.callbacks.remove(clock)
        if window is not None:
            window.stop()
    return steps, token_steps


def kernel_category(name: str) -> str:
    """A kernel's share of a step, by its name (cuBLAS/CUTLASS GEMMs, our Triton kernels, copies)."""
    rules = (("gemm", ("gemm", "cutlass", "nvjet", "xmma", "cublas", "splitkreduce")),
             ("prefill attention", ("_prefill_kernel",)), ("decode attention", ("_decode_split", "_decode_reduce")),
             ("rmsnorm", ("rms",)), ("silu-mul", ("silu",)), ("rotary + cache", ("rotary", "cache")),
             ("gemv", ("gemv",)), ("sampling", ("argmax", "max_", "reduce", "softmax", "sampl")),
             ("copy / set", ("memcpy", "memset", "copy", "fill", "elementwise", "index", "gather", "where")))
    low = name.lower()
    for category, keys in rules:
        if any(k in low for k in keys):
            return category
    return "other"


class KernelWindow:
    """torch.profiler over steps [first, last) of a trace; each step() call inside a record_function range,
    so each kernel is charged to the step whose host call launched it (the launch's correlation id, matched
    to the range that holds the launch's host timestamp). -> per step: kernel ms by category, the GPU span
    from its first kernel's start to its last one's end, and the idle time inside and before it (the union
    of kernel intervals against the span)."""

    def __init__(self, first: int, last: int, trace_path: str) -> None:
        self.first, self.last, self.trace_path = first, last, trace_path
        self._prof: Any = None
        self.steps: list[dict[str, Any]] = []
        self.error: str | None = None

    @property
    def active(self) -> bool:
        return self._prof is not None

    def before(self, index: int) -> None:
        import torch
        from torch.profiler import ProfilerActivity, profile

        if index == self.first and self._prof is None:
            cuda = torch.cuda.is_available()  # a CPU dry run profiles host ops only (no kernel rows)
            if cuda:
                torch.cuda.synchronize()
            self._prof = profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else []))
            self._prof.__enter__()
        elif index == self.last:
            self.stop()

    def annotate(self, index: int) -> Any:
        from torch.profiler import record_function

        return record_function(f"stoker_step_{index}") if self._prof is not None else contextlib.nullcontext()

    def stop(self) -> None:
        import torch

        if self._prof is None:
            return
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        prof, self._prof = self._prof, None
        try:  # the window's figures are a bonus: a profiler failure must not lose the run's account
            prof.__exit__(None, None, None)
            prof.export_chrome_trace(self.trace_path)
            with open(self.trace_path) as f:
                self.steps = kernel_steps(json.load(f)["traceEvents"])
        except Exception as e:
            self.error = f"{type(e).__name__}: {e}"[:300]


def kernel_steps(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Chrome-trace events -> one row per annotated step (see KernelWindow)."""
    ranges = sorted((e["ts"], e["ts"] + e["dur"], int(e["name"].rsplit("_", 1)[1])) for e in events
                    if e.get("ph") == "X" and str(e.get("name", "")).startswith("stoker_step_")
                    and e.get("cat") == "user_annotation")
    launch_step: dict[int, int] = {}
    for e in events:
        if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {}):
            for lo, hi, index in ranges:
                if lo <= e["ts"] <= hi:
                    launch_step[e["args"]["correlation"]] = index
                    break
    by_step: dict[int, list[tuple[float, float, str]]] = {}
    for e in events:
        if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and e.get("ph") == "X":
            index = launch_step.get(e.get("args", {}).get("correlation", -1))
            if index is not None:
                by_step.setdefault(index, []).append((e["ts"], e["ts"] + e["dur"], e["name"]))
    rows, prev_end = [], None
    for index in sorted(by_step):
        kernels = sorted(by_step[index])
        busy, cursor = 0.0, kernels[0][0]
        for lo, hi, _ in kernels:  # the union of the kernel intervals (streams may overlap)
            if hi > cursor:
                busy += hi - max(lo, cursor)
                cursor = hi
        categories: dict[str, float] = {}
        by_name: dict[str, list[float]] = {}  # name -> [launches, ms]
        for lo, hi, name in kernels:
            cat = kernel_category(name)
            categories[cat] = categories.get(cat, 0.0) + (hi - lo) / 1000
            entry = by_name.setdefault(name[:90], [0, 0.0])
            entry[0] += 1
            entry[1] += (hi - lo) / 1000
        span = (max(hi for _, hi, _ in kernels) - kernels[0][0]) / 1000
        rows.append({"step": index, "kernels": len(kernels), "kernel_ms": sum(categories.values()),
                     "span_ms": span, "idle_inside_ms": span - busy / 1000,
                     "idle_before_ms": None if prev_end is None else (kernels[0][0] - prev_end) / 1000,
                     "by_category_ms": {k: round(v, 3) for k, v in sorted(categories.items(), key=lambda kv: -kv[1])},
                     "top_kernels": [(name, int(n), round(ms, 3)) for name, (n, ms)
                                     in sorted(by_name.items(), key=lambda kv: -kv[1][1])[:14]]})
        prev_end = max(hi for _, hi, _ in kernels)
    return rows


def gaps_of(steps: list[dict[str, Any]], token_steps: dict[str, list[int]]) -> list[tuple[float, int, int]]:
    """(gap ms, step before, step after) for each pair of successive token-carrying returns of a request."""
    gaps = []
    for idx in token_steps.values():
        for a, b in zip(idx, idx[1:], strict=False):
            gaps.append(((steps[b]["end"] - steps[a]["end"]) * 1000, a, b))
    return gaps


def summarize(steps: list[dict[str, Any]], gaps: list[tuple[float, int, int]]) -> dict[str, Any]:
    ordered = sorted(g[0] for g in gaps)
    p99 = ordered[int(0.99 * (len(ordered) - 1))] if ordered else float("nan")
    slow = [g for g in gaps if g[0] >= p99]
    charged: dict[int, int] = {}  # step -> slow gaps that span it
    for _, a, b in slow:
        for s in range(a + 1, b + 1):
            charged[s] = charged.get(s, 0) + 1
    spanned = [steps[s] for s in charged]
    gc_ms = [ms for st in steps for _, ms in st["gc"]]
    return {
        "steps": len(steps), "gaps": len(gaps), "itl_p50_ms": statistics.median(ordered) if ordered else None,
        "itl_p99_ms": p99, "itl_max_ms": ordered[-1] if ordered else None, "slow_gaps": len(slow),
        "slow_gaps_spanning_steps": len(charged),
        "slow_gap_steps_mixed": sum(st["mixed"] for st in spanned),
        "slow_gap_steps_with_gc": sum(bool(st["gc"]) for st in spanned),
        "slow_gap_steps_ms_mean": statistics.fmean(st["ms"] for st in spanned) if spanned else None,
        "slow_gaps_over_more_than_one_step": sum(b - a > 1 for _, a, b in slow),
        "step_ms_p50": statistics.median(st["ms"] for st in steps), "step_ms_max": max(st["ms"] for st in steps),
        "mixed_step_ms_mean": statistics.fmean([st["ms"] for st in steps if st["mixed"]] or [float("nan")]),
        "decode_step_ms_mean": statistics.fmean([st["ms"] for st in steps if not st["mixed"] and st["waiting"] == 0]
                                                or [float("nan")]),
        "gc_collections": len(gc_ms), "gc_ms_total": sum(gc_ms), "gc_ms_max": max(gc_ms, default=0.0),
        "steps_over_300ms": sum(st["ms"] > 300 for st in steps),
        "allocator_growth": {k: sum(st.get("allocator", {}).get(k, 0) for st in steps)
                             for k in sorted({k for st in steps for k in st.get("allocator", {})})},
    }


def report(res: dict[str, Any], steps: list[dict[str, Any]], top: int) -> None:
    print("\nper-step trace, engine alone:", ", ".join(f"{k} {v:.2f}" if isinstance(v, float) else f"{k} {v}"
                                                 for k, v in res.items()))
    print(f"\nthe {top} longest steps")
    print(f"{'step':>6}{'ms':>10}{'tokens':>8}{'mixed':>7}{'running':>9}{'waiting':>9}{'outputs':>9}  gc (gen, ms)")
    for i in sorted(range(len(steps)), key=lambda i: -steps[i]["ms"])[:top]:
        st = steps[i]
        print(f"{i:>6}{st['ms']:>10.1f}{st['tokens']:>8}{st['mixed']!s:>7}{st['running']:>9}{st['waiting']:>9}"
              f"{st['outputs_with_tokens']:>9}  {[(g, round(ms, 1)) for g, ms in st['gc']]}")
    if steps and "phases_ms" in steps[0]:
        print(f"\nthe first {top} steps in order, host ms by part")
        for i, st in enumerate(steps[:top]):
            print(f"{i:>6}{st['ms']:>10.1f}{st['tokens']:>8}{st['mixed']!s:>7}{st['running']:>9}  {st['phases_ms']}"
                  f"  {st.get('allocator') or ''}")


class MixedBench:
    """After the first launched mixed step with at least `rows` decode rows: step_profile.profile_mixed_step on
    its input (a sync and a few hundred ms of extra GPU work: that step is marked perturbed in the account)."""

    def __init__(self, eng: Any, account: GpuAccount | None, rows: int, window: KernelWindow | None = None) -> None:
        """window: the bench waits until it is closed (a profiler inside another one ends both)."""
        self.launch: int | None = None
        self.result: dict[str, Any] | None = None
        self.text: str | None = None
        runner, forward = eng.runner, eng.runner.forward

        def hooked(inp: Any) -> Any:
            logits = forward(inp)
            comp = account.rows[-1] if account is not None else None
            quiet = window is None or not window.active
            if self.result is None and quiet and comp is not None and comp["prompt_tokens"] \
                    and comp["decode_rows"] >= rows:
                from step_profile import profile_mixed_step

                self.launch = len(account.rows) - 1
                self.result, self.text = profile_mixed_step(runner, inp, comp["decode_rows"], dict(comp))
            return logits

        runner.forward = hooked


def report_account(acc: dict[str, Any], rows: list[dict[str, Any]]) -> None:
    print("\nGPU account (CUDA events per launched step):",
          ", ".join(f"{k} {v:.2f}" if isinstance(v, float) else f"{k} {v}" for k, v in acc.items()))
    print(f"{'launch':>6}{'gpu ms':>9}{'idle ms':>9}{'decodes':>8}{'dec ctx':>8}{'chunks':>7}{'prompt tok':>11}")
    for i, r in enumerate(rows):
        if r["prompt_tokens"] or i % 32 == 0:  # every prefill-phase step, every 32nd decode step
            idle = r.get("idle_before_ms")
            print(f"{i:>6}{r.get('gpu_ms', float('nan')):>9.2f}{idle if idle is not None else float('nan'):>9.2f}"
                  f"{r['decode_rows']:>8}{r['decode_ctx_mean']:>8.0f}{r['prompt_chunks']:>7}{r['prompt_tokens']:>11}"
                  f"{'  ' + r['perturbed'] if 'perturbed' in r else ''}")


def report_window(rows: list[dict[str, Any]]) -> None:
    print("\nkernel window (torch.profiler): per step kernel ms by category")
    for r in rows:
        print(f"step {r['step']}: {r['kernels']} kernels, {r['kernel_ms']:.2f} ms, span {r['span_ms']:.2f}, idle "
              f"inside {r['idle_inside_ms']:.2f}, before {r['idle_before_ms']}; {r['by_category_ms']}")
        for name, n, ms in r.get("top_kernels", []):
            print(f"    {ms:9.3f} ms {n:>5} x  {name}")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="8b", help="ops/bench.py shape: 8b | 1b | tiny")
    ap.add_argument("--model-dir", default=None, help="default /tmp/stoker-bench-<shape> (written when missing)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--requests", type=int, default=1024)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--new", type=int, default=256)
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192)
    ap.add_argument("--top", type=int, default=15, help="longest steps listed")
    ap.add_argument("--json-out", default=None)
    ap.add_argument("--phases", action="store_true", help="per step, host ms in schedule / prepare / forward / "
                    "sample / finish (which part waits on the GPU)")
    ap.add_argument("--sync-debug", action="store_true",
                    help="torch.cuda.set_sync_debug_mode('warn') during the timed run: synchronizing ops by call site")
    ap.add_argument("--gpu-account", action="store_true",
                    help="CUDA events around each launched step: GPU ms, idle before it, and its composition "
                         "(decode rows, contexts, prompt tokens): the prefill phase's wall vs GPU time")
    ap.add_argument("--kernel-window", default=None, metavar="FIRST:LAST",
                    help="steps [FIRST, LAST) under torch.profiler: per step kernel ms by category, GPU span, idle")
    ap.add_argument("--mixed-bench-rows", type=int, default=0,
                    help="the first mixed step with at least this many decode rows: its kernel table and its "
                         "attention timed whole / decode rows / prompt chunks / decode kernel (step_profile.py)")
    ap.add_argument("--ab-mixed-split", action="store_true",
                    help="run the requests twice on one engine: EngineConfig.mixed_decode_attention off, then on")
    ap.add_argument("--settle-heap", action="store_true",
                    help="freeze the heap after the warm-up, as the worker does once loaded (stoker.engine.settle_heap)")
    ap.add_argument("--probe-steps", type=int, default=40,
                    help="with --ab-mixed-split or --probe-after: the probe run (window, mixed bench) stops after this "
                         "many steps")
    ap.add_argument("--probe-after", action="store_true",
                    help="without --ab-mixed-split: the run with the per-step account only, then the probes "
                         "(--kernel-window, --mixed-bench-rows) in a run of their own cut after --probe-steps steps")
    ap.add_argument("--max-steps", type=int, default=None,
                    help="the main run (not the probe) stops after this many steps (the engine is left mid-run)")
    ap.add_argument("--prefill-control", type=int, default=0, metavar="N",
                    help="first, N requests of one new token each: pure prefill steps back to back (no decode rows), "
                         "whose GPU ms a mixed step's are compared with (the account's control)")
    ap.add_argument("--out", default=os.environ.get("OUT"), help="folder for the JSON and tables (default $OUT)")
    args = ap.parse_args(argv)
    import bench
    from stoker.engine import LLMEngine, settle_heap

    path = args.model_dir or f"/tmp/stoker-bench-{args.shape}"
    if not (Path(path) / "config.json").exists():
        bench.write_model(path, bench.SHAPES[args.shape], "cuda" if args.device.startswith("cuda") else "cpu")
    eng = LLMEngine(bench.engine_config(path, args.requests, args.device,
                                        max_num_batched_tokens=args.max_num_batched_tokens))
    vocab = eng.model_config.vocab_size
    trace(eng, bench.random_prompts(2, args.prompt, vocab, 7), 4)  # first compiles and graph buckets: untimed
    if args.settle_heap:
        settle_heap()
    prompts = bench.random_prompts(args.requests, args.prompt, vocab, 1)
    runs: dict[str, Any] = {}
    for label, split, probes in run_settings(args):
        if split is not None:
            eng.config.mixed_decode_attention = split  # read by runner.prepare at every step
        print(f"\n===== {label or 'run'}: EngineConfig.mixed_decode_attention = {eng.config.mixed_decode_attention}",
              flush=True)
        control = label == "prefill control"
        runs[label] = traced_run(eng, args, prompts[: args.prefill_control] if control else prompts,
                                 label.replace(" ", "_").replace(",", ""), probes,
                                 args.probe_steps if probes and label.startswith("probe") else
                                 None if control else args.max_steps,
                                 1 if control else args.new)
        if args.json_out:  # after each run: a run cut short by a timeout keeps the ones before
            body = runs[""] if list(runs) == [""] else {"runs": runs}
            Path(args.json_out).write_text(json.dumps({"args": vars(args), **body}, indent=1))


def run_settings(args: argparse.Namespace) -> list[tuple[str, bool | None, bool]]:
    """(label, mixed_decode_attention or None to leave it, probes) per run. --prefill-control first; then with
    --ab-mixed-split the requests with the mixed steps' attention whole then split, each with the per-step account
    only, and the probes (--kernel-window, --mixed-bench-rows) in a run of their own cut after --probe-steps steps
    (so also with --probe-after); otherwise one run with every instrument asked for."""
    settings: list[tuple[str, bool | None, bool]] = []
    if args.prefill_control:
        settings.append(("prefill control", None, False))
    probes = bool(args.kernel_window or args.mixed_bench_rows)
    if args.ab_mixed_split:
        settings += [("split off", False, False), ("split on", True, False)]
        return settings + ([("probe, split on", True, True)] if probes else [])
    if args.probe_after:
        return settings + [("", None, False)] + ([("probe", None, True)] if probes else [])
    return settings + [("", None, True)]


def traced_run(eng: Any, args: argparse.Namespace, prompts: list[list[int]], tag: str, probes: bool,
               max_steps: int | None, new: int) -> dict[str, Any]:
    """One traced run of the requests with the instruments args asks for (the kernel window and the mixed-step
    bench only with probes), reported; the engine's methods are restored after (the instruments wrap them as
    instance attributes). -> its JSON body."""
    saved = {(obj, name): obj.__dict__.get(name) for obj in (eng, eng.runner, eng.scheduler)
             for name in ("prepare", "forward", "_sample", "_finish_step", "schedule")}
    syncs = SyncLog() if args.sync_debug else contextlib.nullcontext()
    out_dir = Path(args.out or ".")
    account = GpuAccount(eng) if args.gpu_account else None
    window = None
    if args.kernel_window and probes:
        first, last = (int(x) for x in args.kernel_window.split(":"))
        window = KernelWindow(first, last, str(out_dir / f"kernel_window_trace{tag and '_' + tag}.json"))
    mixed = MixedBench(eng, account, args.mixed_bench_rows, window) if args.mixed_bench_rows and probes else None
    import bench

    variants0 = bench.triton_variants()
    t0 = time.perf_counter()
    try:
        with syncs:
            steps, token_steps = trace(eng, prompts, new, phased=args.phases, window=window, max_steps=max_steps)
    finally:
        for (obj, name), value in saved.items():
            if value is None:
                obj.__dict__.pop(name, None)
            else:
                obj.__dict__[name] = value
    wall_ms = (time.perf_counter() - t0) * 1000
    res = summarize(steps, gaps_of(steps, token_steps))
    res["wall_s"] = wall_ms / 1000
    res["triton_compiles"] = bench.midrun_compiles({"triton_variants": {"before_w2": variants0,
                                                                        "after_w2": bench.triton_variants()}})
    report(res, steps, args.top)
    extra: dict[str, Any] = {}
    if account is not None:
        rows = account.close()
        if mixed is not None and mixed.launch is not None:
            rows[mixed.launch]["perturbed"] = "mixed bench ran after its forward"
        extra["account"] = account_summary([r for r in rows if "perturbed" not in r], wall_ms)
        extra["launched"] = rows
        report_account(extra["account"], rows)
    if window is not None:
        extra["kernel_window"] = window.steps
        extra["kernel_window_error"] = window.error
        report_window(window.steps)
        if window.error:
            print(f"kernel window failed: {window.error}")
    if mixed is not None:
        extra["mixed_step"] = mixed.result
        print("\n" + (mixed.text or f"no mixed step had {args.mixed_bench_rows} decode rows"))
    if isinstance(syncs, SyncLog):
        res["sync_sites"] = syncs.sites
        print("\nsynchronizing ops (torch sync debug mode) by call site:")
        for site, n in sorted(syncs.sites.items(), key=lambda kv: -kv[1]):
            print(f"{n:>8}  {site}")
    return {"summary": res, "steps": steps, **extra}


if __name__ == "__main__":
    main()
