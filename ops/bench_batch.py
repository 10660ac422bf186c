"""Batch API bench: a large batch through the gateway, beside the engine alone's W2 throughput, in one call.

    source ops/gpu_stack_env && PYTHONPATH=. python3 ops/bench_batch.py --out $OUT/batch.json   # the H200
    PYTHONPATH=. python3 ops/bench_batch.py --dry-run             # a CPU machine, against a running stack

Through the queue: a private local stack (`--stack external`: KAFKA_BOOTSTRAP_SERVERS / REDIS_URL, fresh
topic and prefix), ops/bench.py's model folder, a worker subprocess with ops/bench.py's engine settings (as
ops/bench_e2e.py starts it) reading the batch topic, and `stoker-gateway` as a subprocess. A JSONL of --lines
/v1/completions requests (--prompt random token ids, --new tokens with ignore_eos, greedy) is uploaded
and run as one batch, driven with httpx (client/batch.py, what `stoker batch` uses): output tok/s is the
batch's output tokens over the time from batches.create to `completed` (the output file written). Then the
engine alone in this process (after the worker has exited, so it has the GPU to itself): W2, --w2-requests
at once, as ops/bench.py measures it. The table: the batch, W2, and their ratio (the issue asks >= 0.90).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import secrets
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "ops"))
sys.path.insert(0, str(ROOT))

GOAL = 0.90  # the batch's output tok/s over the engine alone's W2 (issue 19)


def log(msg: str) -> None:
    print(f"[batch {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def write_batch_file(path: Path, lines: int, prompt: int, new: int, vocab: int, seed: int) -> int:
    """--lines completions requests of --prompt random ids each; the file's bytes."""
    rng = random.Random(seed)
    with open(path, "w") as out:
        for i in range(lines):
            body = {"prompt": [rng.randrange(2, vocab) for _ in range(prompt)], "max_tokens": new, "min_tokens": new,
                    "temperature": 0, "ignore_eos": True}
            out.write(json.dumps({"custom_id": f"r{i}", "method": "POST", "url": "/v1/completions", "body": body}))
            out.write("\n")
    return path.stat().st_size


