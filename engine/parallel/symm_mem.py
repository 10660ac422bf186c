"""One-shot all-reduce over symmetric memory, for the small messages of batch-1 decode (issue 17, item 3).

Used for the forward's all-reduces of up to 16 tokens (the fused decode steps) when EngineConfig
.tensor_parallel_all_reduce is "symm-mem" (RankComm.enable_one_shot); NCCL otherwise. Its correctness test and
ops/bench_all_reduce.py (against NCCL in a CUDA graph) ran first on the two-GPU machine in session 24.

Each rank copies its partial sum into its own slot of a buffer every rank has mapped (torch's symm_mem, CUDA
IPC), then one kernel per rank reads all peers' slots and adds them: one launch, no NCCL protocol, no
NVLink multicast (multimem) instructions, which stay off (TORCH_SYMM_MEM_DISABLE_MULTICAST=1).
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist
import torch.distributed._symmetric_memory as symm_mem
from torch._C._distributed_c10d import _register_process_group, _resolve_process_group, _SymmetricMemory
from torch.distributed.distributed_c10d import GroupName


class OneShotAllReduce:
    def __init__(self, store: dist.Store, rank: int, size: int, device: torch.device, max_elements: int,
                 dtype: torch.dtype, name: str = "stoker-tp"):
        """Collective: every rank builds it at the same point, with the same max_elements and dtype."""
        # Registered by name, not through torch.distributed's global world (our groups are not in it): the store
        # the handles are exchanged over, and (torch 2.11's rendezvous resolves the name to a process group: "Could
        # not resolve the process group registered under the name", the first two-GPU run) a group of that name.
        prefixed = dist.PrefixStore(f"symm_mem/{name}", store)
        _SymmetricMemory.set_group_info(name, rank, size, prefixed)
        self.group = _named_group(name, prefixed, rank, size)
        self.name, self.dtype = name, dtype
        self.buffer = symm_mem.empty(max_elements, dtype=dtype, device=device)
        symm_mem.rendezvous(self.buffer, GroupName(name))

    def fits(self, x: torch.Tensor) -> bool:
        return x.dtype == self.dtype and x.numel() <= self.buffer.numel() and x.is_contiguous()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """Sum x over the ranks, in place (x: contiguous, fits())."""
        staged = self.buffer[: x.numel()]
        staged.copy_(x.view(-1))
        torch.ops.symm_mem.one_shot_all_reduce_out(staged, "sum", self.name, x.view(-1))
        return x


def _named_group(name: str, store: dist.Store, rank: int, size: int) -> dist.ProcessGroup:
    """A process group registered under `name` (a gloo backend on the store: what the name resolves to; the
    symmetric memory's own exchange and signals do the work), or the one already registered under it."""
    group_name = GroupName(name)
    try:
        return _resolve_process_group(group_name)
    except (RuntimeError, ValueError):
        pass
    group = dist.ProcessGroup(store, rank, size)
    backend = dist.ProcessGroupGloo(dist.PrefixStore("gloo", store), rank, size, timedelta(minutes=5))
    group._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO, backend)
    group._set_default_backend(dist.ProcessGroup.BackendType.GLOO)
    group._set_group_name(group_name)
    _register_process_group(group_name, group)
    return group
