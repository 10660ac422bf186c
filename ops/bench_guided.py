"""Decode step cost of structured output: every request constrained by one mid-size JSON Schema vs none.

    PYTHONPATH=. python ops/bench_guided.py                          # H200: 8B shape, batches 1024 and 256
    PYTHONPATH=. python ops/bench_guided.py --batches 1024 --repeats 3 --prefix-caching --timeline  # call.sh's
    PYTHONPATH=. python ops/bench_guided.py --shape tiny --device cpu --batches 8 --steps 4   # dry run

The model is ops/bench.py's random one (written there if absent, same folder), seen through a sibling folder
(<model-dir>-guided) whose weights and config are links to it and whose tokenizer.json is a byte-level BPE of
the model's vocabulary size (ops/bench_grammar.big_tokenizer_json: real-looking pieces, as Llama 3's 128K has;
bench.py's own tokenizer has 384 tokens, which would make every mask trivially cheap). Built once, cached.

For each batch: N requests (random prompt ids, greedy, ignore_eos) run through their prefill and --warm decode
steps, then --steps decode steps are timed, first all unconstrained (overlapped steps, the engine's default on
a GPU), then all constrained by SCHEMA, which cannot close within the steps measured (its array needs
MIN_ITEMS objects), and for the first batch constrained again with overlap off ("schema (sync)": what the
engine did before it overlapped constrained steps; --no-sync-case skips it); --grammar-modes inline,overlap adds the
constrained case with the grammar work on the engine thread (matchers advanced one by one, masks filled inline:
the engine before its grammar_overlap) beside the default; --timeline adds each case's step timeline
(ops/guided_timeline.py). Per case: step wall p50 / mean, the constrained / unconstrained ratio (target <= 1.10 at
1024), process CPU cores over the timed steps, the engine thread's CPU per step, and the mask work split:
`fill` (llguidance computing the masks: wall and process CPU, which counts its own threads), `build`
(SamplingBatch.build, which holds the fill and the upload), `advance` (matchers consuming the sampled tokens,
engine thread CPU) and `apply` (the bitmask op: GPU ms from CUDA events; host ms on the CPU). Sanity: how
many outputs a fresh matcher accepts as a prefix of the schema (constrained: all; unconstrained: ~none).

--repeats R runs each batch's cases R times interleaved on the one engine (none, schema, none, schema ...) and
reports the median of the rounds' own ratios, so that one noisy case does not decide (--prefix-caching makes the
rounds after the first skip the prefill). A second table gives each case's step distribution (p90 / p99 / max, the
slowest steps by index, the collections inside the timed steps: ops/step_tail.py) and, with --timeline, the
slowest steps' own phases. The process runs as the worker's does once loaded (--heap worker, --switch-interval
0.0005: worker/main.py), not with Python's defaults, which the runs before 21:00 UTC 2026-12-01 measured.
Prints the tables; writes $OUT/bench_guided.json when OUT is set.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

MIN_ITEMS = 100  # >= 3 tokens an item (keys, values, braces): cannot close before ~300 tokens


def schema() -> dict[str, Any]:
    """A mid-size extraction schema (~1 KB): an array of records (integers, bounded strings, an enum, an
    array of enums, a nested object with a pattern, a bounded number, a boolean), then a summary string."""
    record = {
        "type": "object",
        "properties": {
            "id": {"type": "integer", "minimum": 0, "maximum": 1_000_000},
            "name": {"type": "string", "minLength": 1, "maxLength": 40},
            "kind": {"enum": ["person", "company", "place", "product", "event", "date", "amount", "other"]},
            "tags": {"type": "array", "items": {"enum": ["new", "old", "hot", "cold", "red", "blue"]},
                     "maxItems": 5},
            "address": {"type": "object",
                        "properties": {"street": {"type": "string", "maxLength": 60},
                                       "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                        "required": ["street", "zip"], "additionalProperties": False},
            "score": {"type": "number", "minimum": 0, "maximum": 1},
            "active": {"type": "boolean"},
        },
        "required": ["id", "name", "kind", "tags", "address", "score", "active"],
        "additionalProperties": False,
    }
    return {
        "type": "object",
        "properties": {
            "records": {"type": "array", "items": record, "minItems": MIN_ITEMS, "maxItems": 200},
            "summary": {"type": "string", "maxLength": 400},
        },
        "required": ["records", "summary"],
        "additionalProperties": False,
    }


def log(msg: str) -> None:
    print(f"[bench_guided {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# ---- the model folder ------------------------------------------------------------------------------------
def guided_model_dir(base: str, vocab_size: int, tokenizer_json: str | None = None) -> tuple[str, float]:
    """base's weights and config behind a byte-level tokenizer of vocab_size tokens (or the file
    tokenizer_json, e.g. the H200's 66,144-token one on the CPU) -> (folder, seconds spent building the
    tokenizer; 0 when cached)."""
    from stoker.ops.bench_grammar import big_tokenizer_json

    path = base.rstrip("/") + "-guided"
    os.makedirs(path, exist_ok=True)
    for name in os.listdir(base):
        if name.endswith((".safetensors", ".json")) and not name.startswith("tokenizer"):
            link = os.path.join(path, name)
            if not os.path.lexists(link):
                os.symlink(os.path.join(os.path.abspath(base), name), link)
    target = os.path.join(path, "tokenizer.json")
    if os.path.isfile(target):
        return path, 0.0
    started = time.perf_counter()
    if tokenizer_json:
        with open(tokenizer_json, encoding="utf-8") as f:
            text = f.read()
    else:
        text = big_tokenizer_json(vocab_size)  # <s> = 0, </s> = 1: bench.py's config's bos and eos
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>"}, f)
    with open(target + ".tmp", "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(target + ".tmp", target)  # last: a folder with tokenizer.json is complete
    return path, time.perf_counter() - started


# ---- instrumentation -------------------------------------------------------------------------------------
class MaskMeter:
    """Wraps the engine's mask work (class attributes, restored by close()) and sums its cost."""

    def __init__(self, cuda: bool):
        from stoker.engine import sampler
        from stoker.engine.grammar import GrammarCompiler, GrammarState

        self.cuda = cuda
        self.totals: dict[str, float] = {}
        self.apply_events: list[tuple[Any, Any]] = []
        self._restore: list[tuple[Any, str, Any]] = []
        self._wrap(GrammarCompiler, "fill_bitmasks", "fill", process=True)
        self._wrap(GrammarState, "advance", "advance")  # one by one (grammar work inline)
        self._wrap(GrammarCompiler, "advance_all", "advance")  # the step's rows in one call (overlap)
        self._wrap_classmethod(sampler.SamplingBatch, "build", "build")
        original_apply = sampler.apply_token_bitmask

        def apply(*args: Any) -> None:
            if not self.cuda:
                started = time.perf_counter()
                original_apply(*args)
                self._add("apply_host_ms", (time.perf_counter() - started) * 1e3)
                return
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            original_apply(*args)
            end.record()
            self.apply_events.append((start, end))

        sampler.apply_token_bitmask = apply
        self._restore.append((sampler, "apply_token_bitmask", original_apply))

    def _add(self, key: str, value: float) -> None:
        self.totals[key] = self.totals.get(key, 0.0) + value

    def _timed(self, fn: Callable[..., Any], name: str, process: bool) -> Callable[..., Any]:
        def run(*args: Any, **kwargs: Any) -> Any:
            wall, thread, proc = time.perf_counter(), time.thread_time(), time.process_time()
            try:
                return fn(*args, **kwargs)
            finally:
                self._add(f"{name}_wall_ms", (time.perf_counter() - wall) * 1e3)
                self._add(f"{name}_thread_cpu_ms", (time.thread_time() - thread) * 1e3)
                if process:
                    self._add(f"{name}_process_cpu_ms", (time.process_time() - proc) * 1e3)
                self._add(f"{name}_calls", 1)

        return run

    def _wrap(self, owner: Any, attr: str, name: str, process: bool = False) -> None:
        original = owner.__dict__[attr]
        setattr(owner, attr, self._timed(original, name, process))
        self._restore.append((owner, attr, original))

    def _wrap_classmethod(self, owner: Any, attr: str, name: str) -> None:
        original = owner.__dict__[attr]
        setattr(owner, attr, classmethod(self._timed(original.__func__, name, False)))
        self._restore.append((owner, attr, original))

    def reset(self) -> None:
        self.totals.clear()
        self.apply_events.clear()

    def snapshot(self) -> dict[str, float]:
        out = dict(self.totals)
        if self.apply_events:
            torch.cuda.synchronize()
            out["apply_gpu_ms"] = sum(s.elapsed_time(e) for s, e in self.apply_events)
        return out

    def close(self) -> None:
        for owner, attr, original in reversed(self._restore):
            setattr(owner, attr, original)