class Gateway:
    """`python -m stoker.gateway.app` on a free port, its storage in a temporary folder."""

    def __init__(self, env: dict[str, str], names: dict[str, str], in_flight: int, log_path: Path):
        import bench_e2e

        self.port, self.log_path = bench_e2e.free_port(), log_path
        self.storage = Path(tempfile.mkdtemp(prefix="stoker-batch-bench-"))
        cmd = [sys.executable, "-m", "stoker.gateway.app", "--port", str(self.port), "--job-topic", names["topic"],
               "--prefix", names["prefix"], "--storage-path", str(self.storage), "--batch-max-in-flight",
               str(in_flight), "--timeout", "3600"]
        self.proc = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=open(log_path, "w"),  # noqa: SIM115
                                     stderr=subprocess.STDOUT)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def wait_ready(self, timeout_s: float = 60) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with contextlib.suppress(OSError), urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health",
                                                                      timeout=1):
                return
            if self.proc.poll() is not None:
                break
            time.sleep(0.1)
        raise RuntimeError(f"the gateway did not start:\n{self.log_path.read_text()[-3000:]}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        import shutil

        shutil.rmtree(self.storage, ignore_errors=True)


def run_batch(gateway_url: str, file: Path, poll_s: float) -> dict[str, Any]:
    """Upload, create, poll to the end: the batch's numbers."""
    from stoker.client.batch import GatewayBatches, follow

    with GatewayBatches(gateway_url, timeout=600) as api:
        t0 = time.monotonic()
        uploaded = api.upload(file)
        t_created = time.monotonic()
        batch = api.create(uploaded["id"], "/v1/completions", "24h", None)
        last = [0.0]

        def progress(p: Any) -> None:
            if time.monotonic() - last[0] > 10:
                last[0] = time.monotonic()
                log(f"  {p.status}: {p.completed + p.failed}/{p.total}")

        final = follow(api, batch["id"], poll_s, progress)
        t_done = time.monotonic()
    counts, usage = final["request_counts"], final["usage"]
    wall = t_done - t_created
    return {"batch_id": final["id"], "status": final["status"], "upload_s": t_created - t0, "wall_s": wall,
            "completed": counts["completed"], "failed": counts["failed"], "total": counts["total"],
            "output_tokens": usage["output_tokens"], "tok_s": usage["output_tokens"] / wall,
            "finalize_s": (final["completed_at"] or 0) - (final["finalizing_at"] or 0)}


def queue_side(args: argparse.Namespace, path: str, vocab: int, settings: Any, bootstrap: str, redis_url: str,
               names: dict[str, str]) -> dict[str, Any]:
    import bench_e2e

    r: dict[str, Any] = {}
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
    wenv = env | bench_e2e.worker_env_vars(args, path, settings, bootstrap, redis_url, names, r)
    file = Path(args.log_dir) / "batch-input.jsonl"
    r["input_bytes"] = write_batch_file(file, args.lines, args.prompt, args.new, vocab, seed=7)
    log(f"input: {args.lines} lines, {r['input_bytes'] / 1e6:.1f} MB")
    worker = bench_e2e.Worker(wenv, Path(args.log_dir) / "worker.log")
    gateway = Gateway(env | {"KAFKA_BOOTSTRAP_SERVERS": bootstrap, "REDIS_URL": redis_url}, names,
                      args.max_in_flight, Path(args.log_dir) / "gateway.log")
    try:
        r["worker_ready_s"] = worker.wait_ready(args.ready_timeout)
        gateway.wait_ready()
        log(f"worker ready in {r['worker_ready_s']:.1f} s; gateway at {gateway.url}")
        r["batch"] = run_batch(gateway.url, file, args.poll)
        log(f"batch: {r['batch']}")
    except Exception as e:  # keep what was measured
        r["error"] = f"{type(e).__name__}: {e}"
        log(f"the queue side stopped: {r['error']}\n{worker.tail()}")
    finally:
        gateway.stop()
        r["worker_exit"] = worker.stop()
        file.unlink(missing_ok=True)
    return r


def engine_side(args: argparse.Namespace, path: str) -> dict[str, Any]:
    """W2 as ops/bench.py measures it: --w2-requests at once, greedy, ignore_eos, after a small warm run."""
    import bench

    eng, ready_s = bench.start_engine(path, args.max_num_seqs, args.device)
    vocab = eng.model_config.vocab_size
    bench.run_requests(eng, bench.random_prompts(2, args.prompt, vocab, 1), 16, "warm")
    w2 = bench.run_requests(eng, bench.random_prompts(args.w2_requests, args.prompt, vocab, 2), args.new, "w2")
    return {"ready_s": ready_s, "w2": {k: w2[k] for k in ("wall_s", "tokens", "tok_s", "cpu_cores")}}


def table(res: dict[str, Any], args: argparse.Namespace) -> list[tuple[str, str]]:
    batch, w2 = res.get("queue", {}).get("batch"), res.get("engine", {}).get("w2")
    rows = [("shape", f"{args.shape} on {args.device}; prompt {args.prompt}, new {args.new}")]
    if batch:
        rows += [(f"batch ({batch['total']} lines)", f"{batch['status']}: {batch['completed']} ok, {batch['failed']} "
                  f"failed, {batch['wall_s']:.1f} s (upload {batch['upload_s']:.1f} s, finalize {batch['finalize_s']} s)"),
                 ("batch output tok/s", f"{batch['tok_s']:.0f}")]
    if w2:
        rows += [(f"engine alone W2 ({args.w2_requests} at once)", f"{w2['wall_s']:.1f} s, {w2['tokens']} tokens"),
                 ("engine alone W2 output tok/s", f"{w2['tok_s']:.0f}")]
    if batch and w2:
        ratio = batch["tok_s"] / w2["tok_s"]
        res["ratio"] = ratio
        rows.append(("batch / W2", f"{ratio:.3f} (goal >= {GOAL:.2f}: {'met' if ratio >= GOAL else 'NOT met'})"))
    return rows


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="8b", help="ops/bench.py shape: 8b | tiny")
    ap.add_argument("--model-dir", default=None, help="default /tmp/stoker-bench-<shape> (ops/bench.py's)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--lines", type=int, default=10_000, help="requests in the batch")
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--new", type=int, default=256)
    ap.add_argument("--w2-requests", type=int, default=1024)
    ap.add_argument("--max-num-seqs", type=int, default=1024)
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192)
    ap.add_argument("--max-in-flight", type=int, default=4096, help="the gateway's --batch-max-in-flight")
    ap.add_argument("--poll", type=float, default=1.0, help="seconds between batches.retrieve calls")
    ap.add_argument("--ready-timeout", type=float, default=300.0)
    ap.add_argument("--stack", choices=("start", "external"), default="start")
    ap.add_argument("--kafka-port", type=int, default=19092)
    ap.add_argument("--redis-port", type=int, default=16379)
    ap.add_argument("--skip-engine", action="store_true")
    ap.add_argument("--out", default=None, help="JSON path (default $OUT/batch.json when OUT is set)")
    ap.add_argument("--log-dir", default=None, help="worker and gateway logs (default $OUT, else /tmp)")
    ap.add_argument("--dry-run", action="store_true", help="a CPU machine: tiny shape, small counts, external stack")
    args = ap.parse_args(argv)
    if args.dry_run:
        small = dict(device="cpu", shape="tiny", lines=64, prompt=32, new=8, w2_requests=32, max_num_seqs=32,
                     max_in_flight=64, poll=0.2, stack="external")
        given = {a.split("=")[0] for a in (argv if argv is not None else sys.argv[1:]) if a.startswith("--")}
        for k, v in small.items():
            if f"--{k.replace('_', '-')}" not in given:
                setattr(args, k, v)
    args.log_dir = args.log_dir or os.environ.get("OUT") or "/tmp"
    Path(args.log_dir).mkdir(parents=True, exist_ok=True)
    if args.out is None and os.environ.get("OUT"):
        args.out = os.path.join(os.environ["OUT"], "batch.json")
    return args


