"""Transport benchmark: how many chunk events per second one worker core pushes into Redis, and the latency
the worker adds from produce to first event, with the stand-in engine (no model: transport only).

    set -a; eval "$(ops/stack up 2>/dev/null)"; set +a; python ops/bench_transport.py

Three processes, so none starves another and each one's CPU is its own: the worker is the real
`stoker-worker --fake-engine` (its CPU read from /proc/<pid>/stat: loop, engine thread, Kafka and Redis
clients together), the producer is this process, the subscriber a child process.
1. Throughput: N concurrent requests of T tokens each (one chunk event per request per step); events/s
   = events / wall time from the first event published to the last result stored, and events per worker
   CPU-second over the same window.
2. Paced (W2's decode on the GPU): 1,024 streams, a stand-in step every 100 ms (~10,000 events/s); the
   worker's CPU over a steady window, split into the loop thread (/proc/<pid>/task/<pid>: the event path,
   Kafka and Redis clients) and the other threads (the stand-in engine's). `--profile-out` runs this
   phase's worker under cProfile and prints where the loop thread's time goes.
3. Latency: a fresh worker whose engine steps are paced so that B background requests stream chunk events
   at half the measured rate; probe jobs (one token each, P per second) measure produce -> first event on
   the request's pub/sub channel. The subscriber subscribes to the probe channels only (a pattern over all
   channels would also deliver the background stream, and the subscriber itself would fall behind).
   A probe without an event is looked up in Redis afterwards: a result key means it ran and the event was
   missed by the subscriber; no result means the worker lost it (a bug). The worker's own stage histogram
   (stoker_job_stage_seconds, probes only) says where the time went.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import msgspec  # noqa: E402
import redis.asyncio as aioredis  # noqa: E402
from aiokafka import AIOKafkaProducer  # noqa: E402
from aiokafka.admin import AIOKafkaAdminClient, NewTopic  # noqa: E402

STAGES = ("polled", "claimed", "engine_added", "scheduled", "first_output", "published")


def _job(rid: str, max_tokens: int) -> bytes:
    return msgspec.json.encode({"type": "job", "request_id": rid, "prompt": "bench", "max_tokens": max_tokens,
                                "ignore_eos": True})


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _cpu_s(pid: int, tid: int | None = None) -> float:
    """utime + stime in seconds: of the whole process (every thread), or of its thread `tid` alone."""
    path = f"/proc/{pid}/stat" if tid is None else f"/proc/{pid}/task/{tid}/stat"
    fields = Path(path).read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@dataclass
class WorkerProc:
    """A `stoker-worker --fake-engine` child with its own topic, prefix, group and metrics port."""

    proc: subprocess.Popen[bytes]
    port: int
    prefix: str
    topic: str
    log: Path

    @classmethod
    async def start(cls, bootstrap: str, redis_url: str, max_num_seqs: int, step_delay_s: float,
                    stream_maxlen: int, profile_out: str | None = None,
                    engine_argv: list[str] | None = None, ready_timeout_s: float = 60) -> WorkerProc:
        """engine_argv: the worker's engine flags in place of the stand-in's (a real model: --model DIR ...)."""
        tag = uuid.uuid4().hex[:8]
        topic, prefix, port = f"bench.{tag}", f"bench{tag}", _free_port()
        admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
        await admin.start()
        try:
            await admin.create_topics([NewTopic(topic, 4, 1), NewTopic(topic + ".dlq", 1, 1),
                                       NewTopic(topic + ".batch", 4, 1)])  # the worker reads it by default
        finally:
            await admin.close()
        log = Path(tempfile.gettempdir()) / f"stoker-bench-worker-{tag}.log"
        # cProfile sees the main thread only: the event loop, which is the event path's cost (the stand-in
        # engine steps on its own thread). The profile is written when the worker exits (stop()).
        wrap = ["-m", "cProfile", "-o", profile_out] if profile_out else []
        engine = engine_argv if engine_argv is not None else [
            "--fake-engine", "--max-model-len", "2000000", "--fake-step-delay-s", repr(step_delay_s)]
        argv = [sys.executable, *wrap, "-m", "stoker.worker.main", *engine, "--bootstrap-servers", bootstrap,
                "--redis-url", redis_url, "--job-topic", topic, "--prefix", prefix, "--group-id", f"bench-{tag}",
                "--metrics-host", "127.0.0.1", "--metrics-port", str(port), "--max-num-seqs", str(max_num_seqs),
                "--max-waiting", str(max_num_seqs), "--max-poll-records", "500",
                "--stream-maxlen", str(stream_maxlen), "--log-level", "WARNING"]
        with open(log, "wb") as out:
            proc = subprocess.Popen(argv, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
        worker = cls(proc, port, prefix, topic, log)
        deadline = time.monotonic() + ready_timeout_s
        while not worker.get("/readyz").startswith("ready"):
            if proc.poll() is not None or time.monotonic() > deadline:
                worker.stop()
                raise RuntimeError(f"the worker did not get ready; its log:\n{log.read_text()[-3000:]}")
            await asyncio.sleep(0.1)
        return worker

    def get(self, path: str) -> str:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}{path}", timeout=5) as resp:
                return str(resp.read().decode())
        except OSError:
            return ""

    def metrics(self) -> dict[str, float]:
        """Samples of the /metrics page, keyed by the sample's full name with labels."""
        out = {}
        for line in self.get("/metrics").splitlines():
            if line and not line.startswith("#"):
                name, value = line.rsplit(" ", 1)
                out[name] = float(value)
        return out

    def cpu_s(self) -> float:
        return _cpu_s(self.proc.pid)

    def loop_cpu_s(self) -> float:
        """The main thread's CPU: the asyncio loop (intake, claims, events, Kafka and Redis clients)."""
        return _cpu_s(self.proc.pid, self.proc.pid)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def stage_table(before: dict[str, float], after: dict[str, float]) -> list[tuple[str, float, float, float]]:
    """(stage, mean ms, p50 ms, p99 ms) from the difference of two scrapes of the stage histogram; the
    percentiles are the upper bound of the bucket they fall in."""
    rows = []
    for stage in STAGES:
        prefix = 'stoker_job_stage_seconds_bucket{le="'
        buckets = []
        for name, value in after.items():
            m = re.fullmatch(re.escape(prefix) + r'([^"]+)",stage="' + stage + r'"\}', name)
            if m:
                buckets.append((float(m.group(1)), value - before.get(name, 0.0)))
        buckets.sort()
        count_key, sum_key = (f'stoker_job_stage_seconds_{k}{{stage="{stage}"}}' for k in ("count", "sum"))
        count = after.get(count_key, 0.0) - before.get(count_key, 0.0)
        if count <= 0:
            continue
        mean = (after[sum_key] - before.get(sum_key, 0.0)) / count * 1000

        def pct(q: float, buckets: list[tuple[float, float]] = buckets, count: float = count) -> float:
            return next((le * 1000 for le, n in buckets if n >= q * count), float("inf"))

        rows.append((stage, mean, pct(0.5), pct(0.99)))
    return rows


