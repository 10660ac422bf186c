#!/usr/bin/env python
"""The prefill attention kernel's tiles at W2's prompt step (issue 13): one 8,192-token step of 16 prompts of 512,
bf16 cache, per PrefillTiles (query rows, key tile, warps, stages).

    PYTHONPATH=. python3 ops/bench_prefill_attention.py                         # the H200 (~20 s, compiles included)
    TRITON_INTERPRET=1 PYTHONPATH=. python ops/bench_prefill_attention.py --tiny  # CPU dry run

Llama-3-8B's attention shape (Hq 32, Hkv 8, D 128, block_size 16, shuffled blocks); timed as
ops/bench_decode_attention_fp8.py times (a CUDA graph of several launches, median of 5 replays). TFLOP/s counts
the causal half of QK^T and PV (2 * 2 * Hq * D per visible query-key pair); 'err' is the largest difference
from the current default's output. A table on stdout, JSON under $OUT (or --json) when set.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parent)]

from bench_decode_attention_fp8 import AHEAD_LABEL, HEAD_DIM, HQ, paged_caches, time_us  # noqa: E402
from stoker.engine.kernels.attention import PREFILL_TILES, PrefillTiles, paged_attention_triton  # noqa: E402

SWEEP = [PREFILL_TILES, PrefillTiles(64, 64, 4, 2), PrefillTiles(64, 128, 8, 2), PrefillTiles(64, 64, 4, 3),
         PrefillTiles(128, 64, 8, 3), PrefillTiles(128, 64, 8, 2), PrefillTiles(128, 128, 8, 2),
         PrefillTiles(128, 32, 4, 3), PrefillTiles(128, 64, 4, 3)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tiny", action="store_true", help="2 prompts of 24 (the CPU dry run under the interpreter)")
    parser.add_argument("--ahead", action="store_true", help="each tile choice with the block numbers loaded in the "
                        "loop and a tile ahead (attention.PREFILL_TABLE_AHEAD)")
    parser.add_argument("--json", default=None, help="where to write the rows (default $OUT/bench_prefill_attention.json)")
    opts = parser.parse_args()
    cuda = torch.cuda.is_available()
    if not cuda and not opts.tiny:
        sys.exit("bench_prefill_attention needs a CUDA GPU (or --tiny under TRITON_INTERPRET=1)")
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float16)
    num_seqs, prompt = (2, 24) if opts.tiny else (16, 512)
    torch.manual_seed(0)
    (k, v), _, tables = paged_caches(num_seqs, prompt, device, dtype)
    qsl = torch.arange(num_seqs + 1, device=device, dtype=torch.int32) * prompt
    lens = torch.full((num_seqs,), prompt, dtype=torch.int32, device=device)
    q = torch.randn(num_seqs * prompt, HQ, HEAD_DIM, device=device, dtype=dtype)
    flops = 4 * HQ * HEAD_DIM * num_seqs * prompt * (prompt + 1) / 2
    print(f"{torch.cuda.get_device_name() if cuda else 'cpu (interpreter)'}  T={num_seqs * prompt} "
          f"({num_seqs}x{prompt}) Hq {HQ} D {HEAD_DIM}\n| tiles | us a layer | TFLOP/s | err |\n|---|---|---|---|")
    rows, baseline = [], None
    aheads = (False, True) if opts.ahead else (None,)
    for tiles, ahead in [(t, a) for t in SWEEP for a in aheads]:
        label = tiles.label + AHEAD_LABEL[ahead]
        def call(tiles: PrefillTiles = tiles, ahead: bool | None = ahead) -> torch.Tensor:
            return paged_attention_triton(q, k, v, tables, qsl, lens, HEAD_DIM**-0.5, tiles=tiles, table_ahead=ahead)
        try:
            out = call().float()
            us = time_us(call, 2 * k.numel() * k.element_size())
        except Exception as e:  # a config the compiler refuses (shared memory): a row saying so
            print(f"| {label} | failed: {type(e).__name__}: {str(e)[:120]} | | |", flush=True)
            rows.append({"tiles": label, "error": f"{type(e).__name__}: {e}"[:300]})
            continue
        baseline = out if baseline is None else baseline
        err = (out - baseline).abs().max().item()
        rows.append({"tiles": label, "us": round(us, 2), "tflop_s": round(flops / us / 1e6, 1), "err": err})
        print(f"| {label} | {us:.1f} | {flops / us / 1e6:.0f} | {err:.1e} |", flush=True)
    target = opts.json or (os.path.join(os.environ["OUT"], "bench_prefill_attention.json")
                           if os.environ.get("OUT") else None)
    if target:
        Path(target).write_text(json.dumps({"device": torch.cuda.get_device_name() if cuda else "cpu",
                                            "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
