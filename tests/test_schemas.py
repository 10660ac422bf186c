"""The wire contract (CONTRACT.md): codecs, every range rule and error code, fuzzing, import hygiene, schemas."""

import contextlib
import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import msgspec
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from stoker.schemas import (
    Cancel,
    ChatMessage,
    Chunk,
    ContractError,
    Done,
    Error,
    ErrorCode,
    Job,
    Names,
    Timings,
    TokenLogprob,
    TopLogprob,
    Usage,
    decode_cancel,
    decode_event,
    decode_job,
    encode,
    encode_cancel,
    encode_event,
    encode_job,
    generate,
)

from stoker import schemas

EXAMPLES = Path(schemas.__file__).parent / "examples"
MP = "application/msgpack"
RID = "req-1"


def example(name: str) -> dict[str, Any]:
    return json.loads((EXAMPLES / f"{name}.json").read_text())


def job_bytes(msgpack: bool = False, **fields: Any) -> bytes:
    body = {"type": "job", "request_id": RID, "prompt": "hi", **fields}
    return msgspec.msgpack.encode(body) if msgpack else json.dumps(body).encode()


def rejected(data: bytes, code: str = "invalid_job", content_type: str | None = None, **kw: Any) -> ContractError:
    with pytest.raises(ContractError) as info:
        decode_job(data, content_type, **kw)
    assert info.value.code == code, info.value
    return info.value


def assert_valid_job(job: Job) -> None:
    """An oracle independent of the Meta annotations: every range of the contract, checked by hand."""
    assert schemas.is_valid_request_id(job.request_id)
    assert sum(x is not None for x in (job.prompt, job.messages, job.prompt_token_ids)) == 1
    assert job.prompt is None or (isinstance(job.prompt, str) and job.prompt)
    assert job.messages is None or (job.messages and all(
        m.role in ("system", "user", "assistant", "tool") and isinstance(m.content, str) for m in job.messages))
    assert job.prompt_token_ids is None or (job.prompt_token_ids and all(
        type(t) is int and t >= 0 for t in job.prompt_token_ids))
    assert type(job.max_tokens) is int and job.max_tokens >= 1
    assert type(job.min_tokens) is int and 0 <= job.min_tokens <= job.max_tokens
    assert type(job.temperature) is float and math.isfinite(job.temperature) and job.temperature >= 0
    assert 0 < job.top_p <= 1 and 0 <= job.min_p <= 1 and type(job.top_k) is int and job.top_k >= 0
    assert job.seed is None or (type(job.seed) is int and 0 <= job.seed < 2**63)
    assert -2 <= job.presence_penalty <= 2 and -2 <= job.frequency_penalty <= 2 and job.repetition_penalty > 0
    assert isinstance(job.stop, list) and len(job.stop) <= 16 and all(isinstance(s, str) and s for s in job.stop)
    assert all(type(t) is int and t >= 0 for t in job.stop_token_ids)
    assert type(job.logprobs) is int and 0 <= job.logprobs <= 20
    assert type(job.ignore_eos) is bool and type(job.include_stop_str_in_output) is bool
    assert job.metadata is None or isinstance(job.metadata, dict)
    assert job.v in (1, 2) and (job.response_format is None or job.v == 2)


# ---- examples, defaults, round trips -------------------------------------------------------------------------

@pytest.mark.parametrize("path", sorted(EXAMPLES.glob("*.json")), ids=lambda p: p.stem)
def test_examples_decode(path: Path) -> None:
    data = path.read_bytes()
    kind = path.stem.split("_")[0]
    decoded = {"job": decode_job, "cancel": decode_cancel}.get(kind, decode_event)(data)
    assert msgspec.structs.asdict(decoded)["request_id"] == json.loads(data)["request_id"]
    assert type(decoded).__struct_config__.tag == kind
    if isinstance(decoded, Job):
        assert_valid_job(decoded)


def test_examples_cover_every_message_kind() -> None:
    assert {p.stem for p in EXAMPLES.glob("*.json")} >= {
        "job_minimal", "job_full", "job_chat", "cancel", "chunk", "done", "error"}


