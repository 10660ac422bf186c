"""The `stoker` command: submit, tail, workers, load, stack.

Connection settings come from flags or the same environment variables the worker reads
(KAFKA_BOOTSTRAP_SERVERS, REDIS_URL, STOKER_PREFIX, STOKER_JOB_TOPIC). Exit codes: 0 done (whatever the
finish_reason), 1 the request ended with an error event (or the client failed), 2 bad usage, 3 timeout (also
a job Kafka would not take in time, e.g. a topic that does not exist), 4 Kafka or Redis unreachable or
failing, 130 interrupted (the job is cancelled first). Every failure is one line on stderr, no traceback.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from pathlib import Path
from typing import Any

import msgspec
from aiokafka.errors import KafkaError
from redis.exceptions import RedisError
from stoker.client.client import (
    DEFAULT_BOOTSTRAP,
    DEFAULT_REDIS_URL,
    Client,
    ClientError,
    RequestFailed,
    RequestTimeout,
)
from stoker.client.load import LoadConfig, plot_latency, run_load
from stoker.schemas import Chunk, Done
from stoker.schemas import Error as ErrorEvent

from stoker import schemas

EXIT_FAILED, EXIT_TIMEOUT, EXIT_UNREACHABLE, EXIT_INTERRUPTED = 1, 3, 4, 130


def _connection_flags(p: argparse.ArgumentParser) -> None:
    env = os.environ.get
    p.add_argument("--bootstrap", default=env("KAFKA_BOOTSTRAP_SERVERS", DEFAULT_BOOTSTRAP),
                   help="Kafka bootstrap servers (env KAFKA_BOOTSTRAP_SERVERS)")
    p.add_argument("--redis-url", default=env("REDIS_URL", DEFAULT_REDIS_URL), help="Redis URL (env REDIS_URL)")
    p.add_argument("--prefix", default=env("STOKER_PREFIX", schemas.REDIS_PREFIX),
                   help="Redis key prefix (env STOKER_PREFIX)")
    p.add_argument("--topic", default=env("STOKER_JOB_TOPIC", schemas.JOBS_TOPIC),
                   help="job topic (env STOKER_JOB_TOPIC)")
    p.add_argument("--msgpack", action="store_true", help="send the job (and get events) as MessagePack")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds to wait for the terminal event")


def _sampling_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=int)
    p.add_argument("--min-tokens", type=int)
    p.add_argument("--temperature", type=float)
    p.add_argument("--top-p", type=float)
    p.add_argument("--top-k", type=int)
    p.add_argument("--min-p", type=float)
    p.add_argument("--seed", type=int)
    p.add_argument("--presence-penalty", type=float)
    p.add_argument("--frequency-penalty", type=float)
    p.add_argument("--repetition-penalty", type=float)
    p.add_argument("--stop", action="append", help="a stop string (repeat for several)")
    p.add_argument("--ignore-eos", action="store_true", default=None)
    p.add_argument("--logprobs", type=int)
    p.add_argument("--priority", type=int)
    p.add_argument("--model")
    p.add_argument("--tenant")


SAMPLING_FIELDS = ("max_tokens", "min_tokens", "temperature", "top_p", "top_k", "min_p", "seed",
                   "presence_penalty", "frequency_penalty", "repetition_penalty", "stop", "ignore_eos",
                   "logprobs", "priority", "model", "tenant")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="stoker", description="Stoker client: submit jobs, follow them, load-test")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("submit", help="submit a prompt and stream the answer")
    p.add_argument("prompt", help="the prompt (with --chat: the user message)")
    p.add_argument("--chat", action="store_true", help="send as a chat (messages) job")
    p.add_argument("--system", help="with --chat: a system message first")
    p.add_argument("--request-id", help="default: a fresh uuid4")
    p.add_argument("--json", action="store_true", help="print every event as one JSON line")
    _connection_flags(p)
    _sampling_flags(p)

    p = sub.add_parser("tail", help="follow a request's events from its stream until it ends")
    p.add_argument("request_id")
    p.add_argument("--json", action="store_true", help="print every event as one JSON line")
    _connection_flags(p)

    p = sub.add_parser("workers", help="list live workers from their heartbeats")
    p.add_argument("--json", action="store_true")
    _connection_flags(p)

    p = sub.add_parser("load", help="load-test: N jobs at a rate, report TTFT / ITL / e2e")
    p.add_argument("-n", "--num-requests", type=int, default=100)
    p.add_argument("--rate", type=float, default=0.0, help="requests per second (0 = all at once)")
    p.add_argument("--prompt-len", type=int, default=32, help="prompt tokens (sent as token ids)")
    p.add_argument("--output-len", type=int, default=32, help="output tokens (ignore_eos holds the length)")
    p.add_argument("--prompt-text", help="send this text as every prompt instead of token ids")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--plot", type=Path, help="write a PNG of latency over time here")
    p.add_argument("--no-progress", action="store_true")
    _connection_flags(p)

    p = sub.add_parser("stack", help="start/stop/inspect the local Kafka + Redis stack")
    p.add_argument("action", choices=["up", "down", "status"])
    p.add_argument("stack_args", nargs=argparse.REMAINDER, help="passed on to the stack launcher")
    return parser


def _client(args: argparse.Namespace) -> Client:
    return Client(args.bootstrap, args.redis_url, prefix=args.prefix, topic=args.topic, msgpack=args.msgpack,
                  timeout=args.timeout)


def _json_line(event: Any) -> str:
    return msgspec.json.encode(event).decode()


async def _submit(args: argparse.Namespace) -> int:
    params = {name: getattr(args, name) for name in SAMPLING_FIELDS if getattr(args, name) is not None}
    if args.chat:
        messages = ([{"role": "system", "content": args.system}] if args.system else [])
        params["messages"] = messages + [{"role": "user", "content": args.prompt}]
    else:
        params["prompt"] = args.prompt
    client = _client(args)
    job = client.make_job(request_id=args.request_id, **params)  # validated before any connection is made
    async with client:
        print(f"request_id {job.request_id}", file=sys.stderr, flush=True)
        async for event in client.run(job, timeout=args.timeout):
            if args.json:
                print(_json_line(event), flush=True)
            elif isinstance(event, Chunk):
                sys.stdout.write(event.text)
                sys.stdout.flush()
            elif isinstance(event, Done):
                u = event.usage
                print(f"\n[{event.finish_reason}] prompt {u.prompt_tokens} + completion {u.completion_tokens} "
                      f"tokens, ttft {event.timings.ttft_ms:.1f} ms, total {event.timings.total_ms:.1f} ms",
                      file=sys.stderr)
    return 0


async def _tail(args: argparse.Namespace) -> int:
    async with _client(args) as client:
        async for event in client.tail(args.request_id, timeout=args.timeout):
            if args.json:
                print(_json_line(event), flush=True)
            elif isinstance(event, Chunk):
                sys.stdout.write(event.text)
                sys.stdout.flush()
            elif isinstance(event, Done):
                print(f"\n[{event.finish_reason}] attempt {event.attempt}", file=sys.stderr)
            elif isinstance(event, ErrorEvent):
                print(f"\nerror {event.code}: {event.message}", file=sys.stderr)
                return EXIT_FAILED
    return 0


async def _workers(args: argparse.Namespace) -> int:
    async with _client(args) as client:
        workers = await client.workers()
    if args.json:
        print(msgspec.json.encode([w.info | {"worker_id": w.worker_id} for w in workers]).decode())
        return 0
    if not workers:
        print(f"no live workers under prefix {args.prefix!r}", file=sys.stderr)
        return 0
    print(f"{'worker':<36} {'model':<30} {'running':>8} {'capacity':>9}  version")
    for w in workers:
        running = w.info.get("running", "-")
        print(f"{w.worker_id:<36} {w.model or '-':<30} {running!s:>8} {w.capacity!s:>9}  {w.version or '-'}")
    return 0


async def _load(args: argparse.Namespace) -> int:
    cfg = LoadConfig(num_requests=args.num_requests, rate=args.rate, prompt_len=args.prompt_len,
                     output_len=args.output_len, prompt_text=args.prompt_text, temperature=args.temperature,
                     timeout=args.timeout, seed=args.seed)
    async with _client(args) as client:
        report = await run_load(client, cfg, progress=not args.no_progress)
    print(report.table())
    if args.plot is not None:
        args.plot.write_bytes(plot_latency(report))
        print(f"plot: {args.plot} (red e2e, blue TTFT, ms against start time, s)", file=sys.stderr)
    return EXIT_FAILED if report.errors() else 0


def _stack(args: argparse.Namespace) -> int:
    from stoker.devstack import (
        stack,  # standard library only; imported here so the other commands never need it
    )

    return int(stack.main([args.action, *args.stack_args]) or 0)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "stack":
        return _stack(args)
    handler = {"submit": _submit, "tail": _tail, "workers": _workers, "load": _load}[args.command]
    try:
        return asyncio.run(handler(args))
    except schemas.ContractError as exc:  # a bad flag value, caught before anything was sent
        print(f"stoker: invalid job: {exc}", file=sys.stderr)
        return 2
    except RequestFailed as exc:
        print(f"\nstoker: {exc}", file=sys.stderr)
        return EXIT_FAILED
    except RequestTimeout as exc:  # before OSError below: a TimeoutError is an OSError
        print(f"\nstoker: {exc}", file=sys.stderr)
        return EXIT_TIMEOUT
    except ClientError as exc:
        print(f"\nstoker: {exc}", file=sys.stderr)
        return EXIT_FAILED
    except RedisError as exc:
        print(f"stoker: Redis ({args.redis_url}) failed: {type(exc).__name__}: {exc}; is the stack up? "
              "(`stoker stack status`)", file=sys.stderr)
        return EXIT_UNREACHABLE
    except KafkaError as exc:  # KafkaConnectionError, or KafkaTimeoutError from a broker that stopped answering
        print(f"stoker: Kafka ({args.bootstrap}) failed: {type(exc).__name__}: {exc}; is the stack up? "
              "(`stoker stack status`)", file=sys.stderr)
        return EXIT_UNREACHABLE
    except (ValueError, OSError) as exc:  # a bad --timeout, an unwritable --plot path
        print(f"stoker: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # asyncio.run cancelled the task: Client.run's finally has sent the cancel
        print("\nstoker: interrupted; the request was cancelled", file=sys.stderr)
        return EXIT_INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
