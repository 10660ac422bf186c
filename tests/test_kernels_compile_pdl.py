"""The PDL forms of the fused decode kernels, compiled for the H200 (sm_90) on a machine without a GPU: where
griddepcontrol.wait and griddepcontrol.launch_dependents sit in the PTX relative to the loads (the interpreter
runs no PTX, and on the GPU a misplaced wait shows only as a race or as lost overlap)."""

from __future__ import annotations

import inspect
import os
import re
from typing import Any

import pytest

if os.environ.get("TRITON_INTERPRET") == "1":
    pytest.skip("compiling for sm_90 needs Triton's JIT, not its interpreter", allow_module_level=True)
triton = pytest.importorskip("triton")
from test_kernels_compile_sm90 import H200, _attention_signature, _gemv_signature  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

LOADS = ("ld.global", "cp.async.ca", "cp.async.cg")


def _ptx(fn: Any, signature: dict[str, str], constexprs: dict[str, Any], warps: int, stages: int,
         aligned: dict[tuple[int, ...], Any]) -> list[str]:
    try:
        kernel = triton.compile(ASTSource(fn, signature, constexprs=constexprs, attrs=aligned), target=H200,
                                options={"num_warps": warps, "num_stages": stages})
    except RuntimeError as e:
        if "ptxas" in str(e).lower():
            pytest.skip(f"no ptxas for sm_90 here: {e}")
        raise
    return kernel.asm["ptx"].splitlines()


def _index(lines: list[str], text: str) -> int:
    found = [i for i, line in enumerate(lines) if text in line]
    assert len(found) == 1, f"{text}: {len(found)} times"
    return found[0]


def _loads(lines: list[str]) -> int:
    return sum(1 for line in lines if any(op in line for op in LOADS))


def _loop_headers(lines: list[str]) -> list[int]:
    return [i for i, line in enumerate(lines) if "Loop Header" in line]


def _gemv_ptx(kind: str, pdl: bool, trigger_first: bool = False) -> list[str]:
    from stoker.engine.kernels import gemv

    n_out = {"rope": 3072, "silu": 14336, "plain": 4096}[kind]
    cfg = gemv.gemv_config(kind + ("-norm" if kind != "plain" else ""), 1, n_out, 4096, True)
    signature = _gemv_signature("bf16")
    constexprs = dict(BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, USE_DOT=cfg.use_dot,
                      DOT_PRECISION="tf32", NORM=kind != "plain", PRO_RESIDUAL=False, APPLY_G=False,
                      HAS_BIAS=False, SILU_MUL=kind == "silu", ADD=kind == "plain", ROTARY=kind == "rope",
                      QK_NORM=False, HALF=64, SPLITS_PER_HEAD=64 // cfg.block_n if kind == "rope" else 1,
                      PAIRED=kind != "plain", USE_PDL=pdl, NORM_CHUNK=gemv.norm_chunk(4096, cfg.num_warps, True),
                      W_SCALED=False, W_CONVERT=0, W_VEC=0, W_SUM=False, PDL_TILES=1, PDL_GDC=pdl,
                      PDL_TRIGGER_FIRST=trigger_first)
    names = list(inspect.signature(gemv._gemv_kernel.fn).parameters)
    signature = {name: signature[name] for name in names}
    aligned = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(names)
               if name.endswith("_ptr") or name in ("K", "x_stride", "w_stride", "out_stride", "add_stride")}
    return _ptx(gemv._gemv_kernel, signature, constexprs, cfg.num_warps, cfg.num_stages, aligned)


@pytest.mark.parametrize("kind", ["rope", "silu", "plain"])
def test_gemv_pdl_loads_the_first_weight_tile_before_the_wait(kind: str) -> None:
    """pdl: the first weight tile is loaded before griddepcontrol.wait (weights never depend on the previous
    kernel), launch_dependents follows the wait with no load between, before any loop (the rms pass's, the
    weights'); without pdl the kernel has neither instruction."""
    lines = _gemv_ptx(kind, pdl=True)
    wait = _index(lines, "griddepcontrol.wait")
    trigger = _index(lines, "griddepcontrol.launch_dependents")
    assert _loads(lines[:wait]) > 0
    assert wait < trigger < _loop_headers(lines)[0] and _loads(lines[wait:trigger]) == 0
    assert not any("griddepcontrol" in line for line in _gemv_ptx(kind, pdl=False))


def test_gemv_pdl_trigger_first_lets_the_next_kernel_in_before_anything() -> None:
    """pdl_trigger_first (qkv before the decode attention): launch_dependents is the first griddepcontrol, before
    any load and before the wait, which still precedes every load of x (after the first weight tile's)."""
    lines = _gemv_ptx("rope", pdl=True, trigger_first=True)
    trigger = _index(lines, "griddepcontrol.launch_dependents")
    wait = _index(lines, "griddepcontrol.wait")
    assert _loads(lines[:trigger]) == 0 and trigger < wait and _loads(lines[trigger:wait]) > 0