def test_minimal_job_gets_contract_defaults() -> None:
    job = decode_job((EXAMPLES / "job_minimal.json").read_bytes())
    assert (job.model, job.max_tokens, job.min_tokens, job.temperature, job.top_p, job.top_k, job.min_p) == (
        None, 256, 0, 1.0, 1.0, 0, 0.0)
    assert (job.seed, job.presence_penalty, job.frequency_penalty, job.repetition_penalty) == (None, 0.0, 0.0, 1.0)
    assert (job.stop, job.stop_token_ids, job.ignore_eos, job.include_stop_str_in_output) == ([], [], False, False)
    assert (job.logprobs, job.priority, job.deadline_ms, job.tenant, job.metadata, job.v) == (
        0, 0, None, None, None, 1)


def test_full_example_sets_every_job_field() -> None:
    # Keeps the full example honest: a new Job field must be shown there too.
    assert set(example("job_full")) - {"type"} == set(Job.__struct_fields__) - {"messages", "prompt_token_ids"}


MESSAGES = [
    Job(request_id="a", prompt="p", max_tokens=7, temperature=0.0, seed=2**63 - 1, stop=["x"], logprobs=20,
        metadata={"traceparent": "t", "nested": [1, {"k": None}]}, tenant="t", deadline_ms=1, priority=-5),
    Job(request_id="b", messages=[ChatMessage(role="system", content="s"), ChatMessage(role="user", content="")]),
    Job(request_id="c", prompt_token_ids=[0, 1, 128000], stop_token_ids=[2], ignore_eos=True),
    Cancel(request_id="d"),
    Chunk(request_id="e", attempt=2, seq=0, text="h\u00e9", token_ids=[5, 6], logprobs=[
        TokenLogprob(token_id=5, logprob=-0.5, top=[TopLogprob(token_id=5, logprob=-0.5)]),
        TokenLogprob(token_id=6, logprob=-9999.0, top=[])]),
    Chunk(request_id="e", attempt=1, seq=3, text="", token_ids=[]),
    Done(request_id="f", attempt=1, seq=9, finish_reason="length", text="abc", model="m", worker="w",
         usage=Usage(prompt_tokens=3, completion_tokens=3, cached_tokens=0),
         timings=Timings(queue_ms=-1.5, ttft_ms=2.0, total_ms=3.0), tenant="x", metadata={"a": 1}),
    Error(request_id="g", attempt=1, seq=0, code=ErrorCode.POISON_JOB, message="killed 3 workers"),
]


@pytest.mark.parametrize("msgpack", [False, True], ids=["json", "msgpack"])
@pytest.mark.parametrize("message", MESSAGES, ids=lambda m: type(m).__name__)
def test_round_trip(message: Any, msgpack: bool) -> None:
    if isinstance(message, Job):
        data = encode_job(message, msgpack)
        assert decode_job(data, schemas.content_type_for(msgpack)) == message
    elif isinstance(message, Cancel):
        assert decode_cancel(encode_cancel(message, msgpack)) == message  # sniffed: pub/sub has no headers
    else:
        data = encode_event(message, msgpack)
        assert decode_event(data, msgpack) == message
        assert decode_event(data) == message  # sniffed
    assert (encode(message, msgpack)[:1] == b"{") is not msgpack


def test_encoding_omits_defaults_and_tags_type() -> None:
    assert json.loads(encode(Job(request_id="a", prompt="p"))) == {"type": "job", "request_id": "a", "prompt": "p"}


# ---- null, unknown fields, version ---------------------------------------------------------------------------

def test_null_means_absent() -> None:
    optional = {name: None for name in Job.__struct_fields__ if name not in ("request_id", "prompt")}
    for msgpack in (False, True):
        job = decode_job(job_bytes(msgpack, **optional), MP if msgpack else None)
        assert job == Job(request_id=RID, prompt="hi")
    chat = decode_job(json.dumps({"type": "job", "request_id": RID, "messages": [
        {"role": "user", "content": "x", "name": None}], "prompt": None}).encode())
    assert chat.messages == [ChatMessage(role="user", content="x")]
    # Inside the opaque metadata nothing is dropped: it is echoed back as sent.
    assert decode_job(job_bytes(metadata={"k": None})).metadata == {"k": None}


