# The H200 call 2 of branch ttft (2026-12-01 ~22:00 UTC): W1 through the queue vs the engine alone, with the
# prefill CUDA graphs on both sides, the verdict on every lone request (W1 + W1-ttft, bootstrap intervals, the
# queue's own share per request); then, in what is left of the call's 98 s, the prefill graphs' GPU test. From the
# repo root, PYTHONPATH=. and the packed stack's env sourced; $R: the results folder.
# E2E_ARGS="--dry-run ..." DEVICE=cpu runs it on a CPU machine against the local stack (the dry run).
set -u
SECONDS=0
R=${R:-/tmp/ttft-call2}
mkdir -p "$R"
E2E_ARGS=${E2E_ARGS:-}
GRAPH_TOKENS=${GRAPH_TOKENS:-1024}
TIMEOUT=${TIMEOUT:-86}
BUDGET=${BUDGET:-98}
DEVICE=${DEVICE:-cuda}
(date -u; nvidia-smi --query-gpu=name,clocks.sm,power.draw --format=csv) > "$R/machine.txt" 2>&1
OUT="$R" timeout "$TIMEOUT" python3 ops/bench_e2e.py --concurrency 1 --w2-requests 0 --rate-seconds 0 --w1-runs 6 \
    --w1-ttft-runs 32 --prefill-graph-tokens "$GRAPH_TOKENS" --out "$R/e2e.json" $E2E_ARGS > "$R/e2e.log" 2>&1
echo "e2e rc=$? after ${SECONDS} s" >> "$R/e2e.log"
LEFT=$((BUDGET - SECONDS))
if [ "$DEVICE" = cuda ] && [ "$LEFT" -gt 5 ]; then
    timeout "$LEFT" python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_prefill_graphs.py > "$R/test.log" 2>&1
    echo "test rc=$? in ${LEFT} s" >> "$R/test.log"
fi
date -u >> "$R/machine.txt"
