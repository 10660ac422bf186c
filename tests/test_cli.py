"""The `stoker` CLI and the load generator: pure parts (percentiles, the results file, the plot, flag wiring)
without a stack, and submit/tail/workers/load against a live fake-engine worker, run with torch import
blocked."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from stoker.client import cli
from stoker.client.load import LoadConfig, LoadReport, RequestRecord, percentile, plot_latency
from test_gateway import Live

ROOT = Path(__file__).resolve().parents[1]

# Runs `client.cli.main(argv)` in a fresh interpreter where importing torch, triton or engine fails.
NO_TORCH = """
import sys, importlib.abc
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name in ('torch', 'triton') or name.startswith(('torch.', 'triton.', 'engine')):
            raise ImportError('blocked for this test: ' + name)
sys.meta_path.insert(0, Block())
from stoker.client.cli import main
code = main(sys.argv[1:])
assert 'torch' not in sys.modules
sys.exit(code)
"""


def png_size(data: bytes) -> tuple[int, int]:
    """(width, height) from a PNG's IHDR."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def test_percentile_interpolates() -> None:
    values = [float(v) for v in range(1, 101)]
    assert percentile(values, 50) == pytest.approx(50.5)
    assert percentile(values, 99) == pytest.approx(99.01)
    assert percentile([7.0], 90) == 7.0


def test_report_table_results_file_and_plot_from_records(tmp_path: Path) -> None:
    records = [RequestRecord(start=float(i), first_token=i + 0.1, end=i + 0.5, output_tokens=4,
                             token_gaps=[0.1, 0.1, 0.2]) for i in range(10)]
    records.append(RequestRecord(start=10.0, error="context_length_exceeded"))
    report = LoadReport(LoadConfig(num_requests=11, output_len=4), records, duration_s=10.5)
    table = report.table()
    assert "ok 10  errors 1" in table and "error context_length_exceeded: 1" in table
    ttft = next(line for line in table.splitlines() if line.startswith("ttft_ms")).split()
    assert float(ttft[1]) == pytest.approx(100.0)  # p50 TTFT: 0.1 s
    assert "throughput 3.8 output tok/s" in table  # 40 tokens / 10.5 s

    tpot = next(line for line in table.splitlines() if line.startswith("tpot_ms")).split()
    assert float(tpot[1]) == pytest.approx(400 / 3, abs=0.01)  # (end - first token) / 3 later tokens

    results = report.to_json()
    assert results["ok"] == 10 and results["errors"] == {"context_length_exceeded": 1}
    assert results["metrics_ms"]["ttft_ms"]["p50"] == pytest.approx(100.0)
    assert results["metrics_ms"]["tpot_ms"]["count"] == 10
    assert results["records"][3] == {"start_s": 3.0, "first_token_s": 3.1, "end_s": 3.5, "output_tokens": 4,
                                     "error": None}
    json.dumps(results)  # plain JSON types only

    plot = tmp_path / "latency.png"
    plot_latency(report, str(plot))
    assert png_size(plot.read_bytes()) == (900, 700)  # matplotlib's figure: 9 x 7 in at 100 dpi


def test_load_config_rejects_nonsense() -> None:
    with pytest.raises(ValueError, match="num_requests"):
        LoadConfig(num_requests=0)
    with pytest.raises(ValueError, match="rate"):
        LoadConfig(rate=-1)


def test_stack_subcommand_calls_the_launcher(monkeypatch: pytest.MonkeyPatch) -> None:
    from stoker.devstack import stack

    seen: list[list[str]] = []
    def fake_main(argv: list[str]) -> int:
        seen.append(argv)
        return 3

    monkeypatch.setattr(stack, "main", fake_main)
    assert cli.main(["stack", "status", "--redis-port", "7000"]) == 3
    assert seen == [["status", "--redis-port", "7000"]]


def test_bad_flag_value_exits_2_naming_the_field(capsys: pytest.CaptureFixture[str]) -> None:
    # validated before connecting: nothing listens on port 1, yet the answer is about the flag
    assert cli.main(["submit", "hi", "--temperature", "-1", "--redis-url", "redis://127.0.0.1:1/0"]) == 2
    assert "temperature" in capsys.readouterr().err
    assert cli.main(["workers", "--redis-url", "redis://127.0.0.1:1/0"]) == 4
    err = capsys.readouterr().err
    assert "Redis (redis://127.0.0.1:1/0) failed" in err and "Traceback" not in err


