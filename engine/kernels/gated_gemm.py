"""The gated MLP's first GEMM with its activation in the epilogue, for the batch step's many tokens:
silu(x Wg^T) * (x Wu^T) in one kernel, so the [T, 2I] gate|up product is never written and read back.

At W2's 8,192-token prefill step the unfused pair (cuBLAS's gate_up GEMM, then silu_and_mul) writes and rereads
0.7 GB a layer: ~5.3 ms of a ~180 ms step, at the copy bandwidth. The GPU runs W2 at its 700 W power cap, so what
a kernel costs is its energy as much as its time; whether this kernel's GEMM holds cuBLAS's rate under the cap is
measured by ops/bench_mlp_fusion.py (BENCHMARKS.md), and the engine takes it only where that measurement said it
pays (`GATED_GEMM_MIN_M`).

The weight is the engine's merged gate|up parameter [2I, K] as loaded (gate rows first): a program owns BLOCK_N
output columns and accumulates the matching gate and up columns side by side over the whole K, one x tile feeding
both dots. The epilogue rounds both sums to the output dtype first, as the GEMM's output would have been, then
computes silu(gate) * up in float32 (activation.silu_and_mul's math), so the result differs from the unfused
pair only by the GEMM's summation order.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from stoker.engine.kernels._triton import check_launchable, tl, triton


def _check(x: torch.Tensor, weight: torch.Tensor) -> None:
    if x.dim() != 2 or weight.dim() != 2:
        raise ValueError(f"gate_up_silu: x must be [T, K] and weight [2I, K], got {tuple(x.shape)} and "
                         f"{tuple(weight.shape)}")
    if weight.shape[0] % 2 or weight.shape[1] != x.shape[1]:
        raise ValueError(f"gate_up_silu: weight must be [2I, K] with K = x's {x.shape[1]}, got {tuple(weight.shape)}")
    if x.dtype != weight.dtype:
        raise ValueError(f"gate_up_silu: x is {x.dtype} but weight is {weight.dtype}")


def gate_up_silu_ref(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [T, K], weight [2I, K] (gate rows, then up rows) -> [T, I] = silu(x Wg^T) * (x Wu^T): the product in
    x's dtype, the activation in float32 math (as silu_and_mul_ref), the output in x's dtype."""
    _check(x, weight)
    gate, up = F.linear(x, weight).float().chunk(2, dim=-1)
    return (F.silu(gate) * up).to(x.dtype)


@triton.jit
def _gate_up_silu_kernel(
    x_ptr, w_ptr, out_ptr, M, N, K, x_stride, w_stride, out_stride, up_offset,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    EVEN_K: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    # Program -> (row tile, column tile) in groups of GROUP_M row tiles, so the programs resident at once share
    # weight columns in L2 (the Triton matmul tutorial's ordering).
    pid = tl.program_id(0)
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * tiles_n
    first_m = (pid // per_group) * GROUP_M
    group_rows = tl.minimum(tiles_m - first_m, GROUP_M)
    tile_m = first_m + (pid % per_group) % group_rows
    tile_n = (pid % per_group) // group_rows
    rows = tile_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    # Out-of-range rows and columns read row 0 / column 0 instead (the modulo keeps every load in bounds without a
    # mask in the loop); the store masks them.
    x_ptrs = x_ptr + (rows % M).to(tl.int64)[:, None] * x_stride + ks[None, :]
    gate_ptrs = w_ptr + (cols % N).to(tl.int64)[None, :] * w_stride + ks[:, None]  # [BLOCK_K, BLOCK_N]: W^T's tile
    up_ptrs = gate_ptrs + up_offset  # the up rows start N rows below
    acc_gate = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k in range(0, K, BLOCK_K):
        if EVEN_K:
            a = tl.load(x_ptrs)
            g = tl.load(gate_ptrs)
            u = tl.load(up_ptrs)
        else:
            k_mask = (k + ks) < K
            a = tl.load(x_ptrs, mask=k_mask[None, :], other=0.0)
            g = tl.load(gate_ptrs, mask=k_mask[:, None], other=0.0)
            u = tl.load(up_ptrs, mask=k_mask[:, None], other=0.0)
        acc_gate = tl.dot(a, g, acc_gate, input_precision=DOT_PRECISION)
        acc_up = tl.dot(a, u, acc_up, input_precision=DOT_PRECISION)
        x_ptrs += BLOCK_K
        gate_ptrs += BLOCK_K
        up_ptrs += BLOCK_K
    out_ty = out_ptr.dtype.element_ty
    gate = acc_gate.to(out_ty).to(tl.float32)
    up = acc_up.to(out_ty).to(tl.float32)
    result = gate * tl.sigmoid(gate) * up
    out_rows = tile_m * BLOCK_M + tl.arange(0, BLOCK_M)
    mask = (out_rows < M)[:, None] & (cols < N)[None, :]
    tl.store(out_ptr + out_rows.to(tl.int64)[:, None] * out_stride + cols[None, :], result.to(out_ty), mask=mask)


@dataclass(frozen=True, slots=True)
class GatedGemmConfig:
    """One launch: rows and columns (of each of gate and up) per program, K per step, L2 grouping, warps, stages."""

    block_m: int = 128
    block_n: int = 128
    block_k: int = 64
    group_m: int = 8
    num_warps: int = 8
    num_stages: int = 3

    @property
    def label(self) -> str:
        return f"m{self.block_m} n{self.block_n} k{self.block_k} g{self.group_m} w{self.num_warps} s{self.num_stages}"


# 128 x (2 x 128) outputs a program, as cuBLAS's bf16 tiles at these shapes; 3 stages of 48 KiB (x, gate, up tiles)
# fit the H200's shared memory. ops/bench_mlp_fusion.py sweeps others.
GATED_GEMM_CONFIG = GatedGemmConfig()
# What ops/bench_mlp_fusion.py times beside it (and the GPU test runs): other tile shapes and pipeline depths.
GATED_GEMM_SWEEP = (
    GATED_GEMM_CONFIG,
    GatedGemmConfig(128, 128, 64, 8, 8, 4),
    GatedGemmConfig(128, 64, 64, 8, 4, 4),
    GatedGemmConfig(64, 128, 64, 8, 4, 4),
    GatedGemmConfig(256, 64, 64, 8, 8, 3),
    GatedGemmConfig(128, 128, 32, 8, 8, 5),
)
_INTERPRETER_CONFIG = GatedGemmConfig(16, 16, 16, 2, 1, 1)  # the interpreter pays per element


def gate_up_silu_triton(x: torch.Tensor, weight: torch.Tensor, config: GatedGemmConfig | None = None) -> torch.Tensor:
    _check(x, weight)
    check_launchable(x, weight)
    if x.stride(1) != 1 or weight.stride(1) != 1:
        raise ValueError("gate_up_silu: the last dims of x and weight must be contiguous")
    num_tokens, k = x.shape
    inter = weight.shape[0] // 2
    out = torch.empty(num_tokens, inter, dtype=x.dtype, device=x.device)
    if num_tokens == 0 or inter == 0:
        return out
    if k == 0:
        return out.zero_()
    cfg = config or (GATED_GEMM_CONFIG if x.is_cuda else _INTERPRETER_CONFIG)
    grid = (triton.cdiv(num_tokens, cfg.block_m) * triton.cdiv(inter, cfg.block_n),)
    _gate_up_silu_kernel[grid](
        x, weight, out, num_tokens, inter, k, x.stride(0), weight.stride(0), out.stride(0), inter * weight.stride(0),
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
        EVEN_K=k % cfg.block_k == 0, DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return out