def test_decode_attention_pdl_reads_older_keys_before_the_wait() -> None:
    """USE_PDL: the block table and the first key tile's older keys / values load before griddepcontrol.wait,
    which comes once, followed by launch_dependents; without it the kernel has neither instruction."""
    from stoker.engine.kernels import attention

    names = list(inspect.signature(attention._decode_split_kernel.fn).parameters)
    signature, aligned = _attention_signature(names, "bf16")
    constexprs = dict(NUM_KV_HEADS=8, GROUP=4, BLOCK_G=16, HEAD_DIM=128, BLOCK_D=128, BLOCK_SIZE=16, TILE_N=64,
                      NUM_SPLITS=16, DOT_PRECISION="tf32", FP8_CACHE=False, FUSED_COMBINE=True, BLOCK_S=16,
                      BLOCK_GP=4, CHUNK_S=16, USE_PDL=True, PDL_GDC=True)
    lines = _ptx(attention._decode_split_kernel, signature, constexprs, 4, 3, aligned)
    wait = _index(lines, "griddepcontrol.wait")
    assert _loads(lines[:wait]) >= 1 + 2 * 8  # context_len, the table, K and V rows (16-byte loads, 8 a thread)
    trigger = _index(lines, "griddepcontrol.launch_dependents")
    assert wait < trigger and _loads(lines[wait:trigger]) == 0
    plain = _ptx(attention._decode_split_kernel, signature, {**constexprs, "USE_PDL": False, "PDL_GDC": False}, 4,
                 3, aligned)
    assert not any("griddepcontrol" in line for line in plain)


@pytest.mark.parametrize("tiles", [2, 4])
def test_gemv_pdl_tiles_all_load_before_the_wait(tiles: int) -> None:
    """GemvConfig.pdl_tiles (o_proj after the attention): the first `tiles` weight tiles all load before
    griddepcontrol.wait, `tiles` times the one tile of the default form, and none after it but x's and the
    loop's; FP8 o_proj at the 8B shape, one token, 1 x 4 x 1024 a tile (4 tiles are its whole K)."""
    from stoker.engine.kernels import gemv
    from test_kernels_compile_sm90 import _fp8_gemv_signature

    cfg = gemv.GemvConfig(1, 4, 1024, False, 4, 3)
    w_vec = gemv._row_vec(cfg, 2, True)
    signature, aligned = _fp8_gemv_signature(2)

    def before_wait(pdl_tiles: int) -> tuple[int, list[str]]:
        constexprs = dict(BLOCK_M=1, BLOCK_N=4, BLOCK_K=1024, USE_DOT=False, DOT_PRECISION="tf32", NORM=False,
                          PRO_RESIDUAL=False, APPLY_G=False, HAS_BIAS=False, SILU_MUL=False, ADD=True, ROTARY=False,
                          QK_NORM=False, HALF=64, SPLITS_PER_HEAD=1, PAIRED=False, USE_PDL=True, W_SCALED=True,
                          W_CONVERT=2, NORM_CHUNK=gemv.norm_chunk(4096, 4, True), W_VEC=w_vec,
                          W_SUM=gemv.row_sum(w_vec, True), PDL_TILES=pdl_tiles, PDL_GDC=True,
                          PDL_TRIGGER_FIRST=False)
        lines = _ptx(gemv._gemv_kernel, signature, constexprs, 4, 3, aligned)
        return _loads(lines[:_index(lines, "griddepcontrol.wait")]), lines

    one, _ = before_wait(1)
    many, lines = before_wait(tiles)
    assert one > 0 and many == tiles * one, (one, many)
    wait = _index(lines, "griddepcontrol.wait")
    assert wait < _index(lines, "griddepcontrol.launch_dependents")


def test_rms_norm_pdl_waits_before_reading_x() -> None:
    """The norm between two PDL GEMVs (pdl=True): griddepcontrol.wait comes before any load (x is the previous
    kernel's output), launch_dependents right after it, before the loads; without PDL_GDC neither appears."""
    from stoker.engine.kernels import rmsnorm

    names = list(inspect.signature(rmsnorm._rms_norm_kernel.fn).parameters)
    signature = {name: "*bf16" for name in names if name.endswith("_ptr")}
    signature.update({name: "i32" for name in names if name.endswith("_stride") or name == "hidden"}, eps="fp32")
    signature.update(HAS_RESIDUAL="constexpr", BLOCK="constexpr", PDL_GDC="constexpr")
    signature = {name: signature[name] for name in names}
    aligned = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(names) if name.endswith("_ptr")}
    constexprs = dict(HAS_RESIDUAL=True, BLOCK=4096, PDL_GDC=True)
    lines = _ptx(rmsnorm._rms_norm_kernel, signature, constexprs, 8, 1, aligned)
    wait = _index(lines, "griddepcontrol.wait")
    trigger = _index(lines, "griddepcontrol.launch_dependents")
    assert _loads(lines[:wait]) == 0 and wait < trigger and _loads(lines[trigger:]) > 0
    plain = _ptx(rmsnorm._rms_norm_kernel, signature, {**constexprs, "PDL_GDC": False}, 8, 1, aligned)
    assert not any("griddepcontrol" in line for line in plain)


