"""ModelSet: several engines behind the one EngineLike the driver steps, so one engine thread serves them all.

Each engine stays one-model (STYLE.md): the set routes a request by its `model` (None = the first model),
steps in turn only the models that have work (round-robin, one engine step per step() call, so two busy
models get alternate steps and an idle one costs nothing), and sums their stats.

Idle unload (idle_unload_s): a model with no work for that long is closed on the engine thread, between
steps, freeing its memory. A request for it is held in the model's backlog while a loader thread builds the
engine again; the other models keep stepping meanwhile. When the load ends the backlog is replayed in order
(adds and aborts) and the driver is woken. A request the reloaded engine refuses, or every request of a load
that failed, comes back from step() as a failed output, the way the engine reports a request failing alone.

On CUDA with graphs, `exclusive_load` makes a load and the steps of other models take turns on the GPU:
torch.cuda.graph captures in "global" error mode, where another thread's allocation during the capture
invalidates it. Loading is fast (engine/fast_load.py), so the pause is short; on the CPU loads run alongside.
The worker's step watchdog (EngineDriver.stalled) asks step_watch() what it sees: a step waiting for another
model's load has not started running (a large model from slow storage may take minutes), and a load is timed
against its own limit (model_load_timeout_s) instead.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Any

from stoker.engine import EngineRequest, EngineRequestError, EngineStats, RequestOutput
from stoker.worker.driver import EngineLike

log = logging.getLogger("stoker.worker.models")

LOADED, LOADING, UNLOADED, FAILED = "loaded", "loading", "unloaded", "failed"
# EngineStats fields that are running totals: kept across an unload so counters never go back
_TOTALS = ("prefix_cache_queries", "prefix_cache_hits", "prompt_tokens_total", "generation_tokens_total")
Loader = Callable[[str], EngineLike]  # served name -> a loaded (and warmed-up) engine


@dataclass(slots=True)
class _Model:
    name: str
    engine: EngineLike | None
    state: str = LOADED
    last_used: float = field(default_factory=time.monotonic)
    backlog: list[tuple[str, Any]] = field(default_factory=list)  # ("add", EngineRequest) | ("abort", id)
    retired: dict[str, int] = field(default_factory=lambda: dict.fromkeys(_TOTALS, 0))  # totals of unloaded engines
    adding: int = 0  # add_request calls handing a request to `engine` now: it must not unload under them
    steps: int = 0
    loads: int = 1
    last_load_s: float = 0.0
    last_error: str | None = None


def _empty_stats() -> EngineStats:
    return EngineStats(**{f.name: 0 for f in fields(EngineStats)})


def _failed_output(request_id: str, code: str, message: str) -> RequestOutput:
    return RequestOutput(request_id, [], "", None, True, None, 0, 0, 0, error_code=code, error_message=message)


class ModelSet:
    """EngineLike over several engines (see the module docstring). `model_names` lists the served names in
    order; `model_name` is the first, the one a job without `model` gets."""

    def __init__(self, names: list[str], load: Loader, idle_unload_s: float | None = None,
                 exclusive_load: bool = False, clock: Callable[[], float] = time.monotonic):
        if not names or len(set(names)) != len(names):
            raise ValueError(f"ModelSet needs distinct served names, got {names}")
        self._load, self._clock = load, clock
        self.idle_unload_s = idle_unload_s
        self._lock = threading.Lock()  # guards every _Model's state, engine, backlog and last_used
        self._gpu = threading.Lock() if exclusive_load else None
        # For step_watch(), time.monotonic() as the driver's step clock: when the step in progress got the GPU
        # (None while it waits for a load to let go of it), and each load in progress by model name.
        self._step_on_gpu_since: float | None = 0.0
        self._loads_since: dict[str, float] = {}
        self._models: list[_Model] = []
        for name in names:  # at startup: load each in turn (the caller runs this off the event loop)
            started = clock()
            engine = load(name)
            self._models.append(_Model(name, engine, last_used=clock(), last_load_s=clock() - started))
        self._by_name = {m.name: m for m in self._models}
        self.model_names: list[str] = list(names)
        self.model_name: str = names[0]
        # Fixed at startup (the worker sizes its streams by it): the longest context of any model.
        self.max_model_len: int = max(int(m.engine.max_model_len) for m in self._models if m.engine is not None)
        self._owner: dict[str, _Model] = {}  # request id -> its model, until its final output
        self._ready: list[RequestOutput] = []  # failed outputs made off the engine thread, handed out by step()
        self._turn = 0  # index of the model whose turn comes next
        self._wake: Callable[[], None] = lambda: None
        self._stop = threading.Event()
        self._reaper: threading.Thread | None = None
        self.last_model_stats: dict[str, EngineStats] = {}

    # ---- routing (any thread) ----------------------------------------------------------------------------
    def model(self, name: str | None) -> _Model:
        if name is None:
            return self._models[0]
        found = self._by_name.get(name)
        if found is None:
            raise EngineRequestError("unknown_model", f"this worker serves {self.model_names}, the job asked for "
                                     f"{name!r}: send it to a topic served by that model, or omit `model`")
        return found

    def add_request(self, request: EngineRequest) -> None:
        model = self.model(request.model)
        with self._lock:
            model.last_used = self._clock()  # under the lock: an unload decided after this sees it
            # Before the engine has it: its final output (popping this) may come before add_request returns.
            self._owner[request.request_id] = model
            engine = model.engine if model.state == LOADED else None
            if engine is None:
                model.backlog.append(("add", request))
                self._start_load(model)
                return
            model.adding += 1
        try:
            engine.add_request(request)  # validates here; EngineRequestError goes to the caller
        except BaseException:
            with self._lock:
                self._owner.pop(request.request_id, None)
            raise
        finally:
            with self._lock:
                model.adding -= 1

    def grammar_ready(self, request: EngineRequest) -> bool:
        """True when add_request compiles nothing here: the model's engine has the grammar cached, or the model
        is not loaded (the request waits in its backlog, compiled later on the loader thread)."""
        model = self.model(request.model)
        with self._lock:
            engine = model.engine if model.state == LOADED else None
        ready = getattr(engine, "grammar_ready", None)
        return ready is None or bool(ready(request))

    def prepare_grammar(self, request: EngineRequest) -> None:
        model = self.model(request.model)
        with self._lock:
            engine = model.engine if model.state == LOADED else None
        prepare = getattr(engine, "prepare_grammar", None)
        if prepare is not None:
            prepare(request)

    def abort(self, request_id: str) -> None:
        with self._lock:
            model = self._owner.get(request_id)
            if model is None:
                return
            engine = model.engine if model.state == LOADED else None
            if engine is None:
                model.backlog.append(("abort", request_id))
                return
        engine.abort(request_id)

    # ---- the engine thread ---------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Unload what idled out, hand over failed outputs, then one step of the next model with work."""
        self._unload_idle()
        with self._lock:
            outputs, self._ready = self._ready, []
        model = self._next_busy()
        if model is not None and model.engine is not None:
            if self._gpu is not None:
                self._step_on_gpu_since = None
                with self._gpu:
                    self._step_on_gpu_since = time.monotonic()
                    outputs += model.engine.step()
            else:
                outputs += model.engine.step()
            model.steps += 1
            with self._lock:
                model.last_used = self._clock()
        if outputs:
            with self._lock:
                for out in outputs:
                    if out.finished:
                        self._owner.pop(out.request_id, None)
        return outputs

    def step_watch(self) -> tuple[float | None, float | None]:
        """For the worker's step watchdog, in time.monotonic(): (when the step in progress got the GPU, None
        while it waits for another model's exclusive load; the start of the oldest load in progress, None when
        none runs). A step that began earlier counts from its own start."""
        with self._lock:
            oldest = min(self._loads_since.values(), default=None)
        return self._step_on_gpu_since, oldest

    def _next_busy(self) -> _Model | None:
        count = len(self._models)
        for k in range(count):
            model = self._models[(self._turn + k) % count]
            engine = model.engine
            if model.state == LOADED and engine is not None and engine.has_unfinished():
                self._turn = (self._turn + k + 1) % count
                return model
        return None

    def has_unfinished(self) -> bool:
        with self._lock:
            if self._ready or self._idle_models():
                return True
        return any(m.state == LOADED and m.engine is not None and m.engine.has_unfinished() for m in self._models)

    def stats(self) -> EngineStats:
        """The sum over the models; each model's own (unloaded ones: zero but their totals) in last_model_stats."""
        per_model: dict[str, EngineStats] = {}
        for model in self._models:
            engine = model.engine
            stats = engine.stats() if model.state == LOADED and engine is not None else _empty_stats()
            for name in _TOTALS:
                setattr(stats, name, getattr(stats, name) + model.retired[name])
            per_model[model.name] = stats
        self.last_model_stats = per_model  # replaced whole: readers on other threads see one snapshot
        total = _empty_stats()
        for stats in per_model.values():
            for f in fields(EngineStats):
                setattr(total, f.name, getattr(total, f.name) + getattr(stats, f.name))
        return total

    # ---- idle unload ---------------------------------------------------------------------------------------
    def _idle_models(self) -> list[_Model]:
        """Models due for unloading (call with the lock held)."""
        if self.idle_unload_s is None:
            return []
        now = self._clock()
        return [m for m in self._models if m.state == LOADED and m.engine is not None and not m.backlog
                and not m.adding and now - m.last_used >= self.idle_unload_s and not m.engine.has_unfinished()]

    def _unload_idle(self) -> None:
        with self._lock:
            idle = self._idle_models()
            closing = []
            for model in idle:
                closing.append((model, model.engine))
                model.engine, model.state = None, UNLOADED
        for model, engine in closing:  # on the engine thread, between steps: nothing else touches it now
            stats = engine.stats() if engine is not None else _empty_stats()
            for name in _TOTALS:
                model.retired[name] += getattr(stats, name)
            close = getattr(engine, "close", None)
            if close is not None:
                close()
            log.info("event=model_unloaded model=%s idle_s=%.1f", model.name, self._clock() - model.last_used)

    def set_waker(self, wake: Callable[[], None]) -> None:
        """The driver's notify: called when a load ends or a model idled out. Starts the idle watcher."""
        self._wake = wake
        if self.idle_unload_s is not None and self._reaper is None:
            self._reaper = threading.Thread(target=self._watch_idle, name="stoker-model-idle", daemon=True)
            self._reaper.start()

    def _watch_idle(self) -> None:
        # The driver sleeps while nothing has work; this wakes it when a model is due, so step() unloads it.
        assert self.idle_unload_s is not None
        interval = min(1.0, self.idle_unload_s / 4)
        while not self._stop.wait(interval):
            with self._lock:
                due = bool(self._idle_models())
            if self._expire_held() or due:
                self._wake()

    def _expire_held(self) -> bool:
        """Held requests (their model loading) past their deadline end now, as the engine's queue would end
        them: a load may take a minute, and the contract ends a queued request at its deadline."""
        now_ms = time.time() * 1000
        with self._lock:
            expired: set[str] = set()
            for model in self._models:
                expired |= {item.request_id for kind, item in model.backlog
                            if kind == "add" and item.deadline_ms is not None and item.deadline_ms <= now_ms}
            if not expired:
                return False
            for model in self._models:  # their held aborts go too: the engine will never know those ids
                model.backlog = [(kind, item) for kind, item in model.backlog
                                 if (item.request_id if kind == "add" else item) not in expired]
            self._ready += [RequestOutput(rid, [], "", None, True, "deadline", 0, 0, 0) for rid in sorted(expired)]
        return True

    # ---- reload on demand ----------------------------------------------------------------------------------
    def _start_load(self, model: _Model) -> None:
        """Start a loader thread unless one runs (call with the lock held)."""
        if model.state in (LOADED, LOADING):
            return
        model.state = LOADING
        log.info("event=model_loading model=%s", model.name)
        threading.Thread(target=self._reload, args=(model,), name=f"stoker-load-{model.name}", daemon=True).start()

    def _reload(self, model: _Model) -> None:
        started = self._clock()
        try:
            if self._gpu is not None:
                with self._gpu:
                    engine = self._timed_load(model.name)
            else:
                engine = self._timed_load(model.name)
        except Exception as exc:  # noqa: BLE001 -- the jobs waiting for it fail; the next job tries again
            log.exception("event=model_load_failed model=%s", model.name)
            self._fail_backlog(model, f"model {model.name!r} could not be loaded: {type(exc).__name__}: {exc}")
            return
        if not self._replay_backlog(model, engine):
            log.info("event=model_load_discarded model=%s reason=closed", model.name)
            return
        model.loads += 1
        model.last_load_s = self._clock() - started
        log.info("event=model_loaded model=%s load_s=%.2f", model.name, model.last_load_s)
        self._wake()

    def _timed_load(self, name: str) -> EngineLike:
        """The loader, with its start visible to step_watch() while it runs (from when it holds the GPU)."""
        with self._lock:
            self._loads_since[name] = time.monotonic()
        try:
            return self._load(name)
        finally:
            with self._lock:
                self._loads_since.pop(name, None)

    def _replay_backlog(self, model: _Model, engine: EngineLike) -> bool:
        """Hand the held requests to the new engine in order; then it takes requests directly (True). After
        close() (the worker stopping) the engine is closed here instead (False): close() freed what it saw."""
        while True:
            with self._lock:
                backlog, model.backlog = model.backlog, []
                closed = self._stop.is_set()  # close() sets it before it takes the lock: no engine slips past
                if closed:
                    model.state = UNLOADED
                elif not backlog:
                    model.engine, model.state, model.last_used = engine, LOADED, self._clock()
                    model.last_error = None
                    return True
            if closed:
                close = getattr(engine, "close", None)
                if close is not None:
                    close()
                return False
            failed = []
            for kind, item in backlog:
                if kind == "abort":
                    engine.abort(item)
                    continue
                try:
                    engine.add_request(item)
                except EngineRequestError as exc:
                    failed.append(_failed_output(item.request_id, exc.code, exc.message))
            with self._lock:
                self._ready += failed

    def _fail_backlog(self, model: _Model, message: str) -> None:
        with self._lock:
            backlog, model.backlog = model.backlog, []
            model.state, model.last_error = FAILED, message
            self._ready += [_failed_output(item.request_id, "internal", message + "; try again")
                            for kind, item in backlog if kind == "add"]
        self._wake()

    # ---- readiness and shutdown ----------------------------------------------------------------------------
    def model_state(self, name: str) -> str | None:
        """loaded | loading | unloaded (reloads on the next job) | failed (the last load raised); None: not here."""
        model = self._by_name.get(name)
        return None if model is None else model.state

    def close(self) -> None:
        """Stop the idle watcher and free every engine (after the driver stopped stepping)."""
        self._stop.set()
        with self._lock:
            engines = [m.engine for m in self._models]
            for model in self._models:
                model.engine, model.state = None, UNLOADED
        for engine in engines:
            close = getattr(engine, "close", None)
            if close is not None:
                close()


def model_states(engine: EngineLike, served_name: str,
                 last_stats: EngineStats | None) -> dict[str, tuple[str, EngineStats | None]]:
    """{served name: (state, its latest stats)} for metrics and per-model readiness: a ModelSet's models, or
    the one engine's (always loaded) under the worker's served name."""
    if isinstance(engine, ModelSet):
        per_model = engine.last_model_stats
        return {name: (engine.model_state(name) or UNLOADED, per_model.get(name)) for name in engine.model_names}
    return {served_name: (LOADED, last_stats)}