def _listener(redis_url: str, prefix: str, ids: list[str], conn: Any, settle_s: float) -> None:
    """Child process: subscribe to each probe's channel, report when each probe's first event arrived."""

    async def run() -> dict[str, float]:
        r = aioredis.Redis.from_url(redis_url)
        pubsub = r.pubsub()
        for start in range(0, len(ids), 200):
            await pubsub.subscribe(*(f"{prefix}:events:{rid}" for rid in ids[start:start + 200]))
        # Drain the subscribe confirmations so "ready" means every channel is live.
        confirmed = 0
        while confirmed < len(ids):
            msg = await pubsub.get_message(timeout=5.0)
            if msg is None:
                raise RuntimeError(f"only {confirmed} of {len(ids)} subscriptions confirmed")
            confirmed += msg["type"] == "subscribe"
        conn.send("ready")
        first: dict[str, float] = {}
        wanted = set(ids)
        deadline: float | None = None
        while len(first) < len(ids) and (deadline is None or time.time() < deadline):
            if deadline is None and conn.poll():  # the producer finished: wait settle_s more at most
                conn.recv()
                deadline = time.time() + settle_s
            msg = await pubsub.get_message(ignore_subscribe_messages=True, timeout=0.2)
            if msg is None:
                continue
            rid = msg["channel"].decode().rsplit(":", 1)[1]
            if rid in wanted:
                first.setdefault(rid, time.time())
        await pubsub.aclose()
        await r.aclose()
        return first

    conn.send(asyncio.run(run()))


