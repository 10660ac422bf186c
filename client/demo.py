"""The README's demo, after the worker is up: produce a few jobs and print their tokens as they arrive.

    python -m stoker.client.demo [--bootstrap-servers ...] [--redis-url ...]   (ops/demo runs it; --help)

Uses client.Client (subscribe before produce, so no token is missed); the jobs run concurrently and each
line of output is tagged with its request, so the interleaving shows the continuous batching.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import click
from stoker.client.client import Client
from stoker.client.options import kafka_options, option, redis_options, resolve_aliases, version_option
from stoker.schemas import Chunk

# The demo model writes stdlib-docstring English (stoker.engine.train_demo), so the prompts open docstrings. A
# model this small repeats its likeliest sentence when greedy; a mild repetition penalty moves it on.
PROMPTS = [
    ("greedy", {"prompt": "Return the", "max_tokens": 32, "temperature": 0.0, "repetition_penalty": 1.2}),
    ("sample", {"prompt": "This module provides", "max_tokens": 32, "temperature": 0.7, "seed": 1,
                "repetition_penalty": 1.2}),
    ("chat", {"messages": [{"role": "user", "content": "Open a file."}], "max_tokens": 24, "temperature": 0.0}),
]


async def follow(client: Client, name: str, params: dict[str, Any]) -> None:
    started = time.monotonic()
    async for event in client.stream(**params):
        if isinstance(event, Chunk):
            print(f"[{name:>6} +{(time.monotonic() - started) * 1000:6.0f} ms] {event.text!r}", flush=True)
        else:
            print(f"[{name:>6}] done: finish_reason={event.finish_reason} tokens={event.usage.completion_tokens} "
                  f"ttft={event.timings.ttft_ms:.0f} ms total={event.timings.total_ms:.0f} ms "
                  f"worker={event.worker}\n         text: {event.text!r}", flush=True)


async def run(params: dict[str, Any]) -> None:
    async with Client(params["bootstrap_servers"], params["redis_url"], topic=params["job_topic"],
                      prefix=params["prefix"], timeout=params["timeout"]) as client:
        await asyncio.gather(*(follow(client, name, job) for name, job in PROMPTS))


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@kafka_options
@redis_options
@option("--timeout", type=float, default=120.0, help="seconds to wait for each answer")
@version_option("stoker-demo")
def main(**params: Any) -> None:
    """Produce a few jobs and print their tokens as they arrive (after ops/demo started the worker)."""
    resolve_aliases(params, "stoker-demo")
    asyncio.run(run(params))


if __name__ == "__main__":
    main()
