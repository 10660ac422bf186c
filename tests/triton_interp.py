"""The Triton interpreter as the kernel tests run it: `INTERPRET` (TRITON_INTERPRET=1, the CPU runs) and, under
it, the one-line fix triton 3.6's interpreter needs with numpy >= 2.4 (it does int(array_of_shape_1) for runtime
loop bounds, which numpy >= 2.4 rejects: triton-lang/triton#9171, fixed upstream by #9172 after 3.6).
Import this before the kernels (after `pytest.importorskip("triton")`)."""

from __future__ import annotations

import os
from typing import Any

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


def _patch_numpy_index() -> None:
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


if INTERPRET:
    _patch_numpy_index()
