"""Compile kernels for the H200 (sm_90) on a machine without a GPU: Triton's own compiler and ptxas, no launch.

Why: the CPU tests run the kernels under TRITON_INTERPRET=1, which accepts what the GPU compiler refuses. On
the H200 (2026-12-01) two such bugs cost a GPU call: the FP8 quantization kernel read plain float module
globals (the interpreter reads any global; the compiler only constexpr ones: 42 GPU tests failed), and a
float32 GEMV config asked 240 KB of shared memory (the H200 has 227 KB a block). Both show here, at compile.
"""

from __future__ import annotations

import inspect
import os
import re
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import pytest

if os.environ.get("TRITON_INTERPRET") == "1":  # the kernels are interpreted functions then: nothing to compile
    pytest.skip("compiling for sm_90 needs Triton's JIT, not its interpreter", allow_module_level=True)
triton = pytest.importorskip("triton")
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

H200 = GPUTarget("cuda", 90, 32)
H200_SHARED_BYTES = 232_448  # per block (the limit the launch checks against)


def _compile(fn: Any, signature: dict[str, str], constexprs: dict[str, Any], warps: int, stages: int = 3) -> Any:
    try:
        return triton.compile(ASTSource(fn, signature, constexprs=constexprs), target=H200,
                              options={"num_warps": warps, "num_stages": stages})
    except RuntimeError as e:  # no CUDA toolchain in this triton install (ptxas ships with the wheel)
        if "ptxas" in str(e).lower():
            pytest.skip(f"no ptxas for sm_90 here: {e}")
        raise


@pytest.mark.parametrize("norm, static", [(False, False), (False, True), (True, False), (True, True)])
def test_fp8_quantization_kernel_compiles_for_sm90(norm: bool, static: bool) -> None:
    from stoker.engine.kernels import fp8_quant

    signature = {"x_ptr": "*bf16", "residual_ptr": "*bf16", "norm_ptr": "*bf16", "sum_ptr": "*bf16",
                 "xq_ptr": "*fp8e4nv", "scale_ptr": "*fp32", "static_scale_ptr": "*fp32", "x_stride": "i32",
                 "residual_stride": "i32", "sum_stride": "i32", "xq_stride": "i32", "K": "i32", "eps": "fp32",
                 "NORM": "constexpr", "HAS_RESIDUAL": "constexpr", "STATIC": "constexpr", "BLOCK": "constexpr"}
    kernel = _compile(fp8_quant._quant_fp8_kernel, signature,
                      {"NORM": norm, "HAS_RESIDUAL": norm, "STATIC": static, "BLOCK": 4096}, warps=8)
    assert kernel.metadata.shared <= H200_SHARED_BYTES


@pytest.mark.parametrize("has_rows", [False, True])
def test_token_bitmask_kernel_compiles_for_sm90(has_rows: bool) -> None:
    from stoker.engine.kernels import token_bitmask

    signature = {"logits_ptr": "*fp32", "bitmask_ptr": "*i32", "rows_ptr": "*i64" if has_rows else "*i32",
                 "logits_row_stride": "i32", "bitmask_row_stride": "i32", "vocab": "i32",
                 "HAS_ROWS": "constexpr", "WORDS": "constexpr"}
    kernel = _compile(token_bitmask._token_bitmask_kernel, signature,
                      {"HAS_ROWS": has_rows, "WORDS": token_bitmask.WORDS_PER_PROGRAM}, warps=4)
    assert kernel.metadata.shared <= H200_SHARED_BYTES


_GEMV_POINTERS = ("x_ptr", "w_ptr", "out_ptr", "bias_ptr", "norm_ptr", "hres_ptr", "res_out_ptr", "add_ptr",
                  "positions_ptr", "cos_sin_ptr", "k_cache_ptr", "v_cache_ptr", "slot_ptr", "q_norm_ptr",
                  "k_norm_ptr", "w_scale_ptr", "sums_in_ptr", "sums_out_ptr", "sums_zero_ptr", "carry_g_ptr",
                  "carry_out_ptr", "k_scale_ptr", "v_scale_ptr", "acc_zero_ptr")
_GEMV_INTS = ("M", "N_OUT", "K", "x_stride", "w_stride", "out_stride", "hres_stride", "res_out_stride",
              "add_stride", "carry_out_stride", "NUM_Q_HEADS", "NUM_KV_HEADS")


