"""Runs engine.step() on its own thread and hands each step's outputs to the asyncio loop.

The thread sleeps on a condition while the engine has nothing to do (no busy spin), and also while too
many steps' outputs are still unpublished (Redis slow or down): then the engine stops stepping, requests
stop advancing, intake pauses, and memory stays bounded instead of queueing tokens without limit.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import threading
import time
from collections.abc import Callable
from typing import Protocol

from stoker.engine import EngineRequest, EngineStats, RequestOutput, name_os_thread

log = logging.getLogger("stoker.worker.driver")


class EngineLike(Protocol):
    """What the worker needs of LLMEngine (and of the stand-in FakeEngine)."""

    model_name: str
    max_model_len: int

    def add_request(self, request: EngineRequest) -> None: ...

    def abort(self, request_id: str) -> None: ...

    def step(self) -> list[RequestOutput]: ...

    def has_unfinished(self) -> bool: ...

    def stats(self) -> EngineStats: ...


# A step still running this long after the engine reported a failure (EngineDriver.stalled) is stuck on it: NCCL's
# abort ends a collective waiting on a dead rank within seconds (the ranks' watchdog), a one-shot all-reduce never.
FAILED_STEP_GRACE_S = 10.0


class EngineStalled(RuntimeError):
    """One engine step has run past the worker's step_stall_timeout_s: a GPU kernel that never ends (a hung
    device, a tensor-parallel peer gone in the middle of a one-shot all-reduce). The step's thread cannot be
    stopped, so the worker stops without it and the process exits (worker/main.py)."""


# Receives (outputs, engine stats after the step, step_end_epoch_ms) on the loop thread. Empty outputs
# with driver.fatal set mean the engine broke.
OutputSink = Callable[[list[RequestOutput], EngineStats | None, float], None]


class EngineDriver:
    def __init__(self, engine: EngineLike, loop: asyncio.AbstractEventLoop, sink: OutputSink,
                 max_unpublished_steps: int = 4, first_token_wait_s: float = 0.0):
        self.engine = engine
        self._first_token_wait_s = first_token_wait_s  # see _let_first_tokens_out
        self._loop = loop
        self._sink = sink
        self._max_unpublished = max_unpublished_steps
        self._cond = threading.Condition()
        self._unpublished = 0  # steps handed to the loop and not yet acknowledged by the publisher
        self._stopping = False
        self._thread: threading.Thread | None = None
        self.fatal: BaseException | None = None  # set when step() itself raised (or stalled): the engine is broken
        self.step_started: float | None = None  # time.monotonic() when the step in progress began; None between
        # (start, end) in time.monotonic() when the whole process did not run (note_pause): not a step's time
        self._pauses: collections.deque[tuple[float, float]] = collections.deque(maxlen=32)
        self.steps = 0
        self.busy_s = 0.0  # time spent inside step(), for metrics
        self.last_stats: EngineStats | None = None
        # Told of every abort before the engine is: a request still compiling its grammar (worker.grammar_gate)
        # is not in the engine yet, and must learn of its cancel there.
        self.on_abort: Callable[[str], None] | None = None
        # Overlapped steps (engine.async_scheduling): step() returns once its forward is launched, so a caller
        # may wait for that launch (add_request's future) without waiting for the GPU.
        self._overlapped = getattr(engine, "async_scheduling", False) is True
        self._idle = False  # the thread sleeps in _run's wait (no work, or the publisher behind)
        self._step_waiters: list[asyncio.Future[None]] = []  # resolved when the current or next step() returns
        # Whether a step's outputs must be searched for first tokens (_let_first_tokens_out)
        self._watch_first_tokens = self._overlapped and first_token_wait_s > 0
        set_waker = getattr(engine, "set_waker", None)  # a ModelSet wakes us when a model loads or idles out
        if set_waker is not None:
            set_waker(self.notify)

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="stoker-engine", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)
        self._release_waiters()

    def stalled(self, limit_s: float, failed_grace_s: float = FAILED_STEP_GRACE_S,
                load_limit_s: float = 0.0) -> EngineStalled | None:
        """The step in progress has run longer than limit_s, or longer than failed_grace_s while the engine says
        it has failed (LLMEngine.failure: a tensor-parallel rank died; a step that the failure does not end by
        itself by then never ends), or a model load (a ModelSet's reload) has run longer than load_limit_s.
        A ModelSet's step waiting for another model's exclusive load is not running yet: its time counts from
        when it got the GPU (step_watch). Limits <= 0 are off. Called on the loop's watchdog (worker.service):
        marks the engine broken (aborts and further steps stop reaching it) and returns the error; else None."""
        started = self.step_started
        now = time.monotonic()
        watch = getattr(self.engine, "step_watch", None)
        on_gpu_since, load_since = watch() if callable(watch) else (started, None)
        if load_limit_s > 0 and load_since is not None and (load_s := self._ran(load_since, now)) > load_limit_s:
            return self._declare(EngineStalled(
                f"a model load has run for {load_s:.0f} s (model_load_timeout_s {load_limit_s:g}): "
                "the GPU or the model's storage is not finishing it"))
        if started is None or limit_s <= 0 or on_gpu_since is None:  # no step, off, or waiting for a load
            return None
        running_s = self._ran(max(started, on_gpu_since), now)
        failure = getattr(self.engine, "failure", None)
        if failure and running_s > failed_grace_s:
            exc = EngineStalled(f"an engine step has run for {running_s:.0f} s and the engine has failed: {failure}")
        elif running_s > limit_s:
            exc = EngineStalled(f"an engine step has run for {running_s:.0f} s (step_stall_timeout_s {limit_s:g}): "
                                "the GPU or a tensor-parallel peer is not finishing it")
        else:
            return None
        return self._declare(exc)

    def note_pause(self, start: float, end: float) -> None:
        """The whole process did not run from start to end (time.monotonic()): SIGSTOP, a frozen VM or cgroup.
        The watchdog sees it as a gap in its own ticks; stalled() does not count it as a step's (or a load's)
        time, so a worker resumed after a pause longer than the limit goes on instead of exiting."""
        self._pauses.append((start, end))

    def _ran(self, since: float, now: float) -> float:
        """Seconds from since to now, less the pauses noted within them."""
        paused = sum(max(0.0, min(end, now) - max(start, since)) for start, end in list(self._pauses))
        return now - since - paused

    def _declare(self, exc: EngineStalled) -> EngineStalled:
        if self.fatal is None:
            self.fatal = exc
        return exc

    def notify(self) -> None:
        """New work (a request added or aborted): wake the thread if it sleeps."""
        with self._cond:
            self._cond.notify_all()

    def published(self) -> None:
        """The loop has safely published one step's outputs (called on the loop thread)."""
        with self._cond:
            self._unpublished -= 1
            self._cond.notify_all()

    def add_request(self, request: EngineRequest) -> asyncio.Future[None] | None:
        """Into the engine's inbox, and wake the thread. When that wakes an idle engine whose step() returns at
        its launch (overlapped steps), a future (on the loop) resolved when the step taking the request in has
        launched; else None. Raises EngineRequestError (validated synchronously)."""
        self.engine.add_request(request)
        with self._cond:
            waiter = None
            if self._overlapped and self._idle and not self._stopping:
                # Registered before the thread can step (it needs this lock to leave its wait): the step it
                # runs next takes the request in, and its return resolves this future.
                waiter = self._loop.create_future()
                self._step_waiters.append(waiter)
            self._cond.notify_all()
        return waiter

    def abort(self, request_id: str) -> None:
        if self.on_abort is not None:
            self.on_abort(request_id)
        self.engine.abort(request_id)
        self.notify()

    def _run(self) -> None:
        # The loop: wait for work and for the publisher to keep up, step, hand the outputs over.
        name_os_thread("stoker-engine")
        engine = self.engine
        while True:
            with self._cond:
                while not self._stopping and (
                    self._unpublished >= self._max_unpublished or not engine.has_unfinished()
                ):
                    self._idle = True
                    self._cond.wait()
                self._idle = False
                if self._stopping:
                    return
            started = time.perf_counter()
            self.step_started = time.monotonic()
            try:
                outputs = engine.step()
                # Read here, on the engine's thread, so the loop never touches the engine. Inside the try:
                # a raise here must stop the worker too, not end this thread without a word.
                stats = engine.stats()
            except BaseException as exc:  # the engine is broken, not one request: the worker must stop
                log.exception("event=engine_step_failed")
                self.fatal = exc
                with contextlib.suppress(RuntimeError):  # the loop may be gone (a stalled step came back late)
                    self._loop.call_soon_threadsafe(self._sink, [], None, time.time() * 1000)
                self._release_waiters()
                return
            finally:
                self.step_started = None
            if self.fatal is not None:  # declared stalled (stalled()) while it ran: its outputs go nowhere
                return
            self.busy_s += time.perf_counter() - started
            self.steps += 1
            self.last_stats = stats
            if self._step_waiters:  # only after a wake-up from idle: a lone job's first step
                self._release_waiters()
            if not outputs:
                continue
            first = self._watch_first_tokens and _has_first_token(outputs)
            handed = self._hand_over(outputs, stats, time.time() * 1000)
            if handed is None:  # the loop closed under us: shutting down
                return
            if first and self._first_token_wait_s > 0:
                self._let_first_tokens_out(handed)

    def _hand_over(self, outputs: list[RequestOutput], stats: EngineStats | None, step_ms: float) -> int | None:
        """Outputs to the loop's sink, counted as unpublished until it acknowledges them (published()).
        -> the unpublished count with them, or None when the loop has closed."""
        with self._cond:
            self._unpublished += 1
            handed = self._unpublished
        try:
            self._loop.call_soon_threadsafe(self._sink, outputs, stats, step_ms)
        except RuntimeError:
            return None
        return handed

    def _let_first_tokens_out(self, handed: int) -> None:
        """Wait (at most first_token_wait_s) until the loop has published the step just handed over, which
        carries a request's first token: else this thread's next step (schedule, prepare, launch) holds the GIL
        the loop needs to publish it, and the first event waits for that host work. With overlapped steps the
        GPU meanwhile runs the step launched before these outputs were read, so the wait costs it nothing
        while that step outlasts it (a decode step of the 8B model: ~4 ms on the H200)."""
        with self._cond:  # published() brings the count below what it was once these outputs were counted
            self._cond.wait_for(lambda: self._unpublished < handed or self._stopping, self._first_token_wait_s)

    def _release_waiters(self) -> None:
        """Resolve the futures add_request handed out (from any thread; the loop may be closed: shutting down)."""
        with self._cond:
            waiters, self._step_waiters = self._step_waiters, []
        if waiters:
            with contextlib.suppress(RuntimeError):
                self._loop.call_soon_threadsafe(_resolve, waiters)


def _has_first_token(outputs: list[RequestOutput]) -> bool:
    """A request's first tokens are among them (all its tokens so far are new in this step)."""
    return any(out.new_token_ids and out.completion_tokens == len(out.new_token_ids) for out in outputs)


def _resolve(waiters: list[asyncio.Future[None]]) -> None:
    for waiter in waiters:
        if not waiter.done():
            waiter.set_result(None)
