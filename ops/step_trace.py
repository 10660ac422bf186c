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


def trace(eng: Any, prompts: list[list[int]], new: int,
          phased: bool = False) -> tuple[list[dict[str, Any]], dict[str, list[int]]]:
    """Runs the requests to the end. -> (one row per step, request id -> indexes of the steps that returned
    its tokens). phased: each step also gets the host ms inside its parts (PhaseClock)."""
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
        while eng.has_unfinished():
            seen = len(clock.events)
            t0 = time.perf_counter()
            outputs = eng.step()
            t1 = time.perf_counter()
            stats = eng.stats()
            with_tokens = 0
            for out in outputs:
                if out.new_token_ids:
                    with_tokens += 1
                    token_steps.setdefault(out.request_id, []).append(len(steps))
            steps.append({"start": t0, "end": t1, "ms": (t1 - t0) * 1000, "tokens": eng.last_step_tokens,
                          "mixed": eng.last_step_mixed, "running": stats.num_running, "waiting": stats.num_waiting,
                          "outputs_with_tokens": with_tokens, "gc": clock.events[seen:],
                          **({"phases_ms": phases.take()} if phases else {})})
    finally:
        gc.callbacks.remove(clock)
    return steps, token_steps


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
            print(f"{i:>6}{st['ms']:>10.1f}{st['tokens']:>8}{st['mixed']!s:>7}{st['running']:>9}  {st['phases_ms']}")


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
    args = ap.parse_args(argv)
    import bench
    from stoker.engine import LLMEngine

    path = args.model_dir or f"/tmp/stoker-bench-{args.shape}"
    if not (Path(path) / "config.json").exists():
        bench.write_model(path, bench.SHAPES[args.shape], "cuda" if args.device.startswith("cuda") else "cpu")
    eng = LLMEngine(bench.engine_config(path, args.requests, args.device,
                                        max_num_batched_tokens=args.max_num_batched_tokens))
    vocab = eng.model_config.vocab_size
    trace(eng, bench.random_prompts(2, args.prompt, vocab, 7), 4)  # first compiles and graph buckets: untimed
    prompts = bench.random_prompts(args.requests, args.prompt, vocab, 1)
    syncs = SyncLog() if args.sync_debug else contextlib.nullcontext()
    with syncs:
        steps, token_steps = trace(eng, prompts, args.new, phased=args.phases)
    res = summarize(steps, gaps_of(steps, token_steps))
    report(res, steps, args.top)
    if isinstance(syncs, SyncLog):
        res["sync_sites"] = syncs.sites
        print("\nsynchronizing ops (torch sync debug mode) by call site:")
        for site, n in sorted(syncs.sites.items(), key=lambda kv: -kv[1]):
            print(f"{n:>8}  {site}")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps({"args": vars(args), "summary": res, "steps": steps}, indent=1))


if __name__ == "__main__":
    main()
