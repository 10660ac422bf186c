"""One worker, two models of different architectures (transformers-made llama and qwen2, CPU, float32),
through the real Kafka and Redis: interleaved jobs each answered by its own model exactly as transformers'
greedy search, `unknown_model` for a third name, each model's KV cache within its own budget, and a model
that idles out unloaded and reloaded by its next job."""

from __future__ import annotations

import asyncio
import json
import time
import urllib.error
import urllib.request
from typing import Any

import pytest
import redis.asyncio as aioredis
from engine_models import build_hf_model, hf_greedy, prompts
from stoker.engine.kv_cache import kv_bytes_per_block
from stoker.schemas import Done, Error
from stoker.worker.config import WorkerConfig
from stoker.worker.main import build_engine
from stoker.worker.model_specs import ModelSpec
from stoker.worker.models import ModelSet
from worker_harness import (
    Outcome,
    check_sequence,
    job,
    make_space,
    produce,
    running_worker,
    scrape,
    start_worker_process,
    stop_process,
    wait_results,
)

pytestmark = [pytest.mark.stack, pytest.mark.slow, pytest.mark.timeout(300)]

ARCH = {"llama": "llama", "qwen": "qwen2"}  # served name -> tests/engine_models.py architecture
KV_BUDGET = {"llama": 1 << 20, "qwen": 3 << 19}  # bytes; different, so each model's own budget is what holds
MAX_NEW = 10


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[str, Any]]:
    """served name -> (model folder, the transformers model)"""
    out = {}
    for name, arch in ARCH.items():
        folder = str(tmp_path_factory.mktemp(arch))
        out[name] = (folder, build_hf_model(arch, folder, seed=len(name)))
    return out


def model_settings(models: dict[str, tuple[str, Any]], **extra: object) -> dict[str, object]:
    specs = tuple(ModelSpec(folder, name, kv_cache_memory_bytes=KV_BUDGET[name]) for name, (folder, _) in models.items())
    return dict(fake_engine=False, models=specs, device="cpu", no_warmup=True, max_num_seqs=8, claim_ttl_s=10,
                drain_timeout_s=30, **extra)


async def load_set(settings: dict[str, object]) -> ModelSet:
    engine = await asyncio.to_thread(build_engine, WorkerConfig(**settings))  # type: ignore[arg-type]
    assert isinstance(engine, ModelSet)
    return engine


def greedy_job(rid: str, ids: list[int], model: str | None) -> dict[str, Any]:
    extra = {"model": model} if model is not None else {}
    return job(rid, prompt_token_ids=ids, max_tokens=MAX_NEW, temperature=0, ignore_eos=True, **extra)


def token_ids(outcome: Outcome) -> list[int]:
    check_sequence(outcome)
    return [t for chunk in outcome.chunks_of_final_attempt() for t in chunk.token_ids]


async def test_two_architectures_in_one_worker_each_answer_as_transformers(request, models):
    space = await make_space(request)
    ids = prompts(11, [5, 9, 13, 6, 11, 8, 7, 12])
    names = ["llama", "qwen"]
    jobs = [greedy_job(f"m{i}", p, names[i % 2]) for i, p in enumerate(ids)]  # interleaved
    jobs += [greedy_job("default", ids[0], None), greedy_job("third", ids[0], "mistral-7b")]
    expected = {j["request_id"]: await asyncio.to_thread(hf_greedy, models[j.get("model") or "llama"][1],
                                                         j["prompt_token_ids"], MAX_NEW)
                for j in jobs if j["request_id"] != "third"}
    settings = model_settings(models)
    engine = await load_set(settings)
    r = aioredis.Redis.from_url(space.redis_url)
    try:
        async with running_worker(space, engine=engine, **settings) as worker:
            assert worker.model_names == ["llama", "qwen"]
            beat = json.loads(await r.get(f"{space.names.redis_prefix}:worker:{worker.cfg.worker_id}"))
            assert beat["models"] == ["llama", "qwen"] and beat["topic"] == space.names.jobs_topic  # routable
            await produce(space.bootstrap, space.names.jobs_topic, jobs)
            results = await wait_results(r, space.names, [j["request_id"] for j in jobs], timeout=240)
    finally:
        await r.aclose()
    for j in jobs[:-1]:
        outcome = results[j["request_id"]]
        assert isinstance(outcome.terminal, Done), outcome.terminal
        assert token_ids(outcome) == expected[j["request_id"]], j["request_id"]
        assert outcome.terminal.model == (j.get("model") or "llama")  # no `model`: the first, the default
    third = results["third"].terminal
    assert isinstance(third, Error) and third.code == "unknown_model"
    assert "mistral-7b" in third.message and "llama" in third.message and "qwen" in third.message
    for name in names:
        llm = engine.model(name).engine
        assert llm is not None and engine.model(name).steps > 0
        per_block = kv_bytes_per_block(llm.model_config, llm.config.block_size, llm.runner.dtype)
        held = sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in llm.runner.kv_caches)
        assert held <= KV_BUDGET[name] and llm.runner.num_blocks == KV_BUDGET[name] // per_block, name
    engine.close()


