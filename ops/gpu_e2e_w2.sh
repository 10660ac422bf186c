#!/bin/bash
# One device call for issue 12's open figure: W2 (1,024 x 512+256 at once) through Kafka + the worker + Redis
# beside the engine alone, on the current code, in one ops/bench_e2e.py run (W1 is cut to 2 runs and the rate phase
# is off, to fit a fresh machine in about 120 s of command time). While the bench model is written, the PDL GPU tests
# run beside it (pytest -m gpu -k pdl: the decode_pdl chain and the GEMV's PDL form).
#
#   run(command="BUDGET_S=118 bash ops/gpu_e2e_w2.sh", carry=[".gpu-stack"], timeout_s=125)
#
# .gpu-stack comes from ops/pack_gpu_stack (the broker's jars, a Java runtime, redis-server and the wheels the GPU
# machine lacks; ops/gpu_stack_env unpacks it). Everything lands under $OUT: env.log, write.log, pdl_tests.log,
# e2e.log and e2e.json (the table at the end of e2e.log puts each figure beside the engine alone's).
export PYTHONUNBUFFERED=1 PYTEST_ADDOPTS="-p no:warnings"
OUT=${OUT:?set OUT to the results folder}
T0=$SECONDS
echo "== start $(date +%T)"; nvidia-smi --query-gpu=name,memory.used,clocks.sm,power.draw --format=csv,noheader
# shellcheck source=/dev/null
source ops/gpu_stack_env > "$OUT/env.log" 2>&1 || { cat "$OUT/env.log"; exit 1; }
echo "== stack env $(date +%T) (+$((SECONDS - T0)) s)"
python3 -c "import sys; sys.path[:0] = ['ops', '.']; import bench; print('write_s', bench.write_model('/tmp/stoker-bench-8b', bench.SHAPES['8b'], 'cuda'))" \
  > "$OUT/write.log" 2>&1 &
writer=$!
timeout 30 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_kernels_decode_pdl.py tests/test_kernels_gemv.py -k pdl \
  > "$OUT/pdl_tests.log" 2>&1
echo "pdl tests rc=$? $(date +%T)"; tail -3 "$OUT/pdl_tests.log"
wait $writer; echo "== model written $(date +%T) (+$((SECONDS - T0)) s)"; tail -2 "$OUT/write.log"
left=$(( ${BUDGET_S:-118} - (SECONDS - T0) ))
echo "== e2e with ${left} s"
timeout "$left" python3 ops/bench_e2e.py --concurrency 1,1024 --w1-runs 2 --rate-seconds 0 --kafka-warmup 1000 \
  --out "$OUT/e2e.json" > "$OUT/e2e.log" 2>&1
echo "e2e rc=$? $(date +%T) (+$((SECONDS - T0)) s)"
grep -v "aiokafka\|loading weights" "$OUT/e2e.log" | tail -45 | cut -c1-260
