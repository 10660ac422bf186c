"""Fault run: jobs through two workers while, in turn, a worker is SIGKILLed, a worker is SIGSTOPped past its
claim TTL and resumed, Redis is killed and restarted, and the broker is killed and restarted. Then every job
must have exactly one terminal event under its result key, from its highest attempt, no event of a lower
attempt after a higher attempt's first event in its stream, and the group's consumer lag must be 0.

Everything runs on loopback: a private Kafka broker (devstack, own ports and data dir), a private
redis-server with AOF (`appendfsync always`, so a killed Redis keeps what it acknowledged), and the workers
as real `stoker-worker` processes on the stand-in engine, each reaching Redis through a loopback proxy of
its own (so that one worker's link can stall while the others' flow). Bounded in time: each wait has a deadline.

    ops/chaos [--jobs 300] [--keep-logs DIR]

tests/test_chaos.py runs a shorter version of the same code.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import redis.asyncio as aioredis
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from stoker.devstack import stack
from stoker.schemas import Chunk, Done, Error, Names, decode_event, default_batch_topic

ROOT = Path(__file__).resolve().parents[1]
CLAIM_TTL_S = 3.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_port(port: int, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.2):
            return
        time.sleep(0.05)
    raise RuntimeError(f"nothing answered on port {port} within {timeout_s} s")


class RedisProxy:
    """A loopback TCP forwarder to Redis that the test can cut (every connection closed, new ones refused)
    and heal, or stall (bytes held) and let flow again: one worker loses Redis while the others keep it."""

    def __init__(self, target_port: int):
        self.target_port = target_port
        self.cut = False
        self.flowing = asyncio.Event()  # cleared: bytes are held (a stalled network), not dropped
        self.flowing.set()
        self.server: asyncio.Server | None = None
        self.writers: set[asyncio.StreamWriter] = set()
        self.handlers: set[asyncio.Task[None]] = set()

    async def start(self) -> int:
        self.server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        return int(self.server.sockets[0].getsockname()[1])

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(Exception):
            while data := await reader.read(65536):
                await self.flowing.wait()
                if self.cut:
                    break
                writer.write(data)
                await writer.drain()
        writer.close()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        if task is not None:  # close() waits for it: a handler cancelled at loop shutdown logs an error
            self.handlers.add(task)
            task.add_done_callback(self.handlers.discard)
        if self.cut:
            writer.close()
            return
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
        except OSError:  # Redis itself is down: the client sees its connection refused, as it would directly
            writer.close()
            return
        self.writers |= {writer, up_writer}
        await asyncio.gather(self._pipe(reader, up_writer), self._pipe(up_reader, writer))

    def sever(self) -> None:
        self.cut = True
        for w in self.writers:
            w.close()
        self.writers.clear()

    async def close(self) -> None:
        self.sever()
        self.flowing.set()  # held bytes: let the pipes see their closed ends
        if self.server is not None:
            self.server.close()
        if self.handlers:
            await asyncio.wait(set(self.handlers), timeout=5)


@dataclass
class ChaosReport:
    jobs: int
    done: int = 0
    errors: int = 0
    missing: int = 0
    attempts: Counter[int] = field(default_factory=Counter)  # final attempt -> jobs
    violations: list[str] = field(default_factory=list)
    committed: int = 0
    end_offsets: int = 0
    faults: list[str] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def lag(self) -> int:
        return self.end_offsets - self.committed

    @property
    def ok(self) -> bool:
        return not self.violations and self.missing == 0 and self.lag == 0 and self.done + self.errors == self.jobs

    def table(self) -> str:
        rows = [("jobs produced", self.jobs), ("done", self.done), ("error", self.errors),
                ("without a result", self.missing),
                ("final attempt 1 / 2 / 3+", " / ".join(str(self.attempts.get(a, 0)) for a in (1, 2))
                 + f" / {sum(n for a, n in self.attempts.items() if a >= 3)}"),
                ("contract violations", len(self.violations)), ("committed / end offsets",
                                                                 f"{self.committed} / {self.end_offsets}"),
                ("consumer lag", self.lag), ("faults", ", ".join(self.faults)), ("seconds", f"{self.seconds:.1f}"),
                ("verdict", "PASS" if self.ok else "FAIL")]
        width = max(len(k) for k, _ in rows)
        return "\n".join(f"{k.ljust(width)}  {v}" for k, v in rows)


def check_stream(rid: str, terminal: Done | Error, events: Sequence[Chunk | Done | Error]) -> list[str]:
    """The contract's rules for one request: what is wrong, as sentences (none when all holds)."""
    problems = []
    attempts = [e.attempt for e in events]
    if attempts != sorted(attempts):
        problems.append(f"{rid}: an older attempt published after a newer one ({attempts[:40]}...)")
    top = max(attempts, default=0)
    if terminal.attempt != top:
        problems.append(f"{rid}: the result is attempt {terminal.attempt}, the stream reaches attempt {top}")
    finals = [e for e in events if isinstance(e, Done | Error) and e.attempt == top]
    if finals != [terminal]:
        problems.append(f"{rid}: the highest attempt has {len(finals)} terminal events, or not the result's")
    seqs = [e.seq for e in events if e.attempt == top]
    if sorted(set(seqs)) != list(range(len(set(seqs)))):
        problems.append(f"{rid}: seq gaps in the final attempt")
    return problems