async def throughput(bootstrap: str, redis_url: str, requests: int, tokens: int) -> dict[str, float]:
    worker = await WorkerProc.start(bootstrap, redis_url, requests, 0.0, tokens + 10)
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, linger_ms=2)
    await producer.start()
    r = aioredis.Redis.from_url(redis_url)
    try:
        ids = [f"t{i}" for i in range(requests)]
        for rid in ids:
            await producer.send(topic=worker.topic, value=_job(rid, tokens), key=rid.encode())
        await producer.flush()
        while worker.metrics().get("stoker_events_published_total", 0.0) == 0:
            await asyncio.sleep(0.005)
        cpu0, wall0 = worker.cpu_s(), time.perf_counter()
        ev0 = worker.metrics()["stoker_events_published_total"]
        results = [f"{worker.prefix}:result:{rid}" for rid in ids]
        while await r.exists(*results) < requests:
            await asyncio.sleep(0.01)
        cpu1, wall1 = worker.cpu_s(), time.perf_counter()
        events = worker.metrics()["stoker_events_published_total"] - ev0
        return {"rate": events / (wall1 - wall0), "cpu_share": (cpu1 - cpu0) / (wall1 - wall0),
                "per_cpu_s": events / max(1e-9, cpu1 - cpu0)}
    finally:
        await producer.stop()
        await r.aclose()
        worker.stop()


async def paced(bootstrap: str, redis_url: str, requests: int, step_ms: float, seconds: float,
                profile_out: str | None) -> dict[str, float]:
    """W2's decode phase on the GPU, with the stand-in engine: `requests` streams, one chunk each per step,
    steps paced at step_ms (1,024 streams at ~100 ms: ~10,000 events/s). The worker's CPU over `seconds` of
    steady streaming, split into the loop thread (the event path) and the rest (the stand-in engine's
    thread, which stands for the real engine's); and the idle worker's CPU before any job, for reference."""
    worker = await WorkerProc.start(bootstrap, redis_url, requests, step_ms / 1000, 1000, profile_out)
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, linger_ms=2)
    await producer.start()
    r = aioredis.Redis.from_url(redis_url)
    ids = [f"p{i}" for i in range(requests)]
    try:
        cpu0, loop0, wall0 = worker.cpu_s(), worker.loop_cpu_s(), time.perf_counter()
        await asyncio.sleep(3.0)
        idle = {"idle_cores": (worker.cpu_s() - cpu0) / (time.perf_counter() - wall0),
                "idle_loop_cores": (worker.loop_cpu_s() - loop0) / (time.perf_counter() - wall0)}
        for rid in ids:
            await producer.send(topic=worker.topic, value=_job(rid, 1_000_000), key=rid.encode())
        await producer.flush()
        # Steady state: every request streams (events per second near requests / step period).
        while worker.metrics().get("stoker_events_published_total", 0.0) < 3 * requests:
            await asyncio.sleep(0.05)
        m0 = worker.metrics()
        cpu0, loop0, wall0 = worker.cpu_s(), worker.loop_cpu_s(), time.perf_counter()
        await asyncio.sleep(seconds)
        cpu1, loop1, wall1 = worker.cpu_s(), worker.loop_cpu_s(), time.perf_counter()
        m1 = worker.metrics()
        events = m1["stoker_events_published_total"] - m0["stoker_events_published_total"]
        wall = wall1 - wall0
        # Time inside step() per step, beyond its paced sleep: the stand-in's own work for `requests` outputs
        # plus whatever it waited for the GIL while the loop ran (the engine thread must not wait on the loop).
        busy = m1["stoker_engine_busy_seconds_total"] - m0["stoker_engine_busy_seconds_total"]
        step_extra_ms = busy / max(1.0, events / requests) * 1000 - step_ms
        return idle | {"rate": events / wall, "cpu_share": (cpu1 - cpu0) / wall, "loop_share": (loop1 - loop0) / wall,
                       "step_extra_ms": step_extra_ms,
                       "per_cpu_s": events / max(1e-9, cpu1 - cpu0),
                       "per_loop_cpu_s": events / max(1e-9, loop1 - loop0)}
    finally:
        pipe = r.pipeline(transaction=False)
        for rid in ids:  # end the streams, so the worker's drain at stop is short
            pipe.publish(f"{worker.prefix}:cancel", msgspec.json.encode({"type": "cancel", "request_id": rid}))
        await pipe.execute()
        deadline = time.monotonic() + 20
        while await r.exists(*(f"{worker.prefix}:result:{rid}" for rid in ids)) < requests \
                and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        await producer.stop()
        await r.aclose()
        worker.stop()


