"""The fused decode MLP (fused_mlp.py) on FP8 weights with the activations as E4M3 terms: the weights are never
converted (issue 14, FP8 W1).

Why: every FP8 decode GEMV so far turned each weight byte into a float before multiplying (fp8_convert.py), and
that conversion kept them at 84 % of copy bandwidth at best (gate_up 32.8 us, down 16.4, 8B, M = 1), where the bf16
fused MLP streams its bytes at 95 %; the fused MLP with converted FP8 tiles lost outright (56.4 against 51.2 us,
BENCHMARKS.md, session 13). Here the weight tile goes from memory to the FP8 tensor cores as it is stored: each
K slice of the activations is split into two E4M3 terms with a scale per token, x ~= s_hi * hi + s_lo * lo
(fp8_quant.quantize_rows_e4m3 twice, the second on the first's remainder), and W . x^T is two FP8 dots with
the weight rows as the MMA's M (out^T [BI, tokens] = W [BI, BK] . hi^T [BK, 16]: on sm_90 `wgmma ... e4m3.e4m3`
straight from shared memory), scaled per token and added in float32 per slice. The same for down_proj on the
SiLU-and-mul product, split into terms per program.

Accuracy: a term carries E4M3's 3 mantissa bits, so the pair holds each element to ~2^-8 of its size (bf16 holds
2^-9), the second term on a scale of the first's largest remainder; each slice's dot runs over BK elements only
before its float32 sum, so the tensor cores' narrower FP8 accumulation never spans K. The tests hold the kernel to
the exact two-term arithmetic on the CPU and to the dequantized reference within bf16's tolerance.

Layout as fused_mlp.py: program p owns BI intermediate rows (gate row n, up row INTER + n), streams them with the
norm's rms pass first, forms act = silu(g) * u (rounded to the model dtype as the unfused path), then streams the
same BI columns of down [H, I] and adds its [BH, M] partials into the zeroed float32 accumulator; fused_mlp.py's
finishing kernel rounds, adds the residual and zeroes the accumulator again.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from stoker.engine.kernels._triton import check_launchable, tl, triton
from stoker.engine.kernels.fp8_quant import quantize_rows_e4m3
from stoker.engine.kernels.fused_mlp import _mlp_finish_kernel
from stoker.engine.kernels.gemv import _row_sumsq, gemv_ref, norm_chunk

FP8_MLP_MAX_M = 16  # the terms' dot tile is 16 tokens wide


def fused_mlp_fp8_ref(x: torch.Tensor, gate_up: torch.Tensor, gate_up_scale: torch.Tensor, down: torch.Tensor,
                      down_scale: torch.Tensor, residual: torch.Tensor, *, eps: float, norm: bool = True,
                      norm_weight: torch.Tensor | None = None) -> torch.Tensor:
    """The two FP8 GEMVs this replaces on the dequantized weights: act = silu-mul(gate_up(rms_norm(x) * g)),
    out = down(act) + residual. norm False: h = x (norm_weight must then be None)."""
    if not norm and norm_weight is not None:
        raise ValueError("fused_mlp_fp8_ref: a norm weight without the norm")
    g = norm_weight if norm_weight is not None else torch.ones(x.shape[1], dtype=x.dtype, device=x.device)
    act, _ = gemv_ref(x, gate_up, silu_mul=True, norm_weight=g if norm else None, eps=eps,
                      weight_scale=gate_up_scale)
    return gemv_ref(act, down, add=residual, weight_scale=down_scale)[0]


@triton.jit
def _mlp_fp8_kernel(
    x_ptr, g_ptr, wgu_ptr, sgu_ptr, wd_ptr, sd_ptr, acc_ptr,
    M, K, INTER, H, eps, x_stride, wgu_stride, wd_stride,
    BLOCK_M: tl.constexpr, BI: tl.constexpr, BK: tl.constexpr, BH: tl.constexpr,
    NORM: tl.constexpr, APPLY_G: tl.constexpr, NORM_CHUNK: tl.constexpr, HW_CAST: tl.constexpr,
):
    pid = tl.program_id(0)
    rows = pid * BI + tl.arange(0, BI)
    row_mask = rows < INTER
    m = tl.arange(0, BLOCK_M)
    m_mask = m < M
    ks = tl.arange(0, BK)
    g_ptrs = wgu_ptr + rows.to(tl.int64)[:, None] * wgu_stride + ks[None, :]
    u_ptrs = wgu_ptr + (rows + INTER).to(tl.int64)[:, None] * wgu_stride + ks[None, :]
    acc_g = tl.zeros([BI, BLOCK_M], dtype=tl.float32)  # transposed: the weight rows are the MMA's M
    acc_u = tl.zeros([BI, BLOCK_M], dtype=tl.float32)
    if NORM:
        sumsq = _row_sumsq(x_ptr, x_stride, M, K, BLOCK_M, NORM_CHUNK)
    for k0 in range(0, K, BK):
        k_mask = k0 + ks < K
        x32 = tl.load(x_ptr + m[:, None] * x_stride + k0 + ks[None, :], mask=m_mask[:, None] & k_mask[None, :],
                      other=0.0).to(tl.float32)
        if APPLY_G:  # the norm's weight on x (the rms in the epilogue: a per-token factor)
            x32 = x32 * tl.load(g_ptr + k0 + ks, mask=k_mask, other=0.0).to(tl.float32)[None, :]
        w_mask = row_mask[:, None] & k_mask[None, :]
        wg = tl.load(g_ptrs + k0, mask=w_mask, other=0.0)
        wu = tl.load(u_ptrs + k0, mask=w_mask, other=0.0)
        hi, s_hi = quantize_rows_e4m3(x32, HW_CAST)
        lo, s_lo = quantize_rows_e4m3(x32 - hi.to(tl.float32) * s_hi[:, None], HW_CAST)
        acc_g += tl.dot(wg, tl.trans(hi)) * s_hi[None, :] + tl.dot(wg, tl.trans(lo)) * s_lo[None, :]
        acc_u += tl.dot(wu, tl.trans(hi)) * s_hi[None, :] + tl.dot(wu, tl.trans(lo)) * s_lo[None, :]
    acc_g = acc_g * tl.load(sgu_ptr + rows, mask=row_mask, other=0.0)[:, None]
    acc_u = acc_u * tl.load(sgu_ptr + INTER + rows, mask=row_mask, other=0.0)[:, None]
    if NORM:
        inv_rms = tl.rsqrt(sumsq / K + eps)[None, :]
        acc_g = acc_g * inv_rms
        acc_u = acc_u * inv_rms
    dtype = x_ptr.dtype.element_ty
    g = acc_g.to(dtype).to(tl.float32)  # rounded like the unfused projection, then SiLU-and-mul as gemv.py
    u = acc_u.to(dtype).to(tl.float32)
    act = tl.where(row_mask[:, None] & m_mask[None, :], g * tl.sigmoid(g) * u, 0.0).to(dtype).to(tl.float32)
    act_t = tl.trans(act)  # [BLOCK_M, BI]: tokens as rows, for the per-token terms
    a_hi, sa_hi = quantize_rows_e4m3(act_t, HW_CAST)
    a_lo, sa_lo = quantize_rows_e4m3(act_t - a_hi.to(tl.float32) * sa_hi[:, None], HW_CAST)
    hs = tl.arange(0, BH)
    d_ptrs = wd_ptr + hs.to(tl.int64)[:, None] * wd_stride + rows[None, :]  # down's [BH, BI] tile, BI contiguous
    out_ptrs = acc_ptr + m[None, :] * H + hs[:, None]  # [BH, BLOCK_M] into the zeroed [M, H] accumulator
    for h0 in range(0, H, BH):
        h_mask = h0 + hs < H
        wd = tl.load(d_ptrs + h0 * wd_stride, mask=h_mask[:, None] & row_mask[None, :], other=0.0)
        part = tl.dot(wd, tl.trans(a_hi)) * sa_hi[None, :] + tl.dot(wd, tl.trans(a_lo)) * sa_lo[None, :]
        part = part * tl.load(sd_ptr + h0 + hs, mask=h_mask, other=0.0)[:, None]
        tl.atomic_add(out_ptrs + h0, part, mask=h_mask[:, None] & m_mask[None, :], sem="relaxed")


@dataclass(frozen=True, slots=True)
class Fp8MlpConfig:
    """Intermediate rows per program (bi), K slice of the gate/up stream (bk), down rows per step (bh), warps,
    pipeline stages."""

    bi: int = 128
    bk: int = 128
    bh: int = 256
    num_warps: int = 4
    num_stages: int = 3


def fp8_mlp_config(on_gpu: bool, inter: int) -> Fp8MlpConfig:
    if not on_gpu:  # the interpreter: small tiles (the dots need 16 in every dimension)
        return Fp8MlpConfig(bi=16, bk=32, bh=32, num_warps=4, num_stages=1)
    return Fp8MlpConfig(bi=128 if inter >= 100 * 128 else 64)


def fused_mlp_fp8_triton(x: torch.Tensor, gate_up: torch.Tensor, gate_up_scale: torch.Tensor, down: torch.Tensor,
                         down_scale: torch.Tensor, residual: torch.Tensor, *, eps: float, norm: bool = True,
                         norm_weight: torch.Tensor | None = None, config: Fp8MlpConfig | None = None,
                         accumulator: torch.Tensor | None = None) -> torch.Tensor:
    """fused_mlp_fp8_ref in two launches. x, residual [M, H] (model dtype); gate_up E4M3 [2I, H] with float32 row
    scales [2I]; down E4M3 [H, I] with row scales [H]; norm_weight [H] or None (a unit norm); accumulator as
    fused_mlp_triton's."""
    if x.dim() != 2 or gate_up.dim() != 2 or down.dim() != 2:
        raise ValueError(f"fused_mlp_fp8: x [M, H], gate_up [2I, H], down [H, I] expected, got "
                         f"{tuple(x.shape)}, {tuple(gate_up.shape)}, {tuple(down.shape)}")
    num_rows, hidden = x.shape
    inter = gate_up.shape[0] // 2
    if gate_up.shape != (2 * inter, hidden) or down.shape != (hidden, inter) or residual.shape != x.shape:
        raise ValueError(f"fused_mlp_fp8: shapes disagree: x {tuple(x.shape)}, gate_up {tuple(gate_up.shape)}, "
                         f"down {tuple(down.shape)}, residual {tuple(residual.shape)}")
    if gate_up.dtype != torch.float8_e4m3fn or down.dtype != torch.float8_e4m3fn:
        raise ValueError(f"fused_mlp_fp8: E4M3 weights expected, got {gate_up.dtype}, {down.dtype}")
    if gate_up_scale.shape != (2 * inter,) or down_scale.shape != (hidden,) or \
            gate_up_scale.dtype != torch.float32 or down_scale.dtype != torch.float32:
        raise ValueError(f"fused_mlp_fp8: float32 row scales [2I], [H] expected, got {gate_up_scale.dtype} "
                         f"{tuple(gate_up_scale.shape)}, {down_scale.dtype} {tuple(down_scale.shape)}")
    if x.dtype != residual.dtype or x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"fused_mlp_fp8: x and residual in one float dtype, got {x.dtype}, {residual.dtype}")
    if norm_weight is not None and (not norm or norm_weight.shape != (hidden,)):
        raise ValueError(f"fused_mlp_fp8: norm_weight [{hidden}] goes with norm=True, got "
                         f"{tuple(norm_weight.shape)} (norm={norm})")
    if not 1 <= num_rows <= FP8_MLP_MAX_M:
        raise ValueError(f"fused_mlp_fp8: 1..{FP8_MLP_MAX_M} tokens (the dot tile), got {num_rows}")
    for name, t in (("x", x), ("gate_up", gate_up), ("down", down), ("residual", residual)):
        if t.stride(-1) != 1:
            raise ValueError(f"fused_mlp_fp8: {name} must be contiguous along its last dimension")
    need = num_rows * hidden
    if accumulator is None:
        accumulator = torch.zeros(need, dtype=torch.float32, device=x.device)
    elif accumulator.dtype != torch.float32 or accumulator.numel() < need or not accumulator.is_contiguous():
        raise ValueError(f"fused_mlp_fp8: the accumulator must be contiguous float32 of >= {need} elements, got "
                         f"{accumulator.dtype} {tuple(accumulator.shape)}")
    check_launchable(x, gate_up, gate_up_scale, down, down_scale, residual, accumulator)
    cfg = config or fp8_mlp_config(x.is_cuda, inter)
    out = torch.empty_like(residual, memory_format=torch.contiguous_format)
    _mlp_fp8_kernel[(triton.cdiv(inter, cfg.bi),)](
        x, norm_weight if norm_weight is not None else x, gate_up, gate_up_scale, down, down_scale, accumulator,
        num_rows, hidden, inter, hidden, eps, x.stride(0), gate_up.stride(0), down.stride(0),
        BLOCK_M=16, BI=cfg.bi, BK=cfg.bk, BH=cfg.bh, NORM=norm, APPLY_G=norm_weight is not None,
        NORM_CHUNK=norm_chunk(hidden, cfg.num_warps, x.is_cuda), HW_CAST=x.is_cuda,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    block_h = 256 if x.is_cuda else 32
    _mlp_finish_kernel[(triton.cdiv(hidden, block_h), num_rows)](
        accumulator, residual, out, hidden, residual.stride(0), out.stride(0), BLOCK_H=block_h, num_warps=4,
    )
    return out
