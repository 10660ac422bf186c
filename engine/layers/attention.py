"""Attention over the paged KV cache: the split-K decode kernel when every sequence has one query token,
the prefill kernel (chunks and decodes mixed) otherwise.

The module also owns the FP8 KV cache's per-tensor scales (`k_scale`, `v_scale`, float32 scalars): a
checkpoint with a `kv_cache_scheme` ships them as `model.layers.N.self_attn.k_scale` / `v_scale` (the model's
`renamed_params` maps them here); without one they stay 1.0, as vLLM does. They matter only when the cache is
float8_e4m3fn (EngineConfig.kv_cache_dtype="fp8"): the cache write stores k / k_scale and attention reads
stored * k_scale (engine/kernels/kv_quant.py)."""

from __future__ import annotations

import math

import torch
from stoker.engine import kernels
from stoker.engine.batch import AttentionMetadata
from stoker.engine.kernels.attention import decode_bucket_launch, decode_combine_counters
from stoker.engine.layers.weights import WeightModule
from torch import nn

# The decode batches (CUDA-graph buckets) at which the decode kernel combines its splits itself (counters, one
# launch); at the others the reduce kernel does. The first version (head by head, 14:43 UTC) lost everywhere;
# the group-at-once one (attention._combine_group) on the H200 (bf16, 2026-12-01 17:57 UTC,
# ops/bench_decode_attention.py, us per layer in CUDA-graph chains, two kernels vs fused, 8B shape, context 768
# in a 1024-token table): batch 1 6.26 vs 5.82, 2 7.48 vs 7.55, 4 10.93 vs 10.56, 8 14.22 vs 13.76, 16 20.03 vs
# 18.28, 32 30.80 vs 29.62 (15:47: batch 4 9.94 vs 10.16, so 4 and 8 are within a run's noise); 1B batch 1 5.48
# vs 5.37. From 64 rows the kernel runs one split: nothing to combine.
FUSED_COMBINE_BATCHES: frozenset[int] = frozenset({1, 4, 8, 16, 32})


class PagedAttention(WeightModule):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                 kv_scales_required: bool = False):
        """kv_scales_required: the checkpoint declares a kv_cache_scheme, so every layer's k_scale and v_scale
        must be in it (the loader reports any that is missing)."""
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim, self.scale = num_heads, num_kv_heads, head_dim, scale
        self.kv_scales_required = kv_scales_required
        self.k_scale = nn.Parameter(torch.ones(1, dtype=torch.float32), requires_grad=False)
        self.v_scale = nn.Parameter(torch.ones(1, dtype=torch.float32), requires_grad=False)
        # The decode kernel's fused-combine counters (made on first use on q's device; not a weight).
        self._combine_counters: torch.Tensor | None = None

    def load_weight(self, param_name: str, loaded: torch.Tensor, shard: str = "") -> None:
        # Checkpoints save a scalar (shape []) or [1]; a scale must be a positive finite number.
        if shard or loaded.numel() != 1:
            raise ValueError(f"{param_name} must be one number per layer (a per-tensor scale), "
                             f"got shape {tuple(loaded.shape)}")
        value = float(loaded.float().reshape(()))
        if not (math.isfinite(value) and value > 0):
            raise ValueError(f"{param_name} must be a positive finite number, got {value}")
        self._parameters[param_name].data.fill_(value)  # type: ignore[union-attr]

    def expected_shards(self) -> list[tuple[str, str]]:
        return [("k_scale", ""), ("v_scale", "")] if self.kv_scales_required else []

    def forward(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
        pdl: bool = False, out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """q [T, Hq, D] (this step's keys and values already in the cache) -> [T, Hq, D]. pdl: a decode-only
        step's kernel launched with programmatic dependent launch (the fused decode chain; ignored otherwise).
        out: where to write the result ([T, Hq, D]; the piecewise graphs' static buffer), None allocates."""
        if meta.decode_only:
            return kernels.paged_decode_attention(
                q, k_cache, v_cache, meta.block_tables, meta.context_lens, self.scale, self.k_scale, self.v_scale,
                self._counters_for(q), pdl=pdl, out=out,
            )
        if meta.num_decodes:
            return self._mixed(q, k_cache, v_cache, meta, out)
        return kernels.paged_attention(
            q, k_cache, v_cache, meta.block_tables, meta.query_start_loc, meta.context_lens, self.scale,
            self.k_scale, self.v_scale, out=out,
        )

    def _mixed(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
        out: torch.Tensor | None,
    ) -> torch.Tensor:
        """A mixed step: its first num_decodes rows (one query token each) through the decode kernel, the prompt
        chunks after them through the prefill kernel, each into its rows of one output."""
        nd = meta.num_decodes
        assert meta.prompt_query_start_loc is not None  # set by the runner whenever num_decodes is
        if out is None:
            out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        num_splits, ahead, counters = None, None, self._counters_for(q[:nd])
        if meta.decode_launch is not None and kernels.use_triton(q):  # (the reference has no splits)
            # Launched as the graph bucket that would hold these rows: a (split count, combine, block numbers ahead)
            # variant the capture compiled. At their own count (e.g. 20-28 rows: 2 splits, two-kernel combine) they
            # compiled 2 Triton variants mid-W2 on a fresh machine (~1 s of host each; BENCHMARKS.md, 18:57 UTC).
            rows, table_tokens = meta.decode_launch
            num_splits, ahead = decode_bucket_launch(rows, table_tokens, q, k_cache)
            counters = self._counters_for_batch(rows, q.device)
        kernels.paged_decode_attention(
            q[:nd], k_cache, v_cache, meta.block_tables[:nd], meta.context_lens[:nd], self.scale, self.k_scale,
            self.v_scale, counters, out=out[:nd], num_splits=num_splits, table_ahead=ahead,
        )
        kernels.paged_attention(
            q[nd:], k_cache, v_cache, meta.block_tables[nd:], meta.prompt_query_start_loc, meta.context_lens[nd:],
            self.scale, self.k_scale, self.v_scale, out=out[nd:],
        )
        return out

    def _counters_for(self, q: torch.Tensor) -> torch.Tensor | None:
        """The fused combine's counters for a decode batch of q.shape[0] sequences, or None for the two-kernel
        combine (batches not in FUSED_COMBINE_BATCHES)."""
        return self._counters_for_batch(q.shape[0], q.device)

    def _counters_for_batch(self, batch: int, device: torch.device) -> torch.Tensor | None:
        batches = FUSED_COMBINE_BATCHES  # read at call time: tests and benches change it
        if batch not in batches:
            return None
        largest = max(batches)
        if self._combine_counters is None or self._combine_counters.shape[0] < largest * self.num_kv_heads \
                or self._combine_counters.device != device:
            self._combine_counters = decode_combine_counters(largest, self.num_kv_heads, device)
        return self._combine_counters