# ---- one case --------------------------------------------------------------------------------------------
def run_case(eng: Any, meter: MaskMeter, batch: int, guided: Any, args: argparse.Namespace, tag: str) -> dict[str, Any]:
    from stoker.engine import EngineRequest, SamplingParams
    from stoker.ops.bench import StepProbe, random_prompts
    from stoker.ops.guided_timeline import StepTimeline
    from stoker.ops.step_tail import GcRecorder, distribution

    # Seeded per request when sampling, so runs repeat; greedy (the default) drives a random model's rows
    # through the same states (every row the same string), sampling makes them diverge as real ones do.
    def params_for(i: int) -> Any:
        return SamplingParams(temperature=args.temperature, seed=i if args.temperature > 0 else None,
                              max_tokens=args.warm + args.steps + 64, ignore_eos=True, guided=guided)
    outputs: dict[str, list[int]] = {}
    ended: dict[str, str] = {}
    prompts = random_prompts(batch, args.prompt, eng.model_config.vocab_size, 5)
    started = time.perf_counter()
    for i, prompt in enumerate(prompts):
        rid = f"{tag}-{i}"
        outputs[rid] = []
        eng.add_request(EngineRequest(rid, prompt_token_ids=prompt, params=params_for(i)))
    add_s = time.perf_counter() - started

    def step() -> None:
        for out in eng.step():
            if out.error_code:
                raise RuntimeError(f"{out.request_id}: {out.error_code} {out.error_message}")
            outputs[out.request_id] += out.new_token_ids
            if out.finished:
                ended[out.request_id] = str(out.finish_reason)

    while min(len(v) for v in outputs.values()) < 1:  # every prefill done
        step()
    prefill_s = time.perf_counter() - started
    for _ in range(args.warm):
        step()
    meter.reset()
    probe = StepProbe(eng) if meter.cuda else None
    timeline = StepTimeline(eng, meter.cuda) if args.timeline else None  # after the probe: unwrapped first
    walls: list[float] = []
    first = outputs[f"{tag}-0"]  # the first request's output so far after each step: where the slow steps were
    first_lengths: list[int] = []
    tokens_before = sum(len(v) for v in outputs.values())
    with GcRecorder() as collections:
        cpu0, thread0, t0 = time.process_time(), time.thread_time(), time.perf_counter()
        for index in range(args.steps):
            collections.step = index
            began = time.perf_counter()
            step() if timeline is None else timeline.step(step)
            walls.append(time.perf_counter() - began)
            first_lengths.append(len(first))
        wall = time.perf_counter() - t0
        cpu, thread = time.process_time() - cpu0, time.thread_time() - thread0
        collections.step = -1
    phases = timeline.close() if timeline is not None else None
    work = meter.snapshot()
    gpu = probe.close() if probe is not None else {}
    tokens = sum(len(v) for v in outputs.values()) - tokens_before
    closed = dict(ended)  # before the aborts below end the rest
    for rid in outputs:
        eng.abort(rid)
    while eng.has_unfinished():
        step()
    per_step = {k: v / args.steps for k, v in work.items() if not k.endswith("_calls")}
    return {
        "batch": batch,
        "constrained": guided is not None,
        "steps": args.steps,
        "tokens": tokens,
        "add_s": add_s,
        "prefill_s": prefill_s,
        "step_p50_ms": statistics.median(walls) * 1e3,
        "step_mean_ms": wall / args.steps * 1e3,
        "step_max_ms": max(walls) * 1e3,
        "step_ms": distribution([w * 1e3 for w in walls]),  # p90 / p99 / max and the slowest steps' indices
        "gc": collections.summary(),
        **({"slow_steps": slow_step_phases(phases, [w * 1e3 for w in walls])} if phases is not None else {}),
        "first_output_after_slowest": [eng.tokenizer.decode(first[: first_lengths[i]])[-48:]
                                       for i, _ in distribution(walls)["slowest"][:3]],
        "process_cpu_cores": cpu / wall,
        "engine_thread_cpu_ms_per_step": thread / args.steps * 1e3,
        # the rest of the process: llguidance's mask threads and the grammar thread (unconstrained: ~nothing)
        "other_threads_cpu_ms_per_step": (cpu - thread) / args.steps * 1e3,
        "mask_work_per_step": per_step,
        # GPU time of a decode step, forward launch .. sampler's last kernel (CUDA events; 0 on the CPU)
        "gpu_busy_ms_per_step": gpu.get("decode_busy_ms", 0.0) / max(1, gpu.get("decode_steps", 0)),
        "closed_early_reasons": sorted(set(closed.values())),
        **({"timeline": phases} if phases is not None else {}),
        "num_closed_early": len(closed),
        "outputs": outputs,
    }


