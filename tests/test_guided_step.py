"""What a constrained decode step costs the engine thread, on the CPU with a tiny random model: a request's first
mask comes from the compile side (the engine thread only copies it), the reused pinned mask rows equal fresh
masks, and an overlapped engine keeps overlapping while constrained requests run (the next forward is launched
before the grammars consume the step before's tokens), with outputs equal to the synchronous engine's."""

from __future__ import annotations

import json
import time

import pytest
from engine_models import build_hf_model
from stoker.engine import EngineRequest, GuidedDecoding, SamplingParams
from stoker.engine.config import EngineConfig
from stoker.engine.engine import LLMEngine
from stoker.engine.grammar import GrammarCompiler

# 600 alternatives of one rule: its first mask walks all of them (~30 ms on the test model's tokenizer, ~0.2 s
# to build); its second step is past max_items_in_row, so the request asks for one token
ANY_OF = json.dumps({"anyOf": [{"type": "object", "properties": {f"k{i}": {"const": i}}} for i in range(600)]})


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("llama"))
    build_hf_model("llama", path)
    return path


def engine_for(path: str, overlap: bool = False) -> LLMEngine:
    return LLMEngine(EngineConfig(model_path=path, device="cpu", async_scheduling=overlap, num_kv_blocks=64))


def _cold_first_mask_s(compiler: GrammarCompiler, guided: GuidedDecoding) -> float:
    """The first mask of a matcher nobody masked before: what the engine thread paid before the compile side
    computed it."""
    matcher = compiler.compile_uncached(guided, first_mask=False).deep_copy()
    started = time.perf_counter()
    matcher.compute_bitmask()
    return time.perf_counter() - started


def test_a_requests_first_mask_comes_from_the_compile_side(model_path):
    engine = engine_for(model_path)
    guided = GuidedDecoding("json_schema", ANY_OF)
    request = EngineRequest("r", prompt="x", params=SamplingParams(max_tokens=1, temperature=0, guided=guided))
    engine.prepare_grammar(request)  # what worker.grammar_gate runs on a compile thread, under its time bound
    compiler = engine.grammar_compiler()
    cold = min(_cold_first_mask_s(compiler, guided) for _ in range(2))
    assert cold > 0.01, f"the schema's first mask should be expensive for this test to mean anything ({cold:.4f} s)"
    fills: list[float] = []
    fill = compiler.fill_bitmasks

    def timed_fill(*args):  # the engine thread's mask work for the step
        started = time.perf_counter()
        fill(*args)
        fills.append(time.perf_counter() - started)

    compiler.fill_bitmasks = timed_fill  # type: ignore[method-assign]
    engine.add_request(request)
    engine.step()  # the prefill step samples the first token: the first mask
    assert fills, "the step computed no mask"
    assert fills[0] < cold / 10, f"first mask on the engine thread {fills[0] * 1e3:.2f} ms, cold {cold * 1e3:.2f} ms"
