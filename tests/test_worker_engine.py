"""End to end with the real engine (the tiny random model, CPU): what subscribers receive through Kafka and
Redis equals what the engine alone produces for the same requests."""

from __future__ import annotations

import asyncio
import subprocess
import sys

import pytest
import redis.asyncio as aioredis
from worker_harness import ROOT, check_sequence, job, make_space, produce, wait_results

from engine import EngineRequest, SamplingParams
from schemas import Done
from worker.config import WorkerConfig
from worker.service import Worker

pytestmark = [pytest.mark.stack, pytest.mark.slow, pytest.mark.timeout(240)]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    out = tmp_path_factory.mktemp("model") / "tiny"
    subprocess.run([sys.executable, "-m", "engine.make_model", str(out), "--preset", "tiny"], cwd=ROOT, check=True,
                   capture_output=True)
    return str(out)


def _engine(model: str):  # noqa: ANN202 -- LLMEngine is imported lazily
    from engine import EngineConfig, LLMEngine

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
    config = WorkerConfig(model=tiny_model, bootstrap_servers=space.bootstrap, redis_url=space.redis_url,
                          job_topic=space.names.jobs_topic, prefix=space.names.redis_prefix, group_id=space.group,
                          metrics_port=-1, max_num_seqs=16)
    worker = Worker(config, engine)
    task = asyncio.create_task(worker.run())
    r = aioredis.Redis.from_url(space.redis_url)
    try:
        await produce(space.bootstrap, space.names.jobs_topic, jobs)
        results = await wait_results(r, space.names, [j["request_id"] for j in jobs], timeout=180)
    finally:
        worker.request_stop()
        await asyncio.wait_for(task, 60)
        await r.aclose()
    for j in jobs:
        outcome = results[j["request_id"]]
        check_sequence(outcome)
        done = outcome.terminal
        assert isinstance(done, Done), done
        assert done.text == expected[j["request_id"]]
        assert done.usage.completion_tokens <= j["max_tokens"] and done.model == "tiny"