def slow_step_phases(phases: dict[str, Any], walls_ms: list[float]) -> list[dict[str, Any]]:
    """The timeline's own phases of the slowest steps (index and wall first), then drops the per-step rows from
    phases (the JSON keeps these few)."""
    from stoker.ops.step_tail import SLOWEST

    per_step = phases.pop("per_step", [])
    slowest = sorted(range(len(walls_ms)), key=walls_ms.__getitem__, reverse=True)[:SLOWEST]
    return [{"index": i, "wall_ms": walls_ms[i], **(per_step[i] if i < len(per_step) else {})} for i in slowest]


def valid_prefixes(compiler: Any, guided: Any, outputs: dict[str, list[int]]) -> int:
    """How many outputs a fresh matcher takes whole (a valid prefix of the grammar)."""
    count = 0
    for tokens in outputs.values():
        matcher = compiler.matcher(guided)
        count += matcher.validate_tokens(tokens) == len(tokens) and bool(tokens)
    return count


def run_round(eng: Any, meter: MaskMeter, compiler: Any, guided: Any, batch: int, args: argparse.Namespace,
              first: bool, rep: int, began: float, r: dict[str, Any], cases: list[dict[str, Any]],
              recorded: dict[str, list[list[int]]]) -> None:
    """One round of a batch's cases, in order (none, then the constrained ones) -> appended to cases."""
    # (grammar, synchronous steps, grammar work): "sync" (the first round only, unless --no-sync-case) is the
    # constrained step with the engine's overlap off, what a constrained batch cost before the engine overlapped
    # it; grammar work "inline" is the matchers advanced and the masks filled on the engine thread
    # (LLMEngine.grammar_overlap off), "overlap" the engine's default (--grammar-modes)
    work = args.grammar_modes.split(",")
    threads = [int(t) for t in args.mask_threads.split(",")] if args.mask_threads else [compiler.mask_threads]
    modes = ([("none", False, "overlap", threads[0])] * args.unconstrained_case
             + [("schema", False, w, t) for w in work for t in threads]
             + ([("schema", True, work[-1], threads[0])] if first and args.sync_case else []))
    for mode, sync, grammar_work, mask_threads in modes:
        if time.perf_counter() - began > args.budget_s:
            log(f"past --budget-s {args.budget_s:g}: batch {batch} round {rep} {mode} sync={sync} {grammar_work} skipped")
            r.setdefault("skipped", []).append([batch, rep, mode, sync, grammar_work])
            continue
        log(f"batch {batch}, round {rep}, {mode}{', synchronous steps' if sync else ''}, grammar work {grammar_work}")
        if mask_threads != compiler.mask_threads:
            compiler.set_mask_threads(mask_threads)
        overlap, eng.async_scheduling = eng.async_scheduling, eng.async_scheduling and not sync
        eng.grammar_overlap = grammar_work == "overlap"
        try:
            case = run_case(eng, meter, batch, guided if mode == "schema" else None, args,
                            f"{mode[0]}{'s' if sync else ''}{grammar_work[0]}{batch}r{rep}t{mask_threads}")
        finally:
            eng.async_scheduling, eng.grammar_overlap = overlap, True
        case["grammar_work"] = grammar_work
        case["sync_steps"] = sync or not overlap
        case["repeat"] = rep
        case["mask_threads"], case["threads_compared"] = mask_threads, len(threads) > 1
        outputs = case.pop("outputs")
        if mode == "schema" and rep == 0:
            recorded[f"{batch}{' sync' if sync else ''}{' inline' if grammar_work == 'inline' else ''}"] = list(
                outputs.values())
        case["valid_prefixes"] = valid_prefixes(compiler, guided, outputs)
        case["distinct_outputs"] = len({tuple(tokens) for tokens in outputs.values()})
        sample = next(iter(outputs.values()))
        case["sample_text"] = eng.tokenizer.decode(sample)[:160]
        cases.append(case)
        log(json.dumps({k: v for k, v in case.items() if k not in ("sample_text", "timeline", "slow_steps")}))


