# budget: 120 s
# w2 (issue 13), final: W2 through ops/bench.py on one engine, the mixed steps' attention whole (before) then
# split (after) (--mixed-split off,on; W1 as ever), then the GPU tests of what this branch changed: the mixed
# split against the reference (bf16/fp16/fp32), the decode launcher's out=, fp32 greedy tokens equal transformers
# in mixed steps, the prefill kernel's tiles (test_kernels' attention cases).
# R: the results folder. DRY=1 (CPU): no bench (it needs CUDA); the tests' interpreter cases.
set -u
R=${R:-${OUT:-/tmp/w2-final}}
mkdir -p "$R"
export PYTHONUNBUFFERED=1
if [ "${DRY:-0}" = 1 ]; then
    BENCH=(echo "dry run: no ops/bench.py"); MARK=(); export TRITON_INTERPRET=1 CUDA_VISIBLE_DEVICES=""
    TESTS=(tests/test_mixed_attention.py); T2=300
else
    BENCH=(python3 ops/bench.py --skip-hf --skip-cold --mixed-split off,on); MARK=(-m gpu); T2=32
    TESTS=(tests/test_mixed_attention.py tests/test_gpu_engine.py tests/test_kernels.py)
fi
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv > "$R/gpu.txt" 2>&1 || true
OUT="$R" timeout 86 "${BENCH[@]}" > "$R/bench_w2.txt" 2>&1
echo "rc=$?" >> "$R/bench_w2.txt"
timeout $T2 python3 -m pytest -q -p no:cacheprovider -p no:warnings "${MARK[@]}" "${TESTS[@]}" \
    -k "mixed or writes_only" > "$R/gpu_tests.txt" 2>&1
echo "rc=$?" >> "$R/gpu_tests.txt"
grep -E "^\| (W1 TPOT|W2)|rc=" "$R/bench_w2.txt"
tail -4 "$R/gpu_tests.txt"
