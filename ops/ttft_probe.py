"""W1's TTFT on the engine alone, taken apart run by run: where a lone 512-token prompt's first token waits.

    PYTHONPATH=. python ops/ttft_probe.py --shape tiny --device cpu --runs 3 --prompt 32 --new 4   # CPU dry run
    PYTHONPATH=. python ops/ttft_probe.py --shape 8b --runs 8 --out $OUT       # the H200 (~45 s, warm machine)

ops/bench.py's engine (as ops/bench_e2e.py's engine side builds it, plus EngineConfig.prefill_graph_tokens), one
request at a time as W1 runs it (--prompt + --new, greedy), under each condition in turn, interleaved run by
run so that the machine's drift falls on every condition alike:
  eager    the prefill step launched kernel by kernel (the engine before engine/prefill_graphs.py)
  graph    the same step replayed from its captured CUDA graph (when the engine captured them)
each at every --gaps-ms (idle time before the add: 0 is W1's back to back). Per run, in one host clock plus CUDA
events on the engine's stream: TTFT (add_request -> the step() return that carries the first token); the
prefill step's step() call (its host launch) and its parts (schedule / prepare / forward / sample, step_trace's
PhaseClock); from the events: how long after the add the GPU got the prefill's first work (wait), the prefill's
GPU time (its upload .. its sampling), the rest (the first token's way back to the host); the garbage
collections inside the TTFT. Then per condition a torch.profiler run (kernels, their sum, the GPU span: idle
inside the span is launch-bound time) and, with --sync-debug, the synchronizing ops by call site.
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

from intervals import describe  # noqa: E402
from step_trace import GcClock, PhaseClock, SyncLog, kernel_steps  # noqa: E402

FIELDS = ("ttft_ms", "launch_ms", "gpu_wait_ms", "prefill_gpu_ms", "after_gpu_ms", "gc_ms")


class PrefillMarks:
    """CUDA events on the engine's stream for the first step launched after arm(): one before its upload
    (prepare), one after its sampling is launched (_sample). Wraps the instance attributes (after PhaseClock,
    so its times include nothing of ours but two event records)."""

    def __init__(self, eng: Any, cuda: bool) -> None:
        import torch

        self._torch, self.cuda = torch, cuda
        self.start = self.end = None
        self._armed = False
        prepare, sample = eng.runner.prepare, eng._sample

        def marked_prepare(*args: Any) -> Any:
            if self._armed:
                self.start = self.event()
            return prepare(*args)

        def marked_sample(*args: Any) -> Any:
            result = sample(*args)
            if self._armed:
                self.end, self._armed = self.event(), False
            return result

        eng.runner.prepare, eng._sample = marked_prepare, marked_sample

    def event(self) -> Any:
        if not self.cuda:
            return None
        ev = self._torch.cuda.Event(enable_timing=True)
        ev.record()
        return ev

    def arm(self) -> Any:
        """-> an event recorded now (the add's moment on the stream)."""
        self.start = self.end = None
        self._armed = True
        return self.event()


def one_run(eng: Any, marks: PrefillMarks, phases: PhaseClock, prompt: list[int], new: int, rid: str) -> dict[str, Any]:
    """One request to its end; -> the run's figures (ms)."""
    from stoker.engine import EngineRequest, SamplingParams

    clock = GcClock()
    gc.callbacks.append(clock)
    phases.take()
    added = marks.arm()
    t_add = time.perf_counter()
    eng.add_request(EngineRequest(rid, prompt_token_ids=prompt,
                                  params=SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True)))
    row: dict[str, Any] = {}
    first = None
    try:
        while eng.has_unfinished():
            t0 = time.perf_counter()
            outs = eng.step()
            t1 = time.perf_counter()
            if "launch_ms" not in row:
                row["launch_ms"], row["launch_parts_ms"] = (t1 - t0) * 1000, phases.take()
            if first is None and any(o.request_id == rid and o.new_token_ids for o in outs):
                first = t1
                row["ttft_ms"] = (t1 - t_add) * 1000
                row["gc"] = list(clock.events)
    finally:
        gc.callbacks.remove(clock)
    row["gc_ms"] = sum(ms for _, ms in row.get("gc", []))
    if marks.cuda and marks.start is not None and marks.end is not None:
        marks._torch.cuda.synchronize()
        row["gpu_wait_ms"] = added.elapsed_time(marks.start)
        row["prefill_gpu_ms"] = marks.start.elapsed_time(marks.end)
        if "ttft_ms" in row:
            row["after_gpu_ms"] = row["ttft_ms"] - row["gpu_wait_ms"] - row["prefill_gpu_ms"]
    return row


