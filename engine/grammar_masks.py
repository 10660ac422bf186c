"""A step's grammar masks, from the matchers to the device: filled in place into pinned host memory, uploaded
with the constrained rows' indices in one copy.

Why: at batch 1,024 over a 128K vocabulary the masks are 16 MB a step. Allocating, zeroing and then pinning a
fresh tensor costs the engine thread two extra passes over it (and the pinned allocation) every step; here
llguidance writes straight into a reused pinned buffer (it writes every word of each row, so nothing needs
zeroing) and a single non-blocking copy carries the masks and the row indices. Two buffers, each guarded by an
event recorded after its copy: a buffer is rewritten only once its previous copy has left it (the engine
normally finishes a step before the next one builds its masks, so the wait is already over; the fallback that
samples row by row builds several batches a step, and that would overwrite a copy in flight without it).
"""

from __future__ import annotations

from typing import Any

import torch


class MaskStaging:
    """Pinned staging for one engine's masks (used from the thread that steps the engine)."""

    def __init__(self) -> None:
        self._buffers: list[torch.Tensor | None] = [None, None]
        self._copied: list[Any] = [None, None]  # torch.cuda.Event per buffer, recorded after its copy
        self._turn = 0

    def masks(self, compiler: Any, matchers: list[Any], rows: list[int] | None, vocab_size: int,
              device: torch.device, families: list[int] | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """-> (bitmask [R, ceil(V/32)] int32, rows [R] int64 or None) on device, V = vocab_size (the logits'
        width); row r of the bitmask holds matchers[r]'s allowed tokens, for logits row rows[r] (rows None:
        every logits row, in order); families: the matchers' (GrammarCompiler.fill_bitmasks)."""
        words = (vocab_size + 31) // 32
        count = len(matchers)
        index = 0 if rows is None else count
        if device.type != "cuda":  # nothing to stage: fill the tensor the sampler reads
            bitmask = torch.empty(count, words, dtype=torch.int32)
            compiler.fill_bitmasks(matchers, bitmask, families)
            return bitmask, None if rows is None else torch.tensor(rows, dtype=torch.int64)
        host = self._take(count * words + index)
        bitmask = host[: count * words].view(count, words)
        compiler.fill_bitmasks(matchers, bitmask, families)
        if rows is not None:
            host[count * words :] = torch.as_tensor(rows, dtype=torch.int32)
        on_device = host.to(device, non_blocking=True)
        self._copied[self._turn] = torch.cuda.Event(blocking=True)  # blocking: a wait sleeps, never spins
        self._copied[self._turn].record()
        row_index = None if rows is None else on_device[count * words :].long()
        return on_device[: count * words].view(count, words), row_index

    def _take(self, size: int) -> torch.Tensor:
        """The next buffer, at least size int32 long, once its last copy is done."""
        self._turn ^= 1
        copied = self._copied[self._turn]
        if copied is not None:
            copied.synchronize()
        buffer = self._buffers[self._turn]
        if buffer is None or buffer.numel() < size:
            buffer = torch.empty(size + size // 4, dtype=torch.int32, pin_memory=True)  # room to grow
            self._buffers[self._turn] = buffer
        return buffer[:size]
