# budget: 120 s
# w2, call 1 (issue 13): a full account of W2's prefill phase on the GPU (ops/step_trace.py): CUDA events
# around every launched step (GPU ms, idle before it, its decode rows / contexts / prompt tokens), six mixed
# steps under torch.profiler (kernel ms by category, GPU span and idle), and one mixed step with >= 512
# decode rows: its kernel table and its attention timed whole / decode rows / prompt chunks / decode kernel.
# --new 80: every request still decodes when the last prompt chunk is in (~68 steps), the run ends soon after.
# R: the results folder. DRY=1: the same commands on the CPU with a tiny model.
set -u
R=${R:-${OUT:-/tmp/w2-results}}
mkdir -p "$R"
export PYTHONUNBUFFERED=1
if [ "${DRY:-0}" = 1 ]; then
    SHAPE=(--shape tiny --device cpu --requests 64 --prompt 32 --new 12 --max-num-batched-tokens 256
           --kernel-window 3:5 --mixed-bench-rows 8)
else
    SHAPE=(--shape 8b --requests 1024 --prompt 512 --new 80 --kernel-window 30:36 --mixed-bench-rows 512)
fi
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv > "$R/gpu.txt" 2>&1 || true
timeout 110 python3 ops/step_trace.py "${SHAPE[@]}" --gpu-account --phases --top 8 --out "$R" \
    --json-out "$R/w2_account.json" > "$R/w2_account.txt" 2>&1
echo "rc=$?" >> "$R/w2_account.txt"
rm -f "$R/kernel_window_trace.json"  # tens of MB; its figures are in w2_account.json
grep -A 80 "GPU account" "$R/w2_account.txt" | head -120
