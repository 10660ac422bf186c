"""What one step runs: the flat token batch and what attention needs to read and write the paged KV cache.

A leaf: the model runner builds these, the model and its layers read them, the CUDA-graph runner keeps
static copies of them. It imports nothing of ours, so none of those needs to import another for the types.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass(slots=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] int64: flat cache slot of each token
    block_tables: torch.Tensor  # [B, max_blocks] int32, padded with 0 (never read past context_lens)
    query_start_loc: torch.Tensor  # [B+1] int32: sequence b owns tokens [qsl[b], qsl[b+1])
    context_lens: torch.Tensor  # [B] int32: tokens in the cache for b after this step
    decode_only: bool  # every sequence has exactly one query token (the decode kernel's case)
    # A mixed step (decodes and prompt chunks): its first num_decodes sequences have one query token each and
    # go through the decode kernel, the rest through the prefill kernel with prompt_query_start_loc ([B -
    # num_decodes + 1] int32: query starts relative to the first prompt token). 0: every row through the
    # prefill kernel (decode-only steps, and mixed steps with EngineConfig.mixed_decode_attention off).
    num_decodes: int = 0
    prompt_query_start_loc: torch.Tensor | None = None
    # (rows, table tokens): the decode rows of a mixed step launch their kernel as a decode-only batch of that many
    # rows over a block table that many tokens wide would (its split count and combine): the CUDA-graph bucket
    # holding them, whose variant the capture compiled. None: as their own shapes ask.
    decode_launch: tuple[int, int] | None = None


@dataclass(slots=True)
class ModelInput:
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    meta: AttentionMetadata
    sample_indices: torch.Tensor  # [N] int64: rows of the hidden states whose logits are sampled
    # The previous step's sampled ids [P] when some input_ids are pending (encoded -1 - row), else None:
    # resolve_pending() reads them on the device (eagerly, or inside the decode graph).
    prev_tokens: torch.Tensor | None = None


def resolve_pending(input_ids: torch.Tensor, prev_tokens: torch.Tensor | None) -> torch.Tensor:
    """input_ids with each pending entry (-1 - r) replaced by prev_tokens[r]: a device-side gather, no host
    round trip. Rows >= 0 pass through; a CUDA graph runs this every replay (the where is the identity then)."""
    if prev_tokens is None:
        return input_ids
    rows = (-1 - input_ids).clamp(min=0, max=prev_tokens.shape[0] - 1)
    return torch.where(input_ids < 0, prev_tokens[rows], input_ids)


@dataclass(slots=True)
class PackedStep:
    """One step's input as two host arrays before upload: what rank 0 ships to the other tensor-parallel
    ranks, each of which uploads and slices it as rank 0 does (ModelRunner.to_device)."""

    host64: np.ndarray  # int64: ids | positions | slots | sample indices, each part 16-byte aligned
    host32: np.ndarray  # int32: query_start | context_lens | block tables
    offsets: tuple[int, ...]  # 7 starts: of ids, positions, slots, samples; qsl, ctx, tables
    num_tokens: int
    num_samples: int
    num_seqs: int
    width: int  # block-table columns
    decode_only: bool
    num_prev: int  # > 0: some ids are pending, read on the device from the previous step's [num_prev] sample
    num_decodes: int = 0  # AttentionMetadata.num_decodes
