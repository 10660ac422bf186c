"""The heap policy of a process that serves an engine, applied once the engine is loaded and before serving.

Everything made by then (modules, the model, the warm-up's leftovers) lives as long as the process. Frozen, it is
no longer walked by a full collection: with torch and the engine imported that is ~193,000 tracked objects, 150 ms
a full collection on the 2-core development VM and under 1 ms frozen. On the H200, W2 without it had a full
collection of 100-145 ms every ~22 decode steps, each leaving the GPU idle 64-109 ms (ops/step_trace.py
--gpu-account). The young generation is also made larger than a step's burst of objects that die within the step
(an output, its token list and a chunk per running request: thousands at 1,024 requests). At Python's default of
700 the bursts alone set off ~14 collections a second (ops/bench_transport.py --phases paced: 0.013 cores of the
worker's ~0.15; none at 20,000).

The worker (worker/main.py) and the benches call settle_heap(). A program that embeds LLMEngine calls it itself
if it wants the same: it changes the whole process's collector, which a library should not do unasked.
"""

from __future__ import annotations

import gc

YOUNG_THRESHOLD = 20_000  # net new tracked objects before a young collection (Python's default: 700)


def settle_heap() -> None:
    """Collect once, freeze what is alive, and raise the young generation's threshold to YOUNG_THRESHOLD."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(YOUNG_THRESHOLD, *gc.get_threshold()[1:])