def test_null_required_field_is_rejected() -> None:
    err = rejected(job_bytes(messages=[{"role": None, "content": "x"}], prompt=None))
    assert "role" in err.message and err.request_id == RID


def test_unknown_fields_ignored() -> None:
    job = decode_job(job_bytes(future_field={"x": 1}, messages=None, best_of=3))
    assert job == Job(request_id=RID, prompt="hi")
    assert decode_event(b'{"type":"error","request_id":"a","attempt":1,"seq":0,"code":"x","message":"m","new":1}')


@pytest.mark.parametrize("content_type", [None, MP])
def test_newer_version_is_unsupported_with_request_id(content_type: str | None) -> None:
    err = rejected(job_bytes(content_type == MP, v=3, top_p=7), "unsupported_version", content_type)
    assert err.request_id == RID and "v=3" in err.message
    with pytest.raises(ContractError) as info:
        decode_cancel(b'{"type":"cancel","request_id":"x","v":3}')
    assert info.value.code == "unsupported_version"


def test_response_format_needs_v2_and_is_bounded() -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}, "strict": True}}
    job = decode_job(job_bytes(v=2, response_format=fmt))
    assert job.response_format is not None and job.response_format.json_schema.schema == {"type": "object"}
    assert "v: 2" in rejected(job_bytes(response_format=fmt)).message
    for other in ({"type": "json_object"}, {"type": "regex", "pattern": "[a-z]+"}, {"type": "choice", "choices": ["a"]}):
        assert decode_job(job_bytes(v=2, response_format=other)).response_format is not None
    for bad in ({"type": "regex", "pattern": ""}, {"type": "choice", "choices": []}, {"type": "grammar"},
                {"type": "json_schema", "json_schema": {"name": "x"}}):
        rejected(job_bytes(v=2, response_format=bad))
    big = {"type": "json_schema", "json_schema": {"schema": {"description": "x" * 65536}}}
    assert "65536" in rejected(job_bytes(v=2, response_format=big)).message


@pytest.mark.parametrize("v", [0, -1, "2", True, 1.5])
def test_malformed_version_is_invalid_job(v: Any) -> None:
    assert rejected(job_bytes(v=v)).request_id == RID


def test_current_version_accepted() -> None:
    assert decode_job(job_bytes(v=1)).v == 1


# ---- every range rule --------------------------------------------------------------------------------------------

RANGES: list[tuple[str, list[Any], list[Any]]] = [  # field, rejected values, accepted boundary values
    ("max_tokens", [0, -1, "10", True, 1.5], [1, 10**6]),
    ("min_tokens", [-1, 257], [0, 256]),  # max_tokens is 256 by default
    ("temperature", [-0.01, "1"], [0, 0.0, 2.5]),
    ("top_p", [0, -0.1, 1.0001], [1e-9, 1, 1.0]),
    ("top_k", [-1, 0.5], [0, 40]),
    ("min_p", [-0.1, 1.1], [0, 1]),
    ("seed", [-1, 2**63, "1"], [0, 2**63 - 1]),
    ("presence_penalty", [-2.01, 2.01], [-2, 2]),
    ("frequency_penalty", [-2.01, 2.01], [-2, 2]),
    ("repetition_penalty", [0, -1], [0.01, 2]),
    ("stop", ["abc", [1], [""], ["s"] * 17, {"a": 1}], [[], ["s"] * 16, ["\n"]]),
    ("stop_token_ids", [[-1], 3, ["1"]], [[], [0, 128009]]),
    ("logprobs", [-1, 21, False], [0, 20]),
    ("ignore_eos", [1, "true"], [True, False]),
    ("priority", [2**63, "0"], [-(2**63), 2**63 - 1]),
    ("deadline_ms", [-1, 1.5], [0, 1924992000000]),
    ("tenant", [1, [], "", "t" * 65], ["acme", "a", "t" * 64]),
    ("model", [1], ["m"]),
    ("metadata", [[1], "x", 5], [{}, {"a": [1]}]),
]


