"""Names this process's threads for the operating system, so `top -H`, `ps -L` and /proc/<pid>/task/*/comm tell
the engine's thread from the event loop and the grammar threads (Python before 3.14 leaves every thread it starts
with the process's name). Linux only; elsewhere, or where prctl is refused, nothing happens."""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import sys

_PR_SET_NAME = 15
_COMM_BYTES = 15  # the kernel keeps 15 bytes of a thread's name (16 with the terminating zero)
_libc: ctypes.CDLL | None = None


def name_os_thread(name: str) -> None:
    """Give the calling thread `name` (cut to 15 bytes of UTF-8) as its name in the kernel."""
    global _libc
    if not sys.platform.startswith("linux"):
        return
    with contextlib.suppress(OSError, AttributeError):
        if _libc is None:
            _libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        _libc.prctl(_PR_SET_NAME, ctypes.c_char_p(name.encode()[:_COMM_BYTES]), 0, 0, 0)
