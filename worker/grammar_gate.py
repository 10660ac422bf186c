"""Compiles a job's `response_format` off the worker's event loop, bounded in time and in threads.

Why: the engine compiles a grammar inside add_request, and the worker calls add_request on its event loop,
which also publishes every request's tokens. A schema seen before is a cache hit (a matcher copy, tens of
us), but a new one costs ~1-10 ms and a hostile one within the contract's 64 KiB far more (ops/bench_grammar.py,
2-core VM: 2,000 optional properties ~0.9 s, 4,500 ~3.3 s on the demo tokenizer). llguidance drops the GIL
while it builds a matcher (the bench's `loop gap` column: a 1 ms ticker thread waited at most ~25 ms during a
3 s compile), so a thread pool keeps the loop going.

How, for one request (all on the loop but the compile itself):
  needs_compile   no response_format, or its grammar cached in the engine: no (add_request on the loop, as
                  before; a cached spec never touches the pool). A spec that timed out before: yes, and it
                  fails at once without a thread.
  start           a task waits for a free compile thread (at most `threads` compiles run; the rest wait
                  here, and the worker pauses its intake while any wait: the normal backpressure), runs
                  engine.prepare_grammar on it, and waits for it up to timeout_s;
  outcome         the worker's callback gets `ok` (add the request now: a cache hit), `error` (the
                  compiler's reason, or "took too long"), or `cancelled` (abort() was called meanwhile: a
                  cancel, a lost claim, a shutdown; the worker decides which by the request's state).
A compile past its timeout cannot be stopped (llguidance has no cancel); its thread runs on until done and
only then frees its slot, and its result is never used for that spec while the spec is remembered as timed
out. llguidance's own limits (engine.grammar) bound how long that can be.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from stoker.engine import EngineRequest, EngineRequestError, name_os_thread

log = logging.getLogger("stoker.worker.grammar")
_TIMED_OUT_KEPT = 1024  # distinct specs remembered as too slow (a flood of one hostile schema costs one thread)


class Outcome(enum.Enum):
    OK = "ok"
    ERROR = "error"  # the response_format's fault: `invalid_response_format`
    FAILED = "failed"  # ours (a bug, the engine refusing): `internal`
    CANCELLED = "cancelled"


@dataclass(frozen=True, slots=True)
class CompileResult:
    outcome: Outcome
    message: str = ""  # with ERROR or FAILED: what went wrong, for the request's error event


OnCompiled = Callable[[CompileResult], None]


class GrammarGate:
    """Runs the grammar compiles the event loop must not. Use from the loop thread only (but the compile)."""

    def __init__(self, engine: Any, threads: int, timeout_s: float):
        self._engine = engine
        self._timeout_s = timeout_s
        self._threads = threads
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="stoker-compile", initializer=name_os_thread,
                                        initargs=("stoker-compile",))
        self._free = threads  # compile threads not running a compile (a timed-out one still holds its thread)
        self._slot_freed = asyncio.Event()
        self._aborts: dict[str, asyncio.Event] = {}  # request id -> set by abort(), for each compile underway
        self._tasks: set[asyncio.Task[None]] = set()
        self._timed_out: OrderedDict[tuple[str, str], str] = OrderedDict()
        self.offloaded = 0  # compiles handed to a thread (metrics, tests)
        self.waiting = 0  # requests waiting for a free thread

    def needs_compile(self, request: EngineRequest) -> bool:
        """True when adding request would compile a grammar on the caller's thread."""
        guided = request.params.guided
        if guided is None:
            return False
        if (guided.kind, guided.spec) in self._timed_out:
            return True
        ready = getattr(self._engine, "grammar_ready", None)  # an engine without grammars (the stand-in)
        return ready is not None and not ready(request)

    def start(self, request: EngineRequest, on_compiled: OnCompiled) -> None:
        """Compile request's grammar off the loop; on_compiled(result) runs on the loop once it is settled
        (never when close() cancelled it first)."""
        aborted = asyncio.Event()
        self._aborts[request.request_id] = aborted
        task = asyncio.create_task(self._run(request, aborted, on_compiled), name=f"grammar:{request.request_id}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def abort(self, request_id: str) -> None:
        """The request was cancelled, or is no longer ours: stop waiting for its compile."""
        aborted = self._aborts.get(request_id)
        if aborted is not None:
            aborted.set()

    def compiling(self, request_id: str) -> bool:
        return request_id in self._aborts

    async def close(self) -> None:
        """Cancel the waits (their callbacks never run) and let the threads finish on their own."""
        for task in list(self._tasks):
            task.cancel()
        for task in list(self._tasks):
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._pool.shutdown(wait=False, cancel_futures=True)

    async def _run(self, request: EngineRequest, aborted: asyncio.Event, on_compiled: OnCompiled) -> None:
        try:
            result = await self._settle(request, aborted)
        except Exception as exc:  # noqa: BLE001 -- the request must still get its answer
            log.exception("event=grammar_compile_failed request_id=%s", request.request_id)
            result = CompileResult(Outcome.FAILED, f"the worker failed to compile response_format: "
                                                   f"{type(exc).__name__}: {exc}")
        finally:
            if self._aborts.get(request.request_id) is aborted:  # a later attempt of the id may have its own
                del self._aborts[request.request_id]
        on_compiled(result)

    async def _settle(self, request: EngineRequest, aborted: asyncio.Event) -> CompileResult:
        guided = request.params.guided
        assert guided is not None
        key = (guided.kind, guided.spec)
        if key in self._timed_out:  # too slow before: fail without spending a thread on it again
            return self._timeout_result(request, key)
        abort_wait = asyncio.ensure_future(aborted.wait())
        try:
            if not await self._take_thread(aborted, abort_wait):
                return CompileResult(Outcome.CANCELLED)
            return await self._compile(request, key, aborted, abort_wait)
        finally:
            abort_wait.cancel()

    async def _take_thread(self, aborted: asyncio.Event, abort_wait: asyncio.Future[Any]) -> bool:
        """Wait for a free compile thread (False: aborted meanwhile)."""
        self.waiting += 1
        try:
            while self._free == 0:
                self._slot_freed.clear()
                freed = asyncio.ensure_future(self._slot_freed.wait())
                await asyncio.wait({freed, abort_wait}, return_when=asyncio.FIRST_COMPLETED)
                freed.cancel()
                if aborted.is_set():
                    return False
        finally:
            self.waiting -= 1
        if aborted.is_set():
            return False
        self._free -= 1
        return True

    async def _compile(self, request: EngineRequest, key: tuple[str, str], aborted: asyncio.Event,
                       abort_wait: asyncio.Future[Any]) -> CompileResult:
        loop = asyncio.get_running_loop()
        future = loop.run_in_executor(self._pool, self._engine.prepare_grammar, request)
        future.add_done_callback(self._thread_done)
        self.offloaded += 1
        done, _ = await asyncio.wait({future, abort_wait}, timeout=self._timeout_s,
                                     return_when=asyncio.FIRST_COMPLETED)
        # The abort first (the event: its waiter may not have run yet): one that came with the compile's end has
        # already reached the engine (driver.abort), so a request added after it would run as if never cancelled.
        if aborted.is_set():
            return CompileResult(Outcome.CANCELLED)
        if future in done:
            exc = future.exception()
            if exc is None:
                return CompileResult(Outcome.OK)
            if isinstance(exc, EngineRequestError):
                return CompileResult(Outcome.ERROR, exc.message)
            raise exc  # not the schema's fault (a bug): _run answers `internal`
        log.warning("event=grammar_compile_timeout request_id=%s kind=%s spec_bytes=%d timeout_s=%g",
                    request.request_id, key[0], len(key[1]), self._timeout_s)
        self._timed_out[key] = (f"took longer than {self._timeout_s:g} s to compile and was given up: simplify it "
                                "(fewer optional properties, alternatives or enum values, smaller repetition "
                                "counts)")
        while len(self._timed_out) > _TIMED_OUT_KEPT:
            self._timed_out.popitem(last=False)
        return self._timeout_result(request, key)

    def _timeout_result(self, request: EngineRequest, key: tuple[str, str]) -> CompileResult:
        return CompileResult(Outcome.ERROR, f"{request.request_id}: response_format ({key[0]}) {self._timed_out[key]}")

    def _thread_done(self, future: asyncio.Future[None]) -> None:
        """On the loop, when a compile thread is done (in time or not): its slot is free again."""
        if not future.cancelled():
            future.exception()  # retrieved here: a result nobody waits for any more must not be logged as lost
        self._free += 1
        self._slot_freed.set()