def test_flag_that_a_subcommand_does_not_use_is_not_offered(capsys: pytest.CaptureFixture[str]) -> None:
    # tail reads Redis only: no Kafka flags (a usage error, exit 2)
    assert cli.main(["tail", "x", "--bootstrap-servers", "k:1"]) == 2
    assert "No such option '--bootstrap-servers'" in capsys.readouterr().err


def test_every_cli_flag_shows_its_help_default_and_env(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["--version"]) == 0
    assert capsys.readouterr().out.startswith("stoker ")
    assert cli.main(["load", "--help"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    for needle in ("--bootstrap-servers TEXT Kafka bootstrap servers", "env var: KAFKA_BOOTSTRAP_SERVERS",
                   "env var: STOKER_JOB_TOPIC", "env var: REDIS_URL", "env var: STOKER_PREFIX",
                   "default: 127.0.0.1:9092", "--json FILE", "--plot FILE"):
        assert needle in out
    assert "--topic" not in out.replace("--job-topic", "")  # the old spelling works, hidden


def test_submit_reads_the_prompt_from_stdin(monkeypatch: pytest.MonkeyPatch) -> None:
    import io

    seen: list[dict] = []

    async def fake_submit(params: dict) -> int:
        seen.append(params)
        return 0

    monkeypatch.setattr(cli, "_submit", fake_submit)
    monkeypatch.setattr(sys, "stdin", io.StringIO("a prompt\nof two lines\n"))
    assert cli.main(["submit", "-", "--topic", "old.spelling"]) == 0
    assert seen[0]["prompt"] == "a prompt\nof two lines" and seen[0]["job_topic"] == "old.spelling"


async def test_load_counts_client_failures_instead_of_aborting() -> None:
    """A fault outside the contract's errors (here Redis failing for every third request) is counted per
    kind in the report; the other requests still run and are measured."""
    from redis.exceptions import ConnectionError as RedisConnectionError
    from stoker.client.load import run_load
    from stoker.schemas import Chunk, Done, Timings, Usage

    calls = 0

    class FlakyClient:
        async def stream(self, **params: object) -> AsyncIterator[Chunk | Done]:
            nonlocal calls
            calls += 1
            if calls % 3 == 0:
                raise RedisConnectionError("Connection closed by server.")
            yield Chunk(request_id=str(calls), attempt=1, seq=0, text=" w", token_ids=[5])
            yield Done(request_id=str(calls), attempt=1, seq=1, finish_reason="length", text=" w",
                       usage=Usage(prompt_tokens=2, completion_tokens=1, cached_tokens=0),
                       timings=Timings(queue_ms=0.0, ttft_ms=0.0, total_ms=0.0), model="m", worker="w")

    report = await run_load(FlakyClient(), LoadConfig(num_requests=9, output_len=1))  # type: ignore[arg-type]
    assert calls == 9 and len(report.ok) == 6 and report.errors() == {"ConnectionError": 3}
    assert "error ConnectionError: 3" in report.table()


# ---- live ----------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def worker(kafka_bootstrap: str, redis_url: str) -> Iterator[Live]:
    live = Live(kafka_bootstrap, redis_url)
    try:
        live.start(serve_gateway=False)
        yield live
    finally:
        live.stop()


def stoker(live: Live, *argv: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, KAFKA_BOOTSTRAP_SERVERS=live.bootstrap, REDIS_URL=live.redis_url,
               STOKER_PREFIX=live.prefix, STOKER_JOB_TOPIC=live.topic)
    return subprocess.run([sys.executable, "-c", NO_TORCH, *argv], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout)


@pytest.mark.stack
def test_submit_json_then_tail_replays_the_same_events(worker: Live) -> None:
    out = stoker(worker, "submit", "hello", "--max-tokens", "5", "--ignore-eos", "--json", "--request-id",
                 "cli-req-1")
    assert out.returncode == 0, out.stderr
    events = [json.loads(line) for line in out.stdout.splitlines()]
    assert [e["seq"] for e in events] == list(range(len(events))) and events[-1]["type"] == "done"
    assert "".join(e["text"] for e in events[:-1]) == events[-1]["text"]
    assert events[-1]["usage"]["completion_tokens"] == 5

    tail = stoker(worker, "tail", "cli-req-1", "--json")
    assert tail.returncode == 0, tail.stderr
    assert [json.loads(line) for line in tail.stdout.splitlines()] == events


@pytest.mark.stack
def test_submit_chat_streams_text(worker: Live) -> None:
    out = stoker(worker, "submit", "hi", "--chat", "--system", "be brief", "--max-tokens", "3", "--ignore-eos")
    assert out.returncode == 0, out.stderr
    assert len(out.stdout.split()) == 3 and "[length]" in out.stderr and "completion 3 tokens" in out.stderr


@pytest.mark.stack
def test_workers_lists_the_live_worker(worker: Live) -> None:
    out = stoker(worker, "workers", "--json")
    assert out.returncode == 0, out.stderr
    (info,) = json.loads(out.stdout)
    assert info["model"] == "fake" and info["capacity"] >= 1 and info["worker_id"]


@pytest.mark.stack
def test_workers_shows_topic_group_and_models(worker: Live) -> None:
    out = stoker(worker, "workers")
    assert out.returncode == 0, out.stderr
    header, row = out.stdout.splitlines()
    assert header.split() == ["worker", "topic", "group", "models", "running", "capacity", "version"]
    cells = row.split()
    assert cells[1:4] == [worker.topic, f"g-{worker.prefix}", "fake"], row
    (info,) = json.loads(stoker(worker, "workers", "--json").stdout)
    assert (info["topic"], info["group"], info["models"]) == (worker.topic, f"g-{worker.prefix}", ["fake"])


@pytest.mark.stack
def test_load_reports_latencies_and_writes_a_plot(worker: Live, tmp_path: Path) -> None:
    plot, results = tmp_path / "latency.png", tmp_path / "results.json"
    out = stoker(worker, "load", "-n", "40", "--rate", "40", "--prompt-len", "16", "--output-len", "8",
                 "--no-progress", "--plot", str(plot), "--json", str(results), timeout=120)
    print(out.stdout)  # the table, for the record (pytest -s shows it)
    assert out.returncode == 0, out.stderr
    assert "requests 40  ok 40  errors 0" in out.stdout
    for metric in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        row = next(line for line in out.stdout.splitlines() if line.startswith(metric)).split()
        p50, p90, p99 = (float(v) for v in row[1:4])
        assert 0 < p50 <= p90 <= p99
    assert png_size(plot.read_bytes()) == (900, 700)
    summary = json.loads(results.read_text())
    assert summary["ok"] == 40 and len(summary["records"]) == 40 and summary["metrics_ms"]["e2e_ms"]["p50"] > 0


@pytest.mark.stack
def test_submit_to_a_missing_topic_exits_3_naming_the_topic(worker: Live) -> None:
    # the stack does not auto-create topics; aiokafka alone would wait 40 s for metadata, then a traceback
    out = stoker(worker, "submit", "hi", "--job-topic", "stoker.no-such-topic", "--timeout", "2", timeout=30)
    assert out.returncode == 3, out.stderr
    assert "stoker.no-such-topic" in out.stderr and "Traceback" not in out.stderr
    # one line of ours (after the request id), none of aiokafka's metadata warnings
    assert [line for line in out.stderr.splitlines() if line.strip()][1:] == [out.stderr.strip().splitlines()[-1]]


@pytest.mark.stack
def test_tail_of_an_unknown_request_says_so_at_once_and_waits_only_if_asked(worker: Live) -> None:
    out = stoker(worker, "tail", "cli-never-submitted")
    assert out.returncode == 1 and "not started yet, or unknown" in out.stderr
    waited = stoker(worker, "tail", "cli-never-submitted", "--wait", "--timeout", "1")
    assert waited.returncode == 3 and "no terminal event within 1 s" in waited.stderr


@pytest.mark.stack
def test_submit_dash_reads_stdin(worker: Live) -> None:
    env = dict(os.environ, KAFKA_BOOTSTRAP_SERVERS=worker.bootstrap, REDIS_URL=worker.redis_url,
               STOKER_PREFIX=worker.prefix, STOKER_JOB_TOPIC=worker.topic)
    out = subprocess.run([sys.executable, "-c", NO_TORCH, "submit", "-", "--json", "--max-tokens", "2"],
                         input="from stdin\n", cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout.splitlines()[-1])["type"] == "done"
