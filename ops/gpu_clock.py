"""The GPU's SM clock and power while a workload runs, sampled by nvidia-smi's own loop (a separate process: its CPU
does not count in the bench's process CPU).

Why: on the H200, W2 runs at the 700 W power cap, its SM clock ~1,500 MHz of 1,980 (throttle reason 0x4, SW power
cap; BENCHMARKS.md, 21:05 UTC), while the floors' 8192^3 rate comes from a burst of a few GEMMs. A W2 figure without
its clock hides why its compute-bound steps are slower than their floor.

    with ClockLog() as clocks:
        run_the_workload()
    clocks.summary()  # {"samples", "sm_mhz_median", ..., "throttle_reasons": {"0x...4": n}} or {"error": ...}
"""

from __future__ import annotations

import statistics
import subprocess
import tempfile
from typing import Any

QUERY = "clocks.sm,power.draw,clocks_throttle_reasons.active"


class ClockLog:
    """nvidia-smi sampling every interval_ms while inside the `with`; summary() after. Never raises: a missing
    nvidia-smi or unreadable output gives {"error": ...} (a bench must not die of its instrument)."""

    def __init__(self, command: list[str] | None = None, interval_ms: int = 100) -> None:
        self.command = command or ["nvidia-smi", f"--query-gpu={QUERY}", "--format=csv,noheader,nounits",
                                   f"-lms={interval_ms}"]
        self._proc: subprocess.Popen[bytes] | None = None
        self._out: Any = None
        self._text = ""
        self._error: str | None = None

    def __enter__(self) -> ClockLog:
        try:
            self._out = tempfile.TemporaryFile()
            self._proc = subprocess.Popen(self.command, stdout=self._out, stderr=subprocess.DEVNULL)
        except OSError as e:
            self._error = f"{type(e).__name__}: {e}"[:200]
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._proc is not None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        if self._out is not None:
            self._out.seek(0)
            self._text = self._out.read().decode(errors="replace")
            self._out.close()

    def summary(self) -> dict[str, Any]:
        if self._error:
            return {"error": self._error}
        samples = parse(self._text)
        if not samples:
            return {"error": f"no samples from {' '.join(self.command[:1])}"}
        clocks = sorted(s[0] for s in samples)
        power = [s[1] for s in samples]
        reasons: dict[str, int] = {}
        for s in samples:
            reasons[s[2]] = reasons.get(s[2], 0) + 1
        return {
            "samples": len(samples),
            "sm_mhz_median": statistics.median(clocks),
            "sm_mhz_p10": clocks[len(clocks) // 10],
            "sm_mhz_p90": clocks[(9 * len(clocks)) // 10],
            "sm_mhz_max": clocks[-1],
            "power_w_median": statistics.median(power),
            "power_w_max": max(power),
            "throttle_reasons": reasons,
        }


def parse(text: str) -> list[tuple[float, float, str]]:
    """'1500, 692.77, 0x0000000000000004' lines -> (SM MHz, W, throttle reasons); lines that are not such a sample
    (an nvidia-smi message, a 'N/A') are skipped."""
    out = []
    for line in text.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) != 3:
            continue
        try:
            out.append((float(parts[0]), float(parts[1]), parts[2]))
        except ValueError:
            continue
    return out

