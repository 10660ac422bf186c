"""Warm-up before serving: run synthetic requests through every path serving will take, so that the first
real requests do not pay for first-time work (Triton compiling a kernel variant, cuBLAS choosing a plan for a
new GEMM shape, the caching allocator growing its pools).

Measured on the H200 through the queue (BENCHMARKS.md, 2026-12-01): the first 8 requests after ready
(512 + 32 tokens) had a TTFT of 233 ms against 102 ms for the same 8 later, a 2.3x penalty, while the decode
CUDA graphs were already captured: the cost sits in the prefill and mixed steps and the sampler's paths.

What runs, in waves, each drained before the next:
  - one short prompt (the smallest prefill, then decode at batch 1);
  - a full prefill step: prompts that fill `max_num_batched_tokens` in one step (a chunked prefill when one
    prompt is longer than the budget);
  - a mixed step: a long prompt arriving while shorter requests decode;
  - the sampler's paths: temperature with top-k/top-p/min-p, seeded sampling, logprobs, penalties (which
    step synchronously);
  - structured output: the grammar compiler reads the vocabulary (about 0.5 s for 128K tokens), and one
    constrained request runs the token-bitmask path (skipped, with a log line, for a tokenizer llguidance
    cannot read: such a model answers response_format with invalid_response_format).
Then the prefix cache forgets the synthetic prompts and its counters start from zero.
"""

from __future__ import annotations

import logging
import random
import time
from dataclasses import dataclass, field

from stoker.engine.engine import LLMEngine
from stoker.engine.grammar import GrammarError
from stoker.engine.request import EngineRequest
from stoker.engine.sampling_params import GuidedDecoding, SamplingParams

log = logging.getLogger(__name__)

_PREFIX = "__stoker_warmup__"


@dataclass(slots=True)
class WarmupReport:
    seconds: float = 0.0
    requests: int = 0
    steps: int = 0
    largest_step_tokens: int = 0  # tokens the fullest forward carried
    mixed_steps: int = 0  # forwards that carried decodes and prompt chunks together
    waves: list[str] = field(default_factory=list)


def warm_up(engine: LLMEngine, seed: int = 0, light: bool = False) -> WarmupReport:
    """Run the waves above to completion. The engine must be idle; it is idle again afterwards, with an empty
    prefix cache. Returns what ran (for the start-up log).

    light: the engine reloads a model that this process has served before (the worker's idle unload, then a
    job for it): Triton's kernels are compiled and cuBLAS's plans chosen in this process already, so only the
    short prompt (a prefill, then the decode graph's replay) and the structured-output wave run; a reload is
    then serving in about the time of its load (issue 16 asks < 3 s warm)."""
    if engine.has_unfinished():
        raise RuntimeError("warm_up needs an idle engine")
    started = time.monotonic()
    report = WarmupReport()
    rng = random.Random(seed)
    vocab = engine.model_config.vocab_size
    budget = engine.config.max_num_batched_tokens
    longest = engine.max_model_len - 2  # prompt + 2 new tokens must fit the context

    def prompt(n: int) -> list[int]:
        return [rng.randrange(vocab) for _ in range(max(1, min(n, longest)))]

    greedy = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    chunk = min(512, longest, budget)
    fill = max(1, budget // chunk)
    waves: list[tuple[str, list[tuple[list[int], SamplingParams]]]] = [
        ("short prompt", [(prompt(16), SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))]),
        (f"full prefill step ({fill} x {chunk})", [(prompt(chunk), greedy) for _ in range(fill)]),
        ("chunked prefill", [(prompt(budget + chunk), greedy)] if longest > budget else []),
        ("sampler paths", [
            (prompt(32), SamplingParams(max_tokens=2, temperature=0.8, top_k=40, top_p=0.9, min_p=0.05,
                                        ignore_eos=True)),
            (prompt(32), SamplingParams(max_tokens=2, temperature=1.0, seed=7, logprobs=5, ignore_eos=True)),
            (prompt(32), SamplingParams(max_tokens=2, temperature=0.7, presence_penalty=0.5,
                                        frequency_penalty=0.5, repetition_penalty=1.1, ignore_eos=True)),
        ]),
    ]
    try:
        engine.grammar_compiler()
        waves.append(("structured output", [(prompt(16), SamplingParams(
            max_tokens=2, temperature=0.0, guided=GuidedDecoding("json_object")))]))
    except GrammarError as e:
        log.warning("warm-up: structured output unavailable for this model: %s", e)
    if light:
        waves = [wave for wave in waves if wave[0] in ("short prompt", "structured output")]
    for name, requests in waves:
        if requests:
            _run(engine, report, name, requests)
    if not light:
        # Mixed: decoders first, then a long prompt joins while they decode.
        decoders = [(prompt(16), SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)) for _ in range(4)]
        _run(engine, report, "mixed step", decoders, late=[(prompt(min(budget, longest) // 2), greedy)])
    engine.scheduler.reset_prefix_cache()
    report.seconds = time.monotonic() - started
    return report


def _run(engine: LLMEngine, report: WarmupReport, name: str, requests: list[tuple[list[int], SamplingParams]],
         late: list[tuple[list[int], SamplingParams]] | None = None) -> None:
    for ids, params in requests:
        engine.add_request(EngineRequest(f"{_PREFIX}{report.requests}", prompt_token_ids=ids, params=params))
        report.requests += 1
    steps = 0
    while engine.has_unfinished():
        outputs = engine.step()
        steps += 1
        report.largest_step_tokens = max(report.largest_step_tokens, engine.last_step_tokens)
        report.mixed_steps += engine.last_step_mixed
        if late and steps == 2:  # the first decode step has run: the long prompt now shares steps with it
            for ids, params in late:
                engine.add_request(EngineRequest(f"{_PREFIX}{report.requests}", prompt_token_ids=ids,
                                                 params=params))
                report.requests += 1
            late = None
        failed = [o for o in outputs if o.error_code is not None]
        if failed:
            raise RuntimeError(f"warm-up ({name}) failed: {failed[0].error_code}: {failed[0].error_message}")
    report.steps += steps
    report.waves.append(name)
