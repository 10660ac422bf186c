"""Builds the flat batch tensors from a SchedulerOutput, runs the model on the paged KV cache and samples.

The batch is one flat token axis: decodes first (one token each), then prefill chunks. Everything the
attention needs travels in `AttentionMetadata`, so the CUDA-graph work can swap in static buffers behind
the same interface.
"""

from __future__ import annotations

import gc
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from stoker.engine import kernels
from stoker.engine.batch import AttentionMetadata, ModelInput, PackedStep, resolve_pending
from stoker.engine.config import EngineConfig
from stoker.engine.cuda_graphs import bucket_sizes, pick_bucket
from stoker.engine.kv_cache import allocate_kv_cache, kv_cache_dtype, num_kv_blocks, weights_bytes
from stoker.engine.loader import load_weights
from stoker.engine.model_config import ModelConfig
from stoker.engine.models import model_class
from stoker.engine.models.fused_decode import resolve_decode_kernels
from stoker.engine.models.nano_batches import make_plan
from stoker.engine.sampler import Sampler, SamplerOutput, SamplingBatch, SamplingRequest
from stoker.engine.scheduler import SchedulerOutput
from stoker.engine.sequence import Sequence

if TYPE_CHECKING:
    from stoker.engine.cuda_graphs import TokenBucketGraphs
    from stoker.engine.parallel.comm import RankComm
    from stoker.engine.parallel.launcher import RankGroup
    from stoker.engine.piecewise_graphs import PiecewiseGraphs
    from stoker.engine.prefill_graphs import PrefillGraphs

log = logging.getLogger(__name__)


