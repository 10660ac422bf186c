"""Incremental detokenization through a real byte-level BPE tokenizer (make_model's): UTF-8 characters split
across tokens, stop strings held back and cut, and the same through the engine (stop strings, stop ids,
eos, ignore_eos, min_tokens)."""

from __future__ import annotations

import pytest
from engine_models import build_hf_model, prompts
from stoker.engine import EngineRequest, SamplingParams
from stoker.engine.config import EngineConfig
from stoker.engine.detokenizer import IncrementalDetokenizer
from stoker.engine.engine import LLMEngine
from stoker.engine.make_model import write_tokenizer
from stoker.engine.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> Tokenizer:
    path = tmp_path_factory.mktemp("tok")
    write_tokenizer(str(path), 384)
    return Tokenizer(str(path))


def stream(tok: Tokenizer, text: str, **kw) -> tuple[list[str], IncrementalDetokenizer]:
    ids = tok.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, tok.encode("Prompt:"), **kw)
    deltas = [detok.add([t]) for t in ids]
    if not detok.stopped:
        deltas.append(detok.flush())
    return deltas, detok


TEXT = "Fire 🔥 and 東京は日本の首都です rocket 🚀👍🏽 done."


def test_multibyte_characters_split_across_tokens(tokenizer):
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    assert any("\ufffd" in tokenizer.decode([t]) for t in ids), (
        "no character spans tokens: the test tests nothing"
    )
    deltas, _ = stream(tokenizer, TEXT)
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == TEXT


def test_logprob_token_text_is_each_token_decoded_alone(tokenizer):
    """Contract 1.1: logprob entries carry the token decoded alone, a split character as U+FFFD."""
    from stoker.engine.output_processor import OutputProcessor

    outputs = OutputProcessor(tokenizer)
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    texts = [outputs.token_text(t) for t in ids]
    assert texts == [tokenizer.decode([t], skip_special_tokens=False) for t in ids]
    assert any("\ufffd" in t for t in texts)  # a character split across tokens
    assert texts[0] and "\ufffd" not in texts[0] and TEXT.startswith(texts[0])
    assert [outputs.token_text(t) for t in ids] == texts  # cached: the same answer again


@pytest.mark.parametrize(
    ("stop", "include", "expected"),
    [
        (("首都",), False, "Fire 🔥 and 東京は日本の"),
        (("首都",), True, "Fire 🔥 and 東京は日本の首都"),
        (("rocket", "🔥 a"), False, "Fire "),  # the earliest match wins, even when spanning tokens
        (("nowhere", "done!"), False, TEXT),  # "done" is a held-back partial match, flushed at the end
    ],
)
def test_stop_strings(tokenizer, stop, include, expected):
    deltas, detok = stream(tokenizer, TEXT, stop=stop, include_stop_str_in_output=include)
    assert "".join(deltas) == expected == detok.text
    assert detok.stopped == (expected != TEXT)
    emitted = ""
    for d in deltas:  # nothing is ever taken back: each prefix is final
        emitted += d
        assert expected.startswith(emitted)


def test_partial_stop_string_is_held_back(tokenizer):
    detok = IncrementalDetokenizer(tokenizer, [], stop=("STOP",))
    sent = "".join(detok.add([t]) for t in tokenizer.encode("go ST", add_special_tokens=False))
    assert sent == "go "  # "ST" may still become "STOP"
    assert detok.flush() == "ST"


def test_min_tokens_ignores_stop_strings_before_it(tokenizer):
    detok = IncrementalDetokenizer(tokenizer, [], stop=("ab",))
    ids = tokenizer.encode("ab cd ab", add_special_tokens=False)
    out = "".join(detok.add([t], check_stop=i >= 2) for i, t in enumerate(ids))
    assert detok.stopped and out == "ab cd "


@pytest.fixture(scope="module")
def engine_path(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("llama"))
    build_hf_model("llama", path, seed=4)
    return path


def generate(path: str, ids: list[int], eos: set[int] | None = None, **params):
    engine = LLMEngine(EngineConfig(path, device="cpu", num_kv_blocks=32))
    if eos is not None:
        engine.inputs.eos_token_ids = frozenset(eos)
    engine.add_request(EngineRequest("r", prompt_token_ids=ids, params=SamplingParams(temperature=0, **params)))
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    assert outs[-1].finished and all(not o.finished for o in outs[:-1])
    return [t for o in outs for t in o.new_token_ids], "".join(o.text_delta for o in outs), outs[-1]


