"""Every entry of gemv.py's M = 1 table (the launch shapes ops/bench_gemv.py --sweep-fused measured fastest)
computes its kind right at the very shape it is listed for: the tests of test_kernels_gemv.py run other
configs at small shapes, and a table entry reaches the engine only at a real model's shape. GPU only (bf16,
the dtype the table was measured in); the CPU case checks that the table is what gemv_config hands out.
"""
from __future__ import annotations

from typing import Any

import pytest
import torch

triton = pytest.importorskip("triton")
from kernel_harness import GPU, NO_CUDA, TOLERANCE  # noqa: E402
from stoker.engine.kernels import gemv, rope_cos_sin  # noqa: E402
from stoker.engine.kernels.gemv import (  # noqa: E402
    gemv_config,
    gemv_ref,
    gemv_rotary_cache_ref,
    gemv_rotary_cache_triton,
    gemv_triton,
)

TUNED = sorted(gemv._TUNED_M1.items())
HEADS = {3072: (32, 8, 128), 1536: (32, 8, 64)}  # rope's n_out (half the qkv rows) -> Hq, Hkv, head_dim


def test_gemv_config_hands_out_the_table_at_m1() -> None:
    assert TUNED, "the M = 1 table is empty"
    for (kind, n_out, hidden), cfg in TUNED:
        assert gemv_config(kind, 1, n_out, hidden, True) == cfg


def _close_to_truth(out: torch.Tensor, ref: torch.Tensor, truth: torch.Tensor) -> None:
    ref_err = (ref.double() - truth).abs().max().item()
    tol = TOLERANCE[torch.bfloat16]
    torch.testing.assert_close(out.double(), truth, atol=tol + 2 * ref_err, rtol=tol)


@GPU
@NO_CUDA
@pytest.mark.parametrize("key", [key for key, _ in TUNED], ids=lambda k: f"{k[0]}-{k[1]}x{k[2]}")
def test_tuned_m1_config_matches_the_reference_at_its_shape(key: tuple[str, int, int]) -> None:
    kind, n_out, hidden = key
    dtype, dev = torch.bfloat16, "cuda"
    folded = kind.endswith("-norm")
    x = (torch.randn(1, hidden, device=dev) * 3).to(dtype)  # rms ~3: a missing prologue norm shows
    if kind.startswith("rope"):
        _check_rope(x, n_out, folded)
        return
    silu = kind.startswith("silu")
    weight = (torch.randn(2 * n_out if silu else n_out, hidden, device=dev) * hidden**-0.5).to(dtype)
    kwargs: dict[str, Any] = {"silu_mul": silu, "norm_folded": folded, "eps": 1e-5}
    if not silu and not folded:  # o_proj / down: the residual-add epilogue
        kwargs["add"] = torch.randn(1, n_out, device=dev).to(dtype)
    out, _ = gemv_triton(x, weight, **kwargs)
    ref, _ = gemv_ref(x, weight, **kwargs)
    wide = {k: v.double() if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
    truth, _ = gemv_ref(x.double(), weight.double(), **wide)
    _close_to_truth(out, ref, truth)


def _check_rope(x: torch.Tensor, n_out: int, folded: bool) -> None:
    hq, hkv, head_dim = HEADS[n_out]
    dtype, dev, hidden = x.dtype, x.device, x.shape[1]
    weight = (torch.randn(2 * n_out, hidden, device=dev) * hidden**-0.5).to(dtype)
    k_cache = torch.randn(4, 16, hkv, head_dim, device=dev).to(dtype)
    v_cache = torch.randn_like(k_cache)
    common: dict[str, Any] = {
        "num_heads": hq, "num_kv_heads": hkv, "positions": torch.tensor([300], device=dev),
        "cos_sin": rope_cos_sin(head_dim, 512, 500000.0, None, device=dev),
        "slot_mapping": torch.tensor([37], device=dev), "norm_folded": folded, "eps": 1e-5,
    }
    ref_k, ref_v, true_k, true_v = k_cache.clone(), v_cache.clone(), k_cache.double(), v_cache.double()
    out, _ = gemv_rotary_cache_triton(x, weight, None, k_cache=k_cache, v_cache=v_cache, **common)
    ref, _ = gemv_rotary_cache_ref(x, weight, None, k_cache=ref_k, v_cache=ref_v, **common)
    truth, _ = gemv_rotary_cache_ref(x.double(), weight.double(), None, k_cache=true_k, v_cache=true_v, **common)
    _close_to_truth(out, ref, truth)
    _close_to_truth(k_cache, ref_k, true_k)
    _close_to_truth(v_cache, ref_v, true_v)
