"""Structured output: grammars from a request's GuidedDecoding, one matcher per request, token bitmasks.

Library: llguidance (guidance-ai). Chosen over xgrammar (measured on this machine's CPU, 2026-12-01, one
thread, a synthetic 128,001-token byte-level vocabulary, batch 256, one mid-size JSON Schema):
- install: llguidance is one wheel with no dependencies (7.5 MB); xgrammar requires transformers, torch,
  pydantic and apache-tvm-ffi, and `import xgrammar` imports transformers (the worker must not need it).
- coverage: llguidance rejects the JSON Schema keywords it cannot enforce (`not`, `if`/`then`,
  `uniqueItems`): the request gets `invalid_response_format`, never silently unconstrained output; xgrammar
  accepted those and does not enforce them, and rejected `minProperties`.
- mask cost: llguidance 438 us per row (112 ms per step for 256 rows on one thread; it spreads rows over
  threads with LLExecutor), xgrammar 38 us per row. Slower here, but no transformers at run time outweighs
  it; the lead's H200 benchmark measures the real step cost at batch 1,024.

Grammars are compiled on the caller's thread, never on the engine thread (the worker compiles an uncached one
on its own compile threads, LLMEngine.prepare_grammar via worker.grammar_gate, so that add_request on its event
loop finds it cached), with their first mask, and cached by (kind, spec): a request gets a copy of one of the
grammar's cached templates (several per grammar, each with its own lexer: FAMILY_COMPILE_BUDGET_S says why). JSON
is compact (no free whitespace: a model cannot run on between tokens inside a bounded schema), as vLLM chose.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from stoker.engine.grammar_masks import MaskStaging
from stoker.engine.os_threads import name_os_thread
from stoker.engine.sampling_params import GuidedDecoding

_CACHE_SIZE = 256  # distinct (kind, spec) kept compiled; pipelines send the same schema thousands of times
# llguidance's resource limits, set here rather than left implicit (values = its 1.9 defaults, kept after
# ops/bench_grammar.py: no schema within the contract's 64 KiB needed more, and lower ones did not make the
# slowest case cheaper: 4,500 optional properties cost ~2 s of matcher build whatever the limits, which is why
# the worker bounds the compile by time instead, worker.grammar_gate). A grammar past one ends the request
# with `invalid_response_format`, or (a step's lexer fuel or Earley items) stops the matcher mid-request.
PARSER_LIMITS: dict[str, Any] = {
    "max_items_in_row": 2_000,  # alternatives of one rule (an enum, anyOf)
    "initial_lexer_fuel": 1_000_000,  # regex analysis at build, ~50k/ms (~20 ms)
    "step_lexer_fuel": 200_000,  # lexing per mask (engine thread), ~14k/ms
    "step_max_items": 50_000,  # Earley items per mask, ~20k/ms
    "max_lexer_states": 250_000,  # ~1-2 kB each: caps a matcher's lexer memory near 0.5 GB
    "max_grammar_size": 500_000,  # symbols in the grammar's productions
    "verbose_errors": False,  # else an error carries the parser state and the whole grammar (tens of KB)
}
# Lexer families. llguidance's LLMatcher.deep_copy (1.9) shares the template's lexer (its lazily built DFA)
# between the copies behind one mutex, and a mask computation holds that mutex throughout: 1,024 copies of one
# template fill their masks one at a time whatever the executor's threads (issue 15: 125 ms wall for 148 ms
# CPU on 16 cores). Each grammar is therefore compiled into several independent templates, requests are dealt
# round-robin over them, and a step's rows are handed to the executor grouped by template. FAMILIES_PER_THREAD
# templates per executor thread: rayon gives each thread a contiguous share of the rows and splits shares again
# when a thread steals, so with one family per thread two threads often meet on one family's lock (H200, 1,024
# recorded rows, 12 threads, 12 families: 11.3 us a row for 6.3 cores busy, against 25.4 us with one family;
# ops/llg_fill_probe.py); with four a share spans several families and only its edges can collide. Extra
# compiles stop once they would cost more than FAMILY_COMPILE_BUDGET_S (the bench's 2.4 ms schema gets all 48 of
# the H200's; a 1.5 s hostile one only its first).
FAMILIES_PER_THREAD = 4
FAMILY_COMPILE_BUDGET_S = 0.2
_COMPACT: dict[str, Any] = {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}


class GrammarError(ValueError):
    """The schema, pattern or choice list cannot be compiled; the message is the compiler's reason."""


