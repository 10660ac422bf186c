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


def build_hf_model(name: str, out_dir: str, max_shard_size: str | None = None, seed: int = 0):
    """Build, save (with tokenizer + generation config) and return the transformers model, in eval mode."""
    import transformers

    cls_name, overrides = ARCHS[name]
    config = getattr(transformers, cls_name)(**{**COMMON, **overrides})
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