def test_engine_stop_string_stop_id_eos_and_min_tokens(engine_path):
    ids = prompts(21, [6])[0]
    full_ids, full_text, last = generate(engine_path, ids, max_tokens=24, ignore_eos=True)
    assert last.finish_reason == "length" and len(full_ids) == 24
    stop = full_text[len(full_text) // 2 : len(full_text) // 2 + 2]
    cut = full_text.index(stop)
    _, text, last = generate(engine_path, ids, max_tokens=24, ignore_eos=True, stop=(stop,))
    assert (text, last.finish_reason) == (full_text[:cut], "stop")
    _, text, _ = generate(
        engine_path, ids, max_tokens=24, ignore_eos=True, stop=(stop,), include_stop_str_in_output=True
    )
    assert text == full_text[: cut + len(stop)]

    stop_id = full_ids[5]
    first = full_ids.index(stop_id)
    out_ids, _, last = generate(engine_path, ids, max_tokens=24, stop_token_ids=(stop_id,))
    assert out_ids == full_ids[: first + 1] and last.finish_reason == "stop"  # the stop id is reported

    out_ids, _, last = generate(engine_path, ids, eos={stop_id}, max_tokens=24)
    assert out_ids == full_ids[: first + 1] and last.finish_reason == "stop"
    out_ids, _, last = generate(engine_path, ids, eos={stop_id}, max_tokens=24, ignore_eos=True)
    assert out_ids == full_ids and last.finish_reason == "length"

    min_tokens = first + 3
    out_ids, _, last = generate(engine_path, ids, eos={stop_id}, max_tokens=24, min_tokens=min_tokens)
    assert stop_id not in out_ids[:min_tokens] and len(out_ids) > min_tokens
    assert last.completion_tokens == len(out_ids)


def test_byte_table_fast_path_equals_tokenizer_decode(tmp_path):
    # Byte-level BPE: the detokenizer concatenates per-token bytes; the text must be decode()'s, also across
    # ids that split UTF-8 characters, special tokens (skipped) and ids outside the vocabulary (nothing).
    import random

    from stoker.engine.make_model import write_tokenizer
    from stoker.engine.tokenizer import Tokenizer

    write_tokenizer(str(tmp_path), 384)
    tok = Tokenizer(str(tmp_path))
    table = tok.byte_table()
    assert table is not None and len(table) == tok.vocab_size and table[tok.eos_token_id] == b""
    rng = random.Random(0)
    for _ in range(200):
        ids = [rng.randrange(0, 400) for _ in range(rng.randrange(1, 30))]
        det = IncrementalDetokenizer(tok, [5, 6])
        assert det._utf8 is not None
        deltas = [det.add([i]) for i in ids]
        assert "".join(deltas) + det.flush() == tok.decode(ids), ids
        assert all(not d.endswith("\ufffd") or "\ufffd" in tok.decode(ids) for d in deltas)
        # add_token, the engine's per-token path (ASCII pieces skip the incremental decoder unless it holds
        # the start of a character): the same deltas
        fast = IncrementalDetokenizer(tok, [5, 6])
        assert [fast.add_token(i) for i in ids] == deltas, ids


def test_add_token_across_a_split_character_then_ascii(tokenizer):
    # Characters split over tokens, then ASCII; and a lone lead byte followed by ASCII (invalid UTF-8): the
    # ASCII token must not jump the bytes the decoder holds.
    table = tokenizer.byte_table()
    assert table is not None
    data = "é🔥a東b".encode() + b"\xe6" + b"c"
    by_bytes = {b: i for i, b in enumerate(table) if len(b) == 1}
    ids = [by_bytes[data[k : k + 1]] for k in range(len(data))]  # one token per byte
    det = IncrementalDetokenizer(tokenizer, [5])
    deltas = [det.add_token(i) for i in ids]
    assert "".join(deltas) + det.flush() == data.decode("utf-8", "replace") == "é🔥a東b\ufffdc"
    assert deltas[data.index(b"a")] == "a" and deltas[-1] == "\ufffdc"


@pytest.mark.parametrize("finished", [False, True])
def test_output_token_equals_output_for_a_token_without_logprobs(tokenizer, finished):
    # OutputProcessor.output_token restates output(state, [token], text, None) for the hot path: the two must
    # give the same RequestOutput, a finished request's held-back bytes (a split character here) included.
    from stoker.engine.output_processor import OutputProcessor
    from stoker.engine.sequence import FinishReason, Sequence, SequenceStatus

    ids = tokenizer.encode("Fire 🔥 on", add_special_tokens=False)
    cut = next(k for k in range(1, len(ids)) if tokenizer.decode(ids[:k]).endswith("\ufffd"))  # mid-character
    processor = OutputProcessor(tokenizer)
    outs = []
    for use_output_token in (True, False):
        seq = Sequence("r", [5, 6, 7], output_token_ids=list(ids[:cut]), num_cached_tokens=2)
        state = processor.new_request(seq)
        state.first_scheduled_ms = 123.0
        for t in ids[: cut - 1]:
            state.detokenizer.add_token(t)
        text = state.detokenizer.add_token(ids[cut - 1])
        if finished:
            seq.status, seq.finish_reason = SequenceStatus.FINISHED, FinishReason.LENGTH
        outs.append(processor.output_token(state, ids[cut - 1], text) if use_output_token
                    else processor.output(state, [ids[cut - 1]], text, None))
    assert outs[0] == outs[1]
    assert outs[0].finished is finished and outs[0].completion_tokens == cut and outs[0].cached_tokens == 2
    assert outs[0].text_delta.endswith("\ufffd") is finished  # only a finished request flushes held bytes
