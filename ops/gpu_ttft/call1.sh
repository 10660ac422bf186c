# The H200 call 1 of branch ttft (2026-12-01 ~21:25 UTC): W1's TTFT on the engine alone by part, eager vs the
# prefill graphs, then the prefill graphs' GPU test. From the repo root, PYTHONPATH=. ; $R: the results folder.
# SHAPE=tiny DEVICE=cpu runs the same lines on a CPU machine (the dry run).
set -u
R=${R:-/tmp/ttft-call1}
mkdir -p "$R"
SHAPE=${SHAPE:-8b}
DEVICE=${DEVICE:-cuda}
PROMPT=${PROMPT:-512}
SEQS=${SEQS:-1024}
RUNS=${RUNS:-8}
NEW=${NEW:-32}
(nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.draw --format=csv; nproc; date -u; id -u
 lscpu | grep -i "model name\|mhz"; ls -l /dev/cpu_dma_latency
 for s in /sys/devices/system/cpu/cpu0/cpuidle/state*; do echo "$s $(cat $s/name) $(cat $s/latency) $(cat $s/disable)"; done
 cat /sys/devices/system/cpu/cpu0/cpufreq/scaling_governor) > "$R/machine.txt" 2>&1
timeout 72 python3 ops/ttft_probe.py --shape "$SHAPE" --device "$DEVICE" --prompt "$PROMPT" --max-num-seqs "$SEQS" \
    --runs "$RUNS" --new "$NEW" --gaps-ms 0,100 --prefill-graph-tokens 1024 --out "$R" > "$R/probe.log" 2>&1
echo "probe rc=$?" >> "$R/probe.log"
if [ "$DEVICE" = cuda ]; then
    timeout 24 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_prefill_graphs.py > "$R/test.log" 2>&1
    echo "test rc=$?" >> "$R/test.log"
fi
date -u >> "$R/machine.txt"
