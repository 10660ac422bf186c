# budget: 100 s
# fp8 (issue 14), call 2: W2 with FP8 weights + the FP8 KV cache on this branch's final code
# (ops/bench.py --dtype fp8 --kv-cache-dtype fp8: W1, then W2 with its prefill / decode phases), then the
# FP8 prefill pieces again (ops/bench_fp8_prefill.py at M = 8,192: the quantization kernels after their
# rewrite, the fused norm / SiLU-mul ones) with what time is left.
# R: the results folder. DRY=1 on the CPU: bench.py only parses its flags there (it needs CUDA), the
# prefill bench runs its tiny shapes under the interpreter.
set -u
R=${R:-${OUT:-/tmp/fp8-results}}
mkdir -p "$R"
export PYTHONUNBUFFERED=1 OUT="$R"
if [ "${DRY:-0}" = 1 ]; then
    ATTN=(--tiny); T1=60; T2=600; export TRITON_INTERPRET=1
else
    ATTN=(); T1=84; T2=12
fi
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv > "$R/gpu.txt" 2>&1 || true
TRITON_INTERPRET=0 timeout $T1 python3 ops/bench.py --skip-hf --skip-cold --dtype fp8 --kv-cache-dtype fp8 \
    > "$R/bench_fp8kv.txt" 2>&1
echo "rc=$?" >> "$R/bench_fp8kv.txt"
timeout $T2 python3 ops/bench_fp8_prefill.py "${ATTN[@]}" --ms 8192,1024 > "$R/fp8_prefill.txt" 2>&1
echo "rc=$?" >> "$R/fp8_prefill.txt"
grep -vE "^\[bench .*(INFO|startup)" "$R/bench_fp8kv.txt" | tail -40
cat "$R/fp8_prefill.txt"
