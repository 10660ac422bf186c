"""Two-nano-batch decode (issue 13 item 4): a large decode-only step cut into two halves whose stages interleave
on two CUDA streams, so that one half's GEMMs run while the other half's attention does.

Why: at batch 1,024 (8B shape, bf16, H200) a decode step is GEMMs 22.2 ms (compute-bound) + attention 18.3 ms
(bandwidth-bound) one after the other (BENCHMARKS.md, 12:06 UTC); the two use different limits of the chip.

Each layer is three stages per half: P (input norm, qkv, q/k norms, rotary + cache write), T (paged decode
attention) and Q (o_proj, post-attention norm, gate_up, SiLU-mul, down). A half's chain is P0 T0 Q0 P1 T1 Q1 ..
The GEMM lane (the caller's stream) runs P and Q of both halves, the attention lane (a side stream) runs T:

    GEMM lane:  P0(a) P0(b) Q0(a) P1(a) Q0(b) P1(b) Q1(a) P2(a) ...
    attention:        T0(a) T0(b)       T1(a)       T1(b) ...

so Q_l(a) + P_l+1(a) run beside T_l(b), and Q_l(b) + P_l+1(b) beside T_l+1(a). The lanes meet through events
(fork/join), which a CUDA graph captures as edges. On the CPU (or with no side stream) the lanes are one and
the same stages run in the same order, in sequence: the code path the CPU tests check against the plain order.

Measured (ops/bench_overlap.py, BENCHMARKS.md 14:44 UTC): 3.7 % SLOWER than the plain order at batch 1,024, so
EngineConfig.decode_overlap is off. Each kernel already fills the chip (attention needs about half the SMs for
3 TB/s; the GEMMs lose time near-linearly with SMs), so the two lanes run one after the other anyway and the split
itself costs 3.5 %. Under the 700 W cap, where W2 runs, it loses 3.6 % as well (`--sustained`, BENCHMARKS.md
2026-12-04 18:50 UTC): both lanes draw from one power budget. Kept behind the switch for other shapes and GPUs
(re-measure there with ops/bench_overlap.py).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from stoker.engine import kernels
from stoker.engine.batch import AttentionMetadata
from stoker.engine.kernels.decode_persistent import paged_decode_attention_persistent


@dataclass(slots=True)
class NanoBatchPlan:
    min_rows: int  # decode-only steps of at least this many rows take the two-half path
    side: torch.cuda.Stream | None  # the attention lane; None: one lane (the CPU), halves in sequence
    # > 0 (CUDA): the SMs are split instead of shared: attention on this many persistent programs (one per SM,
    # kernels/decode_persistent.py) and the GEMMs at cuBLAS's SM target of the rest (the cublasLt path).
    attention_sms: int = 0


def make_plan(enabled: bool, min_rows: int, device: torch.device, attention_sms: int = 0) -> NanoBatchPlan | None:
    if not enabled:
        return None
    if min_rows < 2:
        raise ValueError(f"two-nano-batch decode needs min_rows >= 2 (two non-empty halves), got {min_rows}")
    if attention_sms < 0:
        raise ValueError(f"two-nano-batch decode: attention_sms must be >= 0, got {attention_sms}")
    if device.type != "cuda":
        return NanoBatchPlan(min_rows, None)  # one lane: nothing to split
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    if attention_sms >= sms:
        raise ValueError(f"two-nano-batch decode: attention_sms={attention_sms} leaves the GEMMs no SM of {sms}")
    return NanoBatchPlan(min_rows, torch.cuda.Stream(device), attention_sms)


def takes_nano_batches(plan: NanoBatchPlan | None, hidden: torch.Tensor, meta: AttentionMetadata) -> bool:
    return plan is not None and meta.decode_only and hidden.shape[0] >= plan.min_rows


def split_meta(meta: AttentionMetadata, rows: int) -> tuple[AttentionMetadata, AttentionMetadata]:
    """A decode-only batch's metadata cut after `rows` sequences (one token each). Views, except the second
    half's query_start_loc (rebased to start at 0: one small op, never read by the decode kernel)."""
    qsl = meta.query_start_loc
    first = AttentionMetadata(meta.slot_mapping[:rows], meta.block_tables[:rows], qsl[: rows + 1],
                              meta.context_lens[:rows], decode_only=True)
    second = AttentionMetadata(meta.slot_mapping[rows:], meta.block_tables[rows:], qsl[rows:] - qsl[rows],
                               meta.context_lens[rows:], decode_only=True)
    return first, second


class _Lanes:
    """The GEMM lane (the current stream) and the attention lane; on one lane every call runs in place."""

    def __init__(self, side: torch.cuda.Stream | None):
        self.side = side
        self.main = torch.cuda.current_stream() if side is not None else None

    def attend(self, fn: Callable[[], torch.Tensor], inputs: Sequence[torch.Tensor]) -> tuple[torch.Tensor, Any]:
        """Run fn on the attention lane after everything queued so far on the GEMM lane -> (its output, the
        event that marks it done)."""
        if self.side is None or self.main is None:
            return fn(), None
        ready = torch.cuda.Event()
        ready.record(self.main)
        self.side.wait_event(ready)
        with torch.cuda.stream(self.side):
            out = fn()
            done = torch.cuda.Event()
            done.record(self.side)
        # Allocator bookkeeping: these blocks are in use on the other lane too, so a free on their own
        # stream must not hand them out again before that lane's work ran (during a graph capture the
        # caching allocator defers such frees to the capture's end).
        for t in inputs:
            t.record_stream(self.side)
        out.record_stream(self.main)
        return out, done

    def join(self, done: Any) -> None:
        """The GEMM lane waits for an attention-lane event."""
        if done is not None and self.main is not None:
            self.main.wait_event(done)


