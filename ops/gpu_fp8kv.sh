# budget: 150 s
# fp8kv, call 2 (issue 14, item 3): the FP8 KV cache's attention variants vs the bf16 cache
# (ops/bench_decode_attention_fp8.py), W2 end to end with the FP8 cache on the new default ('f16'), and the GPU
# tests of the FP8 KV kernels (the new modes, the bit trick on all 256 codes, the fp16 clamp of bf16 q).
# R: the results folder. DRY=1 (CPU, TRITON_INTERPRET=1): the bench on tiny shapes, the tests' interpreter cases.
set -u
R=${R:-${OUT:-/tmp/fp8kv-results}}
mkdir -p "$R"
export PYTHONUNBUFFERED=1
if [ "${DRY:-0}" = 1 ]; then
    TINY=(--tiny); W2=(echo "dry run: no ops/bench.py"); MARK=()
else
    TINY=(); W2=(python3 ops/bench.py --skip-hf --skip-cold --dtype fp8 --kv-cache-dtype fp8); MARK=(-m gpu)
fi
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv > "$R/gpu.txt" 2>&1 || true
timeout 62 python3 ops/bench_decode_attention_fp8.py "${TINY[@]}" --budget-s 45 --json "$R/bench_decode_attention_fp8.json" \
    > "$R/bench_decode_attention_fp8.txt" 2>&1
echo "rc=$?" >> "$R/bench_decode_attention_fp8.txt"
timeout 52 "${W2[@]}" > "$R/bench_w2_fp8_kvfp8.txt" 2>&1
echo "rc=$?" >> "$R/bench_w2_fp8_kvfp8.txt"
timeout 34 python3 -m pytest -q -p no:cacheprovider -p no:warnings "${MARK[@]}" tests/test_kernels_fp8_kv.py \
    -k "(modes and bf16) or 256 or clamp or rounds_like" > "$R/gpu_tests.txt" 2>&1
echo "rc=$?" >> "$R/gpu_tests.txt"
cat "$R/bench_decode_attention_fp8.txt"
grep -E "W2|fp8|FP8" "$R/bench_w2_fp8_kvfp8.txt" | tail -12
tail -5 "$R/gpu_tests.txt"
