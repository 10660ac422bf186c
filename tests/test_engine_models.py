"""Greedy output of our engine equals transformers' generate, token for token, for every supported
architecture and under every batching situation: mixed lengths, chunked prefill, preemption, prefix-cache
hits, and requests joining and leaving mid-batch; each with synchronous steps and with overlapped steps
(async_scheduling: step N+1 launched on step N's device-side tokens before N's values reach the host)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from engine_models import ARCHS, build_hf_model, hf_greedy, prompts
from stoker.engine import EngineRequest, SamplingParams
from stoker.engine.config import EngineConfig
from stoker.engine.engine import LLMEngine
from stoker.engine.outputs import RequestOutput

MAX_NEW = 10
PROMPTS = prompts(1, [3, 17, 9, 26, 1])  # shared by most tests so the HF references are computed once
_references: dict[tuple[str, tuple[int, ...]], list[int]] = {}


@pytest.fixture(scope="module", params=list(ARCHS))
def arch(request, tmp_path_factory) -> tuple[str, str, object]:
    path = str(tmp_path_factory.mktemp(request.param))
    model = build_hf_model(request.param, path)
    return request.param, path, model


@pytest.fixture(scope="module", params=[False, True], ids=["sync", "overlap"])
def overlap(request) -> bool:
    return request.param


def reference(arch, ids: list[int], n: int = MAX_NEW) -> list[int]:
    name, _, model = arch
    key = (name, tuple(ids))
    if key not in _references or len(_references[key]) < n:
        _references[key] = hf_greedy(model, ids, max(n, MAX_NEW))
    return _references[key][:n]


def greedy(n: int = MAX_NEW) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)


def run(
    engine: LLMEngine,
    schedule: dict[int, list[tuple[str, list[int], int]]] | None = None,
    on_step: Callable[[list[RequestOutput]], None] | None = None,
) -> dict[str, list[RequestOutput]]:
    """Step until done; schedule[step] = requests (id, prompt ids, max_tokens) added before that step."""
    schedule = schedule or {}
    outputs: dict[str, list[RequestOutput]] = {}
    step = 0
    while engine.has_unfinished() or any(s >= step for s in schedule):
        for rid, ids, n in schedule.get(step, []):
            engine.add_request(EngineRequest(rid, prompt_token_ids=ids, params=greedy(n)))
        step_out = engine.step()
        if on_step:
            on_step(step_out)
        for o in step_out:
            outputs.setdefault(o.request_id, []).append(o)
        step += 1
        assert step < 2000, "engine did not finish"
    return outputs


def tokens(outs: list[RequestOutput]) -> list[int]:
    assert outs[-1].finished and outs[-1].error_code is None, outs[-1]
    return [t for o in outs for t in o.new_token_ids]


def engine_for(path: str, overlap: bool, **kw) -> LLMEngine:
    kw.setdefault("num_kv_blocks", 64)  # a small pool: allocating the 256 MiB default dominates otherwise
    engine = LLMEngine(EngineConfig(model_path=path, device="cpu", async_scheduling=overlap, **kw))
    assert engine.async_scheduling is overlap
    return engine


def test_mixed_lengths_batch(arch, overlap):
    ps = PROMPTS
    out = run(engine_for(arch[1], overlap), {0: [(f"r{i}", p, MAX_NEW) for i, p in enumerate(ps)]})
    for i, p in enumerate(ps):
        assert tokens(out[f"r{i}"]) == reference(arch, p), f"prompt {i} (len {len(p)})"
        assert out[f"r{i}"][-1].finish_reason == "length"


def test_chunked_prefill(arch, overlap):
    ps = PROMPTS
    engine = engine_for(arch[1], overlap, max_num_batched_tokens=7)  # every longer prompt is split over steps
    chunked = []
    engine.scheduler_schedule = engine.scheduler.schedule  # type: ignore[attr-defined]

    def spy():
        out = engine.scheduler_schedule()  # type: ignore[attr-defined]
        chunked.extend(c for c in out.chunks if c.num_tokens > 1 and not c.samples)
        return out

    engine.scheduler.schedule = spy  # type: ignore[method-assign]
    out = run(engine, {0: [(f"r{i}", p, MAX_NEW) for i, p in enumerate(ps)]})
    assert chunked, "no prefill was chunked: the test does not test chunking"
    for i, p in enumerate(ps):
        assert tokens(out[f"r{i}"]) == reference(arch, p)


def test_preemption(arch, overlap):
    ps = PROMPTS
    # 4-token blocks, 16 of them: 64 tokens for requests needing 11-36 each (116 in all): some get preempted.
    engine = engine_for(arch[1], overlap, block_size=4, num_kv_blocks=16, max_model_len=64)
    preempted: list[str] = []
    original = engine.scheduler.schedule

    def spy():
        out = original()
        preempted.extend(s.request_id for s in out.preempted)
        return out

    engine.scheduler.schedule = spy  # type: ignore[method-assign]
    out = run(engine, {0: [(f"r{i}", p, MAX_NEW) for i, p in enumerate(ps)]})
    assert preempted, "nothing was preempted: the test does not test preemption"
    for i, p in enumerate(ps):
        assert tokens(out[f"r{i}"]) == reference(arch, p)


def test_prefix_cache_hits(arch, overlap):
    shared = prompts(3, [40])[0]
    tails = prompts(4, [5, 1])
    engine = engine_for(arch[1], overlap, block_size=8)
    first = run(engine, {0: [("first", shared + tails[0], MAX_NEW)]})
    assert tokens(first["first"]) == reference(arch, shared + tails[0])
    out = run(engine, {0: [(f"r{i}", shared + t, MAX_NEW) for i, t in enumerate(tails)]})
    for i, t in enumerate(tails):
        assert out[f"r{i}"][-1].cached_tokens >= 40 - 8, "the shared prefix was not served from the cache"
        assert tokens(out[f"r{i}"]) == reference(arch, shared + t)
    queries, hits = engine.stats().prefix_cache_queries, engine.stats().prefix_cache_hits
    assert hits > 0 and queries > hits


def test_requests_join_and_leave_mid_batch(arch, overlap):
    ps = PROMPTS
    plan = {
        0: [("a", ps[0], 3), ("b", ps[1], MAX_NEW)],
        2: [("c", ps[2], 5)],
        4: [("d", ps[3], MAX_NEW)],
        7: [("e", ps[4], 2)],
    }
    out = run(engine_for(arch[1], overlap, max_num_batched_tokens=16), plan)
    for reqs in plan.values():
        for rid, p, n in reqs:
            assert tokens(out[rid]) == reference(arch, p, n), rid
            assert out[rid][-1].completion_tokens == n


@pytest.mark.parametrize("split", [True, False], ids=["split", "whole"])
def test_mixed_steps_decode_rows_split(arch, overlap, split):
    """Decode rows sharing steps with prompt chunks (requests join a running batch with chunked prompts): with
    mixed_decode_attention they go through the decode attention path, the chunks through the prefill path."""
    ps = PROMPTS
    engine = engine_for(arch[1], overlap, max_num_batched_tokens=12, mixed_decode_attention=split)
    splits: list[int] = []
    to_device = engine.runner.to_device

    def spy(packed, prev_tokens):
        splits.append(packed.num_decodes)
        return to_device(packed, prev_tokens)

    engine.runner.to_device = spy  # type: ignore[method-assign]
    # Five short prompts decode while two long ones are prefilled in chunks of what the budget leaves (the split
    # takes a multiple of 4 decode rows, the rest stay with the prompt chunks).
    short = [("a", ps[0], MAX_NEW), ("b", ps[4], MAX_NEW), ("c", ps[2][:4], MAX_NEW), ("d", ps[4], 6),
             ("e", ps[0][:2], MAX_NEW)]
    plan = {0: short, 2: [("f", ps[3], MAX_NEW)], 4: [("g", ps[1], 5)]}
    out = run(engine, plan)
    assert any(splits) is split, splits
    for reqs in plan.values():
        for rid, p, n in reqs:
            assert tokens(out[rid]) == reference(arch, p, n), rid
