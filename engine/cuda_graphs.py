"""CUDA graphs for decode-only steps.

At startup we capture, per batch-size bucket (1, 2, 4, ..., max_num_seqs), one graph of the whole decode
forward (embedding -> layers -> final norm -> lm_head -> float32 logits) over static buffers: input_ids,
positions, slot_mapping, block_tables, context_lens (and query_start_loc, which the decode kernel never
reads). All graphs share one memory pool and are captured largest first, so the smaller ones reuse its
blocks. A decode step of n sequences replays the smallest bucket >= n: rows n.. are padding that write
their K/V nowhere (slot -1), attend over one key and whose logits nobody reads. The attention's split-K
grid is fixed per bucket because the decode launcher picks num_splits from the batch and the static block
table's width (max_model_len), never from context_lens values. Sampling stays outside the graph (its
stages depend on per-batch settings); mixed and prefill steps run eagerly.
"""

from __future__ import annotations

import bisect
import time

import torch
from stoker.engine.batch import AttentionMetadata, ModelInput
from stoker.engine.models.base import CausalLM


def bucket_sizes(max_batch: int) -> list[int]:
    """Powers of two below max_batch, then max_batch itself: 1, 2, 4, ..., max_batch."""
    if max_batch < 1:
        raise ValueError(f"max_batch must be >= 1, got {max_batch}")
    sizes, b = [], 1
    while b < max_batch:
        sizes.append(b)
        b *= 2
    return sizes + [max_batch]


def pick_bucket(sizes: list[int], n: int) -> int:
    """The smallest bucket >= n (sizes sorted ascending); ValueError when n exceeds the largest."""
    i = bisect.bisect_left(sizes, n)
    if n < 1 or i == len(sizes):
        raise ValueError(f"no CUDA-graph bucket for a batch of {n} (buckets {sizes[0]}..{sizes[-1]})")
    return sizes[i]


class DecodeGraphs:
    def __init__(
        self,
        model: CausalLM,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        device: torch.device,
        block_size: int,
        max_batch: int,
        max_model_len: int,
        with_logits: bool = True,  # False: stop at the hidden states (tensor-parallel ranks > 0)
    ):
        self.model, self.kv_caches, self.device = model, kv_caches, device
        self.with_logits = with_logits
        self.sizes = bucket_sizes(max_batch)
        self.max_batch = max_batch
        dev = device
        max_blocks = -(-max_model_len // block_size)
        self.input_ids = torch.zeros(max_batch, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(max_batch, dtype=torch.int64, device=dev)
        self.slot_mapping = torch.full((max_batch,), -1, dtype=torch.int64, device=dev)
        self.block_tables = torch.zeros(max_batch, max_blocks, dtype=torch.int32, device=dev)
        self.context_lens = torch.ones(max_batch, dtype=torch.int32, device=dev)
        self.query_start_loc = torch.arange(max_batch + 1, dtype=torch.int32, device=dev)
        self._meta = {
            b: AttentionMetadata(
                self.slot_mapping[:b],
                self.block_tables[:b],
                self.query_start_loc[: b + 1],
                self.context_lens[:b],
                decode_only=True,
            )
            for b in self.sizes
        }
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}  # bucket -> static [b, V] float32 output
        self.replays = 0  # decode steps served from a graph (tests and stats read it)
        self.capture_s = 0.0

    def _forward(self, b: int) -> torch.Tensor:
        hidden = self.model(self.input_ids[:b], self.positions[:b], self._meta[b], self.kv_caches)
        return self.model.compute_logits(hidden) if self.with_logits else hidden

    @torch.inference_mode()
    def capture(self) -> float:
        """Capture every bucket, largest first into one pool; returns seconds taken."""
        t0 = time.perf_counter()
        pool = torch.cuda.graph_pool_handle()
        # Warm up on a side stream (as torch.cuda.graphs asks): compiles the Triton kernels and lets cuBLAS
        # pick its algorithms before any capture.
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for b in (self.sizes[-1], self.sizes[0]):
                self._forward(b)
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize(self.device)
        for b in reversed(self.sizes):
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.logits[b] = self._forward(b)
            self.graphs[b] = graph
        torch.cuda.synchronize(self.device)
        self.capture_s = time.perf_counter() - t0
        return self.capture_s

    def fits(self, inp: ModelInput) -> bool:
        n = inp.input_ids.shape[0]
        return (
            inp.meta.decode_only
            and 1 <= n <= self.max_batch
            and inp.meta.block_tables.shape[1] <= self.block_tables.shape[1]
        )

    def run(self, inp: ModelInput) -> torch.Tensor:
        """Copy the step's tensors (already on the device) into the static buffers, replay, and return
        float32 logits of the sampled rows. Device-side copies only: no host sync."""
        n, width = inp.input_ids.shape[0], inp.meta.block_tables.shape[1]
        b = pick_bucket(self.sizes, n)
        self.input_ids[:n].copy_(inp.input_ids, non_blocking=True)
        self.positions[:n].copy_(inp.positions, non_blocking=True)
        self.slot_mapping[:n].copy_(inp.meta.slot_mapping, non_blocking=True)
        self.context_lens[:n].copy_(inp.meta.context_lens, non_blocking=True)
        self.block_tables[:n, :width].copy_(inp.meta.block_tables, non_blocking=True)
        if n < b:  # padding rows: write no K/V, read one key (a real, finite cache row), ignored outputs
            self.slot_mapping[n:b].fill_(-1)
            self.context_lens[n:b].fill_(1)
        self.graphs[b].replay()
        self.replays += 1
        logits = self.logits[b]
        if inp.sample_indices.shape[0] == n:  # a decode step samples every row (the usual case)
            return logits[:n]
        return logits[inp.sample_indices]
