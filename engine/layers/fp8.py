"""FP8 twins of the linear layers (engine.layers.linear), and `make_linear`, the one factory the model calls.

Parameters: `weight` float8_e4m3fn [N, K]; `weight_scale` float32, one per output row [N] (per-channel
checkpoints; per-tensor checkpoints repeat each shard's scalar over its rows, so fused q | k | v or gate | up
with a scale per shard keep it exactly, without requantizing) or one per 128 x 128 tile
[ceil(N/128), ceil(K/128)]; `input_scale` float32 [shards] for static activations (the GEMM uses their max,
as vLLM does: one scale must quantize the shared input); `bias` in the model dtype. The checkpoint's tensor
names: `<module>.weight`, `.weight_scale` (`.weight_scale_inv` in the older fp8 block form), `.input_scale`.
With `--quantization fp8` a bf16/fp32 `weight` is quantized per row as it is copied in.

Tensor-parallel twins (at the end): the rows or columns engine/layers/tensor_parallel.py's twins hold, and
the scales that go with them. A column-parallel rank (q | k | v, gate | up) holds whole output rows: its
per-channel scales are those rows' and its block scales those rows' blocks; a per-tensor scale applies to any
rows, so it is read whole. A row-parallel rank (o_proj, down_proj) holds all output rows but only some input
columns: per-tensor and per-channel scales are read whole (each rank's partial sum carries the row's scale and
the all-reduce sums them), block scales the column blocks of its columns. `input_scale` is read whole: one
scale quantizes the layer's whole input, so every rank's part of it too. Block schemes need every split on a
multiple of 128 (engine.parallel.plan.shard_problems checks it before any rank starts).
"""

from __future__ import annotations

import torch
from stoker.engine import kernels
from stoker.engine.kernels.fp8_linear import FP8_DTYPE, quantize_rows, scaled_mm_quantized, takes_scaled_mm
from stoker.engine.kernels.fp8_quant import QUANT_MAX_K, rms_norm_quant_fp8_triton, silu_mul_quant_fp8_triton
from stoker.engine.layers.linear import GateUpLinear, Linear, QKVLinear
from stoker.engine.layers.tensor_parallel import (
    gate_up_rows,
    qkv_rows,
    row_parallel_columns,
    tensor_parallel_twin,
)
from stoker.engine.layers.weights import WeightModule, WeightShapeError, copy_into, empty_param
from stoker.engine.parallel.plan import ShardPlan
from stoker.engine.quant_config import Fp8Scheme
from torch import nn