def get(port: int, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode()


async def wait_state(engine: ModelSet, name: str, state: str, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while engine.model_state(name) != state:
        assert time.monotonic() < deadline, f"{name} is {engine.model_state(name)}, not {state}"
        await asyncio.sleep(0.05)


async def test_an_idle_model_unloads_and_its_next_job_reloads_it(request, models):
    space = await make_space(request)
    first, again = prompts(23, [7, 10])
    expected = [await asyncio.to_thread(hf_greedy, models["qwen"][1], p, MAX_NEW) for p in (first, again)]
    settings = model_settings(models, model_idle_unload_s=1.0, metrics_port=0)
    engine = await load_set(settings)
    r = aioredis.Redis.from_url(space.redis_url)
    try:
        async with running_worker(space, engine=engine, **settings) as worker:
            assert worker.health is not None and worker.health.port is not None
            port = worker.health.port
            await produce(space.bootstrap, space.names.jobs_topic, [greedy_job("q1", first, "qwen")])
            results = await wait_results(r, space.names, ["q1"], timeout=120)
            await wait_state(engine, "qwen", "unloaded")
            assert engine.model(name="qwen").engine is None  # its weights and KV cache are gone
            values = await asyncio.to_thread(scrape, port)
            assert values[("stoker_model_loaded", frozenset({("model", "qwen")}))] == 0
            assert await asyncio.to_thread(get, port, "/readyz/qwen") == (200, "unloaded\n")
            assert (await asyncio.to_thread(get, port, "/readyz/gpt"))[0] == 404
            # Counted from here: qwen may also have idled out (1 s) while the worker joined, before q1 came.
            loads = engine.model("qwen").loads
            await produce(space.bootstrap, space.names.jobs_topic, [greedy_job("q2", again, "qwen")])
            results |= await wait_results(r, space.names, ["q2"], timeout=120)
            assert engine.model("qwen").loads == loads + 1
    finally:
        await r.aclose()
    for rid, want in zip(("q1", "q2"), expected, strict=True):
        assert isinstance(results[rid].terminal, Done), results[rid].terminal
        assert token_ids(results[rid]) == want, rid
    engine.close()


async def test_stoker_worker_serves_the_models_its_flags_name(request, tmp_path):
    """The command line end to end (stand-in engines: the wiring is what is tested): two --model flags make one
    worker that answers both names, the first for jobs without `model`, and refuses a third."""
    space = await make_space(request)
    proc = start_worker_process(space.worker_env(), "--model", "/m/alpha", "--model", "/m/beta,name=b",
                                log_path=tmp_path / "worker.log")
    r = aioredis.Redis.from_url(space.redis_url)
    jobs = [job("none", max_tokens=3), job("alpha", max_tokens=3, model="alpha"), job("b", max_tokens=3, model="b"),
            job("beta", max_tokens=3, model="beta")]
    try:
        await produce(space.bootstrap, space.names.jobs_topic, jobs)
        results = await wait_results(r, space.names, [j["request_id"] for j in jobs], timeout=60)
    finally:
        await r.aclose()
        assert stop_process(proc) == 0
    served = {rid: results[rid].terminal for rid in ("none", "alpha", "b")}
    assert {rid: d.model for rid, d in served.items() if isinstance(d, Done)} == {"none": "alpha", "alpha": "alpha",
                                                                                  "b": "b"}
    refused = results["beta"].terminal  # the folder's name is not served when name= renames it
    assert isinstance(refused, Error) and refused.code == "unknown_model" and "['alpha', 'b']" in refused.message
