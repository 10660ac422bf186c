"""Llama-family decoder (Llama 2/3/3.x, Mistral, Qwen2 with q/k/v bias, Qwen3 with per-head q/k norm).

q/k/v are one fused matmul and gate/up another (fused at load, see `weight_destination`). The forward is
over a flat batch of tokens (prefill chunks and decodes mixed) and has no Python loop over tokens or
sequences and no host sync, so a CUDA graph can capture it. Only the kernel dispatchers of
`engine.kernels` touch the KV cache.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from engine import kernels
from engine.loader import ModelConfig

if TYPE_CHECKING:
    from engine.model_runner import AttentionMetadata


def _param(*shape: int, dtype: torch.dtype) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size, self.kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.eps, self.scale = cfg.rms_norm_eps, cfg.head_dim**-0.5
        self.input_layernorm = _param(cfg.hidden_size, dtype=dtype)
        self.qkv_proj = _param(self.q_size + 2 * self.kv_size, cfg.hidden_size, dtype=dtype)
        self.qkv_bias = _param(self.q_size + 2 * self.kv_size, dtype=dtype) if cfg.attention_bias else None
        self.q_norm = _param(cfg.head_dim, dtype=dtype) if cfg.qk_norm else None
        self.k_norm = _param(cfg.head_dim, dtype=dtype) if cfg.qk_norm else None
        self.o_proj = _param(cfg.hidden_size, self.q_size, dtype=dtype)
        self.post_attention_layernorm = _param(cfg.hidden_size, dtype=dtype)
        self.gate_up_proj = _param(2 * cfg.intermediate_size, cfg.hidden_size, dtype=dtype)
        self.down_proj = _param(cfg.hidden_size, cfg.intermediate_size, dtype=dtype)

    def forward(
        self,
        hidden: torch.Tensor,  # [T, H]
        residual: torch.Tensor | None,  # [T, H]; None in the first layer
        positions: torch.Tensor,  # [T] int64
        meta: AttentionMetadata,
        k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
        v_cache: torch.Tensor,
        cos_sin: torch.Tensor,  # [max_position, D] float32
    ) -> tuple[torch.Tensor, torch.Tensor]:
        num_tokens = hidden.shape[0]
        x, residual = kernels.rms_norm(hidden, self.input_layernorm, self.eps, residual)
        qkv = F.linear(x, self.qkv_proj, self.qkv_bias)  # [T, (Hq + 2 Hkv) D]
        # Views into qkv (row stride != H*D): the rotary kernel rotates them in place.
        q = qkv[:, : self.q_size].view(num_tokens, self.num_heads, self.head_dim)
        k = qkv[:, self.q_size : self.q_size + self.kv_size].view(
            num_tokens, self.num_kv_heads, self.head_dim
        )
        v = qkv[:, self.q_size + self.kv_size :].view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:  # Qwen3: RMSNorm over each head's vector
            q = kernels.rms_norm(q.reshape(-1, self.head_dim), self.q_norm, self.eps)[0].view_as(q)
            k = kernels.rms_norm(k.reshape(-1, self.head_dim), self.k_norm, self.eps)[0].view_as(k)
        kernels.rotary_and_cache(q, k, v, positions, cos_sin, k_cache, v_cache, meta.slot_mapping)
        if meta.decode_only:  # one query per sequence: the split-K decode kernel
            attn = kernels.paged_decode_attention(
                q, k_cache, v_cache, meta.block_tables, meta.context_lens, self.scale
            )
        else:
            attn = kernels.paged_attention(
                q, k_cache, v_cache, meta.block_tables, meta.query_start_loc, meta.context_lens, self.scale
            )
        hidden = F.linear(attn.reshape(num_tokens, self.q_size), self.o_proj)
        x, residual = kernels.rms_norm(hidden, self.post_attention_layernorm, self.eps, residual)
        hidden = F.linear(kernels.silu_and_mul(F.linear(x, self.gate_up_proj)), self.down_proj)
        return hidden, residual


# Checkpoint name -> (our parameter, shard of a fused parameter) for the per-layer tensors.
_LAYER_MAP = {
    "input_layernorm.weight": ("input_layernorm", ""),
    "self_attn.q_proj.weight": ("qkv_proj", "q"),
    "self_attn.k_proj.weight": ("qkv_proj", "k"),
    "self_attn.v_proj.weight": ("qkv_proj", "v"),
    "self_attn.q_proj.bias": ("qkv_bias", "q"),
    "self_attn.k_proj.bias": ("qkv_bias", "k"),
    "self_attn.v_proj.bias": ("qkv_bias", "v"),
    "self_attn.q_norm.weight": ("q_norm", ""),
    "self_attn.k_norm.weight": ("k_norm", ""),
    "self_attn.o_proj.weight": ("o_proj", ""),
    "post_attention_layernorm.weight": ("post_attention_layernorm", ""),
    "mlp.gate_proj.weight": ("gate_up_proj", "gate"),
    "mlp.up_proj.weight": ("gate_up_proj", "up"),
    "mlp.down_proj.weight": ("down_proj", ""),
}
_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.(.+)$")


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, max_position: int):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = _param(cfg.vocab_size, cfg.hidden_size, dtype=dtype)
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg, dtype) for _ in range(cfg.num_layers))
        self.norm = _param(cfg.hidden_size, dtype=dtype)
        self.lm_head = (
            self.embed_tokens
            if cfg.tie_word_embeddings
            else _param(cfg.vocab_size, cfg.hidden_size, dtype=dtype)
        )
        self.register_buffer(
            "cos_sin",
            kernels.rope_cos_sin(cfg.head_dim, max_position, cfg.rope_theta, cfg.rope_scaling),
            persistent=False,
        )
        # Rows of the fused parameters: q | k | v and gate | up.
        q, kv, inter = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.intermediate_size
        self._rows = {
            "q": slice(0, q),
            "k": slice(q, q + kv),
            "v": slice(q + kv, q + 2 * kv),
            "gate": slice(0, inter),
            "up": slice(inter, 2 * inter),
        }

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
    ) -> torch.Tensor:
        """input_ids, positions: [T] -> final hidden states [T, H] (normed)."""
        hidden = F.embedding(input_ids, self.embed_tokens)
        residual: torch.Tensor | None = None
        for layer, (k_cache, v_cache) in zip(self.layers, kv_caches, strict=True):
            hidden, residual = layer(hidden, residual, positions, meta, k_cache, v_cache, self.cos_sin)
        return kernels.rms_norm(hidden, self.norm, self.cfg.rms_norm_eps, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, H] (only the rows we sample) -> [N, vocab] float32."""
        return F.linear(hidden, self.lm_head).float()

    # Loading (engine.loader.load_weights drives these).
    def weight_destination(self, name: str) -> tuple[str, str, slice | None] | None:
        if name == "model.embed_tokens.weight":
            return "embed_tokens", "", None
        if name == "model.norm.weight":
            return "norm", "", None
        if name == "lm_head.weight":
            return None if self.cfg.tie_word_embeddings else ("lm_head", "", None)
        m = _LAYER_RE.match(name)
        if m is None or m.group(2) not in _LAYER_MAP or int(m.group(1)) >= self.cfg.num_layers:
            return None  # e.g. rotary_emb.inv_freq: recomputed, not loaded
        param, shard = _LAYER_MAP[m.group(2)]
        if getattr(self.layers[int(m.group(1))], param) is None:
            return None  # e.g. a zero bias saved for a model we run without one
        return f"layers.{m.group(1)}.{param}", shard, self._rows[shard] if shard else None

    def expected_shards(self) -> set[tuple[str, str]]:
        out = set()
        for name, _ in self.named_parameters():
            param = name.rsplit(".", 1)[-1]
            if param == "qkv_proj" or param == "qkv_bias":
                out |= {(name, s) for s in ("q", "k", "v")}
            elif param == "gate_up_proj":
                out |= {(name, s) for s in ("gate", "up")}
            else:
                out.add((name, ""))
        return out