def _kind(fn: Any, name: str) -> str:
    """A scalar parameter's signature entry: "constexpr" where it is annotated so, else i32."""
    annotation = inspect.signature(fn.fn).parameters[name].annotation
    return "constexpr" if "constexpr" in str(annotation) else "i32"


def _mlp_ptx(carried: bool, pdl: bool, early: bool = False) -> tuple[list[str], list[str]]:
    """(streaming kernel, finishing kernel) PTX of the fused MLP at the 8B shape as fused_decode launches it."""
    from stoker.engine.kernels import fused_mlp, gemv

    cfg = fused_mlp.mlp_config(True, 2, 14336)
    names = list(inspect.signature(fused_mlp._mlp_kernel.fn).parameters)
    pointers = {"x_ptr": "*bf16", "wgu_ptr": "*bf16", "wd_ptr": "*bf16", "acc_ptr": "*fp32", "sums_ptr": "*i64"}
    signature = {name: pointers.get(name, _kind(fused_mlp._mlp_kernel, name)) for name in names}
    signature["eps"] = "fp32"
    aligned = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(names)
               if name.endswith("_ptr") or name in ("K", "H", "x_stride", "wgu_stride", "wd_stride")}
    slots = dict(NUM_SLOTS=gemv.NORM_SLOTS, SLOT_STRIDE=gemv.NORM_SLOT_STRIDE, SUM_UNIT=gemv.NORM_SUM_UNIT)
    constexprs = dict(BLOCK_M=16, BI=cfg.bi, BK=cfg.bk, BH=cfg.bh, NORM=True, NORM_CHUNK=gemv.norm_chunk(4096, 4, True),
                      DOT_PRECISION="tf32", NORM_SUMS=carried, WAIT_GDC=pdl, TRIGGER_GDC=early, **slots)
    stream = _ptx(fused_mlp._mlp_kernel, signature, constexprs, cfg.num_warps, cfg.num_stages, aligned)
    names = list(inspect.signature(fused_mlp._mlp_finish_kernel.fn).parameters)
    pointers = {"acc_ptr": "*fp32", "res_ptr": "*bf16", "out_ptr": "*bf16", "sums_out_ptr": "*i64",
                "sums_zero_ptr": "*i64"}
    signature = {name: pointers.get(name, _kind(fused_mlp._mlp_finish_kernel, name)) for name in names}
    aligned = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(names) if name.endswith("_ptr")}
    constexprs = dict(BLOCK_H=256, SUMS_OUT=carried, ZERO_SUMS=carried, SUMS_ROWS=16, PDL_GDC=pdl or early,
                      TRIGGER_FIRST=early, **slots)
    finish = _ptx(fused_mlp._mlp_finish_kernel, signature, constexprs, 4, 3, aligned)
    return stream, finish


@pytest.mark.parametrize("carried", [False, True], ids=["rms-pass", "carried-sums"])
def test_fused_mlp_pdl_forms_read_other_kernels_outputs_after_their_waits(carried: bool) -> None:
    """The fused MLP's PDL forms. pdl (fused_decode.MLP_PDL): the streaming kernel waits before any global load (x
    is o_proj's output, the carried sums its epilogue's) and lets the finishing kernel in right after, before any
    loop; the finishing kernel waits before any load (it reads the accumulator the streaming kernel fills), then
    lets its successor in. early (FINISH_EARLY): the streaming kernel lets the finishing kernel in first thing and
    has no wait; the finishing kernel lets its successor in before its own wait, and still loads nothing before it.
    With the carried norms the finishing kernel adds its 64-bit sums (red/atom) and zeroes the ones read (64-bit
    stores), and the streaming kernel loads the sums. Without either form neither kernel has griddepcontrol."""
    stream, finish = _mlp_ptx(carried, pdl=True)
    wait = _index(stream, "griddepcontrol.wait")
    trigger = _index(stream, "griddepcontrol.launch_dependents")
    assert _loads(stream[:wait]) == 0 and wait < trigger < _loop_headers(stream)[0]
    if carried:
        assert any("ld.global" in line and ".b64" in line for line in stream[trigger:]), "the sums are not loaded"
    wait = _index(finish, "griddepcontrol.wait")
    assert _loads(finish[:wait]) == 0 and wait < _index(finish, "griddepcontrol.launch_dependents")
    ptx = "\n".join(finish)
    assert bool(re.search(r"\b(red|atom)\.global(\.\w+)*\.(u64|s64)", ptx)) == carried
    assert bool(re.search(r"st\.global(\.\w+)*\.b64", ptx)) == carried
    stream, finish = _mlp_ptx(carried, pdl=False, early=True)
    assert not any("griddepcontrol.wait" in line for line in stream)
    assert _index(stream, "griddepcontrol.launch_dependents") < _loop_headers(stream)[0]
    trigger, wait = _index(finish, "griddepcontrol.launch_dependents"), _index(finish, "griddepcontrol.wait")
    assert trigger < wait and _loads(finish[:wait]) == 0
    plain_stream, plain_finish = _mlp_ptx(carried, pdl=False)
    assert not any("griddepcontrol" in line for line in plain_stream + plain_finish)