@dataclass(slots=True)
class _Half:
    hidden: torch.Tensor  # [t, H]: the layer input, or the last MLP output
    residual: torch.Tensor | None
    positions: torch.Tensor
    meta: AttentionMetadata
    attention: torch.Tensor | None = None  # [t, Hq, D]: the pending attention output (stage T done or queued)
    done: Any = None  # its event on the attention lane


def nano_batch_layers(
    plan: NanoBatchPlan, layers: Iterable[Any], hidden: torch.Tensor, positions: torch.Tensor,
    meta: AttentionMetadata, kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor]],
) -> tuple[torch.Tensor, torch.Tensor]:
    """The decoder layers (LlamaDecoderLayer: input_layernorm, self_attn, post_attention_layernorm, mlp) over
    a decode-only batch in two halves -> (last MLP output, residual) [T, H] each, as the plain loop returns
    them (the final norm adds them)."""
    rows = hidden.shape[0] // 2
    meta_a, meta_b = split_meta(meta, rows)
    halves = [_Half(hidden[:rows], None, positions[:rows], meta_a),
              _Half(hidden[rows:], None, positions[rows:], meta_b)]
    lanes = _Lanes(plan.side)
    with _gemm_sm_share(plan.attention_sms):
        _interleave(layers, halves, kv_caches, lanes, plan.attention_sms)
    residuals = [h.residual for h in halves if h.residual is not None]
    return torch.cat([h.hidden for h in halves]), torch.cat(residuals)


def _interleave(layers: Iterable[Any], halves: list[_Half], kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor]],
                lanes: _Lanes, attention_sms: int) -> None:
    """The schedule of the module docstring: per layer and half, Q of the previous layer, P, then T queued."""
    previous: Any = None  # LlamaDecoderLayer (typed loosely: this module does not import the model)
    for layer, (k_cache, v_cache) in zip(layers, kv_caches, strict=True):
        for half in halves:
            if previous is not None:
                _finish_layer(previous, half, lanes)
            q = _before_attention(layer, half, k_cache, v_cache)
            half.attention, half.done = lanes.attend(
                _attention(layer, q, k_cache, v_cache, half.meta, attention_sms), (q,))
        previous = layer
    assert previous is not None, "a model with no layers"
    for half in halves:
        _finish_layer(previous, half, lanes)


class _gemm_sm_share:
    """cuBLAS's SM count target lowered by n SMs meanwhile (a CUDA graph captured inside keeps it): through
    torch's experimental SM carve-out, which only the cublasLt path reads, so that backend is preferred
    meanwhile. n = 0: nothing changes."""

    def __init__(self, n: int):
        self.n = n
        self.saved: tuple[Any, int | None] = (None, None)

    def __enter__(self) -> None:
        if self.n:
            self.saved = (torch.backends.cuda.preferred_blas_library(), torch._C._get_sm_carveout_experimental())
            torch.backends.cuda.preferred_blas_library("cublaslt")
            torch._C._set_sm_carveout_experimental(self.n)

    def __exit__(self, *exc: Any) -> None:
        if self.n:
            torch.backends.cuda.preferred_blas_library(self.saved[0])
            torch._C._set_sm_carveout_experimental(self.saved[1])


def _before_attention(layer: Any, half: _Half, k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
    """Stage P: input norm (+ residual add), then qkv, q/k norms, rotary and the cache write -> q."""
    x, half.residual = layer.input_layernorm(half.hidden, half.residual)
    q: torch.Tensor = layer.self_attn.project(x, half.positions, half.meta, k_cache, v_cache)
    return q


def _attention(layer: Any, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               meta: AttentionMetadata, attention_sms: int) -> Callable[[], torch.Tensor]:
    """Stage T as a call for the attention lane: the layer's own attention, or with the SMs split the
    persistent-grid kernel on attention_sms programs (a cache in q's dtype, Triton on; else the layer's)."""
    attn = layer.self_attn.attn
    if attention_sms and kernels.use_triton(q) and k_cache.dtype == q.dtype:
        return lambda: paged_decode_attention_persistent(q, k_cache, v_cache, meta.block_tables, meta.context_lens,
                                                         attn.scale, attention_sms)
    return lambda: attn(q, k_cache, v_cache, meta)


def _finish_layer(layer: Any, half: _Half, lanes: _Lanes) -> None:
    """Stage Q, once the half's attention is done: o_proj, post-attention norm (+ residual), the MLP."""
    lanes.join(half.done)
    attention, half.attention, half.done = half.attention, None, None
    assert attention is not None
    attn = layer.self_attn
    out = attn.o_proj(attention.reshape(attention.shape[0], attn.q_size))
    x, half.residual = layer.post_attention_layernorm(out, half.residual)
    half.hidden = layer.mlp(x)
