# budget: 100 s
# w2 (issue 13), session 6 call 2: the first W2 run in a process had its prefill phase's host step() returns
# alternate ~25 / ~370 ms (a wait on the step just launched, every other step, steps 1-56; GPU idle 142 ms before
# prefill steps; call 1 at 21:05 UTC). Suspect: a fresh [N, V] float32 logits tensor per eager step, N growing
# every mixed step (the caching allocator growing its pool inside the forward). A/B in two fresh processes, the
# same as call 1 otherwise (ops/step_trace.py: the pure-prefill control first, then W2 cut after 45 steps):
#   A: eager logits in the decode graphs' static buffer (the new default, ModelRunner._eager_logits);
#   B: --no-shared-logits (the code before).
# Per step: host ms by part (--phases), the allocators' growth (cudaMalloc calls, pinned blocks and their us),
# GPU ms and idle (--gpu-account). nvidia-smi samples every 100 ms ($R/smi.csv).
# R: the results folder. DRY=1: the same commands on the CPU with a tiny model.
set -u
R=${R:-${OUT:-/tmp/w2-ab6}}
mkdir -p "$R"
export PYTHONUNBUFFERED=1
if [ "${DRY:-0}" = 1 ]; then
    ARGS=(--shape tiny --device cpu --requests 24 --prompt 32 --new 8 --max-num-batched-tokens 128
          --prefill-control 8 --max-steps 5)
    TA=900; TB=900
else
    ARGS=(--shape 8b --requests 1024 --prompt 512 --new 256 --prefill-control 256 --max-steps 45)
    TA=60; TB=35
fi
SMI=""
if command -v nvidia-smi > /dev/null; then
    nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,temperature.gpu,clocks_throttle_reasons.active \
        --format=csv,noheader -lms 100 > "$R/smi.csv" 2>&1 &
    SMI=$!
fi
for case in A B; do
    EXTRA=(); T=$TA
    if [ "$case" = B ]; then EXTRA=(--no-shared-logits); T=$TB; fi
    timeout $T python3 ops/step_trace.py "${ARGS[@]}" "${EXTRA[@]}" --gpu-account --phases --settle-heap --top 45 \
        --out "$R" --json-out "$R/trace_$case.json" > "$R/trace_$case.txt" 2>&1
    echo "rc=$?" >> "$R/trace_$case.txt"
done
[ -n "$SMI" ] && kill "$SMI"
for case in A B; do
    echo "== $case"
    grep -E "^per-step|GPU account|rc=" "$R/trace_$case.txt"
done
