"""Builds the flat batch tensors from a SchedulerOutput, runs the model on the paged KV cache and samples.

The batch is one flat token axis: decodes first (one token each), then prefill chunks. Everything the
attention needs travels in `AttentionMetadata`, so the CUDA-graph work can swap in static buffers behind
the same interface.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import torch

from engine.config import EngineConfig
from engine.kv_cache import allocate_kv_cache, num_kv_blocks
from engine.loader import ModelConfig, load_weights
from engine.models import MODEL_REGISTRY
from engine.sampler import Sampler, SamplerOutput, SamplingBatch, SamplingRequest
from engine.scheduler import SchedulerOutput

log = logging.getLogger(__name__)


@dataclass(slots=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] int64: flat cache slot of each token
    block_tables: torch.Tensor  # [B, max_blocks] int32, padded with 0 (never read past context_lens)
    query_start_loc: torch.Tensor  # [B+1] int32: sequence b owns tokens [qsl[b], qsl[b+1])
    context_lens: torch.Tensor  # [B] int32: tokens in the cache for b after this step
    decode_only: bool  # every sequence has exactly one query token (the decode kernel's case)


@dataclass(slots=True)
class ModelInput:
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    meta: AttentionMetadata
    sample_indices: torch.Tensor  # [N] int64: rows of the hidden states whose logits are sampled


class ModelRunner:
    def __init__(self, config: EngineConfig, model_config: ModelConfig, max_model_len: int):
        self.config, self.model_config = config, model_config
        self.device = torch.device(config.device)  # type: ignore[arg-type]
        self.dtype = config.torch_dtype
        self.block_size = config.block_size
        t0 = time.perf_counter()
        with torch.device(self.device):
            self.model = MODEL_REGISTRY[model_config.architecture](model_config, self.dtype, max_model_len)
        # Startup report (GPU work, see engine/fast_load.py and engine/cuda_graphs.py): seconds and bytes.
        self.startup: dict[str, Any] = {}
        if self.device.type == "cuda":
            from engine.fast_load import load_weights_fast

            self.startup |= load_weights_fast(self.model, config.model_path, self.device)
        else:
            load_weights(self.model, config.model_path)
        self.model.eval()
        self.num_blocks = num_kv_blocks(model_config, config)
        self.kv_caches = allocate_kv_cache(model_config, self.num_blocks, self.block_size, self.dtype, self.device)
        self.sampler = Sampler()
        self.graphs = None
        if self.device.type == "cuda" and config.cuda_graphs:
            from engine.cuda_graphs import DecodeGraphs

            self.graphs = DecodeGraphs(self, config.max_num_seqs, max_model_len)
            self.startup["graph_capture_s"] = self.graphs.capture()
            self.startup["graph_buckets"] = self.graphs.sizes
        self.startup["ready_s"] = time.perf_counter() - t0
        if self.device.type == "cuda":
            log.info("model ready in %.2f s (weights %.2f s, %.1f GB/s; graph capture %.2f s)",
                     self.startup["ready_s"], self.startup.get("load_s", 0.0),
                     self.startup.get("gb_per_s", 0.0), self.startup.get("graph_capture_s", 0.0))

    def _tensor(self, values: list[int], dtype: torch.dtype) -> torch.Tensor:
        host = torch.tensor(values, dtype=dtype)
        if self.device.type == "cuda":
            host = host.pin_memory()
        return host.to(self.device, non_blocking=True)

    def prepare(self, out: SchedulerOutput) -> ModelInput:
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_start = [0]
        context_lens: list[int] = []
        sample_indices: list[int] = []
        bs = self.block_size
        for chunk in out.chunks:
            seq, end = chunk.seq, chunk.start + chunk.num_tokens
            if chunk.num_tokens == 1:
                input_ids.append(seq.token_id_at(chunk.start))
            else:
                input_ids.extend(seq.all_token_ids[chunk.start : end])
            positions.extend(range(chunk.start, end))
            table = seq.block_table
            slots.extend(table[p // bs] * bs + p % bs for p in range(chunk.start, end))
            query_start.append(query_start[-1] + chunk.num_tokens)
            context_lens.append(end)
            if chunk.samples:
                sample_indices.append(query_start[-1] - 1)
        width = max(len(c.seq.block_table) for c in out.chunks)
        tables = [c.seq.block_table + [0] * (width - len(c.seq.block_table)) for c in out.chunks]
        meta = AttentionMetadata(
            slot_mapping=self._tensor(slots, torch.int64),
            block_tables=self._tensor(tables, torch.int32),  # type: ignore[arg-type]
            query_start_loc=self._tensor(query_start, torch.int32),
            context_lens=self._tensor(context_lens, torch.int32),
            decode_only=all(c.num_tokens == 1 for c in out.chunks),
        )
        return ModelInput(
            self._tensor(input_ids, torch.int64),
            self._tensor(positions, torch.int64),
            meta,
            self._tensor(sample_indices, torch.int64),
        )

    @torch.inference_mode()
    def forward(self, inp: ModelInput) -> torch.Tensor:
        """-> float32 logits [N, V] of the sampled rows only (lm_head runs on those rows alone)."""
        if self.graphs is not None and self.graphs.fits(inp):
            return self.graphs.run(inp)  # decode-only: replay the captured graph of the batch's bucket
        hidden = self.model(inp.input_ids, inp.positions, inp.meta, self.kv_caches)
        return self.model.compute_logits(hidden[inp.sample_indices])

    @torch.inference_mode()
    def sample(self, logits: torch.Tensor, rows: list[SamplingRequest]) -> SamplerOutput:
        batch = SamplingBatch.build(rows, logits.shape[-1], self.device)
        out = self.sampler(logits, batch)
        return _to_host(out) if self.device.type == "cuda" else out


def _to_host(out: SamplerOutput) -> SamplerOutput:
    """The step's one host sync: non_blocking copies into pinned memory, then wait on a blocking-sync event
    so the CPU sleeps instead of spinning while the GPU finishes (spinning would burn a core per worker)."""
    def host(t: torch.Tensor) -> torch.Tensor:
        return torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t, non_blocking=True)

    def maybe(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else host(t)

    res = SamplerOutput(host(out.token_ids), maybe(out.logprobs), maybe(out.top_ids), maybe(out.top_logprobs))
    done = torch.cuda.Event(blocking=True)
    done.record()
    done.synchronize()
    return res
