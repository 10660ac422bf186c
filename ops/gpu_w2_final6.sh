# budget: 100 s
# w2 (issue 13), for the next GPU call (written for session 6 call 2, not run: that call ran the A/B): W2 through ops/bench.py alone (--skip-w1: W1's warm run only, then W2;
# the floor in the same run; the row "W2 Triton compiles mid-run" must read 0; the SM clock and power through W2), then the GPU tests of this
# branch's change: mixed steps compile no decode-kernel variant after the capture, and fp32 greedy tokens equal
# transformers in mixed steps (the decode rows now launch with their graph bucket's split count and combine).
# nvidia-smi samples SM clock, power and temperature every 100 ms ($R/smi.csv).
# R: the results folder. DRY=1 (CPU): no bench (it needs CUDA); the tests as collected on the CPU (skipped).
set -u
R=${R:-${OUT:-/tmp/w2-final6}}
mkdir -p "$R"
export PYTHONUNBUFFERED=1
if [ "${DRY:-0}" = 1 ]; then
    BENCH=(python3 ops/bench.py --skip-hf --skip-cold --skip-w1); MARK=()  # (exits 2 without CUDA, after its args parse)
    T2=300  # the shared CPU is slow: the GPU's limit is below
else
    BENCH=(python3 ops/bench.py --skip-hf --skip-cold --skip-w1); MARK=(-m gpu); T2=20
fi
SMI=""
if command -v nvidia-smi > /dev/null; then
    nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,clocks.mem,power.limit --format=csv > "$R/gpu.txt" 2>&1
    nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,temperature.gpu,clocks_throttle_reasons.active \
        --format=csv,noheader -lms 100 > "$R/smi.csv" 2>&1 &
    SMI=$!
fi
OUT="$R" timeout 76 "${BENCH[@]}" > "$R/bench_w2.txt" 2>&1
echo "rc=$?" >> "$R/bench_w2.txt"
[ -n "$SMI" ] && kill "$SMI"
timeout $T2 python3 -m pytest -q -p no:cacheprovider -p no:warnings "${MARK[@]}" tests/test_mixed_decode_launch.py \
    tests/test_gpu_engine.py -k "compile_no_decode_variant or (mixed_steps and split)" > "$R/gpu_tests.txt" 2>&1
echo "rc=$?" >> "$R/gpu_tests.txt"
grep -E "^\| (W2|W3)|COMPILED|rc=" "$R/bench_w2.txt"
tail -4 "$R/gpu_tests.txt"
