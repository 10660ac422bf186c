"""A constrained decode step's timeline: where the engine thread's time goes, and where the GPU waits for it.

Used by ops/bench_guided.py --timeline. Host side: wall ms per step inside each wrapped engine call (the engine
thread's own phases; nested ones are inside their parent: `token wait`, `advance`, `detokenize`, `update` inside
`finish`; `build` inside `sample launch`, `fill` inside `build`), and `other` = the step's wall less its top-level
phases (the inbox, output objects, the bench loop). With the engine's grammar_overlap, `advance` and `fill` run on
the grammar thread (their wall there, beside the engine thread's) and the engine thread's share is `advance wait`
and `fill wait`. GPU side (CUDA events recorded at the forward's and the
sampler's entry and exit): the forward's GPU time, the GPU idle between the forward's end and the sampler's
first kernel (`gpu wait for masks`: the host had not launched the sampling yet), the sampling's own GPU time
(mask upload, bitmask op, argmax / draw, token copies), and the GPU idle from there to the next forward (`gpu
wait for next forward`). Medians over the timed steps; the CPU dry run reports the host side only.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

# (label, top-level): top-level phases are disjoint parts of step(); the others nest inside one of them
HOST_PHASES: list[tuple[str, bool]] = [
    ("schedule", True), ("prepare", True), ("forward launch", True), ("finish", True), ("token wait", False),
    ("advance", False), ("advance wait", False), ("detokenize", False), ("update", False), ("sample launch", True), ("build", False),
    ("fill", False), ("fill wait", False),
]
GPU_PHASES = ["gpu forward", "gpu wait for masks", "gpu sampling", "gpu wait for next forward"]


class StepTimeline:
    """Install on an engine (after any other wrapper of the same calls), call step() through it, close()."""

    def __init__(self, eng: Any, cuda: bool):
        from stoker.engine import grammar, grammar_masks, model_runner, sampler

        self.cuda = cuda
        self.steps: list[dict[str, float]] = []
        self._now: dict[str, float] = {}
        self._events: list[list[Any]] = []  # per step: [forward in, forward out, sample in, sample out]
        self._restore: list[tuple[Any, str, Any, bool]] = []
        runner = eng.runner
        self._wrap(eng.scheduler, "schedule", "schedule")
        self._wrap(runner, "prepare", "prepare")
        self._wrap(runner, "forward", "forward launch", gpu=(0, 1))
        self._wrap(eng, "_finish_step", "finish")
        self._wrap(model_runner.PendingSample, "wait", "token wait", cls=True)
        self._wrap(eng.outputs, "detokenize", "detokenize")
        if hasattr(eng, "_wait_grammars"):  # the engine thread's wait for the grammar thread's advance
            self._wrap(eng, "_wait_grammars", "advance wait")
        self._wrap(eng.scheduler, "update_from_output", "update")
        self._wrap(runner, "sample_async", "sample launch", gpu=(2, 3))
        self._wrap(grammar.GrammarCompiler, "fill_bitmasks", "fill", cls=True)
        for name in ("advance", "advance_all"):  # the serial per-row call and the batched one, whichever exists
            if name in vars(grammar.GrammarState) or name in vars(grammar.GrammarCompiler):
                owner = grammar.GrammarState if name in vars(grammar.GrammarState) else grammar.GrammarCompiler
                self._wrap(owner, name, "advance", cls=True)
        if "wait_fill" in vars(grammar_masks.MaskStaging):  # the prefetched fill's wait (engine thread)
            self._wrap(grammar_masks.MaskStaging, "wait_fill", "fill wait", cls=True)
        build = sampler.SamplingBatch.__dict__["build"]
        timed = self._timed(build.__func__, "build", None)
        sampler.SamplingBatch.build = classmethod(timed)  # type: ignore[method-assign,assignment]
        self._restore.append((sampler.SamplingBatch, "build", build, True))

    # ---- wrapping ----------------------------------------------------------------------------------------
    def _timed(self, fn: Callable[..., Any], label: str, gpu: tuple[int, int] | None) -> Callable[..., Any]:
        def run(*args: Any, **kwargs: Any) -> Any:
            if gpu is not None and self.cuda:
                self._record(gpu[0])
            started = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                # only the engine thread's time counts: a fill on a prefetch thread is not the step's wall
                self._now[label] = self._now.get(label, 0.0) + (time.perf_counter() - started) * 1e3
                if gpu is not None and self.cuda:
                    self._record(gpu[1])

        return run

    def _wrap(self, owner: Any, attr: str, label: str, gpu: tuple[int, int] | None = None, cls: bool = False) -> None:
        own = cls or attr in vars(owner)
        original = owner.__dict__[attr] if own else getattr(owner, attr)
        setattr(owner, attr, self._timed(original, label, gpu))
        self._restore.append((owner, attr, original, own))

    def _record(self, slot: int) -> None:
        if slot == 0:
            self._events.append([None] * 4)
        if not self._events:
            return
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        self._events[-1][slot] = event

    # ---- use ---------------------------------------------------------------------------------------------
    def step(self, fn: Callable[[], Any]) -> Any:
        """fn() (one engine step and the caller's handling of its outputs), its phases recorded."""
        self._now = {}
        started = time.perf_counter()
        try:
            return fn()
        finally:
            wall = (time.perf_counter() - started) * 1e3
            top = sum(v for label, is_top in HOST_PHASES if is_top for v in [self._now.get(label, 0.0)])
            self.steps.append(dict(self._now, step=wall, other=wall - top))

    def close(self) -> dict[str, Any]:
        """Unwrap; -> {"host_ms": {phase: median}, "gpu_ms": {phase: median}} over the steps recorded, and
        "per_step": each step's own host and GPU phases (ops/step_tail.py lists the slowest steps' ones)."""
        for owner, attr, original, own in reversed(self._restore):
            if own:  # the attribute was the owner's own (a class's function, an earlier instance wrapper)
                setattr(owner, attr, original)
            else:  # a bound method read through the instance: drop the instance's wrapper
                delattr(owner, attr)
        labels = ["step"] + [label for label, _ in HOST_PHASES] + ["other"]
        host = {label: statistics.median(s.get(label, 0.0) for s in self.steps) for label in labels if self.steps}
        gpu = self._gpu()
        per_step = [dict(s) for s in self.steps]
        for name, values in gpu.items():  # the GPU rows are the steps' own, in order (the last has no next)
            for row, value in zip(per_step, values, strict=False):
                row[name] = value
        return {"host_ms": host, "gpu_ms": {name: statistics.median(v) for name, v in gpu.items() if v},
                "per_step": per_step}

    def _gpu(self) -> dict[str, list[float]]:
        """-> each GPU phase's ms per step, in step order."""
        if not self.cuda:
            return {}
        torch.cuda.synchronize()
        full = [e for e in self._events if all(x is not None for x in e)]
        rows: dict[str, list[float]] = {name: [] for name in GPU_PHASES}
        for k, (f0, f1, s0, s1) in enumerate(full):
            rows["gpu forward"].append(f0.elapsed_time(f1))
            rows["gpu wait for masks"].append(f1.elapsed_time(s0))
            rows["gpu sampling"].append(s0.elapsed_time(s1))
            if k + 1 < len(full):
                rows["gpu wait for next forward"].append(s1.elapsed_time(full[k + 1][0]))
        return rows


def format_timeline(tag: str, timeline: dict[str, Any]) -> str:
    """One line per case: the host phases, then the GPU ones."""
    host = " ".join(f"{k}={v:.2f}" for k, v in timeline.get("host_ms", {}).items())
    gpu = " ".join(f"{k.removeprefix('gpu ')}={v:.2f}" for k, v in timeline.get("gpu_ms", {}).items())
    return f"# timeline {tag} (median ms per step): host: {host}" + (f" | GPU: {gpu}" if gpu else "")
