"""A Llama MLP block at decode as two launches (issue 13): out = residual + down(silu(gate(h)) * up(h)), h =
rms_norm(x) folded into gate_up, for M = 1..MLP_MAX_M tokens.

Why: at batch 1 every kernel boundary costs ~3 us of ramp and tail (BENCHMARKS.md, the 21:07 chain table: gate_up
58.3 us and down 30.7 us against 55.1 and 27.6 at copy bandwidth). Here one kernel streams both: program p owns BI
intermediate rows, streams their gate and up rows (the folded norm's rms pass first, as gemv.py's prologue), makes
h = silu(g) * u for them in registers, then streams the same BI columns of down_proj and adds its partial sums of
all H outputs into one zeroed float32 accumulator [M, H] (relaxed atomic adds). A second, small kernel reads the
accumulator, zeroes it for the next launch, rounds like the unfused path (the projection to the model dtype, then
the residual add) and writes the new residual stream. On the H200 (session 12, 8B shape, M = 1, 8-layer CUDA-graph
chains): 86.1 us a layer against 89.2 for the two GEMVs, W1 4.196-4.198 ms against 4.289 (BENCHMARKS.md); at 2-16
tokens the gap widens (MLP_MAX_M says by how much).

Not bitwise repeatable: the atomic adds land in whatever order the programs finish, so a bf16 output can differ
in its last bit from one run to the next (the float32 sums differ by rounding only). A slot per program summed in a
fixed order by the second kernel instead (tried: 1.8 MB of partials at the 8B shape) cost more than the kernel
boundary it saves (89.2-91.8 us a layer); EngineConfig.decode_fused_mlp=False (worker --no-decode-fused-mlp) keeps
the two GEMVs for a repeatable small-batch decode.

down_proj is read as it is stored, [H, I] (I contiguous): a program's BI columns are one BI * 2-byte run per
output row (256 bytes at BI = 128), whole cache lines, so no transposed copy is needed.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from stoker.engine.kernels import gemv as _gemv
from stoker.engine.kernels._triton import check_launchable, interpreting, tl, triton
from stoker.engine.kernels.gemv import (
    _check_norm_sums,
    _check_zero_sums,
    _dot_precision,
    _fixed_point,
    _load_slots,
    _row_sumsq,
    _slots_sumsq,
    _zero_slots,
    gdc_launch_dependents,
    gdc_wait,
    gemv_ref,
    norm_chunk,
)

# Tokens per step that take the fused MLP (fused_decode.py): every fused decode step (gemv.GEMV_MAX_M). On the H200
# (session 13, 8B bf16, us a layer, 4 layer copies in a CUDA graph) it beats the two GEMVs at every M measured:
# M = 1 86.9 vs 90.9, 2 89.0 vs 100.5, 4 92.3 vs 111.9, 8 98.1 vs 129.0, 16 107.6 vs 160.5; at the 1B shape 30.1 vs
# 30.1 at M = 1 and 42.7 vs 51.5 at 16 (BENCHMARKS.md). Why the GEMVs' time grows with M so much faster was not
# measured (both read the same weights once).
MLP_MAX_M = 16


def fused_mlp_ref(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, residual: torch.Tensor | None, *,
                  eps: float, norm_folded: bool = True) -> torch.Tensor:
    """The two fused-decode GEMVs this replaces: act = silu-mul(gate_up(rms_norm(x))) (norm folded into gate_up:
    a unit-weight norm), out = down(act) + residual. norm_folded=False: no norm at all (h = x). residual None:
    down(act) alone (a tensor-parallel rank's partial sum, the residual added by rank 0)."""
    act, _ = gemv_ref(x, gate_up, silu_mul=True, norm_folded=norm_folded, eps=eps)
    return gemv_ref(act, down, add=residual)[0]


def fused_mlp_finish_ref(accumulator: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    """What the finishing kernel stores from the float32 down sums [M, H] and the residual [M, H]: the projection
    rounded to the model dtype, then the residual add rounded (the unfused path's `down(act) + residual`)."""
    return accumulator.to(residual.dtype) + residual


@triton.jit
def _mlp_kernel(
    x_ptr, wgu_ptr, wd_ptr, acc_ptr, sums_ptr,
    M, K, INTER, H, eps, x_stride, wgu_stride, wd_stride,
    BLOCK_M: tl.constexpr, BI: tl.constexpr, BK: tl.constexpr, BH: tl.constexpr,
    NORM: tl.constexpr, NORM_CHUNK: tl.constexpr, DOT_PRECISION: tl.constexpr,
    NORM_SUMS: tl.constexpr = False, NUM_SLOTS: tl.constexpr = 1, SLOT_STRIDE: tl.constexpr = 1,
    SUM_UNIT: tl.constexpr = 1048576.0, WAIT_GDC: tl.constexpr = False, TRIGGER_GDC: tl.constexpr = False,
):
    pid = tl.program_id(0)
    rows = pid * BI + tl.arange(0, BI)  # this program's intermediate rows (gate row n, up row INTER + n)
    row_mask = rows < INTER
    m = tl.arange(0, BLOCK_M)
    m_mask = m < M
    ks = tl.arange(0, BK)
    g_ptrs = wgu_ptr + rows.to(tl.int64)[:, None] * wgu_stride + ks[None, :]
    u_ptrs = wgu_ptr + (rows + INTER).to(tl.int64)[:, None] * wgu_stride + ks[None, :]
    acc_g = tl.zeros([BLOCK_M, BI], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_M, BI], dtype=tl.float32)
    # griddepcontrol (the GPU only): TRIGGER_GDC lets the finishing kernel launch now (it waits for this kernel's end
    # before reading anything); WAIT_GDC: launched with PDL, so wait for the kernel before (x, the carried sums) first.
    _enter(WAIT_GDC, TRIGGER_GDC)
    if NORM_SUMS:  # the carried norm: each token's sum of squares added by the o_proj epilogue (gemv's NormCarryOut)
        sumsq = _slots_sumsq(_load_slots(sums_ptr, m, m_mask, NUM_SLOTS, SLOT_STRIDE), SUM_UNIT)
    elif NORM:
        sumsq = _row_sumsq(x_ptr, x_stride, M, K, BLOCK_M, NORM_CHUNK)
    for k0 in range(0, K, BK):
        k_mask = k0 + ks < K
        x = tl.load(x_ptr + m[:, None] * x_stride + k0 + ks[None, :], mask=m_mask[:, None] & k_mask[None, :],
                    other=0.0)
        w_mask = row_mask[:, None] & k_mask[None, :]
        wg = tl.load(g_ptrs + k0, mask=w_mask, other=0.0)
        wu = tl.load(u_ptrs + k0, mask=w_mask, other=0.0)
        acc_g = tl.dot(x, tl.trans(wg), acc_g, input_precision=DOT_PRECISION)
        acc_u = tl.dot(x, tl.trans(wu), acc_u, input_precision=DOT_PRECISION)
    if NORM:
        inv_rms = tl.rsqrt(sumsq / K + eps)[:, None]
        acc_g = acc_g * inv_rms
        acc_u = acc_u * inv_rms
    dtype = x_ptr.dtype.element_ty
    g = acc_g.to(dtype).to(tl.float32)  # rounded like the unfused projection, then SiLU-and-mul as gemv.py
    u = acc_u.to(dtype).to(tl.float32)
    act = tl.where(row_mask[None, :], g * tl.sigmoid(g) * u, 0.0).to(dtype)  # [BLOCK_M, BI]; padding rows 0
    hs = tl.arange(0, BH)
    d_ptrs = wd_ptr + hs.to(tl.int64)[:, None] * wd_stride + rows[None, :]  # down's [BH, BI] tile, BI contiguous
    out_ptrs = acc_ptr + m[:, None] * H + hs[None, :]  # every program adds into the one zeroed [M, H] accumulator
    for h0 in range(0, H, BH):
        h_mask = h0 + hs < H
        wd = tl.load(d_ptrs + h0 * wd_stride, mask=h_mask[:, None] & row_mask[None, :], other=0.0)
        part = tl.dot(act, tl.trans(wd), input_precision=DOT_PRECISION)  # [BLOCK_M, BH]
        tl.atomic_add(out_ptrs + h0, part, mask=m_mask[:, None] & h_mask[None, :], sem="relaxed")


@triton.jit
def _mlp_finish_kernel(
    acc_ptr, res_ptr, out_ptr, sums_out_ptr, sums_zero_ptr, H, res_stride, out_stride, BLOCK_H: tl.constexpr,
    SUMS_OUT: tl.constexpr = False, ZERO_SUMS: tl.constexpr = False, SUMS_ROWS: tl.constexpr = 16,
    NUM_SLOTS: tl.constexpr = 1, SLOT_STRIDE: tl.constexpr = 1, SUM_UNIT: tl.constexpr = 1048576.0,
    PDL_GDC: tl.constexpr = False, TRIGGER_FIRST: tl.constexpr = False, ADD_RESIDUAL: tl.constexpr = True,
):
    # Program (column block, token): the accumulated down projection, rounded, plus the residual (unless
    # ADD_RESIDUAL is off: a tensor-parallel rank > 0's partial sum); the accumulator zeroed behind it.
    # PDL_GDC: launched while the streaming kernel runs, so nothing is read before it has finished; TRIGGER_FIRST: the
    # next kernel (the next layer's qkv) let in now, which reads this one's output after its own wait.
    _enter(PDL_GDC, TRIGGER_FIRST)
    pid = tl.program_id(0)
    cols = pid * BLOCK_H + tl.arange(0, BLOCK_H)
    row = tl.program_id(1)
    share = _finish_cols(acc_ptr, res_ptr, out_ptr, row, cols, H, res_stride, out_stride, SUM_UNIT, ADD_RESIDUAL)
    if SUMS_OUT:  # the next RMSNorm's first half (its g folded into the next qkv): this program's share of sum(s^2)
        tl.atomic_add(sums_out_ptr + row * (NUM_SLOTS * SLOT_STRIDE) + (pid % NUM_SLOTS) * SLOT_STRIDE, share,
                      sem="relaxed")
    if ZERO_SUMS:  # the carried sums the streaming kernel read, put back to zero (program (0, 0) only)
        _zero_slots(sums_zero_ptr, (pid == 0) & (row == 0), SUMS_ROWS, NUM_SLOTS, SLOT_STRIDE)


@triton.jit
def _enter(WAIT: tl.constexpr, TRIGGER_FIRST: tl.constexpr):
    """A kernel's griddepcontrol at its start (the GPU only; neither flag: nothing): TRIGGER_FIRST lets the kernel
    after it launch before anything else; WAIT waits for the kernel before it (launched with PDL), then, unless
    triggered already, lets the next one launch."""
    if TRIGGER_FIRST:
        gdc_launch_dependents()
    if WAIT:
        gdc_wait()
        if not TRIGGER_FIRST:
            gdc_launch_dependents()


@triton.jit
def _finish_cols(acc_ptr, res_ptr, out_ptr, row, cols, H, res_stride, out_stride, SUM_UNIT: tl.constexpr,
                 ADD_RESIDUAL: tl.constexpr = True):
    """Columns `cols` of token `row`: the accumulated down projection rounded, plus the residual (ADD_RESIDUAL),
    stored; the accumulator zeroed behind it for the next launch. -> sum(s^2) of the stored columns in fixed point
    (gemv's _fixed_point, as its CARRY)."""
    col_mask = cols < H
    acc = tl.load(acc_ptr + row * H + cols, mask=col_mask, other=0.0)
    tl.store(acc_ptr + row * H + cols, tl.zeros_like(acc), mask=col_mask)
    dtype = out_ptr.dtype.element_ty
    y = acc.to(dtype).to(tl.float32)  # down's output rounded, then the residual add (gemv.py's ADD epilogue)
    if ADD_RESIDUAL:
        r = tl.load(res_ptr + row * res_stride + cols, mask=col_mask, other=0.0).to(tl.float32)
        s = (y + r).to(dtype)
    else:
        s = y.to(dtype)
    tl.store(out_ptr + row * out_stride + cols, s, mask=col_mask)
    s32 = tl.where(col_mask, s.to(tl.float32), 0.0)
    return _fixed_point(tl.sum(s32 * s32, axis=0), SUM_UNIT)


@dataclass(frozen=True, slots=True)
class MlpConfig:
    """Intermediate rows per program (bi), K slice of the gate/up stream (bk), output columns per down step (bh),
    warps and pipeline stages of the streaming kernel."""

    bi: int
    bk: int = 128
    bh: int = 256
    num_warps: int = 4
    num_stages: int = 3


def mlp_config(on_gpu: bool, elem_bytes: int, inter: int) -> MlpConfig:
    """From the H200 sweep (session 12, bf16, M = 1, us a layer in 8-layer CUDA-graph chains, two GEMVs 89.2 at 8B
    and 31.5 at 1B): bi 128 (112 programs at 8B's 14,336) bk 128 bh 256 w4 s3 86.1, w8 86.4, bh 128 86.6, bi 64 89.8;
    at 1B (8,192) bi 64 (128 programs) bh 256 w4 s4 30.0, bi 128 31.4-33.3. So: at least ~100 programs."""
    if not on_gpu:  # the interpreter pays per program and numpy op: small tiles, a few of each
        return MlpConfig(bi=16, bk=32, bh=32, num_warps=4, num_stages=1)
    if elem_bytes > 2:  # float32 (tests): the 16-bit tiles' pipeline stages would overflow shared memory
        return MlpConfig(bi=64, bk=32, bh=64, num_warps=4, num_stages=3)
    if inter >= 100 * 128:
        return MlpConfig(bi=128, num_stages=3)
    return MlpConfig(bi=64, num_stages=4)


def fused_mlp_triton(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, residual: torch.Tensor | None, *,
                     eps: float, norm_folded: bool = True, config: MlpConfig | None = None,
                     accumulator: torch.Tensor | None = None, norm_sums: torch.Tensor | None = None,
                     sums_out: torch.Tensor | None = None, zero_sums: torch.Tensor | None = None,
                     pdl: bool = False, finish_early: bool = False, finish: bool = True) -> torch.Tensor:
    """fused_mlp_ref in two launches. x, residual: [M, H]; gate_up [2I, H] ([gate; up] rows, the norm weight folded
    in when norm_folded); down [H, I]; all the model dtype. residual None: no residual add (a tensor-parallel
    rank's partial sum of the row-parallel down, rank 0 adding the residual before the all-reduce). accumulator:
    contiguous float32 of >= M * H elements, all zero (the second launch leaves it zero again, so a static one
    serves every layer and step); None allocates one.

    The carried norms (fused_decode.NormCarry in its folded form; gemv.norm_sums_buffer layouts): norm_sums (instead
    of norm_folded) holds each token's sum of x^2, added by the o_proj epilogue, and replaces the rms pass over x;
    sums_out: the finishing kernel adds each token's sum(out^2) into it (for the next layer's qkv, whose weights hold
    its norm's g); zero_sums: a buffer the finishing kernel sets to zero (the norm_sums just read). pdl: the
    streaming kernel launched with programmatic dependent launch (it waits for the kernel before first thing, so its
    launch and setup overlap that kernel's end); pdl or finish_early: the finishing kernel too. finish_early: the
    streaming kernel lets the finishing kernel launch as it starts, and the finishing kernel lets the kernel after
    it in before its own wait, so that one (the next layer's qkv, launched with PDL) is resident and loading its
    first weight tile when the MLP ends. Every read of another kernel's output stays after a wait.

    finish False: the streaming kernel alone; returns the accumulator's first M * H elements as [M, H] float32, the
    down projection's sums, left for a later kernel to round, add the residual to and zero
    (fused_decode.MLP_FINISH_IN_QKV: the next layer's qkv and o_proj); residual is not read, and the finishing
    kernel's arguments (sums_out, zero_sums, finish_early) are refused."""
    if x.dim() != 2 or gate_up.dim() != 2 or down.dim() != 2:
        raise ValueError(f"fused_mlp: x [M, H], gate_up [2I, H], down [H, I] expected, got "
                         f"{tuple(x.shape)}, {tuple(gate_up.shape)}, {tuple(down.shape)}")
    num_rows, hidden = x.shape
    inter = gate_up.shape[0] // 2
    res = residual if residual is not None else x  # shape and dtype as x's either way
    if gate_up.shape != (2 * inter, hidden) or down.shape != (hidden, inter) or res.shape != x.shape:
        raise ValueError(f"fused_mlp: shapes disagree: x {tuple(x.shape)}, gate_up {tuple(gate_up.shape)}, down "
                         f"{tuple(down.shape)}, residual {tuple(res.shape)}")
    if not (x.dtype == gate_up.dtype == down.dtype == res.dtype):
        raise ValueError(f"fused_mlp: one dtype expected, got x {x.dtype}, gate_up {gate_up.dtype}, down "
                         f"{down.dtype}, residual {res.dtype}")
    if not 1 <= num_rows <= 16:
        raise ValueError(f"fused_mlp: 1..16 tokens (the dot tile), got {num_rows}")
    for name, t in (("x", x), ("gate_up", gate_up), ("down", down), ("residual", res)):
        if t.stride(-1) != 1:
            raise ValueError(f"fused_mlp: {name} must be contiguous along its last dimension")
    if norm_sums is not None:
        if norm_folded:
            raise ValueError("fused_mlp: norm_sums is the carried norm; pass norm_folded=False with it")
        _check_norm_sums(norm_sums, num_rows, x.device, "norm_sums")
    if sums_out is not None:
        _check_norm_sums(sums_out, num_rows, x.device, "sums_out")
    _check_zero_sums(zero_sums, x)
    if not finish and (sums_out is not None or zero_sums is not None or finish_early):
        raise ValueError("fused_mlp: sums_out, zero_sums and finish_early are the finishing kernel's; finish=False "
                         "launches none")
    check_launchable(x, gate_up, down, res)
    cfg = config or mlp_config(x.is_cuda, x.element_size(), inter)
    need = num_rows * hidden
    if accumulator is None:
        accumulator = torch.zeros(need, dtype=torch.float32, device=x.device)
    elif accumulator.dtype != torch.float32 or accumulator.numel() < need or not accumulator.is_contiguous():
        raise ValueError(f"fused_mlp: the accumulator must be contiguous float32 of >= {need} elements, got "
                         f"{accumulator.dtype} {tuple(accumulator.shape)}")
    on_gpu = not interpreting()  # griddepcontrol and the launch attribute: the GPU only
    gdc, early = pdl and on_gpu, finish_early and on_gpu
    slots = {"NUM_SLOTS": _gemv.NORM_SLOTS, "SLOT_STRIDE": _gemv.NORM_SLOT_STRIDE, "SUM_UNIT": _gemv.NORM_SUM_UNIT}
    placeholder = accumulator  # any tensor: its pointer is never read
    _mlp_kernel[(triton.cdiv(inter, cfg.bi),)](
        x, gate_up, down, accumulator, norm_sums if norm_sums is not None else placeholder,
        num_rows, hidden, inter, hidden, eps, x.stride(0), gate_up.stride(0), down.stride(0),
        BLOCK_M=16, BI=cfg.bi, BK=cfg.bk, BH=cfg.bh, NORM=norm_folded or norm_sums is not None,
        NORM_CHUNK=norm_chunk(hidden, cfg.num_warps, x.is_cuda), DOT_PRECISION=_dot_precision(x.dtype),
        NORM_SUMS=norm_sums is not None, WAIT_GDC=gdc, TRIGGER_GDC=early, **slots,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **({"launch_pdl": True} if gdc else {}),
    )
    if not finish:
        return accumulator[:need].view(num_rows, hidden)
    out = torch.empty_like(res, memory_format=torch.contiguous_format)
    block_h = 256 if x.is_cuda else 32
    _mlp_finish_kernel[(triton.cdiv(hidden, block_h), num_rows)](
        accumulator, res, out, sums_out if sums_out is not None else placeholder,
        zero_sums if zero_sums is not None else placeholder, hidden, res.stride(0), out.stride(0),
        BLOCK_H=block_h, SUMS_OUT=sums_out is not None, ZERO_SUMS=zero_sums is not None,
        SUMS_ROWS=zero_sums.shape[0] if zero_sums is not None else 16, PDL_GDC=gdc or early, TRIGGER_FIRST=early,
        ADD_RESIDUAL=residual is not None, **slots, num_warps=4, **({"launch_pdl": True} if gdc or early else {}),
    )
    return out