def set_condition(eng: Any, name: str) -> None:
    graphs = getattr(eng.runner, "prefill_graphs", None)
    if graphs is not None:
        graphs.enabled = name == "graph"


def profiled_run(eng: Any, marks: PrefillMarks, phases: PhaseClock, prompt: list[int], new: int, rid: str,
                 trace_path: Path) -> list[dict[str, Any]]:
    """One run under torch.profiler, each step() in a record_function range -> step_trace.kernel_steps rows
    (kernels, kernel ms by category, GPU span, idle inside it) of the run's first two steps."""
    import torch
    from torch.profiler import ProfilerActivity, profile, record_function

    cuda = torch.cuda.is_available()
    index = [0]
    step = eng.step

    def annotated() -> Any:
        with record_function(f"stoker_step_{index[0]}"):
            index[0] += 1
            return step()

    eng.step = annotated
    try:
        with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
            one_run(eng, marks, phases, prompt, new, rid)
            if cuda:
                torch.cuda.synchronize()
        prof.export_chrome_trace(str(trace_path))
        with open(trace_path) as f:
            return [r for r in kernel_steps(json.load(f)["traceEvents"]) if r["step"] < 2]
    finally:
        del eng.step


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="8b")
    ap.add_argument("--model-dir", default=None, help="default /tmp/stoker-bench-<shape> (written when missing)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--runs", type=int, default=16, help="runs per condition and gap")
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--gaps-ms", default="0,100", help="idle ms before each add (0: back to back, as W1)")
    ap.add_argument("--prefill-graph-tokens", type=int, default=1024, help="EngineConfig.prefill_graph_tokens")
    ap.add_argument("--max-num-seqs", type=int, default=1024)
    ap.add_argument("--profile", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--sync-debug", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--out", default=None, help="folder for ttft_probe.json and the profiler traces")
    args = ap.parse_args(argv)
    import bench
    import torch
    from stoker.engine import LLMEngine, settle_heap

    path = args.model_dir or f"/tmp/stoker-bench-{args.shape}"
    cuda = args.device.startswith("cuda")
    if not (Path(path) / "config.json").exists():
        bench.write_model(path, bench.SHAPES[args.shape], "cuda" if cuda else "cpu")
    config = bench.engine_config(path, args.max_num_seqs, args.device)
    config.prefill_graph_tokens = args.prefill_graph_tokens
    t0 = time.perf_counter()
    eng = LLMEngine(config)
    startup = {k: v for k, v in eng.runner.startup.items() if "graph" in k or k == "ready_s"}
    print(f"engine ready in {time.perf_counter() - t0:.1f} s: {startup}", flush=True)
    conditions = ["eager"] + (["graph"] if getattr(eng.runner, "prefill_graphs", None) is not None else [])
    gaps = [float(g) for g in args.gaps_ms.split(",")]
    vocab = eng.model_config.vocab_size
    phases = PhaseClock(eng)
    marks = PrefillMarks(eng, cuda)
    warm = bench.random_prompts(len(conditions) * 2, args.prompt, vocab, 5)
    for i, prompt in enumerate(warm):  # untimed: every condition's first run (allocator, cuBLAS plans)
        set_condition(eng, conditions[i % len(conditions)])
        one_run(eng, marks, phases, prompt, args.new, f"warm{i}")
    settle_heap()  # as the worker does once loaded
    prompts = bench.random_prompts(args.runs * len(conditions) * len(gaps), args.prompt, vocab, 1)
    print("per run: condition, gap ms, then ms: " + ", ".join(FIELDS), flush=True)
    rows: list[dict[str, Any]] = []
    for i, prompt in enumerate(prompts):
        cond, gap = conditions[i % len(conditions)], gaps[(i // len(conditions)) % len(gaps)]
        set_condition(eng, cond)
        time.sleep(gap / 1000)
        rows.append({"condition": cond, "gap_ms": gap, **one_run(eng, marks, phases, prompt, args.new, f"r{i}")})
        print(run_line(rows[-1]), flush=True)  # a run cut by its time limit keeps the runs before
    summary = summarize(rows, conditions, gaps)
    print_summary(summary)
    out_dir = Path(args.out) if args.out else None
    extra: dict[str, Any] = {}

    def save() -> None:
        if out_dir is not None:
            out_dir.mkdir(parents=True, exist_ok=True)
            body = {"args": vars(args), "startup": startup, "gpu": torch.cuda.get_device_name() if cuda else "cpu",
                    "summary": summary, "runs": rows, **extra}
            (out_dir / "ttft_probe.json").write_text(json.dumps(body, indent=1, default=str))

    save()
    if args.profile:
        for cond in conditions:
            set_condition(eng, cond)
            (out_dir or Path("/tmp")).mkdir(parents=True, exist_ok=True)
            trace = (out_dir or Path("/tmp")) / f"ttft_probe_trace_{cond}.json"
            try:
                extra[f"profile_{cond}"] = profiled_run(eng, marks, phases, prompts[0], 4, f"p{cond}", trace)
            except Exception as e:  # noqa: BLE001 -- a missing bonus figure, not a failed probe
                extra[f"profile_{cond}"] = f"{type(e).__name__}: {e}"[:300]
            print(f"\nprofiled run, {cond}: {extra[f'profile_{cond}']}", flush=True)
    if args.sync_debug:
        for cond in conditions:
            set_condition(eng, cond)
            with SyncLog() as syncs:
                one_run(eng, marks, phases, prompts[1], 4, f"s{cond}")
            extra[f"sync_sites_{cond}"] = syncs.sites
            print(f"\nsynchronizing ops, {cond}: {syncs.sites or 'none'}", flush=True)
    save()
    return 0


def summarize(rows: list[dict[str, Any]], conditions: list[str], gaps: list[float]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for cond in conditions:
        for gap in gaps:
            mine = [r for r in rows if r["condition"] == cond and r["gap_ms"] == gap]
            key = f"{cond} gap {gap:g}"
            out[key] = {f: describe([r[f] for r in mine if f in r]) for f in FIELDS}
            parts: dict[str, list[float]] = {}
            for r in mine:
                for name, ms in r.get("launch_parts_ms", {}).items():
                    parts.setdefault(name, []).append(ms)
            out[key]["launch_parts_p50_ms"] = {k: statistics.median(v) for k, v in parts.items()}
            out[key]["runs_with_gc"] = sum(bool(r.get("gc")) for r in mine)
    return out


def run_line(r: dict[str, Any]) -> str:
    """condition, gap, then ttft, launch, wait, prefill gpu, after gpu (ms) and the collections' ms."""
    return f"  {r['condition']:>6} {r['gap_ms']:>5g} " + " ".join(
        f"{r[f]:7.2f}" if f in r else "      -" for f in FIELDS)


def print_summary(summary: dict[str, Any]) -> None:
    print("\nW1's TTFT on the engine alone, by part (ms: p50 [95% bootstrap interval] / mean / min-max)")
    head = ["condition", *FIELDS]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for key, s in summary.items():
        cells = [key]
        for f in FIELDS:
            d = s[f]
            cells.append("" if not d.get("n") else
                         f"{d['p50']:.2f} [{d['p50_lo']:.2f}, {d['p50_hi']:.2f}] / {d['mean']:.2f} / "
                         f"{d['min']:.2f}-{d['max']:.2f}")
        print("| " + " | ".join(cells) + " |")
    for key, s in summary.items():
        print(f"{key}: launch parts p50 ms {s['launch_parts_p50_ms']}; runs with a collection in the TTFT: "
              f"{s['runs_with_gc']}")


if __name__ == "__main__":
    with contextlib.suppress(BrokenPipeError):
        sys.exit(main())