class Chaos:
    def __init__(self, work_dir: Path, jobs: int, step_delay_s: float = 0.01, log: Callable[[str], None] = print):
        self.work_dir = work_dir
        self.jobs = jobs
        self.step_delay_s = step_delay_s
        self.log = log
        tag = uuid.uuid4().hex[:8]
        self.names = Names(redis_prefix=f"chaos{tag}", jobs_topic=f"chaos.{tag}")
        self.group = f"chaos-{tag}"
        self.stack_cfg = stack.StackConfig(kafka_port=free_port(), controller_port=free_port(),
                                           redis_port=free_port(), stack_dir=work_dir / "stack")
        self.redis_port = free_port()
        self.redis_dir = work_dir / "redis"
        self.redis_proc: subprocess.Popen[bytes] | None = None
        self.workers: list[subprocess.Popen[bytes]] = []
        self.worker_ids: dict[int, str] = {}  # pid -> its STOKER_WORKER_ID (the name its claims carry)
        self.proxies: dict[int, RedisProxy] = {}  # worker pid -> its own link to Redis
        self.worker_count = 0
        self.report = ChaosReport(jobs)
        self.ids: list[str] = []

    # -- the pieces ----------------------------------------------------------------------------------------
    @property
    def redis_url(self) -> str:
        return f"redis://127.0.0.1:{self.redis_port}/0"

    def start_redis(self) -> None:
        self.redis_dir.mkdir(parents=True, exist_ok=True)
        self.redis_proc = subprocess.Popen(
            ["redis-server", "--port", str(self.redis_port), "--bind", "127.0.0.1", "--dir", str(self.redis_dir),
             "--save", "", "--appendonly", "yes", "--appendfsync", "always"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_port(self.redis_port, 10)

    def kill_redis(self) -> None:
        if self.redis_proc is not None:
            self.redis_proc.kill()
            self.redis_proc.wait()

    async def start_worker(self) -> subprocess.Popen[bytes]:
        """A worker process whose Redis link is a proxy of its own (so one worker's link can stall)."""
        self.worker_count += 1
        worker_id = f"chaos-w{self.worker_count}"
        proxy = RedisProxy(self.redis_port)
        proxy_port = await proxy.start()
        env = dict(os.environ)
        env.update(KAFKA_BOOTSTRAP_SERVERS=self.stack_cfg.kafka_bootstrap,
                   REDIS_URL=f"redis://127.0.0.1:{proxy_port}/0",
                   STOKER_JOB_TOPIC=self.names.jobs_topic, STOKER_PREFIX=self.names.redis_prefix,
                   STOKER_GROUP_ID=self.group, STOKER_METRICS_PORT="-1", STOKER_FAKE_ENGINE="1",
                   STOKER_FAKE_STEP_DELAY_S=str(self.step_delay_s), STOKER_CLAIM_TTL_S=str(CLAIM_TTL_S),
                   STOKER_DRAIN_TIMEOUT_S="5", STOKER_WORKER_ID=worker_id, PYTHONUNBUFFERED="1")
        with open(self.work_dir / f"worker-{self.worker_count}.log", "ab") as out:
            proc = subprocess.Popen([sys.executable, "-m", "stoker.worker.main"], cwd=ROOT, env=env, stdout=out,
                                    stderr=subprocess.STDOUT)
        self.workers.append(proc)
        self.proxies[proc.pid] = proxy
        self.worker_ids[proc.pid] = worker_id
        return proc

    def live_workers(self) -> list[subprocess.Popen[bytes]]:
        return [w for w in self.workers if w.poll() is None]

    async def busiest_worker(self, r: aioredis.Redis, fallback: int) -> subprocess.Popen[bytes]:
        """The live worker holding the most claims now (a claim lives while its job runs; its value is "<worker
        id> <attempt>"), so that a fault hits running work; live_workers()[fallback] when none holds one."""
        live = self.live_workers()
        values = await r.mget([self.names.claim(i) for i in self.ids])
        held = Counter(v.split()[0].decode() for v in values if v)
        by_id = {self.worker_ids[w.pid]: w for w in live}
        busy = [(n, by_id[wid]) for wid, n in held.most_common() if wid in by_id]
        return busy[0][1] if busy else live[fallback]

    async def create_topics(self) -> None:
        admin = AIOKafkaAdminClient(bootstrap_servers=self.stack_cfg.kafka_bootstrap)
        await admin.start()
        try:
            # The .batch sibling too: workers read it by default and log it missing otherwise.
            await admin.create_topics([NewTopic(self.names.jobs_topic, 4, 1), NewTopic(self.names.dlq_topic, 1, 1),
                                       NewTopic(default_batch_topic(self.names.jobs_topic), 4, 1)])
        finally:
            await admin.close()

    async def produce(self, count: int) -> None:
        start = len(self.ids)
        producer = AIOKafkaProducer(bootstrap_servers=self.stack_cfg.kafka_bootstrap, acks="all")
        await producer.start()
        try:
            futures = []
            for i in range(start, start + count):
                rid = f"chaos-{i}"
                self.ids.append(rid)
                body = {"type": "job", "request_id": rid, "prompt": "chaos", "max_tokens": random.randint(20, 300)}
                futures.append(await producer.send(self.names.jobs_topic, msgspec.json.encode(body), rid.encode()))
            await asyncio.gather(*futures)
        finally:
            await producer.stop()

    async def wait_streaming(self, r: aioredis.Redis, ids: list[str], timeout_s: float = 30) -> None:
        """Until most of these jobs stream (the fault should hit running work)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            flags = await asyncio.gather(*(r.exists(self.names.stream(i)) for i in ids))
            if sum(flags) >= len(ids) // 2:
                return
            await asyncio.sleep(0.05)

    # -- faults ------------------------------------------------------------------------------------------
    async def fault_sigkill(self, r: aioredis.Redis) -> None:
        victim = await self.busiest_worker(r, 0)
        victim.kill()
        victim.wait()
        self.report.faults.append("worker SIGKILL")
        await asyncio.sleep(1.0)
        await self.start_worker()

    async def fault_sigstop(self, r: aioredis.Redis) -> None:
        victim = await self.busiest_worker(r, -1)
        link = self.proxies[victim.pid]
        # Its link stalls first, with a publish in flight (a frozen VM, a long GC pause: the bytes it sent
        # arrive when it wakes). Then the process stops past the claim TTL and the group's session timeout
        # (10 s): the other worker takes its jobs over as the next attempt.
        link.flowing.clear()
        await asyncio.sleep(0.3)
        victim.send_signal(signal.SIGSTOP)
        await asyncio.sleep(CLAIM_TTL_S + 10.0)
        link.flowing.set()
        victim.send_signal(signal.SIGCONT)
        self.report.faults.append(f"worker SIGSTOP {CLAIM_TTL_S + 10:.0f} s")

    async def fault_redis(self, r: aioredis.Redis) -> None:
        self.kill_redis()
        await asyncio.sleep(5.0)
        self.start_redis()
        self.report.faults.append("Redis killed 5 s")

    async def fault_broker(self, r: aioredis.Redis) -> None:
        pid = stack.status(self.stack_cfg).kafka.pid
        if pid is None:
            raise RuntimeError("the private broker is not running")
        os.kill(pid, signal.SIGKILL)
        while Path(f"/proc/{pid}").exists() and Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z":
            await asyncio.sleep(0.05)
        await asyncio.sleep(2.0)
        await asyncio.to_thread(stack.up, self.stack_cfg)
        self.report.faults.append("broker SIGKILL + restart")

    # -- the run -----------------------------------------------------------------------------------------
    async def run(self, timeout_s: float = 300) -> ChaosReport:
        started = time.monotonic()
        await asyncio.to_thread(stack.up, self.stack_cfg)
        self.start_redis()
        await self.create_topics()
        r = aioredis.Redis.from_url(self.redis_url)
        try:
            await self.start_worker()
            await self.start_worker()
            faults = [self.fault_sigkill, self.fault_sigstop, self.fault_redis, self.fault_broker]
            per_wave = self.jobs // len(faults)
            for n, fault in enumerate(faults):
                count = per_wave if n < len(faults) - 1 else self.jobs - per_wave * (len(faults) - 1)
                await self.produce(count)
                await self.wait_streaming(r, self.ids[-count:])
                self.log(f"[chaos] {len(self.ids)} jobs produced; fault: {fault.__name__[6:]}")
                await fault(r)
                if fault == self.fault_redis:  # the test's own connections died with the server
                    await r.aclose()
                    r = aioredis.Redis.from_url(self.redis_url)
            await self.settle(r, deadline=started + timeout_s)
            await self.check(r)
        finally:
            await r.aclose()
            for proxy in self.proxies.values():
                await proxy.close()
            self.report.seconds = time.monotonic() - started
        return self.report

    async def settle(self, r: aioredis.Redis, deadline: float) -> None:
        """Until every job has a result and every offset is committed (or the deadline)."""
        while time.monotonic() < deadline:
            values = await r.mget([self.names.result(i) for i in self.ids])
            if all(v is not None for v in values):
                committed, end = await self.offsets()
                if committed == end:
                    return
            await asyncio.sleep(0.5)

    async def offsets(self) -> tuple[int, int]:
        consumer = AIOKafkaConsumer(bootstrap_servers=self.stack_cfg.kafka_bootstrap, group_id=self.group,
                                    enable_auto_commit=False)
        await consumer.start()
        try:
            parts = [TopicPartition(self.names.jobs_topic, p) for p in range(4)]
            ends = await consumer.end_offsets(parts)
            committed = 0
            for tp in parts:
                committed += (await consumer.committed(tp)) or 0
            return committed, sum(ends.values())
        finally:
            await consumer.stop()

    async def check(self, r: aioredis.Redis) -> None:
        report = self.report
        for rid in self.ids:
            value: Any = await r.get(self.names.result(rid))
            if value is None:
                report.missing += 1
                report.violations.append(f"{rid}: no result")
                continue
            terminal = decode_event(value)
            assert isinstance(terminal, Done | Error)
            report.done += isinstance(terminal, Done)
            report.errors += isinstance(terminal, Error)
            report.attempts[terminal.attempt] += 1
            entries: Any = await r.xrange(self.names.stream(rid))
            events = [decode_event(fields[b"data"]) for _, fields in entries]
            report.violations += check_stream(rid, terminal, events)
        report.committed, report.end_offsets = await self.offsets()

    def close(self) -> None:
        for w in self.workers:
            with contextlib.suppress(ProcessLookupError):
                w.send_signal(signal.SIGCONT)
            if w.poll() is None:
                w.terminate()
        for w in self.workers:
            try:
                w.wait(20)
            except subprocess.TimeoutExpired:
                w.kill()
                w.wait()
        self.kill_redis()
        with contextlib.suppress(Exception):
            stack.down(self.stack_cfg, wipe=True)


@contextlib.contextmanager
def chaos(jobs: int, work_dir: Path | None = None, **kwargs: object) -> Iterator[Chaos]:
    if shutil.which("redis-server") is None or shutil.which("java") is None:
        raise RuntimeError("the fault run needs redis-server and java (ops/stack up installs redis-server)")
    own = work_dir is None
    path = Path(tempfile.mkdtemp(prefix="stoker-chaos-")) if work_dir is None else work_dir
    path.mkdir(parents=True, exist_ok=True)
    run = Chaos(path, jobs, **kwargs)  # type: ignore[arg-type]
    try:
        yield run
    finally:
        run.close()
        if own:
            shutil.rmtree(path, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=300, help="jobs produced, in four waves (default 300)")
    parser.add_argument("--keep-logs", type=Path, default=None, help="keep the stack and worker logs in this folder")
    parser.add_argument("--timeout-s", type=float, default=300, help="give up waiting after this long")
    args = parser.parse_args(argv)
    with chaos(args.jobs, args.keep_logs) as run:
        report = asyncio.run(run.run(timeout_s=args.timeout_s))
    print(report.table())
    for problem in report.violations[:20]:
        print("  " + problem)
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
