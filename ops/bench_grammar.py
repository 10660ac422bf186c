"""What compiling a job's `response_format` costs, for normal and hostile specs within the contract's 64 KiB.

    PYTHONPATH=. python ops/bench_grammar.py                  # the demo model's tokenizer + a 128K one
    PYTHONPATH=. python ops/bench_grammar.py --only deep      # the cases whose name contains "deep"

For each tokenizer and case: the whole compile as the engine does it (engine.grammar.GrammarCompiler, with
its llguidance limits), the fastest of --repeat fresh compiles (the cache is bypassed), the outcome (ok, or
the first words of the compiler's reason); `loop gap`: the longest a Python thread that wants to run every
1 ms waited while the compile ran on another thread (the method's floor is ~1.1 ms, for compile and gap
alike); the compile includes the first mask (engine.grammar computes it there, under the worker's time bound);
`mask ms`: a request's first mask, on a copy of the compiled matcher, which is what the engine thread pays. A gap near the compile time would mean the compile holds the GIL (then a thread pool alone would not
keep the worker's loop going); a gap of a few ms means it releases it. The 128K tokenizer is byte-level, its tokens the most frequent words and punctuation runs of
Python's standard library sources (real-looking pieces, as a Llama-3-sized vocabulary has).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import sysconfig
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

from stoker.engine.grammar import GrammarCompiler, GrammarError
from stoker.engine.sampling_params import GuidedDecoding
from stoker.schemas.messages import MAX_RESPONSE_FORMAT_BYTES

DEMO_TOKENIZER = "/root/.cache/stoker/models/stoker-demo-py311-bc3dee4f0643/tokenizer.json"
BIG_VOCAB = 128_000


def _obj(props: dict[str, object], required: list[str] | None = None) -> dict[str, object]:
    return {"type": "object", "properties": props, "required": required or list(props),
            "additionalProperties": False}


def _nested_objects(depth: int) -> str:
    # Written as text: json.dumps recurses once per level and stops near 1,000.
    head = '{"type":"object","required":["a"],"additionalProperties":false,"properties":{"a":'
    return head * depth + '{"type":"integer"}' + "}}" * depth


def _nested_arrays(depth: int) -> str:
    return '{"type":"array","maxItems":3,"items":' * depth + '{"type":"integer"}' + "}" * depth


def _words(count: int, width: int) -> list[str]:
    return [f"w{i:0{width}d}" for i in range(count)]


def cases() -> dict[str, GuidedDecoding]:
    """name -> spec; every one within the 64 KiB the contract allows (checked in main)."""
    mid = _obj({"id": {"type": "integer", "minimum": 0}, "name": {"type": "string", "maxLength": 40},
                "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 5},
                "address": _obj({"street": {"type": "string"}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}}),
                "score": {"type": "number", "minimum": 0, "maximum": 1}})
    big_anyof = {"anyOf": [{"type": "object", "properties": {f"k{i}": {"const": i}}} for i in range(900)]}
    schemas: dict[str, object | str] = {
        "small object": _obj({"name": {"type": "string", "maxLength": 6}, "age": {"type": "integer"}}),
        "mid object": mid,
        "nested objects x50": _nested_objects(50),
        "nested objects x100": _nested_objects(100),
        "nested objects x600": _nested_objects(600),
        "nested arrays x1500": _nested_arrays(1500),
        "enum of 6000 strings": {"enum": _words(6000, 4)},
        "anyOf 900 objects": big_anyof,
        "2000 optional props": {"type": "object", "additionalProperties": False,
                                "properties": {w: {"type": "integer"} for w in _words(2000, 4)}},
        "4500 optional props": {"type": "object", "properties": {f"p{i}": True for i in range(4500)}},
        "string maxLength 1e6": {"type": "string", "minLength": 500000, "maxLength": 1000000},
        "pattern {1000}x{1000}": {"type": "string", "pattern": "^((ab|cd){1000}){1000}$"},
        "pattern [a-z]{30000}": {"type": "string", "pattern": "^[a-z0-9]{30000}$"},
        "pattern nested counts": {"type": "string", "pattern": "^(((a|b){1,60}){1,60}){1,60}$"},
        "array minItems 10000": {"type": "array", "items": {"type": "integer"}, "minItems": 10000,
                                 "maxItems": 20000},
        "int range 1e15 wide": {"type": "integer", "minimum": -123456789012345, "maximum": 987654321098765},
    }
    specs = {name: GuidedDecoding("json_schema", s if isinstance(s, str) else json.dumps(s, separators=(",", ":")))
             for name, s in schemas.items()}
    specs["json_object"] = GuidedDecoding("json_object")
    specs["regex email-ish"] = GuidedDecoding("regex", r"[a-z]{1,20}@[a-z]{1,20}\.(com|org|net)")
    specs["regex (a|aa)*{500}"] = GuidedDecoding("regex", "((a|aa)*b){500}")
    specs["regex alternation 64K"] = GuidedDecoding("regex", "|".join(_words(7000, 4)))
    specs["choice of 6000"] = GuidedDecoding("choice", json.dumps(_words(6000, 4)))
    return specs


def big_tokenizer_json(vocab_size: int) -> str:
    """A byte-level BPE tokenizer.json: the 256 byte symbols, then the commonest word / punctuation pieces of
    the standard library's sources (with the GPT-2 byte-to-unicode map, as `tokenizers` writes them)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    byte_chars = pre_tokenizers.ByteLevel.alphabet()
    counts: Counter[str] = Counter()
    piece = re.compile(r" ?[A-Za-z_]+| ?[0-9]{1,3}| ?[^\sA-Za-z0-9_]+|\s+")
    stdlib = sysconfig.get_paths()["stdlib"]
    for root, _, files in os.walk(stdlib):
        for name in files:
            if name.endswith(".py") and len(counts) < 3 * vocab_size:
                with open(os.path.join(root, name), encoding="utf-8", errors="ignore") as f:
                    counts.update(piece.findall(f.read()))
    to_unicode = _byte_to_unicode()
    vocab: dict[str, int] = {"<s>": 0, "</s>": 1}
    for ch in sorted(byte_chars):
        vocab.setdefault(ch, len(vocab))
    for text, _ in counts.most_common():
        token = "".join(to_unicode[b] for b in text.encode("utf-8"))
        if len(token) > 1:
            vocab.setdefault(token, len(vocab))
        if len(vocab) >= vocab_size:
            break
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "tokenizer.json")
        tok.save(path)
        with open(path, encoding="utf-8") as f:
            return f.read()


