"""Guarded Triton import shared by the kernel files.

The CPU path (references) must work even where triton is missing or fails to import (no compiler, wrong
CUDA), so the op files import `triton`/`tl` from here. Without triton, `triton.jit` is the identity and
`tl.<anything>` is None, so the kernel definitions still parse; `HAS_TRITON` tells the dispatcher not to
launch them.
"""
from __future__ import annotations

import os
from typing import Any

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except Exception:  # ImportError, or a broken install raising at import: fall back to the references
    HAS_TRITON = False

    class _Missing:
        def __getattr__(self, name: str) -> Any:
            return None

    class _NoTriton(_Missing):
        @staticmethod
        def jit(fn: Any = None, **_: Any) -> Any:
            return fn if fn is not None else (lambda f: f)

    triton = _NoTriton()
    tl = _Missing()


def interpreting() -> bool:
    """True under TRITON_INTERPRET=1: kernels then run on CPU tensors (the tests use this)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def patch_interpreter_for_numpy() -> None:
    """The one-line fix triton 3.6's interpreter needs with numpy >= 2.4: it does int(array_of_shape_1) for runtime
    loop bounds, which numpy >= 2.4 rejects (triton-lang/triton#9171, fixed upstream by #9172 after 3.6). Applied at
    import under TRITON_INTERPRET=1, so every process that runs the kernels interpreted has it (the test process, and
    the tensor-parallel ranks it spawns); a no-op with an older numpy or once applied."""
    import numpy as np
    from triton.runtime import interpreter

    if tuple(int(p) for p in np.__version__.split(".")[:2]) < (2, 4) or getattr(interpreter, "_stoker_patched", False):
        return
    original = interpreter._patch_lang_tensor

    def patch_lang_tensor(tensor: Any, scope: Any) -> None:
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))

    interpreter._patch_lang_tensor = patch_lang_tensor
    interpreter._stoker_patched = True


if HAS_TRITON and interpreting():
    patch_interpreter_for_numpy()


def check_launchable(*tensors: Any) -> None:
    """Raise a clear error instead of a Triton crash when a kernel cannot run on these tensors."""
    if not HAS_TRITON:
        raise RuntimeError("triton is not importable here; use the *_ref functions (or EngineConfig(use_triton=False))")
    on_cpu = [t for t in tensors if not t.is_cuda]
    if on_cpu and not interpreting():
        raise ValueError("Triton kernels need CUDA tensors (or TRITON_INTERPRET=1 for CPU tests)")
    devices = {t.device for t in tensors}
    if len(devices) > 1:
        raise ValueError(f"all kernel inputs must be on one device, got {sorted(map(str, devices))}")