@pytest.mark.parametrize(("field", "bad", "good"), RANGES, ids=[r[0] for r in RANGES])
def test_range_rules(field: str, bad: list[Any], good: list[Any]) -> None:
    for value in bad:
        err = rejected(job_bytes(**{field: value}))
        assert field in err.message, err.message  # names the field
        assert err.request_id == RID  # so the worker can tell the requester
    for value in good:
        assert getattr(decode_job(job_bytes(**{field: value})), field) == value


def test_range_errors_name_the_allowed_range() -> None:
    assert "<= 1.0" in rejected(job_bytes(top_p=2)).message
    assert "<= 20" in rejected(job_bytes(logprobs=99)).message
    assert "min_tokens" in rejected(job_bytes(min_tokens=5, max_tokens=4)).message


@pytest.mark.parametrize("msgpack", [False, True], ids=["json", "msgpack"])
def test_metadata_is_bounded_at_16_kib_encoded_in_the_jobs_own_encoding(msgpack: bool) -> None:
    limit = 16 * 1024
    assert limit == schemas.MAX_METADATA_BYTES
    encoder = msgspec.msgpack.encode if msgpack else msgspec.json.encode
    # The overhead of {"k": <string>} at these lengths (MessagePack's string header grows with the length).
    filler = limit - (len(encoder({"k": "x" * 1000})) - 1000)
    at_limit = {"k": "x" * filler}
    assert len(encoder(at_limit)) == limit
    ctype = MP if msgpack else None
    assert decode_job(job_bytes(msgpack, metadata=at_limit), ctype).metadata == at_limit
    over = {"k": "x" * (filler + 1)}
    err = rejected(job_bytes(msgpack, metadata=over), content_type=ctype)
    assert "metadata" in err.message and str(limit + 1) in err.message and "16384" in err.message
    assert err.request_id == RID
    # A producer learns it before sending: encode_job runs the same check.
    with pytest.raises(ContractError, match="metadata"):
        schemas.encode_job(Job(request_id=RID, prompt="p", metadata=over), msgpack)


def test_min_tokens_equal_to_max_tokens_is_fine() -> None:
    assert decode_job(job_bytes(min_tokens=4, max_tokens=4)).min_tokens == 4


def test_non_finite_temperature_rejected_through_msgpack() -> None:
    for value in (math.inf, math.nan):
        assert "temperature" in rejected(job_bytes(True, temperature=value), content_type=MP).message
    assert "top_p" in rejected(job_bytes(True, top_p=math.nan), content_type=MP).message


@pytest.mark.parametrize("request_id", ["", "a" * 129, "has space", "abc\n", "\u00fc", "a*", 5, None, ["a"]])
def test_bad_request_id(request_id: Any) -> None:
    err = rejected(job_bytes(request_id=request_id))
    assert "request_id" in err.message and err.request_id is None


@pytest.mark.parametrize("request_id", ["a" * 128, "A-z_0.9:x", "3f1c2a9e-5b7d-4c1e-9a0b-2d6f8e4c1a77"])
def test_good_request_id(request_id: str) -> None:
    assert decode_job(job_bytes(request_id=request_id)).request_id == request_id


@pytest.mark.parametrize("forms", [{}, {"messages": [{"role": "user", "content": "x"}]},
                                   {"prompt_token_ids": [1]},
                                   {"messages": [{"role": "user", "content": "x"}], "prompt_token_ids": [1]}])
def test_exactly_one_prompt_form(forms: dict[str, Any]) -> None:
    body = {"type": "job", "request_id": RID, **forms}
    if len(forms) == 1:
        body["prompt"] = "p"  # a second form next to the one given
    err = rejected(json.dumps(body).encode())
    assert "exactly one of" in err.message and err.request_id == RID


@pytest.mark.parametrize(("field", "value"), [
    ("prompt", ""), ("prompt", 5), ("prompt", ["a"]), ("messages", []), ("messages", "hi"),
    ("messages", [{"role": "robot", "content": "x"}]), ("messages", [{"role": "user"}]),
    ("messages", [{"role": "user", "content": 1}]), ("messages", ["x"]),
    ("prompt_token_ids", []), ("prompt_token_ids", [-1]), ("prompt_token_ids", [1.5]), ("prompt_token_ids", "1 2"),
])
def test_bad_prompt_forms(field: str, value: Any) -> None:
    assert field in rejected(json.dumps({"type": "job", "request_id": RID, field: value}).encode()).message