def _gemv_signature(dtype: str) -> dict[str, str]:
    signature = {name: f"*{dtype}" for name in _GEMV_POINTERS}
    signature.update(positions_ptr="*i64", slot_ptr="*i64", cos_sin_ptr="*fp32", w_scale_ptr="*fp32", eps="fp32",
                     sums_in_ptr="*i64", sums_out_ptr="*i64", sums_zero_ptr="*i64", k_scale_ptr="*fp32",
                     v_scale_ptr="*fp32", acc_zero_ptr="*fp32")
    signature.update({name: "i32" for name in _GEMV_INTS})
    for name in ("BLOCK_M", "BLOCK_N", "BLOCK_K", "USE_DOT", "DOT_PRECISION", "NORM", "PRO_RESIDUAL", "APPLY_G",
                 "HAS_BIAS", "SILU_MUL", "ADD", "ROTARY", "QK_NORM", "HALF", "SPLITS_PER_HEAD", "PAIRED", "USE_PDL",
                 "NORM_CHUNK", "W_SCALED", "W_CONVERT", "W_VEC", "W_SUM", "PDL_TILES", "PDL_GDC",
                 "PDL_TRIGGER_FIRST", "NORM_SUMS", "CARRY", "CARRY_X", "ZERO_SUMS", "NUM_SLOTS", "SUMS_ROWS", "SUM_UNIT",
                 "SLOT_STRIDE",
                 "SUMS_AT_END", "FP8_CACHE", "X_ACC", "ZERO_ACC"):
        signature[name] = "constexpr"
    return signature


@pytest.mark.parametrize("dtype, elem_bytes", [("bf16", 2), ("fp32", 4)])
@pytest.mark.parametrize("kind, rows, norm", [("silu", 8, False), ("rope", 8, False), ("plain", 1, False),
                                              ("silu", 1, True), ("rope", 1, True)])
def test_gemv_configs_fit_the_h200s_shared_memory(dtype: str, elem_bytes: int, kind: str, rows: int,
                                                  norm: bool) -> None:
    """The configs gemv_config picks for the 8B shape compile for sm_90 and fit a block's shared memory (the
    float32 rotary tile of the bf16 sweep's shape asked 245,760 bytes); norm: the folded prologue norm."""
    from stoker.engine.kernels import gemv

    cfg = gemv.gemv_config(kind, rows, 4096, 4096, True, elem_bytes)
    constexprs = dict(BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, USE_DOT=cfg.use_dot,
                      DOT_PRECISION="ieee" if dtype == "fp32" else "tf32", NORM=norm, PRO_RESIDUAL=False,
                      APPLY_G=False, HAS_BIAS=False, SILU_MUL=kind == "silu", ADD=False, ROTARY=kind == "rope",
                      QK_NORM=False, HALF=64, SPLITS_PER_HEAD=2, PAIRED=kind in ("silu", "rope"), USE_PDL=False,
                      NORM_CHUNK=gemv.norm_chunk(4096, cfg.num_warps, True), W_SCALED=False, W_CONVERT=0,
                      W_VEC=0, W_SUM=False, PDL_TILES=1, PDL_GDC=False,
                      PDL_TRIGGER_FIRST=False)
    kernel = _compile(gemv._gemv_kernel, _gemv_signature(dtype), constexprs, cfg.num_warps, cfg.num_stages)
    assert kernel.metadata.shared <= H200_SHARED_BYTES, (cfg, kernel.metadata.shared)


@pytest.mark.parametrize("w_convert", [0, 1, 2], ids=["cast", "bits-join", "asm-join"])
@pytest.mark.parametrize("kind, rows", [("silu", 1), ("rope", 1), ("plain", 8)])
def test_fp8_fused_gemv_compiles_for_sm90(w_convert: int, kind: str, rows: int) -> None:
    """The fused GEMVs with FP8 weights (row scales; the float8 tile cast, or int32 words through the bit trick
    or the inline cvt.rn.f16x2.e4m3x2, which the interpreter never runs) compile for sm_90 and fit."""
    from stoker.engine.kernels import gemv

    cfg = gemv.gemv_config(kind, rows, 4096, 4096, True)
    signature = _gemv_signature("bf16")
    signature["w_ptr"] = "*fp8e4nv" if w_convert == 0 else "*i32"
    constexprs = dict(BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, USE_DOT=cfg.use_dot,
                      DOT_PRECISION="tf32", NORM=False, PRO_RESIDUAL=False, APPLY_G=False, HAS_BIAS=False,
                      SILU_MUL=kind == "silu", ADD=kind == "plain", ROTARY=kind == "rope", QK_NORM=False, HALF=64,
                      SPLITS_PER_HEAD=2, PAIRED=kind in ("silu", "rope"), USE_PDL=False, W_SCALED=True,
                      W_CONVERT=w_convert, NORM_CHUNK=gemv.norm_chunk(4096, cfg.num_warps, True),
                      W_VEC=gemv._row_vec(cfg, 2, True), W_SUM=gemv.row_sum(gemv._row_vec(cfg, 2, True), True),
                      PDL_TILES=1, PDL_GDC=False,
                      PDL_TRIGGER_FIRST=False)
    kernel = _compile(gemv._gemv_kernel, signature, constexprs, cfg.num_warps, cfg.num_stages)
    assert kernel.metadata.shared <= H200_SHARED_BYTES, (cfg, kernel.metadata.shared)
    if w_convert == 2:
        assert "cvt.rn.f16x2.e4m3x2" in kernel.asm["ptx"]


