"""`stoker load`: a load generator measured from the subscriber side.

N jobs go out at a fixed rate (Poisson-free, evenly spaced, so runs are comparable) or all at once; each is
followed through the normal client path, so the numbers include Kafka, the worker and Redis. Output lengths
hold because jobs set `ignore_eos` with min_tokens = max_tokens; prompt lengths hold because prompts are
sent as `prompt_token_ids` (or as a fixed text when --prompt-text is given).
"""

from __future__ import annotations

import asyncio
import random
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, TextIO

from stoker.client.client import Client, RequestFailed, RequestTimeout
from stoker.schemas import Chunk, Done


@dataclass(slots=True)
class LoadConfig:
    num_requests: int = 100
    rate: float = 0.0  # requests per second; 0 = all at once
    prompt_len: int = 32  # tokens, sent as prompt_token_ids
    output_len: int = 32  # tokens (ignore_eos, min_tokens = max_tokens)
    prompt_text: str | None = None  # send this text instead of token ids (its token count is the model's)
    token_id_range: tuple[int, int] = (10, 200)  # ids drawn from [lo, hi): inside any sane vocabulary
    temperature: float = 0.0
    timeout: float = 120.0  # per request
    seed: int = 0

    def __post_init__(self) -> None:
        if self.num_requests < 1:
            raise ValueError(f"num_requests must be >= 1, got {self.num_requests}")
        if self.rate < 0:
            raise ValueError(f"rate must be >= 0 requests/s (0 = all at once), got {self.rate}")
        if self.prompt_len < 1 or self.output_len < 1:
            raise ValueError(f"prompt_len ({self.prompt_len}) and output_len ({self.output_len}) must be >= 1")
        lo, hi = self.token_id_range
        if not 0 <= lo < hi:
            raise ValueError(f"token_id_range must be 0 <= lo < hi, got {self.token_id_range}")


