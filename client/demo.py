"""The README's demo, after the worker is up: produce a few jobs and print their tokens as they arrive.

    python -m stoker.client.demo [--bootstrap-servers ...] [--redis-url ...]   (ops/demo runs it)

Uses client.Client (subscribe before produce, so no token is missed); the jobs run concurrently and each
line of output is tagged with its request, so the interleaving shows the continuous batching.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time

from stoker.client.client import Client
from stoker.schemas import Chunk

# The demo model writes stdlib-docstring English (stoker.engine.train_demo), so the prompts open docstrings. A
# model this small repeats its likeliest sentence when greedy; a mild repetition penalty moves it on.
PROMPTS = [
    ("greedy", {"prompt": "Return the", "max_tokens": 32, "temperature": 0.0, "repetition_penalty": 1.2}),
    ("sample", {"prompt": "This module provides", "max_tokens": 32, "temperature": 0.7, "seed": 1,
                "repetition_penalty": 1.2}),
    ("chat", {"messages": [{"role": "user", "content": "Open a file."}], "max_tokens": 24, "temperature": 0.0}),
]


async def follow(client: Client, name: str, params: dict) -> None:
    started = time.monotonic()
    async for event in client.stream(**params):
        if isinstance(event, Chunk):
            print(f"[{name:>6} +{(time.monotonic() - started) * 1000:6.0f} ms] {event.text!r}", flush=True)
        else:
            print(f"[{name:>6}] done: finish_reason={event.finish_reason} tokens={event.usage.completion_tokens} "
                  f"ttft={event.timings.ttft_ms:.0f} ms total={event.timings.total_ms:.0f} ms "
                  f"worker={event.worker}\n         text: {event.text!r}", flush=True)


async def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bootstrap-servers", default=os.environ.get("KAFKA_BOOTSTRAP_SERVERS", "127.0.0.1:9092"))
    parser.add_argument("--redis-url", default=os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0"))
    parser.add_argument("--job-topic", default=os.environ.get("STOKER_JOB_TOPIC", "stoker.jobs"))
    parser.add_argument("--prefix", default=os.environ.get("STOKER_PREFIX", "stoker"))
    parser.add_argument("--timeout", type=float, default=120.0)
    args = parser.parse_args()
    async with Client(args.bootstrap_servers, args.redis_url, topic=args.job_topic, prefix=args.prefix,
                      timeout=args.timeout) as client:
        await asyncio.gather(*(follow(client, name, params) for name, params in PROMPTS))
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