def test_fp8_gemv_word_conversions_compile_for_sm90() -> None:
    """ops/bench_fp8_gemv.py --converts's kernels: each conversion at the M = 1 CUDA-core config."""
    import importlib

    fp8_linear = importlib.import_module("stoker.engine.kernels.fp8_linear")  # the package exports a function of that name
    signature = {"x_ptr": "*bf16", "w_ptr": "*i32", "scale_ptr": "*fp32", "bias_ptr": "*fp32", "out_ptr": "*bf16"}
    signature.update({name: "i32" for name in ("M", "N", "K", "x_stride", "w_stride", "out_stride", "scale_stride")})
    cfg = fp8_linear.Fp8GemvConfig(1, 8, 1024, False, 4, 3)
    for convert in (1, 2, 3, 4):
        constexprs = dict(BLOCK_M=1, BLOCK_N=8, BLOCK_K=1024, USE_DOT=False, BLOCK_SCALES=False, SCALE_BN=1,
                          SCALE_BK=1, HAS_BIAS=False, DOT_PRECISION="tf32", CONVERT=convert,
                          ROW_VEC=fp8_linear.row_vec(cfg, 1024, 2, fp8_linear.CONVERTS[convert]))
        sig = {**signature, **{name: "constexpr" for name in constexprs}}
        kernel = _compile(fp8_linear._gemv_fp8_kernel, sig, constexprs, 4)
        assert kernel.metadata.shared <= H200_SHARED_BYTES


def test_fp8_gemv_one_token_loop_has_no_layout_conversion_on_sm90() -> None:
    """The W8A16 GEMV's one-token CUDA-core configs (FP8_GEMV_CONFIGS, M = 1) with the cast and row scales: the
    ROW_VEC loop, whose K loop must not go through shared memory (the [1, BN, BK] accumulator's did, every weight
    tile). Block scales narrow the K step to 128 (one element a thread) and load a scale vector per step: not
    checked."""
    import importlib

    fp8_linear = importlib.import_module("stoker.engine.kernels.fp8_linear")
    names = list(inspect.signature(fp8_linear._gemv_fp8_kernel.fn).parameters)
    signature = {"x_ptr": "*bf16", "w_ptr": "*fp8e4nv", "scale_ptr": "*fp32", "bias_ptr": "*fp32", "out_ptr": "*bf16"}
    signature.update({name: "i32" for name in ("M", "N", "K", "x_stride", "w_stride", "out_stride", "scale_stride")})
    aligned = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(names)
               if name.endswith("_ptr") or name in ("K", "x_stride", "w_stride", "out_stride")}
    for (shape_class, m), cfg in sorted(fp8_linear.FP8_GEMV_CONFIGS.items()):
        if m != 1 or cfg.use_dot:
            continue
        constexprs = dict(BLOCK_M=1, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, USE_DOT=False, BLOCK_SCALES=False,
                          SCALE_BN=1, SCALE_BK=1, HAS_BIAS=False, DOT_PRECISION="tf32", CONVERT=0,
                          ROW_VEC=fp8_linear.row_vec(cfg, cfg.block_k, 2, "cast"))
        assert constexprs["ROW_VEC"], shape_class
        sig = {name: {**signature, **dict.fromkeys(constexprs, "constexpr")}[name] for name in names}
        kernel = triton.compile(ASTSource(fp8_linear._gemv_fp8_kernel, sig, constexprs=constexprs, attrs=aligned),
                                target=H200, options={"num_warps": cfg.num_warps, "num_stages": cfg.num_stages})
        loops = [part.split("bra", 1)[0] for part in kernel.asm["ptx"].split("Loop Header")[1:]]
        assert loops and all("bar.sync" not in body for body in loops), (shape_class, cfg)


def _attention_signature(names: list[str], cache: str) -> tuple[dict[str, str], dict[tuple[int, ...], Any]]:
    """bf16 q/out, the cache's element type, int32 tables; pointers and the contiguous strides 16-aligned, as the
    JIT specializes them at a real launch (without that the loads compile scalar and nothing is pipelined)."""
    signature = {name: "*bf16" for name in names if name.endswith("_ptr")}
    signature.update({name: "*" + cache for name in ("k_cache_ptr", "v_cache_ptr")})
    signature.update({name: "*i32" for name in ("block_tables_ptr", "context_lens_ptr", "query_start_loc_ptr")
                      if name in names})
    signature.update({name: "*fp32" for name in names if name.startswith(("part_", "k_scale", "v_scale"))})
    for name in names:
        signature.setdefault(name, "fp32" if name == "qk_scale" else "constexpr" if name.isupper() else "i32")
    aligned = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(signature)
               if name.endswith("_ptr") or (name.endswith("_stride") and not name.startswith("block_table"))}
    return signature, aligned


@pytest.mark.parametrize("mode, tile_n, warps, stages", [("f16", 64, 4, 3), ("bits", 64, 4, 3), ("f16", 128, 8, 2),
                                                         ("cast", 64, 4, 3), ("f16-vwords", 64, 4, 3),
                                                         ("f16-vwords", 128, 8, 3), ("f16-vwords", 128, 4, 3)])
