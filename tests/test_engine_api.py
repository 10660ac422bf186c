"""LLMEngine's API as the worker uses it: request validation, abort, deadlines, stats, thread-safe adds, chat
messages, and a failure in one request's sampling that fails that request alone."""

from __future__ import annotations

import threading
import time

import pytest
from engine_models import build_hf_model, prompts
from stoker.engine import EngineRequest, SamplingParams
from stoker.engine.config import EngineConfig
from stoker.engine.engine import LLMEngine
from stoker.engine.outputs import EngineRequestError, RequestOutput


@pytest.fixture(scope="module")
def path(tmp_path_factory) -> str:
    p = str(tmp_path_factory.mktemp("llama"))
    build_hf_model("llama", p, seed=5)
    return p


@pytest.fixture
def engine(path) -> LLMEngine:
    return LLMEngine(EngineConfig(path, device="cpu", num_kv_blocks=16, max_model_len=128))


def drain(engine: LLMEngine) -> dict[str, list[RequestOutput]]:
    outs: dict[str, list[RequestOutput]] = {}
    for _ in range(500):
        if not engine.has_unfinished():
            return outs
        for o in engine.step():
            outs.setdefault(o.request_id, []).append(o)
    raise AssertionError("engine did not finish")


GREEDY = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)


@pytest.mark.parametrize(
    ("kwargs", "code", "match"),
    [
        ({}, "invalid_job", "exactly one of prompt, messages, prompt_token_ids"),
        ({"prompt": "hi", "prompt_token_ids": [3]}, "invalid_job", "got prompt, prompt_token_ids"),
        ({"prompt": ""}, "invalid_job", "prompt is empty"),
        ({"prompt_token_ids": []}, "invalid_job", "prompt is empty"),
        ({"prompt_token_ids": [3, 384, -1]}, "invalid_job", r"\[384, -1\] are not token ids"),
        (
            {"prompt_token_ids": [3, True, 383]},
            "invalid_job",
            r"\[True\] are not token ids",
        ),  # bool: not an id
        ({"prompt_token_ids": [3, 2.0]}, "invalid_job", r"\[2.0\] are not token ids"),
        ({"prompt_token_ids": [0, 383, 384]}, "invalid_job", r"\[384\] are not token ids"),  # vocab edge
        ({"messages": [{"content": "x"}]}, "invalid_job", "list of"),
        ({"messages": [{"role": "robot", "content": "x"}]}, "invalid_job", "unknown role robot"),
        (
            {"prompt_token_ids": [3] * 100, "params": SamplingParams(max_tokens=29)},
            "context_length_exceeded",
            r"prompt \(100 tokens\) \+ max_tokens \(29\) exceeds the model's context of 128",
        ),
    ],
)
def test_add_request_validation(engine, kwargs, code, match):
    with pytest.raises(EngineRequestError, match=match) as info:
        engine.add_request(EngineRequest("r", **kwargs))
    assert info.value.code == code
    assert not engine.has_unfinished()


def test_stop_token_ids_beyond_the_vocabulary_are_refused_at_admission(engine):
    # Unchecked, min_tokens > 0 bans them in the sampler by index: out of range (internal on the CPU, a
    # device-side assert on a GPU). The vocabulary here is 384.
    for stop_ids in ([384], [3, 10**6], [True]):
        with pytest.raises(EngineRequestError, match=r"stop_token_ids .* not token ids") as info:
            engine.add_request(EngineRequest("r", prompt="hi", params=SamplingParams(
                max_tokens=4, min_tokens=2, stop_token_ids=stop_ids)))
        assert info.value.code == "invalid_job"
    assert not engine.has_unfinished()
    engine.add_request(EngineRequest("ok", prompt="hi", params=SamplingParams(max_tokens=4, min_tokens=2,
                                                                             stop_token_ids=(383,))))
    assert drain(engine)["ok"][-1].completion_tokens >= 2


def test_prompt_at_the_context_limit_runs_and_duplicates_are_refused(engine):
    engine.add_request(EngineRequest("r", prompt_token_ids=[3] * 124, params=GREEDY))
    with pytest.raises(EngineRequestError, match="already queued or running"):
        engine.add_request(EngineRequest("r", prompt="hello", params=GREEDY))
    outs = drain(engine)["r"]
    assert outs[-1].finish_reason == "length" and outs[-1].completion_tokens == 4


def test_text_and_chat_prompts(engine):
    messages = [{"role": "user", "content": "Why is the sky blue?"}]
    engine.add_request(EngineRequest("chat", messages=messages, params=GREEDY))
    engine.add_request(EngineRequest("text", prompt=engine.tokenizer.apply_chat_template(messages), params=GREEDY))
    outs = drain(engine)
    chat_ids = engine.tokenizer.encode_chat(messages)
    assert outs["chat"][-1].prompt_tokens == len(chat_ids)
    # The rendered template already holds BOS; encoding it as a plain prompt adds another one.
    assert outs["text"][-1].prompt_tokens == len(chat_ids) + 1


