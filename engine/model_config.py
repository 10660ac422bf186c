"""A model folder's config.json (and generation_config.json), normalised; and the one architecture registry.

Pure Python, no torch: reading a config (the engine's limits, the KV budget) needs no model code.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from stoker.engine.quant_config import Fp8Scheme, parse_quantization

if TYPE_CHECKING:
    from stoker.engine.parallel.plan import ShardPlan

# The architecture registry: config.json's `architectures` name -> the model class, by import path (resolved
# by engine.models.model_class), so that this module stays free of torch. A new architecture is a line here,
# its config normalisation below (when it differs) and its model file under engine/models/.
ARCHITECTURES: dict[str, str] = {
    "LlamaForCausalLM": "stoker.engine.models.llama:LlamaForCausalLM",
    "MistralForCausalLM": "stoker.engine.models.llama:LlamaForCausalLM",
    "Qwen2ForCausalLM": "stoker.engine.models.llama:LlamaForCausalLM",
    "Qwen3ForCausalLM": "stoker.engine.models.llama:LlamaForCausalLM",
}
SUPPORTED_ARCHITECTURES = tuple(ARCHITECTURES)


def read_json(path: str) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from e
    if not isinstance(data, dict):
        raise ValueError(f"{path} must hold a JSON object")
    return data


def _as_id_list(value: Any) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, list) else [int(value)]


@dataclass(slots=True)
class ModelConfig:
    """The parts of config.json the model needs, normalised across Llama/Mistral/Qwen2/Qwen3."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None  # HF rope_scaling / rope_parameters when not "default"
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # q/k/v biases (Qwen2)
    qk_norm: bool  # per-head RMSNorm of q and k before rotary (Qwen3)
    eos_token_ids: list[int]  # from config.json and generation_config.json, merged
    bos_token_id: int | None
    sliding_window: int | None  # not implemented: the engine caps max_model_len to it instead
    quantization: Fp8Scheme | None = None  # the checkpoint's FP8 scheme, or --quantization fp8's; None = plain
    # Tensor parallelism: this rank's part (the counts above are then per rank); None = the whole model here.
    shard: ShardPlan | None = None

    @classmethod
    def from_folder(cls, path: str, quantization: str | None = None) -> ModelConfig:
        """quantization: EngineConfig.quantization ("fp8": quantize an unquantized checkpoint at load)."""
        cfg_path = os.path.join(path, "config.json")
        if not os.path.isfile(cfg_path):
            raise FileNotFoundError(f"model folder {path!r} has no config.json")
        cfg = read_json(cfg_path)
        archs = cfg.get("architectures") or []
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise ValueError(
                f"unsupported architecture {archs or cfg.get('model_type')!r} in {cfg_path}; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        missing = [
            k
            for k in (
                "vocab_size",
                "hidden_size",
                "intermediate_size",
                "num_hidden_layers",
                "num_attention_heads",
            )
            if k not in cfg
        ]
        if missing:
            raise ValueError(f"{cfg_path} lacks required keys: {', '.join(missing)}")
        sizes = {k: cfg[k] for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                                     "num_attention_heads")}
        sizes |= {k: cfg[k] for k in ("num_key_value_heads", "head_dim") if cfg.get(k) is not None}
        bad = [f"{k}={v!r}" for k, v in sizes.items() if isinstance(v, bool) or not isinstance(v, int) or v < 1]
        if bad:
            raise ValueError(f"{cfg_path}: sizes must be positive integers, got {', '.join(bad)}")
        num_heads = int(cfg["num_attention_heads"])
        num_kv_heads = int(cfg.get("num_key_value_heads") or num_heads)
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // num_heads
        # transformers 5.x folds rope_theta and rope_scaling into rope_parameters.
        rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or None
        rope_theta = float(cfg.get("rope_theta") or (rope or {}).get("rope_theta") or 10000.0)
        rope_type = (rope or {}).get("rope_type", (rope or {}).get("type", "default"))
        rope_scaling = None if rope is None or rope_type == "default" else {**rope, "rope_type": rope_type}
        eos = _as_id_list(cfg.get("eos_token_id"))
        gen_path = os.path.join(path, "generation_config.json")
        if os.path.isfile(gen_path):
            eos += [e for e in _as_id_list(read_json(gen_path).get("eos_token_id")) if e not in eos]
        if arch != "Qwen2ForCausalLM" and cfg.get("attention_bias"):
            raise ValueError(f"{cfg_path}: attention_bias is not supported for {arch}")
        if cfg.get("mlp_bias"):  # every MLP kernel (the GEMMs, the fused decode GEMVs and MLP) has no bias
            raise ValueError(f"{cfg_path}: mlp_bias is not supported (gate/up/down projections without bias only)")
        act = cfg.get("hidden_act", "silu")  # the MLP is SiLU-gated in every path: another activation would run as SiLU
        if act not in ("silu", "swish"):
            raise ValueError(f"{cfg_path}: hidden_act {act!r} is not supported (the gated MLP runs silu only)")
        if num_heads % num_kv_heads:  # grouped-query attention: each kv head serves a whole group of q heads
            raise ValueError(f"{cfg_path}: num_attention_heads ({num_heads}) is not a multiple of "
                             f"num_key_value_heads ({num_kv_heads})")
        sliding = cfg.get("sliding_window")
        if arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM") and not cfg.get("use_sliding_window", False):
            sliding = None
        return cls(
            architecture=arch,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=int(cfg["hidden_size"]),
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=int(head_dim),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=arch == "Qwen2ForCausalLM",
            qk_norm=arch == "Qwen3ForCausalLM",
            eos_token_ids=eos,
            bos_token_id=cfg.get("bos_token_id"),
            sliding_window=int(sliding) if sliding else None,
            quantization=parse_quantization(cfg, cfg_path, quantization),
        )
