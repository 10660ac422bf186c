"""CUDA graphs for one sequence's prefill step: a lone request's prompt without the ~300 eager launches.

Why: a request that arrives at an idle engine (W1) runs one prefill step of its whole prompt, eagerly: at the
8B shape ~330 launches (norms, GEMMs, rotary + cache write, attention, SiLU-mul, ~10 a layer) through Python.
On the H200 (ops/ttft_probe.py, 21:09 UTC) that step's launch took 18.3 ms p50 of host (14.8-29.9) for 11.0 ms
of kernels, the GPU idle 8.5 ms inside it: TTFT 19.4 ms p50 (15.8-31.4). Replayed: TTFT 12.4 ms (12.2-12.7),
the launch 1.4 ms (BENCHMARKS.md, "the prefill step was launch-bound").

What: at startup, per token bucket (bucket_sizes: every 64 tokens to 512, then every 128, up to
EngineConfig.prefill_graph_tokens), one graph of the forward of ONE sequence's chunk of that many tokens
(embedding -> layers -> final norm -> lm_head of one row) over static buffers, all in one memory pool, largest
first. A step fits when it holds exactly one sequence, no decode row and no pending token, and at most the
largest bucket of tokens; it replays the smallest bucket >= its tokens. Rows past the chunk's tokens are
padding: slot -1 (no K/V write), zero attention output (the prefill kernel writes rows past query_start_loc[-1]
with zeros), and nobody reads their hidden states. The logits row is the chunk's last token (a chunk that does
not end its prompt samples nothing: its logits are computed and ignored). Several prompts at once, mixed steps
and longer chunks take the piecewise graphs (piecewise_graphs.py) instead.
"""

from __future__ import annotations

from typing import Any

import torch
from stoker.engine.batch import AttentionMetadata, ModelInput
from stoker.engine.cuda_graphs import TokenBucketGraphs
from stoker.engine.models.base import CausalLM

FINE_STEP = 64  # tokens between buckets up to COARSE_FROM
COARSE_STEP = 128  # above it
COARSE_FROM = 512


def bucket_sizes(max_tokens: int) -> list[int]:
    """64, 128, .., 512, then every 128 tokens, then max_tokens itself: padding stays under 64 tokens (12 %)
    to 512 and under 128 above, and every bucket is a multiple of 16 (Triton specializes integer arguments on
    divisibility by 16: other counts would compile their own kernel variants)."""
    if max_tokens < 1:
        raise ValueError(f"prefill graphs: max_tokens must be >= 1, got {max_tokens}")
    sizes, t = [], FINE_STEP
    while t < max_tokens:
        sizes.append(t)
        t += FINE_STEP if t < COARSE_FROM else COARSE_STEP
    return sizes + [-(-max_tokens // 16) * 16]


class PrefillGraphs(TokenBucketGraphs):
    def __init__(self, model: CausalLM, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], device: torch.device,
                 max_tokens: int, max_blocks: int):
        super().__init__(device, bucket_sizes(max_tokens))
        self.model, self.kv_caches = model, kv_caches
        self.block_tables = torch.zeros(1, max_blocks, dtype=torch.int32, device=device)
        self.query_start_loc = torch.tensor([0, 1], dtype=torch.int32, device=device)
        self.context_lens = torch.ones(1, dtype=torch.int32, device=device)
        self.sample_index = torch.zeros(1, dtype=torch.int64, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: torch.Tensor | None = None  # [1, V] float32, written by every bucket's graph
        self._logits_like: torch.Tensor | None = None  # the warm-up's logits (their width and dtype)

    def _forward(self, tokens: int) -> torch.Tensor:
        meta = AttentionMetadata(self.slot_mapping[:tokens], self.block_tables, self.query_start_loc,
                                 self.context_lens, decode_only=False)
        hidden = self.model(self.input_ids[:tokens], self.positions[:tokens], meta, self.kv_caches)
        return self.model.compute_logits(hidden[self.sample_index], out=self.logits)

    def _warm(self, tokens: int) -> None:
        self._logits_like = self._forward(tokens)

    def _after_warm(self) -> None:
        # The static logits row, on the current stream (which replays use), not the warm-up's side stream.
        out, self._logits_like = self._logits_like, None
        assert out is not None  # (the warm-up ran)
        self.logits = torch.empty(1, out.shape[1], dtype=out.dtype, device=self.device)

    def _capture_bucket(self, tokens: int, pool: Any) -> None:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            self._forward(tokens)
        self.graphs[tokens] = graph

    def fits(self, inp: ModelInput) -> bool:
        """One sequence's prompt chunk alone, within the largest bucket and the static block table."""
        meta = inp.meta
        return (self.enabled and not meta.decode_only and meta.num_decodes == 0 and inp.prev_tokens is None
                and meta.block_tables.shape[0] == 1 and meta.block_tables.shape[1] <= self.block_tables.shape[1]
                and 1 <= inp.input_ids.shape[0] <= self.sizes[-1] and inp.sample_indices.shape[0] <= 1)

    def run(self, inp: ModelInput) -> torch.Tensor:
        """Copy the step's tensors (on the device) into the static buffers and replay the bucket's graph ->
        float32 logits [N, V] of the sampled row (N = 0 or 1). Device-side copies only: no host sync."""
        meta = inp.meta
        bucket = self._bucket_inputs(inp)
        self.block_tables[:, : meta.block_tables.shape[1]].copy_(meta.block_tables, non_blocking=True)
        self.query_start_loc.copy_(meta.query_start_loc, non_blocking=True)
        self.context_lens.copy_(meta.context_lens, non_blocking=True)
        sampled = inp.sample_indices.shape[0]
        if sampled:
            self.sample_index.copy_(inp.sample_indices, non_blocking=True)
        else:  # nothing sampled: row 0, since a stale index from a longer run would read past this bucket's rows
            self.sample_index.zero_()
        self.graphs[bucket].replay()
        self.replays += 1
        assert self.logits is not None  # set by capture()
        return self.logits[:sampled]