class Fp8Linear(WeightModule):
    """[T, in] -> [T, out] with FP8 weights; `shard_sizes` {"": out} for a plain linear, else the fused shards."""

    def __init__(
        self, input_size: int, output_size: int, *, bias: bool = False, dtype: torch.dtype, scheme: Fp8Scheme,
        shard_sizes: dict[str, int] | None = None,
    ):
        super().__init__()
        self.input_size, self.output_size, self.scheme = input_size, output_size, scheme
        self.shard_rows: dict[str, slice] = {}
        start = 0
        for name, size in (shard_sizes or {"": output_size}).items():
            self.shard_rows[name] = slice(start, start + size)
            start += size
        self.block = scheme.block_size
        self.weight = empty_param(output_size, input_size, dtype=FP8_DTYPE)
        if self.block is None:
            self.weight_scale = empty_param(output_size, dtype=torch.float32)
        else:
            bn, bk = self.block
            bad = [name for name, rows in self.shard_rows.items() if rows.start % bn]
            if bad:
                raise ValueError(f"{type(self).__name__}: shard {bad[0]!r} starts at a row that is not a multiple of "
                                 f"the weight block {bn}; block-quantized fused layers need block-aligned shards")
            self.weight_scale = empty_param(-(-output_size // bn), -(-input_size // bk), dtype=torch.float32)
        static = scheme.activations == "static"
        self.input_scale = empty_param(len(self.shard_rows), dtype=torch.float32) if static else None
        self.bias = empty_param(output_size, dtype=dtype) if bias else None
        self.register_buffer("act_scale", torch.ones(1) if static else None, persistent=False)

    def _param(self, checkpoint_name: str) -> str:
        return "weight_scale" if checkpoint_name == self.scheme.weight_scale_name else checkpoint_name

    def owns(self, param_name: str) -> bool:
        return self._parameters.get(self._param(param_name)) is not None

    def load_weight(self, param_name: str, loaded: torch.Tensor, shard: str = "") -> None:
        rows = self.shard_rows.get(shard)
        if rows is None:
            raise ValueError(f"{type(self).__name__}.{param_name}: unknown shard {shard!r} "
                             f"(have {', '.join(map(repr, self.shard_rows))})")
        name = self._param(param_name)
        if name == "weight":
            self._load_fp8_weight(loaded, rows)
        elif name == "weight_scale":
            self._load_weight_scale(loaded, rows)
        elif name == "input_scale":
            if loaded.numel() != 1:
                raise WeightShapeError(tuple(loaded.shape), (1,))
            self.input_scale.data[list(self.shard_rows).index(shard)] = loaded.reshape(()).float()  # type: ignore[union-attr]
        else:
            copy_into(self._parameters[name].data[rows], loaded)  # type: ignore[union-attr]

    def _load_fp8_weight(self, loaded: torch.Tensor, rows: slice) -> None:
        if loaded.dtype == FP8_DTYPE:
            copy_into(self.weight.data[rows], loaded)
        elif self.scheme.quantize_at_load and loaded.is_floating_point() and loaded.element_size() >= 2:
            if tuple(loaded.shape) != tuple(self.weight.data[rows].shape):
                raise WeightShapeError(tuple(loaded.shape), tuple(self.weight.data[rows].shape))
            weight, scale = quantize_rows(loaded.to(self.weight.device))
            self.weight.data[rows].copy_(weight)
            self.weight_scale.data[rows].copy_(scale)
        else:
            raise ValueError(f"weight dtype {loaded.dtype}: the checkpoint's quantization_config "
                             f"({self.scheme.method}) says this layer's weights are float8_e4m3fn")

    def _load_weight_scale(self, loaded: torch.Tensor, rows: slice) -> None:
        if self.block is not None:
            bn = self.block[0]
            target = self.weight_scale.data[rows.start // bn : -(-rows.stop // bn)]
            copy_into(target, loaded.float())
            return
        target = self.weight_scale.data[rows]
        if loaded.numel() == 1:  # per tensor (per shard): the scalar over the shard's rows
            target.fill_(loaded.reshape(()).float().item())
        elif loaded.numel() == target.numel() and loaded.dim() <= 2 and loaded.shape[0] == target.numel():
            target.copy_(loaded.reshape(-1))  # per channel: [rows, 1] in compressed-tensors, [rows] too
        else:
            raise WeightShapeError(tuple(loaded.shape), (target.numel(), 1))

    def expected_shards(self) -> list[tuple[str, str]]:
        names = [n for n, p in self._parameters.items() if p is not None]
        if self.scheme.quantize_at_load:  # the scales come with the weight
            names.remove("weight_scale")
        return [(name, shard) for name in names for shard in self.shard_rows]

    def finish_loading(self) -> None:
        if self.input_scale is not None:
            self.act_scale = self.input_scale.data.max().reshape(1).clone()

    def _epilogue_bias(self) -> torch.Tensor | None:
        """The bias the GEMM adds; the row-parallel twin adds its own after the sum instead."""
        return self.bias

    def _finish(self, out: torch.Tensor) -> torch.Tensor:
        """The GEMM's output -> the layer's: every path (forward and the fused ones below) ends here, so the
        row-parallel twin's all-reduce cannot be skipped by one of them."""
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[T, in] -> [T, out]"""
        out = kernels.fp8_linear(x, self.weight, self.weight_scale, self._epilogue_bias(), self.block, self.act_scale)
        return self._finish(out)

    def forward_after_silu(self, gate_up: torch.Tensor) -> torch.Tensor:
        """[T, 2 in] (gate | up) -> this layer on silu(gate) * up. On the FP8 tensor-core path the SiLU-mul and
        the activation quantization are one kernel (fp8_quant.py): the [T, in] bf16 product never goes to
        memory (8B, W2's 8,192-token step: 235 MB written and read again less a layer); elsewhere the two ops."""
        h_cols = gate_up.shape[1] // 2
        if (kernels.use_triton(gate_up) and gate_up.dim() == 2 and gate_up.stride(1) == 1
                and h_cols == self.input_size and h_cols <= QUANT_MAX_K
                and takes_scaled_mm(gate_up, self.weight, self.block)):
            xq, x_scale = silu_mul_quant_fp8_triton(gate_up, self.act_scale)
            out = scaled_mm_quantized(xq, x_scale, self.weight, self.weight_scale, self._epilogue_bias(), gate_up.dtype)
            return self._finish(out)
        return self(kernels.silu_and_mul(gate_up))

    def forward_add(self, x: torch.Tensor, residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Linear.forward_add's pair, the residual left for the norm to add (scaled_mm has no add of its own)."""
        return self(x), residual

    def forward_after_silu_add(self, gate_up: torch.Tensor, residual: torch.Tensor | None
                               ) -> tuple[torch.Tensor, torch.Tensor | None]:
        return self.forward_after_silu(gate_up), residual

    def forward_after_norm(
        self, hidden: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """[T, in] -> (this layer on rms_norm(hidden + residual) * norm_weight, the sum for the next block):
        the RMSNorm before qkv / gate_up and this layer in one call. Where the layer takes FP8 activations
        (the tensor-core GEMM), the norm, the residual add and the per-token quantization are one kernel
        (fp8_quant.py): the normed bf16 activations never go to memory, one kernel fewer a layer. Elsewhere
        (the GEMV, the CPU) the norm kernel, then forward.

        The model's unfused layers call it (LlamaDecoderLayer: qkv and gate_up). What it saves, estimated: 4
        of the 11 bytes an element the unfused pair moves (the norm: x and residual in, s and h out; the
        quantization: h in, xq out): 134 MB, ~31 us at 4.3 TB/s a call at 8,192 prefill tokens, 8B."""
        if (kernels.use_triton(hidden) and takes_scaled_mm(hidden, self.weight, self.block)
                and hidden.shape[1] <= QUANT_MAX_K):
            xq, x_scale, summed = rms_norm_quant_fp8_triton(hidden, norm_weight, eps, residual, self.act_scale)
            out = scaled_mm_quantized(xq, x_scale, self.weight, self.weight_scale, self._epilogue_bias(), hidden.dtype)
            return self._finish(out), summed
        h, summed = kernels.rms_norm(hidden, norm_weight, eps, residual)
        return self(h), summed


class Fp8QKVLinear(Fp8Linear):
    """QKVLinear's FP8 twin: q | k | v rows, the shard names the loader's packed_modules use."""

    def __init__(self, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int, *, bias: bool,
                 dtype: torch.dtype, scheme: Fp8Scheme):
        self.q_size, self.kv_size = num_heads * head_dim, num_kv_heads * head_dim
        sizes = {"q": self.q_size, "k": self.kv_size, "v": self.kv_size}
        super().__init__(hidden_size, sum(sizes.values()), bias=bias, dtype=dtype, scheme=scheme, shard_sizes=sizes)


class Fp8GateUpLinear(Fp8Linear):
    """GateUpLinear's FP8 twin: gate | up rows."""

    def __init__(self, hidden_size: int, intermediate_size: int, *, dtype: torch.dtype, scheme: Fp8Scheme):
        sizes = {"gate": intermediate_size, "up": intermediate_size}
        super().__init__(hidden_size, 2 * intermediate_size, dtype=dtype, scheme=scheme, shard_sizes=sizes)


_FP8_TWINS: dict[type[Linear], type[Fp8Linear]] = {
    Linear: Fp8Linear, QKVLinear: Fp8QKVLinear, GateUpLinear: Fp8GateUpLinear,
}


# ---- tensor-parallel twins ----------------------------------------------------------------------------------
def _column_parallel_slice(layer: Fp8Linear, param_name: str, rows: slice) -> tuple[slice, ...] | None:
    """The part of a checkpoint tensor a column-parallel FP8 layer holds, `rows` being the checkpoint rows of
    the shard's weight that this rank holds."""
    name = layer._param(param_name)
    if name == "input_scale":
        return None
    if name == "weight_scale":
        if layer.block is not None:  # [N/128, K/128]: the row blocks of these rows (shard_problems: aligned)
            bn = layer.block[0]
            return (slice(rows.start // bn, -(-rows.stop // bn)),)
        if layer.scheme.weight_strategy == "tensor":  # [1] or [], one scale for any rows
            return None
    return (rows,)  # the weight [N, K], a per-channel scale [N, 1], the bias [N]


class Fp8ColumnParallelQKV(Fp8QKVLinear):
    """ColumnParallelQKV's FP8 twin: this rank's q heads and KV heads, built with the per-rank head counts."""

    def __init__(self, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int, *, bias: bool,
                 dtype: torch.dtype, scheme: Fp8Scheme, shard: ShardPlan):
        super().__init__(hidden_size, num_heads, num_kv_heads, head_dim, bias=bias, dtype=dtype, scheme=scheme)
        self.shard, self.head_dim, self.num_local_kv_heads = shard, head_dim, num_kv_heads

    def checkpoint_slice(self, param_name: str, shard: str) -> tuple[slice, ...] | None:
        rows = self.shard_rows[shard].stop - self.shard_rows[shard].start
        return _column_parallel_slice(self, param_name,
                                      qkv_rows(self.shard, shard, rows, self.head_dim, self.num_local_kv_heads))


class Fp8ColumnParallelGateUp(Fp8GateUpLinear):
    """ColumnParallelGateUp's FP8 twin: the same intermediate rows of gate and of up."""

    def __init__(self, hidden_size: int, intermediate_size: int, *, dtype: torch.dtype, scheme: Fp8Scheme,
                 shard: ShardPlan):
        super().__init__(hidden_size, intermediate_size, dtype=dtype, scheme=scheme)
        self.shard, self.local_intermediate = shard, intermediate_size

    def checkpoint_slice(self, param_name: str, shard: str) -> tuple[slice, ...] | None:
        return _column_parallel_slice(self, param_name, gate_up_rows(self.shard, self.local_intermediate))


class Fp8RowParallelLinear(Fp8Linear):
    """RowParallelLinear's FP8 twin: this rank's input columns, [T, in/size] -> partial [T, out], summed over the
    ranks on every path (forward, forward_after_silu, forward_after_norm: all end in _finish).

    Dynamic activations (CUDA's FP8 GEMMs) are quantized per token over this rank's input columns only, with
    this rank's own absmax (as vLLM does): each rank's partial sum is exact for its quantized input, but the
    quantization differs from one over the whole row at tensor_parallel_size=1 (finer, not coarser). Static
    activations use the checkpoint's one input_scale on every rank. The CPU reference path does not quantize
    activations, so there the ranks' sums equal the unsharded product up to the order of the float sums."""

    def __init__(self, input_size: int, output_size: int, *, bias: bool = False, dtype: torch.dtype,
                 scheme: Fp8Scheme, shard: ShardPlan):
        super().__init__(input_size, output_size, bias=bias, dtype=dtype, scheme=scheme)
        self.shard = shard

    def checkpoint_slice(self, param_name: str, shard: str) -> tuple[slice, ...] | None:
        name = self._param(param_name)
        columns = row_parallel_columns(self.shard, self.input_size)
        if name == "weight":
            return (slice(None), columns)
        if name == "weight_scale" and self.block is not None:  # the column blocks (shard_problems: aligned)
            bk = self.block[1]
            return (slice(None), slice(columns.start // bk, -(-columns.stop // bk)))
        # Per-tensor and per-channel scales (every output row is here), input_scale, and the bias (added once,
        # after the sum): whole.
        return None

    def _epilogue_bias(self) -> torch.Tensor | None:
        return None

    def _finish(self, out: torch.Tensor) -> torch.Tensor:
        out = self.shard.comm.all_reduce(out)
        return out if self.bias is None else out + self.bias


_FP8_TP_TWINS: dict[type[Linear], type[Fp8Linear]] = {
    QKVLinear: Fp8ColumnParallelQKV, GateUpLinear: Fp8ColumnParallelGateUp,
    Linear: Fp8RowParallelLinear,  # o_proj and down_proj, as tensor_parallel._TP_TWINS says
}


def make_linear(cls: type[Linear], *args: object, quant: Fp8Scheme | None, names: list[str],
                tp: ShardPlan | None = None, **kwargs: object) -> nn.Module:
    """`cls(*args, **kwargs)`, or its FP8 twin when the model is quantized and the scheme does not ignore the
    checkpoint modules `names` it holds (q_proj, k_proj, v_proj for a fused qkv_proj); when the model is split
    over ranks (`tp`; the sizes given are then this rank's), the tensor-parallel twin of either."""
    ignored = [quant.ignores(name) for name in names] if quant is not None else []
    if any(ignored) and not all(ignored):
        raise ValueError(f"quantization_config ignores only some of {names} (a fused layer is quantized whole "
                         "or not at all)")
    fp8 = quant is not None and not all(ignored)
    if tp is not None and tp.size > 1:
        if fp8:
            return _FP8_TP_TWINS[cls](*args, scheme=quant, shard=tp, **kwargs)  # type: ignore[arg-type,call-arg]
        return tensor_parallel_twin(cls)(*args, shard=tp, **kwargs)  # type: ignore[arg-type,call-arg]
    if fp8:
        return _FP8_TWINS[cls](*args, scheme=quant, **kwargs)  # type: ignore[arg-type]
    return cls(*args, **kwargs)  # type: ignore[arg-type]
