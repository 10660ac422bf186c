#!/usr/bin/env python
"""Probes the FP8 rotary GEMV with Qwen3's per-head q/k norm and int32-word weights ("asm-join", "bits-join") on
the GPU, the refusal in gemv_rotary_cache_triton lifted (gemv.REFUSE_WORDS_WITH_QK_NORM): at 15:50 UTC the
asm-join case gave NaN in the q and k heads at M = 1, head_dim 40 (tests/test_kernels_gemv_fp8.py). Prints one
row per case: NaN count, the relative error against gemv_rotary_cache_ref on the dequantized weights, and
whether it is within the GPU test's bound. From the repo root (CUDA, ~20 s; $OUT/probe_qk_norm_words.json):

    PYTHONPATH=. python3 ops/probe_qk_norm_words.py
    TRITON_INTERPRET=1 PYTHONPATH=. python3 ops/probe_qk_norm_words.py --dry-run     # CPU: bits-join only
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a bare checkout too

from stoker.engine.kernels import gemv as gemv_mod  # noqa: E402
from stoker.engine.kernels import rope_cos_sin  # noqa: E402
from stoker.engine.kernels.fp8_linear import quantize_rows  # noqa: E402
from stoker.engine.kernels.gemv import gemv_rotary_cache_ref, gemv_rotary_cache_triton  # noqa: E402

K = 136  # the GPU test's: a masked K tail
BOUND = 2e-2  # bf16 rounding through the norm and rotation is ~4e-3; a NaN or a wrong head is O(1)


def case(head_dim: int, num_rows: int, convert: str, device: str, dtype: torch.dtype) -> dict[str, Any]:
    """One launch against the reference: 4 q heads, 2 kv heads, bias, q/k norm, a padding slot when M > 1."""
    hq, hkv, block_size, num_blocks = 4, 2, 8, 3
    n_total = (hq + 2 * hkv) * head_dim
    rows = torch.randn(n_total, K) * K**-0.5 * torch.logspace(-1, 1, n_total)[torch.randperm(n_total)][:, None]
    w8, scale = (t.to(device) for t in quantize_rows(rows))
    x = (torch.randn(num_rows, K) * 2).to(device, dtype)
    slots = torch.randperm(num_blocks * block_size, device=device)[:num_rows]
    if num_rows > 1:
        slots[1] = -1
    common: dict[str, Any] = {
        "num_heads": hq, "num_kv_heads": hkv, "slot_mapping": slots, "eps": 1e-6,
        "cos_sin": rope_cos_sin(head_dim, 256, 10000.0, None, device=device),
        "positions": torch.randint(1, 256, (num_rows,), device=device),
        "norm_weight": (torch.randn(K) + 1).to(device, dtype),
        "q_norm": (torch.randn(head_dim) * 0.25 + 1).to(device, dtype),
        "k_norm": (torch.randn(head_dim) * 0.25 + 1).to(device, dtype),
    }
    bias = torch.randn(n_total).to(device, dtype)
    caches = [torch.randn(num_blocks, block_size, hkv, head_dim).to(device, dtype) for _ in range(2)]
    kv_out = [c.clone() for c in caches]
    kv_ref = [c.clone() for c in caches]
    out, _ = gemv_rotary_cache_triton(x, w8, bias, k_cache=kv_out[0], v_cache=kv_out[1], weight_scale=scale,
                                      weight_convert=convert, **common)
    ref, _ = gemv_rotary_cache_ref(x, w8, bias, k_cache=kv_ref[0], v_cache=kv_ref[1], weight_scale=scale, **common)
    nan_rows = torch.isnan(out.float()).any(dim=0).nonzero().flatten()
    err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
    return {"head_dim": head_dim, "m": num_rows, "convert": convert, "nan": int(torch.isnan(out).sum()),
            "first_nan_column": int(nan_rows[0]) if len(nan_rows) else None, "rel_err": err,
            "ok": bool(err < BOUND)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dry-run", action="store_true", help="CPU under TRITON_INTERPRET=1 (no PTX: bits-join)")
    opts = parser.parse_args()
    if opts.dry_run:
        device, dtype, converts = "cpu", torch.float16, ["bits-join"]
        sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
        import kernel_harness  # noqa: F401  (its numpy patch for triton 3.6's interpreter)
    else:
        if not torch.cuda.is_available():
            sys.exit("probe_qk_norm_words needs a CUDA GPU (or --dry-run under TRITON_INTERPRET=1)")
        device, dtype, converts = "cuda", torch.bfloat16, ["asm-join", "bits-join"]  # the cast passed at 15:57
    gemv_mod.REFUSE_WORDS_WITH_QK_NORM = False
    torch.manual_seed(0)
    rows = []
    print("| head_dim | M | convert | NaN | first NaN column | rel err | ok |\n|---|---|---|---|---|---|---|")
    for head_dim in (40, 128):
        for num_rows in (1, 5):
            for convert in converts:
                try:
                    row = case(head_dim, num_rows, convert, device, dtype)
                except Exception as e:  # report and go on: the other cases still say something
                    print(f"| {head_dim} | {num_rows} | {convert} | {type(e).__name__}: {str(e)[:160]} |")
                    continue
                rows.append(row)
                print(f"| {head_dim} | {num_rows} | {convert} | {row['nan']} | {row['first_nan_column']} | "
                      f"{row['rel_err']:.2e} | {row['ok']} |", flush=True)
    if os.environ.get("OUT"):
        (Path(os.environ["OUT"]) / "probe_qk_norm_words.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
