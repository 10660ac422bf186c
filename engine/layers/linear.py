"""Linear layers: y = x W^T (+ b), W [out, in] as in Hugging Face checkpoints.

`MergedLinear` stores several checkpoint projections as row blocks of one parameter, so one GEMM computes
them all (q | k | v, gate | up); each knows which rows a shard fills. An FP8 or a tensor-parallel variant
subclasses these: its own parameters (a scale, a shard of the rows or columns), its `load_weight`, its forward.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from stoker.engine import kernels
from stoker.engine.layers.weights import WeightModule, copy_into, empty_param

# Linear.forward_add's add in cuBLAS's epilogue; False: every linear leaves the residual to the norm after it (the
# bench's A/B: ops/bench.py --decode-kernels auto+set=linear.EPILOGUE_ADD=False).
EPILOGUE_ADD = True


class Linear(WeightModule):
    def __init__(self, input_size: int, output_size: int, *, bias: bool = False, dtype: torch.dtype):
        super().__init__()
        self.input_size, self.output_size = input_size, output_size
        self.weight = empty_param(output_size, input_size, dtype=dtype)
        self.bias = empty_param(output_size, dtype=dtype) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[T, in] -> [T, out]"""
        return F.linear(x, self.weight, self.bias)

    def forward_after_norm(
        self, hidden: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """[T, in] -> (this layer on rms_norm(hidden + residual) * norm_weight, the sum for the next block), as
        RMSNorm then this layer. A twin that takes quantized activations fuses the norm in (Fp8Linear)."""
        h, summed = kernels.rms_norm(hidden, norm_weight, eps, residual)
        return self(h), summed

    def forward_after_silu(self, gate_up: torch.Tensor) -> torch.Tensor:
        """[T, 2 in] (gate | up) -> this layer on silu(gate) * up: the gated MLP's down projection. A twin that
        takes quantized activations fuses the two (Fp8Linear)."""
        return self(kernels.silu_and_mul(gate_up))

    def forward_add(self, x: torch.Tensor, residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """[T, in] and the running sum [T, out] -> (hidden, residual) for the next norm, whose sum is residual +
        this layer on x. Here the add is in cuBLAS's epilogue (`residual.addmm_`, beta = 1) and the pair comes back
        as (the sum, None): the norm after it then reads one [T, out] tensor and writes one, instead of reading
        two and writing two (W2's 8,192-token step: 1.7 % of a layer's projections and norms under the power cap,
        ops/bench_epilogue_fusion.py, which found the layer's output unchanged on the H200 bit for bit). `residual` is
        overwritten: the caller hands it over, as the norms' sum it is.
        Elsewhere (a bias, a twin that reduces across ranks or quantizes, no residual yet) (this layer on x,
        residual), added in the norm."""
        if (not EPILOGUE_ADD or residual is None or self.bias is not None
                or not residual.dtype == x.dtype == self.weight.dtype
                or residual.shape != (x.shape[0], self.output_size) or not residual.is_contiguous()):
            return self(x), residual
        return residual.addmm_(x, self.weight.t()), None

    def forward_after_silu_add(self, gate_up: torch.Tensor, residual: torch.Tensor | None
                               ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """forward_after_silu with forward_add's residual: the down projection's (hidden, residual)."""
        return self.forward_add(kernels.silu_and_mul(gate_up), residual)


class MergedLinear(Linear):
    """Checkpoint projections fused along the output dim: shard `name` fills rows `self.shard_rows[name]`
    of the weight (and of the bias)."""

    def __init__(self, input_size: int, shard_sizes: dict[str, int], *, bias: bool = False, dtype: torch.dtype):
        super().__init__(input_size, sum(shard_sizes.values()), bias=bias, dtype=dtype)
        self.shard_rows: dict[str, slice] = {}
        start = 0
        for name, size in shard_sizes.items():
            self.shard_rows[name] = slice(start, start + size)
            start += size

    def load_weight(self, param_name: str, loaded: torch.Tensor, shard: str = "") -> None:
        rows = self.shard_rows.get(shard)
        if rows is None:
            raise ValueError(
                f"{type(self).__name__}.{param_name}: unknown shard {shard!r} (have {', '.join(self.shard_rows)})"
            )
        copy_into(self._parameters[param_name].data[rows], loaded)  # type: ignore[union-attr]

    def expected_shards(self) -> list[tuple[str, str]]:
        return [(name, shard) for name, _ in super().expected_shards() for shard in self.shard_rows]


class QKVLinear(MergedLinear):
    """q | k | v projections in one GEMM: [T, H] -> [T, (Hq + 2 Hkv) D]."""

    def __init__(
        self, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int, *, bias: bool, dtype: torch.dtype
    ):
        self.q_size, self.kv_size = num_heads * head_dim, num_kv_heads * head_dim
        super().__init__(
            hidden_size, {"q": self.q_size, "k": self.kv_size, "v": self.kv_size}, bias=bias, dtype=dtype
        )


class GateUpLinear(MergedLinear):
    """gate | up projections of the gated MLP in one GEMM: [T, H] -> [T, 2 I]."""

    def __init__(self, hidden_size: int, intermediate_size: int, *, dtype: torch.dtype):
        super().__init__(hidden_size, {"gate": intermediate_size, "up": intermediate_size}, dtype=dtype)
