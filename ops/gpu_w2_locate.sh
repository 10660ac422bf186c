# budget: 100 s
# w2 (issue 13), session 6 call 1: where a mixed step's ~12 ms over its parts goes, and W2 without mid-run
# compiles. One engine (ops/step_trace.py, the bench's engine and prompts, heap settled as the bench does):
#   1. a control: 256 requests of one new token each, i.e. 16 pure 8,192-token prefill steps back to back (no
#      decode rows): if their GPU ms climb from step 0's ~175 to the mixed steps' ~187, the excess is the GPU's
#      sustained clock (power / heat), not the mixing;
#   2. W2 (1,024 x 512 + 256) with the per-step account (GPU ms, idle, composition) and the Triton variants it
#      compiled (must be none now);
#   3. a probe run cut after 6 steps: steps 0-4 (one pure prefill, four mixed) under torch.profiler, kernel ms by
#      category and the top kernels per step.
# nvidia-smi samples SM clock, power and temperature every 100 ms through all of it ($R/smi.csv).
# R: the results folder. DRY=1: the same commands on the CPU with a tiny model.
set -u
R=${R:-${OUT:-/tmp/w2-locate}}
mkdir -p "$R"
export PYTHONUNBUFFERED=1
if [ "${DRY:-0}" = 1 ]; then
    ARGS=(--shape tiny --device cpu --requests 24 --prompt 32 --new 8 --max-num-batched-tokens 128
          --prefill-control 8 --kernel-window 0:3 --probe-steps 4)
    T1=900
else
    ARGS=(--shape 8b --requests 1024 --prompt 512 --new 256 --prefill-control 256 --kernel-window 0:5
          --probe-steps 6)
    T1=95
fi
SMI=""
if command -v nvidia-smi > /dev/null; then
    nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,clocks.mem,power.limit --format=csv > "$R/gpu.txt" 2>&1
    nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,temperature.gpu,clocks_throttle_reasons.active \
        --format=csv,noheader -lms 100 > "$R/smi.csv" 2>&1 &
    SMI=$!
fi
timeout $T1 python3 ops/step_trace.py "${ARGS[@]}" --gpu-account --settle-heap --probe-after --top 4 --out "$R" \
    --json-out "$R/trace.json" > "$R/trace.txt" 2>&1
echo "rc=$?" >> "$R/trace.txt"
[ -n "$SMI" ] && kill "$SMI"
rm -f "$R"/kernel_window_trace*.json  # large; its figures are in trace.json
grep -E "=====|^per-step|GPU account|^kernel window|^step |^    |failed|rc=" "$R/trace.txt" | cut -c1-220
