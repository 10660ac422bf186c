"""Where a lone job's time to first event goes, hop by hop, with the stand-in engine (no model: the queue's
share of W1's TTFT). One `stoker-worker --fake-engine` in its own process (as ops/bench_transport.py starts it);
jobs from the real client (`Client.stream`, what `stoker load` and ops/bench_e2e.py use), one at a time;
a plain consumer in a second process (another group, the same topic) sees each record beside the worker:

    PYTHONPATH=. python3 ops/bench_ttft.py [--jobs 200] [--gaps-ms 0,50]          # against the local stack
    source ops/gpu_stack_env && python3 ops/bench_ttft.py --stack start ...       # a private stack (GPU machine)

Per job, in one clock (time.time(), all processes on this machine): the client's start (before subscribing),
its produce call, the broker's ack, the record's CreateTime (the producer's, truncated to the millisecond),
the plain consumer's getmany() return, the first chunk at the subscriber. On the worker's side, its stage
histogram (stoker_job_stage_seconds, means over the phase's jobs, from the record's CreateTime): polled,
claimed, engine_added, first_output, published. If the worker polls later than the plain consumer, the time
is ours; if both see the record late, it is the broker's or the producer's.
`--gaps-ms 0` sends each job the moment the previous one's done event arrived (ops/bench_e2e.py's W1: the
worker's offset commit of the previous job meets the next produce); a larger gap lets everything settle.
Kafka's own send -> fetch (ops/bench_kafka_rtt.py: one producer and one consumer, a one-partition topic) runs
before and after the jobs: a freshly started broker's JVM runs its request path interpreted at first.
`--json-out` writes every figure.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "ops")]

from aiokafka import AIOKafkaConsumer  # noqa: E402
from bench_kafka_rtt import measure as kafka_rtt  # noqa: E402
from bench_transport import WorkerProc, stage_table  # noqa: E402
from stoker.client.client import Client  # noqa: E402
from stoker.schemas import Job  # noqa: E402

# (label, from, to): the hops of one job, keys of its timeline (epoch seconds)
HOPS = (
    ("client start -> produce call", "start", "send"),
    ("produce call -> record CreateTime", "send", "created"),
    ("produce call -> broker ack", "send", "acked"),
    ("CreateTime -> plain consumer fetch", "created", "fetched"),
    ("produce call -> plain consumer fetch", "send", "fetched"),
    ("produce call -> first chunk", "send", "first"),
    ("client start -> first chunk (TTFT)", "start", "first"),
)


class TimedClient(Client):
    """The real client; its produce call is timed (the client subscribes before it, as always)."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.sends: dict[str, tuple[float, float]] = {}  # request id -> (produce call, broker ack)

    async def submit(self, job: Job, *, topic: str | None = None) -> None:
        sent = time.time()
        await super().submit(job, topic=topic)
        self.sends[job.request_id] = (sent, time.time())


def summary(samples: list[float]) -> dict[str, float]:
    ordered = sorted(samples)
    return {"n": len(ordered), "mean": statistics.fmean(ordered), "p50": statistics.median(ordered),
            "p90": ordered[int(0.9 * (len(ordered) - 1))], "p99": ordered[int(0.99 * (len(ordered) - 1))]}


async def observe(bootstrap: str, topic: str) -> None:
    """The plain consumer (a child process): one JSON line per record, after a `ready` line."""
    consumer = AIOKafkaConsumer(topic, bootstrap_servers=bootstrap, group_id=f"observer-{topic}",
                                enable_auto_commit=False, auto_offset_reset="earliest")
    await consumer.start()
    try:
        while not consumer.assignment():
            await asyncio.sleep(0.05)
        print("ready", flush=True)
        while True:
            batches = await consumer.getmany(timeout_ms=200)
            fetched = time.time()
            for records in batches.values():
                for rec in records:
                    key = rec.key.decode() if rec.key else ""
                    print(json.dumps({"key": key, "created": rec.timestamp / 1000, "fetched": fetched}), flush=True)
    finally:
        await consumer.stop()


