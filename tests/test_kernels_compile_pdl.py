"""The PDL forms of the fused decode kernels, compiled for the H200 (sm_90) on a machine without a GPU: where
griddepcontrol.wait and griddepcontrol.launch_dependents sit in the PTX relative to the loads (the interpreter
runs no PTX, and on the GPU a misplaced wait shows only as a race or as lost overlap)."""

from __future__ import annotations

import inspect
import os
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


def _last_loop_end(lines: list[str]) -> int:
    """The line of the last loop's back branch (a bra to the label of the last loop header)."""
    label = lines[_loop_headers(lines)[-1]].split(":")[0].strip()
    return max(i for i, line in enumerate(lines) if "bra" in line and line.rstrip().endswith(label + ";"))


def _gemv_ptx(kind: str, peel: bool, late: bool, l2_bytes: int, eighths: int = 0, next_block: int = 1,
              next_bytes: int = 0, pdl: bool = True) -> list[str]:
    from stoker.engine.kernels import gemv

    n_out = {"rope": 3072, "silu": 14336, "plain": 4096}[kind]
    cfg = gemv.gemv_config(kind + ("-norm" if kind != "plain" else ""), 1, n_out, 4096, True)
    signature = _gemv_signature("bf16")
    constexprs = dict(BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, USE_DOT=cfg.use_dot,
                      DOT_PRECISION="tf32", NORM=kind != "plain", PRO_RESIDUAL=False, APPLY_G=False,
                      HAS_BIAS=False, SILU_MUL=kind == "silu", ADD=kind == "plain", ROTARY=kind == "rope",
                      QK_NORM=False, HALF=64, SPLITS_PER_HEAD=64 // cfg.block_n if kind == "rope" else 1,
                      PAIRED=kind != "plain", USE_PDL=pdl, NORM_CHUNK=gemv.norm_chunk(4096, cfg.num_warps, True),
                      W_SCALED=False, W_CONVERT=0, W_VEC=0, W_PREFETCH=False, PDL_PEEL=peel, PDL_LATE=late,
                      PDL_L2_BYTES=l2_bytes, PDL_TRIGGER_EIGHTHS=eighths)
    signature.update(dict.fromkeys(("PDL_PEEL", "PDL_LATE", "PDL_L2_BYTES", "PDL_TRIGGER_EIGHTHS", "NEXT_BLOCK",
                                    "NEXT_L2_BYTES"), "constexpr"))
    signature.update(next_w_ptr="*u8", next_rows="i32", next_stride="i32")
    constexprs.update(NEXT_BLOCK=next_block, NEXT_L2_BYTES=next_bytes)
    names = list(inspect.signature(gemv._gemv_kernel.fn).parameters)
    signature = {name: signature[name] for name in names}
    aligned = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(names)
               if name.endswith("_ptr") or name in ("K", "x_stride", "w_stride", "out_stride", "add_stride")}
    return _ptx(gemv._gemv_kernel, signature, constexprs, cfg.num_warps, cfg.num_stages, aligned)


@pytest.mark.parametrize("kind", ["rope", "silu", "plain"])
def test_gemv_pdl_without_peel_loads_nothing_before_the_wait(kind: str) -> None:
    """PDL_PEEL off: no load precedes griddepcontrol.wait (x and the residual are the previous kernel's), and the
    next kernel may launch right after it; with PDL_PEEL the first weight tile is loaded before it."""
    lines = _gemv_ptx(kind, peel=False, late=False, l2_bytes=0)
    wait = _index(lines, "griddepcontrol.wait")
    trigger = _index(lines, "griddepcontrol.launch_dependents")
    assert _loads(lines[:wait]) == 0
    assert wait < trigger < _loop_headers(lines)[0] and _loads(lines[wait:trigger]) == 0
    peeled = _gemv_ptx(kind, peel=True, late=False, l2_bytes=0)
    assert _loads(peeled[: _index(peeled, "griddepcontrol.wait")]) > 0


@pytest.mark.parametrize("kind", ["rope", "silu", "plain"])
def test_gemv_pdl_l2_prefetch_precedes_the_wait_and_late_trigger_follows_the_loop(kind: str) -> None:
    """PDL_L2_BYTES: the bulk L2 prefetches (one row per request) are issued before the wait, no load is. PDL_LATE:
    launch_dependents comes after the weight loop's back branch, before the epilogue's stores."""
    lines = _gemv_ptx(kind, peel=False, late=False, l2_bytes=4096)
    wait = _index(lines, "griddepcontrol.wait")
    prefetches = [i for i, line in enumerate(lines) if "cp.async.bulk.prefetch.L2" in line]
    assert prefetches and max(prefetches) < wait and _loads(lines[:wait]) == 0
    late = _gemv_ptx(kind, peel=False, late=True, l2_bytes=0)
    trigger = _index(late, "griddepcontrol.launch_dependents")
    stores = [i for i, line in enumerate(late) if "st.global" in line]
    assert _index(late, "griddepcontrol.wait") < _last_loop_end(late) < trigger < min(stores)


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


@pytest.mark.parametrize("kind", ["silu", "plain"])
def test_gemv_pdl_trigger_eighths_splits_the_weight_loop(kind: str) -> None:
    """PDL_TRIGGER_EIGHTHS: launch_dependents between two weight loops (the first e/8 of K, then the rest), after
    the wait; no trigger right after the wait."""
    lines = _gemv_ptx(kind, peel=False, late=False, l2_bytes=0, eighths=6)
    wait, trigger = _index(lines, "griddepcontrol.wait"), _index(lines, "griddepcontrol.launch_dependents")
    headers = [i for i in _loop_headers(lines) if i > wait]
    assert len(headers) >= 2 and headers[-2] < trigger < headers[-1], (headers, trigger)


@pytest.mark.parametrize("kind", ["rope", "plain"])
def test_gemv_next_weight_prefetch_follows_the_stores(kind: str) -> None:
    """NEXT_L2_BYTES (no PDL): the bulk L2 prefetches of the next projection's rows come after the program's last
    store, and there is no griddepcontrol."""
    lines = _gemv_ptx(kind, peel=False, late=False, l2_bytes=0, next_block=16, next_bytes=4096, pdl=False)
    prefetches = [i for i, line in enumerate(lines) if "cp.async.bulk.prefetch.L2" in line]
    stores = [i for i, line in enumerate(lines) if "st.global" in line]
    assert prefetches and stores and min(prefetches) > max(stores)
    assert not any("griddepcontrol" in line for line in lines)
