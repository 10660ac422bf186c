"""End-to-end bench: the worker through a real Kafka broker and Redis, beside the engine alone, in one call.

    source ops/gpu_stack_env && PYTHONPATH=. python3 ops/bench_e2e.py --out $OUT/e2e.json   # the H200
    PYTHONPATH=. python3 ops/bench_e2e.py --dry-run          # a CPU machine, against a running stack

Through the queue: starts a private local stack (`stoker.devstack`, own ports and folder; `--stack external` uses
KAFKA_BOOTSTRAP_SERVERS / REDIS_URL with a fresh topic, prefix and group), writes or reuses ops/bench.py's
model folder, starts `python3 -m stoker.worker.main` on it as a subprocess with ops/bench.py's engine settings (as
STOKER_* variables, checked against `stoker-worker --help`), waits for /readyz, then drives it
with client/load.py's generator, spread over --load-procs processes for the larger phases:
  first    --first-n requests (prompt + --first-new) sent the moment /readyz answers 200
  W1       one request (--prompt + --new), --w1-runs times one after another
  steady   the `first` shape again, warm
  c=N      N requests at once, for each N of --concurrency (the first is W1, the largest W2)
  W2       --w2-requests at once
  rate     evenly spaced arrivals at --rate-fraction x W2's request rate, for --rate-seconds
For each phase: output tok/s, TTFT / inter-token / e2e p50 and p99 (at the subscriber), the worker's CPU
(/proc/<pid>/stat), the load generator's CPU, and the worker's stage histogram (`stoker_job_stage_seconds`,
mean per stage). Then the engine alone in this process (ops/bench.py's engine, the same settings and phases,
TTFT to the step() that returned the first token on the host), and one table: queue | engine | ratio.
Writes the JSON to --out (default $OUT/e2e.json when OUT is set).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import resource
import secrets
import select
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "ops"))
sys.path.insert(0, str(ROOT))

from stoker.ops.proc_cpu import cpu_s, threads_cpu_s  # noqa: E402


# Each engine setting of ops/bench.py's EngineConfig, as the worker's environment variable and the value it
# reads there (booleans the worker spells as --no-* switches: "1" turns the feature off). Checked at start
# against the variables `stoker-worker --help` lists.
def _off(v: Any) -> str:
    return "0" if v else "1"


WORKER_ENV: dict[str, tuple[str, Callable[[Any], str]]] = {
    "max_num_seqs": ("STOKER_MAX_NUM_SEQS", str),
    "max_model_len": ("STOKER_MAX_MODEL_LEN", str),
    "kv_cache_memory_bytes": ("STOKER_KV_CACHE_MEMORY_BYTES", str),
    "num_kv_blocks": ("STOKER_NUM_KV_BLOCKS", str),
    "dtype": ("STOKER_DTYPE", str),
    "block_size": ("STOKER_BLOCK_SIZE", str),
    "gpu_memory_utilization": ("STOKER_GPU_MEMORY_UTILIZATION", str),
    "max_num_batched_tokens": ("STOKER_MAX_NUM_BATCHED_TOKENS", str),
    "seed": ("STOKER_SEED", str),
    "enable_prefix_caching": ("STOKER_NO_PREFIX_CACHING", _off),
    "cuda_graphs": ("STOKER_NO_CUDA_GRAPHS", _off),
    "async_scheduling": ("STOKER_NO_ASYNC_SCHEDULING", _off),  # None (the default: on for CUDA) not passed
    "use_triton": ("STOKER_NO_TRITON", _off),
    "blocking_sync": ("STOKER_NO_BLOCKING_SYNC", _off),
    "decode_kernels": ("STOKER_DECODE_KERNELS", str),
    "decode_pdl": ("STOKER_DECODE_PDL", lambda v: "1"),  # True; False is STOKER_NO_DECODE_PDL (worker_env), None neither
    "quantization": ("STOKER_QUANTIZATION", str),
    "kv_cache_dtype": ("STOKER_KV_CACHE_DTYPE", str),
    "load_format": ("STOKER_LOAD_FORMAT", str),
    "prefill_graph_tokens": ("STOKER_PREFILL_GRAPH_TOKENS", str),
    "piecewise_graph_tokens": ("STOKER_PIECEWISE_GRAPH_TOKENS", str),
}
STAGES = ("polled", "claimed", "engine_added", "scheduled", "first_output", "published")


def log(msg: str) -> None:
    print(f"[e2e {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def pct(values: list[float], q: float) -> float:
    from intervals import percentile  # ops/ is the script's folder (imported late, as the verdict's helpers)

    return percentile(values, q)


# ---- records -> figures (both sides) ---------------------------------------------------------------------
# A record: [start, first_token, end, output_tokens, error, token_gaps] in monotonic seconds (first/end None
# when missing); token gaps in seconds, one per token after the first.
def summarize(records: list[list[Any]]) -> dict[str, Any]:
    ok = [r for r in records if r[4] is None and r[2] is not None]
    errors: dict[str, int] = {}
    for r in records:
        if r[4] is not None:
            errors[r[4]] = errors.get(r[4], 0) + 1
    if not ok:
        return {"requests": len(records), "ok": 0, "errors": errors}
    began, ended = min(r[0] for r in records), max(r[2] for r in ok)
    tokens = sum(r[3] for r in ok)
    ttft = [(r[1] - r[0]) * 1e3 for r in ok if r[1] is not None]
    itl = [g * 1e3 for r in ok for g in r[5]]
    e2e = [(r[2] - r[0]) * 1e3 for r in ok]
    wall = max(1e-9, ended - began)
    return {
        "requests": len(records), "ok": len(ok), "errors": errors, "wall_s": wall, "output_tokens": tokens,
        "tok_s": tokens / wall, "req_s": len(ok) / wall,
        "ttft_p50_ms": pct(ttft, 50), "ttft_p99_ms": pct(ttft, 99), "ttft_max_ms": max(ttft, default=math.nan),
        "ttft_mean_ms": sum(ttft) / max(1, len(ttft)),
        "itl_p50_ms": pct(itl, 50), "itl_p99_ms": pct(itl, 99), "itl_mean_ms": sum(itl) / max(1, len(itl)),
        "e2e_p50_ms": pct(e2e, 50), "e2e_p99_ms": pct(e2e, 99),
    }


# ---- the load generator, in child processes -----------------------------------------------------------
async def _child_main(spec: dict[str, Any]) -> None:
    """One load process: connects, warms its producer, says `ready`; then per stdin line (a JSON command)
    runs client/load.py's run_load and answers one JSON line (records, CPU seconds)."""
    from stoker.client.client import Client
    from stoker.client.load import LoadConfig, run_load

    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    async with Client(spec["bootstrap"], spec["redis_url"], prefix=spec["prefix"], topic=spec["topic"],
                      timeout=spec["timeout"]) as client:
        await client._kafka()  # the producer's start and metadata fetch, before any timed request
        sys.stdout.write("ready\n")
        sys.stdout.flush()
        while line := await reader.readline():
            cmd = json.loads(line)
            if cmd.get("quit"):
                break
            cfg = LoadConfig(num_requests=cmd["n"], rate=cmd["rate"], prompt_len=cmd["prompt"],
                             output_len=cmd["new"], token_id_range=(2, cmd["vocab"]), timeout=spec["timeout"],
                             seed=cmd["seed"])
            await asyncio.sleep(cmd.get("offset_s", 0.0))
            ru0 = resource.getrusage(resource.RUSAGE_SELF)
            report = await run_load(client, cfg)
            ru1 = resource.getrusage(resource.RUSAGE_SELF)
            recs = [[r.start, r.first_token, r.end, r.output_tokens, r.error, r.token_gaps] for r in report.records]
            cpu = ru1.ru_utime - ru0.ru_utime + ru1.ru_stime - ru0.ru_stime
            sys.stdout.write(json.dumps({"records": recs, "cpu_s": cpu}) + "\n")
            sys.stdout.flush()


