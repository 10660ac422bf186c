"""Rank 0's side of a tensor-parallel engine: spawn ranks 1..size-1, join them into the groups, check that
they agree on model and config, watch them, ship each step's input to them, and stop them.

A rank that dies takes the engine down: the watchdog thread sees its process end (and on CUDA aborts the
NCCL group, whose waits would otherwise spin), and the next step(), or the one in flight, raises
TensorParallelError naming the rank. The worker treats an exception from step() as fatal: it exits 1 and
its jobs go back to Kafka through the at-least-once path. Collectives time out (engine/parallel/comm.py),
so a rank that hangs instead of dying ends the same way, only later.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import multiprocessing as mp
import multiprocessing.connection
import os
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import astuple
from datetime import timedelta

import torch
import torch.distributed as dist
from stoker.engine.batch import PackedStep
from stoker.engine.config import EngineConfig
from stoker.engine.parallel import step_io
from stoker.engine.parallel.comm import STARTUP_TIMEOUT, RankComm, rank_device

log = logging.getLogger(__name__)

# NVLink multicast (NVLS) stays off on the lent machines: every rank process gets these, and so does rank 0.
RANK_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
_STOP_TIMEOUT = timedelta(seconds=10)
_JOIN_POLL_S = 0.05
_VERDICT_WAIT_S = 3.0


class TensorParallelError(RuntimeError):
    """A rank died, hung past a collective's timeout, or disagrees with rank 0: the engine cannot go on."""


# The entry point of ranks > 0: (config, rank, size, store port, max_model_len, environment).
RankTarget = Callable[[EngineConfig, int, int, int, int, dict[str, str]], None]


class RankGroup:
    def __init__(self, config: EngineConfig, max_model_len: int, target: RankTarget):
        self.size = config.tensor_parallel_size
        self.failure: str | None = None
        self._died = threading.Event()  # the watchdog has named the ranks that died (in self.failure)
        self._closed = False
        for name, value in RANK_ENV.items():
            if os.environ.get(name, value) != value:
                log.warning("tensor parallel: overriding %s=%s with %s", name, os.environ[name], value)
            os.environ[name] = value
        self.store = dist.TCPStore("127.0.0.1", 0, self.size, is_master=True, timeout=STARTUP_TIMEOUT,
                                   wait_for_workers=False)
        spawn = mp.get_context("spawn")  # CUDA cannot be forked; spawn also gives each rank a clean import
        self.procs = [
            spawn.Process(target=target, args=(config, rank, self.size, self.store.port, max_model_len,
                                               dict(RANK_ENV)), name=f"stoker-tp-rank{rank}", daemon=True)
            for rank in range(1, self.size)
        ]
        for p in self.procs:
            p.start()
        self._wake_r, self._wake_w = spawn.Pipe(duplex=False)  # close() wakes the watchdog through it
        self._watchdog = threading.Thread(target=self._watch, name="stoker-tp-watchdog", daemon=True)
        self._watchdog.start()
        try:
            self._wait_joined()
            shared = config.tensor_parallel_shared_gpu
            self.comm = RankComm(0, self.size, self.store, rank_device(str(config.device), 0, shared),
                                 shared_gpu=shared)
            check_agreement(self.comm, fingerprint(config, max_model_len))
        except BaseException:
            self.close()
            raise

    def _wait_joined(self) -> None:
        """Every rank has reached the store (polled, so that a rank that died on the way fails us now
        rather than after the startup timeout)."""
        keys = [f"joined/{rank}" for rank in range(1, self.size)]
        while not self.store.check(keys):
            self.raise_if_failed()
            time.sleep(_JOIN_POLL_S)

    def _watch(self) -> None:
        sentinels = {p.sentinel: p for p in self.procs}
        ready = multiprocessing.connection.wait([*sentinels, self._wake_r])
        if self._closed or self._wake_r in ready:
            return
        for s in ready:
            if s in sentinels:
                sentinels[s].join()  # sets its exitcode; this thread is the one that reaps ranks that die
        self.failure = self._dead_ranks()
        self._died.set()
        log.error("%s: the engine cannot run on without it", self.failure)
        comm = getattr(self, "comm", None)
        if comm is not None:
            comm.abort()

    def _dead_ranks(self) -> str | None:
        dead = [p for p in self.procs if p.exitcode is not None]
        return "; ".join(f"tensor-parallel rank {int(p.name.removeprefix('stoker-tp-rank'))} (pid {p.pid}) "
                         f"exited with code {p.exitcode}" for p in dead) or None

    def raise_if_failed(self) -> None:
        if self.failure is not None:
            raise TensorParallelError(f"{self.failure}; restart the engine (the worker exits for its supervisor)")

    @contextlib.contextmanager
    def guard(self) -> Iterator[None]:
        """Collective errors -> TensorParallelError naming the dead rank when the watchdog knows it."""
        self.raise_if_failed()
        try:
            yield
        except RuntimeError as e:
            if isinstance(e, TensorParallelError):
                raise
            # The closed connection of a dead rank usually arrives before the watchdog has reaped it: give the
            # watchdog a moment to name it (a rank alive but stuck leaves the collective's own error).
            self._died.wait(timeout=_VERDICT_WAIT_S)
            if self.failure is None:
                self.failure = f"a tensor-parallel collective failed ({e})"
            raise TensorParallelError(f"{self.failure}; restart the engine") from e

    def ship(self, packed: PackedStep, prev_tokens: torch.Tensor | None) -> None:
        with self.guard():
            step_io.ship(self.comm, packed, prev_tokens)

    def close(self) -> None:
        """Stop the ranks: a stop header when they are healthy, then join; kill what does not exit."""
        if self._closed:
            return
        self._closed = True
        comm = getattr(self, "comm", None)
        if comm is not None and self.failure is None:
            try:
                step_io.ship_stop(comm, _STOP_TIMEOUT)
            except RuntimeError as e:
                log.warning("tensor parallel: stopping the ranks failed (%s); killing them", e)
        for p in self.procs:
            p.join(timeout=_STOP_TIMEOUT.total_seconds())
            if p.is_alive():
                p.kill()
                p.join()
        self._wake_w.send(None)
        self._watchdog.join(timeout=5)


def fingerprint(config: EngineConfig, max_model_len: int) -> int:
    """What every rank must agree on: the engine config, the model's config.json, its weight and JSON files
    (names and sizes), the engine's source and torch's version. 63 bits of a SHA-256."""
    h = hashlib.sha256(repr((astuple(config), max_model_len, torch.__version__)).encode())
    with open(os.path.join(config.model_path, "config.json"), "rb") as f:
        h.update(f.read())
    for name in sorted(os.listdir(config.model_path)):
        if name.endswith((".safetensors", ".json")):
            h.update(f"{name}:{os.path.getsize(os.path.join(config.model_path, name))}".encode())
    engine_dir = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    for root, _, files in sorted(os.walk(engine_dir)):
        for name in sorted(n for n in files if n.endswith(".py")):
            with open(os.path.join(root, name), "rb") as f:
                h.update(f.read())
    return int.from_bytes(h.digest()[:8], "big") >> 1


def check_agreement(comm: RankComm, mine: int) -> None:
    """Every rank compares every rank's fingerprint with rank 0's; a rank that differs fails them all."""
    values = comm.gather_ints(mine)
    odd = [rank for rank, value in enumerate(values) if value != values[0]]
    if odd:
        raise TensorParallelError(
            f"tensor-parallel ranks {odd} disagree with rank 0 on the model folder, the engine config or the "
            "engine's code (fingerprints differ): start every rank from the same checkout and model folder"
        )
