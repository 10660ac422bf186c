"""`stoker load`: a load generator measured from the subscriber side.

N jobs go out at a fixed rate (Poisson-free, evenly spaced, so runs are comparable) or all at once; each is
followed through the normal client path, so the numbers include Kafka, the worker and Redis. Output lengths
hold because jobs set `ignore_eos` with min_tokens = max_tokens; prompt lengths hold because prompts are
sent as `prompt_token_ids` (or as a fixed text when --prompt-text is given).
"""

from __future__ import annotations

import asyncio
import random
import struct
import time
import zlib
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
            "itl_ms": [gap * 1e3 for r in ok for gap in r.token_gaps],
            "e2e_ms": [(r.end - r.start) * 1e3 for r in ok if r.end is not None],
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
        for name, values in self.metrics().items():
            if values:
                cells = [percentile(values, q) for q in (50, 90, 99)] + [sum(values) / len(values), max(values)]
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
    try:
        from tqdm import tqdm  # optional: the base install has no tqdm
    except ImportError:
        return None
    return tqdm(total=total, unit="req", desc="load")


# ---- PNG plot (no matplotlib: a raster written with zlib + struct) ----------------------------------------
_DIGITS = {  # 3x5 glyphs, rows top to bottom, bit 2 = left column
    "0": (7, 5, 5, 5, 7), "1": (2, 6, 2, 2, 7), "2": (7, 1, 7, 4, 7), "3": (7, 1, 7, 1, 7),
    "4": (5, 5, 7, 1, 1), "5": (7, 4, 7, 1, 7), "6": (7, 4, 7, 5, 7), "7": (7, 1, 1, 1, 1),
    "8": (7, 5, 7, 5, 7), "9": (7, 5, 7, 1, 7), ".": (0, 0, 0, 0, 2), "s": (0, 3, 6, 1, 6),
    "m": (0, 0, 7, 7, 5), "t": (2, 7, 2, 2, 3), "e": (0, 7, 7, 4, 7), " ": (0, 0, 0, 0, 0),
}
SERIES_COLOURS = {"e2e_ms": (214, 39, 40), "ttft_ms": (31, 119, 180)}


def _png(width: int, height: int, pixels: bytearray) -> bytes:
    """Encodes an RGB raster (row-major, 3 bytes a pixel) as a PNG: signature, IHDR, IDAT, IEND."""
    def chunk(tag: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + tag + body + struct.pack(">I", zlib.crc32(tag + body))

    stride = width * 3
    raw = b"".join(b"\x00" + bytes(pixels[y * stride:(y + 1) * stride]) for y in range(height))  # filter 0
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)  # 8-bit RGB, no interlace
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(raw, 6)) + chunk(b"IEND", b"")


def plot_latency(report: LoadReport, width: int = 800, height: int = 400) -> bytes:
    """Scatter of e2e latency (red) and TTFT (blue) in ms against request start time in s, as PNG bytes.
    Axis maxima are printed at the axis ends ("12.5s" on x, "340ms" on y); the origin is 0, 0."""
    margin = 40
    pixels = bytearray(b"\xff" * width * height * 3)

    def put(x: int, y: int, colour: tuple[int, int, int]) -> None:
        if 0 <= x < width and 0 <= y < height:
            i = (y * width + x) * 3
            pixels[i:i + 3] = bytes(colour)

    def text(x: int, y: int, s: str, scale: int = 2) -> None:
        for ci, ch in enumerate(s):
            for row, bits in enumerate(_DIGITS.get(ch, _DIGITS[" "])):
                for col in range(3):
                    if bits >> (2 - col) & 1:
                        for dx in range(scale):
                            for dy in range(scale):
                                put(x + (ci * 4 + col) * scale + dx, y + row * scale + dy, (0, 0, 0))

    ok = report.ok
    began = min((r.start for r in report.records), default=0.0)
    points = {
        "e2e_ms": [(r.start - began, (r.end - r.start) * 1e3) for r in ok if r.end is not None],
        "ttft_ms": [(r.start - began, (r.first_token - r.start) * 1e3) for r in ok if r.first_token is not None],
    }
    x_max = max([p[0] for pts in points.values() for p in pts], default=0.0) or 1.0
    y_max = max([p[1] for pts in points.values() for p in pts], default=0.0) or 1.0
    plot_w, plot_h = width - 2 * margin, height - 2 * margin
    for x in range(margin, width - margin):
        put(x, height - margin, (0, 0, 0))
    for y in range(margin, height - margin + 1):
        put(margin, y, (0, 0, 0))
    for tick in range(1, 5):  # quarter ticks on both axes
        for d in range(-4, 1):
            put(margin + plot_w * tick // 4, height - margin - d, (0, 0, 0))
            put(margin + d, height - margin - plot_h * tick // 4, (0, 0, 0))
    for name, pts in points.items():
        colour = SERIES_COLOURS[name]
        for px, py in pts:
            cx = margin + round(px / x_max * plot_w)
            cy = height - margin - round(py / y_max * plot_h)
            for dx in (-1, 0, 1):
                for dy in (-1, 0, 1):
                    put(cx + dx, cy + dy, colour)
    text(width - margin - 40, height - margin + 10, f"{x_max:.3g}s")
    text(4, margin - 16, f"{y_max:.0f}ms")
    text(4, height - margin + 10, "0")
    return _png(width, height, pixels)


def print_report(report: LoadReport, out: TextIO) -> None:
    out.write(report.table() + "\n")
