"""Tiny Hugging Face models (random weights, scaled up so logits are peaked) for the engine tests.

Each is built with transformers from a config, saved with save_pretrained (safetensors), and given the
byte-level BPE tokenizer that engine.make_model trains, so tests run the whole path on real files.
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch
from stoker.engine.make_model import write_tokenizer

VOCAB = 384  # make_model's tokenizer fills exactly this many ids at vocab_size=384
COMMON: dict[str, Any] = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    rms_norm_eps=1e-5,
    initializer_range=0.3,
    bos_token_id=0,
    eos_token_id=1,
    tie_word_embeddings=False,
)

# name -> (transformers config class name, overrides)
ARCHS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("LlamaConfig", {}),
    "llama_tied": ("LlamaConfig", {"tie_word_embeddings": True}),
    "llama3_rope": (
        "LlamaConfig",
        {
            "rope_theta": 500000.0,
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32,
            },
        },
    ),
    "mistral": ("MistralConfig", {"sliding_window": None, "head_dim": 16}),
    "qwen2": ("Qwen2Config", {"use_sliding_window": False}),
    "qwen3": ("Qwen3Config", {"head_dim": 24, "use_sliding_window": False}),  # head_dim != hidden/heads
}


def build_hf_model(name: str, out_dir: str, max_shard_size: str | None = None, seed: int = 0,
                   shape: dict[str, Any] | None = None):
    """Build, save (with tokenizer + generation config) and return the transformers model, in eval mode.
    `shape` overrides COMMON's dimensions (e.g. head counts that 3 tensor-parallel ranks divide)."""
    import transformers

    cls_name, overrides = ARCHS[name]
    config = getattr(transformers, cls_name)(**{**COMMON, **overrides, **(shape or {})})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        if name == "qwen2":  # HF zero-inits biases: make them matter
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0, 0.3)
        for norm in [m for n, m in model.named_modules() if n.endswith("norm")]:
            norm.weight.uniform_(0.6, 1.4)  # not all ones: catches a skipped or misplaced norm
    model.generation_config.eos_token_id = None  # greedy references run to max_new_tokens
    model.generation_config.pad_token_id = 1
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(out_dir, **kwargs)
    assert write_tokenizer(out_dir, VOCAB) == VOCAB
    with open(os.path.join(out_dir, "generation_config.json"), "w") as f:
        json.dump({"bos_token_id": 0, "eos_token_id": [1, 5]}, f)  # 5 = <|end|>: a list merged with config's
    return model


@torch.no_grad()
def hf_greedy(model, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    out = model.generate(
        torch.tensor([prompt_ids]),
        attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=1,
    )
    return out[0, len(prompt_ids) :].tolist()


@torch.no_grad()
def hf_logits(model, token_ids: list[int]) -> torch.Tensor:
    """[len, V] float32 logits of a whole sequence (teacher forcing)."""
    return model(torch.tensor([token_ids])).logits[0].float()


def prompts(seed: int, lengths: list[int]) -> list[list[int]]:
    """Random prompts of ordinary (non-special) token ids."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(10, VOCAB, (n,), generator=gen).tolist() for n in lengths]


# FP8 checkpoints (issue 14). Dimensions multiples of 128 so that the block scheme's 128 x 128 tiles divide
# every projection (kv rows = 2 heads x 64); otherwise COMMON's model.
FP8_DIMS: dict[str, Any] = dict(hidden_size=256, intermediate_size=384, num_attention_heads=4, num_key_value_heads=2,
                                 head_dim=64)
FP8_PRESETS = ("FP8", "FP8_DYNAMIC", "FP8_BLOCK")  # compressed-tensors' names: tensor+static, channel+token, block


def build_fp8_checkpoint(model, out_dir: str, preset: str, calibration: list[list[int]]):
    """Quantize a copy of `model` (a float32 build_hf_model model) with the compressed-tensors library's
    preset scheme and save it in the format's layout (FP8 weights, weight_scale, input_scale for the static
    preset; config.json's quantization_config written by the library's ModelCompressor). Weight scales are
    min-max (llm-compressor's default observer); static input scales the min-max of the `calibration` prompts'
    activations. Returns the plain-torch reference: a copy of `model` whose linears hold the dequantized FP8
    weights read back from the saved files. The caller copies the tokenizer files."""
    import copy

    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (
        QuantizationConfig,
        apply_quantization_config,
        preset_name_to_scheme,
    )
    from compressed_tensors.quantization.utils import calculate_qparams
    from safetensors.torch import load_file

    def linears(m: torch.nn.Module) -> dict[str, torch.nn.Linear]:
        return {n: x for n, x in m.named_modules() if isinstance(x, torch.nn.Linear) and n != "lm_head"}

    input_amax: dict[str, float] = {}
    hooks = [
        lin.register_forward_pre_hook(
            lambda _m, args, n=name: input_amax.__setitem__(n, max(input_amax.get(n, 0.0), args[0].abs().max().item()))
        )
        for name, lin in linears(model).items()
    ]
    with torch.no_grad():
        for prompt in calibration:
            model(torch.tensor([prompt]))
    for h in hooks:
        h.remove()
    quantized = copy.deepcopy(model)
    config = QuantizationConfig(config_groups={"group_0": preset_name_to_scheme(preset, ["Linear"])},
                                ignore=["lm_head"])
    apply_quantization_config(quantized, config, show_progress=False)
    with torch.no_grad():
        for name, lin in linears(quantized).items():
            args = lin.quantization_scheme.weights
            w = lin.weight.float()
            if args.strategy == "tensor":
                lo, hi = w.min().reshape(1), w.max().reshape(1)
            elif args.strategy == "channel":
                lo, hi = w.amin(dim=1, keepdim=True), w.amax(dim=1, keepdim=True)
            else:  # block 128 x 128
                tiles = w.reshape(w.shape[0] // 128, 128, w.shape[1] // 128, 128)
                lo, hi = tiles.amin(dim=(1, 3)), tiles.amax(dim=(1, 3))
            lin.weight_scale.data.copy_(calculate_qparams(lo, hi, args)[0].reshape(lin.weight_scale.shape))
            if getattr(lin, "input_scale", None) is not None:
                amax = torch.tensor([input_amax[name]])
                scale = calculate_qparams(-amax, amax, lin.quantization_scheme.input_activations)[0]
                lin.input_scale.data.copy_(scale.reshape(lin.input_scale.shape))
    compressor = ModelCompressor.from_pretrained_model(quantized, "float-quantized")
    compressor.compress_model(quantized)
    quantized.save_pretrained(out_dir)
    compressor.update_config(out_dir)
    saved: dict[str, torch.Tensor] = {}
    for file in os.listdir(out_dir):
        if file.endswith(".safetensors"):
            saved.update(load_file(os.path.join(out_dir, file)))
    reference = copy.deepcopy(model)
    with torch.no_grad():
        for name, lin in linears(reference).items():
            lin.weight.copy_(dequantize_saved(saved[f"{name}.weight"], saved[f"{name}.weight_scale"]))
    return reference


def dequantize_saved(weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """A checkpoint's FP8 weight [N, K] times its weight_scale (tensor [1] or [], channel [N, 1], block
    [N/128, K/128]) in float32: the semantics the engine must reproduce, written independently of it."""
    w, s = weight.float(), scale.float()
    if s.dim() == 2 and tuple(s.shape) != (w.shape[0], 1):  # block: repeat each tile's scale over its tile
        s = s.repeat_interleave(w.shape[0] // s.shape[0], 0).repeat_interleave(w.shape[1] // s.shape[1], 1)
    return w * s  # [N, 1] and [1] / [] broadcast
