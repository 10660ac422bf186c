#!/usr/bin/env python
"""W2's two step kinds kernel by kernel, each category beside its floor (issue 14): reads the JSON that
ops/step_profile.py writes (w2_step_profile.json: every op and kernel with its input shapes) and prints, for
the 8,192-token prefill step and the batch-1,024 decode step, device ms per category, the floor of the work
that category must do, and the ratio.

    python3 ops/fp8_account.py RESULTS/w2_step_profile.json [--fp8-tflops 1300 --bf16-tflops 800 --tbps 4.26]

Floors: GEMMs by their shapes (aten::_scaled_mm at the FP8 rate, aten::mm / addmm at bf16's; the rates are
h200-gemm-facts.md's at these shapes unless given); the prefill attention by its causal FLOPs at the bf16 rate;
everything else by the bytes it must move at the copy bandwidth (activations in bf16, FP8 outputs and the FP8
cache at 1 byte), from the model's shape: the quantization kernels (norm or SiLU-mul fused in where the engine
fuses them), RMSNorm with its residual, rotary + the cache write, the decode attention's K/V bytes.
"""
from __future__ import annotations

import argparse
import ast
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a bare checkout too

from stoker.ops.step_trace import kernel_category  # noqa: E402

SHAPE_8B = {"hidden": 4096, "layers": 32, "hq": 32, "hkv": 8, "head_dim": 128, "inter": 14336}


def category(name: str) -> str:
    """step_trace's categories, with the FP8 activation quantization (fp8_quant.py) apart."""
    return "fp8 activation quant" if "quant_fp8" in name else kernel_category(name)


def gemm_flops(rows: list[dict[str, Any]]) -> dict[str, tuple[float, float]]:
    """{"fp8" | "bf16": (device ms, FLOPs)} from the GEMM ops' shapes (each op's device time, children in)."""
    out = {"fp8": [0.0, 0.0], "bf16": [0.0, 0.0]}
    for r in rows:
        kind = "fp8" if r["name"] == "aten::_scaled_mm" else "bf16" if r["name"] in ("aten::mm", "aten::addmm") else None
        if kind is None:
            continue
        shapes = ast.literal_eval(r["shapes"])
        a, b = shapes[1:3] if r["name"] == "aten::addmm" else shapes[:2]
        out[kind][0] += r["total_us"] / 1e3
        out[kind][1] += 2.0 * a[0] * a[1] * b[1] * r["count"]
    return {k: (v[0], v[1]) for k, v in out.items()}


def byte_floors(tokens: int, shape: dict[str, int], decode_ctx_sum: int, kv_bytes: int) -> dict[str, float]:
    """Bytes each memory-bound category must move in one step of `tokens` tokens."""
    h, i, n = shape["hidden"], shape["inter"], shape["layers"]
    qkv_cols, kv_cols = (shape["hq"] + 2 * shape["hkv"]) * shape["head_dim"], 2 * shape["hkv"] * shape["head_dim"]
    return {
        # qkv, o and gate_up inputs: bf16 in, FP8 out (+ a float32 scale a row); down's: SiLU-mul fused in
        "fp8 activation quant": n * tokens * (3 * (2 * h + h) + (4 * i + i)),
        "rmsnorm": (2 * n + 1) * tokens * h * 2 * 4,  # x and the residual in, the sum and the normed out
        "rotary + cache": n * tokens * (qkv_cols * 2 + (qkv_cols - kv_cols // 2) * 2 + kv_cols * kv_bytes),
        "silu-mul": n * tokens * i * 2 * 3,  # only where it is not fused into the quantization
        "decode attention": n * decode_ctx_sum * kv_cols * kv_bytes,
    }


def account(res: dict[str, Any], step: str, rates: dict[str, float], prompt: int, kv_bytes: int) -> list[str]:
    rows = res[f"{step}_ops"]
    shape = SHAPE_8B
    tokens = res["prefill_tokens"] if step == "prefill" else res["decode_batch"]
    by_cat: dict[str, float] = {}
    for r in rows:
        if r["kernel"]:
            by_cat[category(r["name"])] = by_cat.get(category(r["name"]), 0.0) + r["self_us"] / 1e3
    total = sum(by_cat.values())
    gem = gemm_flops(rows)
    floors: dict[str, float] = {k: b / rates["bw"] * 1e3 for k, b in
                                byte_floors(tokens, shape, res.get("decode_context_sum", 0), kv_bytes).items()}
    if step == "prefill":  # causal pairs of whole prompts of `prompt` tokens, QK^T and PV
        pairs = tokens // prompt * prompt * (prompt + 1) / 2
        floors["prefill attention"] = 4 * shape["hq"] * shape["head_dim"] * pairs * shape["layers"] / rates["bf16"] * 1e3
    floors["gemm"] = (gem["fp8"][1] / rates["fp8"] + gem["bf16"][1] / rates["bf16"]) * 1e3
    lines = [f"| {step} step ({tokens} tokens) | device ms | % | floor ms | x floor |", "|---|---|---|---|---|"]
    for cat, ms in sorted(by_cat.items(), key=lambda kv: -kv[1]):
        floor = floors.get(cat)
        ratio = f"{ms / floor:.2f}" if floor else ""
        lines.append(f"| {cat} | {ms:.2f} | {100 * ms / max(total, 1e-9):.1f} | "
                     f"{'' if floor is None else f'{floor:.2f}'} | {ratio} |")
    lines.append(f"| all kernels | {total:.2f} | | {sum(floors.get(c, 0.0) for c in by_cat):.2f} | |")
    for kind in ("fp8", "bf16"):
        ms, flops = gem[kind]
        if ms:
            lines.append(f"| of the GEMMs: {kind} ops (device ms with children; {flops / 1e12:.1f} TFLOP) | {ms:.2f} | "
                         f"| {flops / rates[kind] * 1e3:.2f} | {flops / ms / 1e9:.0f} TFLOP/s |")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("profile_json")
    ap.add_argument("--fp8-tflops", type=float, default=1300.0)
    ap.add_argument("--bf16-tflops", type=float, default=800.0)
    ap.add_argument("--tbps", type=float, default=4.26, help="copy bandwidth, TB/s")
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--kv-bytes", type=int, default=1, help="1: the FP8 cache, 2: bf16")
    args = ap.parse_args()
    res = json.loads(Path(args.profile_json).read_text())
    rates = {"fp8": args.fp8_tflops * 1e12, "bf16": args.bf16_tflops * 1e12, "bw": args.tbps * 1e12}
    for step in ("prefill", "decode"):
        if f"{step}_ops" in res:
            print("\n".join(account(res, step, rates, args.prompt, args.kv_bytes)) + "\n")


if __name__ == "__main__":
    main()
