"""Compile kernels for the H200 (sm_90) on a machine without a GPU: Triton's own compiler and ptxas, no launch.

Why: the CPU tests run the kernels under TRITON_INTERPRET=1, which accepts what the GPU compiler refuses. On
the H200 (2026-12-01) two such bugs cost a GPU call: the FP8 quantization kernel read plain float module
globals (the interpreter reads any global; the compiler only constexpr ones: 42 GPU tests failed), and a
float32 GEMV config asked 240 KB of shared memory (the H200 has 227 KB a block). Both show here, at compile.
"""

from __future__ import annotations

import os
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


_GEMV_POINTERS = ("x_ptr", "w_ptr", "out_ptr", "bias_ptr", "norm_ptr", "hres_ptr", "res_out_ptr", "add_ptr",
                  "positions_ptr", "cos_sin_ptr", "k_cache_ptr", "v_cache_ptr", "slot_ptr", "q_norm_ptr",
                  "k_norm_ptr")
_GEMV_INTS = ("M", "N_OUT", "K", "x_stride", "w_stride", "out_stride", "hres_stride", "res_out_stride",
              "add_stride", "NUM_Q_HEADS", "NUM_KV_HEADS")


def _gemv_signature(dtype: str) -> dict[str, str]:
    signature = {name: f"*{dtype}" for name in _GEMV_POINTERS}
    signature.update(positions_ptr="*i64", slot_ptr="*i64", cos_sin_ptr="*fp32", eps="fp32")
    signature.update({name: "i32" for name in _GEMV_INTS})
    for name in ("BLOCK_M", "BLOCK_N", "BLOCK_K", "USE_DOT", "DOT_PRECISION", "NORM", "PRO_RESIDUAL", "APPLY_G",
                 "HAS_BIAS", "SILU_MUL", "ADD", "ROTARY", "QK_NORM", "HALF", "SPLITS_PER_HEAD", "PAIRED", "USE_PDL",
                 "NORM_CHUNK"):
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
                      NORM_CHUNK=gemv.norm_chunk(4096, cfg.num_warps, True))
    kernel = _compile(gemv._gemv_kernel, _gemv_signature(dtype), constexprs, cfg.num_warps, cfg.num_stages)
    assert kernel.metadata.shared <= H200_SHARED_BYTES, (cfg, kernel.metadata.shared)


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
                      NORM_CHUNK=gemv.norm_chunk(hidden, cfg.num_warps, True))
    kernel = _compile(gemv._gemv_kernel, _gemv_signature("fp32"), constexprs, cfg.num_warps, cfg.num_stages)
    assert kernel.metadata.shared <= H200_SHARED_BYTES, (cfg, kernel.metadata.shared)
