"""A job's response_format compiles off the worker's event loop (worker.grammar_gate), over the real Kafka and
Redis with the real CPU engine and a tiny model: another request's chunks keep flowing while a slow grammar
compiles (a compile held on purpose, and a real hostile schema); a compile past its timeout ends its request
`invalid_response_format` once and the worker stays healthy; a cancel during the compile ends it `cancelled`
once; a shutdown during the compile hands the job back unanswered and the next worker answers it once; a
cached spec never goes through the pool; at most `grammar_compile_threads` compiles run, and the intake pauses
while more wait."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
import redis.asyncio as aioredis
from stoker.schemas import Cancel, Done, Error, decode_event, encode_cancel
from worker_harness import (
    Space,
    check_sequence,
    committed_offsets,
    job,
    produce,
    running_worker,
    stack_fixtures,
    wait_results,
)

pytestmark = [pytest.mark.stack, pytest.mark.slow, pytest.mark.timeout(240)]

SLOW = "slow-compile"  # a schema whose title holds this compiles slowly under CompileHook
CRASH = "crash-compile"  # ... and this one makes the compile raise what no schema should (a bug of ours)
MAX_GAP_S = 0.75  # the longest a running request may go without a chunk while a grammar compiles
HELD_S = 2.0  # how long CompileHook holds a slow compile unless released


space, r = stack_fixtures(2)


class CompileHook:
    """Wraps an engine's grammar compiler: records each compile's wall-clock start and end and how many ran at
    once; a spec naming SLOW is held until release() or hold_s, whichever comes first (a deterministic slow
    compile that, like llguidance's, does not hold the GIL)."""

    def __init__(self, engine: Any, hold_s: float = HELD_S):
        compiler = engine.grammar_compiler()
        # one call per grammar (its templates, engine/grammar.py's families, compile inside it): the engine's own
        # compiler, every other part real
        self._real: Callable[[Any], Any] = compiler._compile_families
        compiler._compile_families = self._compile
        self.hold_s = hold_s
        self._released = threading.Event()
        self._lock = threading.Lock()
        self.spans: list[tuple[float, float]] = []
        self.started = 0
        self.running = 0
        self.most_at_once = 0

    def release(self) -> None:
        self._released.set()

    def _compile(self, guided: Any) -> Any:
        with self._lock:
            self.started += 1
            self.running += 1
            self.most_at_once = max(self.most_at_once, self.running)
        began = time.time()
        try:
            if SLOW in guided.spec:
                self._released.wait(self.hold_s)
            if CRASH in guided.spec:
                raise RuntimeError("the compiler broke")
            return self._real(guided)
        finally:
            with self._lock:
                self.running -= 1
                self.spans.append((began, time.time()))


def _engine(model: str) -> Any:
    from stoker.engine import EngineConfig, LLMEngine

    return LLMEngine(EngineConfig(model_path=model, device="cpu", kv_cache_memory_bytes=32 << 20, max_num_seqs=16))


def constrained(rid: str, schema: dict[str, Any], **fields: Any) -> dict[str, Any]:
    return job(rid, v=2, max_tokens=fields.pop("max_tokens", 24), temperature=0.0,
               response_format={"type": "json_schema", "json_schema": {"name": "t", "schema": schema}}, **fields)


def slow_schema(tag: str) -> dict[str, Any]:
    return {"title": f"{SLOW}-{tag}", "enum": ["red", "green", "blue"]}


def hostile_schema() -> dict[str, Any]:
    """4,500 optional properties (57 KB, within the contract's 64 KiB): ~2-3 s to compile on the 2-core VM
    (ops/bench_grammar.py), in llguidance's matcher build itself; it then fails at its first token."""
    return {"type": "object", "properties": {f"p{i}": True for i in range(4500)}}


async def until(check: Callable[[], Any], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        await asyncio.sleep(0.02)


async def cancel(r: aioredis.Redis, space: Space, rid: str) -> None:
    await r.set(space.names.cancelled(rid), b"1", ex=60)
    await r.publish(space.names.cancel_channel, encode_cancel(Cancel(request_id=rid)))


async def stream_ms(r: aioredis.Redis, space: Space, rid: str) -> list[float]:
    """Wall-clock ms at which Redis stored each of the request's events (the stream entry ids' time part)."""
    entries: Any = await r.xrange(space.names.stream(rid))
    return [float(entry_id.split(b"-")[0]) for entry_id, _ in entries]


def longest_silence(event_ms: list[float], start_s: float, end_s: float) -> float:
    """The longest stretch of [start_s, end_s] with no event, in seconds."""
    marks = [start_s * 1000] + [t for t in event_ms if start_s * 1000 < t < end_s * 1000] + [end_s * 1000]
    return max(b - a for a, b in zip(marks, marks[1:], strict=False)) / 1000


def the_error(outcome: Any) -> Error:
    check_sequence(outcome)
    assert isinstance(outcome.terminal, Error), outcome.terminal
    return outcome.terminal


@pytest.mark.parametrize("slow", ["held", "hostile_schema"])
async def test_chunks_keep_flowing_while_a_grammar_compiles(space, r, tiny_model, slow):
    engine = await asyncio.to_thread(_engine, tiny_model)
    hook = CompileHook(engine)
    long_job = job("long", prompt="The stoker keeps the fire", max_tokens=1800, ignore_eos=True, temperature=0.0)
    schema = slow_schema("a") if slow == "held" else hostile_schema()
    async with running_worker(space, engine=engine, fake_engine=False, model=tiny_model, max_num_seqs=16,
                              claim_ttl_s=10, grammar_compile_timeout_s=30) as worker:
        await produce(space.bootstrap, space.names.jobs_topic, [long_job])
        await until(lambda: worker.requests.running("long") is not None and worker.requests.running("long").seq > 0,
                    30, "the long request's first chunk")
        await produce(space.bootstrap, space.names.jobs_topic, [constrained("shaped", schema, max_tokens=8)])
        await until(lambda: hook.spans, 60, "the compile to end")
        await asyncio.sleep(0.3)
        await cancel(r, space, "long")
        results = await wait_results(r, space.names, ["long", "shaped"], timeout=60)
        offloaded = worker.grammars.offloaded
    start, end = hook.spans[0]
    assert end - start > 0.5, f"the compile took {end - start:.2f} s: not slow enough to show anything"
    event_ms = await stream_ms(r, space, "long")
    assert event_ms[-1] > end * 1000, "the long request ended before the compile: nothing was measured"
    silence = longest_silence(event_ms, start, end)
    assert silence < MAX_GAP_S, f"no chunk for {silence:.2f} s while a {end - start:.2f} s compile ran"
    assert offloaded == 1
    check_sequence(results["long"])
    assert isinstance(results["long"].terminal, Done) and results["long"].terminal.finish_reason == "cancelled"
    check_sequence(results["shaped"])
    if slow == "held":
        assert isinstance(results["shaped"].terminal, Done), results["shaped"].terminal
    else:  # it compiles, but its first token leaves 18,000 parser items, past llguidance's limit (engine.grammar)
        error = results["shaped"].terminal
        assert isinstance(error, Error) and error.code == "invalid_response_format", error
        assert "past the grammar parser's limits" in error.message and len(error.message) < 1000, error.message


async def test_a_compile_past_the_timeout_ends_invalid_response_format_once(space, r, tiny_model):
    engine = await asyncio.to_thread(_engine, tiny_model)
    hook = CompileHook(engine, hold_s=60)
    try:
        async with running_worker(space, engine=engine, fake_engine=False, model=tiny_model, max_num_seqs=16,
                                  claim_ttl_s=10, grammar_compile_timeout_s=0.5) as worker:
            await produce(space.bootstrap, space.names.jobs_topic, [constrained("slow1", slow_schema("t"))])
            first = (await wait_results(r, space.names, ["slow1"], timeout=30))["slow1"]
            assert hook.running == 1, "the compile was not still running when the request ended"
            hook.release()
            await until(lambda: hook.spans, 30, "the timed-out compile's thread to end")
            await asyncio.sleep(0.2)  # its late result lands in the engine's cache: it must not be used
            await produce(space.bootstrap, space.names.jobs_topic,
                          [constrained("slow2", slow_schema("t")), job("plain", max_tokens=6, temperature=0.0)])
            later = await wait_results(r, space.names, ["slow2", "plain"], timeout=30)
            assert worker._healthy() and worker.fatal is None
            offloaded, compiles = worker.grammars.offloaded, hook.started
    finally:
        hook.release()
    for outcome in (first, later["slow2"]):
        error = the_error(outcome)
        assert error.code == "invalid_response_format" and "took longer than 0.5 s" in error.message, error
        assert len(outcome.events) == 1  # the terminal event alone: no chunk, no second answer
    assert (offloaded, compiles) == (1, 1), "the spec that timed out was compiled again"
    check_sequence(later["plain"])
    assert isinstance(later["plain"].terminal, Done) and later["plain"].terminal.finish_reason == "length"


async def test_a_compile_that_breaks_ends_internal_once_and_the_worker_goes_on(space, r, tiny_model):
    engine = await asyncio.to_thread(_engine, tiny_model)
    CompileHook(engine)
    async with running_worker(space, engine=engine, fake_engine=False, model=tiny_model, max_num_seqs=16,
                              claim_ttl_s=10) as worker:
        await produce(space.bootstrap, space.names.jobs_topic,
                      [constrained("broke", {"title": CRASH, "enum": ["a"]}), job("next", max_tokens=4)])
        results = await wait_results(r, space.names, ["broke", "next"], timeout=30)
        assert worker._healthy() and worker.requests.get("broke") is None
    error = the_error(results["broke"])
    assert error.code == "internal" and "the compiler broke" in error.message, error
    check_sequence(results["next"])
    assert isinstance(results["next"].terminal, Done)


async def test_a_cancel_during_the_compile_ends_the_request_cancelled_once(space, r, tiny_model):
    engine = await asyncio.to_thread(_engine, tiny_model)
    hook = CompileHook(engine, hold_s=60)
    try:
        async with running_worker(space, engine=engine, fake_engine=False, model=tiny_model, max_num_seqs=16,
                                  claim_ttl_s=10, grammar_compile_timeout_s=30) as worker:
            await produce(space.bootstrap, space.names.jobs_topic, [constrained("c1", slow_schema("c"))])
            await until(lambda: hook.running == 1, 30, "the compile to start")
            await cancel(r, space, "c1")
            outcome = (await wait_results(r, space.names, ["c1"], timeout=10))["c1"]
            assert hook.running == 1, "the cancel waited for the compile"
            hook.release()
            await until(lambda: hook.spans, 30, "the compile's thread to end")
            await asyncio.sleep(0.5)  # time for a wrong second answer (the compiled request run) to show
            assert not engine.has_unfinished()
            assert worker.requests.get("c1") is None
    finally:
        hook.release()
    events: Any = await r.xrange(space.names.stream("c1"))
    assert len(events) == 1
    check_sequence(outcome)
    assert isinstance(outcome.terminal, Done) and outcome.terminal.finish_reason == "cancelled"


async def test_a_shutdown_during_the_compile_hands_the_job_back_and_the_next_worker_answers_once(
        space, r, tiny_model):
    engine = await asyncio.to_thread(_engine, tiny_model)
    hook = CompileHook(engine, hold_s=60)
    try:
        async with running_worker(space, engine=engine, fake_engine=False, model=tiny_model, max_num_seqs=16,
                                  claim_ttl_s=10, drain_timeout_s=1, grammar_compile_timeout_s=30):
            await produce(space.bootstrap, space.names.jobs_topic, [constrained("s1", slow_schema("s"))])
            await until(lambda: hook.running == 1, 30, "the compile to start")
        assert hook.running == 1, "the worker stopped after the compile, not during it"
        assert await r.get(space.names.result("s1")) is None
        assert await r.exists(space.names.claim("s1")) == 0, "the claim was not handed back"
    finally:
        hook.release()
    second = await asyncio.to_thread(_engine, tiny_model)
    async with running_worker(space, engine=second, fake_engine=False, model=tiny_model, max_num_seqs=16,
                              claim_ttl_s=10):
        outcome = (await wait_results(r, space.names, ["s1"], timeout=60))["s1"]
    check_sequence(outcome)
    assert isinstance(outcome.terminal, Done) and outcome.terminal.attempt == 1
    assert sum(isinstance(e, Done | Error) for e in outcome.events) == 1


async def test_a_revoke_during_the_compile_still_ends_the_request_once(space, r, tiny_model):
    """The partition is revoked (the rebalance listener's own code) while the grammar compiles: the request
    runs on and answers once; the record is not committed by us, and the next owner of the partition finds the
    result and answers nothing."""
    engine = await asyncio.to_thread(_engine, tiny_model)
    hook = CompileHook(engine, hold_s=60)
    try:
        async with running_worker(space, engine=engine, fake_engine=False, model=tiny_model, max_num_seqs=16,
                                  claim_ttl_s=10, grammar_compile_timeout_s=30) as worker:
            await produce(space.bootstrap, space.names.jobs_topic, [constrained("rv", slow_schema("r"))])
            await until(lambda: hook.running == 1, 30, "the compile to start")
            await worker.on_revoked(set(worker._assigned))
            await asyncio.sleep(0.5)  # the revoke's consequences settle while the compile still runs
            assert hook.running == 1
            hook.release()
            outcome = (await wait_results(r, space.names, ["rv"], timeout=30))["rv"]
            await asyncio.sleep(0.3)
            assert worker.requests.get("rv") is None
    finally:
        hook.release()
    committed, end = await committed_offsets(space.bootstrap, space.group, space.names.jobs_topic)
    assert committed < end, "the revoked partition's record was committed by the worker that lost it"
    second = await asyncio.to_thread(_engine, tiny_model)
    async with running_worker(space, engine=second, fake_engine=False, model=tiny_model, max_num_seqs=16,
                              claim_ttl_s=10):
        await until_async(lambda: committed_offsets(space.bootstrap, space.group, space.names.jobs_topic),
                          lambda offsets: offsets[0] == offsets[1], 30, "the next owner to commit the record")
    events: Any = await r.xrange(space.names.stream("rv"))
    assert [decode_event(fields[b"data"]) for _, fields in events] == outcome.events
    check_sequence(outcome)
    assert isinstance(outcome.terminal, Done) and outcome.terminal.finish_reason == "stop"


async def until_async(read: Callable[[], Any], check: Callable[[Any], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not check(await read()):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        await asyncio.sleep(0.2)


async def test_a_cached_spec_does_not_go_through_the_pool(space, r, tiny_model):
    engine = await asyncio.to_thread(_engine, tiny_model)
    hook = CompileHook(engine)
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    async with running_worker(space, engine=engine, fake_engine=False, model=tiny_model, max_num_seqs=16,
                              claim_ttl_s=10) as worker:
        await produce(space.bootstrap, space.names.jobs_topic, [constrained("first", schema)])
        results = await wait_results(r, space.names, ["first"], timeout=30)
        assert worker.grammars.offloaded == 1
        ids = [f"again{i}" for i in range(4)]
        await produce(space.bootstrap, space.names.jobs_topic, [constrained(rid, schema) for rid in ids])
        results |= await wait_results(r, space.names, ids, timeout=30)
        offloaded_after_repeats = worker.grammars.offloaded
        await produce(space.bootstrap, space.names.jobs_topic, [constrained("other", {"enum": ["x", "y"]})])
        results |= await wait_results(r, space.names, ["other"], timeout=30)
        offloaded_after_new = worker.grammars.offloaded
    assert (offloaded_after_repeats, offloaded_after_new, hook.started) == (1, 2, 2)
    for rid in ["first", *ids]:
        check_sequence(results[rid])
        done = results[rid].terminal
        assert isinstance(done, Done) and done.finish_reason == "stop", done
        assert isinstance(json.loads(done.text)["ok"], bool)


async def test_compiles_run_at_most_threads_at_once_and_admission_holds_while_more_wait(space, r, tiny_model):
    engine = await asyncio.to_thread(_engine, tiny_model)
    hook = CompileHook(engine, hold_s=0.4)
    ids = [f"flood{i}" for i in range(4)]
    paused_seen = False
    async with running_worker(space, engine=engine, fake_engine=False, model=tiny_model, max_num_seqs=16,
                              claim_ttl_s=10, grammar_compile_threads=1, grammar_compile_timeout_s=30) as worker:
        await produce(space.bootstrap, space.names.jobs_topic,
                      [constrained(rid, slow_schema(rid)) for rid in ids])
        deadline = time.monotonic() + 60
        while len(hook.spans) < len(ids) and time.monotonic() < deadline:
            # admission from the backlog holds (no free slot) while a compile waits for the thread
            paused_seen = paused_seen or (worker.grammars.waiting > 0 and worker._free_slots()[0] == 0)
            await asyncio.sleep(0.02)
        results = await wait_results(r, space.names, ids, timeout=30)
        assert worker._free_slots()[0] > 0 and worker.grammars.waiting == 0
    assert hook.most_at_once == 1 and hook.started == len(ids)
    assert paused_seen, "admission never held while compiles waited for the thread"
    for rid in ids:
        check_sequence(results[rid])
        assert isinstance(results[rid].terminal, Done)


async def test_an_abort_that_comes_with_the_compiles_end_wins(tiny_model):
    """The compile ends and a cancel lands in the same turn of the loop: the cancel has already gone to the
    engine (before the request), so the request must not be added: the outcome is `cancelled`."""
    from stoker.engine import EngineRequest, GuidedDecoding, SamplingParams
    from stoker.worker.grammar_gate import GrammarGate, Outcome

    engine = await asyncio.to_thread(_engine, tiny_model)
    hook = CompileHook(engine, hold_s=60)
    gate = GrammarGate(engine, threads=1, timeout_s=30)
    results: list[Any] = []
    request = EngineRequest("both", prompt="x", params=SamplingParams(
        max_tokens=4, guided=GuidedDecoding("json_schema", json.dumps(slow_schema("b")))))
    try:
        assert gate.needs_compile(request)
        gate.start(request, results.append)
        await until(lambda: hook.running == 1, 30, "the compile to start")
        hook.release()
        while not hook.spans:  # blocks the loop on purpose: the compile's end and the abort meet in one turn
            time.sleep(0.01)
        time.sleep(0.05)
        gate.abort("both")
        await until(lambda: results, 10, "the outcome")
    finally:
        hook.release()
        await gate.close()
    assert [r.outcome for r in results] == [Outcome.CANCELLED]
    assert not gate.needs_compile(request)  # compiled and cached all the same: the next one takes the fast path


def test_a_model_set_routes_the_grammar_checks_to_the_jobs_model(tiny_model):
    """A multi-model worker: grammar_ready and prepare_grammar reach the engine of the job's `model`."""
    from stoker.engine import EngineRequest, GuidedDecoding, SamplingParams
    from stoker.worker.models import ModelSet

    engines = {name: _engine(tiny_model) for name in ("a", "b")}
    models = ModelSet(["a", "b"], engines.__getitem__)
    params = SamplingParams(max_tokens=4, guided=GuidedDecoding("json_schema", json.dumps({"enum": ["p", "q"]})))
    for_b = EngineRequest("rb", prompt="x", params=params, model="b")
    for_a = EngineRequest("ra", prompt="x", params=params, model="a")
    try:
        assert not models.grammar_ready(for_b) and not models.grammar_ready(for_a)
        models.prepare_grammar(for_b)
        assert models.grammar_ready(for_b) and engines["b"].grammar_ready(for_b)
        assert not models.grammar_ready(for_a)  # a's engine has its own cache, still cold
        plain = EngineRequest("rp", prompt="x", params=SamplingParams(max_tokens=4), model="a")
        assert models.grammar_ready(plain)
    finally:
        models.close()
