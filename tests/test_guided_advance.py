"""Issue 15: the grammar work off the engine thread. The step's matchers consume their tokens in one call on
llguidance's threads (GrammarCompiler.advance_all, grouped by family) and the next step's masks fill on the
compiler's grammar thread while the engine thread detokenizes (LLMEngine.grammar_overlap). Each matcher must get
its own row's token whatever the grouping, a rejected token must fail its request alone, a completed grammar
must end its request `stop` exactly as the inline engine (grammar_overlap off, the order before) does, and the
prefetched masks must be the ones sampled with."""

from __future__ import annotations

import json
import os
import threading

import pytest
import torch
from engine_models import VOCAB, build_hf_model
from stoker.engine import EngineRequest, GuidedDecoding, SamplingParams
from stoker.engine.config import EngineConfig
from stoker.engine.engine import LLMEngine
from stoker.engine.grammar import GrammarCompiler, GrammarState

# Cannot close within the tokens asked for (as tests/test_guided_step.py's LONG)
LONG = GuidedDecoding("json_schema", json.dumps({
    "type": "object", "properties": {"items": {"type": "array", "minItems": 200, "items": {
        "type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99},
                                         "s": {"type": "string", "maxLength": 8}},
        "required": ["n", "s"], "additionalProperties": False}}},
    "required": ["items"], "additionalProperties": False}))
DIGITS = GuidedDecoding("regex", "[0-9]{40}")


@pytest.fixture(scope="module")
def model_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = str(tmp_path_factory.mktemp("llama"))
    build_hf_model("llama", path)
    return path


