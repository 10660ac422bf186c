"""`stoker batch`: a JSONL file through a gateway's Batch API, its output (and error) file back.

Speaks only HTTP, the way the official `openai` client does (POST /v1/files, POST /v1/batches, GET
/v1/batches/{id} until it ends, GET /v1/files/{id}/content), with httpx: the openai package would bring
pydantic and a dozen more packages to a CLI that needs five calls, and httpx streams the downloads.

The batch lives in the gateway, not in this process: an interrupted `stoker batch` leaves it running, and
`--follow BATCH_ID` picks it up again.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

ENDPOINTS = ("/v1/chat/completions", "/v1/completions")
FINISHED = ("completed", "expired", "cancelled", "failed")


class BatchError(Exception):
    """The gateway refused a call, or answered something else than the Batch API; the message says which."""


def endpoint_of(path: Path) -> str:
    """The endpoint the file's first request names (every line must name the batch's one)."""
    with open(path, "rb") as lines:
        for raw in lines:
            if raw.strip():
                try:
                    url = json.loads(raw).get("url")
                except (ValueError, AttributeError):
                    url = None
                if url not in ENDPOINTS:
                    raise BatchError(f"{path}: the first request's `url` is {url!r}; give --endpoint (one of "
                                     f"{', '.join(ENDPOINTS)})")
                return str(url)
    raise BatchError(f"{path} holds no requests: one JSON object per line")


@dataclass(slots=True)
class Progress:
    total: int
    completed: int
    failed: int
    status: str


class GatewayBatches:
    """The five calls, on one HTTP connection pool. Use as a context manager."""

    def __init__(self, base_url: str, api_key: str | None = None, timeout: float = 60.0):
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.http = httpx.Client(base_url=base_url.rstrip("/") + "/", headers=headers, timeout=timeout)

    def __enter__(self) -> GatewayBatches:
        return self

    def __exit__(self, *exc: object) -> None:
        self.http.close()

    def _json(self, response: httpx.Response) -> dict[str, Any]:
        try:
            body = response.json()
        except ValueError:
            body = None
        if response.is_error or not isinstance(body, dict):
            error = body.get("error") if isinstance(body, dict) else None
            detail = error.get("message") if isinstance(error, dict) else response.text[:300]
            raise BatchError(f"{response.request.method} {response.request.url.path}: HTTP {response.status_code}: "
                             f"{detail}")
        return body

    def upload(self, path: Path) -> dict[str, Any]:
        with open(path, "rb") as content:
            return self._json(self.http.post("files", files={"file": (path.name, content, "application/jsonl")},
                                              data={"purpose": "batch"}))

    def create(self, file_id: str, endpoint: str, window: str, metadata: dict[str, str] | None) -> dict[str, Any]:
        body = {"input_file_id": file_id, "endpoint": endpoint, "completion_window": window, "metadata": metadata}
        return self._json(self.http.post("batches", json=body))

    def retrieve(self, batch_id: str) -> dict[str, Any]:
        return self._json(self.http.get(f"batches/{batch_id}"))

    def download(self, file_id: str, target: Path) -> int:
        """Streams a file's content to `target` (through a temporary file: no half file on failure); bytes."""
        partial = target.with_name(target.name + ".part")
        with self.http.stream("GET", f"files/{file_id}/content") as response:
            if response.is_error:
                response.read()
                self._json(response)
            with open(partial, "wb") as out:
                for chunk in response.iter_bytes():
                    out.write(chunk)
        partial.replace(target)
        return target.stat().st_size


def follow(api: GatewayBatches, batch_id: str, poll_s: float, on_progress: Callable[[Progress], None]) -> dict[str, Any]:
    """Polls the batch until it ends; its last state."""
    while True:
        batch = api.retrieve(batch_id)
        counts = batch.get("request_counts") or {}
        on_progress(Progress(counts.get("total", 0), counts.get("completed", 0), counts.get("failed", 0),
                             str(batch.get("status"))))
        if batch.get("status") in FINISHED:
            return batch
        time.sleep(poll_s)


def fetch_results(api: GatewayBatches, batch: dict[str, Any], output: Path, errors: Path) -> list[tuple[str, Path, int]]:
    """Downloads the output and error files a batch has: (what, where, bytes) of each."""
    written = []
    for what, key, target in (("output", "output_file_id", output), ("errors", "error_file_id", errors)):
        if batch.get(key):
            written.append((what, target, api.download(batch[key], target)))
    return written
