"""How one model is split over a tensor-parallel group (Megatron style), in pure Python.

Rank r of `size` holds q heads [r*Hq/size, (r+1)*Hq/size), the KV heads those q heads read, and the slice
[r*I/size, (r+1)*I/size) of the MLP's intermediate dimension. KV heads are split when size divides them and
replicated otherwise (size a multiple of Hkv: each KV head lives on size/Hkv ranks, e.g. Llama-3-70B's 8 KV
heads at TP=16), which keeps every q head beside the one KV head it attends with. The embedding and the LM
head stay whole on every rank (see engine/layers/tensor_parallel.py for why).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar


class AllReduce(Protocol):
    # Tensors typed Any: this module stays free of torch (engine.model_config, which must, names ShardPlan).
    def all_reduce(self, x: Any) -> Any:
        """Sum x over the ranks, in place; returns x."""
        ...


class _Shape(Protocol):
    """What the split reads of a ModelConfig (a protocol: engine.model_config imports this module's plan)."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    quantization: Any  # engine.quant_config.Fp8Scheme | None


_Model = TypeVar("_Model", bound=_Shape)


@dataclass(frozen=True, slots=True)
class ShardPlan:
    rank: int
    size: int
    kv_replicas: int  # ranks holding each KV head: 1 when the KV heads are split, size/Hkv when replicated
    comm: AllReduce  # the group's sum over ranks (the row-parallel layers call it)

    def kv_head_start(self, local_kv_heads: int) -> int:
        """First checkpoint KV head this rank holds."""
        return (self.rank // self.kv_replicas) * local_kv_heads


def valid_sizes(model: _Shape) -> list[int]:
    """Every tensor-parallel size this model can be split into (up to its q head count)."""
    return [n for n in range(1, model.num_heads + 1) if not shard_problems(model, n)]


def shard_problems(model: _Shape, size: int) -> list[str]:
    problems = []
    if model.num_heads % size:
        problems.append(f"num_attention_heads={model.num_heads} is not divisible by it")
    if model.num_kv_heads % size and size % model.num_kv_heads:
        problems.append(f"num_key_value_heads={model.num_kv_heads} neither divides it nor is divisible by it")
    if model.intermediate_size % size:
        problems.append(f"intermediate_size={model.intermediate_size} is not divisible by it")
    block = model.quantization.block_size if model.quantization is not None else None
    if block is not None and size > 1 and not problems:
        # A block-quantized rank must hold whole 128 x 128 scale tiles: its q rows, its k and v rows (each
        # starts a shard of the fused qkv and a row block of the checkpoint's scales) and its intermediate
        # slice (gate | up rows, down_proj columns). The o_proj columns are the q rows. Per-tensor and
        # per-channel scales split at any row or column (engine/layers/fp8.py's tensor-parallel twins).
        heads, kv_heads, intermediate = _rank_sizes(model, size)
        splits = {"q rows": heads * model.head_dim, "KV rows": kv_heads * model.head_dim,
                  "intermediate slice": intermediate}
        if any(n % block[0] for n in splits.values()):
            problems.append(
                f"the FP8 weight blocks are {block[0]} x {block[1]} and every split must be a multiple of {block[0]}: "
                "a rank's " + ", ".join(f"{k} = {v}" for k, v in splits.items())
            )
    return problems


def _rank_sizes(model: _Shape, size: int) -> tuple[int, int, int]:
    """(q heads, KV heads, intermediate size) one rank of `size` holds: KV heads split, or one replicated."""
    return model.num_heads // size, max(1, model.num_kv_heads // size), model.intermediate_size // size


def check_shardable(model: _Shape, size: int, path: str) -> None:
    """ValueError naming what does not divide, and the sizes that would work."""
    problems = shard_problems(model, size)
    if problems:
        raise ValueError(
            f"tensor_parallel_size={size} cannot split the model in {path!r}: {'; '.join(problems)}. "
            f"Sizes that work for this model: {', '.join(map(str, valid_sizes(model)))}"
        )


def rank_model_config(model: _Model, rank: int, size: int, comm: AllReduce) -> _Model:
    """The model as rank `rank` holds it: its head counts and intermediate size, and the plan its sharded
    layers read. The model code builds from this unchanged (its views use the per-rank head counts) and the
    KV cache is sized from it, so each rank caches only its own heads."""
    heads, kv_heads, intermediate = _rank_sizes(model, size)
    plan = ShardPlan(rank, size, max(1, size // model.num_kv_heads), comm)
    return dataclasses.replace(
        model,  # type: ignore[type-var]
        num_heads=heads,
        num_kv_heads=kv_heads,
        intermediate_size=intermediate,
        shard=plan,
    )
