"""Structured output on the CPU with a tiny random model (its unconstrained output is noise): every output
the grammar ends parses and validates against its schema, outputs cut by max_tokens are prefixes of the
uncut ones (same seed), regex and choice outputs match, unconstrained greedy requests in the same batch still
equal transformers (sync and overlapped engines), through preemption and prefix-cache hits; the bitmask op
equals its reference on odd vocabulary sizes."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch
from engine_models import build_hf_model, hf_greedy, prompts
from stoker.engine import EngineRequest, EngineRequestError, GuidedDecoding, SamplingParams
from stoker.engine.config import EngineConfig
from stoker.engine.engine import LLMEngine
from stoker.engine.kernels.token_bitmask import apply_token_bitmask, apply_token_bitmask_ref

SCHEMAS: dict[str, dict] = {
    "object": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                                "age": {"type": "integer", "minimum": 0, "maximum": 120}},
               "required": ["name", "age"], "additionalProperties": False},
    "nested_arrays": {"type": "array", "maxItems": 3,
                      "items": {"type": "array", "maxItems": 3, "items": {"type": "integer", "minimum": 0, "maximum": 9}}},
    "enum": {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}, "ok": {"type": "boolean"}},
             "required": ["color", "ok"], "additionalProperties": False},
    "bounded_numbers": {"type": "object", "properties": {
        "t": {"type": "integer", "minimum": -40, "maximum": 40},
        "p": {"type": "number", "minimum": 0, "maximum": 1}}, "required": ["t", "p"], "additionalProperties": False},
    "optional": {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9},
                                                  "b": {"type": "string", "maxLength": 4},
                                                  "c": {"type": "boolean"}},
                 "required": ["a"], "additionalProperties": False},
    "patterns": {"type": "object", "properties": {"zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                                                  "code": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{2}$"}},
                 "required": ["zip", "code"], "additionalProperties": False},
}
MAX_TOKENS = 160  # every schema above closes far below this (each is a few dozen bytes at most)


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> tuple[str, object]:
    path = str(tmp_path_factory.mktemp("llama"))
    return path, build_hf_model("llama", path)


def engine_for(path: str, overlap: bool = False, **kw) -> LLMEngine:
    kw.setdefault("num_kv_blocks", 64)
    return LLMEngine(EngineConfig(model_path=path, device="cpu", async_scheduling=overlap, **kw))


def run(engine: LLMEngine, requests: list[EngineRequest]) -> dict[str, tuple[str, list[int], str | None]]:
    """-> request id: (text, token ids, finish reason)."""
    for r in requests:
        engine.add_request(r)
    text: dict[str, str] = {}
    ids: dict[str, list[int]] = {}
    reasons: dict[str, str | None] = {}
    for _ in range(2000):
        if not engine.has_unfinished():
            break
        for o in engine.step():
            assert o.error_code is None, (o.request_id, o.error_message)
            text[o.request_id] = text.get(o.request_id, "") + o.text_delta
            ids.setdefault(o.request_id, []).extend(o.new_token_ids)
            if o.finished:
                reasons[o.request_id] = o.finish_reason
    assert not engine.has_unfinished()
    return {rid: (text[rid], ids[rid], reasons[rid]) for rid in text}


def guided(kind: str, spec: str = "", max_tokens: int = MAX_TOKENS, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, guided=GuidedDecoding(kind, spec), **kw)


def test_schema_corpus_outputs_validate(model):
    engine = engine_for(model[0])
    requests = []
    for name, schema in SCHEMAS.items():
        spec = json.dumps(schema)
        requests.append(EngineRequest(f"{name}-greedy", prompt="Answer: ", params=guided("json_schema", spec, temperature=0)))
        for seed in range(3):
            requests.append(EngineRequest(f"{name}-s{seed}", prompt=f"Q{seed}",
                                          params=guided("json_schema", spec, temperature=1.0, seed=seed)))
    requests.append(EngineRequest("object-any", prompt="x", params=guided("json_object", temperature=1.0, seed=7)))
    out = run(engine, requests)
    for rid, (text, _, reason) in out.items():
        assert reason == "stop", (rid, reason, text)  # the grammar ended it, well within max_tokens
        value = json.loads(text)
        assert not re.search(r"\s", re.sub(r'"(?:[^"\\]|\\.)*"', "", text)), f"whitespace outside strings: {text!r}"
        if rid == "object-any":
            assert isinstance(value, dict)
        else:
            jsonschema.validate(value, SCHEMAS[rid.rsplit("-", 1)[0]])


def test_cut_by_max_tokens_is_a_prefix_of_the_whole(model):
    engine = engine_for(model[0])
    spec = json.dumps(SCHEMAS["object"])
    whole = run(engine, [EngineRequest(f"w{s}", prompt="p", params=guided("json_schema", spec, seed=s)) for s in range(3)])
    cut = run(engine, [EngineRequest(f"c{s}", prompt="p", params=guided("json_schema", spec, max_tokens=4, seed=s))
                       for s in range(3)])
    for s in range(3):
        text, ids, reason = cut[f"c{s}"]
        assert reason == "length" and len(ids) == 4
        assert whole[f"w{s}"][1][:4] == ids and whole[f"w{s}"][0].startswith(text)


def test_regex_and_choice_match(model):
    engine = engine_for(model[0])
    choices = ["yes", "no", "maybe so"]
    requests = [EngineRequest(f"re{s}", prompt="id:", params=guided("regex", r"[a-f]{2,4}-[0-9]{1,3}", seed=s))
                for s in range(4)]
    requests += [EngineRequest(f"ch{s}", prompt="ok?", params=guided("choice", json.dumps(choices), seed=s))
                 for s in range(4)]
    requests.append(EngineRequest("stop", prompt="id:",
                                  params=guided("regex", r"[a-f]{2,4}-[0-9]{1,3}", temperature=0, stop=["-"])))
    out = run(engine, requests)
    for s in range(4):
        assert out[f"re{s}"][2] == "stop" and re.fullmatch(r"[a-f]{2,4}-[0-9]{1,3}", out[f"re{s}"][0])
        assert out[f"ch{s}"][2] == "stop" and out[f"ch{s}"][0] in choices
    assert out["stop"][2] == "stop" and re.fullmatch(r"[a-f]{2,4}", out["stop"][0])  # cut at the stop string


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
def test_unconstrained_greedy_beside_constrained_equals_transformers(model, overlap):
    """Also through preemption (a 4-token-block pool too small for all) and a prefix-cache hit."""
    path, hf = model
    engine = engine_for(path, overlap, block_size=4, num_kv_blocks=24, max_model_len=96)
    ps = prompts(3, [5, 19, 11, 7])
    plain = [EngineRequest(f"g{i}", prompt_token_ids=p, params=SamplingParams(max_tokens=10, temperature=0,
                                                                               ignore_eos=True))
             for i, p in enumerate(ps)]
    spec = json.dumps(SCHEMAS["patterns"])
    constrained = [EngineRequest(f"j{i}", prompt_token_ids=p, params=guided("json_schema", spec, max_tokens=60, seed=i))
                   for i, p in enumerate(ps)]
    preempted: list[str] = []
    original = engine.scheduler.schedule

    def spy():
        out = original()
        preempted.extend(s.request_id for s in out.preempted)
        return out

    engine.scheduler.schedule = spy  # type: ignore[method-assign]
    out = run(engine, [r for pair in zip(plain, constrained, strict=True) for r in pair])
    assert preempted, "nothing was preempted: the test does not test preemption"
    for i, p in enumerate(ps):
        assert out[f"g{i}"][1] == hf_greedy(hf, p, 10)
        jsonschema.validate(json.loads(out[f"j{i}"][0]), SCHEMAS["patterns"])
    again = run(engine, [EngineRequest("again", prompt_token_ids=ps[1], params=guided("json_schema", spec, max_tokens=60,
                                                                                   seed=1))])
    assert again["again"][1] == out["j1"][1]  # a prefix-cache hit and the cached grammar: the same tokens


def test_grammar_cache_and_invalid_formats(model):
    engine = engine_for(model[0])
    for kind, spec in (("regex", "(unclosed"), ("json_schema", '{"type": "object", "not": {}}'),
                       ("json_schema", '{"type": "strin"}')):
        with pytest.raises(EngineRequestError) as info:
            engine.add_request(EngineRequest("bad", prompt="x", params=guided(kind, spec)))
        assert info.value.code == "invalid_response_format" and info.value.message
    spec = json.dumps(SCHEMAS["enum"])
    engine.add_request(EngineRequest("a", prompt="x", params=guided("json_schema", spec)))
    engine.add_request(EngineRequest("b", prompt="x", params=guided("json_schema", spec)))
    assert engine._grammars is not None and len(engine._grammars._cache) == 1  # compiled once
    run(engine, [])


@pytest.mark.parametrize("vocab", [1, 31, 33, 97, 384, 1001])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_bitmask_op_matches_reference(vocab, dtype):
    gen = torch.Generator().manual_seed(vocab)
    logits = torch.randn(7, vocab, generator=gen).to(dtype)
    words = (vocab + 31) // 32
    bitmask = torch.randint(-(2**31), 2**31 - 1, (3, words), generator=gen, dtype=torch.int64).to(torch.int32)
    rows = torch.tensor([5, 0, 3])
    want, got = logits.clone(), logits.clone()
    apply_token_bitmask_ref(want, bitmask, rows)
    apply_token_bitmask(got, bitmask, rows)
    assert torch.equal(got, want)  # exact: the op only writes -inf or leaves a value alone
    assert torch.equal(got[[1, 2, 4, 6]], logits[[1, 2, 4, 6]])  # unconstrained rows untouched
    assert torch.isinf(got[rows]).any() and not torch.isinf(got[rows]).all()


@pytest.mark.parametrize("vocab", [33, 1001])
def test_bitmask_op_on_every_row_matches_reference(vocab):
    """rows None (every request constrained): masked in place, row r by bitmask row r."""
    gen = torch.Generator().manual_seed(vocab)
    logits = torch.randn(5, vocab, generator=gen)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (5, (vocab + 31) // 32), generator=gen, dtype=torch.int64)
    bitmask = bitmask.to(torch.int32)
    want, got = logits.clone(), logits.clone()
    apply_token_bitmask_ref(want, bitmask, torch.arange(5))
    apply_token_bitmask(got, bitmask, None)
    assert torch.equal(got, want)
    assert torch.isinf(got).any(dim=1).all() and not torch.isinf(got).all(dim=1).any()

