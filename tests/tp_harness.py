"""Runs a function in every rank of a real gloo group of N processes (spawned), for the tensor-parallel
tests: the function gets (rank, size, comm: engine.parallel.comm.RankComm, *args) and each rank's return value
comes back in a list; an exception in any rank fails the caller with that rank's traceback."""

from __future__ import annotations

import multiprocessing as mp
import queue
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist


def _rank(fn: Callable[..., Any], rank: int, size: int, port: int, device: str, args: tuple[Any, ...],
          out: Any) -> None:
    from stoker.engine.parallel.comm import RankComm, rank_device

    try:
        torch.set_num_threads(1)
        store = dist.TCPStore("127.0.0.1", port, size + 1, is_master=False, timeout=timedelta(seconds=60))
        comm = RankComm(rank, size, store, rank_device(device, rank))
        comm.store = store  # type: ignore[attr-defined]  # for functions that build more on the same store
        out.put((rank, True, fn(rank, size, comm, *args)))
    except BaseException:
        out.put((rank, False, traceback.format_exc()))


def run_ranks(fn: Callable[..., Any], size: int, *args: Any, timeout_s: float = 120.0, device: str = "cpu") -> list[Any]:
    """fn(rank, size, comm, *args) in `size` spawned processes joined in one group (gloo on the CPU; NCCL with
    device="cuda", rank r on GPU r) -> results by rank."""
    ctx = mp.get_context("spawn")
    # The store's master lives here (one more client than ranks: this process).
    store = dist.TCPStore("127.0.0.1", 0, size + 1, is_master=True, timeout=timedelta(seconds=60),
                          wait_for_workers=False)
    out = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(fn, r, size, store.port, device, args, out), daemon=True)
             for r in range(size)]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    try:
        while len(results) < size:
            try:
                rank, ok, value = out.get(timeout=timeout_s)
            except queue.Empty:
                raise AssertionError(f"ranks {sorted(set(range(size)) - set(results))} gave no result") from None
            if not ok:
                raise AssertionError(f"rank {rank} failed:\n{value}")
            results[rank] = value
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    return [results[r] for r in range(size)]
