"""The body of `stoker batch` (client.cli declares its flags): submit or follow, a progress bar, the files.

Exit codes as the other commands': 0 the batch completed (error lines, if any, are in the error file and
counted on stderr), 1 it ended otherwise (failed, expired, cancelled) or the gateway refused a call, 2 bad
usage, 4 the gateway unreachable, 130 interrupted (the batch keeps running in the gateway).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import httpx
from stoker.client.batch import BatchError, GatewayBatches, Progress, endpoint_of, fetch_results, follow
from tqdm import tqdm

EXIT_FAILED, EXIT_USAGE, EXIT_UNREACHABLE, EXIT_INTERRUPTED = 1, 2, 4, 130


def _say(message: str) -> None:
    print(f"stoker: {message}", file=sys.stderr)


def _targets(params: dict[str, Any], batch_id: str) -> tuple[Path, Path]:
    output = params["output"]
    if output is None:
        stem = params["input_path"].with_suffix("") if params["input_path"] else Path(batch_id)
        output = stem.with_name(stem.name + ".output.jsonl")
    errors = params["errors"] or output.with_name(output.name.removesuffix(".output.jsonl").removesuffix(".jsonl")
                                                   + ".errors.jsonl")
    return output, errors


def _submit(api: GatewayBatches, params: dict[str, Any]) -> str:
    path: Path = params["input_path"]
    endpoint = params["endpoint"] or endpoint_of(path)
    uploaded = api.upload(path)
    batch = api.create(uploaded["id"], endpoint, params["completion_window"], None)
    _say(f"batch {batch['id']} ({endpoint}, file {uploaded['id']}); `stoker batch --follow {batch['id']}` follows "
         "it again if this is interrupted")
    return str(batch["id"])


def _follow(api: GatewayBatches, batch_id: str, params: dict[str, Any]) -> dict[str, Any]:
    with tqdm(total=None, unit="req", desc=batch_id[:18], disable=params["no_progress"], file=sys.stderr) as bar:
        def show(progress: Progress) -> None:
            bar.total = progress.total or None
            bar.update(progress.completed + progress.failed - bar.n)
            bar.set_postfix(status=progress.status, failed=progress.failed, refresh=False)

        return follow(api, batch_id, params["poll"], show)


def _report(api: GatewayBatches, batch: dict[str, Any], params: dict[str, Any]) -> int:
    output, errors = _targets(params, batch["id"])
    for what, where, size in fetch_results(api, batch, output, errors):
        _say(f"{what}: {where} ({size} bytes)")
    counts = batch.get("request_counts") or {}
    _say(f"batch {batch['id']} {batch['status']}: {counts.get('completed', 0)} of {counts.get('total', 0)} "
         f"answered, {counts.get('failed', 0)} in the error file")
    return 0 if batch["status"] == "completed" else EXIT_FAILED


def run_batch_command(params: dict[str, Any]) -> int:
    if (params["input_path"] is None) == (params["batch_id"] is None):
        _say("give INPUT.jsonl to submit, or --follow BATCH_ID to follow a batch already submitted (not both)")
        return EXIT_USAGE
    if params["poll"] <= 0:
        _say(f"--poll must be > 0 seconds, got {params['poll']}")
        return EXIT_USAGE
    try:
        with GatewayBatches(params["gateway"], params["api_key"]) as api:
            batch_id = params["batch_id"] or _submit(api, params)
            return _report(api, _follow(api, batch_id, params), params)
    except BatchError as exc:
        _say(str(exc))
        return EXIT_FAILED
    except httpx.TransportError as exc:
        _say(f"the gateway at {params['gateway']} is unreachable: {type(exc).__name__}: {exc}")
        return EXIT_UNREACHABLE
    except OSError as exc:  # an output path that cannot be written
        _say(str(exc))
        return EXIT_USAGE
    except KeyboardInterrupt:
        _say("interrupted; the batch keeps running in the gateway (`stoker batch --follow BATCH_ID`)")
        return EXIT_INTERRUPTED
