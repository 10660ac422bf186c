"""End to end with the real engine (the tiny random model, CPU): what subscribers receive through Kafka and
Redis equals what the engine alone produces for the same requests."""

from __future__ import annotations

import asyncio
import json

import jsonschema
import pytest
import redis.asyncio as aioredis
from stoker.engine import EngineRequest, SamplingParams
from stoker.schemas import Done, Error
from worker_harness import (
    check_sequence,
    dead_letters,
    job,
    make_space,
    produce,
    running_worker,
    scrape,
    wait_results,
)

pytestmark = [pytest.mark.stack, pytest.mark.slow, pytest.mark.timeout(240)]


def _engine(model: str):  # noqa: ANN202 -- LLMEngine is imported lazily
    from stoker.engine import EngineConfig, LLMEngine

    return LLMEngine(EngineConfig(model_path=model, device="cpu", kv_cache_memory_bytes=32 << 20, max_num_seqs=16))


def _alone(model: str, jobs: list[dict]) -> dict[str, str]:
    """Each request's text from the engine driven directly, no Kafka, no Redis."""
    engine = _engine(model)
    for j in jobs:
        engine.add_request(EngineRequest(j["request_id"], prompt=j["prompt"], params=SamplingParams(
            max_tokens=j["max_tokens"], temperature=j.get("temperature", 1.0), seed=j.get("seed"),
            stop=tuple(j.get("stop", ())))))
    text: dict[str, list[str]] = {j["request_id"]: [] for j in jobs}
    while engine.has_unfinished():
        for out in engine.step():
            text[out.request_id].append(out.text_delta)
    return {rid: "".join(parts) for rid, parts in text.items()}


async def test_worker_output_equals_the_engine_alone(request, tiny_model):
    space = await make_space(request)
    prompts = ["The stoker keeps the fire", "A message queue", "Language models read", "Numbers are part of"]
    jobs = [job(f"e{i}", prompt=prompts[i % 4] + " " * (i // 4), max_tokens=8 + i, temperature=0.0 if i % 2 else 0.8,
                seed=100 + i) for i in range(12)]
    expected = await asyncio.to_thread(_alone, tiny_model, jobs)
    engine = await asyncio.to_thread(_engine, tiny_model)
    r = aioredis.Redis.from_url(space.redis_url)
    try:
        async with running_worker(space, engine=engine, fake_engine=False, model=tiny_model, metrics_port=-1,
                                  max_num_seqs=16, claim_ttl_s=10, drain_timeout_s=30):
            await produce(space.bootstrap, space.names.jobs_topic, jobs)
            results = await wait_results(r, space.names, [j["request_id"] for j in jobs], timeout=180)
    finally:
        await r.aclose()
    for j in jobs:
        outcome = results[j["request_id"]]
        check_sequence(outcome)
        done = outcome.terminal
        assert isinstance(done, Done), done
        assert done.text == expected[j["request_id"]]
        assert done.usage.completion_tokens <= j["max_tokens"] and done.model == "tiny"


async def test_prefix_cache_metrics_and_a_stop_id_beyond_the_vocabulary(request, tiny_model):
    """Through Kafka and Redis with the real engine: a stop id >= the vocabulary (384) with min_tokens used to
    index past the sampler's logits and end `internal`; now `invalid_job` naming the field. And the prefix
    cache counters, which stayed 0, count: a repeated prompt is looked up whole and found in part."""
    space = await make_space(request)
    shared = [5 + (7 * i) % 300 for i in range(48)]  # three 16-token blocks
    engine = await asyncio.to_thread(_engine, tiny_model)
    r = aioredis.Redis.from_url(space.redis_url)
    try:
        async with running_worker(space, engine=engine, fake_engine=False, model=tiny_model, metrics_port=0,
                                  max_num_seqs=16, claim_ttl_s=10, drain_timeout_s=30) as worker:
            await produce(space.bootstrap, space.names.jobs_topic, [
                job("bad-stop", prompt="hello", stop_token_ids=[3, 384], min_tokens=1, max_tokens=4),
                job("p0", prompt_token_ids=shared, max_tokens=2, temperature=0)])
            results = await wait_results(r, space.names, ["bad-stop", "p0"], timeout=120)
            await produce(space.bootstrap, space.names.jobs_topic,  # after p0: its blocks are cached
                          [job(f"p{i}", prompt_token_ids=shared, max_tokens=2, temperature=0) for i in (1, 2)])
            results |= await wait_results(r, space.names, ["p1", "p2"], timeout=120)
            assert worker.health is not None and worker.health.port is not None
            values = await asyncio.to_thread(scrape, worker.health.port)
    finally:
        await r.aclose()
    bad = results["bad-stop"].terminal
    assert isinstance(bad, Error) and bad.code == "invalid_job" and "stop_token_ids" in bad.message, bad
    done = [results[f"p{i}"].terminal for i in range(3)]
    assert all(isinstance(d, Done) for d in done)
    cached = sum(d.usage.cached_tokens for d in done if isinstance(d, Done))
    assert cached > 0
    assert values[("stoker_prefix_cache_queries_total", frozenset())] == 3 * len(shared)
    assert values[("stoker_prefix_cache_hits_total", frozenset())] == cached
    assert values[("stoker_prompt_tokens_total", frozenset({("tenant", "")}))] == 3 * len(shared)
    assert values[("stoker_generation_tokens_total", frozenset({("tenant", "")}))] == 6


async def test_response_format_job_and_an_invalid_schema(request, tiny_model):
    """A job with a JSON Schema ends `done` with schema-valid JSON; one whose schema the compiler rejects ends
    with the error event `invalid_response_format` (not dead-lettered: the job is well-formed)."""
    space = await make_space(request)
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                               "rank": {"type": "integer", "minimum": 1, "maximum": 5}},
              "required": ["city", "rank"], "additionalProperties": False}
    fmt = {"type": "json_schema", "json_schema": {"name": "place", "schema": schema, "strict": True}}
    bad = {"type": "json_schema", "json_schema": {"name": "bad", "schema": {"type": "string", "pattern": "(x"}}}
    engine = await asyncio.to_thread(_engine, tiny_model)
    r = aioredis.Redis.from_url(space.redis_url)
    try:
        async with running_worker(space, engine=engine, fake_engine=False, model=tiny_model, metrics_port=-1,
                                  max_num_seqs=16, claim_ttl_s=10, drain_timeout_s=30):
            await produce(space.bootstrap, space.names.jobs_topic, [
                job("json", prompt="Name a city", max_tokens=64, seed=3, response_format=fmt, v=2),
                job("plain", prompt="Name a city", max_tokens=6, temperature=0),
                job("bad-schema", prompt="Name a city", max_tokens=8, response_format=bad, v=2)])
            results = await wait_results(r, space.names, ["json", "plain", "bad-schema"], timeout=120)
    finally:
        await r.aclose()
    done = results["json"].terminal
    assert isinstance(done, Done) and done.finish_reason == "stop", done
    check_sequence(results["json"])
    jsonschema.validate(json.loads(done.text), schema)
    assert isinstance(results["plain"].terminal, Done)
    err = results["bad-schema"].terminal
    assert isinstance(err, Error) and err.code == "invalid_response_format" and "regex" in err.message, err
    assert not await dead_letters(space.bootstrap, space.names.dlq_topic)
