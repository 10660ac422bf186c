"""One-shot all-reduce over symmetric memory, for the small messages of batch-1 decode (issue 17, item 3).

NOT RUN: it needs two GPUs of one host and none was lent. Not wired into RankComm.all_reduce yet: the issue asks
to measure it against the NCCL all-reduce captured in the graph and keep the faster, so the choice (and the
message size below which this wins) is for the first multi-GPU run; tests/test_tensor_parallel.py has its
correctness test (marked gpu, multi_gpu).

Each rank copies its partial sum into its own slot of a buffer every rank has mapped (torch's symm_mem, CUDA
IPC), then one kernel per rank reads all peers' slots and adds them: one launch, no NCCL protocol, no
NVLink multicast (multimem) instructions, which stay off (TORCH_SYMM_MEM_DISABLE_MULTICAST=1).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._symmetric_memory as symm_mem
from torch._C._distributed_c10d import _SymmetricMemory
from torch.distributed.distributed_c10d import GroupName


class OneShotAllReduce:
    def __init__(self, store: dist.Store, rank: int, size: int, device: torch.device, max_elements: int,
                 dtype: torch.dtype, name: str = "stoker-tp"):
        """Collective: every rank builds it at the same point, with the same max_elements and dtype."""
        # Registered by name, not through torch.distributed's global world (our groups are not in it).
        _SymmetricMemory.set_group_info(name, rank, size, dist.PrefixStore(f"symm_mem/{name}", store))
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