class Observer:
    def __init__(self, bootstrap: str, topic: str):
        self.proc = subprocess.Popen([sys.executable, __file__, "--observer", bootstrap, topic],
                                     stdout=subprocess.PIPE, text=True, cwd=ROOT)
        assert self.proc.stdout is not None
        if (line := self.proc.stdout.readline().strip()) != "ready":
            raise RuntimeError(f"the observer did not start: {line!r}")

    def stop(self) -> dict[str, dict[str, float]]:
        """Every record it saw: key -> {created, fetched}."""
        self.proc.terminate()
        out, _ = self.proc.communicate(timeout=10)
        seen = {}
        for line in out.splitlines():
            with contextlib.suppress(ValueError):
                row = json.loads(line)
                seen[row["key"]] = row
        return seen


async def one_job(client: TimedClient, rid: str, tokens: int) -> dict[str, float]:
    start = time.time()
    first = None
    async for _event in client.stream("bench", request_id=rid, max_tokens=tokens, ignore_eos=True):
        first = first or time.time()
    assert first is not None
    sent, acked = client.sends.pop(rid)
    return {"start": start, "send": sent, "acked": acked, "first": first}


async def phase(client: TimedClient, worker: WorkerProc, args: argparse.Namespace, gap_ms: float,
                tag: str) -> tuple[dict[str, dict[str, float]], list[tuple[str, float, float, float]]]:
    before = worker.metrics()
    rows = {}
    for i in range(args.jobs):
        if gap_ms:
            await asyncio.sleep(gap_ms / 1000)
        rid = f"{tag}-{i}"
        rows[rid] = await one_job(client, rid, args.tokens)
    return rows, stage_table(before, worker.metrics())


def hop_table(rows: dict[str, dict[str, float]]) -> dict[str, dict[str, float]]:
    out = {}
    for label, a, b in HOPS:
        samples = [(r[b] - r[a]) * 1000 for r in rows.values() if a in r and b in r]
        if samples:
            out[label] = summary(samples)
    return out


async def run(args: argparse.Namespace, bootstrap: str, redis_url: str) -> dict[str, Any]:
    res: dict[str, Any] = {"jobs": args.jobs, "tokens": args.tokens, "step_delay_ms": args.step_delay_ms,
                           "cpus": os.cpu_count(), "phases": {}}
    res["kafka_before"] = summary(await kafka_rtt(bootstrap, args.kafka_records, 0, "all"))
    engine_argv = None if args.model is None else [
        "--model", args.model, "--device", args.device, "--max-model-len", str(args.max_model_len)]
    res["engine"] = args.model or "stand-in"
    worker = await WorkerProc.start(bootstrap, redis_url, 64, args.step_delay_ms / 1000, 1000,
                                    engine_argv=engine_argv, ready_timeout_s=300)
    observer = Observer(bootstrap, worker.topic)
    phases = {}
    try:
        cpu0 = worker.cpu_s()
        for acks in args.acks:
            client = TimedClient(bootstrap, redis_url, prefix=worker.prefix, topic=worker.topic, timeout=30,
                                 kafka_options={"acks": acks if acks == "all" else int(acks)})
            async with client:
                for i in range(5):  # connections, metadata, the worker's script loads: not timed
                    await one_job(client, f"warm-{acks}-{i}", args.tokens)
                for gap in args.gaps_ms:
                    name = f"acks={acks}, gap {gap:g} ms"
                    phases[name] = await phase(client, worker, args, gap, f"acks{acks}-gap{gap:g}")
        res["worker_cpu_s"] = worker.cpu_s() - cpu0
    finally:
        seen = observer.stop()
        worker.stop()
    for name, (rows, stages) in phases.items():
        for rid, row in rows.items():
            row.update(seen.get(rid, {}))
        res["phases"][name] = {"hops": hop_table(rows),
                               "stages": [{"stage": s, "mean_ms": m, "p50_le_ms": p50, "p99_le_ms": p99}
                                          for s, m, p50, p99 in stages]}
    res["kafka_after"] = summary(await kafka_rtt(bootstrap, args.kafka_records, 0, "all"))
    res["kafka_after_acks1"] = summary(await kafka_rtt(bootstrap, args.kafka_records, 0, 1))
    return res


