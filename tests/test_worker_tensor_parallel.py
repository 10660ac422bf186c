"""A tensor-parallel worker (`stoker-worker --tensor-parallel 2`, CPU, gloo) through the real Kafka and Redis:
it serves jobs, and when one of its rank processes is killed mid-request it exits 1 (no hang), and another
worker finishes its jobs under the next attempt (the at-least-once path)."""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path

import pytest
import redis.asyncio as aioredis
from engine_models import build_hf_model, prompts
from stoker.schemas import Chunk, Done
from worker_harness import (
    check_attempt_order,
    check_sequence,
    job,
    make_space,
    produce,
    start_worker_process,
    stop_process,
    wait_results,
)

pytestmark = [pytest.mark.stack, pytest.mark.slow, pytest.mark.timeout(300)]


def _rank_pids(worker_pid: int) -> list[int]:
    """The worker's spawned rank processes (not multiprocessing's resource tracker)."""
    pids = []
    for task in os.listdir(f"/proc/{worker_pid}/task"):
        with open(f"/proc/{worker_pid}/task/{task}/children") as f:
            pids += [int(p) for p in f.read().split()]
    ranks = []
    for pid in pids:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            if b"spawn_main" in f.read():
                ranks.append(pid)
    return ranks


async def _first_chunk(r: aioredis.Redis, stream: str, timeout: float) -> None:
    for _ in range(int(timeout / 0.05)):
        if await r.xlen(stream):
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"no event on {stream} after {timeout}s")


async def test_worker_whose_rank_dies_exits_1_and_another_worker_finishes_its_jobs(request, tmp_path: Path):
    space = await make_space(request, partitions=1)
    model = str(tmp_path / "llama")
    await asyncio.to_thread(build_hf_model, "llama", model)
    ids = ["long", "short-0", "short-1"]
    jobs = [job(rid, prompt_token_ids=p, max_tokens=n, temperature=0, ignore_eos=True)
            for rid, p, n in zip(ids, prompts(5, [6, 4, 9]), [400, 300, 300], strict=True)]
    env = space.worker_env(STOKER_FAKE_ENGINE="0", STOKER_MODEL=model, STOKER_DEVICE="cpu", STOKER_NO_WARMUP="1",
                           STOKER_NUM_KV_BLOCKS="128", STOKER_TENSOR_PARALLEL="2")
    r = aioredis.Redis.from_url(space.redis_url)
    first_log, second = tmp_path / "first.log", None
    first = start_worker_process(env, log_path=first_log)
    try:
        await produce(space.bootstrap, space.names.jobs_topic, jobs)
        await _first_chunk(r, space.names.stream("long"), timeout=120)
        ranks = _rank_pids(first.pid)
        assert len(ranks) == 1, ranks  # rank 1; rank 0 is the worker itself
        os.kill(ranks[0], signal.SIGKILL)
        code = await asyncio.to_thread(first.wait, 60)  # raises TimeoutExpired on a hang
        log = first_log.read_text()
        assert code == 1, log[-3000:]
        assert "event=worker_failed" in log and "TensorParallelError" in log, log[-3000:]
        assert "tensor-parallel rank 1" in log and "exited with code -9" in log, log[-3000:]
        second = start_worker_process({**env, "STOKER_TENSOR_PARALLEL": "1"}, log_path=tmp_path / "second.log")
        results = await wait_results(r, space.names, ids, timeout=180)
    finally:
        stop_process(first, signal.SIGKILL)
        if second is not None:
            stop_process(second)
        await r.aclose()
    for rid, j in zip(ids, jobs, strict=True):
        outcome = results[rid]
        check_attempt_order(outcome)
        check_sequence(outcome)
        assert isinstance(outcome.terminal, Done) and outcome.terminal.usage.completion_tokens == j["max_tokens"]
    # The request the dead worker was running ends under a later attempt than its first, and what the TP=2
    # worker streamed before its rank died is the start of the same greedy completion (TP=1 now).
    long = results["long"]
    assert long.terminal.attempt >= 2
    streamed = [t for e in long.events if e.attempt == 1 and isinstance(e, Chunk) for t in e.token_ids]
    final = [t for e in long.chunks_of_final_attempt() for t in e.token_ids]
    assert streamed and final[: len(streamed)] == streamed
