"""The `stoker` command: submit, tail, workers, load, batch, stack.

Connection settings come from flags or the same environment variables the worker reads, under the worker's
flag names (--bootstrap-servers KAFKA_BOOTSTRAP_SERVERS, --redis-url REDIS_URL, --prefix STOKER_PREFIX,
--job-topic STOKER_JOB_TOPIC; client.options); each subcommand offers only those it uses. Exit codes: 0 done
(whatever the finish_reason), 1 the request ended with an error event, the client failed, or `tail` found
nothing of the request (without --wait), 2 bad usage, 3 timeout (also a job Kafka would not take in time, e.g.
a topic that does not exist), 4 Kafka or Redis unreachable or failing, 130 interrupted (the job is cancelled
first). Every failure is one line on stderr, no traceback: aiokafka's own log lines (repeated metadata
warnings while a broker or topic is missing) are shown only with --verbose.
"""

from __future__ import annotations

import asyncio
import logging
import sys
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

import click
import msgspec
from aiokafka.errors import KafkaError
from redis.exceptions import RedisError
from stoker.client.client import DEFAULT_BOOTSTRAP, Client, ClientError, RequestFailed, RequestTimeout
from stoker.client.load import LoadConfig, plot_latency, run_load
from stoker.client.options import kafka_options, option, redis_options, resolve_aliases, version_option
from stoker.schemas import Chunk, Done, Event
from stoker.schemas import Error as ErrorEvent

from stoker import schemas

EXIT_FAILED, EXIT_USAGE, EXIT_TIMEOUT, EXIT_UNREACHABLE, EXIT_INTERRUPTED = 1, 2, 3, 4, 130
PROG = "stoker"


def _timeout_option(default: float, what: str) -> Callable[[Any], Any]:
    return option("--timeout", type=float, default=default, help=f"seconds to wait for {what}")


def _msgpack_option(f: Any) -> Any:
    return option("--msgpack", is_flag=True, help="send the job (and get its events) as MessagePack")(f)


def _json_option(f: Any) -> Any:
    return option("--json", "as_json", is_flag=True, help="print every event as one JSON line")(f)


SAMPLING_FIELDS = ("max_tokens", "min_tokens", "temperature", "top_p", "top_k", "min_p", "seed",
                   "presence_penalty", "frequency_penalty", "repetition_penalty", "stop", "ignore_eos",
                   "logprobs", "priority", "model", "tenant")


def _sampling_options(f: Any) -> Any:
    """The job's fields (schemas/job.schema.json says each one's range); unset ones are left out of the job."""
    for decl, kind, text in reversed([
        ("--max-tokens", int, "most tokens to generate"),
        ("--min-tokens", int, "fewest tokens before a stop or eos counts"),
        ("--temperature", float, "0 is greedy"),
        ("--top-p", float, "nucleus sampling mass"),
        ("--top-k", int, "sample from the k most likely tokens"),
        ("--min-p", float, "drop tokens below this share of the top one's probability"),
        ("--seed", int, "sampling seed (same seed, same answer)"),
        ("--presence-penalty", float, "OpenAI presence penalty"),
        ("--frequency-penalty", float, "OpenAI frequency penalty"),
        ("--repetition-penalty", float, "multiplicative repetition penalty (1 = off)"),
        ("--logprobs", int, "top logprobs per token to return"),
        ("--priority", int, "lower runs first"),
        ("--model", str, "served model name the job asks for"),
        ("--tenant", str, "tenant label (metrics, fairness)"),
    ]):
        f = option(decl, type=kind, default=None, show_default=False, help=text)(f)
    f = option("--ignore-eos", is_flag=True, default=None, help="keep generating past the eos token")(f)
    return option("--stop", multiple=True, help="a stop string (repeat for several)")(f)


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110})
@version_option(PROG)
@click.option("-v", "--verbose", is_flag=True, help="show the Kafka and Redis libraries' own log lines")
def cli(verbose: bool) -> None:
    """Stoker client: submit jobs, follow them, list workers, load-test, run the local stack."""
    # aiokafka logs a warning per metadata retry while a broker or topic is missing; the command reports the
    # failure itself, once, so the library's lines would only repeat it.
    logging.basicConfig(level=logging.INFO if verbose else logging.CRITICAL, format="%(name)s: %(message)s")
    logging.getLogger("aiokafka").setLevel(logging.INFO if verbose else logging.CRITICAL + 1)


