#!/bin/bash
# Issue 17's device calls on a machine with several GPUs (nvidia-h200-x2 and up), in phases that each fit one
# call's 600 s. First run on nvidia-h200-x2 in session 24 (BENCHMARKS.md), as .dev/s24's calls A and B.
#
#   run(command="bash ops/gpu_tp.sh correctness", kind="nvidia-h200-x2", carry=[".gpu-stack"], timeout_s=600)
#   run(command="bash ops/gpu_tp.sh speed", kind="nvidia-h200-x2", carry=[".gpu-stack"], timeout_s=600)
#   run(command="bash ops/gpu_tp.sh first", kind="nvidia-h200-x2", carry=[".gpu-stack"], timeout_s=600)
#
# correctness: the GPU and multi-GPU tests of tensor parallelism (TP=2 against TP=1, graphs on every rank, the
#              one-shot all-reduce against NCCL) and of the loaders' rank paths; then the all-reduce at decode's
#              message sizes, NCCL in a graph against the one-shot (ops/bench_all_reduce.py: item 3's choice).
# speed:       the 8B shape at TP=2 (written weights: the fast loader's rank reads) beside TP=1 on the same
#              machine, W1 and W2; then the 70B shape at TP=2 on dummy weights (its 131 GiB fit no disk), W1 and W2
#              at 256 requests (the figures).
# all-reduce:  ops/bench_all_reduce.py, then W1 of the 8B at TP=2 with NCCL and with the one-shot all-reduce
#              (EngineConfig.tensor_parallel_all_reduce), and --shape 8b-rank2 (a rank's kernels alone); ~300 s.
# first:       for a short lending window: the two-GPU engine tests (TP=2 against TP=1 with graphs on every rank,
#              NCCL and the one-shot symm-mem all-reduce; the one-shot against NCCL), then the all-reduce phase;
#              ~450 s.
# NVLink multicast stays off (the engine's ranks set it; the tests and the all-reduce bench set it too).
# Everything lands under $OUT: one log per step and the benches' JSON.
export PYTHONUNBUFFERED=1 PYTEST_ADDOPTS="-p no:warnings" NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 \
  NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:?set OUT to the results folder}
T0=$SECONDS
step() { echo "== $1 rc=$2 +$((SECONDS - T0)) s"; }
nvidia-smi --query-gpu=index,name,memory.used --format=csv,noheader
# shellcheck source=/dev/null
source ops/gpu_stack_env > "$OUT/env.log" 2>&1 || { cat "$OUT/env.log"; exit 1; }
case "${1:-}" in
  correctness)
    timeout 300 python3 -m pytest -v -rfEs -p no:cacheprovider -m gpu tests/test_tensor_parallel.py \
      tests/test_tensor_parallel_fp8.py tests/test_fast_load_slices.py tests/test_dummy_load.py \
      > "$OUT/tp_tests.log" 2>&1
    step tp_tests $?
    timeout 200 python3 ops/bench_all_reduce.py --ranks 2 > "$OUT/all_reduce.log" 2>&1
    step all_reduce $?
    grep "^|" "$OUT/all_reduce.log"; tail -5 "$OUT/tp_tests.log"
    ;;
  speed)
    mkdir -p "$OUT/8b_tp2" "$OUT/8b_tp1" "$OUT/70b_tp2"
    OUT=$OUT/8b_tp2 timeout 200 python3 ops/bench.py --skip-hf --skip-cold --tensor-parallel 2 \
      > "$OUT/8b_tp2.log" 2>&1
    step 8b_tp2 $?
    OUT=$OUT/8b_tp1 timeout 120 python3 ops/bench.py --skip-hf --skip-cold > "$OUT/8b_tp1.log" 2>&1
    step 8b_tp1 $?
    OUT=$OUT/70b_tp2 timeout 240 python3 ops/bench.py --shape 70b --tensor-parallel 2 --load-format dummy \
      --w2-requests 256 > "$OUT/70b_tp2.log" 2>&1
    step 70b_tp2 $?
    grep -h "W1 TPOT\|W2 total\|W3 weights" "$OUT"/*.log
    ;;
  all-reduce)
    # Item 3's choice on the engine: W1 of the 8B at TP=2 (dummy weights) with NCCL and with the one-shot all-reduce
    # over symmetric memory for the fused steps (STOKER_TP_ALL_REDUCE=symm-mem), and one rank's kernels alone
    # (--shape 8b-rank2 on one GPU: what the all-reduces cost is the difference).
    mkdir -p "$OUT/nccl" "$OUT/symm" "$OUT/rank"
    timeout 60 python3 ops/bench_all_reduce.py --ranks 2 > "$OUT/all_reduce.log" 2>&1
    step all_reduce $?
    OUT=$OUT/nccl timeout 100 python3 ops/bench.py --skip-hf --skip-w2 --tensor-parallel 2 --load-format dummy \
      > "$OUT/w1_nccl.log" 2>&1
    step w1_nccl $?
    OUT=$OUT/symm STOKER_TP_ALL_REDUCE=symm-mem timeout 100 python3 ops/bench.py --skip-hf --skip-w2 \
      --tensor-parallel 2 --load-format dummy > "$OUT/w1_symm.log" 2>&1
    step w1_symm $?
    OUT=$OUT/rank timeout 100 python3 ops/bench.py --shape 8b-rank2 --skip-hf --skip-w2 --load-format dummy \
      --max-num-seqs 1 > "$OUT/w1_rank.log" 2>&1
    step w1_rank $?
    grep "^|" "$OUT/all_reduce.log"; grep -h "W1 TPOT" "$OUT"/w1_*.log
    ;;
  first)
    timeout 150 python3 -m pytest -v -rfEs -p no:cacheprovider -m gpu tests/test_tensor_parallel.py \
      -k "cuda_tp2_float32 or cuda_tp2_bfloat16 or one_shot" > "$OUT/tp2_tests.log" 2>&1
    step tp2_tests $?
    tail -12 "$OUT/tp2_tests.log"
    bash "$0" all-reduce
    ;;
  *)
    echo "usage: ops/gpu_tp.sh correctness|speed|all-reduce|first" >&2; exit 2 ;;
esac
