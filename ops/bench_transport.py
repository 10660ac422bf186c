"""Transport benchmark: how many chunk events per second one worker core pushes into Redis, and the latency
the worker adds from produce to first event, with the stand-in engine (no model: transport only).

    KAFKA_BOOTSTRAP_SERVERS=127.0.0.1:9092 REDIS_URL=redis://127.0.0.1:6379/0 python ops/bench_transport.py

1. Throughput: N concurrent requests of T tokens each (one chunk event per request per step); events/s
   = N*T / wall time from the first chunk to the last done, and the worker's CPU seconds over that time
   (process CPU time: the asyncio loop, the engine thread, Kafka and Redis clients together).
2. Latency: jobs produced at half the measured rate (one token each), from the produce call to the
   first event arriving on the request's pub/sub channel; p50/p99.
The worker runs in this process (its CPU is measured with time.process_time around the measured window;
the subscriber for the latency phase runs in a child process so it doesn't count).
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import statistics
import sys
import time
import uuid
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import msgspec  # noqa: E402
import redis.asyncio as aioredis  # noqa: E402
from aiokafka import AIOKafkaProducer  # noqa: E402
from aiokafka.admin import AIOKafkaAdminClient, NewTopic  # noqa: E402

from worker.config import WorkerConfig  # noqa: E402
from worker.fake_engine import FakeEngine  # noqa: E402
from worker.service import Worker  # noqa: E402


async def _topics(bootstrap: str, names: dict[str, int]) -> None:
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        await admin.create_topics([NewTopic(n, p, 1) for n, p in names.items()])
    finally:
        await admin.close()
    await asyncio.sleep(1.0)


def _job(rid: str, max_tokens: int) -> bytes:
    return msgspec.json.encode({"type": "job", "request_id": rid, "prompt": "bench", "max_tokens": max_tokens,
                                "ignore_eos": True})


def _latency_listener(redis_url: str, prefix: str, ids: list[str], conn: Any) -> None:
    """Child process: subscribe to every channel, report arrival time of each request's first event."""

    async def run() -> dict[str, float]:
        r = aioredis.Redis.from_url(redis_url)
        pubsub = r.pubsub()
        await pubsub.psubscribe(f"{prefix}:events:*")
        conn.send("ready")
        first: dict[str, float] = {}
        deadline = time.time() + 120
        while len(first) < len(ids) and time.time() < deadline:
            msg = await pubsub.get_message(ignore_subscribe_messages=True, timeout=1.0)
            if msg is None:
                continue
            rid = msg["channel"].decode().rsplit(":", 1)[1]
            first.setdefault(rid, time.time())
        await pubsub.aclose()
        await r.aclose()
        return first

    conn.send(asyncio.run(run()))


