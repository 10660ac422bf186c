"""A rank's process groups, made from a TCPStore without torch.distributed's global default group (so one
process could hold several engines): every collective goes through a group object and carries a timeout.

- control (gloo, CPU tensors): step headers and packed inputs from rank 0, startup agreement. Ranks > 0
  wait on it between steps for as long as the engine is idle, so their receive has no practical timeout;
  they notice a dead rank 0 by its closed connection or its process sentinel (engine/rank_worker.py).
- compute (nccl on CUDA, gloo on CPU): the all-reduces inside the forward, bounded by COLLECTIVE_TIMEOUT. With
  every rank on one GPU (EngineConfig.tensor_parallel_shared_gpu) gloo on CUDA tensors: NCCL refuses two ranks on
  one device.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

COLLECTIVE_TIMEOUT = timedelta(seconds=60)  # a forward's all-reduce waiting longer means a rank is stuck
STARTUP_TIMEOUT = timedelta(minutes=30)  # joining and loading: a 70B shard read from disk takes minutes
IDLE_WAIT = timedelta(days=3650)  # ranks > 0 between steps: the engine may idle indefinitely


class RankComm:
    def __init__(self, rank: int, size: int, store: dist.Store, device: torch.device,
                 collective_timeout: timedelta = COLLECTIVE_TIMEOUT, shared_gpu: bool = False):
        self.rank, self.size, self.device, self.store = rank, size, device, store
        self.timeout = collective_timeout
        self.one_shot: Any = None  # enable_one_shot: small all-reduces over symmetric memory
        self.nccl = device.type == "cuda" and not shared_gpu
        # gloo with CUDA tensors (shared_gpu): through a host copy of our own, since gloo's CUDA path writes the result
        # back from its own thread, outside the forward's inference mode, which refuses that on an inference tensor.
        self.staged = device.type == "cuda" and shared_gpu
        self.control: Any = dist.ProcessGroupGloo(dist.PrefixStore("control", store), rank, size, STARTUP_TIMEOUT)
        compute_store = dist.PrefixStore("compute", store)
        if self.nccl:
            # Backends (gloo, nccl) used directly: torch's stubs type them apart from ProcessGroup, hence Any.
            self.compute: Any = _nccl_group(compute_store, rank, size, device, collective_timeout)
        else:
            self.compute = dist.ProcessGroupGloo(compute_store, rank, size, collective_timeout)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over the ranks, in place (the row-parallel layers' one collective)."""
        opts = dist.AllreduceOptions()
        opts.timeout = self.timeout
        if self.one_shot is not None and self.one_shot.fits(x):
            return self.one_shot(x)
        if self.staged:
            host = x.cpu()
            self.compute.allreduce([host], opts).wait()
            return x.copy_(host)
        self.compute.allreduce([x], opts).wait()
        return x

    def enable_one_shot(self, max_elements: int, dtype: torch.dtype) -> None:
        """Collective (every rank at the same point): all-reduces of up to max_elements of `dtype` from now on through
        the one-shot all-reduce over symmetric memory (EngineConfig.tensor_parallel_all_reduce "symm-mem"); larger
        or other ones NCCL. CUDA (NCCL ranks) only."""
        if not self.nccl:
            raise ValueError("the one-shot all-reduce needs one GPU a rank (NCCL ranks)")
        from stoker.engine.parallel.symm_mem import OneShotAllReduce

        self.one_shot = OneShotAllReduce(self.store, self.rank, self.size, self.device, max_elements, dtype)

    def broadcast_compute(self, x: torch.Tensor) -> torch.Tensor:
        """rank 0's device tensor to every rank (a step's pending token ids), in place."""
        if self.staged:  # rank 0 sends its tensor as it is (an inference tensor, outside the forward here)
            host = _broadcast(self.compute, x.cpu(), self.timeout)
            return x if self.rank == 0 else x.copy_(host)
        return _broadcast(self.compute, x, self.timeout)

    def broadcast_control(self, x: torch.Tensor, timeout: timedelta | None = None) -> torch.Tensor:
        """rank 0's CPU tensor to every rank, in place (within the collective timeout unless given)."""
        return _broadcast(self.control, x, timeout or self.timeout)

    def gather_ints(self, value: int) -> list[int]:
        """Every rank's value (startup agreement), over the control group."""
        slots = torch.zeros(self.size, dtype=torch.int64)
        slots[self.rank] = value
        opts = dist.AllreduceOptions()
        opts.timeout = STARTUP_TIMEOUT
        self.control.allreduce([slots], opts).wait()
        return [int(v) for v in slots]

    def abort(self) -> None:
        """Unblock collectives stuck on a dead peer (NCCL waits on the GPU otherwise; gloo's peers see the
        closed connection by themselves)."""
        abort = getattr(self.compute, "abort", None)
        if self.nccl and abort is not None:
            abort()


def rank_device(device: str, rank: int, shared_gpu: bool = False) -> torch.device:
    """Rank r drives the r-th visible GPU (CUDA_VISIBLE_DEVICES picks the set: two TP=2 workers on a 4-GPU host
    see 0,1 and 2,3), or with shared_gpu the first one, as every rank does; on the CPU every rank shares the host."""
    return torch.device("cuda", 0 if shared_gpu else rank) if device.startswith("cuda") else torch.device("cpu")


def _broadcast(group: Any, x: torch.Tensor, timeout: timedelta) -> torch.Tensor:
    opts = dist.BroadcastOptions()
    opts.rootRank, opts.rootTensor, opts.timeout = 0, 0, timeout
    group.broadcast([x], opts).wait()
    return x


def _nccl_group(store: dist.Store, rank: int, size: int, device: torch.device, timeout: timedelta) -> Any:
    """The NCCL group of the compute collectives (first run on two H200s in session 24: BENCHMARKS.md). The
    NVLink-multicast switches (NCCL_NVLS_ENABLE=0 ...) are in the environment before this runs (launcher)."""
    options = dist.ProcessGroupNCCL.Options()
    options._timeout = timeout
    torch.cuda.set_device(device)
    return dist.ProcessGroupNCCL(store, rank, size, options)