def _json_line(event: Any) -> str:
    return msgspec.json.encode(event).decode()


class _Failed(Exception):
    """A one-line failure with its exit code (the line is printed by main)."""

    def __init__(self, message: str, code: int):
        super().__init__(message)
        self.code = code


def _run(work: Coroutine[Any, Any, int], params: dict[str, Any]) -> int:
    """Runs a subcommand's coroutine, turning every failure a person can meet into one line and an exit code."""
    try:
        return asyncio.run(work)
    except schemas.ContractError as exc:  # a bad flag value, caught before anything was sent
        raise _Failed(f"invalid job: {exc}", EXIT_USAGE) from None
    except RequestFailed as exc:
        raise _Failed(f"\n{PROG}: {exc}", EXIT_FAILED) from None
    except RequestTimeout as exc:  # before OSError below: a TimeoutError is an OSError
        raise _Failed(f"\n{PROG}: {exc}", EXIT_TIMEOUT) from None
    except ClientError as exc:
        raise _Failed(f"\n{PROG}: {exc}", EXIT_FAILED) from None
    except RedisError as exc:
        raise _Failed(f"Redis ({params.get('redis_url')}) failed: {type(exc).__name__}: {exc}; is the stack up? "
                      "(`stoker stack status`)", EXIT_UNREACHABLE) from None
    except KafkaError as exc:  # KafkaConnectionError, or KafkaTimeoutError from a broker that stopped answering
        raise _Failed(f"Kafka ({params.get('bootstrap_servers')}) failed: {type(exc).__name__}: {exc}; is the "
                      "stack up? (`stoker stack status`)", EXIT_UNREACHABLE) from None
    except (ValueError, OSError) as exc:  # a bad --timeout, an unwritable --json or --plot path
        raise _Failed(str(exc), EXIT_USAGE) from None
    except KeyboardInterrupt:  # asyncio.run cancelled the task: Client.run's finally has sent the cancel
        raise _Failed(f"\n{PROG}: interrupted; the request was cancelled", EXIT_INTERRUPTED) from None


def _client(params: dict[str, Any]) -> Client:
    # tail and workers read Redis only: they offer no Kafka flags, and the client never connects to Kafka
    return Client(params.get("bootstrap_servers") or DEFAULT_BOOTSTRAP, params["redis_url"], prefix=params["prefix"], topic=params.get("job_topic") or schemas.JOBS_TOPIC,
                  msgpack=params.get("msgpack", False), timeout=params["timeout"])


@cli.command()
@click.argument("prompt")
@option("--chat", is_flag=True, help="send as a chat (messages) job")
@option("--system", default=None, help="with --chat: a system message first")
@option("--request-id", default=None, show_default=False, help="the job's id (default: a fresh uuid4)")
@_json_option
@_sampling_options
@kafka_options
@redis_options
@_msgpack_option
@_timeout_option(300.0, "the terminal event")
def submit(**params: Any) -> int:
    """Submit PROMPT and stream the answer (PROMPT `-`: read it from stdin; with --chat, the user message)."""
    resolve_aliases(params, PROG)
    if params["prompt"] == "-":
        params["prompt"] = sys.stdin.read().rstrip("\n")
        if not params["prompt"]:
            raise click.BadParameter("stdin was empty", param_hint="PROMPT")
    return _run(_submit(params), params)


async def _submit(params: dict[str, Any]) -> int:
    job_fields = {name: params[name] for name in SAMPLING_FIELDS if params[name] not in (None, ())}
    if "stop" in job_fields:
        job_fields["stop"] = list(job_fields["stop"])
    if params["chat"]:
        messages = [{"role": "system", "content": params["system"]}] if params["system"] else []
        job_fields["messages"] = messages + [{"role": "user", "content": params["prompt"]}]
    else:
        job_fields["prompt"] = params["prompt"]
    client = _client(params)
    job = client.make_job(request_id=params["request_id"], **job_fields)  # validated before any connection
    async with client:
        print(f"request_id {job.request_id}", file=sys.stderr, flush=True)
        async for event in client.run(job, timeout=params["timeout"]):
            if _echo_stream(event, params["as_json"]):
                continue
            if isinstance(event, Done):
                u = event.usage
                print(f"\n[{event.finish_reason}] prompt {u.prompt_tokens} + completion {u.completion_tokens} "
                      f"tokens, ttft {event.timings.ttft_ms:.1f} ms, total {event.timings.total_ms:.1f} ms",
                      file=sys.stderr)
    return 0