class GrammarTooComplex(RuntimeError):
    """A compiled grammar hit one of PARSER_LIMITS while the request ran (e.g. 4,500 optional properties: the
    row after `{` holds 18,000 Earley items, past max_items_in_row): the request's response_format is at fault,
    not the worker, so it ends `invalid_response_format`."""


class _Compiled:
    """One grammar's templates (independent lexers, see FAMILY_COMPILE_BUDGET_S) and the round-robin over
    them."""

    __slots__ = ("templates", "_turn")

    def __init__(self, templates: list[Any]):
        self.templates = templates
        self._turn = itertools.count()  # next() is atomic under the GIL

    def copy(self) -> tuple[Any, int]:
        """-> (a fresh matcher, its family: the index of the template whose lexer it shares)."""
        family = next(self._turn) % len(self.templates)
        return self.templates[family].deep_copy(), family


def default_mask_threads() -> int:
    """llguidance's default executor size (80% of the CPUs this process may use, 1..32), stated here so the
    families follow it."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, min(32, cpus * 80 // 100))


class GrammarCompiler:
    """Compiles GuidedDecoding specs into llguidance matchers for one model's vocabulary. Thread-safe.
    mask_threads: the executor's threads (default_mask_threads()); families: independent templates per grammar
    at most (default FAMILIES_PER_THREAD * mask_threads; 1 is what this engine did before issue 15's fix)."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_token_ids: list[int],
                 mask_threads: int | None = None, families: int | None = None):
        import llguidance

        self._llg = llguidance
        # llguidance reads tokenizer.json itself (the `tokenizers` format, in Rust): no transformers needed.
        # vocab_size is the model's (embedding rows, often padded past the tokenizer's): ids past the
        # tokenizer are never allowed.
        self.tokenizer = llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab_size, eos_token=eos_token_ids)
        self.vocab_size = vocab_size
        self._cache: OrderedDict[tuple[str, str], _Compiled] = OrderedDict()
        self._lock = threading.Lock()
        self.mask_threads = mask_threads or default_mask_threads()
        self.families = families or FAMILIES_PER_THREAD * self.mask_threads
        # its threads start here (warm-up), not on a first step
        self._executor = llguidance.LLExecutor(num_threads=self.mask_threads)
        self.staging = MaskStaging()  # the sampler's pinned mask buffers for this model's engine
        self._limits = llguidance.LLParserLimits(**PARSER_LIMITS)
        self._worker: ThreadPoolExecutor | None = None  # submit(): one thread, so its jobs run in order
        self._consume_par = getattr(self._executor, "consume_token_par", None)

    def set_mask_threads(self, threads: int) -> None:
        """Fills and advances from now on run on a new executor of this many threads (benchmarks compare counts
        on one engine; call between steps, with no fill or advance queued); the families compiled stay."""
        self._executor = self._llg.LLExecutor(num_threads=threads)
        self._consume_par = getattr(self._executor, "consume_token_par", None)
        self.mask_threads = threads

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future[Any]:
        """Run fn(*args) on this compiler's grammar thread, after the jobs submitted before it (the engine
        queues a step's advance, then the next step's fill, and works meanwhile). That thread mostly waits on
        llguidance's executor, which runs without the GIL."""
        if self._worker is None:
            self._worker = ThreadPoolExecutor(1, thread_name_prefix="grammar", initializer=name_os_thread,
                                              initargs=("stoker-grammar",))
        return self._worker.submit(fn, *args)

    def new_state(self, guided: GuidedDecoding) -> GrammarState:
        """A fresh request state for guided (GrammarError when it cannot be compiled)."""
        matcher, family = self._template(guided).copy()
        return GrammarState(self, matcher, family)

    def matcher(self, guided: GuidedDecoding) -> Any:
        """A fresh matcher for guided (GrammarError when it cannot be compiled)."""
        return self._template(guided).copy()[0]

    def num_families(self, guided: GuidedDecoding) -> int:
        """How many independent templates guided was compiled into (compiling it if needed)."""
        return len(self._template(guided).templates)

    def is_cached(self, guided: GuidedDecoding) -> bool:
        """True when guided is compiled already: new_state is then a copy, cheap enough for any thread."""
        with self._lock:
            return (guided.kind, guided.spec) in self._cache

    def prepare(self, guided: GuidedDecoding) -> None:
        """Compile guided into the cache (GrammarError when it cannot be): the worker runs this on its
        compile threads so that the add_request that follows on its event loop finds it cached."""
        self._template(guided)

    def compile_uncached(self, guided: GuidedDecoding, first_mask: bool = True) -> Any:
        """A compile that bypasses the cache (benchmarks, tests); first_mask=False leaves the first mask to be
        computed by whoever masks first, as a request's copy on the engine thread once did."""
        return self._compile(guided, first_mask)

    def _template(self, guided: GuidedDecoding) -> _Compiled:
        key = (guided.kind, guided.spec)
        with self._lock:
            template = self._cache.get(key)
            if template is not None:
                self._cache.move_to_end(key)
                return template
        template = self._compile_families(guided)  # outside the lock: a large schema must not stall other adds
        with self._lock:
            self._cache[key] = template
            while len(self._cache) > _CACHE_SIZE:
                self._cache.popitem(last=False)
        return template

    def _compile_families(self, guided: GuidedDecoding) -> _Compiled:
        """The first template, then as many more (up to self.families) as FAMILY_COMPILE_BUDGET_S pays for at
        the first one's cost."""
        started = time.perf_counter()
        templates = [self._compile(guided)]
        each_s = time.perf_counter() - started
        extra = min(self.families - 1, int(FAMILY_COMPILE_BUDGET_S / max(each_s, 1e-6)))
        templates += [self._compile(guided) for _ in range(extra)]
        return _Compiled(templates)

    def _compile(self, guided: GuidedDecoding, first_mask: bool = True) -> Any:
        llg = self._llg
        Matcher = llg.LLMatcher
        try:
            if guided.kind == "json_schema":
                grammar = Matcher.grammar_from_json_schema(guided.spec, defaults=_COMPACT)
            elif guided.kind == "json_object":
                grammar = Matcher.grammar_from_json_schema('{"type": "object"}', defaults=_COMPACT)
            elif guided.kind == "regex":
                grammar = Matcher.grammar_from_regex(guided.spec)
            elif guided.kind == "choice":
                grammar = llg.grammar_from("choice", guided.spec)
            else:
                raise GrammarError(f"unknown response_format type {guided.kind!r}")
        except (ValueError, TypeError) as e:
            raise GrammarError(str(e)) from e
        # No validate_grammar pass first: it builds the whole grammar once more (half of a hostile schema's
        # compile: 4,500 optional properties 0.6 s of 2.4 s) and the matcher reports the same errors.
        matcher = Matcher(self.tokenizer, grammar, log_level=0, limits=self._limits)
        if matcher.is_error():
            raise GrammarError(_first_line(matcher.get_error()))
        # The first mask here, on the compile thread and under its time bound (worker.grammar_gate): llguidance
        # keeps a computed mask in the matcher and deep_copy carries it, so every request's first mask on the
        # engine thread is a copy (4,500 optional properties, demo tokenizer: 335 ms once here, then 28 us a
        # request; it was 220 ms a request on the engine thread).
        if first_mask:
            matcher.compute_bitmask()
        if matcher.is_error():
            raise GrammarError(_first_line(matcher.get_error()))
        return matcher

    def fill_bitmasks(self, matchers: list[Any], bitmask: Any, families: list[int] | None = None) -> None:
        """bitmask: [len(matchers), ceil(V / 32)] int32 contiguous host tensor; row i <- matchers[i]'s allowed
        tokens (bit j of word k = token 32k + j). One call for the batch: llguidance fills the rows on its
        own threads without the GIL. families[i]: matchers[i]'s family (GrammarState.family); the rows go to
        the executor grouped by it, so that its threads' contiguous shares of the list meet few lexer locks."""
        order = range(len(matchers)) if families is None else sorted(range(len(matchers)), key=families.__getitem__)
        self._executor.unsafe_compute_mask_ptr(
            [(matchers[i], i) for i in order], bitmask.data_ptr(), bitmask.shape[1] * 4, len(matchers)
        )

    def advance_all(self, states: list[GrammarState], token_ids: list[int]) -> list[bool | Exception]:
        """states[i] consumes token_ids[i], on the executor's threads -> per row what GrammarState.advance
        returns (True: the grammar is complete) or raises (returned here, so that one bad row fails alone). One
        call for the step's rows, grouped by family as the fill is (the consume lexes the token's bytes under
        the family's lexer lock): the engine thread spent ~4.5 ms a step advancing 1,024 matchers one by one
        (H200, 15:31 UTC), outside the forward's shadow."""
        order = sorted(range(len(states)), key=lambda i: states[i].family)
        pairs = [(states[i].matcher, token_ids[i]) for i in order]
        if self._consume_par is not None:
            consumed = self._consume_par(pairs)
        else:  # an llguidance without LLExecutor.consume_token_par (pyproject allows >= 1.1; 1.9.1 has it)
            consumed = [matcher.consume_token(token) for matcher, token in pairs]
        accepted = [False] * len(states)
        for i, ok in zip(order, consumed, strict=True):
            accepted[i] = ok
        results: list[bool | Exception] = []
        for state, token_id, ok in zip(states, token_ids, accepted, strict=True):
            try:
                results.append(state.settle(ok, token_id))
            except (GrammarTooComplex, RuntimeError) as e:
                results.append(e)
        return results