@contextlib.contextmanager
def stack(args: argparse.Namespace, topic: str) -> Any:
    """(bootstrap, redis url) of a private stack (started and wiped here) or the external one."""
    from stoker.devstack import stack as st

    # The worker reads the job topic and its .batch sibling (where the gateway sends the batch's lines).
    topics = {topic: 4, topic + ".dlq": 1, topic + ".batch": 4}
    if args.stack == "external":
        bootstrap = os.environ.get("KAFKA_BOOTSTRAP_SERVERS", "127.0.0.1:9092")
        redis_url = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0")
        st.ensure_topics(bootstrap, topics)
        yield bootstrap, redis_url
        return
    cfg = st.StackConfig(kafka_port=args.kafka_port, controller_port=args.kafka_port + 1, redis_port=args.redis_port,
                         stack_dir=Path(tempfile.mkdtemp(prefix="stoker-batch-stack-")), job_topic=topic)
    st.up(cfg)
    try:
        st.ensure_topics(cfg.kafka_bootstrap, topics)
        yield cfg.kafka_bootstrap, cfg.redis_url
    finally:
        log(f"stack down: {st.down(cfg, wipe=True)}")


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    import bench
    import bench_e2e

    run_id = time.strftime("%m%d%H%M%S") + secrets.token_hex(2)
    names = {"run": run_id, "topic": f"stoker.batchbench.{run_id}", "prefix": f"stoker-bb-{run_id}",
             "group": f"stoker-bb-{run_id}"}
    path = args.model_dir or f"/tmp/stoker-bench-{args.shape}"
    res: dict[str, Any] = {"date": time.strftime("%Y-%m-%d %H:%M"), "argv": sys.argv[1:], "names": names}
    t0 = time.monotonic()
    with stack(args, names["topic"]) as (bootstrap, redis_url):
        res.update(bench_e2e.write_model(args.shape, path, args.device))
        settings = bench.engine_config(path, args.max_num_seqs, args.device,
                                       max_num_batched_tokens=args.max_num_batched_tokens)
        res["queue"] = queue_side(args, path, bench.SHAPES[args.shape]["vocab_size"], settings, bootstrap, redis_url,
                                  names)
    save(args, res)
    if not args.skip_engine:
        log("the engine alone")
        res["engine"] = engine_side(args, path)
    res["table"] = rows = table(res, args)
    res["total_s"] = time.monotonic() - t0
    print()
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{width}}  {v}")
    save(args, res)
    return 0 if res.get("queue", {}).get("batch", {}).get("status") == "completed" else 1


def save(args: argparse.Namespace, res: dict[str, Any]) -> None:
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1, default=str)
        log(f"wrote {args.out}")


if __name__ == "__main__":
    sys.exit(main())
