"""CUDA graphs for the batch step: the forward cut at every attention, each piece between two attentions one graph
per token bucket, the attentions launched eagerly between the replays ("piecewise" graphs, as vLLM calls them).

Why: a step of several prompts, or of prompt chunks beside decode rows (every prefill step of W2, and most steps
under a steady arrival of requests), ran its forward eagerly: at the 8B shape ~330 launches through Python (norms,
GEMMs, rotary + cache write, attention, SiLU-mul, ~10 a layer). On the H200's host that is 27.3 ms of CPU for an
8,192-token step unprofiled (ops/step_profile.py, session 11), ~32 ms on the engine's stepping thread: W2's 68
prefill steps spent ~2.2 CPU-s launching, the largest part of the worker's CPU in W2 (issue 12: <= 0.3 cores); at
a 2,048-token budget the engine thread needed 0.62 cores. Steps under a few hundred tokens were launch-bound: the
GPU waited for the host. The attention cannot be captured as it is: its grids and its split between the decode and
prefill kernels follow the step's sequences. Everything else in a layer depends on the token count alone.

What: at startup, per token bucket (bucket_sizes), the model's pieces (CausalLM.piece: piece 0 the embedding and
layer 0 up to its attention; piece i layer i-1's o_proj and MLP and layer i up to its attention; the last one the
final norm) are captured over static buffers: token ids, positions, slots (-1 = write no K/V), q (each piece's
rotary writes its q there), the attention output (every piece after the first reads it) and the final hidden
states. All buckets share one memory pool, largest first. A piece's residual sum lives in the pool: the next
piece's capture holds it, later captures may reuse its memory, so replays follow capture order within a bucket
(a step replays its bucket's pieces in order, and buckets never interleave). A step then costs ~num_layers + 1
replays and one or two attention launches a layer, and its sampled rows' logits are computed eagerly from the
static hidden states.

Padding rows past the step's tokens: slot -1 (no K/V write), stale but valid token ids and positions, attention
output rows left from earlier steps (finite), and nobody reads their hidden states. Rows are independent in
every captured op, so padding changes no real row (cuBLAS may pick another algorithm for the bucket's row count:
rounding, not results, can differ from the eager step).
"""

from __future__ import annotations

from typing import Any

import torch
from stoker.engine.batch import AttentionMetadata, ModelInput
from stoker.engine.cuda_graphs import TokenBucketGraphs
from stoker.engine.models.base import CausalLM

MIN_TOKENS = 64  # the smallest bucket
STEPS_PER_OCTAVE = 4  # buckets between two powers of two (padding < 25 % above 256 tokens)


def bucket_sizes(max_tokens: int) -> list[int]:
    """64, 128, 192, 256, then STEPS_PER_OCTAVE buckets per doubling (320, 384, 448, 512, 640, .., 7168,
    8192), ending at max_tokens rounded up to a multiple of 64: every bucket a multiple of 16 (Triton specializes
    integer arguments on divisibility by 16)."""
    if max_tokens < 1:
        raise ValueError(f"piecewise graphs: max_tokens must be >= 1, got {max_tokens}")
    top = -(-max_tokens // MIN_TOKENS) * MIN_TOKENS
    sizes, t = [], MIN_TOKENS
    while t < top:
        sizes.append(t)
        octave = 1 << (t.bit_length() - 1)  # the power of two at or below t
        t += max(MIN_TOKENS, octave // STEPS_PER_OCTAVE)
    return sizes + [top]


class PiecewiseGraphs(TokenBucketGraphs):
    def __init__(self, model: CausalLM, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], device: torch.device,
                 max_tokens: int, num_heads: int, head_dim: int, hidden_size: int, dtype: torch.dtype):
        if model.num_pieces < 2:
            raise ValueError(f"piecewise graphs: {type(model).__name__} has no forward cut at its attentions")
        super().__init__(device, bucket_sizes(max_tokens))
        self.model, self.kv_caches = model, kv_caches
        top = self.sizes[-1]
        self.q = torch.zeros(top, num_heads, head_dim, dtype=dtype, device=device)
        self.attention = torch.zeros(top, num_heads, head_dim, dtype=dtype, device=device)
        self.hidden = torch.zeros(top, hidden_size, dtype=dtype, device=device)
        self.graphs: dict[int, list[torch.cuda.CUDAGraph]] = {}

    def _meta(self, tokens: int) -> AttentionMetadata:
        """The pieces read only the slots (the cache write); the rest of the metadata is the eager attention's."""
        none = self.slot_mapping[:0].to(torch.int32)
        return AttentionMetadata(self.slot_mapping[:tokens], none.view(0, 0), none, none, decode_only=False)

    def _piece(self, i: int, tokens: int, meta: AttentionMetadata, residual: torch.Tensor | None) -> torch.Tensor:
        """Piece i of a `tokens` bucket over the static buffers -> the residual sum it leaves for the next piece."""
        x = self.input_ids[:tokens] if i == 0 else self.attention[:tokens]
        out, residual = self.model.piece(i, x, residual, self.positions[:tokens], meta, self.kv_caches,
                                         self.q[:tokens])
        if i == self.model.num_pieces - 1:
            self.hidden[:tokens].copy_(out)
        return residual

    def _warm(self, tokens: int) -> None:
        residual, meta = None, self._meta(tokens)
        for i in range(self.model.num_pieces):  # (the attention output stays as it is)
            residual = self._piece(i, tokens, meta, residual)

    def _capture_bucket(self, tokens: int, pool: Any) -> None:
        meta, graphs, residual = self._meta(tokens), [], None
        for i in range(self.model.num_pieces):
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                new_residual = self._piece(i, tokens, meta, residual)
            graphs.append(graph)
            residual = new_residual  # the previous sum is dead now: later captures may reuse its memory
        self.graphs[tokens] = graphs

    def fits(self, inp: ModelInput) -> bool:
        """A step with prompt tokens (decode-only steps have their own graphs) within the largest bucket."""
        return self.enabled and not inp.meta.decode_only and 1 <= inp.input_ids.shape[0] <= self.sizes[-1]

    def run(self, inp: ModelInput) -> torch.Tensor:
        """Copy the step's ids, positions and slots into the static buffers (on the device), replay its bucket's
        pieces with the attentions between them -> float32 logits [N, V] of the sampled rows. No host sync."""
        tokens, meta = inp.input_ids.shape[0], inp.meta
        bucket = self._bucket_inputs(inp)
        q, out = self.q[:tokens], self.attention[:tokens]
        graphs = self.graphs.get(bucket)  # None before capture (the CPU tests): the same pieces, eagerly
        last, residual = self.model.num_pieces - 1, None
        eager_meta = self._meta(bucket) if graphs is None else None
        for i in range(last + 1):
            if graphs is not None:
                graphs[i].replay()
            else:
                assert eager_meta is not None
                residual = self._piece(i, bucket, eager_meta, residual)
            if i < last:
                self.model.attend(i, q, meta, self.kv_caches, out)
        self.replays += 1
        return self.model.compute_logits(self.hidden[inp.sample_indices])
