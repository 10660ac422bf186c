"""The Batch API's lines: the input file's JSONL in, the output and error files' lines out. Pure functions.

An input line is OpenAI's `{"custom_id", "method": "POST", "url", "body"}`; its body is mapped to a job by
the same code as a live request (gateway.mapping.plan_request), so a batch line accepts exactly what
/v1/chat/completions or /v1/completions accepts, less what a batch cannot carry (streaming, n > 1, several
prompts, logprobs: the gateway gathers results from the result key, which holds the done event alone).

A line that is JSON but not a valid request becomes an error line (the batch goes on); a file whose lines
are not JSON at all is rejected when uploaded (`check_jsonl`). Every job's request id is derived from the
batch id and the line number (`request_id_for`): producing a line again (a gateway restarted mid-batch)
names the same job, which a worker does not run twice.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import msgspec
from stoker.gateway.mapping import APIError, Choice, plan_request, shape_for, status_for
from stoker.schemas import ContractError, Done, Job, decode_job
from stoker.schemas import Error as ErrorEvent

ENDPOINTS = {"/v1/chat/completions": True, "/v1/completions": False}  # endpoint -> chat?
MAX_CUSTOM_ID_CHARS = 512
_WINDOW = re.compile(r"(\d+)(s|m|h|d)")
_WINDOW_UNIT_S = {"s": 1, "m": 60, "h": 3600, "d": 86400}
MAX_WINDOW_S = 7 * 86400  # a deadline further out than this is a typo, not a plan


class NotJSONL(ValueError):
    """The upload is not a JSONL file: not UTF-8, or a line that is not a JSON object."""


def check_jsonl(data: bytes, max_lines: int) -> int:
    """The number of non-blank lines of a JSONL upload, or NotJSONL naming the first bad line. Blank lines
    are allowed (a trailing newline, an editor's empty last line) and are not requests."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise NotJSONL(f"the file is not UTF-8 text (byte {exc.start}): upload a JSONL file") from None
    count = 0
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            value = msgspec.json.decode(line)
        except (msgspec.DecodeError, RecursionError) as exc:  # RecursionError: nested past the decoder's limit
            raise NotJSONL(f"line {number} is not JSON ({exc}): upload one JSON object per line") from None
        if not isinstance(value, dict):
            raise NotJSONL(f"line {number} is a JSON {type(value).__name__}, not an object: one request object "
                           "per line") from None
        count += 1
        if count > max_lines:
            raise NotJSONL(f"the file has more than {max_lines} requests: split it into several batches")
    if count == 0:
        raise NotJSONL("the file holds no requests: one JSON object per line")
    return count


def parse_window(window: Any) -> int:
    """`completion_window` ("24h", also "90m", "3600s", "1d") -> seconds; ValueError says what is accepted."""
    found = _WINDOW.fullmatch(window) if isinstance(window, str) else None
    seconds = int(found.group(1)) * _WINDOW_UNIT_S[found.group(2)] if found else 0
    if not 1 <= seconds <= MAX_WINDOW_S:
        raise ValueError(f"`completion_window` must be a duration like \"24h\" (a number and s, m, h or d, at "
                         f"most {MAX_WINDOW_S // 86400}d), got {window!r}")
    return seconds


def request_id_for(batch_id: str, line: int) -> str:
    """The job id of one line: the same for every production of that line, unique across batches."""
    return f"{batch_id}:{line}"


def line_id_for(batch_id: str, line: int) -> str:
    """The `id` of a line in the output or error file (OpenAI's `batch_req_...`), stable across restarts."""
    return f"batch_req_{batch_id.removeprefix('batch_')}_{line}"


@dataclass(frozen=True, slots=True)
class LineJob:
    """A valid input line: its job, ready to produce."""

    line: int
    custom_id: str
    job: Job


@dataclass(frozen=True, slots=True)
class LineError:
    """An input line that cannot run; `custom_id` is None when the line names none."""

    line: int
    custom_id: str | None
    code: str
    message: str
    status: int = 400


def _custom_id(raw: dict[str, Any]) -> str | None:
    value = raw.get("custom_id")
    return value if isinstance(value, str) and 0 < len(value) <= MAX_CUSTOM_ID_CHARS else None


def _job(request_id: str, fields: dict[str, Any]) -> Job:
    """The job, checked by the worker's own decoder (the messages a worker would answer with, but now)."""
    raw = {"type": "job", "request_id": request_id, **fields}
    try:
        data = msgspec.json.encode(raw)
    except (TypeError, msgspec.EncodeError) as exc:
        raise ContractError("invalid_job", f"cannot encode the job: {exc}", request_id) from None
    return decode_job(data)


def _fields(body: dict[str, Any], chat: bool) -> dict[str, Any]:
    """A line's body -> one job's fields, or APIError. A batch line is one job: one prompt, one choice."""
    plan = plan_request(body, chat)
    if plan.stream:
        raise APIError(400, "`stream` cannot be used in a batch: results are written to the output file",
                       param="stream", code="unsupported")
    if plan.top_logprobs is not None:
        raise APIError(400, "`logprobs` are not returned by batches: send that request to the endpoint itself",
                       param="logprobs", code="unsupported")
    jobs = plan.jobs()
    if len(jobs) != 1:
        raise APIError(400, f"a batch line must ask for one completion (n = 1, one prompt), this one asks for "
                       f"{len(jobs)}: write one line per prompt", param="n", code="unsupported")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise APIError(422, "`model` must be a string", param="model", code="invalid_type")
    return jobs[0] | ({"model": model} if model else {})


def parse_line(text: str, line: int, batch_id: str, endpoint: str, deadline_ms: int,
               seen: set[str]) -> LineJob | LineError | None:
    """One input line -> its job, an error line, or None for a blank line. `seen` collects custom_ids: a
    custom_id met again is an error line (the first one runs), so each custom_id is answered once."""
    if not text.strip():
        return None
    try:
        raw = msgspec.json.decode(text)
    except (msgspec.DecodeError, RecursionError) as exc:  # check_jsonl passed it; kept for files written by other means
        return LineError(line, None, "invalid_json", f"line {line} is not JSON: {exc}")
    if not isinstance(raw, dict):
        return LineError(line, None, "invalid_request", f"line {line} is not a JSON object")
    custom_id = _custom_id(raw)
    if custom_id is None:
        return LineError(line, None, "missing_custom_id", f"line {line}: `custom_id` must be a string of 1-"
                         f"{MAX_CUSTOM_ID_CHARS} characters, unique in the file")
    if custom_id in seen:
        return LineError(line, custom_id, "duplicate_custom_id", f"line {line}: custom_id {custom_id!r} was "
                         "used by an earlier line (that one runs): give every line its own custom_id")
    seen.add(custom_id)
    return _line_job(raw, line, custom_id, batch_id, endpoint, deadline_ms)


def _line_job(raw: dict[str, Any], line: int, custom_id: str, batch_id: str, endpoint: str,
              deadline_ms: int) -> LineJob | LineError:
    if raw.get("method", "POST") != "POST":
        return LineError(line, custom_id, "invalid_method", f"line {line}: `method` must be \"POST\"")
    if raw.get("url") != endpoint:
        return LineError(line, custom_id, "invalid_url", f"line {line}: `url` must be the batch's endpoint "
                         f"{endpoint!r}, got {raw.get('url')!r}")
    body = raw.get("body")
    if not isinstance(body, dict):
        return LineError(line, custom_id, "invalid_body", f"line {line}: `body` must be the request object")
    try:
        fields = _fields(body, ENDPOINTS[endpoint])
        return LineJob(line, custom_id, _job(request_id_for(batch_id, line), fields | {"deadline_ms": deadline_ms}))
    except APIError as exc:
        return LineError(line, custom_id, exc.code or "invalid_request", f"line {line}: {exc.message}", exc.status)
    except ContractError as exc:
        return LineError(line, custom_id, exc.code, f"line {line}: {exc.message}", status_for(exc.code))


def parse_input(data: bytes, batch_id: str, endpoint: str, deadline_ms: int) -> list[LineJob | LineError]:
    """Every request line of an input file, in file order (line numbers count from 1, blank lines too)."""
    seen: set[str] = set()
    parsed = (parse_line(text, number, batch_id, endpoint, deadline_ms, seen)
              for number, text in enumerate(data.decode("utf-8", errors="replace").splitlines(), start=1))
    return [p for p in parsed if p is not None]


# ---- output and error lines -------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Outcome:
    """One answered line: `record` is its line in the output file (`ok`) or the error file."""

    line: int
    ok: bool
    record: dict[str, Any]
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0


# A done event's finish_reason that is no answer: OpenAI's codes for lines a batch did not get to.
UNANSWERED = {"deadline": ("batch_expired", "the batch's completion window ended before this request finished"),
              "cancelled": ("batch_cancelled", "the batch was cancelled before this request finished")}


def error_outcome(batch_id: str, line: int, custom_id: str | None, code: str, message: str,
                  status: int | None = None) -> Outcome:
    """An error-file line. With `status`, `response` carries the HTTP answer the endpoint would have given."""
    response = None if status is None else {"status_code": status, "request_id": request_id_for(batch_id, line),
                                            "body": APIError(status, message, code=code).body()}
    record = {"id": line_id_for(batch_id, line), "custom_id": custom_id, "response": response,
              "error": {"code": code, "message": message}}
    return Outcome(line, False, record)


def invalid_outcome(batch_id: str, bad: LineError) -> Outcome:
    return error_outcome(batch_id, bad.line, bad.custom_id, bad.code, bad.message, bad.status)


def terminal_outcome(batch_id: str, line: LineJob, endpoint: str, event: Done | ErrorEvent) -> Outcome:
    """A line's terminal event -> its output line (a done that answered) or its error line."""
    if isinstance(event, ErrorEvent):
        return error_outcome(batch_id, line.line, line.custom_id, event.code, event.message, status_for(event.code))
    if event.finish_reason in UNANSWERED:
        code, message = UNANSWERED[event.finish_reason]
        return error_outcome(batch_id, line.line, line.custom_id, code, message)
    request_id = request_id_for(batch_id, line.line)
    shape = shape_for(ENDPOINTS[endpoint], request_id, event.model or line.job.model or "")
    body = shape.whole([Choice(0, done=event)])
    record = {"id": line_id_for(batch_id, line.line), "custom_id": line.custom_id,
              "response": {"status_code": 200, "request_id": request_id, "body": body}, "error": None}
    usage = event.usage
    return Outcome(line.line, True, record, usage.prompt_tokens, usage.completion_tokens, usage.cached_tokens)