async def bench(bootstrap: str, redis_url: str, requests: int, tokens: int, latency_jobs: int,
                bg_requests: int) -> None:
    tag = uuid.uuid4().hex[:8]
    topic, prefix = f"bench.{tag}", f"bench{tag}"
    await _topics(bootstrap, {topic: 4, topic + ".dlq": 1})
    cfg = WorkerConfig(fake_engine=True, bootstrap_servers=bootstrap, redis_url=redis_url, job_topic=topic,
                       prefix=prefix, group_id=f"bench-{tag}", metrics_port=-1, max_num_seqs=requests,
                       max_waiting=requests, max_poll_records=500, stream_maxlen=tokens + 10)
    engine = FakeEngine(max_num_seqs=requests, max_model_len=2_000_000)
    worker = Worker(cfg, engine)
    task = asyncio.create_task(worker.run())
    while not worker.ready:
        await asyncio.sleep(0.05)
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, linger_ms=2)
    await producer.start()
    r = aioredis.Redis.from_url(redis_url)
    try:
        # -- 1. throughput ---------------------------------------------------------------------------------
        ids = [f"t{i}" for i in range(requests)]
        for rid in ids:
            await producer.send(topic, _job(rid, tokens), key=rid.encode())
        await producer.flush()
        events_before = worker.metrics.events._value.get()  # noqa: SLF001 -- our own counter
        while worker.metrics.events._value.get() == events_before:  # noqa: SLF001
            await asyncio.sleep(0.001)
        cpu0, wall0, ev0 = time.process_time(), time.perf_counter(), worker.metrics.events._value.get()  # noqa: SLF001
        while await r.exists(*(f"{prefix}:result:{rid}" for rid in ids)) < requests:
            await asyncio.sleep(0.01)
        cpu1, wall1, ev1 = time.process_time(), time.perf_counter(), worker.metrics.events._value.get()  # noqa: SLF001
        events = ev1 - ev0
        rate = events / (wall1 - wall0)
        cpu_share = (cpu1 - cpu0) / (wall1 - wall0)
        per_core = events / (cpu1 - cpu0)
        # -- 2. latency at half the rate: background requests stream chunk events at ~rate/2 (the stand-in
        # engine's steps are paced for it), while sparse probe jobs (one token) measure produce -> first event.
        # Small steps (bg_requests events each, paced) keep the engine's own wait short, so what is measured
        # is mostly transport: Kafka -> claim -> engine thread -> Redis pipeline -> pub/sub.
        background = [f"b{i}" for i in range(bg_requests)]
        engine.step_delay_s = 2 * bg_requests / rate
        for rid in background:
            await producer.send(topic, _job(rid, 1_000_000), key=rid.encode())
        await producer.flush()
        await asyncio.sleep(2.0)  # let the background batch reach steady state
        lat_ids = [f"l{i}" for i in range(latency_jobs)]
        parent, child = mp.Pipe()
        listener = mp.get_context("spawn").Process(target=_latency_listener, args=(redis_url, prefix, lat_ids, child))
        listener.start()
        assert parent.recv() == "ready"
        sent: dict[str, float] = {}
        cpu2, wall2, ev2 = time.process_time(), time.perf_counter(), worker.metrics.events._value.get()  # noqa: SLF001
        for rid in lat_ids:
            await asyncio.sleep(1 / PROBES_PER_S)
            sent[rid] = time.time()
            await producer.send(topic, _job(rid, 1), key=rid.encode())
        await producer.flush()
        first = await asyncio.to_thread(parent.recv)
        cpu3, wall3, ev3 = time.process_time(), time.perf_counter(), worker.metrics.events._value.get()  # noqa: SLF001
        for rid in background:  # end the background load
            await r.publish(f"{prefix}:cancel", msgspec.json.encode({"type": "cancel", "request_id": rid}))
        listener.join(10)
        lat = sorted((first[rid] - sent[rid]) * 1000 for rid in lat_ids if rid in first)
        p50, p99 = statistics.median(lat), lat[min(len(lat) - 1, int(len(lat) * 0.99))]
        print(f"\nStoker transport benchmark (fake engine), {os.cpu_count()} CPUs, worker in-process")
        print(f"{'phase':<34}{'value':>14}")
        print(f"{'throughput: requests x tokens':<34}{f'{requests} x {tokens}':>14}")
        print(f"{'chunk+done events/s (wall)':<34}{rate:>14,.0f}")
        print(f"{'worker CPU (cores busy)':<34}{cpu_share:>14.2f}")
        print(f"{'events per worker CPU-second':<34}{per_core:>14,.0f}")
        print(f"{'latency phase: background events/s':<34}{(ev3 - ev2) / (wall3 - wall2):>14,.0f}")
        print(f"{'engine step period ms (paced)':<34}{engine.step_delay_s * 1000:>14.2f}")
        print(f"{'probe jobs measured':<34}{len(lat):>14}")
        print(f"{'produce -> first event p50 ms':<34}{p50:>14.2f}")
        print(f"{'produce -> first event p99 ms':<34}{p99:>14.2f}")
        print(f"{'worker CPU during latency phase':<34}{(cpu3 - cpu2) / (wall3 - wall2):>14.2f}")
    finally:
        await producer.stop()
        await r.aclose()
        worker.request_stop()
        await task


PROBES_PER_S = 100


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bootstrap-servers", default=os.environ.get("KAFKA_BOOTSTRAP_SERVERS", "127.0.0.1:9092"))
    parser.add_argument("--redis-url", default=os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0"))
    parser.add_argument("--requests", type=int, default=512, help="concurrent requests (events per step)")
    parser.add_argument("--tokens", type=int, default=200, help="tokens per request")
    parser.add_argument("--latency-jobs", type=int, default=500, help=f"probe jobs, {PROBES_PER_S}/s")
    parser.add_argument("--bg-requests", type=int, default=32, help="streaming requests in the latency phase")
    args = parser.parse_args()
    asyncio.run(bench(args.bootstrap_servers, args.redis_url, args.requests, args.tokens, args.latency_jobs,
                      args.bg_requests))


if __name__ == "__main__":
    main()
