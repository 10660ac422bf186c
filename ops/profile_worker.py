"""Runs stoker-worker (same arguments and environment) with its engine thread under cProfile, for
`ops/bench_e2e.py --profile-worker`: where the engine thread's CPU goes inside the worker, beside ops/bench.py
--profile's engine alone. The stats are written to $STOKER_PROFILE_OUT when the thread ends (the worker's
shutdown stops it). cProfile slows the Python it measures: read the shares, not the totals, and no CPU or timing
figure of a run made this way."""

from __future__ import annotations

import cProfile
import os
import sys

from stoker.worker import driver
from stoker.worker.main import main

_run = driver.EngineDriver._run


def _profiled_run(self: driver.EngineDriver) -> None:
    prof = cProfile.Profile()
    prof.enable()
    try:
        _run(self)
    finally:
        prof.disable()
        prof.dump_stats(os.environ.get("STOKER_PROFILE_OUT", "worker_engine.prof"))


driver.EngineDriver._run = _profiled_run  # type: ignore[method-assign]

if __name__ == "__main__":
    sys.exit(main())