def test_fp8_decode_attention_variants_compile_for_sm90(mode: str, tile_n: int, warps: int, stages: int) -> None:
    """The FP8 cache's decode variants (kv_fp8_tiles.py) compile for sm_90 and fit shared memory; the fp16-dot
    modes carry none of the per-element fp16 -> bf16 conversions that made the 'cast' path issue-bound."""
    import inspect

    from stoker.engine.kernels import attention
    from stoker.engine.kernels.kv_fp8_tiles import FP8_MODES

    names = list(inspect.signature(attention._decode_split_kernel.fn).parameters)
    signature, aligned = _attention_signature(names, "fp8e4nv")
    constexprs = dict(NUM_KV_HEADS=8, GROUP=4, BLOCK_G=16, HEAD_DIM=128, BLOCK_D=128, BLOCK_SIZE=16, TILE_N=tile_n,
                      NUM_SPLITS=1, DOT_PRECISION="tf32", FP8_CACHE=True, FUSED_COMBINE=False, BLOCK_S=1,
                      BLOCK_GP=4, CHUNK_S=1, FP8_MODE=FP8_MODES[mode],
                      DOT_FP16=mode != "cast", FP8_PTX=mode == "f16-vwords")
    kernel = triton.compile(ASTSource(attention._decode_split_kernel, signature, constexprs=constexprs, attrs=aligned),
                            target=H200, options={"num_warps": warps, "num_stages": stages})
    ptx = kernel.asm["ptx"]
    assert kernel.metadata.shared <= H200_SHARED_BYTES
    assert "cp.async" in ptx  # the K/V loads are still pipelined
    assert ("cvt.bf16.f16" in ptx) == (mode == "cast"), mode
    # f16-vwords exists to read V from shared memory without byte loads (ptxas has checked its inline PTX)
    assert ("ld.shared.b8" in ptx) == (mode != "f16-vwords"), mode
    assert ("cvt.rn.f16x2.e4m3x2 p01, lo" in ptx) == (mode == "f16-vwords")  # its inline PTX, through ptxas


@pytest.mark.parametrize("fused_combine", [False, True])
def test_decode_attention_compiles_for_sm90(fused_combine: bool) -> None:
    """The split kernel with the fused combine (a gpu-scope acq_rel atomic, a barrier, .cg loads: none of which
    the interpreter checks) and the separate reduce kernel it replaces, at the 8B shape (8 kv heads, 32 splits)."""
    from stoker.engine.kernels import attention

    ints = ("q_seq_stride", "q_head_stride", "block_table_stride", "out_seq_stride", "out_head_stride")
    signature = {"q_ptr": "*bf16", "k_cache_ptr": "*bf16", "v_cache_ptr": "*bf16", "block_tables_ptr": "*i32",
                 "context_lens_ptr": "*i32", "out_ptr": "*bf16", "part_out_ptr": "*fp32", "part_max_ptr": "*fp32",
                 "part_sum_ptr": "*fp32", "k_scale_ptr": "*bf16", "v_scale_ptr": "*bf16", "counters_ptr": "*i32",
                 "qk_scale": "fp32", **{name: "i32" for name in ints}}
    constexprs = dict(NUM_KV_HEADS=8, GROUP=4, BLOCK_G=16, HEAD_DIM=128, BLOCK_D=128, BLOCK_SIZE=16, TILE_N=64,
                      NUM_SPLITS=32, DOT_PRECISION="tf32", FP8_CACHE=False, FUSED_COMBINE=fused_combine, BLOCK_S=32,
                      BLOCK_GP=4, CHUNK_S=16)
    signature.update({name: "constexpr" for name in constexprs})
    kernel = _compile(attention._decode_split_kernel, signature, constexprs, warps=4)
    assert kernel.metadata.shared <= H200_SHARED_BYTES
    ptx = kernel.asm["ptx"]
    assert ("atom.global.gpu.acq_rel.add" in ptx) == fused_combine, "the arrival counter must be a gpu-scope acq_rel atomic"


def _tuned_entries() -> list[Any]:
    from stoker.engine.kernels import gemv

    seen, entries = set(), []
    for (kind, n_out, hidden), cfg in sorted(gemv._TUNED_M1.items()):
        if (kind, cfg) not in seen:  # one compile per distinct (kind, config)
            seen.add((kind, cfg))
            entries.append(pytest.param(kind, n_out, hidden, id=f"{kind}-{n_out}x{hidden}"))
    return entries


@pytest.mark.parametrize("kind, n_out, hidden", _tuned_entries())
def test_tuned_m1_configs_fit_the_h200s_shared_memory_in_fp32(kind: str, n_out: int, hidden: int) -> None:
    """The M = 1 table's configs as float32 operands get them (the halved K slice): the largest tiles it asks."""
    from stoker.engine.kernels import gemv

    cfg = gemv.gemv_config(kind, 1, n_out, hidden, True, 4)
    base = kind.removesuffix("-norm")
    constexprs = dict(BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, USE_DOT=cfg.use_dot,
                      DOT_PRECISION="ieee", NORM=kind.endswith("-norm"), PRO_RESIDUAL=False, APPLY_G=False,
                      HAS_BIAS=False, SILU_MUL=base == "silu", ADD=base == "plain", ROTARY=base == "rope",
                      QK_NORM=False, HALF=64, SPLITS_PER_HEAD=8, PAIRED=base in ("silu", "rope"), USE_PDL=False,
                      NORM_CHUNK=gemv.norm_chunk(hidden, cfg.num_warps, True), W_SCALED=False, W_CONVERT=0,
                      W_VEC=0, W_SUM=False, PDL_TILES=1, PDL_GDC=False,
                      PDL_TRIGGER_FIRST=False)
    kernel = _compile(gemv._gemv_kernel, _gemv_signature("fp32"), constexprs, cfg.num_warps, cfg.num_stages)
    assert kernel.metadata.shared <= H200_SHARED_BYTES, (cfg, kernel.metadata.shared)


