"""What FP8 costs in quality, on a trained model: the demo model (engine/train_demo.py) against its float32 self.

    PYTHONPATH=. python ops/fp8_quality.py [--windows 1000] [--window-len 64] [--json out.json]

The model is the cached demo model (trained once per machine on the stdlib's docstrings; trained now, ~3 min
on 2 cores, if not cached). The text is its held-out docstrings (whole files it never saw), cut into windows of
--window-len tokens (the length it was trained on). Each window is run through the engine's own model, KV cache
and attention (one prefill: keys and values are written to the paged cache and read back from it), on the CPU
in float32, for each variant:

  fp8-weights        quantization="fp8": linears quantized at load (per output row; lm_head stays float32)
  fp8-kv             kv_cache_dtype="fp8" with the scales the engine uses for this checkpoint (no
                     kv_cache_scheme: 1.0, as vLLM does)
  fp8-kv-calibrated  kv_cache_dtype="fp8" with per-layer scales amax/448 measured on training windows (what a
                     kv_cache_scheme checkpoint would ship): shows what the 1.0 rule leaves on the table
  fp8-both           FP8 weights and the FP8 KV cache (scales 1.0)

and compared at every position with the float32 original: top-1 agreement (the variant's argmax is the
original's) and mean next-token KL(original || variant) in nats; the held-out loss (cross-entropy of the
true next token) of each is printed beside them. These are the CPU reference paths: they measure the
quantization error of the formats, not kernel speed (and not the GPU kernels' own rounding).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from stoker.engine.batch import AttentionMetadata  # noqa: E402
from stoker.engine.config import EngineConfig  # noqa: E402
from stoker.engine.engine import LLMEngine  # noqa: E402
from stoker.engine.kernels.kv_quant import FP8_E4M3_MAX  # noqa: E402
from stoker.engine.train_demo import TrainConfig, corpus, ensure_demo_model, token_stream  # noqa: E402


@dataclass(frozen=True, slots=True)
class Variant:
    name: str
    quantization: str | None
    kv_cache_dtype: str
    calibrated_kv_scales: bool = False


VARIANTS = (
    Variant("float32 (original)", None, "auto"),
    Variant("fp8-weights", "fp8", "auto"),
    Variant("fp8-kv", None, "fp8"),
    Variant("fp8-kv-calibrated", None, "fp8", calibrated_kv_scales=True),
    Variant("fp8-both", "fp8", "fp8"),
)


def windows(path: str, texts: list[str], count: int, length: int) -> torch.Tensor:
    """[count, length] token ids: consecutive non-overlapping windows of the texts' token stream."""
    from tokenizers import Tokenizer

    stream = token_stream(Tokenizer.from_file(os.path.join(path, "tokenizer.json")), texts)
    count = min(count, len(stream) // length)
    if count < 1:
        raise ValueError(f"the text has {len(stream)} tokens: fewer than one window of {length}")
    return stream[: count * length].view(count, length)


def build(path: str, variant: Variant, num_tokens: int, block_size: int) -> LLMEngine:
    return LLMEngine(EngineConfig(model_path=path, device="cpu", dtype="float32", block_size=block_size,
                                  num_kv_blocks=num_tokens // block_size, enable_prefix_caching=False,
                                  quantization=variant.quantization, kv_cache_dtype=variant.kv_cache_dtype))


@torch.no_grad()
def prefill_logits(engine: LLMEngine, batch: torch.Tensor, block_size: int) -> torch.Tensor:
    """[B, L] windows -> [B, L, vocab] float32 logits, all windows in one step of the engine's own model: window
    b is sequence b, its blocks b*L/block_size.., its keys and values written to the cache and read back."""
    num_seqs, length = batch.shape
    blocks_per_seq = length // block_size
    meta = AttentionMetadata(
        slot_mapping=torch.arange(num_seqs * length, dtype=torch.int64),
        block_tables=torch.arange(num_seqs * blocks_per_seq, dtype=torch.int32).view(num_seqs, blocks_per_seq),
        query_start_loc=torch.arange(num_seqs + 1, dtype=torch.int32) * length,
        context_lens=torch.full((num_seqs,), length, dtype=torch.int32),
        decode_only=False,
    )
    positions = torch.arange(length, dtype=torch.int64).repeat(num_seqs)
    model = engine.runner.model
    hidden = model(batch.flatten(), positions, meta, engine.runner.kv_caches)
    return model.compute_logits(hidden).view(num_seqs, length, -1).float()


def calibrate_kv_scales(path: str, batch: torch.Tensor, block_size: int) -> list[tuple[float, float]]:
    """Per layer (k_scale, v_scale) = amax / 448 of the keys and values the float32 model caches on `batch`
    (training text, not the held-out windows): the static per-tensor scales a kv_cache_scheme carries."""
    engine = build(path, VARIANTS[0], batch.numel(), block_size)
    prefill_logits(engine, batch, block_size)
    return [(k.abs().max().item() / FP8_E4M3_MAX, v.abs().max().item() / FP8_E4M3_MAX)
            for k, v in engine.runner.kv_caches]


def compare(reference: torch.Tensor, logits: torch.Tensor, targets: torch.Tensor) -> dict[str, float]:
    """Top-1 agreement and mean KL(reference || variant) over every position; the variant's held-out loss."""
    ref_logp, logp = reference.log_softmax(-1), logits.log_softmax(-1)
    kl = (ref_logp.exp() * (ref_logp - logp)).sum(-1)
    return {
        "top1_agreement": (reference.argmax(-1) == logits.argmax(-1)).float().mean().item(),
        "mean_kl_nats": kl.mean().item(),
        "held_out_loss": F.cross_entropy(logits[:, :-1].flatten(0, 1), targets.flatten()).item(),
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    torch.manual_seed(0)
    path = ensure_demo_model()
    train_texts, held_out_texts = corpus()
    batch = windows(path, held_out_texts, args.windows, args.window_len)
    calibration = windows(path, train_texts[: 4 * args.windows], args.windows, args.window_len)
    targets = batch[:, 1:]
    results: dict[str, dict[str, float]] = {}
    reference = None
    for variant in VARIANTS:
        engine = build(path, variant, batch.numel(), args.block_size)
        if variant.calibrated_kv_scales:
            for layer, (k_scale, v_scale) in zip(engine.runner.model.model.layers,
                                                 calibrate_kv_scales(path, calibration, args.block_size), strict=True):
                layer.self_attn.attn.k_scale.fill_(k_scale)
                layer.self_attn.attn.v_scale.fill_(v_scale)
        logits = prefill_logits(engine, batch, args.block_size)
        reference = logits if reference is None else reference
        results[variant.name] = compare(reference, logits, targets)
    return {"model": path, "windows": batch.shape[0], "window_len": batch.shape[1],
            "positions": batch.numel(), "results": results}


def table(report: dict[str, Any]) -> str:
    lines = [f"{'variant':<22} {'top-1 agreement':>16} {'mean KL (nats)':>15} {'held-out loss':>14}"]
    for name, r in report["results"].items():
        lines.append(f"{name:<22} {100 * r['top1_agreement']:>15.2f}% {r['mean_kl_nats']:>15.2e} "
                     f"{r['held_out_loss']:>14.4f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--windows", type=int, default=1000,
                        help="held-out windows at most (default %(default)s: all the held-out text has)")
    parser.add_argument("--window-len", type=int, default=TrainConfig().seq_len,
                        help="tokens per window (default: the training length, %(default)s)")
    parser.add_argument("--block-size", type=int, default=16, help="KV block size (default %(default)s)")
    parser.add_argument("--json", help="also write the report here")
    args = parser.parse_args(argv)
    if args.window_len % args.block_size:
        parser.error(f"--window-len {args.window_len} must be a multiple of --block-size {args.block_size}")
    started = time.perf_counter()
    report = run(args)
    report["seconds"] = round(time.perf_counter() - started, 1)
    print(f"model {report['model']}: {report['windows']} held-out windows x {report['window_len']} tokens = "
          f"{report['positions']} positions, CPU float32 reference paths, {report['seconds']} s")
    print(table(report))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
