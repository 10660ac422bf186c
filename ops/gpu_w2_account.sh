# budget: 120 s
# w2, call 1 (issue 13): a full account of W2's prefill phase on the GPU (ops/step_trace.py): CUDA events
# around every launched step (GPU ms, idle before it, its decode rows / contexts / prompt tokens), four mixed
# steps under torch.profiler (kernel ms by category, GPU span and idle), and one mixed step with >= 512
# decode rows: its kernel table and its attention timed whole / decode rows / prompt chunks / decode kernel.
# Twice on one engine (--ab-mixed-split): the mixed steps' attention whole (the code before 4b65a9d), then
# split (decode rows through the decode kernel). --new 72: every request still decodes when the last prompt
# chunk is in (69 steps), the run ends soon after.
# R: the results folder. DRY=1: the same commands on the CPU with a tiny model.
set -u
R=${R:-${OUT:-/tmp/w2-results}}
mkdir -p "$R"
export PYTHONUNBUFFERED=1
if [ "${DRY:-0}" = 1 ]; then
    SHAPE=(--shape tiny --device cpu --requests 64 --prompt 32 --new 12 --max-num-batched-tokens 256
           --kernel-window 3:5 --mixed-bench-rows 8 --ab-mixed-split)
else
    SHAPE=(--shape 8b --requests 1024 --prompt 512 --new 72 --kernel-window 30:34 --mixed-bench-rows 512
           --ab-mixed-split)
fi
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv > "$R/gpu.txt" 2>&1 || true
timeout 110 python3 ops/step_trace.py "${SHAPE[@]}" --gpu-account --phases --top 8 --out "$R" \
    --json-out "$R/w2_account.json" > "$R/w2_account.txt" 2>&1
echo "rc=$?" >> "$R/w2_account.txt"
rm -f "$R"/kernel_window_trace*.json  # tens of MB; its figures are in w2_account.json
grep -E -A 3 "=====|GPU account|kernel window|ONE mixed|^  [a-z_]+ +[0-9]" "$R/w2_account.txt" | head -120
tail -2 "$R/w2_account.txt"
