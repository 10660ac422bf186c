"""The worker's pure parts, without Kafka, Redis or an engine: the events it builds for a request, its
request table, and the one mapping of a wire job to an engine request."""

from __future__ import annotations

import dataclasses

import pytest
from stoker.engine import EngineRequest, GuidedDecoding, RequestOutput, SamplingParams
from stoker.engine.outputs import TokenLogprob as EngineTokenLogprob
from stoker.engine.outputs import TopLogprob as EngineTopLogprob
from stoker.schemas import (
    ChatMessage,
    ChoiceFormat,
    Chunk,
    Done,
    Error,
    Job,
    JsonObjectFormat,
    JsonSchemaFormat,
    JsonSchemaSpec,
    RegexFormat,
    TokenLogprob,
    TopLogprob,
    decode_event,
    encode_event,
)
from stoker.worker import events
from stoker.worker.requests import Request, RequestState, RequestTable, engine_request

RECORD_MS = 1_000_000.0


def request(rid: str = "r1", attempt: int = 2, **job: object) -> Request:
    spec = {"prompt": "hi", "tenant": "acme", "metadata": {"k": 1}} | job
    return Request(Job(request_id=rid, **spec), False, RECORD_MS, [("p0", 7)], (b"k", b"v", []),  # type: ignore[arg-type]
                   attempt=attempt)


def output(rid: str = "r1", **kw: object) -> RequestOutput:
    base: dict[str, object] = dict(request_id=rid, new_token_ids=[5, 6], text_delta="ab", logprobs=None,
                                   finished=False, finish_reason=None, prompt_tokens=3, completion_tokens=2,
                                   cached_tokens=1)
    return RequestOutput(**(base | kw))  # type: ignore[arg-type]


# -- events -------------------------------------------------------------------------------------------------
def test_a_chunk_carries_the_attempt_the_seq_and_the_steps_tokens():
    req = request()
    req.seq = 4
    ev = events.chunk(req, output())
    assert ev == Chunk(request_id="r1", attempt=2, seq=4, text="ab", token_ids=[5, 6], logprobs=None)


def test_logprobs_map_one_entry_per_token_with_their_alternatives():
    out = output(logprobs=[EngineTokenLogprob(5, -0.5, [EngineTopLogprob(5, -0.5, " a"),
                                                        EngineTopLogprob(9, -1.5, "\ufffd")], " a"),
                           EngineTokenLogprob(6, -0.25, [], "b")])
    assert events.logprobs(out) == [  # each token's text travels (contract 1.1)
        TokenLogprob(token_id=5, logprob=-0.5, text=" a", top=[TopLogprob(token_id=5, logprob=-0.5, text=" a"),
                                                                TopLogprob(token_id=9, logprob=-1.5, text="\ufffd")]),
        TokenLogprob(token_id=6, logprob=-0.25, text="b", top=[]),
    ]
    assert events.logprobs(output(logprobs=[])) is None  # none asked: the field stays absent
    assert events.chunk(request(), out).logprobs is not None


def test_done_has_the_whole_text_usage_and_latencies_from_the_record():
    req = request()
    req.seq, req.text = 2, ["Hel", "lo"]
    req.first_scheduled_ms, req.first_token_ms = RECORD_MS + 10, RECORD_MS + 30
    ev = events.finished(req, output(finished=True, finish_reason="length", completion_tokens=7),
                         RECORD_MS + 100, "tiny", "w1")
    assert isinstance(ev, Done)
    assert (ev.request_id, ev.attempt, ev.seq, ev.finish_reason, ev.text) == ("r1", 2, 2, "length", "Hello")
    assert (ev.usage.prompt_tokens, ev.usage.completion_tokens, ev.usage.cached_tokens) == (3, 7, 1)
    assert (ev.timings.queue_ms, ev.timings.ttft_ms, ev.timings.total_ms) == (10.0, 30.0, 100.0)
    assert (ev.model, ev.worker, ev.tenant, ev.metadata) == ("tiny", "w1", "acme", {"k": 1})


def test_done_of_a_request_that_never_ran_a_step_measures_from_the_final_step():
    ev = events.finished(request(), output(finished=True, finish_reason=None, new_token_ids=[]), RECORD_MS + 40,
                         "tiny", "w1")
    assert isinstance(ev, Done)
    assert ev.finish_reason == "stop"  # no reason given: a plain stop
    assert (ev.timings.queue_ms, ev.timings.ttft_ms, ev.timings.total_ms) == (40.0, 40.0, 40.0)
    # A clock that ran backwards never gives a negative latency.
    early = events.finished(request(), output(finished=True), RECORD_MS - 5, "tiny", "w1")
    assert isinstance(early, Done) and early.timings.total_ms == 0.0


def test_an_engine_failure_is_an_error_event_at_the_next_seq():
    req = request()
    req.seq = 3
    ev = events.finished(req, output(finished=True, error_code="internal", error_message=None), RECORD_MS, "m", "w")
    assert ev == Error(request_id="r1", attempt=2, seq=3, code="internal",
                       message="the engine failed this request")