def test_every_chat_role_accepted() -> None:
    roles = ["system", "user", "assistant", "tool"]
    job = decode_job(json.dumps({"type": "job", "request_id": RID,
                                 "messages": [{"role": r, "content": r} for r in roles]}).encode())
    assert [m.role for m in job.messages or []] == roles


# ---- the other error codes -------------------------------------------------------------------------------------

def test_size_limit_default_and_configurable() -> None:
    assert schemas.DEFAULT_MAX_MESSAGE_BYTES == 1 << 20
    big = job_bytes(prompt="x" * (1 << 20))
    err = rejected(big, "message_too_large")
    assert str(len(big)) in err.message and str(1 << 20) in err.message
    small = job_bytes()
    assert decode_job(small, max_bytes=len(small)).prompt == "hi"  # the limit is inclusive
    rejected(small, "message_too_large", max_bytes=len(small) - 1)
    assert decode_job(big, max_bytes=2 << 20).prompt == "x" * (1 << 20)
    with pytest.raises(ContractError, match="message_too_large"):
        encode_job(Job(request_id="a", prompt="x" * 100), max_bytes=50)


@pytest.mark.parametrize("data", [None, b"", b"{", b"\xff\xfe", b"[1,2]", b'"job"', b"null", b"[" * 50000])
def test_unparseable_body_is_invalid_job_without_request_id(data: bytes | None) -> None:
    assert rejected(data).request_id is None  # type: ignore[arg-type]


def test_msgpack_without_header_gets_a_hint() -> None:
    assert "content-type: application/msgpack" in rejected(job_bytes(True)).message


def test_wrong_type_tag_keeps_request_id() -> None:
    for tag in ("cancel", "chunk", None, 7):
        body = json.loads(job_bytes())
        body["type"] = tag
        assert rejected(json.dumps(body).encode()).request_id == RID
    body.pop("type")
    assert "type" in rejected(json.dumps(body).encode()).message


@pytest.mark.parametrize(("header", "msgpack"), [
    (None, False), ("application/json", False), ("Application/JSON; charset=utf-8", False), ("", False),
    ("application/msgpack", True), (b"application/msgpack", True), ("application/x-msgpack", True)])
def test_content_type_header(header: Any, msgpack: bool) -> None:
    assert schemas.is_msgpack(header) is msgpack
    assert decode_job(job_bytes(msgpack), header).prompt == "hi"


def test_unsupported_content_type() -> None:
    rejected(job_bytes(), "unsupported_content_type", "text/plain")
    assert schemas.content_type_of([("Content-Type", b"application/msgpack"), ("x", b"y")]) == b"application/msgpack"
    assert schemas.content_type_of([("x", b"y")]) is None and schemas.content_type_of(None) is None


def test_cancel_errors_use_their_own_code() -> None:
    for data in (b'{"type":"cancel"}', b'{"type":"job","request_id":"a"}', b"nope"):
        with pytest.raises(ContractError) as info:
            decode_cancel(data)
        assert info.value.code == "invalid_cancel"


@pytest.mark.parametrize("data", [b"", b"{}", b'{"type":"progress","request_id":"a","attempt":1,"seq":0}',
                                  b'{"type":"chunk","request_id":"a","attempt":0,"seq":0,"text":"","token_ids":[]}',
                                  b'{"type":"done","request_id":"a","attempt":1,"seq":0,"finish_reason":"eos"}',
                                  b"\x80", b"[" * 50000])
def test_bad_event_is_invalid_event(data: bytes) -> None:
    with pytest.raises(ContractError) as info:
        decode_event(data)
    assert info.value.code == "invalid_event"


# ---- Python construction and producer-side validation --------------------------------------------------------------

def test_constructing_a_job_checks_cross_field_rules() -> None:
    with pytest.raises(ContractError, match="exactly one of"):
        Job(request_id="a")
    with pytest.raises(ContractError, match="min_tokens"):
        Job(request_id="a", prompt="p", min_tokens=3, max_tokens=2)
    with pytest.raises(ContractError, match="request_id"):
        Cancel(request_id="bad id")


