"""The kernel files' interpreter runs: each kernel test file is run again in a child pytest under
TRITON_INTERPRET=1 (its test `test_*_under_triton_interpreter`, through kernel_harness.run_under_interpreter).

The interpreter is single-threaded and CPU-bound, and these runs are the suite's largest block of time (about 440 s
of a CI run on 2 cores, one after the other). conftest.py starts every selected file's run at the end of
collection, as many at once as the machine has cores (STOKER_INTERPRETER_JOBS overrides), longest first, and
waits for them all before the first test: they share the machine with each other only, never with the timed
stack tests. The tests then read their file's result. A file whose run was not started here runs when its test
asks. No torch import: conftest loads this for every suite."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

TIMEOUT_S = 280  # one file's run; started together, each still gets its own full budget
_done: dict[str, subprocess.CompletedProcess[str] | BaseException] = {}
# The longest runs first (80 s down to 17 s each in a CI run one after the other on the 2-core development VM,
# 2026-12-02); files not named here (under 15 s) start after them.
_ORDER = ["test_fused_decode", "test_kernels_fp8_kv", "test_kernels", "test_kernels_gemv",
          "test_kernels_decode_combine", "test_kernels_fp8", "test_kernels_gemv_fp8", "test_kernels_decode_pdl",
          "test_kernels_decode_persistent"]


def _key(test_file: str) -> str:
    return str(Path(test_file).resolve())


def run(test_file: str) -> subprocess.CompletedProcess[str]:
    """One file under the interpreter, in a child pytest (no GPU visible)."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""}
    return subprocess.run(
        [sys.executable, "-m", "pytest", test_file, "-x", "-q", "-p", "no:cacheprovider", "-p", "no:randomly"],
        env=env, capture_output=True, text=True, timeout=TIMEOUT_S,
    )


def result(test_file: str) -> subprocess.CompletedProcess[str]:
    """The file's run: the one started before the tests, else run now. A run that raised (its timeout, say)
    raises here, in its own test."""
    done = _done.pop(_key(test_file), None)
    if done is None:
        return run(test_file)
    if isinstance(done, BaseException):
        raise done
    return done


def run_all(test_files: list[str], jobs: int | None = None) -> float:
    """Run these files' interpreter runs `jobs` at a time (default: the CPU count), longest first; keep each
    result (or the exception it raised) for result(). Returns the wall seconds."""
    if jobs is None:
        jobs = int(os.environ.get("STOKER_INTERPRETER_JOBS") or os.cpu_count() or 1)
    rank = {name: i for i, name in enumerate(_ORDER)}
    files = sorted({_key(f) for f in test_files}, key=lambda f: rank.get(Path(f).stem, len(rank)))
    start = time.monotonic()
    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        futures: list[tuple[str, Future[subprocess.CompletedProcess[str]]]] = [(f, pool.submit(run, f)) for f in files]
        for f, future in futures:
            try:
                _done[f] = future.result()
            except BaseException as e:  # noqa: BLE001 - kept for the file's own test to raise
                _done[f] = e
    return time.monotonic() - start