def test_ended_without_running_and_error_events():
    ev = events.ended_without_running(request(), "cancelled", RECORD_MS + 25, "tiny", "w1")
    assert (ev.finish_reason, ev.text, ev.usage.completion_tokens, ev.timings.total_ms) == ("cancelled", "", 0, 25.0)
    assert (ev.tenant, ev.metadata, ev.seq) == ("acme", {"k": 1}, 0)
    err = events.error(request(), "unknown_model", "no such model")
    assert err == Error(request_id="r1", attempt=2, seq=0, code="unknown_model", message="no such model")


@pytest.mark.parametrize("msgpack", [False, True])
def test_every_event_encodes_and_decodes_under_the_contract(msgpack: bool):
    req = request()
    built = [events.chunk(req, output()), events.finished(req, output(finished=True), RECORD_MS + 1, "m", "w"),
             events.ended_without_running(req, "deadline", RECORD_MS + 1, "m", "w"), events.error(req, "internal", "x")]
    for ev in built:
        assert decode_event(encode_event(ev, msgpack)) == ev


# -- the request table --------------------------------------------------------------------------------------
def test_the_table_holds_one_entry_per_id_in_one_state():
    table = RequestTable()
    a, b = request("a"), request("b")
    table.put(a, RequestState.CLAIMING)
    table.put(b, RequestState.PARKED)
    assert a.state is RequestState.CLAIMING and "a" in table and len(table) == 2
    assert table.get("a", RequestState.PARKED) is None and table.get("b", RequestState.PARKED) is b
    run = a.next_attempt(3)
    assert (run.attempt, run.seq, run.text, run.records) == (3, 0, [], a.records)
    table.put(run, RequestState.RUNNING)  # replaces the CLAIMING entry of the same id
    assert table.running("a") is run and table.count(RequestState.CLAIMING) == 0
    assert table.ids(RequestState.RUNNING) == ["a"] and table.of(RequestState.PARKED) == [b]
    assert not table.remove(a)  # a stale request never removes the id's current entry
    assert table.remove(run) and table.get("a") is None
    table.clear(RequestState.PARKED)
    assert len(table) == 0 and list(table) == []


def test_each_state_keeps_the_order_its_entries_entered_it():
    table = RequestTable()
    for rid in ("c", "a", "b"):
        table.put(request(rid), RequestState.PARKED)
    table.put(request("a"), RequestState.PARKED)  # entering again moves it to the end
    assert table.ids(RequestState.PARKED) == ["c", "b", "a"]


# -- job -> engine request ----------------------------------------------------------------------------------
def test_a_job_maps_to_one_engine_request_field_by_field():
    job = Job(request_id="j", messages=[ChatMessage(role="user", content="hey")], max_tokens=9, min_tokens=2,
              temperature=0.5, top_p=0.9, top_k=40, min_p=0.05, seed=11, presence_penalty=0.1,
              frequency_penalty=0.2, repetition_penalty=1.1, stop=["\n"], stop_token_ids=[2], ignore_eos=True,
              include_stop_str_in_output=True, logprobs=3, priority=-1, deadline_ms=123)
    er = engine_request(job)
    assert isinstance(er, EngineRequest)
    assert (er.request_id, er.prompt, er.messages, er.prompt_token_ids) == ("j", None,
                                                                           [{"role": "user", "content": "hey"}], None)
    assert (er.priority, er.deadline_ms) == (-1, 123)
    p = er.params
    assert (p.max_tokens, p.min_tokens, p.temperature, p.top_p, p.top_k, p.min_p, p.seed) == (9, 2, 0.5, 0.9, 40,
                                                                                              0.05, 11)
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.1, 0.2, 1.1)
    assert (p.stop, p.stop_token_ids, p.ignore_eos, p.include_stop_str_in_output, p.logprobs) == (
        ("\n",), (2,), True, True, 3)
    # Every sampling setting the engine takes has its field on the wire job (the mapping passes each one).
    wire_name = {"guided": "response_format"}  # the engine's name for the one field named otherwise on the wire
    missing = {wire_name.get(f.name, f.name) for f in dataclasses.fields(SamplingParams)} - set(Job.__struct_fields__)
    assert not missing, f"SamplingParams fields the job does not carry: {missing}"
    assert p.guided is None
    constrained = engine_request(Job(request_id="g", prompt="p", v=2, response_format=JsonSchemaFormat(
        json_schema=JsonSchemaSpec(schema={"type": "object", "properties": {"b": {}, "a": {}}}))))
    assert constrained.params.guided == GuidedDecoding(
        "json_schema", '{"type":"object","properties":{"b":{},"a":{}}}')  # key order kept: the output follows it
    for fmt, kind, spec in ((JsonObjectFormat(), "json_object", ""), (RegexFormat(pattern="a+"), "regex", "a+"),
                            (ChoiceFormat(choices=["x", "y"]), "choice", '["x", "y"]')):
        params = engine_request(Job(request_id="g", prompt="p", v=2, response_format=fmt)).params
        assert params.guided == GuidedDecoding(kind, spec)

def test_a_prompt_or_token_ids_job_passes_them_through():
    er = engine_request(Job(request_id="t", prompt_token_ids=[1, 2, 3]))
    assert (er.prompt, er.messages, er.prompt_token_ids) == (None, None, [1, 2, 3])
    assert engine_request(Job(request_id="p", prompt="once")).prompt == "once"
