"""Rank 0 -> ranks > 0, once per step: a fixed-size int64 header, then the step's two packed host arrays
(engine.batch.PackedStep) over the control group, then (only when some input ids are pending on the device)
the previous step's sampled ids over the compute group. Three or four small broadcasts: a decode step of 64
sequences ships about 3 KB."""

from __future__ import annotations

from datetime import timedelta

import numpy as np
import torch
from stoker.engine.batch import PackedStep
from stoker.engine.parallel.comm import IDLE_WAIT, RankComm

OP_STEP, OP_STOP = 1, 2
_HEADER_LEN = 17  # op, len64, len32, 7 offsets, tokens, samples, seqs, width, decode_only, num_prev, num_decodes


def ship(comm: RankComm, packed: PackedStep, prev_tokens: torch.Tensor | None) -> None:
    header = [OP_STEP, len(packed.host64), len(packed.host32), *packed.offsets, packed.num_tokens,
              packed.num_samples, packed.num_seqs, packed.width, int(packed.decode_only), packed.num_prev,
              packed.num_decodes]
    comm.broadcast_control(torch.tensor(header, dtype=torch.int64))
    comm.broadcast_control(torch.from_numpy(packed.host64))
    comm.broadcast_control(torch.from_numpy(packed.host32))
    if packed.num_prev:
        assert prev_tokens is not None and prev_tokens.shape[0] == packed.num_prev
        comm.broadcast_compute(prev_tokens.contiguous())


def ship_stop(comm: RankComm, timeout: timedelta) -> None:
    header = torch.zeros(_HEADER_LEN, dtype=torch.int64)
    header[0] = OP_STOP
    comm.broadcast_control(header, timeout)


def receive(comm: RankComm) -> tuple[PackedStep, torch.Tensor | None] | None:
    """The next step's input (None: rank 0 closed the engine). Waits as long as the engine idles."""
    header = comm.broadcast_control(torch.zeros(_HEADER_LEN, dtype=torch.int64), IDLE_WAIT).tolist()
    if header[0] == OP_STOP:
        return None
    if header[0] != OP_STEP:
        raise RuntimeError(f"tensor-parallel step header with unknown op {header[0]} (ranks out of step?)")
    host64 = comm.broadcast_control(torch.zeros(header[1], dtype=torch.int64)).numpy()
    host32 = comm.broadcast_control(torch.zeros(header[2], dtype=torch.int32)).numpy()
    tokens, samples, seqs, width, decode_only, num_prev, num_decodes = header[10:17]
    packed = PackedStep(np.asarray(host64), np.asarray(host32), tuple(header[3:10]),
                        tokens, samples, seqs, width, bool(decode_only), num_prev, num_decodes)
    prev = None
    if num_prev:
        prev = comm.broadcast_compute(torch.zeros(num_prev, dtype=torch.int64, device=comm.device))
    return packed, prev
