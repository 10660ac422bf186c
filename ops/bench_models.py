"""Two models in one worker's engine thread (worker/models.py ModelSet) vs one model alone, and the warm reload.

    PYTHONPATH=. python ops/bench_models.py                 # H200: two 8B-shaped models, 256 requests
    PYTHONPATH=. python ops/bench_models.py --tiny          # any machine (CPU): the tiny shape, a dry run

  alone   one model, the whole KV budget (--kv-gib), N requests (random prompts, greedy, ignore_eos) added at
          once and run to the end: output tokens/s;
  pair    the same weights loaded twice under two names (a, b: two 8B-shaped models; one folder saves 16 GB of
          disk), each with half the KV budget, N requests alternating between them, stepped in turn by one
          ModelSet as the worker does: output tokens/s, and pair/alone (issue 16's target: >= 0.9);
  reload  both models unloaded as if idle, then one request for `a`: seconds from add_request to its first
          token (the load, and the warm-up the worker runs, included); the first reload, then a second one
          (warm: page cache and Triton cache hot), whose target is < 3 s.
Prints one table and writes $OUT/bench_models.json when OUT is set. Reuses ops/bench.py's model writer,
engine settings and prompts.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench import SHAPES, engine_config, log, random_prompts, write_model  # noqa: E402

_WARMED: set[str] = set()  # served names warmed in full in this process (worker/main.py's rule)
LOADS: list[dict[str, Any]] = []  # per build: name, seconds to construct (weights, KV, graphs), to warm up


def _engine(path: str, name: str, kv_bytes: int, args: argparse.Namespace) -> Any:
    """One engine as the worker builds it: the bench's settings, a served name, an explicit KV budget, the
    warm-up run before serving (unless --no-warmup): in full the first time, light for a reload."""
    from stoker.engine import LLMEngine, warm_up

    base = engine_config(path, args.requests, args.device, max_num_batched_tokens=args.batched_tokens)
    config = dataclasses.replace(base, model_name=name, kv_cache_memory_bytes=kv_bytes,
                                 max_model_len=args.prompt + args.new + 16)
    t0 = time.perf_counter()
    engine = LLMEngine(config)
    built = time.perf_counter()
    if not args.no_warmup:
        warm_up(engine, light=name in _WARMED)
        _WARMED.add(name)
    LOADS.append({"name": name, "construct_s": built - t0, "warmup_s": time.perf_counter() - built})
    return engine


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def drive(engine: Any, prompts: list[list[int]], models: list[str | None], new: int, device: str) -> dict[str, float]:
    """Add every request at once, step to the end; output tokens/s over the whole run."""
    from stoker.engine import EngineRequest, SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True)
    _sync(device)
    t0 = time.perf_counter()
    for i, (ids, model) in enumerate(zip(prompts, models, strict=True)):
        engine.add_request(EngineRequest(f"r{i}-{t0}", prompt_token_ids=ids, params=params, model=model))
    produced = 0
    while engine.has_unfinished():
        for out in engine.step():
            if out.error_code:
                raise RuntimeError(f"{out.request_id}: {out.error_code} {out.error_message}")
            produced += len(out.new_token_ids)
    _sync(device)
    wall = time.perf_counter() - t0
    if produced != len(prompts) * new:
        raise RuntimeError(f"{produced} tokens, expected {len(prompts) * new}")
    return {"wall_s": wall, "tokens": produced, "tok_s": produced / wall}


def reload_seconds(models: Any, prompt: list[int], device: str) -> float:
    """Unload every model as if idle, then time one request for `a` from add_request to its first token."""
    from stoker.engine import EngineRequest, SamplingParams

    models.idle_unload_s = 1e-3
    time.sleep(0.01)
    models.step()  # the engine thread's unload of idle models
    if models.model_state("a") != "unloaded":
        raise RuntimeError(f"model a did not unload: {models.model_state('a')}")
    models.idle_unload_s = None
    t0 = time.perf_counter()
    models.add_request(EngineRequest(f"reload-{t0}", prompt_token_ids=prompt, model="a",
                                     params=SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)))
    seconds = None
    while seconds is None or models.has_unfinished():
        if any(out.new_token_ids for out in models.step()) and seconds is None:
            _sync(device)
            seconds = time.perf_counter() - t0
        if seconds is None and not models.has_unfinished():
            time.sleep(0.001)  # loading on its own thread: nothing to step yet
    return seconds


def run(args: argparse.Namespace) -> dict[str, Any]:
    from stoker.worker.models import ModelSet

    shape = SHAPES["tiny" if args.tiny else "8b"]
    log(f"writing the model under {args.model_dir} (once)")
    write_model(args.model_dir, shape, device=args.device if args.device.startswith("cuda") else "cpu")
    kv = int(args.kv_gib * 2**30)
    prompts = random_prompts(args.requests, args.prompt, shape["vocab_size"], seed=1)
    log(f"alone: one model, KV {kv / 2**30:.2f} GiB, {args.requests} requests")
    alone_engine = _engine(args.model_dir, "a", kv, args)
    drive(alone_engine, prompts[: max(1, args.requests // 8)], [None] * max(1, args.requests // 8), args.new,
          args.device)  # a short first run: lazy init out of the timing
    alone = drive(alone_engine, prompts, [None] * args.requests, args.new, args.device)
    alone_engine.close()
    del alone_engine
    if args.device.startswith("cuda"):
        torch.cuda.empty_cache()
    log(f"pair: two models, KV {kv / 2 ** 31:.2f} GiB each, {args.requests} requests alternating")
    pair_set = ModelSet(["a", "b"], lambda name: _engine(args.model_dir, name, kv // 2, args),
                        exclusive_load=args.device.startswith("cuda"))
    names: list[str | None] = ["a" if i % 2 == 0 else "b" for i in range(args.requests)]
    drive(pair_set, prompts[: max(2, args.requests // 8)], names[: max(2, args.requests // 8)], args.new, args.device)
    pair = drive(pair_set, prompts, names, args.new, args.device)
    log("reload: unload both, one request for a (twice: the second is warm)")
    first = reload_seconds(pair_set, prompts[0], args.device)
    first_load = dict(LOADS[-1])
    warm = reload_seconds(pair_set, prompts[1], args.device)
    warm_load = dict(LOADS[-1])
    pair_set.close()
    return {"shape": "tiny" if args.tiny else "8b", "device": args.device, "requests": args.requests,
            "prompt": args.prompt, "new": args.new, "kv_bytes_total": kv, "alone": alone, "pair": pair,
            "ratio": pair["tok_s"] / alone["tok_s"], "reload_first_s": first, "reload_warm_s": warm,
            "reload_first_load": first_load, "reload_warm_load": warm_load, "loads": LOADS}


def print_table(r: dict[str, Any]) -> None:
    rows = [
        ("alone: output tok/s", f"{r['alone']['tok_s']:.0f}", ""),
        ("pair: output tok/s", f"{r['pair']['tok_s']:.0f}", ""),
        ("pair / alone", f"{r['ratio']:.3f}", ">= 0.9"),
        ("reload, first: s to first token", f"{r['reload_first_s']:.2f}", ""),
        ("reload, warm: s to first token", f"{r['reload_warm_s']:.2f}", "< 3"),
        ("  of which construct (weights, KV, graphs)", f"{r['reload_warm_load']['construct_s']:.2f}", ""),
        ("  of which light warm-up", f"{r['reload_warm_load']['warmup_s']:.2f}", ""),
    ]
    print(f"\n{r['shape']} on {r['device']}: {r['requests']} requests x {r['prompt']} prompt + {r['new']} new tokens, "
          f"KV {r['kv_bytes_total'] / 2**30:.2f} GiB in all")
    print(f"| {'figure':<42} | {'value':>9} | {'target':>6} |")
    print(f"|{'-' * 44}|{'-' * 11}|{'-' * 8}|")
    for name, value, target in rows:
        print(f"| {name:<42} | {value:>9} | {target:>6} |")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="tiny shape, few requests, CPU unless --device says")
    parser.add_argument("--device", default=None, help="cuda or cpu (default: cuda for 8b, cpu for --tiny)")
    parser.add_argument("--requests", type=int, default=None, help="concurrent requests (default 256; tiny 32)")
    parser.add_argument("--prompt", type=int, default=None, help="prompt tokens (default 512; tiny 16)")
    parser.add_argument("--new", type=int, default=None, help="new tokens per request (default 256; tiny 8)")
    parser.add_argument("--kv-gib", type=float, default=None, help="total KV budget (default 40; tiny 0.0625)")
    parser.add_argument("--batched-tokens", type=int, default=8192, help="max_num_batched_tokens per engine")
    parser.add_argument("--no-warmup", action="store_true", help="skip the engine warm-up at (re)load")
    parser.add_argument("--model-dir", default=None, help="where the random model is written (reused)")
    args = parser.parse_args(argv)
    tiny = args.tiny
    args.device = args.device or ("cpu" if tiny else "cuda")
    args.requests = args.requests or (32 if tiny else 256)
    args.prompt = args.prompt or (16 if tiny else 512)
    args.new = args.new or (8 if tiny else 256)
    args.kv_gib = args.kv_gib or (0.0625 if tiny else 40.0)
    args.model_dir = args.model_dir or os.path.join("/tmp", f"stoker-bench-models-{'tiny' if tiny else '8b'}")
    result = run(args)
    print_table(result)
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "bench_models.json"), "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