# ---- main ------------------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="8b")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--model-dir", default=None, help="bench.py's folder; default /tmp/stoker-bench-<shape>")
    ap.add_argument("--batches", default="1024,256")
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--warm", type=int, default=4)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--temperature", type=float, default=0.0,
                    help="0: greedy (a random model then walks every row through the same states); > 0: sampled, "
                         "seeded per request, so the constrained rows diverge (both cases use it)")
    ap.add_argument("--max-num-seqs", type=int, default=1024)
    ap.add_argument("--no-sync-case", dest="sync_case", action="store_false",
                    help="skip the first batch's constrained case with synchronous steps (the old design)")
    ap.add_argument("--grammar-families", type=int, default=None,
                    help="independent templates per grammar (default: the compiler's, 4 per mask thread; 1: the "
                         "engine before issue 15's fix, every request a copy of one template)")
    ap.add_argument("--no-unconstrained-case", dest="unconstrained_case", action="store_false",
                    help="only the constrained cases (recording rows on the CPU)")
    ap.add_argument("--vocab-size", type=int, default=None, help="the model's vocabulary (default: the shape's)")
    ap.add_argument("--tokenizer-json", default=None,
                    help="the guided tokenizer from this file (default: built for the vocabulary, cached)")
    ap.add_argument("--record", default=None,
                    help="write every constrained case's output token ids here (JSON; ops/llg_fill_probe.py)")
    ap.add_argument("--grammar-modes", default="overlap",
                    help="constrained cases per batch, by where the grammar work runs: overlap (the engine's "
                         "default: matchers advanced on the mask threads, masks prefetched beside the engine "
                         "thread's work), inline (both on the engine thread, as before), or both: inline,overlap")
    ap.add_argument("--async-steps", action="store_true",
                    help="overlapped steps on the CPU too (the GPU's default), for a dry run of that path")
    ap.add_argument("--timeline", action="store_true",
                    help="per case, the median step's host phases and GPU waits (ops/guided_timeline.py)")
    ap.add_argument("--repeats", type=int, default=1,
                    help="per batch, this many rounds of its cases interleaved on the one engine (none, schema, none, "
                         "schema ...); the ratio reported is the median of the rounds' own ratios")
    ap.add_argument("--mask-threads", default="",
                    help="constrained cases per round, one per llguidance executor size listed (e.g. 12,15; default: "
                         "the compiler's own, 80%% of the CPUs); the families compiled stay those of the default")
    ap.add_argument("--heap", choices=["worker", "default"], default="worker",
                    help="worker: the heap frozen and the young GC threshold raised once the engine is up, as the "
                         "worker does (stoker.engine.settle_heap); default: Python's GC as it comes (runs before "
                         "21:00 UTC 2026-12-01)")
    ap.add_argument("--switch-interval", type=float, default=0.0005,
                    help="sys.setswitchinterval for the run (the worker's default, worker/config.py; Python's own "
                         "is 0.005, the runs before 21:00 UTC 2026-12-01)")
    ap.add_argument("--prefix-caching", action="store_true",
                    help="the engine's prefix cache on (its default; ops/bench.py's settings turn it off): every "
                         "round's prompts are the same, so rounds after the first skip most of the ~3.5 s prefill "
                         "of 1,024 x 128 tokens; the decode steps timed are the same")
    ap.add_argument("--budget-s", type=float, default=200.0,
                    help="start no further case once this many seconds have passed since the start")
    args = ap.parse_args(argv)
    import logging

    from stoker.engine import GuidedDecoding, LLMEngine
    from stoker.ops.bench import SHAPES, engine_config, write_model
    from stoker.ops.step_tail import heap_policy

    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    cuda = args.device.startswith("cuda")
    if cuda and not torch.cuda.is_available():
        print("bench_guided: --device cuda needs a CUDA GPU (use --device cpu --shape tiny for a dry run)",
              file=sys.stderr)
        return 2
    shape = dict(SHAPES[args.shape], **({"vocab_size": args.vocab_size} if args.vocab_size else {}))
    base = args.model_dir or f"/tmp/stoker-bench-{args.shape}"
    began = time.perf_counter()
    r: dict[str, Any] = {"date": time.strftime("%Y-%m-%d %H:%M"), "argv": sys.argv[1:], "torch": torch.__version__,
                         "gpu": torch.cuda.get_device_name() if cuda else "cpu", "host_cpus": os.cpu_count(),
                         "temperature": args.temperature}
    log(f"model folder {base} (written if absent)")
    r["write_s"] = write_model(base, shape, device="cuda" if cuda else "cpu")
    path, r["tokenizer_build_s"] = guided_model_dir(base, shape["vocab_size"], args.tokenizer_json)
    log(f"tokenizer ready ({r['tokenizer_build_s']:.1f} s); starting the engine")
    started = time.perf_counter()
    config = engine_config(path, args.max_num_seqs, device=args.device)
    if args.prefix_caching:
        config = dataclasses.replace(config, enable_prefix_caching=True)
    eng = LLMEngine(config)
    r["engine_start_s"] = time.perf_counter() - started
    if args.async_steps:
        eng.async_scheduling = True  # the GPU's step order on the CPU (a dry run of the overlapped path)
    started = time.perf_counter()
    compiler = eng.grammar_compiler()
    r["lltokenizer_s"] = time.perf_counter() - started
    if args.grammar_families:
        compiler.families = args.grammar_families  # before the schema's compile below
    r["mask_threads"], r["grammar_families"] = compiler.mask_threads, compiler.families
    r["tokenizer_vocab"] = eng.tokenizer.vocab_size
    spec = json.dumps(schema(), separators=(",", ":"))
    guided = GuidedDecoding("json_schema", spec)
    started = time.perf_counter()
    compiler.prepare(guided)
    r["schema_bytes"], r["compile_ms"] = len(spec), (time.perf_counter() - started) * 1e3
    r["templates"] = compiler.num_families(guided)
    sys.setswitchinterval(args.switch_interval)
    r["process"] = heap_policy(args.heap)  # after the engine's start, as the worker
    meter = MaskMeter(cuda)
    cases: list[dict[str, Any]] = []
    recorded: dict[str, list[list[int]]] = {}  # case -> the constrained rows' output token ids (--record)
    try:
        for index, batch in enumerate(int(b) for b in args.batches.split(",")):
            for rep in range(args.repeats):
                run_round(eng, meter, compiler, guided, batch, args, index == 0 and rep == 0, rep, began, r, cases,
                          recorded)
    finally:
        meter.close()
    r["cases"] = cases
    if args.record:
        with open(args.record, "w") as f:
            json.dump({"schema": spec, "vocab_size": shape["vocab_size"], "cases": recorded}, f)
    print_table(r)
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "bench_guided.json"), "w") as f:
            json.dump(r, f, indent=2)
    return 0


