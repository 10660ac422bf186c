"""A step's grammar masks, from the matchers to the device: filled in place into pinned host memory, uploaded
with the constrained rows' indices in one copy.

Why: at batch 1,024 over a 128K vocabulary the masks are 16 MB a step. Allocating, zeroing and then pinning a
fresh tensor costs the engine thread two extra passes over it (and the pinned allocation) every step; here
llguidance writes straight into a reused pinned buffer (it writes every word of each row, so nothing needs
zeroing) and a single non-blocking copy carries the masks and the row indices. Two buffers, each guarded by an
event recorded after its copy: a buffer is rewritten only once its previous copy has left it (the engine
normally finishes a step before the next one builds its masks, so the wait is already over; the fallback that
samples row by row builds several batches a step, and that would overwrite a copy in flight without it).

Prefetch: the engine queues a step's fill (prefetch) behind the matchers' advance by the step before's tokens,
both on the compiler's grammar thread, and goes on with that step's detokenizing and outputs; the build that follows
(masks, same matchers and rows) waits for it and uploads. Filled inline on the engine thread, the fill's wall
(15.5 ms at batch 1,024 on the H200, 15:31 UTC) added to the thread's ~14 ms of other work a step, and the sum
outran the 30.7 ms forward. llguidance fills without the GIL, so the engine thread runs meanwhile.
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(slots=True)
class _Prefetch:
    """A fill started ahead of its build: for these matchers (kept alive here, so their ids stay theirs) and
    rows, into bitmask (a view of a staging buffer on a GPU)."""

    key: tuple[Any, ...]  # (matcher ids, rows, words): what the build must ask for to take it
    matchers: list[Any]
    bitmask: torch.Tensor
    host: torch.Tensor | None  # the whole staging slice (masks then row indices); None on the CPU
    done: Future[None]


class MaskStaging:
    """Pinned staging for one engine's masks (used from the thread that steps the engine)."""

    def __init__(self) -> None:
        self._buffers: list[torch.Tensor | None] = [None, None]
        self._copied: list[Any] = [None, None]  # torch.cuda.Event per buffer, recorded after its copy
        self._turn = 0
        self._pending: _Prefetch | None = None

    def prefetch(self, compiler: Any, matchers: list[Any], rows: list[int] | None, vocab_size: int,
                 device: torch.device, families: list[int] | None = None) -> None:
        """Start filling what masks(same arguments) will return, on the compiler's grammar thread (after the jobs
        queued there before: the engine's advance of these matchers); masks() waits for it. Nothing else may
        touch the matchers until then."""
        self.wait_fill()  # a fill not taken (its sampling failed) still owns its buffer and its matchers
        words, count = (vocab_size + 31) // 32, len(matchers)
        host = None
        if device.type == "cuda":
            host = self._take(count * words + (0 if rows is None else count))
            bitmask = host[: count * words].view(count, words)
        else:
            bitmask = torch.empty(count, words, dtype=torch.int32)
        done = compiler.submit(compiler.fill_bitmasks, matchers, bitmask, families)  # after the advance queued
        self._pending = _Prefetch(_key(matchers, rows, words), matchers, bitmask, host, done)

    def wait_fill(self) -> _Prefetch | None:
        """The prefetched fill, once done (None when none is pending); its error, if it failed, raises here."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.done.result()
        return pending

    def masks(self, compiler: Any, matchers: list[Any], rows: list[int] | None, vocab_size: int,
              device: torch.device, families: list[int] | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """-> (bitmask [R, ceil(V/32)] int32, rows [R] int64 or None) on device, V = vocab_size (the logits'
        width); row r of the bitmask holds matchers[r]'s allowed tokens, for logits row rows[r] (rows None:
        every logits row, in order); families: the matchers' (GrammarCompiler.fill_bitmasks)."""
        words = (vocab_size + 31) // 32
        count = len(matchers)
        index = 0 if rows is None else count
        pending = self.wait_fill()
        if pending is not None and pending.key != _key(matchers, rows, words):
            pending = None  # prefetched for other rows (e.g. the row-by-row fallback): filled again below
        if device.type != "cuda":  # nothing to stage: fill the tensor the sampler reads
            if pending is not None:
                bitmask = pending.bitmask
            else:
                bitmask = torch.empty(count, words, dtype=torch.int32)
                compiler.fill_bitmasks(matchers, bitmask, families)
            return bitmask, None if rows is None else torch.tensor(rows, dtype=torch.int64)
        if pending is not None and pending.host is not None:
            host = pending.host
        else:
            host = self._take(count * words + index)
            compiler.fill_bitmasks(matchers, host[: count * words].view(count, words), families)
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


def _key(matchers: list[Any], rows: list[int] | None, words: int) -> tuple[Any, ...]:
    return tuple(map(id, matchers)), None if rows is None else tuple(rows), words
