"""CUDA graphs for decode-only steps.

At startup we capture, per batch-size bucket (bucket_sizes: 1, 2, 4, .., 64, then every 64 rows up to
max_num_seqs), one graph of the whole decode forward (embedding -> layers -> final norm -> lm_head -> float32
logits) over static buffers: input_ids, positions, slot_mapping, block_tables, context_lens (and
query_start_loc, which the decode kernel never reads). A step's inputs go into them in one kernel launched before
the replay (engine/kernels/graph_inputs.py), which also resolves its pending token ids (-1 - row of the previous
step's sampled ids). All graphs share one memory pool
and are captured largest first, so the smaller ones reuse its blocks; all write their logits into one
static [max_batch, V] buffer. A decode step of n sequences replays the smallest bucket >= n: rows n.. are
padding that write their K/V nowhere (slot -1), attend over one key and whose logits nobody reads. The
attention's split-K grid is fixed per bucket because the decode launcher picks num_splits from the batch
and the static block table's width (max_model_len), never from context_lens values (splits past a short
context exit at once). Sampling stays outside the graph (its stages depend on per-batch settings), but for
buckets of up to GREEDY_IN_GRAPH_MAX rows the graph ends with the greedy argmax of every row (one kernel,
engine/kernels/argmax.py) into a static buffer, which the sampler takes instead of launching its own where nothing
changes the logits before the argmax (greedy_for). Mixed and prefill steps run eagerly, a mixed step's decode rows with the split count and combine of the bucket that
would hold them (ModelRunner._decode_launch): only variants the capture compiled.
"""

from __future__ import annotations

import bisect
import contextlib
import gc
import time
from collections.abc import Iterator
from typing import Any

import torch
from stoker.engine import kernels
from stoker.engine.batch import AttentionMetadata, ModelInput, resolve_pending
from stoker.engine.kernels.argmax import GreedyArgmax
from stoker.engine.kernels.graph_inputs import decode_inputs, decode_inputs_ref
from stoker.engine.models.base import CausalLM

FINE_BUCKETS_FROM = 64  # powers of two up to here, then a bucket every FINE_BUCKETS_FROM rows or more
# Buckets of up to this many rows end with the greedy argmax of every row (a few us at batch 1, against ~20 us for
# the sampler's four kernels and their launch gaps outside the graph; above it a step is tens of ms and the argmax
# of rows that sample at random would be work for nothing).
GREEDY_IN_GRAPH_MAX = 64
# A step's inputs into the static buffers by one kernel on CUDA (graph_inputs.decode_inputs); False: by the copies,
# fills and resolve_pending it replaced (decode_inputs_ref: the A/B's other side, ops/bench.py "+set=cuda_graphs.").
GRAPH_INPUTS_KERNEL = True


