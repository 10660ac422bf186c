#!/usr/bin/env bash
# Issue 13's PDL round on the H200 (branch w1, session 6): W1 per PDL variant, then the PDL GPU tests.
#   bash ops/gpu_w1_pdl.sh call1|call2|call3|dry    (from the repo root; results under $R, else ./.dev/gpu-out)
# "dry" runs the same steps on the CPU with a tiny shape: the bench refuses without CUDA after parsing its flags
# (so a typo in a flag fails here), and pytest collects the GPU tests (which then skip).
set -u
R=${R:-$PWD/.dev/gpu-out}
mkdir -p "$R"
export OUT=$R PYTHONPATH=${PYTHONPATH:-.}
PY=${PY:-python3}
which=${1:-call1}
git rev-parse HEAD > "$R/head.txt" 2>/dev/null || true
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv > "$R/gpu.txt" 2>&1 || true

bench() {  # bench <seconds> <name> <args...>: one ops/bench.py run, W1 only, graph bucket 1 only
    local limit=$1 name=$2
    shift 2
    timeout "$limit" "$PY" ops/bench.py --skip-hf --skip-cold --skip-w2 --max-num-seqs 1 "$@" > "$R/$name.txt" 2>&1
    echo "$name rc=$?" >> "$R/rc.txt"
    [ -f "$R/bench.json" ] && mv "$R/bench.json" "$R/$name.json"
    grep -E "W1 (TPOT|auto)|W1 \{" "$R/$name.txt" | tail -12
}

chain() {  # chain <seconds> <args...>: ops/bench_pdl_chain.py, the 8B layer chain per PDL variant in a graph
    local limit=$1
    shift
    timeout "$limit" "$PY" ops/bench_pdl_chain.py "$@" > "$R/chain.txt" 2>&1
    echo "chain rc=$?" >> "$R/rc.txt"
    grep "^|" "$R/chain.txt"
}

tests() {  # tests <seconds> <-k expression>
    timeout "$1" "$PY" -m pytest -q -p no:cacheprovider -p no:warnings -m gpu tests/test_kernels_decode_pdl.py \
        -k "$2" > "$R/tests.txt" 2>&1
    echo "tests rc=$?" >> "$R/rc.txt"
    tail -5 "$R/tests.txt"
}

case $which in
    call1)
        chain 42 --budget-s 28 --variants plain,pdl+peel0,pdl+peel1+attn0,pdl+peel0+l2_32,pdl+peel0+late,pdl+peel0+attn0
        bench 54 bf16 --decode-kernels auto,auto+pdl+peel0,auto+pdl+peel1+attn0
        ;;
    call2)
        bench 30 bf16 --decode-kernels auto,auto+nx4,auto+pdl+peel0+trig6+l2_32,auto+nx2
        chain 37 --budget-s 24 --variants plain,nx4,pdl+peel0+trig6+l2_32,nx2,nx8,pdl+peel0+trig6,pdl+peel0+trig7+l2_16,pdl+peel0+late+l2_32
        bench 20 fp8 --dtype fp8 --decode-kernels auto,auto+nx2
        tests 10 "plain_launch or (chain and trig-1)"
        ;;
    call3)  # not run in session 6: the next-weight L2 prefetch (gemv.NEXT_L2_ROW_BYTES, no PDL), ~45 s
        chain 40 --budget-s 26 --variants plain,nx4,nx2,nx8,nx1
        bench 40 bf16 --decode-kernels auto,auto+nx4,auto+nx2
        ;;
    dry)
        TRITON_INTERPRET=1 "$PY" ops/bench_pdl_chain.py --dry-run > "$R/chain.txt" 2>&1
        tail -6 "$R/chain.txt"
        bench 60 bf16 --shape tiny --decode-kernels auto,auto+pdl+peel0,auto+pdl+peel1+attn0
        bench 60 bf16 --decode-kernels auto,auto+nx4,auto+pdl+peel0+trig6+l2_32,auto+nx2
        bench 60 fp8 --dtype fp8 --decode-kernels auto,auto+nx2
        "$PY" ops/bench_pdl_chain.py --variants plain,nx4,pdl+peel0+trig6+l2_32,nx2,nx8,pdl+peel0+trig6,pdl+peel0+trig7+l2_16,pdl+peel0+late+l2_32 2>&1 | tail -1
        "$PY" -m pytest -q -p no:cacheprovider -m gpu tests/test_kernels_decode_pdl.py \
            -k "plain_launch or (chain and (plain-1 or l2-1))" > "$R/tests.txt" 2>&1
        tail -2 "$R/tests.txt"
        ;;
    *)
        echo "usage: $0 call1|call2|call3|dry" >&2
        exit 2
        ;;
esac
cat "$R/rc.txt"