def print_table(r: dict[str, Any]) -> None:
    from stoker.ops.guided_timeline import format_timeline

    print(f"# temperature {r.get('temperature', 0.0)}; {r['gpu']}, {r['host_cpus']} host CPUs; tokenizer {r['tokenizer_vocab']:,} tokens; schema "
          f"{r['schema_bytes']} B compiled in {r['compile_ms']:.1f} ms into {r['templates']} templates (mask threads "
          f"{r['mask_threads']}); engine start {r['engine_start_s']:.1f} s")
    head = ("batch", "grammar", "p50 ms", "mean ms", "ratio p50", "gpu ms", "cores", "eng thr ms", "fill ms",
            "fill cpu ms", "build ms", "advance ms", "apply ms", "valid", "distinct", "closed")
    print("| " + " | ".join(head) + " |")
    print("|" + "|".join("---" for _ in head) + "|")
    for c in r["cases"]:
        w = c["mask_work_per_step"]
        ratio = case_ratio(r["cases"], c)
        apply_ms = w.get("apply_gpu_ms", w.get("apply_host_ms", 0.0))
        cells = (c["batch"], grammar_label(c), f"{c['step_p50_ms']:.2f}",
                 f"{c['step_mean_ms']:.2f}", f"{ratio:.2f}x", f"{c['gpu_busy_ms_per_step']:.2f}",
                 f"{c['process_cpu_cores']:.2f}",
                 f"{c['engine_thread_cpu_ms_per_step']:.2f}", f"{w.get('fill_wall_ms', 0):.2f}",
                 f"{w.get('fill_process_cpu_ms', 0):.2f}", f"{w.get('build_wall_ms', 0):.2f}",
                 f"{w.get('advance_thread_cpu_ms', 0):.2f}", f"{apply_ms:.2f}",
                 f"{c['valid_prefixes']}/{c['batch']}", c["distinct_outputs"], c["num_closed_early"])
        print("| " + " | ".join(str(x) for x in cells) + " |")
    print_tail(r)
    if r.get("skipped"):
        print(f"# skipped (past --budget-s): {r['skipped']}")
    for c in r["cases"]:
        if "timeline" in c:
            tag = "schema " + c.get("grammar_work", "") if c["constrained"] else "none"
            print(format_timeline(f"{c['batch']} {tag}", c["timeline"]))
    for c in r["cases"]:
        if c["constrained"]:
            print(f"# batch {c['batch']} sample output: {c['sample_text']!r}")


