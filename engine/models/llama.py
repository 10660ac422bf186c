"""Llama-family decoder (Llama 2/3/3.x, Mistral, Qwen2 with q/k/v bias, Qwen3 with per-head q/k norm).

Built from engine.layers: the modules own the parameters and how checkpoint tensors fill them; this file
wires them and names them as the checkpoints do (`model.layers.N.self_attn.qkv_proj`), so the loader maps
a checkpoint name to its module by path, with `packed_modules` folding q/k/v and gate/up into the fused
linears. The forward is over a flat batch of tokens (prefill chunks and decodes mixed) and has no Python
loop over tokens or sequences and no host sync, so a CUDA graph can capture it.
"""

from __future__ import annotations

from typing import Any, cast

import torch
from stoker.engine.batch import AttentionMetadata
from stoker.engine.layers import (
    GateUpLinear,
    Linear,
    LMHead,
    PagedAttention,
    QKVLinear,
    RMSNorm,
    RotaryEmbedding,
    VocabEmbedding,
    make_linear,
)
from stoker.engine.model_config import ModelConfig
from stoker.engine.models.base import CausalLM
from stoker.engine.models.fused_decode import (
    FusedDecode,
    bind_fused_decode,
    decode_report,
    fused_decode_layer,
    link_norm_carry,
    takes_fused_decode,
)
from stoker.engine.models.nano_batches import NanoBatchPlan, nano_batch_layers, takes_nano_batches
from torch import nn


class LlamaAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, rotary: RotaryEmbedding, prefix: str):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        # make_linear: the plain linear, its FP8 twin (engine/layers/fp8.py), or the tensor-parallel twin of
        # either (engine/layers/tensor_parallel.py, fp8.py; cfg then holds this rank's head counts and
        # intermediate size).
        quant = cfg.quantization
        self.qkv_proj = make_linear(
            QKVLinear, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, bias=cfg.attention_bias,
            dtype=dtype, quant=quant, names=[f"{prefix}.{p}" for p in ("q_proj", "k_proj", "v_proj")], tp=cfg.shard,
        )
        self.q_size, self.kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.o_proj = make_linear(Linear, self.q_size, cfg.hidden_size, dtype=dtype, quant=quant,
                                  names=[f"{prefix}.o_proj"], tp=cfg.shard)
        # Qwen3: RMSNorm over each head's vector of q and k, before rotary.
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, dtype=dtype) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, dtype=dtype) if cfg.qk_norm else None
        self.rotary = rotary
        kv_scheme = quant is not None and quant.kv_cache_scheme is not None  # then k_scale/v_scale must load
        self.attn = PagedAttention(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.head_dim**-0.5, kv_scheme)

    def forward(
        self,
        x: torch.Tensor,  # [T, H], normed
        positions: torch.Tensor,  # [T] int64
        meta: AttentionMetadata,
        k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
        v_cache: torch.Tensor,
    ) -> torch.Tensor:
        q = self.project(x, positions, meta, k_cache, v_cache)
        return self.o_proj(self.attn(q, k_cache, v_cache, meta).reshape(x.shape[0], self.q_size))

    def project_after_norm(
        self, hidden: torch.Tensor, residual: torch.Tensor | None, norm: RMSNorm, positions: torch.Tensor,
        meta: AttentionMetadata, k_cache: torch.Tensor, v_cache: torch.Tensor, q_out: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """project(norm(hidden, residual)) and the sum: the norm goes into qkv's call (Linear.forward_after_norm),
        so an FP8 qkv quantizes its normed input in the norm's own kernel. -> (q [T, Hq, D], the sum)."""
        qkv, residual = cast(Linear, self.qkv_proj).forward_after_norm(hidden, residual, norm.weight, norm.eps)
        return self.project_qkv(qkv, positions, meta, k_cache, v_cache, q_out), residual

    def project(
        self, x: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata, k_cache: torch.Tensor,
        v_cache: torch.Tensor,
    ) -> torch.Tensor:
        """The part before attention (a stage of its own for models/nano_batches.py): qkv, the q/k norms,
        rotary and the cache write -> q [T, Hq, D]."""
        return self.project_qkv(self.qkv_proj(x), positions, meta, k_cache, v_cache)

    def project_qkv(
        self, qkv: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata, k_cache: torch.Tensor,
        v_cache: torch.Tensor, q_out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """project() after the qkv GEMM: qkv [T, (Hq + 2 Hkv) D] -> q [T, Hq, D] (q_out, rotated there, when
        given)."""
        num_tokens = qkv.shape[0]
        # Views into qkv (row stride != H*D): the rotary kernel rotates them in place.
        q = qkv[:, : self.q_size].view(num_tokens, self.num_heads, self.head_dim)
        k = qkv[:, self.q_size : self.q_size + self.kv_size].view(num_tokens, self.num_kv_heads, self.head_dim)
        v = qkv[:, self.q_size + self.kv_size :].view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q = self.q_norm(q.reshape(-1, self.head_dim))[0].view_as(q)
            k = self.k_norm(k.reshape(-1, self.head_dim))[0].view_as(k)
        self.rotary(q, k, v, positions, k_cache, v_cache, meta.slot_mapping, self.attn.k_scale, self.attn.v_scale,
                    q_out)
        return q if q_out is None else q_out


class LlamaMLP(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, prefix: str):
        super().__init__()
        quant = cfg.quantization
        self.gate_up_proj = make_linear(GateUpLinear, cfg.hidden_size, cfg.intermediate_size, dtype=dtype,
                                        quant=quant, names=[f"{prefix}.gate_proj", f"{prefix}.up_proj"], tp=cfg.shard)
        self.down_proj = make_linear(Linear, cfg.intermediate_size, cfg.hidden_size, dtype=dtype, quant=quant,
                                     names=[f"{prefix}.down_proj"], tp=cfg.shard)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Linear or a twin (FP8: the SiLU-mul fused into its activation quantization)
        return cast(Linear, self.down_proj).forward_after_silu(self.gate_up_proj(x))

    def forward_after_norm(self, hidden: torch.Tensor, residual: torch.Tensor | None, norm: RMSNorm
                           ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """forward(norm(hidden, residual)) and the sum, the norm in gate_up's call (as the attention's), as the
        (hidden, residual) pair of Linear.forward_add: down_proj may add the sum in its GEMM."""
        gate_up, residual = cast(Linear, self.gate_up_proj).forward_after_norm(hidden, residual, norm.weight, norm.eps)
        return cast(Linear, self.down_proj).forward_after_silu_add(gate_up, residual)


class LlamaDecoderLayer(nn.Module):
    """Norm -> attention -> norm -> MLP, the residual carried beside the hidden states and added inside the
    next norm. Small decode steps take models/fused_decode.py's path instead (same modules and weights)."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, rotary: RotaryEmbedding, prefix: str):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)
        self.self_attn = LlamaAttention(cfg, dtype, rotary, f"{prefix}.self_attn")
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)
        self.mlp = LlamaMLP(cfg, dtype, f"{prefix}.mlp")
        self.fused_decode: FusedDecode | None = None  # set after loading (LlamaForCausalLM.plan_decode)

    def forward(
        self,
        hidden: torch.Tensor,  # [T, H]
        residual: torch.Tensor | None,  # [T, H]; None in the first layer
        positions: torch.Tensor,
        meta: AttentionMetadata,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        if self.fused_decode is not None and takes_fused_decode(hidden, meta):
            return fused_decode_layer(self.fused_decode, hidden, residual, positions, meta, k_cache, v_cache)
        q, residual = self.before_attention(hidden, residual, positions, meta, k_cache, v_cache)
        return self.after_attention(self.self_attn.attn(q, k_cache, v_cache, meta), residual)

    # The layer in two halves around its attention (forward, and the batch step's piecewise CUDA graphs:
    # engine/piecewise_graphs.py). Each norm runs inside the linear after it (Linear.forward_after_norm: the
    # norm kernel, then the GEMM; an FP8 linear quantizes in the norm's kernel).
    def before_attention(
        self, hidden: torch.Tensor, residual: torch.Tensor | None, positions: torch.Tensor, meta: AttentionMetadata,
        k_cache: torch.Tensor, v_cache: torch.Tensor, q_out: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Input norm (+ residual), qkv, q/k norms, rotary and this step's K/V into the cache -> (q, the sum);
        q_out: the rotated q goes there."""
        return self.self_attn.project_after_norm(hidden, residual, self.input_layernorm, positions, meta, k_cache,
                                                 v_cache, q_out)

    def after_attention(self, attention: torch.Tensor, residual: torch.Tensor | None
                        ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """attention [T, Hq, D] (or [T, Hq * D]) -> o_proj, post-attention norm (+ residual), the MLP -> (hidden,
        residual): their sum is the layer's output (residual None: hidden is the sum, Linear.forward_add).
        `residual` is consumed (o_proj and down_proj may add into it in place)."""
        attn = self.self_attn
        hidden, residual = cast(Linear, attn.o_proj).forward_add(attention.reshape(attention.shape[0], attn.q_size),
                                                                 residual)
        return self.mlp.forward_after_norm(hidden, residual, self.post_attention_layernorm)


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, max_position: int):
        super().__init__()
        self.embed_tokens = VocabEmbedding(cfg.vocab_size, cfg.hidden_size, dtype=dtype)
        rotary = RotaryEmbedding(cfg.head_dim, max_position, cfg.rope_theta, cfg.rope_scaling)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(cfg, dtype, rotary, f"model.layers.{i}") for i in range(cfg.num_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)
        self.nano_batches: NanoBatchPlan | None = None  # set after loading (LlamaForCausalLM.plan_nano_batches)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
    ) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        if takes_nano_batches(self.nano_batches, hidden, meta):  # large decode steps: two halves, two streams
            assert self.nano_batches is not None
            hidden, both = nano_batch_layers(self.nano_batches, self.layers, hidden, positions, meta, kv_caches)
            return self.norm(hidden, both)[0]
        residual: torch.Tensor | None = None  # stays None after fused decode layers (their output is the sum)
        for layer, (k_cache, v_cache) in zip(self.layers, kv_caches, strict=True):
            hidden, residual = layer(hidden, residual, positions, meta, k_cache, v_cache)
        return self.norm(hidden, residual)[0]

    def piece(
        self, i: int, x: torch.Tensor, residual: torch.Tensor | None, positions: torch.Tensor,
        meta: AttentionMetadata, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], q_out: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Piece i of forward() cut at every attention (CausalLM.piece): the same modules in the same order as
        the layers' forward, regrouped so that each piece ends where an attention begins."""
        if i == 0:
            hidden = self.embed_tokens(x)
        else:
            hidden, residual = cast(LlamaDecoderLayer, self.layers[i - 1]).after_attention(x, residual)
        if i == len(self.layers):
            return self.norm(hidden, residual)
        k_cache, v_cache = kv_caches[i]
        return cast(LlamaDecoderLayer, self.layers[i]).before_attention(hidden, residual, positions, meta, k_cache,
                                                                        v_cache, q_out)

    def attend(self, i: int, q: torch.Tensor, meta: AttentionMetadata,
               kv_caches: list[tuple[torch.Tensor, torch.Tensor]], out: torch.Tensor) -> torch.Tensor:
        k_cache, v_cache = kv_caches[i]
        return cast(LlamaDecoderLayer, self.layers[i]).self_attn.attn(q, k_cache, v_cache, meta, out=out)


class LlamaForCausalLM(CausalLM):
    # Checkpoint module name -> (our fused module, its shard): how q/k/v and gate/up load into one linear.
    packed_modules = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", "gate"),
        "up_proj": ("gate_up_proj", "up"),
    }
    # Checkpoint parameter suffix -> ours: the FP8 KV cache's scales live on the attention module.
    renamed_params = {"self_attn.k_scale": "self_attn.attn.k_scale", "self_attn.v_scale": "self_attn.attn.v_scale"}

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, max_position: int):
        super().__init__()
        self.cfg = cfg
        self.model = LlamaModel(cfg, dtype, max_position)
        tied = self.model.embed_tokens if cfg.tie_word_embeddings else None
        self.lm_head = LMHead(cfg.vocab_size, cfg.hidden_size, dtype=dtype, tied_to=tied)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
    ) -> torch.Tensor:
        """input_ids, positions: [T] -> final hidden states [T, H] (normed)."""
        return self.model(input_ids, positions, meta, kv_caches)

    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """[N, H] (only the rows we sample) -> [N, vocab] float32 (into `out` when given)."""
        return self.lm_head(hidden, out)

    @property
    def num_pieces(self) -> int:
        return self.cfg.num_layers + 1

    def piece(self, i: int, x: torch.Tensor, residual: torch.Tensor | None, positions: torch.Tensor,
              meta: AttentionMetadata, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], q_out: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor]:
        return self.model.piece(i, x, residual, positions, meta, kv_caches, q_out)

    def attend(self, i: int, q: torch.Tensor, meta: AttentionMetadata,
               kv_caches: list[tuple[torch.Tensor, torch.Tensor]], out: torch.Tensor) -> torch.Tensor:
        return self.model.attend(i, q, meta, kv_caches, out)

    def plan_decode(self, mode: str, pdl: bool | None, kv_dtype: torch.dtype, fused_mlp: bool,
                    prologue_max_m: int) -> dict[str, Any]:
        reasons: list[str | None] = []
        mlp_max_m = prologue = 0
        for layer in cast(list[LlamaDecoderLayer], list(self.model.layers)):
            attn = layer.self_attn
            planned = None if mode == "cublas" else bind_fused_decode(
                mode, pdl, kv_dtype, fused_mlp=fused_mlp, prologue_max_m=prologue_max_m,
                input_norm=layer.input_layernorm, qkv=attn.qkv_proj,
                q_norm=attn.q_norm, k_norm=attn.k_norm, rotary=attn.rotary, attention=attn.attn, o_proj=attn.o_proj,
                post_norm=layer.post_attention_layernorm, gate_up=layer.mlp.gate_up_proj, down=layer.mlp.down_proj)
            layer.fused_decode = planned if isinstance(planned, FusedDecode) else None
            reasons.append(planned if isinstance(planned, str) else None)
            if layer.fused_decode is not None:
                mlp_max_m = max(mlp_max_m, layer.fused_decode.mlp_max_m)
                prologue = max(prologue, layer.fused_decode.prologue_max_m)
        layers = cast(list[LlamaDecoderLayer], list(self.model.layers))
        for layer, linked in zip(layers, link_norm_carry([layer.fused_decode for layer in layers]), strict=True):
            layer.fused_decode = linked
        pdl_used = any(layer.fused_decode is not None and layer.fused_decode.pdl for layer in layers)
        carried = any(layer.fused_decode is not None and layer.fused_decode.carry is not None for layer in layers)
        return decode_report(mode, pdl_used, reasons) | {"fused_mlp_max_m": mlp_max_m, "prologue_norm_max_m": prologue,
                                                         "norm_carry": carried}

    def plan_nano_batches(self, plan: NanoBatchPlan | None) -> dict[str, Any]:
        self.model.nano_batches = plan
        if plan is None:
            return {"enabled": False}
        return {"enabled": True, "min_rows": plan.min_rows, "attention_sms": plan.attention_sms}