def _byte_to_unicode() -> dict[int, str]:
    """GPT-2's printable stand-in for each byte (what ByteLevel tokenizers store in their vocabularies)."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def timed(compile_once: Callable[[], Any]) -> tuple[float, float, str, float | None]:
    """(seconds, longest wait of a 1 ms ticker thread meanwhile, outcome, first mask's seconds or None) of one
    compile on a side thread."""
    outcome: list[str] = []
    matchers: list[Any] = []

    def work() -> None:
        try:
            matchers.append(compile_once())
            outcome.append("ok")
        except GrammarError as exc:
            outcome.append("rejected: " + str(exc)[:70])

    worker = threading.Thread(target=work)
    longest, started = 0.0, time.perf_counter()
    worker.start()
    last = time.perf_counter()
    while worker.is_alive():
        time.sleep(0.001)
        now = time.perf_counter()
        longest, last = max(longest, now - last), now
    elapsed = time.perf_counter() - started
    mask_s = None
    if matchers:  # a request's first mask on the engine thread: a copy of the compiled matcher's
        request = matchers[0].deep_copy()
        started = time.perf_counter()
        request.compute_bitmask()
        mask_s = time.perf_counter() - started
    return elapsed, longest, outcome[0], mask_s


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", default="", help="run only the cases whose name contains this")
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--skip-big", action="store_true", help="the demo tokenizer only")
    args = parser.parse_args(argv)
    with open(DEMO_TOKENIZER, encoding="utf-8") as f:
        tokenizers = {"demo (2,048)": (f.read(), 2048)}
    if not args.skip_big:
        started = time.perf_counter()
        tokenizers[f"byte-level {BIG_VOCAB:,}"] = (big_tokenizer_json(BIG_VOCAB), BIG_VOCAB)
        print(f"# built the 128K tokenizer in {time.perf_counter() - started:.1f} s", file=sys.stderr)
    specs = {name: spec for name, spec in cases().items() if args.only in name}
    print(f"{'tokenizer':<18} {'case':<24} {'bytes':>6} {'compile ms':>11} {'loop gap ms':>11} {'mask ms':>8}  outcome")
    for tok_name, (tok_json, vocab) in tokenizers.items():
        started = time.perf_counter()
        compiler = GrammarCompiler(tok_json, vocab, [1])
        print(f"{tok_name:<18} {'(LLTokenizer build)':<24} {'':>6} {(time.perf_counter() - started) * 1e3:>11.1f}")
        for name, spec in specs.items():
            size = len(spec.spec.encode())
            if size > MAX_RESPONSE_FORMAT_BYTES:
                raise SystemExit(f"case {name!r} is {size} bytes, over the contract's {MAX_RESPONSE_FORMAT_BYTES}")
            runs = [timed(lambda s=spec, c=compiler: _compile_fresh(c, s)) for _ in range(args.repeat)]
            best = min(runs, key=lambda run: run[0])
            mask = f"{best[3] * 1e3:>8.1f}" if best[3] is not None else f"{'':>8}"
            print(f"{tok_name:<18} {name:<24} {size:>6} {best[0] * 1e3:>11.1f} {best[1] * 1e3:>11.1f} {mask}  {best[2]}",
                  flush=True)


def _compile_fresh(compiler: GrammarCompiler, spec: GuidedDecoding) -> Any:
    return compiler.compile_uncached(spec)


if __name__ == "__main__":
    main()
