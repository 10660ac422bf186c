"""CPU seconds of a process and of each of its threads, read from /proc (Linux): what the benches report beside
their figures (ops/bench.py for its own process, ops/bench_e2e.py for the worker's and its own)."""

from __future__ import annotations

import os

_TICK = os.sysconf("SC_CLK_TCK")


def _stat(path: str) -> tuple[str, float]:
    """(the name in parentheses, utime + stime in seconds) of one /proc stat file."""
    with open(path) as f:
        stat = f.read()
    fields = stat[stat.rindex(")") + 2 :].split()  # from the 3rd field on: utime and stime are the 14th and 15th
    return stat[stat.index("(") + 1 : stat.rindex(")")], (int(fields[11]) + int(fields[12])) / _TICK


def cpu_s(pid: int | str = "self", tid: int | None = None) -> float:
    """utime + stime of every thread of pid, or of its thread `tid` alone."""
    return _stat(f"/proc/{pid}/stat" if tid is None else f"/proc/{pid}/task/{tid}/stat")[1]


def threads_cpu_s(pid: int | str = "self") -> dict[int, tuple[str, float]]:
    """{tid: (its name in the kernel, utime + stime)} of every thread of pid now (a thread that ends while this
    reads is left out). The worker names its own threads (stoker-engine, ...); its main thread, tid == pid, runs
    the event loop."""
    out: dict[int, tuple[str, float]] = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            out[int(tid)] = _stat(f"/proc/{pid}/task/{tid}/stat")
        except OSError:
            continue
    return out
