"""Runs a function in every rank of a real process group of N spawned processes (gloo on the CPU; NCCL with
device="cuda", rank r on GPU r): fn(rank, size, comm, *args), comm an engine.parallel.comm.RankComm (with its
store as comm.store, for what builds more on it: symmetric memory), each rank's return value back in a list; an
exception in any rank fails the caller with that rank's traceback. The tensor-parallel tests use it
(tests/test_tensor_parallel*.py) and so does ops/bench_all_reduce.py."""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist


class RankError(RuntimeError):
    """A rank failed or gave no result."""


def _rank(fn: Callable[..., Any], rank: int, size: int, port: int, device: str, args: tuple[Any, ...],
          env: dict[str, str], out: Any) -> None:
    os.environ.update(env)
    from stoker.engine.parallel.comm import RankComm, rank_device

    try:
        torch.set_num_threads(1)
        dev = rank_device(device, rank)
        if dev.type == "cuda":
            torch.cuda.set_device(dev)
        store = dist.TCPStore("127.0.0.1", port, size + 1, is_master=False, timeout=timedelta(seconds=60))
        comm = RankComm(rank, size, store, dev)
        out.put((rank, True, fn(rank, size, comm, *args)))
    except BaseException:
        out.put((rank, False, traceback.format_exc()))


def run_ranks(fn: Callable[..., Any], size: int, *args: Any, timeout_s: float = 120.0, device: str = "cpu",
              env: dict[str, str] | None = None) -> list[Any]:
    """fn(rank, size, comm, *args) in `size` spawned processes joined in one group -> results by rank. env: set in
    every rank before anything is imported there (e.g. NCCL's switches)."""
    ctx = mp.get_context("spawn")
    # The store's master lives here (one more client than ranks: this process).
    store = dist.TCPStore("127.0.0.1", 0, size + 1, is_master=True, timeout=timedelta(seconds=60),
                          wait_for_workers=False)
    out = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(fn, r, size, store.port, device, args, env or {}, out), daemon=True)
             for r in range(size)]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    try:
        while len(results) < size:
            try:
                rank, ok, value = out.get(timeout=timeout_s)
            except queue.Empty:
                raise RankError(f"ranks {sorted(set(range(size)) - set(results))} gave no result") from None
            if not ok:
                raise RankError(f"rank {rank} failed:\n{value}")
            results[rank] = value
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    return [results[r] for r in range(size)]
