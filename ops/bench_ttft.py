"""Where a lone job's time to first event goes, with the stand-in engine (no model: the queue's share of W1's
TTFT). One `stoker-worker --fake-engine` in its own process (as ops/bench_transport.py starts it), one job at a
time, each sent only after the previous one's first event arrived and a pause, like W1's requests:

    PYTHONPATH=. python3 ops/bench_ttft.py [--jobs 200] [--gap-ms 20]     # against the local stack

Per job, on this side: the producer's send() call -> the broker's ack, and send() -> the first event on the
request's pub/sub channel (subscribed before the send, as the client does). On the worker's side, its stage
histogram (stoker_job_stage_seconds, means over the jobs, from the Kafka record's timestamp): polled, claimed,
engine_added, first_output, published. Kafka's own send -> fetch on the same broker (one producer and one
consumer, ops/bench_kafka_rtt.py) runs after, with the producer's settings, to separate the broker's share from
the worker's. `--json-out` writes every figure.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "ops")]

import redis.asyncio as aioredis  # noqa: E402
from aiokafka import AIOKafkaProducer  # noqa: E402
from bench_kafka_rtt import measure as kafka_rtt  # noqa: E402
from bench_transport import WorkerProc, _job, stage_table  # noqa: E402


def _pct(ordered: list[float], q: float) -> float:
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _summary(samples: list[float]) -> dict[str, float]:
    ordered = sorted(samples)
    return {"mean": statistics.fmean(ordered), "p50": statistics.median(ordered), "p90": _pct(ordered, 0.9),
            "p99": _pct(ordered, 0.99), "max": ordered[-1]}


async def one_job(producer: AIOKafkaProducer, r: aioredis.Redis, worker: WorkerProc, rid: str) -> tuple[float, float]:
    """(send -> ack ms, send -> first event ms) of one job, subscribed before the send."""
    pubsub = r.pubsub()
    await pubsub.subscribe(f"{worker.prefix}:events:{rid}")
    while (await pubsub.get_message(timeout=5.0) or {}).get("type") != "subscribe":
        pass  # the confirmation: from here on the channel is live
    sent = time.perf_counter()
    ack = await producer.send(worker.topic, _job(rid, 1), key=rid.encode())
    await ack
    acked = time.perf_counter()
    msg = None
    while msg is None:
        msg = await pubsub.get_message(ignore_subscribe_messages=True, timeout=5.0)
        if msg is None and time.perf_counter() - sent > 10:
            raise RuntimeError(f"no event for {rid} within 10 s")
    first = time.perf_counter()
    await pubsub.aclose()
    return (acked - sent) * 1000, (first - sent) * 1000


async def run(args: argparse.Namespace) -> dict[str, Any]:
    worker = await WorkerProc.start(args.bootstrap_servers, args.redis_url, 64, 0.0, 1000)
    producer = AIOKafkaProducer(bootstrap_servers=args.bootstrap_servers, linger_ms=args.linger_ms, acks="all")
    await producer.start()
    r = aioredis.Redis.from_url(args.redis_url)
    try:
        for i in range(5):  # connections, metadata and the worker's first claim script load: not timed
            await one_job(producer, r, worker, f"warm{i}")
        before, cpu0 = worker.metrics(), worker.cpu_s()
        acks, firsts = [], []
        for i in range(args.jobs):
            await asyncio.sleep(args.gap_ms / 1000)
            ack_ms, first_ms = await one_job(producer, r, worker, f"j{i}")
            acks.append(ack_ms)
            firsts.append(first_ms)
        after, cpu1 = worker.metrics(), worker.cpu_s()
    finally:
        await producer.stop()
        await r.aclose()
        worker.stop()
    kafka = await kafka_rtt(args.bootstrap_servers, args.jobs, args.linger_ms, "all")
    return {"jobs": args.jobs, "gap_ms": args.gap_ms, "linger_ms": args.linger_ms,
            "send_to_ack_ms": _summary(acks), "send_to_first_event_ms": _summary(firsts),
            "kafka_send_to_fetch_ms": _summary(kafka), "worker_cpu_s": cpu1 - cpu0,
            "stages": [{"stage": s, "mean_ms": mean, "p50_le_ms": p50, "p99_le_ms": p99}
                       for s, mean, p50, p99 in stage_table(before, after)]}


def report(res: dict[str, Any]) -> None:
    print(f"\nlone-job TTFT with the stand-in engine: {res['jobs']} jobs one at a time, {res['gap_ms']:g} ms apart, "
          f"producer linger_ms={res['linger_ms']}, acks=all, {os.cpu_count()} CPUs")
    print(f"{'client side (ms)':<34}{'mean':>8}{'p50':>8}{'p90':>8}{'p99':>8}{'max':>8}")
    for name, key in (("send() -> broker ack", "send_to_ack_ms"), ("send() -> first event", "send_to_first_event_ms"),
                      ("Kafka alone: send() -> fetched", "kafka_send_to_fetch_ms")):
        s = res[key]
        print(f"{name:<34}{s['mean']:>8.2f}{s['p50']:>8.2f}{s['p90']:>8.2f}{s['p99']:>8.2f}{s['max']:>8.2f}")
    print("\nworker stages, from the Kafka record's timestamp (means; p50/p99 are histogram bucket bounds)")
    print(f"{'stage':<16}{'mean ms':>10}{'step ms':>10}{'p50 ms <=':>12}{'p99 ms <=':>12}")
    previous = 0.0
    for row in res["stages"]:
        print(f"{row['stage']:<16}{row['mean_ms']:>10.2f}{row['mean_ms'] - previous:>10.2f}{row['p50_le_ms']:>12.1f}"
              f"{row['p99_le_ms']:>12.1f}")
        previous = row["mean_ms"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bootstrap-servers", default=os.environ.get("KAFKA_BOOTSTRAP_SERVERS", "127.0.0.1:9092"))
    ap.add_argument("--redis-url", default=os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0"))
    ap.add_argument("--jobs", type=int, default=200, help="timed jobs, one at a time")
    ap.add_argument("--gap-ms", type=float, default=20.0, help="pause between a first event and the next send")
    ap.add_argument("--linger-ms", type=int, default=0, help="the producer's linger_ms (the client's is 0)")
    ap.add_argument("--json-out", default=None, help="also write the figures as JSON here")
    args = ap.parse_args()
    if args.jobs < 1 or args.gap_ms < 0 or args.linger_ms < 0:
        ap.error("--jobs must be >= 1, --gap-ms and --linger-ms >= 0")
    res = asyncio.run(run(args))
    report(res)
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