def _allowed(matcher) -> list[int]:
    mask = torch.frombuffer(bytearray(matcher.compute_bitmask()), dtype=torch.uint8)
    return [t for t in range(mask.numel() * 8) if mask[t // 8] >> (t % 8) & 1]


def _outcome(result: object) -> object:
    return (type(result).__name__, str(result)) if isinstance(result, Exception) else result


@pytest.mark.parametrize("parallel", [True, False], ids=["consume_token_par", "without-it"])
def test_advance_all_gives_each_matcher_its_own_token(model_path, parallel):
    """Rows in several states and families (so the family grouping reorders them), one completing its grammar,
    one given a token its grammar refuses: each outcome and each matcher's next mask equal those of a copy
    advanced alone by GrammarState.advance; also with an llguidance that has no consume_token_par."""
    with open(os.path.join(model_path, "tokenizer.json"), encoding="utf-8") as f:
        compiler = GrammarCompiler(f.read(), VOCAB, [1], mask_threads=2)
    assert compiler._consume_par is not None  # the installed llguidance has it: the fallback is simulated
    if not parallel:
        compiler._consume_par = None
    walker = compiler.matcher(LONG)
    states, tokens = [], []
    for row in range(7):  # row i: i + 1 tokens into one allowed path, its token the (7i)-th allowed one
        allowed = _allowed(walker)
        assert walker.consume_token(allowed[row * 3 % len(allowed)])
        allowed = _allowed(walker)
        states.append(GrammarState(compiler, walker.deep_copy(), family=7 - row))  # reverse order by family
        tokens.append(allowed[row * 7 % len(allowed)])
    closing = compiler.matcher(GuidedDecoding("choice", json.dumps(["yes", "no"])))
    assert closing.consume_tokens(compiler.tokenizer.tokenize_str("ye"))  # one byte left
    states.insert(3, GrammarState(compiler, closing, family=5))
    tokens.insert(3, compiler.tokenizer.tokenize_str("s")[0])
    refused = compiler.matcher(DIGITS)
    states.insert(1, GrammarState(compiler, refused, family=0))
    tokens.insert(1, compiler.tokenizer.tokenize_str("x")[0])
    alone = [GrammarState(compiler, s.matcher.deep_copy(), s.family) for s in states]
    expected = []
    for state, token in zip(alone, tokens, strict=True):
        try:
            expected.append(state.advance(token))
        except RuntimeError as e:
            expected.append(e)
    got = compiler.advance_all(states, tokens)
    assert [_outcome(r) for r in got] == [_outcome(r) for r in expected]
    assert got[4] is True and isinstance(got[1], RuntimeError) and "breaks the grammar" in str(got[1])
    assert sum(r is False for r in got) == 7  # the LONG rows go on
    for state, reference in zip(states, alone, strict=True):
        if not reference.matcher.is_error():
            assert _allowed(state.matcher) == _allowed(reference.matcher)


def _requests() -> list[EngineRequest]:
    """Constrained rows in different states (greedy and seeded, different prompts), one whose grammar closes
    after a few tokens (ends `stop`), one that will be forced onto a refused token (_force_refusal), and an
    unconstrained row beside them."""
    def params(guided: GuidedDecoding | None, seed: int | None = None) -> SamplingParams:
        # ignore_eos on every row: a closed grammar must end its request itself, not leave it to an EOS
        return SamplingParams(max_tokens=20, temperature=0 if seed is None else 1.0, seed=seed, guided=guided,
                              ignore_eos=True)

    return [
        EngineRequest("long-greedy-a", prompt="first prompt", params=params(LONG)),
        EngineRequest("long-greedy-b", prompt="another, longer prompt", params=params(LONG)),
        EngineRequest("long-seeded-a", prompt="first prompt", params=params(LONG, seed=11)),
        EngineRequest("long-seeded-b", prompt="a third one", params=params(LONG, seed=12)),
        EngineRequest("closes", prompt="yes or no?", params=params(GuidedDecoding("regex", "(yes|no) [a-c]{3}"))),
        EngineRequest("refused", prompt="digits please", params=params(DIGITS)),
        EngineRequest("plain", prompt="no grammar", params=params(None)),
    ]


def _force_refusal(engine: LLMEngine, monkeypatch: pytest.MonkeyPatch, token: int, at_fill: int) -> None:
    """From the at_fill-th mask fill that holds the request "refused", its row allows only token (which its
    grammar refuses): the row must sample it and its matcher must reject it."""
    fill = GrammarCompiler.fill_bitmasks
    fills = [0]

    def forcing(self, matchers, bitmask, families=None):
        fill(self, matchers, bitmask, families)
        target = engine._requests.get("refused")
        if target is None or target.row.grammar is None:
            return
        for i, matcher in enumerate(matchers):
            if matcher is target.row.grammar.matcher:
                fills[0] += 1
                if fills[0] >= at_fill:
                    bitmask[i] = 0
                    bitmask[i, token // 32] = 1 << (token % 32)

    monkeypatch.setattr(GrammarCompiler, "fill_bitmasks", forcing)


def _run(model_path: str, overlap: bool, monkeypatch: pytest.MonkeyPatch) -> dict[str, tuple]:
    engine = LLMEngine(EngineConfig(model_path=model_path, device="cpu", async_scheduling=overlap, num_kv_blocks=64))
    engine.grammar_overlap = overlap
    refused_token = engine.grammar_compiler().tokenizer.tokenize_str("x")[0]
    with monkeypatch.context() as patch:
        _force_refusal(engine, patch, refused_token, at_fill=4)
        requests = _requests()
        for request in requests:
            engine.add_request(request)
        ids: dict[str, list[int]] = {r.request_id: [] for r in requests}
        ends: dict[str, tuple] = {}
        for _ in range(200):
            if not engine.has_unfinished():
                break
            for out in engine.step():
                ids[out.request_id] += out.new_token_ids
                if out.finished:
                    ends[out.request_id] = (out.finish_reason, out.error_code, (out.error_message or "")[:60])
    return {rid: (tuple(ids[rid]), ends.get(rid)) for rid in ids}


def test_overlapped_grammar_work_ends_requests_as_the_inline_engine_does(model_path, monkeypatch):
    """The overlapped engine (tokens advanced in one call on the grammar thread, masks prefetched) against the
    synchronous engine with the grammar work inline: equal tokens and endings, a completed grammar ending
    `stop`, a refused token failing only its own request."""
    inline = _run(model_path, overlap=False, monkeypatch=monkeypatch)
    overlapped = _run(model_path, overlap=True, monkeypatch=monkeypatch)
    assert overlapped == inline
    tokens, end = inline["closes"]
    assert end is not None and end[:2] == ("stop", None) and 0 < len(tokens) < 20 and 1 not in tokens  # 1: EOS
    tokens, end = inline["refused"]
    assert end is not None and end[1] == "internal" and "breaks the grammar" in end[2], end
    assert len(tokens) == 3  # the three tokens sampled under its real masks
    for rid in ("long-greedy-a", "long-greedy-b", "long-seeded-a", "long-seeded-b", "plain"):
        assert inline[rid][1] == ("length", None, "") and len(inline[rid][0]) == 20, (rid, inline[rid])
    assert len({inline[rid][0] for rid in ("long-greedy-a", "long-greedy-b", "long-seeded-a", "long-seeded-b")}) == 4


def test_overlapped_engine_fills_each_steps_masks_once_off_its_thread(model_path, monkeypatch):
    """With constrained requests decoding, every step's masks are filled once, on the grammar thread, while the
    engine thread goes on; the sampling takes them (a refill on the engine thread would be the inline cost
    again)."""
    engine = LLMEngine(EngineConfig(model_path=model_path, device="cpu", async_scheduling=True, num_kv_blocks=64))
    fill = GrammarCompiler.fill_bitmasks
    threads: list[str] = []

    def recorded(self, matchers, bitmask, families=None):
        threads.append(threading.current_thread().name)
        fill(self, matchers, bitmask, families)

    monkeypatch.setattr(GrammarCompiler, "fill_bitmasks", recorded)
    for request in _requests()[:4]:
        engine.add_request(request)
    steps = 0
    while engine.has_unfinished():
        engine.step()
        steps += 1
    engine_thread = threading.current_thread().name
    # step 1 (prefill) samples with nothing in flight: filled inline; then one prefetched fill per sampling step
    assert threads[0] == engine_thread
    assert len(threads) == 20 and all(name.startswith("grammar") for name in threads[1:]), threads


def test_a_prefetched_fill_is_taken_only_by_the_build_it_was_for(model_path):
    """MaskStaging.masks takes a prefetched fill only for the same matchers and rows; any other build (the
    row-by-row fallback after a failed batch) waits for it, drops it and fills its own rows; a failed fill's
    error surfaces in the build that waits for it, and the next build works."""
    with open(os.path.join(model_path, "tokenizer.json"), encoding="utf-8") as f:
        compiler = GrammarCompiler(f.read(), VOCAB, [1], mask_threads=2)
    walker = compiler.matcher(LONG)
    matchers = []
    for step in range(5):  # five matchers in five states: their masks differ
        matchers.append(walker.deep_copy())
        allowed = _allowed(walker)
        assert walker.consume_token(allowed[step * 5 % len(allowed)])
    own = [torch.frombuffer(bytearray(m.compute_bitmask()), dtype=torch.int32)[: (VOCAB + 31) // 32] for m in matchers]
    assert len({tuple(mask.tolist()) for mask in own}) > 1
    staging, cpu = compiler.staging, torch.device("cpu")
    staging.prefetch(compiler, matchers, None, VOCAB, cpu)
    bitmask, rows = staging.masks(compiler, matchers[1:2], [3], VOCAB, cpu)  # another build: its own row
    assert torch.equal(bitmask[0], own[1]) and rows is not None and rows.tolist() == [3]
    staging.prefetch(compiler, matchers, [0, 2, 4, 6, 8], VOCAB, cpu)
    bitmask, rows = staging.masks(compiler, matchers, [0, 2, 4, 6, 8], VOCAB, cpu)
    assert torch.equal(bitmask, torch.stack(own)) and rows is not None and rows.tolist() == [0, 2, 4, 6, 8]
    staging.prefetch(compiler, ["not a matcher"], None, VOCAB, cpu)  # its fill raises on the grammar thread
    with pytest.raises(TypeError):
        staging.masks(compiler, ["not a matcher"], None, VOCAB, cpu)
    bitmask, _ = staging.masks(compiler, matchers[:1], None, VOCAB, cpu)
    assert torch.equal(bitmask[0], own[0])
