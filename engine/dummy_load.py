"""Random weights in place of a checkpoint (EngineConfig.load_format = "dummy", the worker's --load-format dummy).

Why: the shapes we benchmark are not all on disk. A Llama-3-70B in bfloat16 is 131 GiB, more than a two-GPU
machine's disk holds (issue 17's 70B bench), and every benchmark call on a fresh GPU machine spent ~20 s writing
16 GB of random 8B weights before it could start. vLLM calls this `--load-format dummy`; its users know it.

How: the Hugging Face tensors a checkpoint of this config would hold (`checkpoint_layout`: names and full shapes
from config.json; norm weights 1, everything else normal with std 0.02, as ops/bench.py writes its models) are
made one at a time on the model's device and handed to the same WeightMap as a real checkpoint's tensors: the
layers' own load rules run (q/k/v and gate/up packing, FP8 quantization at load, a tensor-parallel rank's slice)
and the same completeness check closes it. Each tensor is drawn from a generator seeded by its name, so every rank
of a tensor-parallel group draws the same full tensor and keeps its slice of it: the model at TP = N is the model
at TP = 1, cut. Figures from such weights say how fast a shape runs, never how well it answers.
"""

from __future__ import annotations

import time
import zlib
from typing import Any

import torch
from stoker.engine.loader import WeightMap
from stoker.engine.model_config import ModelConfig

STD = 0.02  # ops/bench.py's random models: the same spread, so timings compare


def full_sizes(mc: ModelConfig) -> tuple[int, int, int]:
    """(q heads, KV heads, intermediate size) of the whole model, also where `mc` is one rank's part of it
    (engine/parallel/plan.py's rank_model_config divides them; a replicated KV head counts once)."""
    if mc.shard is None:
        return mc.num_heads, mc.num_kv_heads, mc.intermediate_size
    size, replicas = mc.shard.size, mc.shard.kv_replicas
    return mc.num_heads * size, mc.num_kv_heads * size // replicas, mc.intermediate_size * size


def checkpoint_layout(mc: ModelConfig) -> list[tuple[str, tuple[int, ...], float | None]]:
    """(name, full shape, fill) of every tensor a Hugging Face checkpoint of this model holds, in file order;
    fill None = random normal, else that constant (the RMSNorm weights: 1)."""
    heads, kv_heads, inter = full_sizes(mc)
    hidden, head_dim = mc.hidden_size, mc.head_dim
    layout: list[tuple[str, tuple[int, ...], float | None]] = [
        ("model.embed_tokens.weight", (mc.vocab_size, hidden), None)]
    for i in range(mc.num_layers):
        pre = f"model.layers.{i}."
        layout += [(pre + "input_layernorm.weight", (hidden,), 1.0),
                   (pre + "post_attention_layernorm.weight", (hidden,), 1.0)]
        for proj, rows in (("q", heads * head_dim), ("k", kv_heads * head_dim), ("v", kv_heads * head_dim)):
            layout.append((f"{pre}self_attn.{proj}_proj.weight", (rows, hidden), None))
            if mc.attention_bias:
                layout.append((f"{pre}self_attn.{proj}_proj.bias", (rows,), None))
        layout.append((pre + "self_attn.o_proj.weight", (hidden, heads * head_dim), None))
        if mc.qk_norm:
            layout += [(pre + "self_attn.q_norm.weight", (head_dim,), 1.0),
                       (pre + "self_attn.k_norm.weight", (head_dim,), 1.0)]
        layout += [(pre + "mlp.gate_proj.weight", (inter, hidden), None),
                   (pre + "mlp.up_proj.weight", (inter, hidden), None),
                   (pre + "mlp.down_proj.weight", (hidden, inter), None)]
    layout.append(("model.norm.weight", (hidden,), 1.0))
    if not mc.tie_word_embeddings:
        layout.append(("lm_head.weight", (mc.vocab_size, hidden), None))
    return layout


def dummy_tensor(name: str, shape: tuple[int, ...], fill: float | None, dtype: torch.dtype,
                 device: torch.device | str, seed: int = 0) -> torch.Tensor:
    """The whole tensor `name` as the dummy checkpoint holds it: the same values for the same (name, seed) on
    every call, rank and TP size (and on the CPU and a GPU alike only up to each device's generator)."""
    if fill is not None:
        return torch.full(shape, fill, dtype=dtype, device=device)
    gen = torch.Generator(device=device)
    gen.manual_seed(zlib.crc32(f"{seed}:{name}".encode()))  # 32 bits: the CPU generator keeps no more
    return torch.randn(shape, generator=gen, dtype=dtype, device=device).mul_(STD)


def check_dummy_allowed(mc: ModelConfig) -> None:
    """An FP8 checkpoint's config declares tensors (F8_E4M3 weights, their scales) the dummy checkpoint does not
    make: refuse it rather than load a model its config misdescribes. Quantizing at load (--quantization fp8)
    works on the dummy tensors as on any unquantized checkpoint's."""
    scheme = mc.quantization
    if scheme is not None and not scheme.quantize_at_load:
        raise ValueError(
            "load_format 'dummy' makes an unquantized checkpoint, but this config.json declares an FP8 one "
            f"({scheme.method}, weights per {scheme.weight_strategy}, {scheme.activations} activations): drop its "
            "quantization_config and pass quantization='fp8' (--quantization fp8) for FP8 layers"
        )


def load_dummy_weights(model: torch.nn.Module, mc: ModelConfig, dtype: torch.dtype, device: torch.device,
                       seed: int = 0) -> dict[str, Any]:
    """Fill `model` (built for `mc`, possibly one rank's part) from the dummy checkpoint through the loaders'
    WeightMap; returns the startup report's entries."""
    check_dummy_allowed(mc)
    t0 = time.perf_counter()
    weights = WeightMap(model)
    made = 0
    with torch.no_grad():
        for name, shape, fill in checkpoint_layout(mc):
            dest = weights.destination(name)
            if dest is None:  # a tensor this model does not keep (there is none for the layouts above today)
                continue
            _, module, param, shard = dest
            full = dummy_tensor(name, shape, fill, dtype, device, seed)
            index = module.checkpoint_slice(param, shard)
            part = full if index is None else full[index]
            weights.load(name, part, "the dummy checkpoint")
            made += part.numel() * part.element_size()  # what this rank keeps of it
            del full, part
    weights.check_all_loaded("the dummy checkpoint (load_format dummy)")
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        # The full tensors a rank cut its slices from (up to the embedding's 2.1 GB at 70B) back to the device, so
        # the KV cache, sized from the free memory next, gets it.
        torch.cuda.empty_cache()
    return {"load_format": "dummy", "load_s": time.perf_counter() - t0, "dummy_bytes": made}