def report(res: dict[str, Any]) -> None:
    engine = "the stand-in engine" if res["engine"] == "stand-in" else f"the engine on {res['engine']}"
    print(f"\nlone-job hops with {engine} ({res['step_delay_ms']:g} ms stand-in steps, {res['tokens']} tokens): "
          f"{res['jobs']} jobs one at a time per phase, {res['cpus']} CPUs")
    head = f"{'(ms)':<40}{'mean':>8}{'p50':>8}{'p90':>8}{'p99':>8}"
    for name, ph in res["phases"].items():
        print(f"\n{name} (the client's producer acks; pause between a done event and the next job)\n{head}")
        for label, s in ph["hops"].items():
            print(f"{label:<40}{s['mean']:>8.2f}{s['p50']:>8.2f}{s['p90']:>8.2f}{s['p99']:>8.2f}")
        created = ph["hops"].get("CreateTime -> plain consumer fetch", {}).get("mean", float("nan"))
        print(f"worker stages from CreateTime (means; plain consumer's fetch: {created:.2f})")
        previous = 0.0
        for row in ph["stages"]:
            print(f"  {row['stage']:<14}{row['mean_ms']:>8.2f}  (+{row['mean_ms'] - previous:.2f})")
            previous = row["mean_ms"]
    print(f"\nKafka alone: send() -> fetched, one partition, sequential\n{head}")
    for label, key in (("before the jobs, acks=all", "kafka_before"), ("after the jobs, acks=all", "kafka_after"),
                       ("after the jobs, acks=1", "kafka_after_acks1")):
        s = res[key]
        print(f"{label:<40}{s['mean']:>8.2f}{s['p50']:>8.2f}{s['p90']:>8.2f}{s['p99']:>8.2f}")


@contextlib.contextmanager
def private_stack(args: argparse.Namespace) -> Iterator[tuple[str, str]]:
    """A stack of our own (own ports and folder), wiped after; or the one in the environment."""
    if args.stack == "external":
        yield (os.environ.get("KAFKA_BOOTSTRAP_SERVERS", "127.0.0.1:9092"),
               os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0"))
        return
    from stoker.devstack import stack as st

    cfg = st.StackConfig(kafka_port=args.kafka_port, controller_port=args.kafka_port + 1,
                         redis_port=args.redis_port, stack_dir=Path(tempfile.mkdtemp(prefix="stoker-ttft-stack-")))
    t0 = time.monotonic()
    st.up(cfg)
    print(f"private stack up in {time.monotonic() - t0:.1f} s", flush=True)
    try:
        yield cfg.kafka_bootstrap, cfg.redis_url
    finally:
        print(f"stack down: {st.down(cfg, wipe=True)}", flush=True)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--jobs", type=int, default=200, help="timed jobs per phase, one at a time")
    ap.add_argument("--gaps-ms", default="0,50", help="one phase per gap: pause between a done event and the next job")
    ap.add_argument("--tokens", type=int, default=8, help="max_tokens of each job")
    ap.add_argument("--step-delay-ms", type=float, default=4.0, help="the stand-in engine's step time")
    ap.add_argument("--model", default=None,
                    help="the real engine on this model folder (e.g. ops/bench.py's /tmp/stoker-bench-tiny) instead of "
                         "the stand-in")
    ap.add_argument("--device", default="cpu", help="with --model: cpu or cuda")
    ap.add_argument("--max-model-len", type=int, default=1024, help="with --model")
    ap.add_argument("--acks", default="all", help="comma list of the client producer's acks (all, 1): phases for each")
    ap.add_argument("--kafka-records", type=int, default=200, help="records of each Kafka-alone measurement")
    ap.add_argument("--stack", choices=("external", "start"), default="external",
                    help="external: KAFKA_BOOTSTRAP_SERVERS / REDIS_URL; start: a private stack on the ports below")
    ap.add_argument("--kafka-port", type=int, default=29092)
    ap.add_argument("--redis-port", type=int, default=26379)
    ap.add_argument("--json-out", default=None, help="also write the figures as JSON here")
    ap.add_argument("--observer", nargs=2, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.observer is None:
        args.gaps_ms = [float(g) for g in args.gaps_ms.split(",")]
        args.acks = args.acks.split(",")
        if not set(args.acks) <= {"all", "1"}:
            ap.error(f"--acks takes all and 1, got {args.acks}")
        if args.jobs < 1 or args.tokens < 1 or args.step_delay_ms < 0 or min(args.gaps_ms) < 0:
            ap.error("--jobs and --tokens must be >= 1, --step-delay-ms and --gaps-ms >= 0")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    if args.observer is not None:
        with contextlib.suppress(KeyboardInterrupt):
            asyncio.run(observe(*args.observer))
        return
    with private_stack(args) as (bootstrap, redis_url):
        res = asyncio.run(run(args, bootstrap, redis_url))
    report(res)
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