class ModelRunner:
    def __init__(self, config: EngineConfig, model_config: ModelConfig, max_model_len: int,
                 comm: RankComm | None = None, ranks: RankGroup | None = None):
        """Tensor parallel: model_config is this rank's part (engine/parallel/plan.py), `comm` its groups, and
        on rank 0 `ranks` the other ranks, to which prepare() ships every step's input."""
        self.config, self.model_config = config, model_config
        self.comm, self.ranks = comm, ranks
        self.device = torch.device(config.device)  # type: ignore[arg-type]
        self.dtype = config.torch_dtype
        self.block_size = config.block_size
        t0 = time.perf_counter()
        # Startup report (GPU work, see engine/fast_load.py and engine/cuda_graphs.py): seconds and bytes.
        self.startup: dict[str, Any] = {}
        kernels.set_triton(config.use_triton)
        if self.device.type == "cuda" and config.blocking_sync:
            self.startup["blocking_sync"] = _blocking_sync(self.device)
        if config.load_format == "dummy":  # refused before the model takes its memory (an FP8 checkpoint's config)
            from stoker.engine.dummy_load import check_dummy_allowed, load_dummy_weights

            check_dummy_allowed(model_config)
        with torch.device(self.device):
            self.model = model_class(model_config.architecture)(model_config, self.dtype, max_model_len)
        if config.load_format == "dummy":  # random weights through the same load rules (engine/dummy_load.py)
            self.startup |= load_dummy_weights(self.model, model_config, self.dtype, self.device)
        elif self.device.type == "cuda":  # a tensor-parallel rank's fast load reads its rows (fast_load.py)
            from stoker.engine.fast_load import load_weights_fast

            self.startup |= load_weights_fast(self.model, config.model_path, self.device)
        else:
            load_weights(self.model, config.model_path)
        self.model.eval()
        if comm is not None and comm.nccl and config.tensor_parallel_all_reduce == "symm-mem":
            # the fused decode steps' messages ([<= GEMV_MAX_M tokens, hidden]); every rank here, before any capture
            comm.enable_one_shot(kernels.GEMV_MAX_M * model_config.hidden_size, self.dtype)
        # Decode steps of <= 16 sequences: the fused GEMVs or the unfused kernels (models/fused_decode.py).
        self.startup["decode_kernels"] = self.model.plan_decode(
            resolve_decode_kernels(config), config.decode_pdl, kv_cache_dtype(config), config.decode_fused_mlp,
            config.decode_prologue_norm_max_m)
        self.startup["decode_overlap"] = self.model.plan_nano_batches(
            make_plan(config.decode_overlap, config.decode_overlap_min_rows, self.device, config.decode_overlap_sms))
        self.weights_bytes = weights_bytes(self.model)
        self.num_blocks = num_kv_blocks(model_config, config, self.weights_bytes)
        if comm is not None:  # every rank's cache has the same blocks: the fewest any rank's memory allows
            self.num_blocks = min(comm.gather_ints(self.num_blocks))
        self.kv_caches = allocate_kv_cache(
            model_config, self.num_blocks, self.block_size, kv_cache_dtype(config), self.device
        )
        self.sampler = Sampler()
        self._tables = _BlockTables(-(-max_model_len // self.block_size))
        self._graph_buckets = bucket_sizes(config.max_num_seqs)  # DecodeGraphs' (for _decode_launch)
        self.graphs = None
        if self.device.type == "cuda" and config.cuda_graphs and not config.use_triton:
            # The torch references (use_triton=False) skip padding slots with boolean masks, which synchronize
            # and cannot be captured: they run eagerly (they exist for A/B runs and tests, not for speed).
            log.info("CUDA graphs off: use_triton=False runs the torch kernel references, which cannot be captured")
        elif self.device.type == "cuda" and config.cuda_graphs:
            from stoker.engine.cuda_graphs import DecodeGraphs

            # Tensor parallel: every rank captures the same buckets in the same order (a graph-captured all-reduce
            # is replayed by all ranks together); ranks > 0 stop at the hidden states (they do not sample).
            self.graphs = DecodeGraphs(
                self.model, self.kv_caches, self.device, self.block_size, config.max_num_seqs, max_model_len,
                with_logits=comm is None or comm.rank == 0,
            )
            self.startup["graph_capture_s"] = self.graphs.capture()
            self.startup["graph_buckets"] = self.graphs.sizes
        self.prefill_graphs = self._capture_prefill_graphs(max_model_len)
        self.piecewise_graphs = self._capture_piecewise_graphs()
        self.startup["ready_s"] = time.perf_counter() - t0
        if self.device.type == "cuda":
            log.info(
                "model ready in %.2f s (weights %.2f s, %.1f GB/s; graph capture %.2f s)",
                self.startup["ready_s"],
                self.startup.get("load_s", 0.0),
                self.startup.get("gb_per_s", 0.0),
                self.startup.get("graph_capture_s", 0.0),
            )

    def _capture_prefill_graphs(self, max_model_len: int) -> PrefillGraphs | None:
        """A lone prompt chunk's step as one graph replay (engine/prefill_graphs.py): with the decode graphs, on
        one GPU (ranks > 0 run forward_shard, which has no LM head to capture), when prefill_graph_tokens > 0."""
        tokens = min(self.config.prefill_graph_tokens, self.config.max_num_batched_tokens, max_model_len)
        if self.graphs is None or self.comm is not None or tokens < 1:
            return None
        from stoker.engine.prefill_graphs import PrefillGraphs

        graphs = PrefillGraphs(self.model, self.kv_caches, self.device, tokens, -(-max_model_len // self.block_size))
        return graphs if self._captured("prefill_graph", graphs) else None

    def _tensor(self, values: list[int], dtype: torch.dtype) -> torch.Tensor:
        host = torch.tensor(values, dtype=dtype)
        if self.device.type == "cuda":
            host = host.pin_memory()
        return host.to(self.device, non_blocking=True)

    def _upload(self, host64: np.ndarray, host32: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """A step's two host arrays to the device in one copy: pinned + non_blocking on CUDA (the caching host
        allocator keeps the pinned block alive until the copy ran, so overlapped steps never overwrite a buffer in
        flight); the int32 part starts 16 bytes aligned. One copy, not two: each costs the step ~3 us of copy-engine
        latency at batch 1 (the W1 profile, BENCHMARKS.md 2026-12-04 session 25)."""
        if self.device.type != "cuda":
            return torch.from_numpy(host64), torch.from_numpy(host32)
        start32 = -(-host64.nbytes // 16) * 16
        # Filled by numpy, not torch's copy: torch parallelizes copies past 32K elements on its OpenMP pool,
        # whose threads then spin-wait, burning cores while the step thread sleeps on the GPU.
        pinned = torch.empty(start32 + host32.nbytes, dtype=torch.uint8, pin_memory=True)
        buf = pinned.numpy()
        buf[: host64.nbytes].view(np.int64)[...] = host64
        buf[start32:].view(np.int32)[...] = host32
        dev = pinned.to(self.device, non_blocking=True)
        return dev[: host64.nbytes].view(torch.int64), dev[start32:].view(torch.int32)

    def prepare(
        self,
        out: SchedulerOutput,
        prev_tokens: torch.Tensor | None = None,
        prev_rows: dict[Sequence, int] | None = None,
    ) -> ModelInput:
        """Flat batch tensors for `out`. A pending token (sampled by the previous, still running step) is read
        on the device from prev_tokens[prev_rows[seq]]: no host round trip. Decodes are gathered with one
        Python pass over the sequences and numpy for the rest; each dtype travels in one host-to-device copy."""
        bs, chunks, tables = self.block_size, out.chunks, self._tables
        num_decodes = len(chunks)
        for i, c in enumerate(chunks):
            if c.num_tokens != 1:
                num_decodes = i
                break
        decodes, prefills = chunks[:num_decodes], chunks[num_decodes:]
        num_seqs = len(chunks)
        rows = np.fromiter((tables.row(c.seq) for c in chunks), np.int64, num_seqs)
        starts = np.fromiter((c.start for c in chunks), np.int64, num_seqs)
        lens = np.fromiter((c.num_tokens for c in chunks), np.int64, num_seqs)
        num_tokens = int(lens.sum())
        ends = starts + lens
        # Token ids: host values, or -1 - (row in prev_tokens) for a pending one (resolved on the device).
        ids = np.empty(num_tokens, np.int64)
        gather = False
        for i, c in enumerate(decodes):  # (per row per step: the known-token count inline)
            seq = c.seq
            pending = seq.num_pending
            if pending and c.start >= len(seq.prompt_token_ids) + len(seq.output_token_ids) - pending:
                row = prev_rows.get(seq) if prev_rows is not None else None
                if row is None:
                    raise RuntimeError(
                        f"{seq.request_id}: pending token at {c.start} without a step to read it from"
                    )
                ids[i] = -1 - row
                gather = True
            else:
                ids[i] = seq.token_id_at(c.start)
        positions = np.empty(num_tokens, np.int64)
        positions[:num_decodes] = starts[:num_decodes]
        offset = num_decodes
        for c in prefills:
            seq, end = c.seq, c.start + c.num_tokens
            if end > seq.num_known_tokens:
                raise RuntimeError(f"{seq.request_id}: a prefill chunk over a pending token")
            n = seq.num_prompt_tokens
            if end <= n:
                ids[offset : offset + c.num_tokens] = seq.prompt_token_ids[c.start : end]
            else:
                ids[offset : offset + c.num_tokens] = seq.all_token_ids[c.start : end]
            positions[offset : offset + c.num_tokens] = np.arange(c.start, end)
            offset += c.num_tokens
        seq_of_token = np.repeat(rows, lens)
        slots = tables.array[seq_of_token, positions // bs].astype(np.int64) * bs + positions % bs
        query_start = np.zeros(num_seqs + 1, np.int64)
        np.cumsum(lens, out=query_start[1:])
        samples = np.fromiter((c.samples for c in chunks), bool, num_seqs)
        sample_indices = query_start[1:][samples] - 1
        width = max(1, int(((ends + bs - 1) // bs).max()))
        # int64: ids | positions | slots | sample indices; int32: query_start | context_lens | block tables.
        # Each part starts 16-byte aligned: Triton specializes a kernel on its pointers' 16-byte alignment, so
        # parts at offsets that vary with the batch would compile new variants mid-run (~1 s of host each).
        host64, offsets64 = _pack([ids, positions, slots, sample_indices], np.int64)
        host32, offsets32 = _pack([query_start, ends, tables.array[rows, :width].reshape(-1)], np.int32)
        num_prev = 0
        if gather:
            assert prev_tokens is not None
            num_prev = prev_tokens.shape[0]
        split = mixed_decode_rows(num_decodes, num_seqs, self.config.mixed_decode_attention)
        packed = PackedStep(host64, host32, (*offsets64, *offsets32), num_tokens, len(sample_indices), num_seqs,
                            width, num_decodes == num_seqs, num_prev, split)
        if self.ranks is not None:  # tensor parallel: every rank runs this step's forward on the same input
            self.ranks.ship(packed, prev_tokens)
        return self.to_device(packed, prev_tokens)

    def to_device(self, packed: PackedStep, prev_tokens: torch.Tensor | None) -> ModelInput:
        """Upload the packed step and slice it into the model's input (every tensor-parallel rank runs this)."""
        o_ids, o_pos, o_slots, o_samples, o_qsl, o_ctx, o_tables = packed.offsets
        i64, i32 = self._upload(packed.host64, packed.host32)
        T, N, B, width = packed.num_tokens, packed.num_samples, packed.num_seqs, packed.width
        input_ids = i64[o_ids : o_ids + T]  # pending ids stay encoded: resolved by the eager forward or the graph
        if packed.num_prev:
            assert prev_tokens is not None
        else:
            prev_tokens = None
        query_start_loc = i32[o_qsl : o_qsl + B + 1]
        nd = packed.num_decodes
        meta = AttentionMetadata(
            slot_mapping=i64[o_slots : o_slots + T],
            block_tables=i32[o_tables : o_tables + B * width].view(B, width),
            query_start_loc=query_start_loc,
            context_lens=i32[o_ctx : o_ctx + B],
            decode_only=packed.decode_only,
            num_decodes=nd,
            # (one small kernel a step; rows 0..nd-1 hold one token each, so the prompt chunks start at nd)
            prompt_query_start_loc=query_start_loc[nd:] - nd if nd else None,
            decode_launch=self._decode_launch(nd) if nd else None,
        )
        return ModelInput(input_ids, i64[o_pos : o_pos + T], meta, i64[o_samples : o_samples + N], prev_tokens)

    def _decode_launch(self, num_decodes: int) -> tuple[int, int]:
        """A mixed step's decode rows launch as the decode graph bucket that would hold them, over the graphs'
        static table (AttentionMetadata.decode_launch): the same buckets with graphs off, so every engine takes
        one set of launches."""
        return pick_bucket(self._graph_buckets, num_decodes), self._tables.array.shape[1] * self.block_size

    def close(self) -> None:
        """Drop the weights, the KV cache and the graphs (the runner is unusable after), and hand the freed
        memory back to the GPU so that another model may use it; stop the other tensor-parallel ranks."""
        if self.ranks is not None:
            self.ranks.close()
        self.graphs = self.prefill_graphs = self.piecewise_graphs = None
        self.kv_caches = []
        self.__dict__.pop("model", None)  # (a second close is a no-op)
        if self.device.type == "cuda":
            gc.collect()  # graphs and modules may sit in reference cycles; their blocks must be free first
            torch.cuda.empty_cache()

    def _capture_piecewise_graphs(self) -> PiecewiseGraphs | None:
        """The batch step's layers between attentions as graph replays (engine/piecewise_graphs.py): with the
        decode graphs, on one GPU, when piecewise_graph_tokens > 0 and the model has the cut."""
        tokens = min(self.config.piecewise_graph_tokens, self.config.max_num_batched_tokens)
        if self.graphs is None or self.comm is not None or tokens < 1 or self.model.num_pieces < 2:
            return None
        from stoker.engine.piecewise_graphs import PiecewiseGraphs

        mc = self.model_config
        graphs = PiecewiseGraphs(self.model, self.kv_caches, self.device, tokens, mc.num_heads, mc.head_dim,
                                 mc.hidden_size, self.dtype)
        return graphs if self._captured("piecewise_graph", graphs) else None

    def _captured(self, name: str, graphs: TokenBucketGraphs) -> bool:
        """graphs.capture() and its startup report (`<name>_capture_s`, `_buckets`, `_pool_mb`). A capture that
        fails (a path the captures were not tried on, e.g. an FP8 variant) leaves those steps eager, logged, rather
        than the engine dead."""
        try:
            self.startup[f"{name}_capture_s"] = graphs.capture()
        except Exception as e:
            log.warning("%s CUDA graphs not captured (%s: %s): those steps run eagerly", name, type(e).__name__, e)
            torch.cuda.synchronize(self.device)
            return False
        self.startup[f"{name}_buckets"] = graphs.sizes
        self.startup[f"{name}_pool_mb"] = round(graphs.pool_bytes / 2**20, 1)
        return True

    def release(self, seq: Sequence) -> None:
        """seq ended: its host block-table row can go to another sequence."""
        self._tables.release(seq)

    @torch.inference_mode()
    def forward(self, inp: ModelInput) -> torch.Tensor:
        """-> float32 logits [N, V] of the sampled rows only (lm_head runs on those rows alone)."""
        if self.ranks is not None:
            with self.ranks.guard():  # a dead rank: TensorParallelError naming it, not a bare gloo/NCCL error
                return self._forward(inp)
        return self._forward(inp)

    def _forward(self, inp: ModelInput) -> torch.Tensor:
        if self.graphs is not None and self.graphs.fits(inp):
            return self.graphs.run(inp)  # decode-only: replay the captured graph of the batch's bucket
        if self.prefill_graphs is not None and self.prefill_graphs.fits(inp):
            return self.prefill_graphs.run(inp)  # one sequence's prompt chunk alone
        if self.piecewise_graphs is not None and self.piecewise_graphs.fits(inp):
            return self.piecewise_graphs.run(inp)  # any other step with prompt tokens: graphs between attentions
        input_ids = resolve_pending(inp.input_ids, inp.prev_tokens)
        hidden = self.model(input_ids, inp.positions, inp.meta, self.kv_caches)
        return self.model.compute_logits(hidden[inp.sample_indices])

    @torch.inference_mode()
    def forward_shard(self, inp: ModelInput) -> None:
        """Ranks > 0: the forward up to the hidden states (its all-reduces meet rank 0's); no LM head."""
        if self.graphs is not None and self.graphs.fits(inp):
            self.graphs.run(inp)
        else:
            self.model(resolve_pending(inp.input_ids, inp.prev_tokens), inp.positions, inp.meta, self.kv_caches)

    @torch.inference_mode()
    def sample_async(self, logits: torch.Tensor, rows: list[SamplingRequest]) -> PendingSample:
        """Launch sampling; the result's token_ids stay on the device (the next step reads them) and host
        copies arrive behind them. Nothing here waits for the GPU."""
        batch = SamplingBatch.build(rows, logits.shape[-1], self.device)
        out = self.sampler(logits, batch, greedy=self.graphs.greedy_for(logits) if self.graphs is not None else None)
        if self.device.type != "cuda":
            return PendingSample(out.token_ids, out, None)
        return PendingSample(out.token_ids, *_to_host_async(out))

    def sample(self, logits: torch.Tensor, rows: list[SamplingRequest]) -> SamplerOutput:
        return self.sample_async(logits, rows).wait()


_CU_CTX_SCHED_BLOCKING_SYNC = 0x4
_CU_CTX_SCHED_MASK = 0x7


def _blocking_sync(device: torch.device) -> bool:
    """Make every host wait on this GPU sleep instead of spin: the primary context's scheduling flag set to
    blocking sync (driver API through ctypes). CUDA's default (auto) spins a core whenever fewer contexts
    than cores exist, so any wait torch does for us (a stream sync, a pageable copy, a full launch queue)
    burned a core per worker. Our one wait per step (PendingSample.wait) already sleeps; this covers the rest.
    Before the context exists the primary context's flags apply at its creation; if torch created it already,
    the live context's flags are set (cuCtxSetFlags, CUDA >= 12.1). Failure only logs."""
    import ctypes

    try:
        cuda = ctypes.CDLL("libcuda.so.1")
        index = device.index if device.index is not None else torch.cuda.current_device()
        dev, flags, active = ctypes.c_int(), ctypes.c_uint(), ctypes.c_int()
        if cuda.cuInit(0) or cuda.cuDeviceGet(ctypes.byref(dev), index):
            raise RuntimeError("cuInit/cuDeviceGet failed")
        if cuda.cuDevicePrimaryCtxGetState(dev, ctypes.byref(flags), ctypes.byref(active)):
            raise RuntimeError("cuDevicePrimaryCtxGetState failed")
        new = (flags.value & ~_CU_CTX_SCHED_MASK) | _CU_CTX_SCHED_BLOCKING_SYNC
        err = cuda.cuDevicePrimaryCtxSetFlags_v2(dev, ctypes.c_uint(new))
        if err:
            raise RuntimeError(f"cuDevicePrimaryCtxSetFlags_v2 returned CUDA error {err}")
        if active.value:  # already created (torch ran before us): set the live context's flags too
            # cuCtxSetFlags (CUDA >= 12.1) acts on the current context: make the primary one current for the
            # call (retain/push, then pop/release: reference counts and this thread's state are unchanged).
            ctx = ctypes.c_void_p()
            if cuda.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev):
                raise RuntimeError("cuDevicePrimaryCtxRetain failed")
            try:
                if cuda.cuCtxPushCurrent_v2(ctx):
                    raise RuntimeError("cuCtxPushCurrent failed")
                try:
                    err = cuda.cuCtxSetFlags(ctypes.c_uint(new))
                    cuda.cuCtxGetFlags(ctypes.byref(flags))
                finally:
                    cuda.cuCtxPopCurrent_v2(ctypes.byref(ctypes.c_void_p()))
            finally:
                cuda.cuDevicePrimaryCtxRelease_v2(dev)
            if err:
                raise RuntimeError(f"cuCtxSetFlags returned CUDA error {err} on the live context")
        else:
            cuda.cuDevicePrimaryCtxGetState(dev, ctypes.byref(flags), ctypes.byref(active))
        ok = flags.value & _CU_CTX_SCHED_MASK == _CU_CTX_SCHED_BLOCKING_SYNC
        log.info(
            "GPU %d waits: blocking sync %s (context flags %#x)", index, "on" if ok else "NOT on", flags.value
        )
        return bool(ok)
    except Exception as e:  # no driver library, an old driver: keep CUDA's default scheduling
        log.warning("could not set blocking-sync scheduling on %s (%s): host waits may spin", device, e)
        return False


def mixed_decode_rows(num_decodes: int, num_seqs: int, enabled: bool) -> int:
    """How many of a mixed step's decode rows go through the decode kernel (the rest, 0-3, run in the prefill
    kernel with the prompt chunks); 0 for a decode-only step or with EngineConfig.mixed_decode_attention off.
    H200: 16.9 us a row instead of 23.0 in W2 (BENCHMARKS.md 18:20 UTC). A multiple of 4 keeps every int32 view
    after them 16-byte aligned (Triton specializes pointers on it: other counts would compile variants mid-run)."""
    return num_decodes - num_decodes % 4 if enabled and num_decodes < num_seqs else 0


def _pack(parts: list[np.ndarray], dtype: type[np.integer]) -> tuple[np.ndarray, list[int]]:
    """Concatenate parts as `dtype`, each starting at a 16-byte boundary -> (array, start of each part)."""
    align = 16 // np.dtype(dtype).itemsize
    starts, end = [], 0
    for p in parts:
        starts.append(end)
        end += -(-len(p) // align) * align
    out = np.zeros(max(end, 1), dtype)  # zeroed padding: never read, but keeps the upload deterministic
    for p, start in zip(parts, starts, strict=True):
        out[start : start + len(p)] = p
    return out, starts


@dataclass(slots=True)
class PendingSample:
    device_token_ids: torch.Tensor  # [N] int64 on the device: the next step's pending input ids
    host: SamplerOutput  # host tensors, valid once wait() returned
    done: torch.cuda.Event | None  # recorded after the device-to-host copies (None on the CPU)

    def wait(self) -> SamplerOutput:
        """The step's one host sync: a blocking-sync event, so the CPU sleeps instead of spinning while the GPU
        finishes (spinning would burn a core per worker)."""
        if self.done is not None:
            self.done.synchronize()
            self.done = None
        return self.host


def _to_host_async(out: SamplerOutput) -> tuple[SamplerOutput, torch.cuda.Event]:
    """non_blocking copies into pinned memory, then an event (blocking sync) recorded behind them."""

    def host(t: torch.Tensor) -> torch.Tensor:
        return torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t, non_blocking=True)

    def maybe(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else host(t)

    res = SamplerOutput(host(out.token_ids), maybe(out.logprobs), maybe(out.top_ids), maybe(out.top_logprobs))
    done = torch.cuda.Event(blocking=True)
    done.record()
    return res, done


class _BlockTables:
    """Host mirror of the block tables, one row per live sequence, updated by appending what is new: a decode
    step copies rows with numpy instead of rebuilding padded Python lists. A row is rewritten when its
    sequence was preempted (its table was rebuilt) and handed back by release() when the sequence ends."""

    def __init__(self, max_blocks: int):
        self.array = np.zeros((64, max_blocks), np.int32)
        self._free: list[int] = list(range(63, -1, -1))
        self._rows: dict[Sequence, tuple[int, int, int]] = {}  # seq -> (row, entries written, preemptions)

    def row(self, seq: Sequence) -> int:
        table = seq.block_table
        if len(table) > self.array.shape[1]:
            raise ValueError(
                f"{seq.request_id}: {len(table)} blocks exceed max_model_len ({self.array.shape[1]} blocks)"
            )
        entry = self._rows.get(seq)
        if entry is None:
            if not self._free:  # grow: double the rows
                old = self.array.shape[0]
                self.array = np.concatenate([self.array, np.zeros_like(self.array)])
                self._free = list(range(2 * old - 1, old - 1, -1))
            row, written = self._free.pop(), 0
        else:
            row, written, preemptions = entry
            if preemptions != seq.num_preemptions:
                written = 0
            elif written == len(table):
                return row
        self.array[row, written : len(table)] = table[written:]
        self._rows[seq] = (row, len(table), seq.num_preemptions)
        return row

    def release(self, seq: Sequence) -> None:
        entry = self._rows.pop(seq, None)
        if entry is not None:
            self._free.append(entry[0])
