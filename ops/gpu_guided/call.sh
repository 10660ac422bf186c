# budget: 120 s
# Issue 15's constrained decode step on the H200: ops/bench_guided.py, greedy then sampled (T=1), batches 1024 and
# 256, each constrained case twice (grammar work inline on the engine thread = the engine before; overlap = the
# grammar thread), with the step timeline. Run from the branch's root with R=<results folder>; GUIDED_DRY=<args>
# appends arguments (a CPU dry run: the tiny shape); GUIDED_TOTAL_S bounds both runs (default 114); GUIDED_MODES
# the constrained cases' grammar work (default inline,overlap; overlap alone: the engine's default, ~30 s a run). ~75 s on the H200
# (17:54 UTC; the model folder written first if absent: ~20 s more).
set -u
R=${R:-/tmp/guided-results}
mkdir -p "$R"
{ nproc; python3 -c "import os; print('affinity', len(os.sched_getaffinity(0)))"; python3 -c "import llguidance, importlib.metadata as m; print('llguidance', m.version('llguidance'))"; } > "$R/env.txt" 2>&1
SECONDS=0
TOTAL=${GUIDED_TOTAL_S:-114}
for case in greedy:0.0:$((TOTAL / 2 + 4)) sampled:1.0:0; do  # the sampled run gets what is left of TOTAL
  name=${case%%:*}; rest=${case#*:}; temp=${rest%%:*}; limit=${rest#*:}
  [ "$limit" = 0 ] && limit=$((TOTAL - SECONDS))
  mkdir -p "$R/$name"
  OUT="$R/$name" timeout "$limit" python3 ops/bench_guided.py --batches 1024,256 --no-sync-case --temperature "$temp" \
    --grammar-modes "${GUIDED_MODES:-inline,overlap}" --timeline --budget-s $((limit - 6)) ${GUIDED_DRY:-} > "$R/$name.log" 2>&1
  echo "$name exit $?" >> "$R/_driver.log"
  grep -v '^\[bench_guided\|^loading' "$R/$name.log" >> "$R/_driver.log"
done
