"""The gateway's OpenAI <-> job mapping (gateway.mapping), without HTTP, Kafka or Redis."""

from __future__ import annotations

import pytest
from stoker.gateway.mapping import APIError, Choice, json_object, plan_request, shape_for, sse, status_for
from stoker.schemas import Chunk, Done, Timings, TokenLogprob, TopLogprob, Usage


def job_fields(body: dict, chat: bool) -> tuple[dict, bool, bool]:
    """The one job of a single-choice request, stream?, include usage?"""
    plan = plan_request(body, chat)
    (fields,) = plan.jobs()
    return fields, plan.stream, plan.include_usage


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
        plan_request({"prompt": ["a", 5]}, chat=False)
    assert err.value.status == 400


def test_n_and_a_batch_of_prompts_fan_out_one_job_per_choice_in_vllms_order():
    plan = plan_request({"prompt": ["a", [1, 2]], "n": 2, "max_tokens": 3, "stop_token_ids": [7],
                         "include_stop_str_in_output": True}, chat=False)
    assert plan.jobs() == [{"prompt": "a", "max_tokens": 3, "stop_token_ids": [7], "include_stop_str_in_output": True}] * 2 + [
        {"prompt_token_ids": [1, 2], "max_tokens": 3, "stop_token_ids": [7], "include_stop_str_in_output": True}] * 2
    with pytest.raises(APIError) as err:
        plan_request({"prompt": ["a"] * 65, "n": 2}, chat=False)
    assert err.value.param == "n"


