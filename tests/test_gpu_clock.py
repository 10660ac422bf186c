"""ops/gpu_clock.ClockLog: nvidia-smi's samples while a workload runs -> the clock and power summary the bench
prints beside W2; a fake nvidia-smi (a Python loop printing samples) stands in for the real one."""

from __future__ import annotations

import os
import sys
import time

from stoker.ops.gpu_clock import ClockLog, parse

# Samples as `nvidia-smi --format=csv,noheader,nounits` writes them, one line a sample, then a line to skip.
FAKE = ("import sys, time\n"
        "for mhz, watts in [(1980, 120.5), (1500, 693.1), (1485, 699.9), (1515, 690.0), (1500, 694.2)]:\n"
        "    print(f'{mhz}, {watts}, 0x{4 if watts > 600 else 0:016x}', flush=True)\n"
        "print('[N/A], [N/A], [N/A]', flush=True)\n"
        "time.sleep(60)\n")


def test_clock_log_summarizes_the_samples_of_its_window() -> None:
    with ClockLog([sys.executable, "-c", FAKE]) as clocks:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and len(parse(_peek(clocks))) < 5:
            time.sleep(0.05)
    got = clocks.summary()
    assert got["samples"] == 5
    assert got["sm_mhz_median"] == 1500 and got["sm_mhz_max"] == 1980 and got["sm_mhz_p10"] == 1485
    assert got["power_w_median"] == 693.1 and got["power_w_max"] == 699.9
    assert got["throttle_reasons"] == {"0x0000000000000004": 4, "0x0000000000000000": 1}


def test_clock_log_without_nvidia_smi_reports_instead_of_raising() -> None:
    with ClockLog(["/nonexistent/nvidia-smi"]) as clocks:
        pass
    assert "error" in clocks.summary()
    with ClockLog([sys.executable, "-c", "print('no samples here')"]) as clocks:
        time.sleep(0.5)
    assert clocks.summary() == {"error": f"no samples from {sys.executable}"}


def _peek(clocks: ClockLog) -> str:
    """What the sampler wrote so far (the test waits for its samples before leaving the window)."""
    # pread: the sampler shares the file's offset, which a seek here would move under its writes
    return os.pread(clocks._out.fileno(), 1 << 20, 0).decode()