def _echo_stream(event: Event, as_json: bool) -> bool:
    """Writes what `run` and `tail` print alike (an event as a JSON line, or a chunk's text as it comes);
    False for the events each prints its own way (its end: done, error)."""
    if as_json:
        print(_json_line(event), flush=True)
        return True
    if isinstance(event, Chunk):
        sys.stdout.write(event.text)
        sys.stdout.flush()
        return True
    return False

@cli.command()
@click.argument("request_id")
@option("--wait", is_flag=True, help="wait for a request that nothing in Redis knows yet (up to --timeout)")
@_json_option
@redis_options
@_timeout_option(300.0, "the terminal event")
def tail(**params: Any) -> int:
    """Follow REQUEST_ID's events from its stream until it ends (a finished one is replayed)."""
    return _run(_tail(params), params)


async def _tail(params: dict[str, Any]) -> int:
    request_id = params["request_id"]
    async with _client(params) as client:
        if not params["wait"] and not await client.known(request_id):
            raise _Failed(f"request {request_id!r}: nothing of it in Redis (no stream, no result, no claim): not "
                          "started yet, or unknown; --wait waits for it", EXIT_FAILED)
        async for event in client.tail(request_id, timeout=params["timeout"]):
            if _echo_stream(event, params["as_json"]):
                continue
            if isinstance(event, Done):
                print(f"\n[{event.finish_reason}] attempt {event.attempt}", file=sys.stderr)
            elif isinstance(event, ErrorEvent):
                print(f"\nerror {event.code}: {event.message}", file=sys.stderr)
                return EXIT_FAILED
    return 0


@cli.command()
@option("--json", "as_json", is_flag=True, help="print the list as JSON")
@redis_options
def workers(**params: Any) -> int:
    """List live workers from their heartbeats: topic, group, models served, load."""
    params["timeout"] = 300.0
    return _run(_workers(params), params)


async def _workers(params: dict[str, Any]) -> int:
    async with _client(params) as client:
        found = await client.workers()
    if params["as_json"]:
        print(msgspec.json.encode([w.info | {"worker_id": w.worker_id} for w in found]).decode())
        return 0
    if not found:
        print(f"no live workers under prefix {params['prefix']!r}", file=sys.stderr)
        return 0
    print(f"{'worker':<36} {'topic':<24} {'group':<20} {'models':<30} {'running':>8} {'capacity':>9}  version")
    for w in found:
        running, models = w.info.get("running", "-"), ",".join(w.models) or "-"
        print(f"{w.worker_id:<36} {w.topic or '-':<24} {w.group or '-':<20} {models:<30} {running!s:>8} "
              f"{w.capacity!s:>9}  {w.version or '-'}")
    return 0


@cli.command()
@option("-n", "--num-requests", type=int, default=100, help="jobs to send")
@option("--rate", type=float, default=0.0, help="requests per second (0 = all at once)")
@option("--prompt-len", type=int, default=32, help="prompt tokens (sent as token ids)")
@option("--output-len", type=int, default=32, help="output tokens (ignore_eos holds the length)")
@option("--prompt-text", default=None, help="send this text as every prompt instead of token ids")
@option("--temperature", type=float, default=0.0, help="0 is greedy")
@option("--seed", type=int, default=0, help="seed of the prompts' token ids")
@option("--json", "json_path", type=click.Path(dir_okay=False, path_type=Path), default=None,
        help="write the results (settings, summaries, one row per request) to this JSON file")
@option("--plot", type=click.Path(dir_okay=False, path_type=Path), default=None,
        help="draw latency over time and the TPOT histogram to this PNG/SVG/PDF (needs stoker[plot])")