@pytest.mark.parametrize("msgpack", [False, True])
def test_encode_job_validates_ranges_before_sending(msgpack: bool) -> None:
    for bad in (Job(request_id="a", prompt="p", top_p=5.0), Job(request_id="a", prompt="p", seed=2**70),
                Job(request_id="a", prompt="p", metadata={"s": object()})):
        with pytest.raises(ContractError) as info:
            encode_job(bad, msgpack)
        assert info.value.code == "invalid_job" and info.value.request_id == "a"


def test_contract_error_is_a_value_error_and_pickles() -> None:
    import pickle
    err = ContractError("invalid_job", "m", "r")
    copy = pickle.loads(pickle.dumps(err))
    assert isinstance(copy, ContractError) and isinstance(copy, ValueError)
    assert (copy.code, copy.message, copy.request_id) == ("invalid_job", "m", "r")
    assert str(copy) == "invalid_job: m"


# ---- names --------------------------------------------------------------------------------------------------------

def test_default_names_match_the_contract() -> None:
    n = Names()
    assert (n.jobs_topic, n.dlq_topic, n.cancel_channel) == ("stoker.jobs", "stoker.jobs.dlq", "stoker:cancel")
    assert [f(RID) for f in (n.events_channel, n.stream, n.result, n.cancelled, n.claim)] == [
        f"stoker:{k}:{RID}" for k in ("events", "stream", "result", "cancelled", "claim")]
    assert schemas.DLQ_HEADERS == ("stoker-error-code", "stoker-error-message", "stoker-failed-at",
                                   "stoker-worker", "stoker-attempts")
    assert (schemas.STREAM_FIELD, schemas.CONTENT_TYPE_HEADER, schemas.MSGPACK_CONTENT_TYPE) == (
        "data", "content-type", "application/msgpack")


def test_configured_names() -> None:
    n = Names(redis_prefix="t1", jobs_topic="t1.jobs")
    assert (n.dlq_topic, n.result("x"), n.cancel_channel) == ("t1.jobs.dlq", "t1:result:x", "t1:cancel")
    assert Names(dlq_topic="dead").dlq_topic == "dead"
    for kwargs in ({"redis_prefix": ""}, {"redis_prefix": "a b"}, {"jobs_topic": "bad topic"},
                   {"jobs_topic": "x", "dlq_topic": "x"}):
        with pytest.raises(ValueError):
            Names(**kwargs)
    with pytest.raises(ValueError, match="request_id"):
        Names().result("a*")  # would escape the key namespace


def test_dlq_headers() -> None:
    assert schemas.dlq_headers("poison_job", "killed 3 workers", 1700000000000, "w1", 3) == [
        ("stoker-error-code", b"poison_job"), ("stoker-error-message", b"killed 3 workers"),
        ("stoker-failed-at", b"1700000000000"), ("stoker-worker", b"w1"), ("stoker-attempts", b"3")]


# ---- fuzzing: decoders either return a valid Struct or raise ContractError -----------------------------------------

FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@FUZZ
@given(st.binary(max_size=256), st.sampled_from([None, MP]))
def test_random_bytes(data: bytes, content_type: str | None) -> None:
    for decode in (lambda: decode_job(data, content_type), lambda: decode_cancel(data), lambda: decode_event(data)):
        with contextlib.suppress(ContractError):
            decode()


VALUES = st.one_of(
    st.none(), st.booleans(), st.integers(), st.integers(-3, 300), st.floats(), st.floats(-3, 3),
    st.text(max_size=8), st.sampled_from(["job", "cancel", "user", "robot", RID]),
    st.lists(st.one_of(st.integers(-2, 10), st.text(max_size=3)), max_size=18),
    st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "robot", None]),
                                    "content": st.one_of(st.text(max_size=3), st.none(), st.integers())}), max_size=3),
    st.dictionaries(st.text(max_size=4), st.integers(), max_size=3),
)
FIELDS = st.sampled_from([*Job.__struct_fields__, "type", "v", "unknown_field"])