async def latency(bootstrap: str, redis_url: str, rate: float, bg_requests: int, probes: int,
                  probes_per_s: float) -> dict[str, Any]:
    # Each engine step makes one chunk event per background request: pace steps for rate/2 events/s.
    step_delay_s = 2 * bg_requests / rate
    worker = await WorkerProc.start(bootstrap, redis_url, bg_requests + probes, step_delay_s, 1000)
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, linger_ms=0)
    await producer.start()
    r = aioredis.Redis.from_url(redis_url)
    listener = None
    try:
        background = [f"b{i}" for i in range(bg_requests)]
        for rid in background:
            await producer.send(worker.topic, _job(rid, 1_000_000), key=rid.encode())
        await producer.flush()
        await asyncio.sleep(2.0)  # let the background batch reach steady state
        lat_ids = [f"l{i}" for i in range(probes)]
        ctx = mp.get_context("spawn")
        parent, child = ctx.Pipe()
        listener = ctx.Process(target=_listener, args=(redis_url, worker.prefix, lat_ids, child, 10.0))
        listener.start()
        if await asyncio.to_thread(parent.recv) != "ready":
            raise RuntimeError("the subscriber did not start")
        before, cpu0, wall0 = worker.metrics(), worker.cpu_s(), time.perf_counter()
        sent: dict[str, float] = {}
        began = time.monotonic()
        for i, rid in enumerate(lat_ids):  # evenly spaced from the start, so drift does not accumulate
            await asyncio.sleep(max(0.0, began + i / probes_per_s - time.monotonic()))
            sent[rid] = time.time()
            await producer.send(worker.topic, _job(rid, 1), key=rid.encode())
        await producer.flush()
        parent.send("produced")
        first: dict[str, float] = await asyncio.to_thread(parent.recv)
        after, cpu1, wall1 = worker.metrics(), worker.cpu_s(), time.perf_counter()
        bg_events = after.get("stoker_events_published_total", 0) - before.get("stoker_events_published_total", 0)
        missing = [rid for rid in lat_ids if rid not in first]
        missing_with_result = 0
        if missing:
            missing_with_result = await r.exists(*(f"{worker.prefix}:result:{rid}" for rid in missing))
        lat = sorted((first[rid] - sent[rid]) * 1000 for rid in lat_ids if rid in first)
        for rid in background:  # end the background load
            await r.publish(f"{worker.prefix}:cancel", msgspec.json.encode({"type": "cancel", "request_id": rid}))
        return {"step_ms": step_delay_s * 1000, "bg_rate": bg_events / (wall1 - wall0),
                "cpu_share": (cpu1 - cpu0) / (wall1 - wall0), "measured": len(lat),
                "missing": len(missing), "missing_with_result": missing_with_result,
                "p50": statistics.median(lat) if lat else float("nan"),
                "p99": lat[min(len(lat) - 1, int(len(lat) * 0.99))] if lat else float("nan"),
                "max": lat[-1] if lat else float("nan"), "stages": stage_table(before, after)}
    finally:
        if listener is not None:
            listener.join(15)
        await producer.stop()
        await r.aclose()
        worker.stop()


