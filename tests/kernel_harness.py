"""What the kernel test files share: `INTERPRET` (TRITON_INTERPRET=1, the CPU runs) with, under it, the fix triton
3.6's interpreter needs with numpy >= 2.4 (engine/kernels/_triton.patch_interpreter_for_numpy); the dtype cases each file runs
(fp32/fp16 in the interpreter, the GPU dtypes on CUDA), their tolerances, and the driver that re-runs a file
under the interpreter. Import this after `pytest.importorskip("triton")`."""

from __future__ import annotations

import os
from typing import Any

import interpreter_runs
import pytest
import torch
from stoker.engine.kernels._triton import patch_interpreter_for_numpy

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


if INTERPRET:  # engine/kernels/_triton.py applies it at import too; here for files that import no kernel first
    patch_interpreter_for_numpy()


def exact_fp8_casts(monkeypatch: pytest.MonkeyPatch) -> None:
    """For the rest of a test, the interpreter's float32 -> float8_e4m3fn casts as the GPU's cvt.rn.satfinite makes
    them: to nearest even, saturated at +-448 (torch's cast on the clamped value). Triton 3.6's
    interpreter._convert_float rounds halves away from zero and drops the carry when a mantissa rounds up past a power
    of two (7.92 is stored as 4: test_kernels_fp8_kv.py's docstring), so a kernel writing an FP8 cache there stores
    other values than torch's cast on the reference path. For tests of what surrounds such a kernel (an engine's FP8 cache); the
    kernels' own tests keep the interpreter's cast and give it values that need no rounding."""
    import numpy as np
    from triton.runtime import interpreter

    original = interpreter._convert_float

    def convert(data: Any, input_dtype: Any, output_dtype: Any, rounding_mode: Any) -> Any:
        if input_dtype.is_fp32() and output_dtype.is_fp8e4nv():
            values = torch.from_numpy(np.ascontiguousarray(data, dtype=np.float32)).clamp(-448.0, 448.0)
            return values.to(torch.float8_e4m3fn).view(torch.uint8).numpy()
        return original(data, input_dtype, output_dtype, rounding_mode)

    monkeypatch.setattr(interpreter, "_convert_float", convert)


def e4m3_steps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """How many e4m3 numbers apart two float8_e4m3fn tensors are, element by element (the codes in sign-magnitude
    order: 0x00-0x7e count up from +0 to 448, the sign bit mirrors them)."""
    def ordered(t: torch.Tensor) -> torch.Tensor:
        code = t.view(torch.uint8).to(torch.int32)
        return torch.where(code >= 128, 128 - code, code)

    return (ordered(a) - ordered(b)).abs()


GPU = pytest.mark.gpu
NO_CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
TOLERANCE = {torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}  # atol = rtol, per dtype
_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


def close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    """A kernel's output against its plain-torch reference, within the dtype's TOLERANCE (compared in float32)."""
    torch.testing.assert_close(actual.float(), expected.float(), atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


def cases(gpu_dtypes: tuple[torch.dtype, ...] = (torch.bfloat16, torch.float16, torch.float32)) -> list[Any]:
    """(device, dtype) parameters: fp32 and fp16 on the CPU under the interpreter, else gpu_dtypes on CUDA."""
    if INTERPRET:
        return [pytest.param("cpu", torch.float32, id="cpu-fp32"), pytest.param("cpu", torch.float16, id="cpu-fp16")]
    return [pytest.param("cuda", dt, id=f"cuda-{_NAMES[dt]}", marks=[GPU, NO_CUDA]) for dt in gpu_dtypes]


def run_under_interpreter(test_file: str) -> None:
    """Re-run a kernel test file on the CPU under TRITON_INTERPRET=1 and require that all of it passed (the run
    conftest.py started before the tests, when it did: tests/interpreter_runs.py)."""
    run = interpreter_runs.result(test_file)
    assert run.returncode == 0, f"interpreter run failed:\n{run.stdout[-8000:]}\n{run.stderr[-4000:]}"
    assert " passed" in run.stdout and "failed" not in run.stdout, run.stdout[-2000:]
