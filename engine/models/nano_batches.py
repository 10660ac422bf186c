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
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from stoker.engine.batch import AttentionMetadata


@dataclass(slots=True)
class NanoBatchPlan:
    min_rows: int  # decode-only steps of at least this many rows take the two-half path
    side: torch.cuda.Stream | None  # the attention lane; None: one lane (the CPU), halves in sequence


def make_plan(enabled: bool, min_rows: int, device: torch.device) -> NanoBatchPlan | None:
    if not enabled:
        return None
    if min_rows < 2:
        raise ValueError(f"two-nano-batch decode needs min_rows >= 2 (two non-empty halves), got {min_rows}")
    side = torch.cuda.Stream(device) if device.type == "cuda" else None
    return NanoBatchPlan(min_rows, side)


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
    previous: Any = None  # LlamaDecoderLayer (typed loosely: this module does not import the model)
    for layer, (k_cache, v_cache) in zip(layers, kv_caches, strict=True):
        for half in halves:
            if previous is not None:
                _finish_layer(previous, half, lanes)
            q = _before_attention(layer, half, k_cache, v_cache)
            half.attention, half.done = lanes.attend(_attention(layer, q, k_cache, v_cache, half.meta), (q,))
        previous = layer
    assert previous is not None, "a model with no layers"
    for half in halves:
        _finish_layer(previous, half, lanes)
    residuals = [h.residual for h in halves if h.residual is not None]
    return torch.cat([h.hidden for h in halves]), torch.cat(residuals)


def _before_attention(layer: Any, half: _Half, k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
    """Stage P: input norm (+ residual add), then qkv, q/k norms, rotary and the cache write -> q."""
    x, half.residual = layer.input_layernorm(half.hidden, half.residual)
    q: torch.Tensor = layer.self_attn.project(x, half.positions, half.meta, k_cache, v_cache)
    return q


def _attention(layer: Any, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               meta: AttentionMetadata) -> Callable[[], torch.Tensor]:
    """Stage T as a call for the attention lane."""
    attn = layer.self_attn.attn
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
