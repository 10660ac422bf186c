"""Tensor-parallel twins of the linear layers (Megatron style, as gpt-fast's tp.py splits them).

Each is built with the per-rank sizes (engine/parallel/plan.py's rank_model_config), so its parameters are
exactly this rank's shard, and each names the part of a checkpoint tensor it needs (`checkpoint_slice`): the
loader reads only that part through safetensors' get_slice, so no rank materialises a whole weight.

- q | k | v and gate | up: column-parallel. A rank's rows are its heads (q, and k/v split or replicated) and
  the same intermediate indices of gate and up, so silu(gate) * up and attention stay local.
- o_proj and down_proj: row-parallel (the columns matching those heads / intermediate indices), then one
  all-reduce each: two per layer.
- Embedding and LM head: replicated. Vocab-parallel would save (V x H) / size per rank (1 GB of bf16 for
  Llama-3-8B's LM head at TP=2) and split the LM head's GEMV, but costs a collective per step (an all-reduce of
  the embedding, an all-gather of the logits) and needs the sampler's whole row on rank 0 anyway; at TP 2-8 the
  replicated copy fits, and ranks > 0 never run the LM head at all (they do not sample).

The FP8 layers' twins (engine/layers/fp8.py) slice their weights with the same functions below (qkv_rows,
gate_up_rows, row_parallel_columns), so a bf16 and an FP8 rank hold the same rows and columns.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from stoker.engine.layers.linear import GateUpLinear, Linear, QKVLinear
from stoker.engine.parallel.plan import ShardPlan


def qkv_rows(plan: ShardPlan, shard: str, rows: int, head_dim: int, local_kv_heads: int) -> slice:
    """The checkpoint rows of q_proj / k_proj / v_proj (`shard`) that this rank's `rows` rows of it are."""
    start = plan.rank * rows if shard == "q" else plan.kv_head_start(local_kv_heads) * head_dim
    return slice(start, start + rows)


def gate_up_rows(plan: ShardPlan, local_intermediate: int) -> slice:
    """The checkpoint rows of gate_proj and of up_proj this rank holds (the same indices of both)."""
    return slice(plan.rank * local_intermediate, (plan.rank + 1) * local_intermediate)


def row_parallel_columns(plan: ShardPlan, local_input: int) -> slice:
    """The checkpoint columns of o_proj / down_proj this rank holds: those its column-parallel input holds."""
    return slice(plan.rank * local_input, (plan.rank + 1) * local_input)


class ColumnParallelQKV(QKVLinear):
    """This rank's q heads and KV heads: [T, H] -> [T, (Hq/size + 2 Hkv_local) D]."""

    def __init__(self, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int, *, bias: bool,
                 dtype: torch.dtype, shard: ShardPlan):
        super().__init__(hidden_size, num_heads, num_kv_heads, head_dim, bias=bias, dtype=dtype)
        self.shard, self.head_dim = shard, head_dim
        self.num_local_kv_heads = num_kv_heads

    def checkpoint_slice(self, param_name: str, shard: str) -> tuple[slice, ...]:
        rows = self.shard_rows[shard].stop - self.shard_rows[shard].start
        # rows of the weight [out, in] and of the bias [out]
        return (qkv_rows(self.shard, shard, rows, self.head_dim, self.num_local_kv_heads),)


class ColumnParallelGateUp(GateUpLinear):
    """The same intermediate rows of gate and of up: [T, H] -> [T, 2 I/size]."""

    def __init__(self, hidden_size: int, intermediate_size: int, *, dtype: torch.dtype, shard: ShardPlan):
        super().__init__(hidden_size, intermediate_size, dtype=dtype)
        self.shard, self.local_intermediate = shard, intermediate_size

    def checkpoint_slice(self, param_name: str, shard: str) -> tuple[slice, ...]:
        return (gate_up_rows(self.shard, self.local_intermediate),)


class RowParallelLinear(Linear):
    """This rank's input columns: [T, in/size] -> partial [T, out], summed over the ranks."""

    def __init__(self, input_size: int, output_size: int, *, bias: bool = False, dtype: torch.dtype,
                 shard: ShardPlan):
        super().__init__(input_size, output_size, bias=bias, dtype=dtype)
        self.shard = shard

    def checkpoint_slice(self, param_name: str, shard: str) -> tuple[slice, ...] | None:
        if param_name == "bias":
            return None  # whole: added once, after the sum
        return (slice(None), row_parallel_columns(self.shard, self.input_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.shard.comm.all_reduce(F.linear(x, self.weight))
        return out if self.bias is None else out + self.bias

    def forward_add(self, x: torch.Tensor, residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        # The residual is added once, after the sum over the ranks: in the norm, as without the epilogue add.
        return self(x), residual


_TP_TWINS: dict[type[Linear], type[Linear]] = {
    QKVLinear: ColumnParallelQKV, GateUpLinear: ColumnParallelGateUp,
    # The plain linears a Llama block builds (o_proj, down_proj) are the ones whose input is split by the
    # column-parallel layer before them; a model with a plain column-parallel linear needs its own twin.
    Linear: RowParallelLinear,
}


def tensor_parallel_twin(cls: type[Linear]) -> type[Linear]:
    return _TP_TWINS[cls]