def _fp8_gemv_signature(w_convert: int) -> tuple[dict[str, str], dict[tuple[int, ...], Any]]:
    """The fused GEMV's bf16 signature with FP8 weights (float8 tiles for the cast, int32 words for the word
    conversions) in the kernel's own parameter order, and the 16-divisibility a real launch specialises on (attrs
    index that order)."""
    from stoker.engine.kernels import gemv

    names = list(inspect.signature(gemv._gemv_kernel.fn).parameters)
    signature = _gemv_signature("bf16")
    signature["w_ptr"] = "*fp8e4nv" if w_convert == 0 else "*i32"
    aligned = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(names)
               if name.endswith("_ptr") or name in ("K", "x_stride", "w_stride", "out_stride", "add_stride")}
    return {name: signature[name] for name in names}, aligned


def _fp8_m1_entries() -> list[Any]:
    """fused_decode's FP8 launch tables: one token per shape (FP8_FUSED_M1), 2-16 tokens per kernel (FP8_FUSED_DOT,
    compiled at the 8B K)."""
    from stoker.engine.models.fused_decode import FP8_FUSED_DOT, FP8_FUSED_M1

    return ([pytest.param(kernel, n, k, cfg, convert, id=f"{kernel}-{n}x{k}-{convert}")
             for (kernel, n, k), (cfg, convert) in sorted(FP8_FUSED_M1.items())]
            + [pytest.param(kernel, 0, 4096, cfg, convert, id=f"dot-{kernel}-{convert}")
               for kernel, (cfg, convert) in sorted(FP8_FUSED_DOT.items())])


@pytest.mark.parametrize("kernel, n, k, cfg, convert", _fp8_m1_entries())
def test_fp8_fused_m1_table_compiles_for_sm90(kernel: str, n: int, k: int, cfg: Any, convert: str) -> None:
    """fused_decode's FP8 launches as the engine makes them (the one-token CUDA-core loop's W_VEC where the config
    is one: its loop carries no shared-memory layout conversion, the reason it exists; except with runs of 16 codes,
    whose 16-byte weight loads sm_90 relays into x's layout, once per K step and measured faster: then exactly the
    weight tile's bytes go through shared memory, 16 a store). With the carried norms of the FP8 layers
    (fused_decode.NORM_CARRY): o_proj / down add each program's share of sum(s^2) into the int64 slots (one 64-bit
    integer atomic a token) and zero the other buffer; gate_up / qkv read the slots."""
    from stoker.engine.kernels import gemv
    from stoker.engine.kernels.fp8_convert import CONVERT_CODE

    w_convert = 0 if convert == "cast" else CONVERT_CODE[convert] - 2
    w_vec = gemv._row_vec(cfg, 2, True)
    signature, aligned = _fp8_gemv_signature(w_convert)
    constexprs = dict(BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, USE_DOT=cfg.use_dot,
                      DOT_PRECISION="tf32", NORM=kernel != "add", PRO_RESIDUAL=False, APPLY_G=False,
                      HAS_BIAS=False, SILU_MUL=kernel == "silu", ADD=kernel == "add", ROTARY=kernel == "rope",
                      QK_NORM=False, HALF=64, SPLITS_PER_HEAD=1, PAIRED=kernel != "add", USE_PDL=True, W_SCALED=True,
                      W_CONVERT=w_convert, NORM_CHUNK=gemv.norm_chunk(k, cfg.num_warps, True), W_VEC=w_vec,
                      W_SUM=gemv.row_sum(w_vec, True), PDL_TILES=cfg.pdl_tiles, PDL_GDC=True,
                      PDL_TRIGGER_FIRST=False,  # FP8 layers launch with PDL (EngineConfig.decode_pdl None)
                      NORM_SUMS=kernel != "add", CARRY=kernel == "add", ZERO_SUMS=kernel == "add",
                      NUM_SLOTS=gemv.NORM_SLOTS, SUMS_ROWS=gemv.GEMV_MAX_M, SUM_UNIT=gemv.NORM_SUM_UNIT, SLOT_STRIDE=gemv.NORM_SLOT_STRIDE,
                      SUMS_AT_END=gemv.NORM_SUMS_AT_END)
    kernel_bin = triton.compile(ASTSource(gemv._gemv_kernel, signature, constexprs=constexprs, attrs=aligned),
                                target=H200, options={"num_warps": cfg.num_warps, "num_stages": cfg.num_stages})
    assert kernel_bin.metadata.shared <= H200_SHARED_BYTES, (cfg, kernel_bin.metadata.shared)
    atomics = [line for line in kernel_bin.asm["ptx"].splitlines() if re.search(r"\b(atom|red)\.global", line)]
    if kernel == "add":
        assert atomics and all(".u64" in line or ".s64" in line for line in atomics), atomics
    else:
        assert not atomics, atomics
    if w_vec:  # the weight loop: the loop whose body converts E4M3 (the norm's rms pass has loops too)
        loops = [part.split("bra", 1)[0] for part in kernel_bin.asm["ptx"].split("Loop Header")[1:]]
        weight_loops = [body for body in loops if "e4m3x2" in body]
        assert weight_loops, "no loop converts the FP8 weights"
        if w_vec <= 8:
            assert all("bar.sync" not in body and "st.shared" not in body for body in weight_loops), \
                "a layout conversion through shared memory inside the K loop"
        else:
            streams = 1 if kernel == "add" else 2
            tile_bytes = streams * cfg.block_n * cfg.block_k // (32 * cfg.num_warps)  # a thread's codes a K step
            for body in weight_loops:
                stores = body.count("st.shared")
                assert stores == body.count("st.shared.v4.b32") and 16 * stores == tile_bytes, (stores, tile_bytes)


