"""Kafka's own produce -> fetch latency on this machine, without the worker: one producer and one consumer
in one process, sequential records on a fresh one-partition topic, time from `send()` to the consumer's
`getmany()` returning the record. Run against the local stack:

    PYTHONPATH=. python3 ops/bench_kafka_rtt.py [--bootstrap-servers 127.0.0.1:9092] [--records 200]

It separates the broker's share of the queue's TTFT (bench_e2e's stage "polled") from the worker's.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
import uuid

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from aiokafka.admin import AIOKafkaAdminClient, NewTopic


async def measure(bootstrap: str, records: int, linger_ms: int, acks: str | int, gap_s: float = 0.0) -> list[float]:
    """send -> fetched ms of each record; `gap_s` idles before each send (a lone request arrives at an idle
    broker: on the 2-core VM a 20 ms gap read 3.0-3.5 ms p50 against 1.5-2.5 back to back)."""
    topic = f"rtt.{uuid.uuid4().hex[:8]}"
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        await admin.create_topics([NewTopic(topic, 1, 1)])
    finally:
        await admin.close()
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, linger_ms=linger_ms, acks=acks)
    consumer = AIOKafkaConsumer(topic, bootstrap_servers=bootstrap, auto_offset_reset="latest",
                                group_id=f"rtt-{topic}", enable_auto_commit=False)
    await producer.start()
    await consumer.start()
    try:
        while not consumer.assignment():
            await asyncio.sleep(0.05)
        await consumer.getmany(timeout_ms=500)  # the fetch session is set up before timing
        samples = []
        for i in range(records):
            if gap_s:
                await asyncio.sleep(gap_s)
            sent = time.perf_counter()
            await producer.send(topic, str(i).encode())
            got = False
            while not got:
                batch = await consumer.getmany(timeout_ms=1000)
                got = any(batch.values())
            samples.append((time.perf_counter() - sent) * 1000)
        return samples
    finally:
        await consumer.stop()
        await producer.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bootstrap-servers", default="127.0.0.1:9092")
    ap.add_argument("--records", type=int, default=200)
    ap.add_argument("--gap-ms", type=float, default=0.0, help="idle before each send (0: back to back)")
    args = ap.parse_args()
    print(f"| producer settings ({args.gap_ms:g} ms idle before each send) | p50 ms | p90 ms | p99 ms | max ms |")
    print("|---|---|---|---|---|")
    for linger_ms, acks in ((0, "all"), (2, "all"), (0, 1)):
        samples = sorted(asyncio.run(measure(args.bootstrap_servers, args.records, linger_ms, acks, args.gap_ms / 1000)))
        print(f"| linger_ms={linger_ms}, acks={acks} | {statistics.median(samples):.2f} | {_pick(samples, 0.9):.2f} "
              f"| {_pick(samples, 0.99):.2f} | {samples[-1]:.2f} |")


def _pick(ordered: list[float], q: float) -> float:
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


if __name__ == "__main__":
    main()