@option("--no-progress", is_flag=True, help="no progress bar")
@kafka_options
@redis_options
@_msgpack_option
@_timeout_option(120.0, "each request's terminal event")
def load(**params: Any) -> int:
    """Load-test: N jobs at a rate; report TTFT, TPOT, ITL and e2e latency."""
    resolve_aliases(params, PROG)
    return _run(_load(params), params)


async def _load(params: dict[str, Any]) -> int:
    cfg = LoadConfig(num_requests=params["num_requests"], rate=params["rate"], prompt_len=params["prompt_len"],
                     output_len=params["output_len"], prompt_text=params["prompt_text"],
                     temperature=params["temperature"], timeout=params["timeout"], seed=params["seed"])
    async with _client(params) as client:
        report = await run_load(client, cfg, progress=not params["no_progress"])
    print(report.table())
    if params["json_path"] is not None:
        params["json_path"].write_text(msgspec.json.encode(report.to_json()).decode() + "\n")
        print(f"results: {params['json_path']}", file=sys.stderr)
    if params["plot"] is not None:
        plot_latency(report, str(params["plot"]))
        print(f"plot: {params['plot']}", file=sys.stderr)
    return EXIT_FAILED if report.errors() else 0


@cli.command()
@click.argument("input_path", metavar="INPUT.jsonl", required=False,
                type=click.Path(exists=True, dir_okay=False, path_type=Path))
@option("--gateway", env="STOKER_GATEWAY_URL", default="http://127.0.0.1:8000/v1", help="the gateway's /v1 URL")
@option("--api-key", env="STOKER_API_KEY", default=None, show_default=False, help="the gateway's API key")
@option("--endpoint", type=click.Choice(["/v1/chat/completions", "/v1/completions"]), default=None,
        show_default=False, help="the batch's endpoint (default: the first request's url)")
@option("--completion-window", default="24h", help="time the batch may take (each job's deadline)")
@option("--follow", "batch_id", default=None, show_default=False,
        help="follow a batch already submitted (by id) instead of submitting INPUT.jsonl")
@option("-o", "--output", type=click.Path(dir_okay=False, path_type=Path), default=None, show_default=False,
        help="where the output file goes (default: INPUT.output.jsonl, or BATCH_ID.output.jsonl)")
@option("--errors", type=click.Path(dir_okay=False, path_type=Path), default=None, show_default=False,
        help="where the error file goes, when there is one (default: beside the output, .errors.jsonl)")
@option("--poll", type=float, default=1.0, help="seconds between progress checks")
@option("--no-progress", is_flag=True, help="no progress bar")
def batch(**params: Any) -> int:
    """Run INPUT.jsonl (OpenAI batch lines) through a gateway's Batch API and write its output file.
    Interrupting leaves the batch running: `--follow BATCH_ID` picks it up again."""
    from stoker.client.batch_command import run_batch_command  # httpx only where it is used

    return run_batch_command(params)


@cli.command(context_settings={"ignore_unknown_options": True, "allow_extra_args": True},
             add_help_option=False)
@click.argument("action", type=click.Choice(["up", "down", "status"]))
@click.argument("stack_args", nargs=-1, type=click.UNPROCESSED)
def stack(action: str, stack_args: tuple[str, ...]) -> int:
    """Start, stop or inspect the local Kafka + Redis stack (the rest goes to the launcher: `stoker stack up
    --help`)."""
    from stoker.devstack import (
        stack as launcher,  # standard library only; imported here so the other commands never need it
    )

    return int(launcher.main([action, *stack_args]) or 0)


def main(argv: list[str] | None = None) -> int:
    try:
        code = cli.main(args=argv, prog_name=PROG, standalone_mode=False)
    except _Failed as exc:
        message = str(exc)
        print(message if message.startswith("\n") else f"{PROG}: {message}", file=sys.stderr)
        return exc.code
    except click.ClickException as exc:  # bad usage: click's own one-line message (and the usage line)
        exc.show()
        return exc.exit_code
    except click.Abort:
        print(f"\n{PROG}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    return code if isinstance(code, int) else 0


if __name__ == "__main__":
    sys.exit(main())