def test_fp8_first_layer_qkv_zeroing_the_carried_sums_compiles_for_sm90() -> None:
    """The first layer's qkv (the norm kernel before it, no carried sums in) zeroes the post-attention sums
    (fused_decode.NormCarry's clean start): its one-token FP8 launch compiles for sm_90 with that store."""
    from stoker.engine.kernels import gemv
    from stoker.engine.models.fused_decode import FP8_FUSED_M1

    cfg, convert = FP8_FUSED_M1[("rope", 6144, 4096)]
    w_convert = 0 if convert == "cast" else 2
    w_vec = gemv._row_vec(cfg, 2, True)
    signature, aligned = _fp8_gemv_signature(w_convert)
    constexprs = dict(BLOCK_M=1, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, USE_DOT=False, DOT_PRECISION="tf32",
                      NORM=False, PRO_RESIDUAL=False, APPLY_G=False, HAS_BIAS=False, SILU_MUL=False, ADD=False,
                      ROTARY=True, QK_NORM=False, HALF=64, SPLITS_PER_HEAD=64 // cfg.block_n, PAIRED=True,
                      USE_PDL=True, W_SCALED=True, W_CONVERT=w_convert, NORM_CHUNK=gemv.norm_chunk(4096, 4, True),
                      W_VEC=w_vec, W_SUM=gemv.row_sum(w_vec, True), PDL_TILES=cfg.pdl_tiles, PDL_GDC=True,
                      PDL_TRIGGER_FIRST=False, NORM_SUMS=False, CARRY=False, ZERO_SUMS=True,
                      NUM_SLOTS=gemv.NORM_SLOTS, SUMS_ROWS=gemv.GEMV_MAX_M, SUM_UNIT=gemv.NORM_SUM_UNIT,
                      SLOT_STRIDE=gemv.NORM_SLOT_STRIDE, SUMS_AT_END=gemv.NORM_SUMS_AT_END)
    kernel_bin = triton.compile(ASTSource(gemv._gemv_kernel, signature, constexprs=constexprs, attrs=aligned),
                                target=H200, options={"num_warps": cfg.num_warps, "num_stages": cfg.num_stages})
    ptx = kernel_bin.asm["ptx"]
    assert kernel_bin.metadata.shared <= H200_SHARED_BYTES
    assert re.search(r"st\.global(\.\w+)*\.b64", ptx), "no 64-bit store: the slots are not zeroed"
    assert not re.search(r"\b(atom|red)\.global", ptx)