def _stores(lines: list[str]) -> int:
    return sum(1 for line in lines if re.search(r"\b(st|red|atom)\.global", line))


def _pending_ptx(kernel: str, pending: bool) -> list[str]:
    """fused_decode.MLP_FINISH_IN_QKV's two GEMVs at the 8B shape, one token, as the engine launches them under PDL
    (bf16): "qkv" on the previous MLP's float32 accumulator (else on the carried sums), "o_proj" with its residual
    add adding the MLP's sums and zeroing the accumulator (ZERO_ACC; else without)."""
    from stoker.engine.kernels import gemv
    from test_kernels_compile_sm90 import pending_qkv_constexprs

    names = list(inspect.signature(gemv._gemv_kernel.fn).parameters)
    signature = _gemv_signature("bf16")
    if kernel == "qkv":
        cfg = gemv.gemv_config("rope-norm", 1, 3072, 4096, True)
        constexprs = pending_qkv_constexprs(cfg, pending, pdl=True)
        if pending:
            signature["x_ptr"] = "*fp32"
    else:
        cfg = gemv.gemv_config("plain", 1, 4096, 4096, True)
        w_vec = gemv._row_vec(cfg, 2, False)
        constexprs = dict(BLOCK_M=1, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, USE_DOT=False, DOT_PRECISION="tf32",
                          NORM=False, PRO_RESIDUAL=False, APPLY_G=False, HAS_BIAS=False, SILU_MUL=False, ADD=True,
                          ROTARY=False, QK_NORM=False, HALF=64, SPLITS_PER_HEAD=1, PAIRED=False, USE_PDL=True,
                          NORM_CHUNK=gemv.norm_chunk(4096, cfg.num_warps, True), W_SCALED=False, W_CONVERT=0,
                          W_VEC=w_vec, W_SUM=gemv.row_sum(w_vec, False), PDL_TILES=cfg.pdl_tiles, PDL_GDC=True,
                          PDL_TRIGGER_FIRST=False, CARRY=True, CARRY_X=False, ZERO_SUMS=True,
                          NUM_SLOTS=gemv.NORM_SLOTS, SUMS_ROWS=gemv.GEMV_MAX_M, SUM_UNIT=gemv.NORM_SUM_UNIT,
                          SLOT_STRIDE=gemv.NORM_SLOT_STRIDE, SUMS_AT_END=gemv.NORM_SUMS_AT_END, ZERO_ACC=pending)
    signature = {name: signature[name] for name in names}
    aligned = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(names)
               if name.endswith("_ptr") or name in ("K", "x_stride", "w_stride", "out_stride", "add_stride")}
    return _ptx(gemv._gemv_kernel, signature, constexprs, cfg.num_warps, cfg.num_stages, aligned)


@pytest.mark.parametrize("kernel", ["qkv", "o_proj"])
def test_pending_mlp_gemvs_touch_other_kernels_buffers_after_their_waits(kernel: str) -> None:
    """fused_decode.MLP_FINISH_IN_QKV under PDL (NormCarry's ordering argument rests on it): the qkv reading the
    previous MLP's accumulator and the stream loads before griddepcontrol.wait only what the carried form loads
    there (its first weight tile) and stores nothing before it (the stream, the zeroed slots come after); the o_proj
    that zeroes the accumulator stores nothing before its wait (its K tiles load there), and its zeroing adds stores
    after it."""
    lines = {pending: _pending_ptx(kernel, pending) for pending in (False, True)}
    wait = {pending: _index(lines[pending], "griddepcontrol.wait") for pending in lines}
    for pending in lines:
        assert _stores(lines[pending][: wait[pending]]) == 0, pending
        assert wait[pending] < _index(lines[pending], "griddepcontrol.launch_dependents")
    assert _loads(lines[True][: wait[True]]) == _loads(lines[False][: wait[False]]) > 0
    assert _stores(lines[True]) > _stores(lines[False])
