"""The model's building blocks. Each module owns its parameters and the rule that fills them from checkpoint
tensors (`WeightModule.load_weight`); the model files only wire them together.

A new way to hold or multiply weights (FP8, a tensor-parallel shard) is a new module here with its own
parameters, `load_weight` and forward; the model's forward calls `self.qkv_proj(x)` either way. A fused
path that crosses modules (a norm folded into the next GEMV's prologue, the residual add into its epilogue)
reads the weights of several of these modules from a decoder layer's forward: the modules own weights and
loading, not necessarily the kernel that uses them.
"""

from stoker.engine.layers.attention import PagedAttention
from stoker.engine.layers.embedding import LMHead, VocabEmbedding
from stoker.engine.layers.fp8 import (
    Fp8ColumnParallelGateUp,
    Fp8ColumnParallelQKV,
    Fp8GateUpLinear,
    Fp8Linear,
    Fp8QKVLinear,
    Fp8RowParallelLinear,
    make_linear,
)
from stoker.engine.layers.linear import GateUpLinear, Linear, MergedLinear, QKVLinear
from stoker.engine.layers.norm import RMSNorm
from stoker.engine.layers.rotary import RotaryEmbedding
from stoker.engine.layers.tensor_parallel import ColumnParallelGateUp, ColumnParallelQKV, RowParallelLinear
from stoker.engine.layers.weights import WeightModule, WeightShapeError

__all__ = [
    "ColumnParallelGateUp", "ColumnParallelQKV", "RowParallelLinear", "Fp8ColumnParallelGateUp", "Fp8ColumnParallelQKV", "Fp8GateUpLinear", "Fp8Linear", "Fp8QKVLinear",
    "Fp8RowParallelLinear", "GateUpLinear", "LMHead", "Linear", "MergedLinear",
    "PagedAttention", "QKVLinear", "RMSNorm",
    "RotaryEmbedding", "VocabEmbedding", "WeightModule", "WeightShapeError", "make_linear",
]
