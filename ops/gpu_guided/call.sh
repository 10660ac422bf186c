# budget: 100 s
# Issue 15's constrained decode step on the H200: ops/bench_guided.py at batch 1,024 (the engine's default: grammar
# work on the grammar thread), every run with interleaved rounds on one engine (none, schema, none, schema ...; the
# ratio is the median of the rounds' own ratios), the step timeline, the per-step distribution (p90/p99/max, the
# slowest steps and the collections inside them) and the prefix cache on (rounds after the first skip the prefill).
# Run from the branch's root with R=<results folder>.
#   GUIDED_RUNS     runs in order, each name:temperature:heap:switch-interval[:extra] (extra: more bench_guided arguments,
#                   commas inside, no spaces, e.g. --mask-threads=12,15; default: greedy then sampled T=1, both
#                   under the worker's process settings: frozen heap, young GC threshold 20,000, 0.5 ms switch
#                   interval; "default:0.005" is the process the runs before 21:00 UTC 2026-12-01 measured)
#   GUIDED_ROUNDS   rounds per run (default 3); GUIDED_BATCHES (default 1024)
#   GUIDED_TOTAL_S  bounds all runs (default 94; each run gets an equal share of what is left when it starts)
#   GUIDED_DRY      appended arguments (a CPU dry run: the tiny shape)
# On the H200 (2026-12-01): a run of 3 rounds 30-34 s (none + schema), 39 s greedy with two executor sizes a round,
# 32 s sampled: loading + engine start ~12 s, the first prefill ~4 s, ~3.5 s a case after; the model folder is
# written first if absent (~20 s more, inside the first run's share).
set -u
R=${R:-/tmp/guided-results}
mkdir -p "$R"
{ nproc; python3 -c "import os; print('affinity', len(os.sched_getaffinity(0)))"; python3 -c "import llguidance, importlib.metadata as m; print('llguidance', m.version('llguidance'))"; } > "$R/env.txt" 2>&1
SECONDS=0
TOTAL=${GUIDED_TOTAL_S:-94}
read -r -a RUNS <<< "${GUIDED_RUNS:-greedy:0.0:worker:0.0005 sampled:1.0:worker:0.0005}"
left=${#RUNS[@]}
for run in "${RUNS[@]}"; do
  IFS=: read -r name temp heap interval extra <<< "$run"
  limit=$(( (TOTAL - SECONDS) / left )); left=$((left - 1))
  mkdir -p "$R/$name"
  OUT="$R/$name" timeout "$limit" python3 ops/bench_guided.py --batches "${GUIDED_BATCHES:-1024}" --no-sync-case \
    --temperature "$temp" --grammar-modes overlap --timeline --repeats "${GUIDED_ROUNDS:-3}" --prefix-caching \
    --heap "$heap" --switch-interval "$interval" --budget-s $((limit - 9)) ${extra:-} ${GUIDED_DRY:-} > "$R/$name.log" 2>&1
  echo "$name ($run) exit $? after ${SECONDS} s" >> "$R/_driver.log"
  grep -v '^\[bench_guided\|^loading' "$R/$name.log" >> "$R/_driver.log"
done
