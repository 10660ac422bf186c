"""The Batch API's pure parts: line validation, id derivation, output lines, state moves, the storage
folder's atomic writes and log, cursor pages. No Kafka, no Redis."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import msgspec
import pytest
from stoker.gateway.batch_api import _page, route_label
from stoker.gateway.batch_lines import (
    LineError,
    LineJob,
    NotJSONL,
    check_jsonl,
    line_id_for,
    parse_input,
    parse_line,
    parse_window,
    request_id_for,
    terminal_outcome,
)
from stoker.gateway.batch_state import BatchState, IllegalMove, decode_state, encode_state
from stoker.gateway.batches import BatchConfig, _log_entry, read_outcomes
from stoker.gateway.storage import FileObject, Storage
from stoker.schemas import Done, Error, Timings, Usage, is_valid_request_id

BATCH = "batch_0123456789abcdef0123456789abcdef"
CHAT = "/v1/chat/completions"


def line(custom_id: str | None = "a", url: str = CHAT, **body: Any) -> str:
    raw: dict[str, Any] = {"method": "POST", "url": url,
                           "body": body or {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5}}
    if custom_id is not None:
        raw["custom_id"] = custom_id
    return json.dumps(raw)


def parse(text: str, number: int = 1, seen: set[str] | None = None, endpoint: str = CHAT) -> LineJob | LineError:
    parsed = parse_line(text, number, BATCH, endpoint, 1_900_000_000_000, set() if seen is None else seen)
    assert parsed is not None
    return parsed


# ---- the upload check -------------------------------------------------------------------------------------------
def test_check_jsonl_counts_requests_and_allows_blank_lines() -> None:
    assert check_jsonl(b'{"a": 1}\n\n{"b": 2}\r\n  \n', max_lines=10) == 2


@pytest.mark.parametrize("data, says", [
    (b'{"a": 1}\n{"a": \n', "line 2 is not JSON"),
    (b'{"a": 1}\n"text"\n', "line 2 is a JSON str"),
    (b'{"a": 1}\n' + b"[" * 200_000 + b"]" * 200_000 + b"\n", "line 2 is not JSON"),  # past the recursion limit
    (b"\xff\xfe", "not UTF-8"),
    (b"\n \n", "no requests"),
    (b'{}\n{}\n{}\n', "more than 2 requests"),
])
def test_check_jsonl_rejects_what_is_not_jsonl_naming_the_line(data: bytes, says: str) -> None:
    with pytest.raises(NotJSONL, match=says):
        check_jsonl(data, max_lines=2)


# ---- the window, the ids ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("window, seconds", [("24h", 86400), ("90m", 5400), ("3600s", 3600), ("1d", 86400)])
def test_parse_window(window: str, seconds: int) -> None:
    assert parse_window(window) == seconds


@pytest.mark.parametrize("window", ["24", "0h", "8d", 24, "24H", "", None, "1h30m"])
def test_parse_window_rejects_naming_the_form(window: Any) -> None:
    with pytest.raises(ValueError, match="completion_window"):
        parse_window(window)


def test_request_ids_are_valid_stable_and_distinct() -> None:
    ids = {request_id_for(BATCH, n) for n in range(1, 50_001)}
    assert len(ids) == 50_000 and all(is_valid_request_id(i) for i in list(ids)[:100])
    assert request_id_for(BATCH, 7) == request_id_for(BATCH, 7) != request_id_for(BATCH.replace("0", "1"), 7)
    assert is_valid_request_id(request_id_for(BATCH, 50_000))
    assert line_id_for(BATCH, 3) == f"batch_req_{BATCH[6:]}_3"


# ---- one line ---------------------------------------------------------------------------------------------------
def test_a_valid_chat_line_becomes_its_job() -> None:
    parsed = parse(line("x", messages=[{"role": "user", "content": "hi"}], max_tokens=7, temperature=0, seed=3,
                        model="m", stop="END"), number=4)
    assert isinstance(parsed, LineJob) and parsed.custom_id == "x" and parsed.line == 4
    job = parsed.job
    assert job.request_id == f"{BATCH}:4" and job.deadline_ms == 1_900_000_000_000
    assert (job.max_tokens, job.temperature, job.seed, job.model, job.stop) == (7, 0.0, 3, "m", ["END"])
    assert job.messages is not None and job.messages[0].content == "hi"


def test_a_completions_line_takes_a_prompt_and_the_legacy_default_max_tokens() -> None:
    parsed = parse(line("p", url="/v1/completions", prompt="Once"), endpoint="/v1/completions")
    assert isinstance(parsed, LineJob) and parsed.job.prompt == "Once" and parsed.job.max_tokens == 16


@pytest.mark.parametrize("text, code, says", [
    (line(url="/v1/completions"), "invalid_url", "must be the batch's endpoint"),
    (json.dumps({"custom_id": "a", "method": "GET", "url": CHAT, "body": {}}), "invalid_method", "POST"),
    (line(custom_id=None), "missing_custom_id", "custom_id"),
    (json.dumps({"custom_id": "", "url": CHAT, "body": {}}), "missing_custom_id", "custom_id"),
    (json.dumps({"custom_id": "a", "url": CHAT, "body": []}), "invalid_body", "body"),
    (line(messages=[{"role": "user", "content": "x"}], stream=True), "unsupported", "stream"),
    (line(messages=[{"role": "user", "content": "x"}], logprobs=True), "unsupported", "logprobs"),
    (line(messages=[{"role": "user", "content": "x"}], n=2), "unsupported", "one completion"),
    (line(messages=[{"role": "user", "content": "x"}], max_tokens=0), "invalid_job", "max_tokens"),
    (line(messages=[{"role": "user", "content": "x"}], model=5), "invalid_type", "model"),
    (line(messages=[]), "invalid_value", "messages"),
    ("[1]", "invalid_request", "not a JSON object"),
    ("{oops", "invalid_json", "not JSON"),
    ("[" * 200_000 + "]" * 200_000, "invalid_json", "not JSON"),  # nested past the decoder's recursion limit
])
def test_a_bad_line_is_an_error_line_naming_what_is_wrong(text: str, code: str, says: str) -> None:
    parsed = parse(text, number=9)
    assert isinstance(parsed, LineError), parsed
    assert parsed.code == code and says in parsed.message and "line 9" in parsed.message


def test_two_prompts_in_a_completions_line_are_refused() -> None:
    parsed = parse(line("p", url="/v1/completions", prompt=["a", "b"]), endpoint="/v1/completions")
    assert isinstance(parsed, LineError) and "2" in parsed.message


def test_a_custom_id_met_again_is_an_error_and_the_first_runs() -> None:
    seen: set[str] = set()
    first, again = parse(line("dup"), 1, seen), parse(line("dup"), 2, seen)
    assert isinstance(first, LineJob)
    assert isinstance(again, LineError) and again.code == "duplicate_custom_id" and again.custom_id == "dup"


def test_parse_input_numbers_file_lines_and_skips_blank_ones() -> None:
    data = f"{line('a')}\n\n{line('b')}\n{line('a')}\n".encode()
    parsed = parse_input(data, BATCH, CHAT, 1)
    assert [(type(p).__name__, p.line) for p in parsed] == [("LineJob", 1), ("LineJob", 3), ("LineError", 4)]


# ---- output and error lines ------------------------------------------------------------------------------------
def _done(reason: str = "stop", text: str = "hello") -> Done:
    return Done(request_id=f"{BATCH}:2", attempt=1, seq=3, finish_reason=reason, text=text,  # type: ignore[arg-type]
                usage=Usage(prompt_tokens=5, completion_tokens=2, cached_tokens=1),
                timings=Timings(queue_ms=1.0, ttft_ms=2.0, total_ms=3.0), model="tiny", worker="w")


def _line_job() -> LineJob:
    parsed = parse(line("c2"), number=2)
    assert isinstance(parsed, LineJob)
    return parsed


def test_a_done_line_is_an_output_line_in_openai_shape() -> None:
    outcome = terminal_outcome(BATCH, _line_job(), CHAT, _done())
    record = outcome.record
    assert outcome.ok and (outcome.prompt_tokens, outcome.completion_tokens, outcome.cached_tokens) == (5, 2, 1)
    assert record["custom_id"] == "c2" and record["error"] is None and record["id"] == line_id_for(BATCH, 2)
    response = record["response"]
    assert response["status_code"] == 200 and response["request_id"] == f"{BATCH}:2"
    body = response["body"]
    assert body["object"] == "chat.completion" and body["model"] == "tiny"
    assert body["choices"][0]["message"] == {"role": "assistant", "content": "hello"}
    assert body["usage"]["total_tokens"] == 7


@pytest.mark.parametrize("reason, code", [("deadline", "batch_expired"), ("cancelled", "batch_cancelled")])
def test_a_line_the_batch_did_not_get_to_is_an_error_line(reason: str, code: str) -> None:
    outcome = terminal_outcome(BATCH, _line_job(), CHAT, _done(reason, ""))
    assert not outcome.ok and outcome.record["error"]["code"] == code and outcome.record["custom_id"] == "c2"


def test_an_error_event_is_an_error_line_with_the_endpoint_status() -> None:
    event = Error(request_id=f"{BATCH}:2", attempt=1, seq=0, code="context_length_exceeded", message="too long")
    record = terminal_outcome(BATCH, _line_job(), CHAT, event).record
    assert record["error"] == {"code": "context_length_exceeded", "message": "too long"}
    assert record["response"]["status_code"] == 400
    assert record["response"]["body"]["error"]["code"] == "context_length_exceeded"


# ---- the state ---------------------------------------------------------------------------------------------------
def _state() -> BatchState:
    return BatchState(id=BATCH, input_file_id="file-x", endpoint=CHAT, completion_window="24h", created_at=100,
                      deadline_ms=86_500_000, output_expires_s=3600, total=3)


def test_state_moves_follow_the_batch_api_and_stamp_their_time() -> None:
    state = _state()
    for status, at in (("in_progress", 101), ("finalizing", 102), ("completed", 103)):
        state.move(status, at)
    view = state.public()
    assert (view["status"], view["in_progress_at"], view["finalizing_at"], view["completed_at"]) == (
        "completed", 101, 102, 103)
    assert state.terminal and view["expires_at"] == 86_500


@pytest.mark.parametrize("path", [["completed"], ["in_progress", "completed"], ["in_progress", "cancelling",
                                                                                 "completed"],
                                  ["failed", "in_progress"], ["in_progress", "finalizing", "cancelling"]])
def test_illegal_state_moves_raise(path: list[str]) -> None:
    state = _state()
    with pytest.raises(IllegalMove):
        for status in path:
            state.move(status, 1)


def test_state_counts_and_round_trips_through_json() -> None:
    state = _state()
    state.count(True, 5, 2, 1)
    state.count(False)
    again = decode_state(encode_state(state))
    assert again == state and again.public()["request_counts"] == {"total": 3, "completed": 1, "failed": 1}
    assert again.public()["usage"]["total_tokens"] == 7


# ---- storage -----------------------------------------------------------------------------------------------------
def test_storage_writes_atomically_and_hides_expired_files(tmp_path: Path) -> None:
    storage = Storage(tmp_path)
    meta = FileObject(id="file-abc", bytes=3, created_at=1, filename="f.jsonl", purpose="batch", expires_at=2_000)
    storage.put_file(meta, b"{}\n")
    assert storage.get_file("file-abc", now_s=1_999) == meta and storage.get_file("file-abc", now_s=2_000) is None
    assert not list(tmp_path.rglob("*.tmp")), "a temporary file was left behind"
    assert storage.get_file("../files/file-abc") is None and not storage.valid_id("file-../x")
    assert storage.sweep_expired(now_s=2_001) == ["file-abc"]
    assert not storage.content_path("file-abc").exists()


def test_the_log_skips_a_torn_last_line_and_repair_cuts_it(tmp_path: Path) -> None:
    storage = Storage(tmp_path)
    storage.append_log(BATCH, [b'{"n": 1}', b'{"n": 2}'])
    with open(storage.log_path(BATCH), "ab") as out:
        out.write(b'{"n": 3, "tor')  # a crash mid-append
    assert [json.loads(x)["n"] for x in storage.read_log(BATCH)] == [1, 2]
    storage.repair_log(BATCH)
    storage.append_log(BATCH, [b'{"n": 4}'])
    assert [json.loads(x)["n"] for x in storage.read_log(BATCH)] == [1, 2, 4]


def test_read_outcomes_counts_a_line_logged_twice_once(tmp_path: Path) -> None:
    storage = Storage(tmp_path)
    first = terminal_outcome(BATCH, _line_job(), CHAT, _done(text="first"))
    again = terminal_outcome(BATCH, _line_job(), CHAT, _done(text="again"))
    storage.append_log(BATCH, [_log_entry(first), _log_entry(again)])
    outcomes = read_outcomes(storage, BATCH)
    assert list(outcomes) == [2] and outcomes[2].record == msgspec.json.decode(msgspec.json.encode(first.record))


# ---- HTTP helpers, settings -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("path, label", [("/v1/files", "/v1/files"), (f"/v1/files/file-{'a' * 32}", "/v1/files/{id}"),
                                         ("/v1/files/file-x/content", "/v1/files/{id}/content"),
                                         (f"/v1/batches/{BATCH}/cancel", "/v1/batches/{id}/cancel"),
                                         ("/v1/models", None), ("/v1/filesx", None)])
def test_route_labels_fold_ids(path: str, label: str | None) -> None:
    assert route_label(path) == label


def test_cursor_pages_follow_after() -> None:
    ids = ["a", "b", "c"]
    first = _page(ids, ids, None, 2)
    assert (first["data"], first["has_more"], first["last_id"]) == (["a", "b"], True, "b")
    second = _page(ids, ids, "b", 2)
    assert (second["data"], second["has_more"]) == (["c"], False)


def test_batch_config_names_bad_settings(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="max_in_flight must be > 0.*batch_topic.*legal Kafka topic.*lease_ttl_s"):
        BatchConfig(tmp_path, max_in_flight=0, lease_ttl_s=0.5, poll_s=0.25, batch_topic="no spaces")
