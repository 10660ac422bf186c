"""The metrics dashboards and autoscalers read: the vLLM-named families beside ours, with a `model_name` label,
served by a worker's /metrics after jobs ran, and every metric the shipped Grafana dashboard queries."""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path

import pytest
import redis.asyncio as aioredis
from stoker.worker.fake_engine import FakeEngine
from stoker.worker.metrics import WorkerMetrics
from worker_harness import Space, job, produce, running_worker, scrape, stack_fixtures, wait_results

DASHBOARD = Path(__file__).resolve().parents[1] / "ops" / "grafana-dashboard.json"
VLLM_GAUGES = ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc")
VLLM_COUNTERS = ("vllm:prompt_tokens_total", "vllm:generation_tokens_total")
VLLM_HISTOGRAMS = ("vllm:time_to_first_token_seconds", "vllm:inter_token_latency_seconds",
                   "vllm:e2e_request_latency_seconds")


def dashboard_metrics() -> set[str]:
    """Every metric name a query of the dashboard (panels and template variables) names."""
    doc = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for panel in doc["panels"] for t in panel.get("targets", [])]
    exprs += [v["query"]["query"] for v in doc["templating"]["list"] if isinstance(v.get("query"), dict)]
    return {name for e in exprs for name in re.findall(r"\b(?:vllm:[a-z0-9_:]+|stoker_[a-z0-9_]+)", e)}


def test_the_vllm_view_is_our_one_observation_under_a_second_name():
    """No second observe on the per-token path: the vLLM histogram is our histogram's buckets."""
    m = WorkerMetrics(model_name="tiny")
    for seconds in (0.002, 0.003, 0.5):
        m.itl.observe(seconds)
    m.finished.labels("stop", "a").inc(2)
    m.finished.labels("deadline", "").inc()
    m.finished.labels("internal", "").inc()  # an error: not a success
    text = m.render().decode()
    ours = re.findall(r'stoker_inter_token_latency_seconds_bucket\{le="([^"]+)"\} (\S+)', text)
    theirs = re.findall(r'vllm:inter_token_latency_seconds_bucket\{le="([^"]+)",model_name="tiny"\} (\S+)', text)
    assert ours == theirs and ours[-1] == ("+Inf", "3.0")
    assert 'vllm:request_success_total{finished_reason="stop",model_name="tiny"} 2.0' in text
    assert 'vllm:request_success_total{finished_reason="abort",model_name="tiny"} 1.0' in text
    assert "internal" not in "".join(line for line in text.splitlines() if line.startswith("vllm:"))
    assert len(dashboard_metrics()) >= 12


space, r = stack_fixtures(2)


@pytest.mark.stack
@pytest.mark.timeout(120)
async def test_a_worker_serves_vllm_families_and_every_dashboard_metric(space: Space, r: aioredis.Redis) -> None:
    names = space.names
    engine = FakeEngine("tiny-engine", step_delay_s=0.05)  # slow enough to see requests running
    async with running_worker(space, engine, metrics_port=0, served_model_name="served-tiny") as w:
        assert w.health is not None and w.health.port
        port = w.health.port
        ids = [f"m{i}" for i in range(4)]
        await produce(space.bootstrap, names.jobs_topic,
                      [job(rid, max_tokens=30, ignore_eos=True, tenant="acme") for rid in ids])
        running = 0.0
        for _ in range(100):  # while they run: the gauges say so under vLLM's name
            samples = await asyncio.to_thread(scrape, port)
            running = samples.get(("vllm:num_requests_running", frozenset({("model_name", "served-tiny")})), 0.0)
            if running:
                break
            await asyncio.sleep(0.05)
        assert running > 0
        await wait_results(r, names, ids, timeout=30)
        lag_series: list[tuple[str, frozenset[tuple[str, str]]]] = []
        for _ in range(100):  # the lag gauge is refreshed beside the claim renewals
            samples = await asyncio.to_thread(scrape, port)
            lag_series = [k for k in samples if k[0] == "stoker_consumer_partition_lag"]
            if len(lag_series) == 2:
                break
            await asyncio.sleep(0.1)
    model = ("model_name", "served-tiny")
    by_name: dict[str, dict[frozenset[tuple[str, str]], float]] = {}
    for (name, labels), value in samples.items():
        by_name.setdefault(name, {})[labels] = value
    for name in VLLM_GAUGES:
        assert list(by_name[name]) == [frozenset({model})], name
    for name in VLLM_COUNTERS:
        assert list(by_name[name]) == [frozenset({model})] and by_name[name][frozenset({model})] > 0, name
    assert by_name["vllm:generation_tokens_total"][frozenset({model})] == 4 * 30
    for name in VLLM_HISTOGRAMS:
        assert by_name[f"{name}_count"][frozenset({model})] > 0, name
        assert by_name[f"{name}_sum"][frozenset({model})] > 0, name
    assert by_name["vllm:e2e_request_latency_seconds_count"][frozenset({model})] == 4
    assert by_name["vllm:request_success_total"] == {frozenset({model, ("finished_reason", "length")}): 4}
    assert sorted(dict(labels)["partition"] for _, labels in lag_series) == ["0", "1"]
    assert all(dict(labels)["topic"] == names.jobs_topic and model in labels for _, labels in lag_series)
    missing = sorted(dashboard_metrics() - set(by_name))
    assert not missing, f"the dashboard queries metrics the worker does not serve: {missing}"