@pytest.mark.parametrize("weights", ["bf16", "fp8"])
@pytest.mark.parametrize("fp8_cache", [False, True], ids=["model-dtype-cache", "fp8-cache"])
def test_qkv_cache_write_compiles_for_sm90(weights: str, fp8_cache: bool) -> None:
    """The qkv GEMV's cache write as the one-token 8B launches make it (bf16: the folded weights' tuned config,
    FP8: FP8_FUSED_M1's; a later layer's qkv, which reads the carried sums, under PDL). With FP8_CACHE it divides by
    the scale in IEEE float32 (div.rn) and converts with saturation, rounding to nearest even
    (cvt.rn.satfinite.e4m3x2); without it neither instruction is in the kernel: the constexpr leaves a cache in the
    model dtype to the store it had."""
    from stoker.engine.kernels import gemv
    from stoker.engine.models.fused_decode import FP8_FUSED_M1

    if weights == "fp8":
        cfg, convert = FP8_FUSED_M1[("rope", 6144, 4096)]
        w_convert = 0 if convert == "cast" else 2
    else:
        cfg, w_convert = gemv.gemv_config("rope-norm", 1, 3072, 4096, True, 2), 0
    w_vec = gemv._row_vec(cfg, 2, weights == "fp8")
    signature, aligned = _fp8_gemv_signature(w_convert)
    if weights == "bf16":
        signature["w_ptr"] = "*bf16"
    if fp8_cache:
        signature["k_cache_ptr"] = signature["v_cache_ptr"] = "*fp8e4nv"
    constexprs = dict(BLOCK_M=1, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, USE_DOT=False, DOT_PRECISION="tf32",
                      NORM=True, PRO_RESIDUAL=False, APPLY_G=False, HAS_BIAS=False, SILU_MUL=False, ADD=False,
                      ROTARY=True, QK_NORM=False, HALF=64, SPLITS_PER_HEAD=64 // cfg.block_n, PAIRED=True,
                      USE_PDL=True, W_SCALED=weights == "fp8", W_CONVERT=w_convert,
                      NORM_CHUNK=gemv.norm_chunk(4096, cfg.num_warps, True), W_VEC=w_vec,
                      W_SUM=gemv.row_sum(w_vec, weights == "fp8"), PDL_TILES=cfg.pdl_tiles, PDL_GDC=True,
                      PDL_TRIGGER_FIRST=False, NORM_SUMS=True, NUM_SLOTS=gemv.NORM_SLOTS, SUMS_ROWS=gemv.GEMV_MAX_M,
                      SUM_UNIT=gemv.NORM_SUM_UNIT, SLOT_STRIDE=gemv.NORM_SLOT_STRIDE, SUMS_AT_END=gemv.NORM_SUMS_AT_END,
                      FP8_CACHE=fp8_cache)
    kernel_bin = triton.compile(ASTSource(gemv._gemv_kernel, signature, constexprs=constexprs, attrs=aligned),
                                target=H200, options={"num_warps": cfg.num_warps, "num_stages": cfg.num_stages})
    ptx = kernel_bin.asm["ptx"]
    assert kernel_bin.metadata.shared <= H200_SHARED_BYTES
    assert ("cvt.rn.satfinite.e4m3x2.f32" in ptx) == fp8_cache
    assert ("div.rn.f32" in ptx) == fp8_cache


def _registers(kernel: Any) -> int:
    """Registers a thread of the compiled kernel (cuobjdump -res-usage on its cubin; the tool ships with triton)."""
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    if not tool.exists():
        pytest.skip(f"no {tool}")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        usage = subprocess.run([str(tool), "-res-usage", f.name], capture_output=True, text=True, check=True).stdout
    found = re.search(r"REG:(\d+)", usage)
    assert found, usage
    return int(found.group(1))


@pytest.mark.parametrize("w_convert", [0, 2], ids=["cast", "asm-join"])
def test_fp8_one_token_loop_sums_its_runs_in_registers_on_sm90(w_convert: int) -> None:
    """gemv.ROW_SUM_FP8 (W_SUM): the one-token FP8 loop sums each thread's run of W_VEC products every K step, so
    the 8B down config 1x8x1024 w4 holds 8 float32 sums a thread instead of 64: its registers drop from ~118 to
    ~70 (more blocks an SM, more weight loads in flight; 33.8 -> 28.5 us on gate_up in session 16's probe)."""
    from stoker.engine.kernels import gemv

    cfg = gemv.GemvConfig(1, 8, 1024, False, 4, 3)
    w_vec = gemv._row_vec(cfg, 2, True)
    assert w_vec == 8 and gemv.row_sum(w_vec, True) == gemv.ROW_SUM_FP8
    assert gemv.row_sum(w_vec, False) == gemv.ROW_SUM_BF16 and not gemv.row_sum(0, True)
    assert gemv._row_vec(gemv.GemvConfig(1, 4, 2048, False, 4, 3), 2, True) == (16 if gemv.ROW_SUM_FP8 else 8)
    signature, aligned = _fp8_gemv_signature(w_convert)
    registers = {}
    for w_sum in (False, True):
        constexprs = dict(BLOCK_M=1, BLOCK_N=8, BLOCK_K=1024, USE_DOT=False, DOT_PRECISION="tf32", NORM=False,
                          PRO_RESIDUAL=False, APPLY_G=False, HAS_BIAS=False, SILU_MUL=False, ADD=True, ROTARY=False,
                          QK_NORM=False, HALF=64, SPLITS_PER_HEAD=1, PAIRED=False, USE_PDL=False, W_SCALED=True,
                          W_CONVERT=w_convert, NORM_CHUNK=gemv.norm_chunk(14336, 4, True), W_VEC=w_vec, W_SUM=w_sum,
                          PDL_TILES=1, PDL_GDC=False,
                      PDL_TRIGGER_FIRST=False)
        kernel = triton.compile(ASTSource(gemv._gemv_kernel, signature, constexprs=constexprs, attrs=aligned),
                                target=H200, options={"num_warps": 4, "num_stages": 3})
        registers[w_sum] = _registers(kernel)
    assert registers[True] <= 80 and registers[False] - registers[True] >= 32, registers


