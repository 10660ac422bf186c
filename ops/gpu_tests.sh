#!/bin/bash
# The GPU tests on a device machine in one call: `pytest -m gpu` over several pytest-xdist workers (the GPU image
# has pytest-xdist), each test file on one worker (--dist loadfile: a file's Triton compiles stay in one process).
# Session 8 ran the same tests as 8 hand-made shards at once on 16 cores and under `-n 4` (BENCHMARKS.md,
# 2026-12-02): seven shards took 49-129 s each, the one holding test_kernels.py more than 170 s. E.g.:
#
#   run(command="bash ops/gpu_tests.sh", carry=[".gpu-stack"], timeout_s=400)
#   run(command="bash ops/gpu_tests.sh tests/test_capture_collector.py tests/test_gpu_engine.py", ...)
#
# Arguments go to pytest in place of `tests` (GPU_TEST_SHARD=K/N, without arguments: every Nth file from the K-th).
# GPU_TEST_WORKERS sets the workers (default 12: the whole suite, 1,258 tests, took 318 s on 16 cores in session 23;
# 8 workers no longer fit 280 s). The collection
# imports the worker's modules, so the packed stack's wheels come first (ops/gpu_stack_env). Writes
# $OUT/gpu_tests.log (a line per failure, error and skip reason at its end).
export PYTHONUNBUFFERED=1 PYTEST_ADDOPTS="-p no:warnings"
OUT=${OUT:-/tmp}
# shellcheck source=/dev/null
source ops/gpu_stack_env > "$OUT/gpu_stack_env.log" 2>&1 || { cat "$OUT/gpu_stack_env.log"; exit 1; }
if [ $# -eq 0 ] && [ -n "${GPU_TEST_SHARD:-}" ]; then
    # GPU_TEST_SHARD=K/N: every Nth test file from the K-th (sorted names), for a suite that no longer fits one
    # call: session 26's whole suite (14 workers, a fresh machine's cold Triton cache) was cut at ~99 % by 560 s.
    k=${GPU_TEST_SHARD%/*} n=${GPU_TEST_SHARD#*/}
    mapfile -t files < <(ls tests/test_*.py | sort | awk -v k="$k" -v n="$n" '(NR - k) % n == 0')
    set -- "${files[@]}"
fi
[ $# -eq 0 ] && set -- tests
# --durations: the slowest tests at the log's end, to balance the shards by. pytest runs in its own process group,
# killed whole when this script is (a call's `timeout`): session 26's cut run left its xdist workers on the GPU,
# under the next call on that warm machine.
setsid python3 -m pytest -q -rfEs -p no:cacheprovider -m gpu -n "${GPU_TEST_WORKERS:-12}" --dist loadfile \
  --durations=25 "$@" > "$OUT/gpu_tests.log" 2>&1 &
pytest_pid=$!
trap 'kill -TERM -- -$pytest_pid 2>/dev/null; sleep 2; kill -KILL -- -$pytest_pid 2>/dev/null' TERM INT
wait $pytest_pid
rc=$?
tail -70 "$OUT/gpu_tests.log"
exit $rc
