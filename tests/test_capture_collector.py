"""engine.cuda_graphs.collector_paused: no cyclic garbage collection while CUDA graphs are captured.

A collection mid-capture can free an earlier engine's CUDA graphs (garbage in a reference cycle), whose
destructors make CUDA calls a "global"-mode capture refuses: the capture is invalidated. The CPU tests check the
pause itself; the GPU test captures a graph while such garbage waits, with the collector set to run at every
allocation."""

from __future__ import annotations

import gc
import threading

import pytest
import torch
from stoker.engine.cuda_graphs import collector_paused


class _Garbage:
    """Collectable only by the cyclic collector (it refers to itself); records when it is finalized."""

    def __init__(self, log: list[str], payload: object = None) -> None:
        self.me = self
        self.log = log
        self.payload = payload

    def __del__(self) -> None:
        self.log.append("freed")


@pytest.fixture
def eager_collector():
    """The collector at every allocation (the worst case), restored after."""
    threshold, enabled = gc.get_threshold(), gc.isenabled()
    gc.enable()
    gc.set_threshold(1, 1, 1)
    try:
        yield
    finally:
        gc.set_threshold(*threshold)
        if not enabled:
            gc.disable()


def _churn() -> None:
    """Allocations enough to set off many collections at threshold 1, in this thread and in another."""
    keep = [[i] for i in range(2_000)]
    t = threading.Thread(target=lambda: [[i] for i in range(2_000)])
    t.start()
    t.join()
    del keep


def test_no_collection_inside_and_the_collector_back_on_after(eager_collector) -> None:
    log: list[str] = []
    with collector_paused():
        _Garbage(log)
        _churn()
        assert log == [] and not gc.isenabled()
    assert gc.isenabled()
    _churn()
    assert log == ["freed"]  # the first collections after the pause free it


def test_a_collector_that_was_off_stays_off(eager_collector) -> None:
    gc.disable()
    with collector_paused():
        assert not gc.isenabled()
    assert not gc.isenabled()


def test_the_collector_comes_back_when_the_capture_raises(eager_collector) -> None:
    with pytest.raises(RuntimeError), collector_paused():
        raise RuntimeError("capture failed")
    assert gc.isenabled()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_capture_with_an_old_graph_in_garbage_succeeds(eager_collector) -> None:
    """An old captured graph, reachable only through a cycle, must not be reset while another graph captures."""
    x = torch.ones(1024, device="cuda")
    old = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # every kernel the captures use, loaded before them
        ((x * 2) * 3 + 1).sum()
    torch.cuda.current_stream().wait_stream(side)
    with torch.cuda.graph(old):
        y_old = x * 2
    log: list[str] = []
    held = [old, y_old]
    del old, y_old
    graph = torch.cuda.CUDAGraph()
    with collector_paused(), torch.cuda.graph(graph):
        y = x * 3
        # The old graph becomes garbage only now, mid-capture (made before, a collection at threshold 1 would
        # free it before the capture began: harmless, and not the case).
        _Garbage(log, tuple(held))
        held.clear()
        _churn()  # at threshold 1, a collection here would free the old graph mid-capture
        y = y + 1
        freed_mid_capture = list(log)  # read inside: the first allocation after the pause collects it
    assert freed_mid_capture == []
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(y, torch.full_like(x, 4.0))
    gc.collect()
    assert log == ["freed"]