def test_abort_and_deadline(engine):
    ps = prompts(31, [9, 9, 9])
    long = SamplingParams(max_tokens=50, temperature=0, ignore_eos=True)
    engine.add_request(EngineRequest("a", prompt_token_ids=ps[0], params=long))
    engine.add_request(EngineRequest("b", prompt_token_ids=ps[1], params=long, deadline_ms=time.time() * 1000 + 60_000))
    engine.add_request(EngineRequest("late", prompt_token_ids=ps[2], params=long, deadline_ms=time.time() * 1000 - 1))
    first = {o.request_id: o for o in engine.step()}
    assert first["late"].finish_reason == "deadline" and first["late"].new_token_ids == []
    assert first["a"].first_scheduled_ms is not None and first["a"].first_scheduled_ms <= time.time() * 1000
    engine.step()
    engine.abort("a")
    engine.abort("unknown")  # no-op
    out = {o.request_id: o for o in engine.step()}
    assert out["a"].finished and out["a"].finish_reason == "cancelled" and out["a"].completion_tokens == 2
    assert not out["b"].finished
    assert engine.stats().num_running == 1
    engine.abort("b")
    drain(engine)
    stats = engine.stats()
    assert stats.kv_blocks_free == stats.kv_blocks_total == 16
    assert stats.prompt_tokens_total == 27 and stats.generation_tokens_total == 2 + 3
    assert stats.num_running == stats.num_waiting == 0


def test_one_failing_request_does_not_fail_the_engine(engine, monkeypatch):
    from stoker.engine import sampler

    original = sampler.SamplingBatch.build

    def build(rows, vocab_size, device):  # a request with seed 666 breaks sampling
        if any(r.seed == 666 for r in rows):
            raise RuntimeError("boom")
        return original(rows, vocab_size, device)

    monkeypatch.setattr(sampler.SamplingBatch, "build", staticmethod(build))
    ps = prompts(32, [5, 7])
    engine.add_request(EngineRequest("ok", prompt_token_ids=ps[0], params=GREEDY))
    engine.add_request(EngineRequest("bad", prompt_token_ids=ps[1], params=SamplingParams(max_tokens=4, seed=666)))
    outs = drain(engine)
    assert outs["bad"][-1].error_code == "internal" and "boom" in (outs["bad"][-1].error_message or "")
    assert outs["bad"][-1].finished and outs["bad"][-1].finish_reason is None
    assert outs["ok"][-1].finish_reason == "length" and outs["ok"][-1].completion_tokens == 4
    assert engine.stats().kv_blocks_free == 16


def test_a_request_whose_detokenization_fails_ends_alone_on_the_plain_path(engine, monkeypatch):
    """The common step (no grammar, penalties or logprobs: LLMEngine._finish_plain) fails a row alone too."""
    from stoker.engine.output_processor import OutputProcessor

    original = OutputProcessor.detokenize
    calls = {"bad": 0}

    def detokenize(state, token_id):
        if state.seq.request_id == "bad":
            calls["bad"] += 1
            if calls["bad"] == 2:  # its second token
                raise RuntimeError("detok boom")
        return original(state, token_id)

    monkeypatch.setattr(OutputProcessor, "detokenize", staticmethod(detokenize))
    ps = prompts(34, [5, 7])
    engine.add_request(EngineRequest("ok", prompt_token_ids=ps[0], params=GREEDY))
    engine.add_request(EngineRequest("bad", prompt_token_ids=ps[1], params=GREEDY))
    outs = drain(engine)
    assert outs["bad"][-1].error_code == "internal" and "detok boom" in (outs["bad"][-1].error_message or "")
    assert outs["bad"][-1].finished and outs["bad"][-1].completion_tokens == 1  # the one before the failure
    assert outs["ok"][-1].finish_reason == "length" and outs["ok"][-1].completion_tokens == 4
    assert engine.stats().kv_blocks_free == 16


def test_a_sample_that_fails_to_reach_the_host_fails_its_rows_not_the_engine(engine, monkeypatch):
    """The step's one wait for the sampled tokens raising (a failed copy): every row of that step ends with an
    error, the engine goes on with the next request."""
    from stoker.engine.model_runner import PendingSample

    original = PendingSample.wait
    failing = {"left": 1}

    def wait(self):
        out = original(self)
        if failing["left"] and len(out.token_ids) == 2 and engine.stats().num_running == 2:
            failing["left"] -= 1
            raise RuntimeError("copy boom")
        return out

    monkeypatch.setattr(PendingSample, "wait", wait)
    ps = prompts(35, [5, 7, 6])
    engine.add_request(EngineRequest("a", prompt_token_ids=ps[0], params=GREEDY))
    engine.add_request(EngineRequest("b", prompt_token_ids=ps[1], params=GREEDY))
    outs = drain(engine)
    assert failing["left"] == 0
    for rid in ("a", "b"):
        assert outs[rid][-1].error_code == "internal" and "copy boom" in (outs[rid][-1].error_message or "")
        assert outs[rid][-1].finished
    engine.add_request(EngineRequest("c", prompt_token_ids=ps[2], params=GREEDY))
    outs = drain(engine)
    assert outs["c"][-1].finish_reason == "length" and outs["c"][-1].completion_tokens == 4
    assert engine.stats().kv_blocks_free == 16


