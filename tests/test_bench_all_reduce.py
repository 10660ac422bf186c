"""ops/bench_all_reduce.py (issue 17 item 3's measurement): its harness on the CPU (real gloo ranks, spawned), and
the GPU table's choice of the faster all-reduce. The CUDA timings themselves need several GPUs (not run here)."""

from __future__ import annotations

import re

from stoker.ops import bench_all_reduce


def test_the_harness_runs_real_ranks_and_prints_a_row_per_size(capsys) -> None:
    assert bench_all_reduce.main(["--device", "cpu", "--ranks", "2", "--sizes", "16,4096", "--iters", "5"]) == 0
    out = capsys.readouterr().out
    rows = re.findall(r"^\| ([\d,]+) \| ([\d.]+) \|$", out, re.M)
    assert [r[0] for r in rows] == ["16", "4,096"] and all(float(us) > 0 for _, us in rows), out


def test_the_gpu_table_names_the_faster_all_reduce_per_size() -> None:
    rows = [{"elements": 4096, "nccl_graph_us": 9.0, "nccl_eager_us": 20.0, "one_shot_graph_us": 4.5,
             "one_shot_rel_err": 1e-3},
            {"elements": 2097152, "nccl_graph_us": 60.0, "nccl_eager_us": 70.0, "one_shot_graph_us": 90.0,
             "one_shot_rel_err": 2e-3}]
    lines = bench_all_reduce.table(rows, 2, "cuda").splitlines()
    assert lines[3].startswith("| 4,096 (8,192) | 9.00 | 20.00 | 4.50 | one-shot |")
    assert lines[4].startswith("| 2,097,152 (4,194,304) | 60.00 | 70.00 | 90.00 | NCCL |")