def test_logprobs_ask_the_job_for_at_least_one_alternative_and_remember_how_many_to_show():
    chat = plan_request({"messages": [{"role": "user", "content": "x"}], "logprobs": True}, chat=True)
    assert (chat.top_logprobs, chat.jobs()[0]["logprobs"]) == (0, 1)
    chat = plan_request({"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 3}, True)
    assert (chat.top_logprobs, chat.jobs()[0]["logprobs"]) == (3, 3)
    assert plan_request({"prompt": "x", "logprobs": 2}, chat=False).jobs()[0]["logprobs"] == 2
    assert "logprobs" not in plan_request({"prompt": "x", "logprobs": None}, chat=False).jobs()[0]


def test_fields_sdks_send_by_default_and_no_op_values_are_accepted():
    body = {"messages": [{"role": "user", "content": "x"}], "store": False, "service_tier": "auto",
            "parallel_tool_calls": True, "metadata": {"a": "b"}, "logit_bias": {}, "tools": [], "n": 1,
            "stream_options": None, "frequency_penalty": None}
    assert job_fields(body, chat=True)[0] == {"messages": [{"role": "user", "content": "x"}]}


@pytest.mark.parametrize(("body", "chat", "status", "param"), [
    ({"messages": [{"role": "user", "content": "x"}], "n": 0}, True, 400, "n"),
    ({"messages": [{"role": "user", "content": "x"}], "tools": [{}]}, True, 400, "tools"),
    ({"messages": [{"role": "user", "content": "x"}], "logit_bias": {"1": 5}}, True, 400, "logit_bias"),
    ({"messages": [{"role": "user", "content": "x"}], "guided_grammar": "root ::= x"}, True, 400, "guided_grammar"),
    ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, True, 400, "top_logprobs"),
    ({"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 21}, True, 400,
     "top_logprobs"),
    ({"messages": [{"role": "user", "content": "x"}], "prompt": "x"}, True, 400, "prompt"),
    ({"prompt": "x", "messages": []}, False, 400, "messages"),
    ({"prompt": "x", "best_of": 2}, False, 400, "best_of"),
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


def done(text: str = "hello", rid: str = "r1") -> Done:
    return Done(request_id=rid, attempt=1, seq=2, finish_reason="length", text=text,
                usage=Usage(prompt_tokens=3, completion_tokens=2, cached_tokens=1),
                timings=Timings(queue_ms=1, ttft_ms=2, total_ms=3), model="m", worker="w")


def finished(index: int, event: Done, *chunks: Chunk) -> Choice:
    choice = Choice(index, done=event)
    for chunk in chunks:
        choice.logprobs.feed(chunk)
    return choice


def test_responses_take_the_jobs_id_text_and_usage():
    chat = shape_for(True, "r1", "m")
    whole = chat.whole([finished(0, done())])
    assert (whole["id"], whole["object"], whole["choices"][0]["message"]["content"]) == (
        "chatcmpl-r1", "chat.completion", "hello")
    assert whole["choices"][0]["logprobs"] is None
    assert whole["usage"] == {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5,
                              "prompt_tokens_details": {"cached_tokens": 1}}
    assert chat.chunk(Choice(1), None, None, first=True)["choices"][0] == {
        "index": 1, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
    completion = shape_for(False, "r1", "m").whole([finished(0, done())])
    assert (completion["id"], completion["choices"][0]["text"], completion["choices"][0]["finish_reason"]) == (
        "cmpl-r1", "hello", "length")
    assert sse("[DONE]") == b"data: [DONE]\n\n" and sse({"a": 1}) == b'data: {"a":1}\n\n'


def test_usage_of_n_choices_counts_the_prompt_once():
    whole = shape_for(False, "r1", "m").whole([finished(0, done("a")), finished(1, done("b"))], n=2)
    assert [c["text"] for c in whole["choices"]] == ["a", "b"]
    assert whole["usage"]["prompt_tokens"] == 3 and whole["usage"]["completion_tokens"] == 4


LOGPROBS = [TokenLogprob(token_id=5, logprob=-0.5, text=" he", top=[TopLogprob(token_id=5, logprob=-0.5, text=" he"),
                                                                   TopLogprob(token_id=9, logprob=-1.5, text="\ufffd")]),
            TokenLogprob(token_id=6, logprob=-0.25, top=[])]  # no text: a worker before contract 1.1


def test_chat_logprobs_render_openais_shape_with_each_tokens_text_and_bytes():
    chunk = Chunk(request_id="r1", attempt=1, seq=0, text=" he", token_ids=[5, 6], logprobs=LOGPROBS)
    whole = shape_for(True, "r1", "m", top_logprobs=1).whole([finished(0, done(), chunk)])
    content = whole["choices"][0]["logprobs"]["content"]
    assert content[0] == {"token": " he", "logprob": -0.5, "bytes": [32, 104, 101],
                          "top_logprobs": [{"token": " he", "logprob": -0.5, "bytes": [32, 104, 101]}]}
    assert content[1]["token"] == "token_id:6" and content[1]["top_logprobs"] == []


def test_completion_logprobs_offsets_run_on_across_stream_chunks_and_attempts():
    shape, choice = shape_for(False, "r1", "m", top_logprobs=2), Choice(0)
    first = Chunk(request_id="r1", attempt=1, seq=0, text=" he", token_ids=[5], logprobs=LOGPROBS[:1])
    lp = shape.chunk(choice, " he", None, entries=choice.logprobs.feed(first))["choices"][0]["logprobs"]
    assert lp == {"tokens": [" he"], "token_logprobs": [-0.5], "top_logprobs": [{" he": -0.5, "\ufffd": -1.5}],
                  "text_offset": [0]}
    rerun = Chunk(request_id="r1", attempt=2, seq=0, text=" he", token_ids=[5, 6], logprobs=LOGPROBS)
    entries = choice.logprobs.feed(rerun)  # a takeover: only what was not shown yet
    lp = shape.chunk(choice, "", None, entries=entries)["choices"][0]["logprobs"]
    assert lp["tokens"] == ["token_id:6"] and lp["text_offset"] == [3]
    assert lp["top_logprobs"] == [{"token_id:6": -0.25}]  # the sampled token, as vLLM adds it


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


@pytest.mark.parametrize("data,says", [(b"{not json", "not valid JSON"), (b"[1, 2]", "must be a JSON object"),
                                       (b'"text"', "must be a JSON object"), (b"", "not valid JSON"),
                                       # nested past the decoder's recursion limit: was a RecursionError, a 500
                                       (b'{"a": ' + b"[" * 200_000 + b"]" * 200_000 + b"}", "not valid JSON")])
def test_a_post_body_that_is_not_a_json_object_is_a_400_saying_so(data: bytes, says: str) -> None:
    with pytest.raises(APIError) as err:
        json_object(data)
    assert err.value.status == 400 and says in err.value.message
    assert json_object(b'{"model": "m"}') == {"model": "m"}
