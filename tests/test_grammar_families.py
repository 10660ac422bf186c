"""Issue 15's fix for the serialised mask fill: one grammar compiles into several independent templates
("families", engine/grammar.py), because llguidance's deep copies of one template share its lexer behind one
mutex that every mask computation holds. Requests of one grammar are dealt over the families, the batch's rows go
to the executor grouped by family and still land in their own bitmask rows, and extra compiles stop at their
time budget."""

from __future__ import annotations

import json
import os

import jsonschema
import pytest
import torch
from engine_models import build_hf_model
from stoker.engine import EngineRequest, SamplingParams, grammar
from stoker.engine.config import EngineConfig
from stoker.engine.engine import LLMEngine
from stoker.engine.grammar import GrammarCompiler
from stoker.engine.make_model import write_tokenizer
from stoker.engine.sampling_params import GuidedDecoding

VOCAB = 512
EOS = 1
# Two branches that need disjoint lexer states: a walk down one derives states the other never uses.
TWO_BRANCHES = GuidedDecoding("regex", "[a-z]{0,30}x|[0-9]{0,30}y")
WALKS = ("abcdefghijklmnopqrstuvwxyzabcd", "012345678901234567890123456789")
# Lexer states (llguidance's max_lexer_states) enough for one walk of WALKS alone on the test tokenizer (each
# needs ~60), not for both walks in one lexer.
ONE_WALKS_STATES = 100


@pytest.fixture(scope="module")
def tokenizer_json(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = str(tmp_path_factory.mktemp("tok"))
    write_tokenizer(path, VOCAB)
    with open(os.path.join(path, "tokenizer.json"), encoding="utf-8") as f:
        return f.read()


def _walk(compiler: GrammarCompiler, state: grammar.GrammarState, text: str) -> bool:
    """Mask, then consume, each token of text (masks derive the lexer states) -> True when all were taken."""
    for token in compiler.tokenizer.tokenize_str(text):
        state.matcher.compute_bitmask()
        if not state.matcher.consume_token(token):
            return False
    return True


def _two_walks(tokenizer_json: str, families: int, monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    monkeypatch.setattr(grammar, "PARSER_LIMITS", dict(grammar.PARSER_LIMITS, max_lexer_states=ONE_WALKS_STATES))
    compiler = GrammarCompiler(tokenizer_json, VOCAB, [EOS], mask_threads=2, families=families)
    states = [compiler.new_state(TWO_BRANCHES) for _ in WALKS]
    return [_walk(compiler, state, text) for state, text in zip(states, WALKS, strict=True)]


def test_deep_copies_of_one_template_share_a_lexer(tokenizer_json, monkeypatch):
    """The premise of the fix (llguidance 1.9's LLMatcher.deep_copy): two copies of one template fill one lexer,
    so the second walk runs out of the states that either walk alone fits in. If a later llguidance gives each
    copy its own lexer, this fails and the families can go."""
    assert _two_walks(tokenizer_json, 1, monkeypatch) == [True, False]


def test_requests_of_one_grammar_get_independent_lexers(tokenizer_json, monkeypatch):
    """With the compiler's default families (FAMILIES_PER_THREAD per mask thread), two requests of one grammar
    do not share a lexer: both walks fit."""
    monkeypatch.setattr(grammar, "PARSER_LIMITS", dict(grammar.PARSER_LIMITS, max_lexer_states=ONE_WALKS_STATES))
    compiler = GrammarCompiler(tokenizer_json, VOCAB, [EOS], mask_threads=2)
    assert compiler.num_families(TWO_BRANCHES) == grammar.FAMILIES_PER_THREAD * 2
    states = [compiler.new_state(TWO_BRANCHES) for _ in WALKS]
    assert [s.family for s in states] == [0, 1]
    assert [_walk(compiler, s, text) for s, text in zip(states, WALKS, strict=True)] == [True, True]


def test_families_are_dealt_in_turn_and_fill_their_own_rows(tokenizer_json):
    """Requests go to families 0, 1, 2, 0, ...; a fill handed families (rows reordered for the executor) writes
    row i with matcher i's mask, equal to what that matcher computes alone."""
    compiler = GrammarCompiler(tokenizer_json, VOCAB, [EOS], mask_threads=2, families=3)
    states = [compiler.new_state(TWO_BRANCHES) for _ in range(7)]
    assert [s.family for s in states] == [0, 1, 2, 0, 1, 2, 0]
    for i, state in enumerate(states):  # different states: i tokens down one branch or the other
        assert state.matcher.consume_tokens(compiler.tokenizer.tokenize_str(WALKS[i % 2][: i * 3]))
    words = (VOCAB + 31) // 32
    expected = torch.stack([torch.frombuffer(bytearray(s.matcher.compute_bitmask()), dtype=torch.int32)[:words]
                            for s in states])
    assert len({tuple(row.tolist()) for row in expected}) == 3  # start, in letters, in digits: rows differ
    bitmask = torch.full((len(states), words), -7, dtype=torch.int32)
    families = [s.family for s in states]
    compiler.fill_bitmasks([s.matcher for s in states], bitmask, families)
    assert torch.equal(bitmask, expected)


def test_a_new_executor_size_fills_and_advances_the_same_rows(tokenizer_json):
    """set_mask_threads (ops/bench_guided.py --mask-threads compares sizes on one engine): the fills and the
    batched advance that follow run on the new executor and still give each row its own matcher's result."""
    compiler = GrammarCompiler(tokenizer_json, VOCAB, [EOS], mask_threads=1, families=2)
    old_executor = compiler._executor
    compiler.set_mask_threads(3)
    assert compiler.mask_threads == 3 and compiler._executor is not old_executor
    states = [compiler.new_state(TWO_BRANCHES) for _ in range(4)]
    tokens = [compiler.tokenizer.tokenize_str(WALKS[i % 2][:1])[0] for i in range(4)]
    assert compiler.advance_all(states, tokens) == [False] * 4
    words = (VOCAB + 31) // 32
    expected = torch.stack([torch.frombuffer(bytearray(s.matcher.compute_bitmask()), dtype=torch.int32)[:words]
                            for s in states])
    assert not torch.equal(expected[0], expected[1])  # a letter then a digit: the rows differ
    bitmask = torch.zeros((len(states), words), dtype=torch.int32)
    compiler.fill_bitmasks([s.matcher for s in states], bitmask, [s.family for s in states])
    assert torch.equal(bitmask, expected)


def test_extra_templates_stop_at_the_compile_budget(tokenizer_json, monkeypatch):
    """A grammar whose compile costs more than FAMILY_COMPILE_BUDGET_S gets one template (a hostile schema
    must not be compiled 12 times); a cheap one gets all of them."""
    compiler = GrammarCompiler(tokenizer_json, VOCAB, [EOS], mask_threads=4, families=4)
    assert compiler.num_families(TWO_BRANCHES) == 4
    monkeypatch.setattr(grammar, "FAMILY_COMPILE_BUDGET_S", 0.0)
    assert compiler.num_families(GuidedDecoding("regex", "[0-9]{3}")) == 1


SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 5},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["name", "n"], "additionalProperties": False}


