"""The worker hands a job to the engine while its claim is on the way (Worker._start_early): the claim's
Redis round trip overlaps the first engine step instead of preceding it (W1's TTFT through the queue,
issue 12). Against the real Kafka and Redis, with the stand-in engine."""

from __future__ import annotations

import asyncio
import time

import pytest
from stoker.engine import EngineRequest
from stoker.schemas import Done
from stoker.worker.fake_engine import FakeEngine
from stoker.worker.redis_io import Admission, RedisAccessError
from worker_harness import (
    check_sequence,
    expected_text,
    job,
    produce,
    running_worker,
    stack_fixtures,
    wait_results,
)

pytestmark = [pytest.mark.stack, pytest.mark.timeout(120)]

space, r = stack_fixtures()


class RecordingEngine(FakeEngine):
    """The stand-in engine, noting when each request id was added and aborted (epoch seconds)."""

    def __init__(self) -> None:
        super().__init__()
        self.added: dict[str, float] = {}
        self.aborted: dict[str, float] = {}

    def add_request(self, request: EngineRequest) -> None:
        super().add_request(request)
        self.added.setdefault(request.request_id, time.time())

    def abort(self, request_id: str) -> None:
        self.aborted.setdefault(request_id, time.time())
        super().abort(request_id)


async def test_the_engine_runs_a_job_while_its_claim_is_on_the_way_and_nothing_is_published_before_it(space, r):
    names = space.names
    engine = RecordingEngine()
    claimed: dict[str, float] = {}
    async with running_worker(space, engine) as worker:
        assert worker.rio is not None
        admit = worker.rio.admit

        async def slow_admit(ids: list[str]) -> list[tuple[Admission, int]]:
            await asyncio.sleep(0.3)  # a slow claim: the stand-in engine finishes the whole job meanwhile
            answers = await admit(ids)
            claimed.update(dict.fromkeys(ids, time.time()))
            return answers

        worker.rio.admit = slow_admit  # type: ignore[method-assign]
        await produce(space.bootstrap, names.jobs_topic, [job("a", max_tokens=5)])
        results = await wait_results(r, names, ["a"], timeout=30)
        entries = await r.xrange(names.stream("a"))
    # In the engine while the claim was on the way; not aborted.
    assert engine.added["a"] < claimed["a"] - 0.2 and "a" not in engine.aborted
    # Every output the engine made before the claim answered went out once it did, in order, and none before.
    outcome = results["a"]
    check_sequence(outcome)
    assert isinstance(outcome.terminal, Done) and outcome.terminal.attempt == 1
    assert outcome.terminal.text == expected_text("a", 5) and len(outcome.events) == 6
    first_event_ms = int(entries[0][0].split(b"-")[0])
    assert first_event_ms >= claimed["a"] * 1000 - 1


async def test_a_job_started_early_whose_claim_says_done_or_cancelled_stops_and_publishes_nothing_of_it(space, r):
    names = space.names
    await r.set(names.result("old"), b'{"type":"done"}', ex=60)  # finished before: a redelivered record
    await r.set(names.cancelled("gone"), b"1", ex=60)  # cancelled before any worker read it
    engine = RecordingEngine()
    async with running_worker(space, engine):
        await produce(space.bootstrap, names.jobs_topic,
                      [job("old", max_tokens=50), job("gone", max_tokens=50), job("new", max_tokens=2)])
        results = await wait_results(r, names, ["gone", "new"], timeout=30)
        for _ in range(50):  # the abort follows the claim's answer
            if {"old", "gone"} <= engine.aborted.keys():
                break
            await asyncio.sleep(0.05)
        old_stream = await r.exists(names.stream("old"))
        old_result = await r.get(names.result("old"))
    # Both ran in the engine before the claim answered, and were stopped by its answer.
    assert {"old", "gone"} <= engine.added.keys() and {"old", "gone"} <= engine.aborted.keys()
    assert engine.aborted["old"] >= engine.added["old"] and "new" not in engine.aborted
    assert old_stream == 0 and old_result == b'{"type":"done"}'
    gone = results["gone"]
    assert isinstance(gone.terminal, Done) and gone.terminal.finish_reason == "cancelled"
    assert gone.events == [gone.terminal] and gone.terminal.text == ""  # none of the early run's tokens
    check_sequence(results["new"])


async def test_a_claim_round_that_raises_aborts_the_jobs_it_started_early(space, r):
    """No answer from the claim script (refused credentials: RedisAccessError, which stops the worker): the job
    the engine was given early is aborted there, not left running for nobody with its outputs held."""
    names = space.names
    engine = RecordingEngine()
    with pytest.raises(RuntimeError, match="the worker failed: RedisAccessError"):
        async with running_worker(space, engine) as worker:
            assert worker.rio is not None

            async def refused_admit(ids: list[str]) -> list[tuple[Admission, int]]:
                await asyncio.sleep(0.2)  # the early start is in the engine by now
                raise RedisAccessError("NOPERM this user has no permissions to run the 'evalsha' command")

            worker.rio.admit = refused_admit  # type: ignore[method-assign]
            await produce(space.bootstrap, names.jobs_topic, [job("a", max_tokens=50)])
            for _ in range(200):
                if "a" in engine.aborted:
                    break
                await asyncio.sleep(0.05)
    assert "a" in engine.added and "a" in engine.aborted and engine.aborted["a"] >= engine.added["a"]
    assert await r.xrange(names.stream("a")) == []  # nothing of the unclaimed run was published