@st.composite
def mutated_jobs(draw: st.DrawFn) -> dict[str, Any]:
    body = example(draw(st.sampled_from(["job_minimal", "job_full", "job_chat"])))
    for _ in range(draw(st.integers(1, 4))):
        field = draw(FIELDS)
        if draw(st.booleans()) and field in body:
            del body[field]
        else:
            body[field] = draw(VALUES)
    return body


@FUZZ
@given(mutated_jobs(), st.booleans())
def test_mutated_jobs(body: dict[str, Any], msgpack: bool) -> None:
    parseable = True
    if msgpack:
        try:
            data = msgspec.msgpack.encode(body)
        except OverflowError:  # an int beyond 64 bits has no MessagePack form
            assume(False)
    else:
        try:
            data = json.dumps(body, allow_nan=False).encode()
        except ValueError:  # NaN/Infinity: feed the invalid JSON anyway; no request_id can be read from it
            data, parseable = json.dumps(body).encode(), False
    try:
        job = decode_job(data, MP if msgpack else None)
    except ContractError as err:
        assert err.code in ("invalid_job", "unsupported_version")
        if parseable and schemas.is_valid_request_id(body.get("request_id")):
            assert err.request_id == body["request_id"]
        return
    assert_valid_job(job)
    assert decode_job(encode_job(job, msgpack), MP if msgpack else None) == job


# ---- import hygiene and generated files -----------------------------------------------------------------------------

IMPORT_CHECK = """
import sys, importlib.abc
BLOCKED = {"torch", "triton", "numpy", "aiokafka", "redis"}
OURS = {"engine", "worker", "client", "gateway", "devstack"}  # stoker.X, and the folders' bare names too
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        parts = name.split(".")
        if parts[0] in BLOCKED | OURS or parts[0] == "stoker" and len(parts) > 1 and parts[1] in OURS:
            raise ImportError(f"schemas must not import {name}")
sys.meta_path.insert(0, Block())
from stoker import schemas
assert schemas.decode_job(b'{"type":"job","request_id":"a","prompt":"p"}').prompt == "p"
import stoker.schemas.generate
schemas.generate.render()
# msgspec itself imports typing_extensions when installed; "_" names are interpreter start-up hooks (.pth files).
allowed = set(sys.stdlib_module_names) | {"stoker", "msgspec", "typing_extensions", "__main__"}
third_party = {m.split(".")[0] for m in sys.modules} - allowed
assert not {m for m in third_party if not m.startswith("_")}, third_party
print("ok")
"""


def test_schemas_imports_only_msgspec_and_stdlib() -> None:
    root = Path(schemas.__file__).parent.parent
    result = subprocess.run([sys.executable, "-c", IMPORT_CHECK], cwd=root, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr


def test_committed_json_schemas_are_fresh() -> None:
    for name, text in generate.render().items():
        assert (generate.SCHEMA_DIR / name).read_text() == text, f"{name} is stale: run `python -m stoker.schemas.generate`"
    assert generate.main(["--check"]) == 0


def test_json_schema_carries_ranges_and_rules() -> None:
    job = json.loads((generate.SCHEMA_DIR / "job.schema.json").read_text())["$defs"]["Job"]
    props = job["properties"]
    assert (props["top_p"]["exclusiveMinimum"], props["top_p"]["maximum"]) == (0.0, 1.0)
    assert props["stop"]["maxItems"] == 16 and props["logprobs"]["maximum"] == 20
    assert props["request_id"]["maxLength"] == 128 and "request_id" in job["required"]
    assert len(job["oneOf"]) == 3
    event = json.loads((generate.SCHEMA_DIR / "event.schema.json").read_text())
    assert set(event["$defs"]) >= {"Chunk", "Done", "Error", "Usage", "Timings", "TokenLogprob", "TopLogprob"}


def test_worker_ids_skip_index_members_that_are_not_text() -> None:
    """The worker index is writable by anyone who writes the prefix's keys: a member that is not UTF-8 is no
    worker's id and is skipped, str members pass as they are (tests/test_routing_stack.py has the whole path)."""
    assert schemas.worker_ids([b"w-1", "w-2", b"\xff\xfe", b"caf\xc3\xa9"]) == ["w-1", "w-2", "café"]