class LoadPool:
    """`procs` load processes, started once (connected and warm before the worker is ready)."""

    def __init__(self, procs: int, spec: dict[str, Any], env: dict[str, str]):
        self.children = [
            subprocess.Popen([sys.executable, __file__, "--load-child", json.dumps(spec)], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, env=env, cwd=ROOT, text=True)
            for _ in range(procs)
        ]
        for c in self.children:
            while (line := self._line(c)) != "ready":
                print(f"load process: {line}", file=sys.stderr)
        self.alive: Callable[[], bool] = lambda: True  # checked while waiting: a dead worker ends the wait

    def _line(self, child: subprocess.Popen[str]) -> str:
        """The child's next stdout line; raises when it exits or when self.alive() turns false."""
        assert child.stdout is not None
        while not select.select([child.stdout], [], [], 1.0)[0]:
            if child.poll() is not None:
                raise RuntimeError("a load process exited (its stderr is above)")
            if not getattr(self, "alive", lambda: True)():
                raise RuntimeError("the worker exited during a phase")
        line = child.stdout.readline()
        if not line:
            raise RuntimeError("a load process exited (its stderr is above)")
        return line.strip()

    def run(self, n: int, prompt: int, new: int, vocab: int, rate: float = 0.0, procs: int = 1,
            seed: int = 0) -> tuple[list[list[Any]], float]:
        """n requests over `procs` processes (all at once, or evenly spaced at `rate`/s overall).
        Returns the merged records and the load processes' CPU seconds."""
        procs = max(1, min(procs, n, len(self.children)))
        shares = [n // procs + (i < n % procs) for i in range(procs)]
        for i, (child, share) in enumerate(zip(self.children, shares, strict=False)):
            cmd = {"n": share, "rate": rate / procs, "offset_s": (i / rate) if rate > 0 else 0.0,
                   "prompt": prompt, "new": new, "vocab": vocab, "seed": seed * 1000 + i}
            assert child.stdin is not None
            child.stdin.write(json.dumps(cmd) + "\n")
            child.stdin.flush()
        records: list[list[Any]] = []
        cpu = 0.0
        for child in self.children[:procs]:
            while not (line := self._line(child)).startswith("{"):
                print(f"load process: {line}", file=sys.stderr)
            out = json.loads(line)
            records += out["records"]
            cpu += out["cpu_s"]
        return records, cpu

    def close(self) -> None:
        for c in self.children:
            with contextlib.suppress(Exception):
                assert c.stdin is not None
                c.stdin.write(json.dumps({"quit": True}) + "\n")
                c.stdin.close()
        for c in self.children:
            try:
                c.wait(10)
            except subprocess.TimeoutExpired:
                c.kill()


# ---- the worker ---------------------------------------------------------------------------------------
def thread_cores(before: dict[int, tuple[str, float]], after: dict[int, tuple[str, float]], pid: int,
                 wall: float) -> dict[str, float]:
    """CPU cores per thread name between two threads_cpu_s snapshots (threads of one name summed; the main
    thread as "loop"), largest first, those under 0.005 cores left out."""
    by_name: dict[str, float] = {}
    for tid, (comm, cpu) in after.items():
        name = "loop" if tid == pid else comm
        by_name[name] = by_name.get(name, 0.0) + (cpu - before.get(tid, (comm, 0.0))[1]) / wall
    return {k: round(v, 3) for k, v in sorted(by_name.items(), key=lambda kv: -kv[1]) if v >= 0.005}


def threads_text(cores: dict[str, float] | None) -> str:
    return ", ".join(f"{k} {v:.3f}" for k, v in cores.items()) if cores else ""


def scrape(port: int) -> dict[str, float]:
    """The worker's /metrics as {series with labels: value}."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        text = r.read().decode()
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            with contextlib.suppress(ValueError):
                out[name] = float(value)
    return out


def stage_means(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """Mean ms from the Kafka record's timestamp to each stage, over the jobs of one phase."""
    out = {}
    for st in STAGES:
        key = f'stoker_job_stage_seconds_{{}}{{{{stage="{st}"}}}}'
        n = after.get(key.format("count"), 0.0) - before.get(key.format("count"), 0.0)
        s = after.get(key.format("sum"), 0.0) - before.get(key.format("sum"), 0.0)
        if n > 0:
            out[st] = s / n * 1e3
    return out


def counter(m: dict[str, float], prefix: str) -> float:
    return sum(v for k, v in m.items() if k.startswith(prefix) and not k.split("{")[0].endswith("_created"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def worker_flags() -> set[str]:
    """The environment variables `stoker-worker` reads (what it accepts today), from its click command: its
    --help wraps them as `[env var: NAME; default: ...]` over lines, which a pattern over the text missed
    (every engine setting was reported "not accepted" and the two sides "differing")."""
    from stoker.worker.main import _command

    return {p.envvar for p in _command().params if isinstance(getattr(p, "envvar", None), str)}


def worker_env(settings: Any, defaults: Any, accepted: set[str]) -> tuple[dict[str, str], list[str]]:
    """STOKER_* for each engine setting, and the settings the worker will not get (not in its --help) whose
    engine default differs from the bench's value: those make the two sides differ."""
    env, differ = {}, []
    for field, (var, spell) in WORKER_ENV.items():
        value = getattr(settings, field)
        if value is None:
            continue
        if field == "decode_pdl" and value is False:  # the worker's off switch is a flag of its own
            var = "STOKER_NO_DECODE_PDL"
        env[var] = spell(value)
        if var not in accepted and getattr(defaults, field) != value:
            differ.append(f"{field}: bench {value}, worker {getattr(defaults, field)} ({var} not accepted)")
    return env, differ


class Worker:
    def __init__(self, env: dict[str, str], log_path: Path, profile_out: Path | None = None):
        self.log_path = log_path
        self.port = int(env["STOKER_METRICS_PORT"])
        self.t0 = time.monotonic()
        cmd = [sys.executable, "-m", "stoker.worker.main"]
        if profile_out is not None:  # the engine thread under cProfile (ops/profile_worker.py)
            cmd = [sys.executable, str(ROOT / "ops" / "profile_worker.py")]
            env = {**env, "STOKER_PROFILE_OUT": str(profile_out)}
        self.proc = subprocess.Popen(cmd, env=env, cwd=ROOT,
                                     stdout=open(log_path, "w"), stderr=subprocess.STDOUT)  # noqa: SIM115

    def ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/readyz", timeout=1) as r:
                return bool(r.status == 200)
        except OSError:
            return False

    def wait_ready(self, timeout_s: float) -> float:
        while not self.ready():
            if self.proc.poll() is not None:
                raise RuntimeError(f"the worker exited ({self.proc.returncode}):\n{self.tail()}")
            if time.monotonic() - self.t0 > timeout_s:
                raise RuntimeError(f"the worker was not ready within {timeout_s} s:\n{self.tail()}")
            time.sleep(0.01)
        return time.monotonic() - self.t0

    def tail(self, n: int = 30) -> str:
        with contextlib.suppress(OSError):
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        return ""

    def stop(self) -> int | None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


# ---- through the queue --------------------------------------------------------------------------------
class KafkaWarmup(threading.Thread):
    """Sequential produce -> fetch round trips on the stack (ops/bench_kafka_rtt.py) while the worker starts.
    A broker just started runs its request path in the JVM's interpreter for its first thousands of requests:
    W1, a few requests soon after the start, would time that rather than a serving broker. Keeps the first
    and the last `measured` round trips: Kafka's own send -> fetch, cold and warm, beside W1's TTFT."""

    def __init__(self, bootstrap: str, round_trips: int, measured: int = 200):
        super().__init__(name="kafka-warmup", daemon=True)
        self.bootstrap, self.round_trips, self.measured = bootstrap, round_trips, measured
        self.figures: dict[str, Any] = {}

    def run(self) -> None:
        from bench_kafka_rtt import measure

        try:
            samples = asyncio.run(measure(self.bootstrap, self.round_trips, 0, "all"))
            for name, part in (("cold", samples[:self.measured]), ("warm", samples[-self.measured:])):
                self.figures[f"{name}_p50_ms"], self.figures[f"{name}_mean_ms"] = pct(part, 50), sum(part) / len(part)
            self.figures["round_trips"] = len(samples)
        except Exception as e:  # noqa: BLE001 -- a figure missing, not a failed run
            self.figures["error"] = f"{type(e).__name__}: {e}"


def queue_side(args: argparse.Namespace, path: str, vocab: int, settings: Any, env: dict[str, str],
               bootstrap: str, redis_url: str, names: dict[str, str]) -> dict[str, Any]:
    r: dict[str, Any] = {"phases": {}}
    spec = {"bootstrap": bootstrap, "redis_url": redis_url, "prefix": names["prefix"], "topic": names["topic"],
            "timeout": args.request_timeout}
    log(f"{args.load_procs} load processes")
    pool = LoadPool(args.load_procs, spec, env)
    wenv = dict(env)
    wenv.update(worker_env_vars(args, path, settings, bootstrap, redis_url, names, r))
    log_path = Path(args.log_dir) / "worker.log"
    log(f"worker starting (log {log_path})")
    profile_out = Path(args.log_dir) / "worker_engine.prof" if args.profile_worker else None
    worker = Worker(wenv, log_path, profile_out)
    pool.alive = lambda: worker.proc.poll() is None
    warmup = KafkaWarmup(bootstrap, args.kafka_warmup)
    if args.kafka_warmup:
        warmup.start()
    try:
        r["ready_s"] = worker.wait_ready(args.ready_timeout)
        if args.kafka_warmup:
            warmup.join()
            r["kafka_alone"] = warmup.figures
            log(f"Kafka alone, send -> fetch: {warmup.figures}")
        pid = worker.proc.pid
        log(f"worker ready in {r['ready_s']:.2f} s")

        def phase(name: str, n: int, prompt: int, new: int, rate: float = 0.0, runs: int = 1,
                  procs: int = 1, per_job: bool = False) -> dict[str, Any]:
            seen = {row["request_id"] for row in job_stages(worker.port)} if per_job else set()
            threads0 = threads_cpu_s(pid)  # (the main thread, pid itself, is the worker's event loop)
            m0, cpu0, t0 = scrape(worker.port), cpu_s(pid), time.monotonic()
            records: list[list[Any]] = []
            client_cpu = 0.0
            for i in range(runs):
                recs, cpu = pool.run(n, prompt, new, vocab, rate, procs, seed=zlib.crc32(name.encode()) % 1000 + i)
                records += recs
                client_cpu += cpu
            wall = time.monotonic() - t0
            cpu1, m1 = cpu_s(pid), scrape(worker.port)
            threads1 = threads_cpu_s(pid)
            s = summarize(records)
            s.update(worker_cpu_s=cpu1 - cpu0, worker_cpu_cores=(cpu1 - cpu0) / wall, phase_wall_s=wall,
                     worker_loop_cpu_cores=(threads1[pid][1] - threads0[pid][1]) / wall,
                     worker_thread_cores=thread_cores(threads0, threads1, pid, wall),
                     client_cpu_cores=client_cpu / wall, load_procs=procs, stages_ms=stage_means(m0, m1))
            if runs > 1:  # per-run TTFTs: the spread of a single request's
                s["ttft_runs_ms"] = [round((x[1] - x[0]) * 1e3, 2) for x in records if x[1] is not None]
            if per_job:  # one request at a time: the worker's jobs in the order of the records
                s["per_job"] = queue_shares(records, [row for row in job_stages(worker.port)
                                                      if row["request_id"] not in seen])
            r["phases"][name] = s
            log(f"{name}: {brief(s)}")
            log(f"{name}: worker threads, cores: {threads_text(s['worker_thread_cores'])}")
            return s

        phase("first", args.first_n, args.prompt, args.first_new)
        observer = plain_consumer(bootstrap, names["topic"]) if args.observe_w1 else None
        w1_from = time.time()
        w1 = phase("W1", 1, args.prompt, args.new, runs=args.w1_runs, per_job=True)
        if observer is not None:
            w1["plain_consumer"] = fetch_delays(observer.stop(), w1_from)
            log(f"W1 records at a plain consumer in another process, ms from CreateTime: {w1['plain_consumer']}")
        if args.w1_ttft_runs:
            phase("W1-ttft", 1, args.prompt, args.w1_ttft_new, runs=args.w1_ttft_runs, per_job=True)
        phase("steady", args.first_n, args.prompt, args.first_new)
        for c in curve_points(args):
            phase(f"c={c}", c, args.prompt, args.new, procs=procs_for(args, c))
        w2 = phase("W2", args.w2_requests, args.prompt, args.new, procs=procs_for(args, args.w2_requests)) \
            if args.w2_requests else {}
        if args.rate_seconds > 0:
            rate = args.rate or args.rate_fraction * w2.get("req_s", 1.0)
            r["rate_req_s"] = rate
            n = max(1, round(rate * args.rate_seconds))
            phase("rate", n, args.prompt, args.new, rate=rate, procs=procs_for(args, n))
        m = scrape(worker.port)
        r["prefix_cache_queries"] = counter(m, "stoker_prefix_cache_queries")
        r["worker_metrics_excerpt"] = {k: v for k, v in m.items() if k.startswith(
            ("stoker_requests_finished", "stoker_events_published", "stoker_records_failed", "stoker_dead_letters"))}
    except Exception as e:  # keep what was measured; the table shows the phases that ran
        r["error"] = f"{type(e).__name__}: {e}"
        log(f"the queue side stopped: {r['error']}\n{worker.tail()}")
    finally:
        pool.close()
        r["worker_exit"] = worker.stop()
        r["worker_log_tail"] = worker.tail(15)
    if profile_out is not None:
        print_profile(profile_out)
    return r


def print_profile(path: Path, top: int = 45) -> None:
    """The worker engine thread's cProfile (--profile-worker), by own time, into the log and beside the stats."""
    import io
    import pstats

    if not path.exists():
        log(f"no engine-thread profile at {path} (the worker did not stop its engine thread)")
        return
    buf = io.StringIO()
    pstats.Stats(str(path), stream=buf).sort_stats("tottime").print_stats(top)
    path.with_suffix(".txt").write_text(buf.getvalue())
    log(f"the worker's engine thread under cProfile (shares only), top {top} by own time:\n{buf.getvalue()}")


def job_stages(port: int) -> list[dict[str, Any]]:
    """The worker's latest jobs' start stages (GET /stages, worker/stage_log.py), oldest first."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/stages", timeout=5) as resp:
        return list(json.loads(resp.read()))


def queue_shares(records: list[list[Any]], jobs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per request (records and jobs in the same order: one request at a time): its TTFT at the subscriber, the
    engine's own time inside the worker (engine_added -> first_output) and the rest, the queue's own share."""
    out: dict[str, Any] = {"records": len(records), "jobs": len(jobs), "ttft_ms": [], "engine_ms": [], "share_ms": []}
    if len(jobs) != len(records):  # a job missing from the log: the order join would pair the wrong ones
        return out
    for rec, job in zip(records, jobs, strict=True):
        if rec[1] is None or "engine_added" not in job or "first_output" not in job:
            continue
        ttft, engine = (rec[1] - rec[0]) * 1e3, job["first_output"] - job["engine_added"]
        out["ttft_ms"].append(round(ttft, 3))
        out["engine_ms"].append(round(engine, 3))
        out["share_ms"].append(round(ttft - engine, 3))
    return out


def plain_consumer(bootstrap: str, topic: str) -> Any:
    """ops/bench_ttft.py's observer: a consumer of its own group in a child process, printing when each record
    reached it. Beside the worker's stage `polled` it says whether a record reached us late (the time is the
    worker's) or reached every consumer late (the producer's or the broker's)."""
    from bench_ttft import Observer

    return Observer(bootstrap, topic)


def fetch_delays(seen: dict[str, dict[str, float]], since_s: float) -> dict[str, float]:
    """Mean and p50 ms from CreateTime to the plain consumer's fetch, of the records made after since_s (the
    observer reads the topic from its start: earlier phases' records come in its first fetch)."""
    delays = [(row["fetched"] - row["created"]) * 1000 for row in seen.values() if row["created"] >= since_s - 0.001]
    if not delays:
        return {"records": 0}
    return {"records": len(delays), "mean_ms": sum(delays) / len(delays), "p50_ms": pct(delays, 50)}


def worker_env_vars(args: argparse.Namespace, path: str, settings: Any, bootstrap: str, redis_url: str,
                    names: dict[str, str], r: dict[str, Any]) -> dict[str, str]:
    from stoker.engine import EngineConfig

    accepted = worker_flags()
    defaults = EngineConfig(model_path=path, device=settings.device)  # what the worker gets for a missing flag
    env, differ = worker_env(settings, defaults, accepted)
    r["worker_env"] = env
    r["worker_env_not_accepted"] = sorted(v for v in env if v not in accepted)
    r["settings_differ"] = differ
    if r["worker_env_not_accepted"]:
        log(f"the worker does not list {r['worker_env_not_accepted']} in --help (set anyway)")
    for d in differ:
        log(f"WARNING engine settings differ between the two sides: {d}")
    env.update(STOKER_MODEL=path, STOKER_DEVICE=str(settings.device), KAFKA_BOOTSTRAP_SERVERS=bootstrap,
               REDIS_URL=redis_url, STOKER_JOB_TOPIC=names["topic"], STOKER_PREFIX=names["prefix"],
               STOKER_GROUP_ID=names["group"], STOKER_METRICS_HOST="127.0.0.1",
               STOKER_METRICS_PORT=str(free_port()), STOKER_WORKER_ID=f"e2e-{names['run']}",
               STOKER_DRAIN_TIMEOUT_S="10", STOKER_MAX_WAITING=str(settings.max_num_seqs), STOKER_DEBUG_STAGES="1")
    return env


def curve_points(args: argparse.Namespace) -> list[int]:
    """The concurrency points W1 (1) and W2 do not already cover."""
    return [c for c in args.concurrency if c not in (1, args.w2_requests)]


def procs_for(args: argparse.Namespace, n: int) -> int:
    return args.load_procs if n >= args.procs_from else 1


def brief(s: dict[str, Any]) -> str:
    if not s.get("ok"):
        return f"no request finished: {s}"
    return (f"{s['ok']}/{s['requests']} ok, {s['wall_s']:.2f} s, {s['tok_s']:.0f} tok/s, TTFT p50/p99 "
            f"{s['ttft_p50_ms']:.1f}/{s['ttft_p99_ms']:.1f} ms, ITL p50/p99 {s['itl_p50_ms']:.2f}/"
            f"{s['itl_p99_ms']:.2f} ms" + (f", worker {s['worker_cpu_cores']:.2f} cores, client "
                                           f"{s['client_cpu_cores']:.2f}" if "worker_cpu_cores" in s else "")
            + (f", errors {s['errors']}" if s["errors"] else ""))


# ---- the engine alone (the one place that touches the engine's API: keep it small) ---------------------
def engine_side(args: argparse.Namespace, path: str, rate: float, settings: Any) -> dict[str, Any]:
    """settings: the EngineConfig the worker was given (the two sides run the same engine settings)."""
    import bench
    from stoker.engine import EngineRequest, SamplingParams, settle_heap

    r: dict[str, Any] = {"phases": {}}
    eng, r["ready_s"] = bench.start_engine(path, args.max_num_seqs, args.device, config=settings)
    settle_heap()  # the worker's heap policy once loaded: no full collection walks the model's objects
    vocab = eng.model_config.vocab_size
    r["kv_blocks"] = getattr(eng.runner, "num_blocks", None)
    r["startup"] = dict(getattr(eng.runner, "startup", {}))
    seq = [0]
    scheduled: list[float] = []  # ms from add_request to the engine's first step of the request (its stage
    # "scheduled" in the worker, from engine_added)

    def run(prompts: list[list[int]], new: int, arrivals: list[float] | None = None) -> list[list[Any]]:
        """Adds each prompt at its arrival (seconds from now; None: all now) and steps to the end. A request's
        first token is the step() that returned it, on the host: the same point as the subscriber's chunk."""
        params = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True)
        t0 = time.monotonic()
        arrivals = arrivals or [0.0] * len(prompts)
        recs: dict[str, list[Any]] = {}
        last: dict[str, float] = {}
        added_ms: dict[str, float] = {}  # epoch ms of each add_request: the engine's first_scheduled_ms clock
        pending = 0
        while pending < len(prompts) or eng.has_unfinished():
            now = time.monotonic()
            while pending < len(prompts) and t0 + arrivals[pending] <= now:
                rid = f"e{seq[0]}"
                seq[0] += 1
                recs[rid] = [time.monotonic(), None, None, 0, None, []]
                added_ms[rid] = time.time() * 1000
                eng.add_request(EngineRequest(rid, prompt_token_ids=prompts[pending], params=params))
                pending += 1
            if not eng.has_unfinished():
                time.sleep(max(0.0, t0 + arrivals[pending] - time.monotonic()))
                continue
            outs = eng.step()
            now = time.monotonic()
            for out in outs:
                rec = recs[out.request_id]
                if out.first_scheduled_ms is not None and out.request_id in added_ms:
                    scheduled.append(out.first_scheduled_ms - added_ms.pop(out.request_id))
                if out.error_code:
                    rec[4] = out.error_code
                k = len(out.new_token_ids)
                if k:
                    if rec[1] is None:
                        rec[1] = now
                    else:
                        rec[5].extend([(now - last[out.request_id]) / k] * k)
                    last[out.request_id] = now
                    rec[3] += k
                if out.finished:
                    rec[2] = now
        return list(recs.values())

    def phase(name: str, n: int, prompt: int, new: int, runs: int = 1, arrivals: list[float] | None = None,
              warm: bool = False) -> None:
        records: list[list[Any]] = []
        scheduled.clear()
        threads0 = threads_cpu_s()
        ru0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.monotonic()
        for i in range(runs):
            records += run(bench.random_prompts(n, prompt, vocab, 100 + i + len(r["phases"])), new, arrivals)
        wall = time.monotonic() - t0
        ru1 = resource.getrusage(resource.RUSAGE_SELF)
        threads1 = threads_cpu_s()
        if warm:
            return
        s = summarize(records)
        s.update(process_cpu_cores=(ru1.ru_utime - ru0.ru_utime + ru1.ru_stime - ru0.ru_stime) / wall,
                 phase_wall_s=wall, thread_cores=thread_cores(threads0, threads1, os.getpid(), wall))
        if runs > 1:
            s["ttft_runs_ms"] = [round((x[1] - x[0]) * 1e3, 2) for x in records if x[1] is not None]
        if scheduled:
            s["add_to_scheduled_ms_mean"] = sum(scheduled) / len(scheduled)
        r["phases"][name] = s
        log(f"engine {name}: {brief(s)}; threads, cores: {threads_text(s['thread_cores'])}")

    phase("first", args.first_n, args.prompt, args.first_new)
    phase("warm", 1, args.prompt, 16, warm=True)  # as ops/bench.py does before W1
    phase("W1", 1, args.prompt, args.new, runs=args.w1_runs)
    if args.w1_ttft_runs:
        phase("W1-ttft", 1, args.prompt, args.w1_ttft_new, runs=args.w1_ttft_runs)
    phase("steady", args.first_n, args.prompt, args.first_new)
    for c in curve_points(args):
        phase(f"c={c}", c, args.prompt, args.new)
    if args.w2_requests:
        phase("W2", args.w2_requests, args.prompt, args.new)
    if args.rate_seconds > 0:
        n = max(1, round(rate * args.rate_seconds))
        phase("rate", n, args.prompt, args.new, arrivals=[i / rate for i in range(n)])
    return r


# ---- the table ----------------------------------------------------------------------------------------
def table(q: dict[str, Any], e: dict[str, Any], args: argparse.Namespace) -> list[tuple[str, str, str, str]]:
    rows: list[tuple[str, str, str, str]] = []

    def row(label: str, qv: float | None, ev: float | None, fmt: str = "{:.2f}", unit: str = "") -> None:
        def cell(v: float | None) -> str:
            return "" if v is None or (isinstance(v, float) and math.isnan(v)) else fmt.format(v) + unit
        ratio = f"{qv / ev:.2f}x" if qv is not None and ev and not math.isnan(qv) and not math.isnan(ev) else ""
        rows.append((label, cell(qv), cell(ev), ratio))

    qp, ep = q.get("phases", {}), e.get("phases", {})
    g = lambda p, name, key: p.get(name, {}).get(key)  # noqa: E731
    row("ready (worker: spawn to /readyz; engine: constructor)", q.get("ready_s"), e.get("ready_s"), unit=" s")
    sh = f"{args.prompt}+{args.first_new}"
    for name, label in (("first", f"first {args.first_n} after ready ({sh})"),
                        ("steady", f"steady {args.first_n} ({sh})")):
        row(f"{label}: TTFT p50", g(qp, name, "ttft_p50_ms"), g(ep, name, "ttft_p50_ms"), "{:.1f}", " ms")
        row(f"{label}: TTFT max", g(qp, name, "ttft_max_ms"), g(ep, name, "ttft_max_ms"), "{:.1f}", " ms")
    def ratio(p: dict[str, Any]) -> float | None:
        a, b = g(p, "first", "ttft_p50_ms"), g(p, "steady", "ttft_p50_ms")
        return a / b if a is not None and b else None

    row("first / steady TTFT p50 (target <= 2)", ratio(qp), ratio(ep), "{:.2f}", "x")
    w1 = f"W1 (1 x {args.prompt}+{args.new}, {args.w1_runs} runs)"
    row(f"{w1}: TTFT p50", g(qp, "W1", "ttft_p50_ms"), g(ep, "W1", "ttft_p50_ms"), "{:.1f}", " ms")
    row(f"{w1}: TTFT mean", g(qp, "W1", "ttft_mean_ms"), g(ep, "W1", "ttft_mean_ms"), "{:.1f}", " ms")
    ka = q.get("kafka_alone", {})
    if "warm_p50_ms" in ka:
        rows.append((f"Kafka alone, send -> fetch p50 / mean: first / last {min(200, ka['round_trips'])} of "
                     f"{ka['round_trips']} round trips (queue only)", f"{ka['cold_p50_ms']:.2f} / "
                     f"{ka['cold_mean_ms']:.2f} ms, then {ka['warm_p50_ms']:.2f} / {ka['warm_mean_ms']:.2f} ms", "", ""))
    row(f"{w1}: inter-token p50", g(qp, "W1", "itl_p50_ms"), g(ep, "W1", "itl_p50_ms"), "{:.2f}", " ms")
    row(f"{w1}: inter-token p99", g(qp, "W1", "itl_p99_ms"), g(ep, "W1", "itl_p99_ms"), "{:.2f}", " ms")
    row(f"{w1}: CPU cores (worker / engine process)", g(qp, "W1", "worker_cpu_cores"),
        g(ep, "W1", "process_cpu_cores"))
    if args.w2_requests:  # else no W2 phase ran
        w2 = f"W2 ({args.w2_requests} x {args.prompt}+{args.new} at once)"
        row(f"{w2}: wall", g(qp, "W2", "wall_s"), g(ep, "W2", "wall_s"), unit=" s")
        row(f"{w2}: output tok/s", g(qp, "W2", "tok_s"), g(ep, "W2", "tok_s"), "{:.0f}")
        row(f"{w2}: CPU cores (worker / engine process)", g(qp, "W2", "worker_cpu_cores"),
            g(ep, "W2", "process_cpu_cores"))
        row(f"{w2}: worker loop-thread CPU cores (the event path)", g(qp, "W2", "worker_loop_cpu_cores"), None)
        rows.append((f"{w2}: CPU cores by thread (engine alone: its stepping thread is \"loop\", the main one)",
                     threads_text(qp.get("W2", {}).get("worker_thread_cores")),
                     threads_text(ep.get("W2", {}).get("thread_cores")), ""))
    curve = [*([1] if 1 in args.concurrency else []), *curve_points(args),
             *([args.w2_requests] if args.w2_requests in args.concurrency else [])]
    for c in curve:
        name = "W1" if c == 1 else ("W2" if c == args.w2_requests else f"c={c}")
        label = f"c={c} ({name})" if name != f"c={c}" else name
        if c != 1:
            row(f"{label}: output tok/s", g(qp, name, "tok_s"), g(ep, name, "tok_s"), "{:.0f}")
        for k, what in (("ttft_p50_ms", "TTFT p50"), ("ttft_p99_ms", "TTFT p99"), ("itl_p50_ms", "inter-token p50"),
                        ("itl_p99_ms", "inter-token p99")):
            if c == 1 and k.startswith("itl_p50"):
                continue  # in the W1 rows
            row(f"{label}: {what}", g(qp, name, k), g(ep, name, k), "{:.1f}" if "ttft" in k else "{:.2f}", " ms")
    if args.rate_seconds > 0:  # else no rate phase ran
        rl = f"rate {q.get('rate_req_s', 0):.1f} req/s for {args.rate_seconds:g} s"
        for k, what, fmt in (("tok_s", "output tok/s", "{:.0f}"), ("ttft_p50_ms", "TTFT p50", "{:.1f}"),
                             ("ttft_p99_ms", "TTFT p99", "{:.1f}"), ("itl_p50_ms", "inter-token p50", "{:.2f}"),
                             ("itl_p99_ms", "inter-token p99", "{:.2f}"), ("e2e_p99_ms", "e2e p99", "{:.0f}")):
            row(f"{rl}: {what}", g(qp, "rate", k), g(ep, "rate", k), fmt, "" if k == "tok_s" else " ms")
    pc = qp.get("W1", {}).get("plain_consumer", {})
    if pc.get("records"):
        rows.append((f"W1 records at a plain consumer (another process), ms from CreateTime: mean / p50 "
                     f"({pc['records']} records)", f"{pc['mean_ms']:.2f} / {pc['p50_ms']:.2f}", "", ""))
    add_sched = g(ep, "W1", "add_to_scheduled_ms_mean")
    if add_sched is not None:
        rows.append(("W1 engine alone: add_request -> first step launched, mean ms", f"{add_sched:.2f}", "", ""))
    for name in ("W1", "W2"):
        st = qp.get(name, {}).get("stages_ms", {})
        if st:
            rows.append((f"{name} worker stages, mean ms from the Kafka record (queue only)",
                         " / ".join(f"{k} {v:.1f}" for k, v in st.items()), "", ""))
        cc = qp.get(name, {}).get("client_cpu_cores")
        if cc is not None:
            rows.append((f"{name} load generator CPU cores ({qp[name]['load_procs']} processes)", f"{cc:.2f}", "", ""))
    return rows


def w1_verdict(q: dict[str, Any], e: dict[str, Any]) -> dict[str, Any]:
    """Issue 12's W1 comparison on every lone request of the call (W1's runs and W1-ttft's, pooled: the same
    prompt at an idle worker / engine), each side's p50 and mean with 95 % bootstrap intervals, their
    differences with intervals, and per request through the queue the engine's own time inside the worker and
    the queue's share (TTFT minus it): a verdict that one noisy p50 does not decide."""
    from intervals import describe, difference

    def pooled(side: dict[str, Any], key: str) -> list[float]:
        phases = side.get("phases", {})
        if key == "ttft_ms":
            return [x for name in ("W1", "W1-ttft") for x in phases.get(name, {}).get("ttft_runs_ms", [])]
        return [x for name in ("W1", "W1-ttft") for x in phases.get(name, {}).get("per_job", {}).get(key, [])]

    queue, engine = pooled(q, "ttft_ms"), pooled(e, "ttft_ms")
    return {"queue_ttft": describe(queue), "engine_ttft": describe(engine),
            "diff_p50": difference(queue, engine), "diff_mean": difference(queue, engine, _mean),
            "engine_in_worker": describe(pooled(q, "engine_ms")), "queue_share": describe(pooled(q, "share_ms"))}


def _mean(values: Any) -> float:
    return sum(values) / len(values)


def print_verdict(v: dict[str, Any]) -> None:
    from intervals import cell

    rows = [("TTFT through the queue", v["queue_ttft"]), ("TTFT on the engine alone", v["engine_ttft"]),
            ("the engine inside the worker (engine_added -> first_output)", v["engine_in_worker"]),
            ("the queue's own share per request (TTFT - the engine inside the worker)", v["queue_share"])]
    print("\nW1's TTFT, every lone request (W1 + W1-ttft runs): ms, p50 [95% bootstrap] / mean [95%] (n)")
    for label, d in rows:
        print(f"  {label}: {cell(d)} / {cell(d, 'mean')} ({d.get('n', 0)})")
    for key, what in (("diff_p50", "p50"), ("diff_mean", "mean")):
        d = v[key]
        print(f"  queue - engine alone, {what}: {d['diff']:+.2f} ms [{d['lo']:+.2f}, {d['hi']:+.2f}] (target <= +5)")


def print_table(rows: list[tuple[str, str, str, str]]) -> None:
    head = ("figure", "through the queue", "engine alone", "queue / engine")
    w = [max(len(r[i]) for r in [head, *rows]) for i in range(4)]
    print("| " + " | ".join(h.ljust(w[i]) for i, h in enumerate(head)) + " |")
    print("|" + "|".join("-" * (x + 2) for x in w) + "|")
    for r in rows:
        print("| " + " | ".join(c.ljust(w[i]) for i, c in enumerate(r)) + " |")


# ---- main ---------------------------------------------------------------------------------------------
def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="8b", help="ops/bench.py shape: 8b | tiny")
    ap.add_argument("--model-dir", default=None, help="default /tmp/stoker-bench-<shape> (ops/bench.py's)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--max-num-seqs", type=int, default=1024)
    ap.add_argument("--dtype", choices=["bf16", "fp8"], default="bf16",
                    help="fp8: the bench's bf16 weights quantized to FP8 at load, on both sides (issue 14)")
    ap.add_argument("--kv-cache-dtype", choices=["auto", "fp8"], default="auto", help="fp8: the FP8 KV cache, both sides")
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192,
                    help="the step's token budget (trades W2's inter-token p99 against throughput)")
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--new", type=int, default=256)
    ap.add_argument("--w1-runs", type=int, default=5)
    ap.add_argument("--w1-ttft-runs", type=int, default=0,
                    help="after W1, this many more lone requests of --prompt + --w1-ttft-new tokens (the W1-ttft "
                         "phase): TTFT samples at a tenth of W1's time, pooled with W1's for the verdict")
    ap.add_argument("--w1-ttft-new", type=int, default=16)
    ap.add_argument("--prefill-graph-tokens", type=int, default=None,
                    help="EngineConfig.prefill_graph_tokens on both sides (default: the engine's)")
    ap.add_argument("--piecewise-graph-tokens", type=int, default=None,
                    help="EngineConfig.piecewise_graph_tokens on both sides (default: the engine's)")
    ap.add_argument("--first-n", type=int, default=8)
    ap.add_argument("--first-new", type=int, default=32)
    ap.add_argument("--w2-requests", type=int, default=1024, help="0: no W2 phase")
    ap.add_argument("--concurrency", default="1,16,64,256,1024", help="comma list; 1 is W1, the W2 count is W2")
    ap.add_argument("--rate", type=float, default=0.0, help="requests/s of the rate phase (0: --rate-fraction)")
    ap.add_argument("--rate-fraction", type=float, default=0.7, help="x W2's request rate through the queue")
    ap.add_argument("--rate-seconds", type=float, default=20.0, help="0: no rate phase")
    ap.add_argument("--kafka-warmup", type=int, default=3000,
                    help="Kafka round trips while the worker starts (0: none; see KafkaWarmup)")
    ap.add_argument("--observe-w1", action=argparse.BooleanOptionalAction, default=True,
                    help="a plain consumer in another process times W1's records beside the worker (bench_ttft's)")
    ap.add_argument("--load-procs", type=int, default=4, help="load generator processes for the larger phases")
    ap.add_argument("--procs-from", type=int, default=64, help="phases of this many requests use --load-procs")
    ap.add_argument("--request-timeout", type=float, default=120.0)
    ap.add_argument("--ready-timeout", type=float, default=300.0)
    ap.add_argument("--stack", choices=("start", "external"), default="start",
                    help="start: a private broker + Redis (ports below); external: KAFKA_BOOTSTRAP_SERVERS/REDIS_URL")
    ap.add_argument("--kafka-port", type=int, default=19092)
    ap.add_argument("--redis-port", type=int, default=16379)
    ap.add_argument("--profile-worker", action="store_true",
                    help="the worker's engine thread under cProfile (ops/profile_worker.py): its top functions by own "
                         "time; that run's CPU and timing figures are cProfile's, not the worker's")
    ap.add_argument("--skip-engine", action="store_true")
    ap.add_argument("--skip-queue", action="store_true", help="the engine alone (its rate phase: --rate or 1/s)")
    ap.add_argument("--out", default=None, help="JSON path (default $OUT/e2e.json when OUT is set)")
    ap.add_argument("--log-dir", default=None, help="worker log (default $OUT, else /tmp)")
    ap.add_argument("--dry-run", action="store_true",
                    help="a CPU machine: --device cpu --shape tiny, small counts, --stack external")
    ap.add_argument("--load-child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.dry_run:
        small = dict(device="cpu", shape="tiny", max_num_seqs=32, prompt=32, new=16, w1_runs=2, first_n=4, kafka_warmup=300,
                     first_new=8, w2_requests=32, concurrency="1,8,32", rate_seconds=4.0, load_procs=2,
                     procs_from=16, stack="external")
        given = {a.split("=")[0] for a in (argv if argv is not None else sys.argv[1:]) if a.startswith("--")}
        for k, v in small.items():
            if f"--{k.replace('_', '-')}" not in given:
                setattr(args, k, v)
    args.concurrency = [int(x) for x in str(args.concurrency).split(",") if x]
    args.log_dir = args.log_dir or os.environ.get("OUT") or "/tmp"
    if args.out is None and os.environ.get("OUT"):
        args.out = os.path.join(os.environ["OUT"], "e2e.json")
    return args


def write_model(shape: str, path: str, device: str) -> dict[str, Any]:
    """ops/bench.py's write_model, in a child process: this one must hold no CUDA context while the worker
    starts, since the engine sizes its KV cache from the memory the whole GPU has free (the worker's and the
    engine alone's budgets then match: each sees only its own process)."""
    dev = "cuda" if device.startswith("cuda") else "cpu"
    code = ("import json, sys, torch; sys.path[:0] = sys.argv[1:3]; import bench; "
            "t = bench.write_model(sys.argv[3], bench.SHAPES[sys.argv[4]], sys.argv[5]); "
            "print(json.dumps({'write_s': t, 'gpu': torch.cuda.get_device_name() if sys.argv[5] == 'cuda' else "
            "'none'}))")
    out = subprocess.run([sys.executable, "-c", code, str(ROOT / "ops"), str(ROOT), path, shape, dev],
                         stdout=subprocess.PIPE, text=True, check=True)
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.load_child is not None:
        asyncio.run(_child_main(json.loads(args.load_child)))
        return 0
    import logging

    import bench
    import torch
    from stoker.devstack import stack as st

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")

    t_start = time.monotonic()
    run_id = time.strftime("%m%d%H%M%S") + secrets.token_hex(2)
    names = {"run": run_id, "topic": f"stoker.e2e.{run_id}", "prefix": f"stoker-e2e-{run_id}",
             "group": f"stoker-e2e-{run_id}"}
    shape = bench.SHAPES[args.shape]
    path = args.model_dir or f"/tmp/stoker-bench-{args.shape}"
    res: dict[str, Any] = {"date": time.strftime("%Y-%m-%d %H:%M"), "argv": sys.argv[1:], "names": names,
                           "torch": torch.__version__, "device": args.device}

    cfg = None
    if args.stack == "start":
        import tempfile

        cfg = st.StackConfig(kafka_port=args.kafka_port, controller_port=args.kafka_port + 1,
                             redis_port=args.redis_port, stack_dir=Path(tempfile.mkdtemp(prefix="stoker-e2e-stack-")),
                             job_topic=names["topic"])
        bootstrap, redis_url = cfg.kafka_bootstrap, cfg.redis_url
        box: dict[str, Any] = {}

        def up() -> None:
            try:
                box["info"] = st.up(cfg)
            except Exception as e:  # reported after the model write
                box["error"] = e

        stack_thread = threading.Thread(target=up)
        stack_thread.start()  # the broker starts while the weights are written
    else:
        bootstrap = os.environ.get("KAFKA_BOOTSTRAP_SERVERS", "127.0.0.1:9092")
        redis_url = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0")
        st.ensure_topics(bootstrap, {names["topic"]: 4, names["topic"] + ".dlq": 1, names["topic"] + ".batch": 4})
    log(f"stack {args.stack}: {bootstrap} {redis_url}, topic {names['topic']}; model folder {path}")
    try:
        res.update(write_model(args.shape, path, args.device))
        if cfg is not None:
            stack_thread.join()
            if "error" in box:
                raise box["error"]
            res["stack_up_s"] = box["info"].elapsed_s
        log(f"weights ready ({res['write_s']:.1f} s to write); stack up ({res.get('stack_up_s', 0):.1f} s)")
        settings = bench.engine_config(path, args.max_num_seqs, args.device,
                                       None if args.dtype == "bf16" else args.dtype,
                                       max_num_batched_tokens=args.max_num_batched_tokens,
                                       kv_cache_dtype=args.kv_cache_dtype)
        if args.prefill_graph_tokens is not None:
            settings.prefill_graph_tokens = args.prefill_graph_tokens
        if args.piecewise_graph_tokens is not None:
            settings.piecewise_graph_tokens = args.piecewise_graph_tokens
        res["engine_settings"] = {f: getattr(settings, f) for f in WORKER_ENV}
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
        res["queue"] = {} if args.skip_queue else queue_side(args, path, shape["vocab_size"], settings, env,
                                                              bootstrap, redis_url, names)
    finally:
        if cfg is not None:
            with contextlib.suppress(Exception):
                stack_thread.join()
                log(f"stack down: {st.down(cfg, wipe=True)}")
    save(args, res)  # what the queue side measured survives a cut-off engine side
    if not args.skip_engine:
        rate = res["queue"].get("rate_req_s", args.rate or 1.0)
        log("the engine alone")
        res["engine"] = engine_side(args, path, rate, settings)
    res["total_s"] = time.monotonic() - t_start
    rows = table(res["queue"], res.get("engine", {}), args)
    res["table"] = rows
    print()
    print_table(rows)
    res["w1_verdict"] = w1_verdict(res["queue"], res.get("engine", {}))
    print_verdict(res["w1_verdict"])
    for d in res["queue"].get("settings_differ", []):
        print(f"NOTE: engine settings differ between the sides: {d}")
    print(f"prefix-cache queries in the worker: {res['queue'].get('prefix_cache_queries')} (0 when caching is off)")
    print(f"total {res['total_s']:.0f} s")
    save(args, res)
    return 0


def save(args: argparse.Namespace, res: dict[str, Any]) -> None:
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1, default=str)
        log(f"wrote {args.out}")


if __name__ == "__main__":
    sys.exit(main())
