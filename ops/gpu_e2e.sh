#!/bin/bash
# Issue 12's device call on a fresh GPU machine: unpack the packed stack (.gpu-stack, from ops/pack_gpu_stack),
# write the 8B-shaped bench model, then run ops/bench_e2e.py (the queue beside the engine alone) with the arguments
# given, or by default W1's 16 + 40 lone requests and W2, no rate phase (~220 s with the machine's start). This is
# what session 8's calls 2-4 ran (BENCHMARKS.md, 2026-12-02); e.g. with the device tool:
#
#   run(command="bash ops/gpu_e2e.sh", carry=[".gpu-stack"], timeout_s=300)
#   run(command="bash ops/gpu_e2e.sh --w1-runs 8 --w1-ttft-runs 40", ...)      # every phase: the curve, the rate
#
# Everything lands under $OUT: env.log, write.log, e2e.log (the table at its end), e2e.json, worker.log.
export PYTHONUNBUFFERED=1
OUT=${OUT:?set OUT to the results folder}
T0=$SECONDS
echo "== start $(date +%T)"; nvidia-smi --query-gpu=name,memory.used,clocks.sm,power.draw --format=csv,noheader
# shellcheck source=/dev/null
source ops/gpu_stack_env > "$OUT/env.log" 2>&1 || { cat "$OUT/env.log"; exit 1; }
python3 -c "import sys; sys.path[:0] = ['ops', '.']; import bench; print('write_s', bench.write_model('/tmp/stoker-bench-8b', bench.SHAPES['8b'], 'cuda'))" \
  > "$OUT/write.log" 2>&1 || { tail -5 "$OUT/write.log"; exit 1; }
echo "== model written $(date +%T) (+$((SECONDS - T0)) s)"
if [ $# -eq 0 ]; then
  set -- --concurrency 1,1024 --w1-runs 16 --w1-ttft-runs 40 --rate-seconds 0
fi
python3 ops/bench_e2e.py "$@" --log-dir "$OUT" --out "$OUT/e2e.json" > "$OUT/e2e.log" 2>&1
rc=$?
echo "== e2e rc=$rc $(date +%T) (+$((SECONDS - T0)) s)"
grep -A7 "every lone" "$OUT/e2e.log"; grep "^|" "$OUT/e2e.log" | cut -c1-260 | tail -40
exit $rc
