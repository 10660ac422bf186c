"""The gateway's OpenAI <-> job mapping (gateway.mapping), without HTTP, Kafka or Redis."""

from __future__ import annotations

import pytest
from stoker.gateway.mapping import APIError, job_fields, shape_for, sse, status_for
from stoker.schemas import Done, Timings, Usage


def test_a_chat_body_maps_to_messages_and_sampling_fields():
    body = {"model": "m", "messages": [{"role": "developer", "content": "be brief"},
                                       {"role": "user", "content": [{"type": "text", "text": "hi "},
                                                                    {"type": "text", "text": "there"}]}],
            "max_completion_tokens": 5, "temperature": 0, "stop": "\n", "user": "acme", "stream": True,
            "stream_options": {"include_usage": True}}
    fields, stream, include_usage = job_fields(body, chat=True)
    assert fields == {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi there"}],
                      "max_tokens": 5, "temperature": 0, "stop": ["\n"], "tenant": "acme"}
    assert (stream, include_usage) == (True, True)


def test_a_completion_body_takes_a_prompt_or_token_ids_and_the_legacy_default_length():
    assert job_fields({"prompt": "once"}, chat=False) == ({"prompt": "once", "max_tokens": 16}, False, False)
    assert job_fields({"prompt": [[1, 2]]}, chat=False)[0]["prompt_token_ids"] == [1, 2]
    with pytest.raises(APIError, match="`prompt` must be") as err:
        job_fields({"prompt": ["a", "b"]}, chat=False)
    assert err.value.status == 400


@pytest.mark.parametrize(("body", "chat", "status", "param"), [
    ({"messages": [{"role": "user", "content": "x"}], "n": 2}, True, 400, "n"),
    ({"messages": [{"role": "user", "content": "x"}], "tools": [{}]}, True, 400, "tools"),
    ({"messages": [{"role": "user", "content": "x"}], "logprobs": True}, True, 400, "logprobs"),
    ({"prompt": "x", "echo": True}, False, 400, "echo"),
    ({"prompt": "x", "temperature": True}, False, 422, "temperature"),  # a bool is not a number here
    ({"messages": []}, True, 400, "messages"),
])
def test_what_is_not_supported_or_mistyped_is_an_error_naming_the_field(body, chat, status, param):
    with pytest.raises(APIError) as err:
        job_fields(body, chat)
    assert (err.value.status, err.value.param) == (status, param)
    assert err.value.body()["error"]["param"] == param


def test_contract_error_codes_map_to_http_statuses():
    assert [status_for(c) for c in ("invalid_job", "message_too_large", "unknown_model", "internal")] == [
        400, 413, 404, 500]


def test_responses_take_the_jobs_id_text_and_usage():
    done = Done(request_id="r1", attempt=1, seq=2, finish_reason="length", text="hello",
                usage=Usage(prompt_tokens=3, completion_tokens=2, cached_tokens=1),
                timings=Timings(queue_ms=1, ttft_ms=2, total_ms=3), model="m", worker="w")
    chat = shape_for(True, "r1", "m")
    whole = chat.whole(done)
    assert (whole["id"], whole["object"], whole["choices"][0]["message"]["content"]) == (
        "chatcmpl-r1", "chat.completion", "hello")
    assert whole["usage"] == {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5,
                              "prompt_tokens_details": {"cached_tokens": 1}}
    assert chat.chunk(None, None, first=True)["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    completion = shape_for(False, "r1", "m").whole(done)
    assert (completion["id"], completion["choices"][0]["text"], completion["choices"][0]["finish_reason"]) == (
        "cmpl-r1", "hello", "length")
    assert sse("[DONE]") == b"data: [DONE]\n\n" and sse({"a": 1}) == b'data: {"a":1}\n\n'


SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}}


@pytest.mark.parametrize(("extra", "expected"), [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": SCHEMA, "strict": True}}},
     {"type": "json_schema", "json_schema": {"name": "n", "schema": SCHEMA, "strict": True}}),
    ({"response_format": {"type": "json_object"}}, {"type": "json_object"}),
    ({"guided_json": SCHEMA}, {"type": "json_schema", "json_schema": {"schema": SCHEMA}}),
    ({"guided_json": '{"type": "object", "properties": {"a": {"type": "integer"}}}'},
     {"type": "json_schema", "json_schema": {"schema": SCHEMA}}),
    ({"guided_regex": "[0-9]+"}, {"type": "regex", "pattern": "[0-9]+"}),
    ({"guided_choice": ["x", "y"]}, {"type": "choice", "choices": ["x", "y"]}),
    ({"structured_outputs": {"choice": ["x"]}}, {"type": "choice", "choices": ["x"]}),
    ({"structured_outputs": {"json": SCHEMA}}, {"type": "json_schema", "json_schema": {"schema": SCHEMA}}),
])
def test_output_constraints_map_to_response_format_with_v2(extra, expected):
    fields, _, _ = job_fields({"messages": [{"role": "user", "content": "hi"}], **extra}, chat=True)
    assert fields["response_format"] == expected and fields["v"] == 2


def test_text_format_is_no_constraint_and_others_are_400s():
    fields, _, _ = job_fields({"prompt": "p", "response_format": {"type": "text"}}, chat=False)
    assert "response_format" not in fields and "v" not in fields
    for body, param in (({"response_format": {"type": "xml"}}, "response_format"),
                        ({"guided_grammar": "root ::= x"}, "guided_grammar"),
                        ({"structured_outputs": {"grammar": "x"}}, "structured_outputs"),
                        ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
                        ({"guided_json": "{not json"}, "guided_json"),
                        ({"guided_choice": "a"}, "guided_choice")):
        with pytest.raises(APIError) as info:
            job_fields({"prompt": "p", **body}, chat=False)
        assert info.value.status in (400, 422) and info.value.param == param, (body, info.value.param)
    assert status_for("invalid_response_format") == 400
