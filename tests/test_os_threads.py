"""name_os_thread: the kernel's name for the calling thread (what top -H and /proc/<pid>/task/<tid>/comm show)."""

from __future__ import annotations

import sys
import threading
from pathlib import Path

import pytest
from stoker.engine import name_os_thread

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="prctl(PR_SET_NAME) is Linux's")


def _comm(tid: int) -> str:
    return Path(f"/proc/self/task/{tid}/comm").read_text().strip()


def test_names_the_calling_thread_only_and_cuts_to_fifteen_bytes() -> None:
    seen: dict[str, str] = {}
    main_before = _comm(threading.get_native_id())

    def body() -> None:
        name_os_thread("stoker-engine")
        seen["short"] = _comm(threading.get_native_id())
        name_os_thread("a-name-longer-than-fifteen-bytes")
        seen["long"] = _comm(threading.get_native_id())

    t = threading.Thread(target=body)
    t.start()
    t.join()
    assert seen == {"short": "stoker-engine", "long": "a-name-longer-t"}
    assert _comm(threading.get_native_id()) == main_before  # the caller's thread only


def test_the_worker_engine_thread_is_named() -> None:
    import asyncio

    from stoker.worker.driver import EngineDriver

    names: list[str] = []

    class Engine:  # steps once, then has nothing left
        async_scheduling = False

        def __init__(self) -> None:
            self.left = 1

        def has_unfinished(self) -> bool:
            return self.left > 0

        def step(self) -> list:
            names.append(_comm(threading.get_native_id()))
            self.left -= 1
            return []

        def stats(self) -> None:
            return None

    loop = asyncio.new_event_loop()
    try:
        driver = EngineDriver(Engine(), loop, lambda *a: None)  # type: ignore[arg-type]
        driver.start()
        for _ in range(200):
            if names:
                break
            threading.Event().wait(0.01)
        driver.stop()
    finally:
        loop.close()
    assert names == ["stoker-engine"]