def _print_table(title: str, rows: list[tuple[str, str]]) -> None:
    print(f"\n{title}")
    print(f"{'phase':<40}{'value':>16}")
    for name, value in rows:
        print(f"{name:<40}{value:>16}")


def _print_profile(path: str, top: int) -> None:
    """The loop thread's heaviest functions by own time (cProfile inflates many small calls: read it for
    where, and measure the gain with the paced phase, not with this)."""
    import pstats

    stats = pstats.Stats(path)
    rows = sorted(stats.stats.items(), key=lambda kv: kv[1][2], reverse=True)[:top]  # type: ignore[attr-defined]
    total = stats.total_tt  # type: ignore[attr-defined]
    print(f"\nloop thread profile (cProfile, {total:.2f} s in all), top {top} by own time")
    print(f"{'own s':>8}{'own %':>7}{'cum s':>8}{'calls':>10}  function")
    for (file, line, name), (_, calls, own, cum, _) in rows:
        where = f"{Path(file).name}:{line}" if line else file
        print(f"{own:>8.2f}{own / total * 100:>7.1f}{cum:>8.2f}{calls:>10}  {name} ({where})")


async def bench(args: argparse.Namespace) -> dict[str, Any]:
    phases = set(args.phases.split(","))
    results: dict[str, Any] = {"cpus": os.cpu_count()}
    print(f"Stoker transport benchmark (fake engine), {os.cpu_count()} CPUs, worker in its own process")
    if "throughput" in phases or ("latency" in phases and args.rate is None):
        tp = results["throughput"] = await throughput(args.bootstrap_servers, args.redis_url, args.requests,
                                                      args.tokens)
        _print_table("throughput: as fast as the worker goes", [
            ("requests x tokens", f"{args.requests} x {args.tokens}"),
            ("chunk+done events/s (wall)", f"{tp['rate']:,.0f}"),
            ("worker CPU (cores busy)", f"{tp['cpu_share']:.2f}"),
            ("events per worker CPU-second", f"{tp['per_cpu_s']:,.0f}")])
    if "paced" in phases:
        pc = results["paced"] = await paced(args.bootstrap_servers, args.redis_url, args.paced_requests,
                                            args.paced_step_ms, args.paced_seconds, args.profile_out)
        _print_table(f"paced: {args.paced_requests} streams, a step every {args.paced_step_ms:g} ms (W2's decode)", [
            ("idle worker CPU (cores; loop thread)", f"{pc['idle_cores']:.3f}; {pc['idle_loop_cores']:.3f}"),
            ("chunk events/s (wall)", f"{pc['rate']:,.0f}"),
            ("worker CPU (cores busy)", f"{pc['cpu_share']:.3f}"),
            ("  of it the loop thread (event path)", f"{pc['loop_share']:.3f}"),
            ("events per worker CPU-second", f"{pc['per_cpu_s']:,.0f}"),
            ("events per loop-thread CPU-second", f"{pc['per_loop_cpu_s']:,.0f}"),
            ("stand-in step() ms beyond its sleep", f"{pc['step_extra_ms']:.2f}")])
        if args.profile_out:
            _print_profile(args.profile_out, args.profile_top)
    if "latency" in phases:
        rate = args.rate if args.rate is not None else results["throughput"]["rate"]
        lt = results["latency"] = await latency(args.bootstrap_servers, args.redis_url, rate, args.bg_requests,
                                                args.latency_jobs, args.probes_per_s)
        _print_table(f"latency: probes over a background load at half of {rate:,.0f} events/s", [
            ("background events/s", f"{lt['bg_rate']:,.0f}"),
            ("engine step period ms (paced)", f"{lt['step_ms']:.2f}"),
            ("probe jobs measured / sent", f"{lt['measured']} / {args.latency_jobs}"),
            ("  not seen, but has a result", f"{lt['missing_with_result']}"),
            ("  not seen, no result (lost)", f"{lt['missing'] - lt['missing_with_result']}"),
            ("produce -> first event p50 ms", f"{lt['p50']:.2f}"),
            ("produce -> first event p99 ms", f"{lt['p99']:.2f}"),
            ("produce -> first event max ms", f"{lt['max']:.2f}"),
            ("worker CPU during latency phase", f"{lt['cpu_share']:.2f}")])
        print("\nworker stages, Kafka record time -> stage (probes; p50/p99 are histogram bucket bounds)")
        print(f"{'stage':<16}{'mean ms':>10}{'p50 ms <=':>12}{'p99 ms <=':>12}")
        for stage, mean, p50, p99 in lt["stages"]:
            print(f"{stage:<16}{mean:>10.2f}{p50:>12.1f}{p99:>12.1f}")
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bootstrap-servers", default=os.environ.get("KAFKA_BOOTSTRAP_SERVERS", "127.0.0.1:9092"))
    parser.add_argument("--redis-url", default=os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0"))
    parser.add_argument("--requests", type=int, default=512, help="concurrent requests (events per step)")
    parser.add_argument("--tokens", type=int, default=200, help="tokens per request")
    parser.add_argument("--latency-jobs", type=int, default=500, help="probe jobs")
    parser.add_argument("--probes-per-s", type=float, default=100.0, help="probe jobs per second")
    parser.add_argument("--bg-requests", type=int, default=32, help="streaming requests in the latency phase")
    parser.add_argument("--rate", type=float, default=None,
                        help="skip the throughput phase; run the latency phase at half this events/s")
    parser.add_argument("--phases", default="throughput,paced,latency",
                        help="comma-separated, of throughput, paced, latency (default: all three)")
    parser.add_argument("--paced-requests", type=int, default=1024, help="paced phase: streams (events per step)")
    parser.add_argument("--paced-step-ms", type=float, default=100.0, help="paced phase: stand-in step period")
    parser.add_argument("--paced-seconds", type=float, default=10.0, help="paced phase: measured window")
    parser.add_argument("--profile-out", default=None,
                        help="paced phase: run the worker under cProfile (its loop thread), write the stats here "
                             "and print the heaviest functions")
    parser.add_argument("--profile-top", type=int, default=30, help="functions the profile table lists")
    parser.add_argument("--json-out", default=None, help="also write the figures as JSON here")
    args = parser.parse_args()
    unknown = set(args.phases.split(",")) - {"throughput", "paced", "latency"}
    if unknown:
        parser.error(f"--phases: unknown {sorted(unknown)}; choose among throughput, paced, latency")
    for name in ("requests", "tokens", "latency_jobs", "bg_requests", "paced_requests"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.rate is not None and args.rate <= 0:
        parser.error("--rate must be > 0 events/s")
    if args.probes_per_s <= 0:
        parser.error("--probes-per-s must be > 0")
    if args.paced_step_ms <= 0 or args.paced_seconds <= 0:
        parser.error("--paced-step-ms and --paced-seconds must be > 0")
    results = asyncio.run(bench(args))
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(results, indent=1, default=str))


if __name__ == "__main__":
    main()