def bucket_sizes(max_batch: int) -> list[int]:
    """1, 2, 4, .., 64, then a bucket every 64 rows (every eighth of an octave once that is larger: 1024-2048
    in steps of 128), then max_batch itself; e.g. max_batch 1024: 22 buckets, 64..1024 in steps of 64.
    Why: up to ~200 rows a decode step streams the weights once whatever the batch (8B shape, bf16 on an
    H200: the GEMMs turn compute-bound near 200 rows), so padding 65 -> 128 costs little; above, a step's
    GEMM time grows with its rows and powers of two made batches of 513..1023 pay for 1024 (up to 2x).
    Steps of 64 rows bound the padding to 63 rows (<= 11% above 576) and keep cuBLAS on whole 64-row tiles.
    Each bucket is one more capture at startup (~0.1 s at the 8B shape: the lead measures graph_capture_s)
    and no more memory for the logits (one shared buffer), only per-bucket graph state."""
    if max_batch < 1:
        raise ValueError(f"max_batch must be >= 1, got {max_batch}")
    sizes, b = [], 1
    while b < max_batch:
        sizes.append(b)
        b = b * 2 if b < FINE_BUCKETS_FROM else b + max(FINE_BUCKETS_FROM, _octave_start(b) // 8)
    return sizes + [max_batch]


def _octave_start(b: int) -> int:
    """The power of two <= b."""
    return 1 << (b.bit_length() - 1)


def pick_bucket(sizes: list[int], n: int) -> int:
    """The smallest bucket >= n (sizes sorted ascending); ValueError when n exceeds the largest."""
    i = bisect.bisect_left(sizes, n)
    if n < 1 or i == len(sizes):
        raise ValueError(f"no CUDA-graph bucket for a batch of {n} (buckets {sizes[0]}..{sizes[-1]})")
    return sizes[i]


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """Python's cyclic collector off (in every thread) while CUDA graphs are captured; as it was after.

    torch.cuda.graph captures in "global" error mode: while it captures, a CUDA call that is not allowed during a
    capture, from any thread, invalidates it. A collection that ran then would free what only it can free, such as
    an earlier engine's CUDA graphs left in a reference cycle, whose destructors reset them
    (cudaGraphExecDestroy): the capture fails with cudaErrorStreamCaptureInvalidated at its next launch. The one
    capture failure seen on the H200 (a GPU test process that had built engines before; BENCHMARKS.md 2026-12-02)
    printed such resets refused mid-capture; the same made on purpose (an old graph in a cycle that becomes garbage
    mid-capture, the collector at every allocation) fails that way on the H200 without the pause and captures
    with it (tests/test_capture_collector.py). A worker reloading a model
    (worker/models.py) captures while its event loop allocates. Paused, such garbage waits for the first
    collection after the capture."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


class TokenBucketGraphs:
    """What the prefill graphs (prefill_graphs.py) and the piecewise graphs (piecewise_graphs.py) share: static
    token ids, positions and slots for the largest bucket of `sizes` (slots -1: padding rows write no K/V), the
    capture's order (a warm-up of the largest and the smallest bucket on a side stream for the compiles and the
    cuBLAS plans, then every bucket largest first into one pool) and the counters benches and tests read."""

    def __init__(self, device: torch.device, sizes: list[int]):
        self.device, self.sizes = device, sizes
        top = sizes[-1]
        self.input_ids = torch.zeros(top, dtype=torch.int64, device=device)
        self.positions = torch.zeros(top, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((top,), -1, dtype=torch.int64, device=device)  # -1: write no K/V
        self.replays = 0  # steps served from the graphs (tests and benches read it)
        self.pool_bytes = 0  # device memory the captured graphs hold (set by capture)
        self.enabled = True  # benches flip it to compare with the eager step on one engine

    def _warm(self, tokens: int) -> None:
        """Run a bucket's work eagerly (on the capture's side stream)."""
        raise NotImplementedError

    def _after_warm(self) -> None:
        """Between the warm-up and the captures, on the current stream (which replays use): static outputs."""

    def _capture_bucket(self, tokens: int, pool: Any) -> None:
        """Capture a bucket's graph(s) into `pool` (torch.cuda.graph_pool_handle())."""
        raise NotImplementedError

    @torch.inference_mode()
    def capture(self) -> float:
        """The warm-up, then every bucket largest first into one pool; -> seconds taken. The static slots are -1
        throughout: nothing writes the KV cache."""
        t0 = time.perf_counter()
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for tokens in (self.sizes[-1], self.sizes[0]):
                self._warm(tokens)
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize(self.device)
        self._after_warm()
        pool = torch.cuda.graph_pool_handle()
        reserved = torch.cuda.memory_reserved(self.device)
        with collector_paused():
            for tokens in reversed(self.sizes):
                self._capture_bucket(tokens, pool)
        torch.cuda.synchronize(self.device)
        self.pool_bytes = torch.cuda.memory_reserved(self.device) - reserved  # what the graphs keep (startup report)
        return time.perf_counter() - t0

    def _bucket_inputs(self, inp: ModelInput) -> int:
        """Copy the step's ids (pending ones resolved), positions and slots into the static buffers, on the
        device; slots past its tokens to the bucket's end -1 -> the bucket."""
        tokens = inp.input_ids.shape[0]
        bucket = self.sizes[bisect.bisect_left(self.sizes, tokens)]
        self.input_ids[:tokens].copy_(resolve_pending(inp.input_ids, inp.prev_tokens), non_blocking=True)
        self.positions[:tokens].copy_(inp.positions, non_blocking=True)
        self.slot_mapping[:tokens].copy_(inp.meta.slot_mapping, non_blocking=True)
        if tokens < bucket:  # rows a longer step left: they must write no K/V
            self.slot_mapping[tokens:bucket].fill_(-1)
        return bucket


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
        self.input_ids = torch.zeros(max_batch, dtype=torch.int64, device=dev)  # resolved ids (graph_inputs)
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
        # Bucket b's graph writes logits[:b] (every bucket shares the rows): one [max_batch, V] float32 buffer
        # instead of a buffer per bucket (which at 22 buckets and V=128K would hold ~4.5 GB). Allocated by
        # capture() (the warm-up's logits give V: this rank's LM head may not be the config's).
        self.logits: torch.Tensor | None = None
        self.hidden: dict[int, torch.Tensor] = {}  # bucket -> static hidden states (ranks without logits)
        # The greedy ids of buckets <= GREEDY_IN_GRAPH_MAX rows, written by each replay's last kernel (capture()
        # makes the argmax's scratch once the vocabulary is known); greedy_for hands them to the sampler.
        self.greedy_rows = min(max_batch, GREEDY_IN_GRAPH_MAX) if with_logits else 0
        self.greedy_ids = torch.zeros(max(1, self.greedy_rows), dtype=torch.int64, device=dev)
        self._argmax: GreedyArgmax | None = None
        self._last: tuple[torch.Tensor, torch.Tensor] | None = None  # (logits, greedy ids) of the last replay
        self.replays = 0  # decode steps served from a graph (tests and stats read it)
        self.capture_s = 0.0

    def _forward(self, b: int) -> torch.Tensor:
        hidden = self.model(self.input_ids[:b], self.positions[:b], self._meta[b], self.kv_caches)
        if not self.with_logits:
            return hidden
        logits = self.model.compute_logits(hidden, out=None if self.logits is None else self.logits[:b])
        if self._argmax is not None and b <= self.greedy_rows:
            self._argmax(logits, self.greedy_ids[:b])
        return logits

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
                out = self._forward(b)
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize(self.device)
        if self.with_logits:  # on the current stream, which replays use (not the side stream's pool)
            self.logits = torch.empty(self.max_batch, out.shape[1], dtype=out.dtype, device=self.device)
            if self.greedy_rows and kernels.use_triton(self.logits):  # its scratch, its compile outside the captures
                self._argmax = GreedyArgmax(self.greedy_rows, out.shape[1], self.device)
                self._argmax(self.logits[:1].zero_(), self.greedy_ids[:1])
        with collector_paused():
            for b in reversed(self.sizes):
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    out = self._forward(b)
                if not self.with_logits:
                    self.hidden[b] = out
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
        """Put the step's tensors (already on the device) into the static buffers (one kernel; padding rows write
        no K/V and read one key, a real, finite cache row), replay, and return float32 logits of the sampled rows.
        No host sync."""
        n = inp.input_ids.shape[0]
        b = pick_bucket(self.sizes, n)
        meta = inp.meta
        fill = decode_inputs if GRAPH_INPUTS_KERNEL else decode_inputs_ref
        fill((inp.input_ids, inp.positions, meta.slot_mapping, meta.context_lens, meta.block_tables), inp.prev_tokens,
             (self.input_ids, self.positions, self.slot_mapping, self.context_lens, self.block_tables), b)
        self.graphs[b].replay()
        self.replays += 1
        self._last = None
        if self.logits is None:  # (no LM head on this tensor-parallel rank)
            return self.hidden[b]
        logits = self.logits[:b]
        if inp.sample_indices.shape[0] == n:  # a decode step samples every row (the usual case)
            out = logits[:n]
            if self._argmax is not None and b <= self.greedy_rows:
                self._last = (out, self.greedy_ids[:n])
            return out
        return logits[inp.sample_indices]

    def greedy_for(self, logits: torch.Tensor) -> torch.Tensor | None:
        """The argmax of every row of `logits` computed inside the graph, where `logits` is the very tensor the
        last replay returned; else None. The ids are a view of a static buffer that the next replay overwrites:
        valid for the work queued before that replay (the sampler's, the host copy, the next step's pending-token
        gather, which reads them before the replay it belongs to)."""
        last = self._last
        return last[1] if last is not None and last[0] is logits else None