def pending_qkv_constexprs(cfg: Any, pending: bool, pdl: bool) -> dict[str, Any]:
    """The bf16 / fp32 qkv GEMV's constexprs at the 8B shape as fused_decode launches it in a layer after the first
    with the folded carried norms: pending (MLP_FINISH_IN_QKV), on the previous MLP's float32 accumulator (X_ACC, the
    residual add and the rms in the K loop, the stream stored, the MLP's slots zeroed); else on the carried sums."""
    from stoker.engine.kernels import gemv

    w_vec = gemv._row_vec(cfg, 2, False)
    return dict(BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, USE_DOT=cfg.use_dot,
                DOT_PRECISION="tf32", NORM=True, PRO_RESIDUAL=pending, APPLY_G=False, HAS_BIAS=False,
                SILU_MUL=False, ADD=False, ROTARY=True, QK_NORM=False, HALF=64, SPLITS_PER_HEAD=64 // cfg.block_n,
                PAIRED=True, USE_PDL=pdl, NORM_CHUNK=gemv.norm_chunk(4096, cfg.num_warps, True), W_SCALED=False,
                W_CONVERT=0, W_VEC=w_vec, W_SUM=gemv.row_sum(w_vec, False), PDL_TILES=cfg.pdl_tiles, PDL_GDC=pdl,
                PDL_TRIGGER_FIRST=False, NORM_SUMS=not pending, ZERO_SUMS=pending, NUM_SLOTS=gemv.NORM_SLOTS,
                SUMS_ROWS=gemv.GEMV_MAX_M, SUM_UNIT=gemv.NORM_SUM_UNIT, SLOT_STRIDE=gemv.NORM_SLOT_STRIDE,
                SUMS_AT_END=gemv.NORM_SUMS_AT_END, X_ACC=pending)


@pytest.mark.parametrize("dtype, elem_bytes", [("bf16", 2), ("fp32", 4)])
@pytest.mark.parametrize("rows", [1, 5])
def test_qkv_on_a_pending_mlp_compiles_for_sm90(dtype: str, elem_bytes: int, rows: int) -> None:
    """fused_decode.MLP_FINISH_IN_QKV's qkv (x the float32 accumulator, the residual and the stream in the model
    dtype) at the configs gemv_config gives the 8B folded qkv, one token (the CUDA cores, PDL) and 2-16 (the tl.dot
    tile), compiles for sm_90 and fits a block's shared memory. (Triton 3.6, bytes a block: one token 128 either
    way; the bf16 dot tile 57,344 against the carried form's 8,192, the float32 x and the residual pipelined beside
    the weights, so fewer blocks an SM at 2-16 tokens: one reason MLP_FINISH_IN_QKV_MAX_M exists; fp32 155,904
    against 122,880.)"""
    from stoker.engine.kernels import gemv

    cfg = gemv.gemv_config("rope-norm", rows, 3072, 4096, True, elem_bytes)
    signature = _gemv_signature(dtype)
    signature["x_ptr"] = "*fp32"
    shared = {}
    for pending in (False, True):
        constexprs = pending_qkv_constexprs(cfg, pending, pdl=rows == 1)
        constexprs["DOT_PRECISION"] = "ieee" if dtype == "fp32" else "tf32"
        kernel = _compile(gemv._gemv_kernel, signature if pending else _gemv_signature(dtype), constexprs,
                          cfg.num_warps, cfg.num_stages)
        shared[pending] = kernel.metadata.shared
    assert shared[True] <= H200_SHARED_BYTES, (cfg, shared)


@pytest.mark.parametrize("dtype, elem_bytes", [("bf16", 2), ("fp32", 4)])
@pytest.mark.parametrize("pending", [False, True])
def test_qkv_with_the_per_head_norm_fits_at_2_to_16_tokens(dtype: str, elem_bytes: int, pending: bool) -> None:
    """Qwen3's per-head q / k norm widens a program to the whole head (gemv.rope_launch_config): head_dim 80 on
    the 2-16-token tensor-core tile, with the residual add in the loop (and on a pending MLP's accumulator). In
    float32 that asked 254,208 bytes of shared memory on the H200 (session 24's GPU tests) until the K slice
    shrank with the widening; bf16 keeps its shape."""
    from stoker.engine.kernels import gemv

    base = gemv.gemv_config("rope-norm", 7, 3 * 80, 4096, True, elem_bytes)
    cfg = gemv.rope_launch_config(base, 40, True, elem_bytes)
    assert cfg.block_n == 64 and cfg.use_dot
    assert cfg.block_k == (base.block_k // 2 if elem_bytes == 4 else base.block_k)
    signature = _gemv_signature(dtype)
    if pending:
        signature["x_ptr"] = "*fp32"
    constexprs = pending_qkv_constexprs(cfg, pending, pdl=False)
    constexprs.update(DOT_PRECISION="ieee" if dtype == "fp32" else "tf32", QK_NORM=True, HALF=40, SPLITS_PER_HEAD=1,
                      PRO_RESIDUAL=True, NORM_SUMS=False, HAS_BIAS=True)
    kernel = _compile(gemv._gemv_kernel, signature, constexprs, cfg.num_warps, cfg.num_stages)
    assert kernel.metadata.shared <= H200_SHARED_BYTES, (cfg, kernel.metadata.shared)