def grammar_label(c: dict[str, Any]) -> str:
    """none / schema, (sync), inline, and the executor's size when the run compared sizes (--mask-threads)."""
    return ("schema" if c["constrained"] else "none") + (" (sync)" if c["sync_steps"] else "") + (
        " inline" if c["constrained"] and c.get("grammar_work") == "inline" else "") + (
        f" t{c['mask_threads']}" if c["constrained"] and c.get("threads_compared") else "")


def case_ratio(cases: list[dict[str, Any]], c: dict[str, Any], key: str = "step_p50_ms") -> float:
    """c's step (key) over the unconstrained case of its own batch and round (1.0 for an unconstrained one, or
    when its round has none)."""
    base = next((b for b in cases if not b["constrained"] and b["batch"] == c["batch"]
                 and b.get("repeat", 0) == c.get("repeat", 0)), None)
    return c[key] / base[key] if base and c["constrained"] else 1.0


def round_ratios(r: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Per (batch, constrained case): each round's p50 ratio and mean ratio, and their medians over the rounds:
    one noisy round does not decide."""
    out: dict[str, dict[str, Any]] = {}
    for c in r["cases"]:
        if c["constrained"]:
            entry = out.setdefault(f"{c['batch']} {grammar_label(c)}", {"p50": [], "mean": []})
            entry["p50"].append(case_ratio(r["cases"], c))
            entry["mean"].append(case_ratio(r["cases"], c, "step_mean_ms"))
    for entry in out.values():
        entry["median_p50_ratio"] = statistics.median(entry["p50"])
        entry["median_mean_ratio"] = statistics.median(entry["mean"])
    return out


def print_tail(r: dict[str, Any]) -> None:
    """The per-step distribution of each case (ms), its slowest steps (index: ms), the collections inside its
    timed steps, then the median of the rounds' ratios."""
    head = ("batch", "grammar", "round", "p50", "p90", "p99", "max", "mean", "slowest steps (index: ms)",
            "gc count gen0/1/2", "gc ms gen0/1/2", "other threads' CPU ms/step")
    print("| " + " | ".join(head) + " |")
    print("|" + "|".join("---" for _ in head) + "|")
    for c in r["cases"]:
        d, g = c["step_ms"], c["gc"]
        slow = ", ".join(f"{i}: {ms:.1f}" for i, ms in d["slowest"])
        cells = (c["batch"], grammar_label(c), c.get("repeat", 0), *(f"{d[k]:.2f}" for k in ("p50", "p90", "p99", "max",
                 "mean")), slow, "/".join(str(n) for n in g["count"]), "/".join(f"{ms:.1f}" for ms in g["ms"]),
                 f"{c.get('other_threads_cpu_ms_per_step', 0.0):.1f}")
        print("| " + " | ".join(str(x) for x in cells) + " |")
    r["round_ratios"] = round_ratios(r)
    for tag, entry in r["round_ratios"].items():
        print(f"# {tag}: p50 ratio median {entry['median_p50_ratio']:.3f}x over {len(entry['p50'])} rounds "
              f"({', '.join(f'{x:.3f}' for x in entry['p50'])}); mean ratio median {entry['median_mean_ratio']:.3f}x "
              f"({', '.join(f'{x:.3f}' for x in entry['mean'])})")
    for c in r["cases"]:
        if c["constrained"] and c.get("first_output_after_slowest"):
            print(f"# {c['batch']} {grammar_label(c)} round {c.get('repeat', 0)}: request 0's output after the three "
                  f"slowest steps ends {c['first_output_after_slowest']!r}")
        for s in c.get("slow_steps", [])[:2]:
            phases = " ".join(f"{k}={v:.2f}" for k, v in s.items() if k not in ("index", "wall_ms") and v)
            print(f"# slow step {c['batch']} {grammar_label(c)} round {c.get('repeat', 0)} step {s['index']} "
                  f"{s['wall_ms']:.1f} ms: {phases}")


if __name__ == "__main__":
    sys.exit(main())