class GrammarState:
    """One request's matcher: it has consumed exactly the request's output tokens whose values reached the
    host. A preempted request keeps its output tokens (they are recomputed as prompt), so its matcher stays
    valid; with constrained requests live the engine finishes step N before step N+1 samples (engine.py), so
    a mask is never built while a token is still in flight."""

    __slots__ = ("compiler", "matcher", "family")

    def __init__(self, compiler: GrammarCompiler, matcher: Any, family: int = 0):
        self.compiler, self.matcher, self.family = compiler, matcher, family

    def advance(self, token_id: int) -> bool:
        """Consume a sampled token -> True when the grammar is complete (nothing but EOS may follow: the
        request ends `stop` without waiting for the model to sample EOS). A token the mask did not allow
        (only possible if another rule overrode the mask) raises."""
        return self.settle(self.matcher.consume_token(token_id), token_id)

    def settle(self, consumed: bool, token_id: int) -> bool:
        """What advance makes of consume_token's answer (consumed: it took token_id): True when the grammar is
        complete; a refusal raises GrammarTooComplex when a parser limit caused it, else RuntimeError."""
        if not consumed:
            error = _first_line(self.matcher.get_error())
            if _past_a_limit(self.matcher.stop_reason(), error):
                raise GrammarTooComplex(
                    f"response_format grew past the grammar parser's limits while decoding ({error[:200]}): "
                    "simplify it (fewer optional properties, alternatives or enum values)")
            raise RuntimeError(f"token {token_id} breaks the grammar: {_first_line(self.matcher.get_error())}")
        return bool(self.matcher.is_stopped())


def _past_a_limit(stop_reason: str, error: str) -> bool:
    """Did the matcher stop on one of PARSER_LIMITS? llguidance 1.9 says so in its stop reason for lexer and
    some parser limits, but a row past max_items_in_row stops with `InternalError` and "... items; max is N"
    (tests/test_grammar_gate.py's hostile schema catches a change of that wording)."""
    return stop_reason in ("ParserTooComplex", "LexerTooComplex") or bool(_LIMIT_MESSAGE.search(error))


_LIMIT_MESSAGE = re.compile(r"; max is \d+")


def _first_line(message: str) -> str:
    """The compiler's reason on one line (its messages span several), bounded for an error event."""
    text = " ".join(line.strip() for line in message.strip().splitlines() if line.strip())
    return text[:600] or "the grammar was rejected"


def choices_spec(choices: list[str]) -> str:
    return json.dumps(choices)