@pytest.fixture(scope="module")
def model_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = str(tmp_path_factory.mktemp("llama"))
    build_hf_model("llama", path)
    return path


def _engine_outputs(model_path: str, families: int) -> tuple[dict[str, list[int]], set[int], LLMEngine]:
    """Seeded sampled constrained requests of one schema beside unconstrained ones, on an overlapped engine whose
    compiler deals them over `families` templates -> (output ids per request, the families used, the engine)."""
    engine = LLMEngine(EngineConfig(model_path=model_path, device="cpu", async_scheduling=True, num_kv_blocks=64))
    engine.grammar_compiler().families = families  # before the schema's first compile
    guided = grammar.GuidedDecoding("json_schema", json.dumps(SCHEMA))
    for i in range(7):
        params = (SamplingParams(max_tokens=40, temperature=1.0, seed=i, guided=guided) if i % 3 else
                  SamplingParams(max_tokens=8, temperature=1.0, seed=i, ignore_eos=True))
        engine.add_request(EngineRequest(f"r{i}", prompt_token_ids=[3 + i, 11, 7 * i % 50 + 2], params=params))
    used = {item.row.grammar.family for _, item in engine._inbox if item.row.grammar is not None}
    ids: dict[str, list[int]] = {}
    for _ in range(500):
        if not engine.has_unfinished():
            break
        for out in engine.step():
            assert out.error_code is None, (out.request_id, out.error_message)
            ids.setdefault(out.request_id, []).extend(out.new_token_ids)
    assert not engine.has_unfinished()
    return ids, used, engine


def test_an_engine_with_families_samples_what_one_template_samples(model_path):
    """The same seeded requests give the same tokens whether their matchers come from one template or three
    (each row of the batch masked by its own matcher whatever the order the executor fills them in), and
    every constrained output validates."""
    one, used_one, _ = _engine_outputs(model_path, 1)
    three, used_three, engine = _engine_outputs(model_path, 3)
    assert used_one == {0} and used_three == {0, 1, 2}
    assert three == one
    for i in range(7):
        if i % 3:
            jsonschema.validate(json.loads(engine.tokenizer.decode(three[f"r{i}"])), SCHEMA)
