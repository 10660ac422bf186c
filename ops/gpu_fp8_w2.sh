# budget: 100 s
# fp8 (issue 14): W2 with FP8 weights + the FP8 KV cache, accounted kernel by kernel. First the FP8 decode
# attention at W2's shape (B=1,024, ctx 640 / 768) against its tile variants (call 1 at 21:09 also ran the grid-
# order / V-prefetch ones, since removed: kv_fp8_tiles.py); the
# FP8 prefill GEMM's pieces at M = 8,192 / 1,024 (ops/bench_fp8_prefill.py: quantization, _scaled_mm, the fused
# norm / SiLU-mul + quantization kernels); then ops/step_profile.py's kernel tables of one 8,192-token FP8 prefill step and one batch-1,024 FP8+FP8KV decode
# step (with every op's input shapes, for ops/fp8_account.py's floors). R: the results folder.
# DRY=1: the same commands on the CPU with a tiny model under the interpreter.
set -u
R=${R:-${OUT:-/tmp/fp8-results}}
mkdir -p "$R"
export PYTHONUNBUFFERED=1 OUT="$R"
if [ "${DRY:-0}" = 1 ]; then
    PROFILE=(--shape tiny --requests 8 --prompt 64); ATTN=(--tiny); T1=600; T2=900; T3=120; export TRITON_INTERPRET=1
else
    PROFILE=(--shape 8b --requests 1024 --prompt 512); ATTN=(); T1=18; T2=68; T3=12
fi
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv > "$R/gpu.txt" 2>&1 || true
timeout $T1 python3 ops/bench_decode_attention_fp8.py "${ATTN[@]}" --w2 --budget-s 8 > "$R/attn_w2.txt" 2>&1
echo "rc=$?" >> "$R/attn_w2.txt"
timeout $T3 python3 ops/bench_fp8_prefill.py "${ATTN[@]}" > "$R/fp8_prefill.txt" 2>&1
echo "rc=$?" >> "$R/fp8_prefill.txt"
unset TRITON_INTERPRET
timeout $T2 python3 ops/step_profile.py "${PROFILE[@]}" --dtype fp8 --kv-cache-dtype fp8 > "$R/step_profile.txt" 2>&1
echo "rc=$?" >> "$R/step_profile.txt"
cat "$R/attn_w2.txt" "$R/fp8_prefill.txt"
grep -E "ONE |rc=" "$R/step_profile.txt"
