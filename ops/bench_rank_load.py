"""How fast one tensor-parallel rank loads its part of a model folder (issue 17), on one GPU.

A rank's model (engine/parallel/plan.py's rank_model_config: its heads, KV heads and intermediate rows) is built on
the GPU without a process group (loading needs none) and filled twice from the same folder: by the plain loader
(safetensors' get_slice, a slice at a time through pageable memory) and by the fast loader (engine/fast_load.py:
pinned staging, parallel reads, a column-parallel tensor's rows alone). The whole model (TP = 1) by the fast loader
is the reference. The folder is ops/bench.py's random model (written first if absent), read from the page cache
(warm: the write or an earlier run left it there). On a machine with several GPUs every rank loads at once and
shares the host's memory bandwidth; this measures one.

    PYTHONPATH=. python3 ops/bench_rank_load.py [--shape 8b] [--tp 2] [--ranks 0]
"""

from __future__ import annotations

import argparse
import gc
import sys
import time

import torch
from stoker.engine.fast_load import load_weights_fast
from stoker.engine.loader import load_weights
from stoker.engine.model_config import ModelConfig
from stoker.engine.models import model_class
from stoker.engine.parallel.plan import rank_model_config
from stoker.ops import bench


def timed_load(path: str, rank: int, size: int, fast: bool) -> tuple[float, int]:
    """(seconds, bytes of the rank's parameters) for one load of rank `rank` of `size` (size 1: the whole model)."""
    mc = ModelConfig.from_folder(path)
    cfg = mc if size == 1 else rank_model_config(mc, rank, size, comm=None)  # type: ignore[arg-type]
    with torch.device("cuda"):
        model = model_class(cfg.architecture)(cfg, torch.bfloat16, 1024)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    if fast:
        read = load_weights_fast(model, path, "cuda", progress=False)["bytes"]
    else:
        load_weights(model, path)
        read = 0
    torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    held = sum(p.numel() * p.element_size() for p in model.parameters())
    del model
    gc.collect()
    torch.cuda.empty_cache()
    return seconds, read or held


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=sorted(bench.SHAPES), default="8b")
    ap.add_argument("--model-dir", default=None, help="default /tmp/stoker-bench-<shape> (ops/bench.py's)")
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--ranks", default="0", help="comma-separated ranks to load (each alone)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("ops/bench_rank_load.py needs a CUDA GPU", file=sys.stderr)
        return 2
    path = args.model_dir or f"/tmp/stoker-bench-{args.shape}"
    bench.write_model(path, bench.SHAPES[args.shape])
    rows = []
    timed_load(path, 0, 1, True)  # a first load warms the page cache and the CUDA context
    for rank in [int(r) for r in args.ranks.split(",")]:
        for fast in (False, True):
            s, b = timed_load(path, rank, args.tp, fast)
            rows.append((f"rank {rank} of {args.tp}", "fast" if fast else "plain (get_slice)", b, s))
    s, b = timed_load(path, 0, 1, True)
    rows.append(("whole model (TP = 1)", "fast", b, s))
    print(f"{args.shape}, folder {path}, page cache warm; bytes: read from the files (fast), held (plain)")
    print("| what | loader | GB | seconds | GB/s |\n|---|---|---|---|---|")
    for what, loader, nbytes, seconds in rows:
        print(f"| {what} | {loader} | {nbytes / 1e9:.2f} | {seconds:.2f} | {nbytes / seconds / 1e9:.1f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