def test_concurrent_adds_while_stepping(engine):
    ps = prompts(33, [4] * 24)
    results: dict[str, list[RequestOutput]] = {}
    errors: list[BaseException] = []

    def producer(offset: int) -> None:
        try:
            for i in range(offset, 24, 3):
                engine.add_request(EngineRequest(f"r{i}", prompt_token_ids=ps[i], params=GREEDY))
                time.sleep(0.001)
        except BaseException as e:  # surfaced below
            errors.append(e)

    threads = [threading.Thread(target=producer, args=(k,)) for k in range(3)]
    for t in threads:
        t.start()
    while any(t.is_alive() for t in threads) or engine.has_unfinished():
        for o in engine.step():
            results.setdefault(o.request_id, []).append(o)
    for t in threads:
        t.join()
    assert not errors
    assert sorted(results) == sorted(f"r{i}" for i in range(24))
    assert all(
        outs[-1].completion_tokens == 4 and outs[-1].finish_reason == "length" for outs in results.values()
    )


def test_warm_up_runs_every_serving_path_then_leaves_the_engine_as_it_found_it(path):
    from stoker.engine import warm_up

    cold = LLMEngine(EngineConfig(path, device="cpu", num_kv_blocks=32, max_model_len=128,
                                  max_num_batched_tokens=64, enable_prefix_caching=True))
    reference = LLMEngine(EngineConfig(path, device="cpu", num_kv_blocks=32, max_model_len=128,
                                       max_num_batched_tokens=64, enable_prefix_caching=True))
    report = warm_up(cold)
    # A full prefill step (the whole token budget in one forward), a chunked prompt, a mixed step.
    assert report.largest_step_tokens == 64
    assert report.mixed_steps >= 1
    assert report.waves == ["short prompt", "full prefill step (1 x 64)", "chunked prefill", "sampler paths",
                            "structured output", "mixed step"]
    assert cold._grammars is not None  # the vocabulary was read before serving
    assert not cold.has_unfinished()
    stats = cold.stats()
    assert stats.kv_blocks_free == stats.kv_blocks_total == 32  # every block back, nothing cached
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (0, 0)
    assert cold.scheduler.block_manager.num_cached_blocks == 0
    # Serving after the warm-up is what serving without it is.
    for eng in (cold, reference):
        for i, ids in enumerate(prompts(11, [5, 40, 17])):
            eng.add_request(EngineRequest(f"r{i}", prompt_token_ids=ids,
                                          params=SamplingParams(max_tokens=6, temperature=0)))
    assert {k: [o.new_token_ids for o in v] for k, v in drain(cold).items()} == \
        {k: [o.new_token_ids for o in v] for k, v in drain(reference).items()}


def test_the_light_warm_up_of_a_reload_runs_the_short_prompt_and_the_grammar_only(path):
    from stoker.engine import warm_up

    eng = LLMEngine(EngineConfig(path, device="cpu", num_kv_blocks=32, max_model_len=128,
                                 max_num_batched_tokens=64, enable_prefix_caching=True))
    report = warm_up(eng, light=True)
    assert report.waves == ["short prompt", "structured output"]
    assert report.mixed_steps == 0 and report.largest_step_tokens < 64
    assert eng._grammars is not None  # constrained jobs after a reload do not pay for the vocabulary either
    stats = eng.stats()
    assert not eng.has_unfinished() and stats.kv_blocks_free == stats.kv_blocks_total == 32
    assert eng.scheduler.block_manager.num_cached_blocks == 0


def test_a_lone_prompt_longer_than_the_step_budget_is_prefilled_in_chunks(path):
    """No chunk of the first steps reaches the prompt's end, so those steps sample nothing. Before, sampling an
    empty batch raised and the step failed (in the worker: the engine thread died on one long prompt)."""
    eng = LLMEngine(EngineConfig(path, device="cpu", num_kv_blocks=32, max_model_len=128, max_num_batched_tokens=16))
    ref = LLMEngine(EngineConfig(path, device="cpu", num_kv_blocks=32, max_model_len=128))
    ids = prompts(3, [70])[0]
    for e in (eng, ref):
        e.add_request(EngineRequest("long", prompt_token_ids=ids, params=SamplingParams(max_tokens=5, temperature=0)))
    got, want = drain(eng)["long"], drain(ref)["long"]
    assert [t for o in got for t in o.new_token_ids] == [t for o in want for t in o.new_token_ids]
    assert len([t for o in got for t in o.new_token_ids]) == 5 and got[-1].finish_reason == "length"


def test_a_gpu_other_than_the_first_is_refused_with_the_way_to_pick_one(path):
    with pytest.raises(ValueError, match="CUDA_VISIBLE_DEVICES"):
        EngineConfig(path, device="cuda:1")
