# budget: 120 s
# w2 (issue 13): W2 on one engine with the mixed steps' attention whole (the code before 4b65a9d), then split
# (decode rows through the decode kernel), each run with the per-step account (ops/step_trace.py: CUDA events
# around every launched step: GPU ms, idle before it, decode rows / contexts / prompt tokens); then a probe run
# cut after 30 steps: steps 22-25 under torch.profiler (kernel ms by category, GPU span and idle) and the first
# mixed step with >= 400 decode rows after them: its kernel tables (split and whole) and its attention timed
# whole / decode rows / prompt chunks / decode kernel. Then the prefill kernel's tiles at W2's 8,192-token step.
# R: the results folder. DRY=1: the same commands on the CPU with a tiny model.
set -u
R=${R:-${OUT:-/tmp/w2-results}}
mkdir -p "$R"
export PYTHONUNBUFFERED=1
if [ "${DRY:-0}" = 1 ]; then
    SHAPE=(--shape tiny --device cpu --requests 64 --prompt 32 --new 12 --max-num-batched-tokens 256
           --kernel-window 3:5 --mixed-bench-rows 16 --probe-steps 7 --ab-mixed-split)
    TINY=(--tiny); T1=600; T2=300; export TRITON_INTERPRET_SWEEP=1  # the CPU is slow: the limits are the GPU's below
else
    SHAPE=(--shape 8b --requests 1024 --prompt 512 --new 256 --kernel-window 22:26 --mixed-bench-rows 400
           --probe-steps 30 --ab-mixed-split)
    TINY=(); T1=98; T2=18; export TRITON_INTERPRET_SWEEP=0
fi
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv > "$R/gpu.txt" 2>&1 || true
timeout $T1 python3 ops/step_trace.py "${SHAPE[@]}" --gpu-account --phases --top 6 --out "$R" \
    --json-out "$R/w2_account.json" > "$R/w2_account.txt" 2>&1
echo "rc=$?" >> "$R/w2_account.txt"
rm -f "$R"/kernel_window_trace*.json  # tens of MB; its figures are in w2_account.json
TRITON_INTERPRET=$TRITON_INTERPRET_SWEEP timeout $T2 python3 ops/bench_prefill_attention.py "${TINY[@]}" --json "$R/bench_prefill_attention.json" \
    > "$R/bench_prefill_attention.txt" 2>&1
echo "rc=$?" >> "$R/bench_prefill_attention.txt"
grep -E "=====|GPU account|^kernel window|^step |ONE mixed|^  [a-z_]+ +[0-9]|^-- the step|failed|rc=" "$R/w2_account.txt"
cat "$R/bench_prefill_attention.txt"