@dataclass(slots=True)
class RequestRecord:
    start: float  # monotonic seconds, just before the job is produced
    first_token: float | None = None
    end: float | None = None
    output_tokens: int = 0
    token_gaps: list[float] = field(default_factory=list)  # inter-token latencies, one per token after the 1st
    error: str | None = None


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolated percentile (q in [0, 100]) of a non-empty list."""
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


@dataclass(slots=True)
class LoadReport:
    config: LoadConfig
    records: list[RequestRecord]
    duration_s: float

    @property
    def ok(self) -> list[RequestRecord]:
        return [r for r in self.records if r.error is None and r.end is not None]

    def errors(self) -> Counter[str]:
        return Counter(r.error for r in self.records if r.error is not None)

    def metrics(self) -> dict[str, list[float]]:
        """Milliseconds per metric, from successful requests."""
        ok = self.ok
        return {
            "ttft_ms": [(r.first_token - r.start) * 1e3 for r in ok if r.first_token is not None],
            # time per output token after the first, per request (vLLM's TPOT)
            "tpot_ms": [(r.end - r.first_token) * 1e3 / (r.output_tokens - 1) for r in ok
                        if r.end is not None and r.first_token is not None and r.output_tokens > 1],
            "itl_ms": [gap * 1e3 for r in ok for gap in r.token_gaps],
            "e2e_ms": [(r.end - r.start) * 1e3 for r in ok if r.end is not None],
        }

    def summary(self) -> dict[str, dict[str, float]]:
        """Per metric: p50, p90, p99, mean, max (ms) and the count of values; {} for a metric without any."""
        out: dict[str, dict[str, float]] = {}
        for name, values in self.metrics().items():
            if values:
                out[name] = {"p50": percentile(values, 50), "p90": percentile(values, 90),
                             "p99": percentile(values, 99), "mean": sum(values) / len(values),
                             "max": max(values), "count": len(values)}
        return out

    def to_json(self) -> dict[str, Any]:
        """The results file of `stoker load --json`: the run's settings, its totals, the metric summaries and
        one row per request (times in seconds from the run's start, null where not reached)."""
        began = min((r.start for r in self.records), default=0.0)

        def rel(t: float | None) -> float | None:
            return None if t is None else round(t - began, 6)

        ok = self.ok
        tokens = sum(r.output_tokens for r in ok)
        cfg = self.config
        return {
            "config": {"num_requests": cfg.num_requests, "rate": cfg.rate, "prompt_len": cfg.prompt_len,
                       "output_len": cfg.output_len, "prompt_text": cfg.prompt_text,
                       "temperature": cfg.temperature, "timeout": cfg.timeout, "seed": cfg.seed},
            "duration_s": self.duration_s,
            "requests": len(self.records),
            "ok": len(ok),
            "errors": dict(self.errors()),
            "output_tokens_per_s": tokens / self.duration_s,
            "requests_per_s": len(ok) / self.duration_s,
            "metrics_ms": self.summary(),
            "records": [{"start_s": rel(r.start), "first_token_s": rel(r.first_token), "end_s": rel(r.end),
                         "output_tokens": r.output_tokens, "error": r.error} for r in self.records],
        }

    def table(self) -> str:
        cfg, ok = self.config, self.ok
        total_tokens = sum(r.output_tokens for r in ok)
        lines = [
            f"requests {len(self.records)}  ok {len(ok)}  errors {sum(self.errors().values())}  "
            f"rate {'all at once' if cfg.rate == 0 else f'{cfg.rate:g}/s'}  "
            f"prompt {cfg.prompt_len if cfg.prompt_text is None else 'text'}  output {cfg.output_len} tokens",
            f"duration {self.duration_s:.2f} s  throughput {total_tokens / self.duration_s:.1f} output tok/s  "
            f"{len(ok) / self.duration_s:.2f} req/s",
            f"{'metric':<10}{'p50':>10}{'p90':>10}{'p99':>10}{'mean':>10}{'max':>10}",
        ]
        summary = self.summary()
        for name in self.metrics():
            if name in summary:
                cells = [summary[name][k] for k in ("p50", "p90", "p99", "mean", "max")]
                lines.append(f"{name:<10}" + "".join(f"{v:>10.2f}" for v in cells))
            else:
                lines.append(f"{name:<10}" + f"{'-':>10}" * 5)
        for code, count in sorted(self.errors().items()):
            lines.append(f"error {code}: {count}")
        return "\n".join(lines)


async def _one(client: Client, cfg: LoadConfig, rng: random.Random, record: RequestRecord) -> None:
    lo, hi = cfg.token_id_range
    params: dict[str, Any] = dict(max_tokens=cfg.output_len, min_tokens=cfg.output_len, ignore_eos=True,
                                  temperature=cfg.temperature, timeout=cfg.timeout)
    if cfg.prompt_text is not None:
        params["prompt"] = cfg.prompt_text
    else:
        params["prompt_token_ids"] = [rng.randrange(lo, hi) for _ in range(cfg.prompt_len)]
    record.start = time.monotonic()
    last = record.start
    try:
        async for event in client.stream(**params):
            now = time.monotonic()
            if isinstance(event, Chunk) and event.token_ids:
                if record.first_token is None:
                    record.first_token = now
                else:  # a chunk of k tokens arrived after `now - last`: k tokens shared that wait
                    record.token_gaps.extend([(now - last) / len(event.token_ids)] * len(event.token_ids))
                last = now
            elif isinstance(event, Done):
                record.end, record.output_tokens = now, event.usage.completion_tokens
    except RequestFailed as exc:
        record.error = exc.code
    except RequestTimeout:
        record.error = "timeout"
    except Exception as exc:  # e.g. Redis or Kafka failing: counted by kind, so one fault cannot abort the run
        record.error = type(exc).__name__


async def run_load(client: Client, cfg: LoadConfig, progress: bool = False) -> LoadReport:
    rng = random.Random(cfg.seed)
    records = [RequestRecord(start=0.0) for _ in range(cfg.num_requests)]
    bar = _progress_bar(cfg.num_requests) if progress else None
    began = time.monotonic()

    async def launch(i: int) -> None:
        if cfg.rate > 0:  # evenly spaced arrivals, measured from the start so drift does not accumulate
            await asyncio.sleep(max(0.0, began + i / cfg.rate - time.monotonic()))
        await _one(client, cfg, rng, records[i])
        if bar is not None:
            bar.update(1)

    try:
        await asyncio.gather(*(launch(i) for i in range(cfg.num_requests)))
    finally:
        if bar is not None:
            bar.close()
    ends = [r.end for r in records if r.end is not None]
    return LoadReport(cfg, records, max(1e-9, (max(ends) if ends else time.monotonic()) - began))


def _progress_bar(total: int) -> Any:
    from tqdm import tqdm  # a base dependency (pure Python, no dependencies of its own)

    return tqdm(total=total, unit="req", desc="load")


def plot_latency(report: LoadReport, path: str) -> None:
    """Writes a figure of TTFT and e2e latency against each request's start time (top) and the TPOT
    distribution (bottom) to `path` (PNG, SVG or PDF by its extension). Needs matplotlib: the `plot` extra."""
    try:
        import matplotlib
    except ImportError:
        raise ValueError("--plot needs matplotlib: pip install 'stoker[plot]'") from None
    matplotlib.use("Agg")  # files only: no display, no GUI toolkit
    import matplotlib.pyplot as plt

    ok = report.ok
    began = min((r.start for r in report.records), default=0.0)
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 7), layout="constrained")
    cfg = report.config
    fig.suptitle(f"stoker load: {len(report.records)} requests, "
                 f"{'all at once' if cfg.rate == 0 else f'{cfg.rate:g}/s'}, {cfg.output_len} output tokens")
    series = {
        ("end-to-end", "tab:red"): [(r.start - began, (r.end - r.start) * 1e3) for r in ok if r.end is not None],
        ("time to first token", "tab:blue"): [(r.start - began, (r.first_token - r.start) * 1e3)
                                              for r in ok if r.first_token is not None],
    }
    for (label, colour), points in series.items():
        top.scatter([x for x, _ in points], [y for _, y in points], s=12, color=colour, label=label)
    top.set(title="Latency by request start", xlabel="request start (s)", ylabel="latency (ms)")
    top.set_ylim(bottom=0)
    top.grid(alpha=0.3)
    top.legend()
    tpot = report.metrics()["tpot_ms"]
    bottom.hist(tpot, bins=min(40, max(5, len(tpot) // 3)), color="tab:green", label="TPOT per request")
    bottom.set(title="Time per output token", xlabel="TPOT (ms)", ylabel="requests")
    bottom.grid(alpha=0.3)
    bottom.legend()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def print_report(report: LoadReport, out: TextIO) -> None:
    out.write(report.table() + "\n")
