"""LLMEngine: the API the worker drives (see engine/outputs.py for the contract).

The loop, once per step(): apply the inbox (adds, aborts) -> schedule -> launch the forward and sampling ->
update the scheduler from the step before's sampled tokens (it appends them, applies the stop rule and frees
the finished) -> build the outputs. Input processing (engine/input_processor.py) and output processing
(engine/output_processor.py) sit beside it; the scheduler (engine/scheduler.py) owns each request's life.
"""

from __future__ import annotations

import contextlib
import logging
import os
import random
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from stoker.engine.config import EngineConfig
from stoker.engine.grammar import GrammarCompiler, GrammarError, GrammarState, GrammarTooComplex
from stoker.engine.input_processor import InputProcessor
from stoker.engine.model_config import ModelConfig
from stoker.engine.model_runner import PendingSample
from stoker.engine.output_processor import OutputProcessor, RequestState, SampleResult
from stoker.engine.outputs import EngineRequestError, EngineStats, RequestOutput
from stoker.engine.ranks import start_runner
from stoker.engine.request import EngineRequest
from stoker.engine.sampler import SamplingRequest, prefetch_grammar_masks
from stoker.engine.sampling_params import GuidedDecoding, SamplingParams
from stoker.engine.scheduler import SampledToken, ScheduledChunk, Scheduler, SchedulerConfig, SchedulerOutput
from stoker.engine.sequence import FinishReason, Sequence, SequenceStatus
from stoker.engine.tokenizer import Tokenizer

log = logging.getLogger(__name__)


@dataclass(slots=True)
class _Request:
    state: RequestState  # the sequence and its output side
    row: SamplingRequest  # refers to the sequence's own token lists, so it is built once per request


@dataclass(slots=True)
class _Launched:
    """A step whose GPU work is queued: its sampled chunks (row i of the sample = sampling[i]) and the
    sample parts, each (first row, PendingSample or the exception that failed that row)."""

    sampling: list[ScheduledChunk]
    rows: dict[Sequence, int]  # sequence -> its row in token_ids
    token_ids: Any  # [N] int64 device tensor: the next step's pending input ids
    parts: list[tuple[int, PendingSample | Exception]]


class LLMEngine:
    def __init__(self, config: EngineConfig):
        self.config = config
        self.model_config = ModelConfig.from_folder(config.model_path, config.quantization)
        self.tokenizer = Tokenizer(config.model_path)
        self.model_name: str = config.model_name  # type: ignore[assignment]
        mc = self.model_config
        max_len = config.max_model_len or mc.max_position_embeddings
        if config.max_model_len is not None and config.max_model_len > mc.max_position_embeddings:
            raise ValueError(
                f"max_model_len={config.max_model_len} exceeds the model's max_position_embeddings="
                f"{mc.max_position_embeddings}; lower it or leave it unset"
            )
        if mc.sliding_window is not None and mc.sliding_window < max_len:
            log.warning(
                "sliding window attention is not implemented: capping max_model_len at %d", mc.sliding_window
            )
            max_len = mc.sliding_window
        self.runner = start_runner(config, mc, max_len)  # tensor_parallel_size > 1: starts ranks 1..
        pool_tokens = self.runner.num_blocks * config.block_size
        if pool_tokens < max_len:  # so that context_length_exceeded fires before the scheduler's own check
            log.warning("KV pool holds %d tokens: capping max_model_len (%d) to it", pool_tokens, max_len)
            max_len = pool_tokens
        self.max_model_len: int = max_len
        self.scheduler = Scheduler(
            SchedulerConfig(
                num_blocks=self.runner.num_blocks,
                block_size=config.block_size,
                max_num_seqs=config.max_num_seqs,
                max_num_batched_tokens=config.max_num_batched_tokens,
                enable_prefix_caching=config.enable_prefix_caching,
                max_model_len=max_len,
            )
        )
        self.eos_token_ids = frozenset(mc.eos_token_ids) | (
            {self.tokenizer.eos_token_id} if self.tokenizer.eos_token_id is not None else set()
        )
        self.inputs = InputProcessor(self.tokenizer, mc.vocab_size, max_len, self.eos_token_ids)
        self.outputs = OutputProcessor(self.tokenizer)
        self._lock = threading.Lock()
        self._grammars: GrammarCompiler | None = None  # built on the first constrained request
        self._grammars_lock = threading.Lock()
        self._inbox: list[tuple[str, Any]] = []  # ("add", _Request) | ("abort", request_id), in call order
        self._pending_ids: set[str] = set()  # added, not yet applied: catches duplicates across threads
        # Applied and unfinished, touched only by step(): entries leave only in _forget, for the sequences the
        # scheduler reports ended (schedule's out.ended, update_from_output's result, our finish() calls).
        self._requests: dict[str, _Request] = {}
        self._rng = random.Random(config.seed)
        # Overlapped steps (see step()): on unless the config turns them off; CPU default off, so a step's
        # outputs come back from the same step() call there (the tests read it that way).
        self.async_scheduling: bool = (
            config.async_scheduling
            if config.async_scheduling is not None
            else self.runner.device.type == "cuda"
        )
        # Structured output's host work off the engine thread: the matchers advance (on the mask threads, in one
        # call) and the next step's masks fill, both queued on the grammar thread, while this one detokenizes
        # and builds its outputs (H200, 15:31 UTC: advance 4.5 ms + fill 15.5 ms a step at batch 1,024 inline,
        # beside ~14 ms of other engine work, outran the 30.7 ms forward); False: both inline, as before
        # (ops/bench_guided.py --grammar-modes compares them). The grammar thread's Python between llguidance's
        # calls waits for this thread up to sys.getswitchinterval() each time: at Python's 5 ms the grammar work
        # took 12.1 ms of wall a step against 6.2 at the worker's 0.5 ms (H200, 21:08 UTC, BENCHMARKS.md).
        self.grammar_overlap = True
        self._inflight: _Launched | None = None
        self._num_history = 0  # live requests whose penalties or grammar read the output token values
        self._prompt_tokens_total = 0
        self._generation_tokens_total = 0
        self.last_step_tokens = 0  # tokens the latest launched forward carried (warm-up and benches read it)
        self.last_step_mixed = False

    # ---- thread-safe inbox -------------------------------------------------------------------------------
    def add_request(self, request: EngineRequest) -> None:
        """Validates synchronously (EngineRequestError); the request joins the batch at the next step()."""
        seq = self.inputs.process(request)
        grammar = self._grammar_state(seq.request_id, seq.params) if seq.params.guided is not None else None
        state = self.outputs.new_request(seq)
        with self._lock:
            if seq.request_id in self._pending_ids or seq.request_id in self._requests:
                raise EngineRequestError(
                    "invalid_job", f"request_id {seq.request_id!r} is already queued or running"
                )
            params = seq.params
            seed = params.seed if params.seed is not None else self._rng.getrandbits(63)
            self._pending_ids.add(seq.request_id)
            row = SamplingRequest(
                params, seed, seq.prompt_token_ids, seq.output_token_ids, tuple(seq.stop_token_ids), grammar
            )
            self._inbox.append(("add", _Request(state, row)))

    def grammar_compiler(self) -> GrammarCompiler:
        """The model's grammar compiler, built on first use (about 0.5 s for a 128K vocabulary: warm_up calls
        this so that serving does not). GrammarError when llguidance cannot read this tokenizer."""
        with self._grammars_lock:
            if self._grammars is None:
                try:
                    with open(os.path.join(self.config.model_path, "tokenizer.json"), encoding="utf-8") as f:
                        self._grammars = GrammarCompiler(
                            f.read(), self.model_config.vocab_size, sorted(self.eos_token_ids)
                        )
                except (ValueError, RuntimeError, TypeError) as e:
                    raise GrammarError(f"this model's tokenizer cannot be used for structured output: {e}") from e
            return self._grammars

    def grammar_ready(self, request: EngineRequest) -> bool:
        """True when add_request(request) compiles nothing (no response_format, or its grammar is cached), so
        that a caller on an event loop may call it directly; else it runs prepare_grammar on a thread first."""
        guided = request.params.guided
        if guided is None:
            return True
        with self._grammars_lock:
            compiler = self._grammars
        return compiler is not None and compiler.is_cached(guided)

    def prepare_grammar(self, request: EngineRequest) -> None:
        """Compile request's grammar into the cache, on the caller's thread (any thread): EngineRequestError
        `invalid_response_format` when it cannot be compiled."""
        guided = request.params.guided
        if guided is not None:
            with _response_format_errors(request.request_id, guided):
                self.grammar_compiler().prepare(guided)

    def _grammar_state(self, request_id: str, params: SamplingParams) -> GrammarState:
        """Compile (or fetch from the cache) on the caller's thread, never the engine's."""
        assert params.guided is not None
        with _response_format_errors(request_id, params.guided):
            return self.grammar_compiler().new_state(params.guided)

    def abort(self, request_id: str) -> None:
        with self._lock:
            self._inbox.append(("abort", request_id))

    def has_unfinished(self) -> bool:
        with self._lock:
            return bool(self._pending_ids) or self.scheduler.has_unfinished() or self._inflight is not None

    def stats(self) -> EngineStats:
        queried, hits = self.scheduler.prefix_cache_stats
        return EngineStats(
            num_running=self.scheduler.num_running,
            num_waiting=self.scheduler.num_waiting + len(self._pending_ids),
            kv_blocks_total=self.runner.num_blocks,
            kv_blocks_free=self.scheduler.num_free_blocks,
            prefix_cache_queries=queried,
            prefix_cache_hits=hits,
            prompt_tokens_total=self._prompt_tokens_total,
            generation_tokens_total=self._generation_tokens_total,
        )

    @property
    def failure(self) -> str | None:
        """Why the engine cannot go on, known outside its step (a tensor-parallel rank that died, named by the
        ranks' watchdog thread); None while it can. Readable from any thread: the worker's step watchdog asks it
        while a step is stuck (a one-shot all-reduce waiting on the dead rank, which nothing interrupts)."""
        ranks = self.runner.ranks
        return None if ranks is None else ranks.failure

    def close(self) -> None:
        """Free the model's weights and KV cache now (call from the thread that steps it, between steps); the
        engine cannot step after. A worker unloading an idle model (worker/models.py) calls it, and the worker
        on exit (it also stops the tensor-parallel ranks this engine started)."""
        self._inflight = None
        self.runner.close()

    # ---- the loop ----------------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Apply the inbox (adds, aborts) -> schedule -> launch forward + sampling -> report.

        Overlapped (async_scheduling): step N's results are read only after step N+1 was scheduled, prepared
        and launched; N+1 decodes the tokens N sampled straight from N's device tensor (a sampled token sits
        in output_token_ids as PENDING_TOKEN until then). So while the GPU runs N+1 the host appends N's
        tokens, detokenizes, checks stops and builds the outputs; a sequence that turns out to have finished
        in N has its N+1 token discarded. Outputs of a step come back from the next step() call. Requests
        with penalties or a grammar (structured output: step N+1's mask needs N's token in the matcher) need
        N's token values before N+1 samples, not before it runs: while one runs, N+1's forward is launched
        first, then N is finished (tokens to the host, matchers advanced) while that forward runs, then N+1
        samples (_launch). The GPU waits only if finishing N and building N+1's masks outlast the forward."""
        self._apply_inbox()
        self.last_step_tokens, self.last_step_mixed = 0, False
        outputs: list[RequestOutput] = []
        out = self.scheduler.schedule()
        outputs += [self._ended_output(seq) for seq in out.ended]
        prev, self._inflight = self._inflight, None
        launched = None
        if out.chunks:
            launched, prev_outputs = self._launch(out, prev)
            if prev_outputs is not None:  # prev was finished inside (history rows)
                outputs += prev_outputs
                prev = None
        if prev is not None:
            outputs += self._finish_step(prev)
        self._inflight = launched
        if launched is not None and not self.async_scheduling:
            outputs += self._finish_step(launched)
            self._inflight = None
        return outputs

    def _apply_inbox(self) -> None:
        with self._lock:
            inbox, self._inbox = self._inbox, []
            self._pending_ids.clear()
        for kind, item in inbox:
            if kind == "add":
                seq = item.state.seq
                self._requests[seq.request_id] = item
                self.scheduler.add(seq)
                self._prompt_tokens_total += seq.num_prompt_tokens
                self._num_history += _needs_history(seq.params)
            else:
                self.scheduler.abort(item)

    def _launch(self, out: SchedulerOutput, prev: _Launched | None) -> tuple[_Launched, list[RequestOutput] | None]:
        """Forward and sampling of out (prev: the step in flight, whose tokens this forward reads on the device).
        With history rows live, prev is finished between the two -> (this step, prev's outputs); else prev is
        left to the caller -> (this step, None)."""
        now_ms = time.time() * 1000
        self.last_step_tokens = out.num_batched_tokens
        self.last_step_mixed = 0 < out.num_decodes < len(out.chunks)  # decodes and prompt chunks in one forward
        requests = self._requests
        sampling: list[ScheduledChunk] = []
        rows: list[SamplingRequest] = []  # taken now: finishing prev below may forget some of these requests
        for chunk in out.chunks:
            req = requests[chunk.seq.request_id]
            if req.state.first_scheduled_ms is None:
                req.state.first_scheduled_ms = now_ms
            if chunk.samples:
                sampling.append(chunk)
                rows.append(req.row)
        inp = self.runner.prepare(out, *((prev.token_ids, prev.rows) if prev is not None else ()))
        logits = self.runner.forward(inp)
        prev_outputs = None
        if prev is not None and self._num_history:  # while the forward runs, and this step's masks fill meanwhile
            prev_outputs = self._finish_step(prev, (rows, logits.shape[-1]))  # its sequences ended are skipped:
            out.chunks = [c for c in out.chunks if not c.seq.is_finished]  # their rows' tokens are discarded
        token_ids, parts = self._sample(logits, rows)
        self.scheduler.update_from_launch(out)  # after sampling: rows see no placeholder of this step's token
        return _Launched(sampling, {c.seq: i for i, c in enumerate(sampling)}, token_ids, parts), prev_outputs

    def _sample(
        self, logits: Any, rows: list[SamplingRequest]
    ) -> tuple[Any, list[tuple[int, PendingSample | Exception]]]:
        """Sample all rows at once; if that fails, row by row, so one bad request fails alone (its row's
        device token is 0, read by nobody: the request ends when its result is processed)."""
        if not rows:  # a step of prompt chunks none of which reaches its prompt's end (one long chunked prompt)
            return torch.empty(0, dtype=torch.int64, device=logits.device), []
        try:
            pending = self.runner.sample_async(logits, rows)
            return pending.device_token_ids, [(0, pending)]
        except Exception:
            log.exception("batched sampling failed; retrying row by row")
        parts: list[tuple[int, PendingSample | Exception]] = []
        tokens = []
        for i, row in enumerate(rows):
            try:
                pending = self.runner.sample_async(logits[i : i + 1], [row])
                parts.append((i, pending))
                tokens.append(pending.device_token_ids)
            except Exception as e:
                parts.append((i, e))
                tokens.append(torch.zeros(1, dtype=torch.int64, device=logits.device))
        return torch.cat(tokens), parts

    def _finish_step(self, launched: _Launched, upcoming: tuple[list[SamplingRequest], int] | None = None
                     ) -> list[RequestOutput]:
        """Wait for a launched step's sampled tokens (a blocking sync), advance the grammars, detokenize,
        update the scheduler, build the outputs. A request whose sampling, grammar or detokenization failed
        fails alone. upcoming: (the rows the next sampling will take, the logits' width): their grammar masks
        start filling once the grammars have advanced, beside the rest of this (grammar_overlap)."""
        seqs = [c.seq for c in launched.sampling]
        parts = launched.parts
        if not self._num_history and len(parts) == 1 and isinstance(parts[0][1], PendingSample):
            try:
                host = parts[0][1].wait()  # (once: the path below waits on it again for nothing)
                token_ids = host.token_ids.tolist() if host.logprobs is None else None  # None: logprobs asked
            except Exception as e:  # every row fails alone, as below
                parts = [(0, e)]
            else:
                if token_ids is not None:
                    return self._finish_plain(seqs, token_ids)
        results: list[SampleResult] = []
        for k, (first, part) in enumerate(parts):
            end = parts[k + 1][0] if k + 1 < len(parts) else len(seqs)
            try:
                if isinstance(part, Exception):
                    raise part
                results.extend(self.outputs.unpack(part.wait(), seqs[first:end]))
            except Exception as e:  # the rows this part covers fail alone
                results.extend([e] * (end - first))
        sampled: list[SampledToken] = []
        done: list[tuple[_Request, SampleResult, str]] = []
        # ended meanwhile (aborted, past its deadline): its token is discarded
        live = [(self._requests[seq.request_id], result) for seq, result in zip(seqs, results, strict=True)
                if not seq.is_finished]
        advancing = self._advance_grammars(live)  # queued on the grammar thread (grammar_overlap)
        if upcoming is not None and self.grammar_overlap:
            prefetch_grammar_masks(upcoming[0], upcoming[1], self.runner.device)  # queued behind the advance
        texts: list[tuple[str, bool] | Exception | None] = []
        for req, result in live:  # while the grammar thread works
            try:
                texts.append(None if isinstance(result, Exception) else self.outputs.detokenize(req.state, result[0]))
            except Exception as e:
                texts.append(e)
        grammars = self._wait_grammars(advancing, len(live))
        for (req, result), detokenized, complete in zip(live, texts, grammars, strict=True):
            text = ""
            if detokenized is not None:
                try:
                    if isinstance(detokenized, Exception):
                        raise detokenized
                    if isinstance(complete, Exception):
                        raise complete
                    text, stop_string = detokenized
                    # the grammar is complete: end `stop` now
                    sampled.append(SampledToken(req.state.seq, result[0], stop_string or complete is True))  # type: ignore[index]
                except Exception as e:
                    result = e
            done.append((req, result, text))
        self._take_sampled(sampled)
        return [self._output(req, result, text) for req, result, text in done]

    def _finish_plain(self, seqs: list[Sequence], token_ids: list[int]) -> list[RequestOutput]:
        """_finish_step of the common step: one sample for all rows, which none failed, and no row with a grammar,
        penalties or logprobs. The same outcome in one pass over the rows and one over its outputs (at 1,024 rows
        this runs ~250,000 times in W2: the engine thread's largest share of host time after the forward)."""
        requests, detokenize = self._requests, self.outputs.detokenize
        sampled: list[SampledToken] = []
        done: list[tuple[_Request, int | Exception, str]] = []  # (request, its token or why it failed, text)
        finished = SequenceStatus.FINISHED
        for seq, token in zip(seqs, token_ids, strict=True):
            if seq.status is finished:  # ended meanwhile (aborted, past its deadline): its token is discarded
                continue
            req = requests[seq.request_id]
            try:
                text, stop_string = detokenize(req.state, token)
            except Exception as e:  # this request fails alone
                done.append((req, e, ""))
                continue
            sampled.append(SampledToken(seq, token, stop_string))
            done.append((req, token, text))
        self._take_sampled(sampled)
        output_token = self.outputs.output_token
        return [self._output(req, token, "") if isinstance(token, Exception) else output_token(req.state, token, text)
                for req, token, text in done]

    def _take_sampled(self, sampled: list[SampledToken]) -> None:
        """The scheduler takes a step's tokens (stop rule, ends); the sequences it ended are forgotten."""
        self._generation_tokens_total += len(sampled)
        for seq in self.scheduler.update_from_output(sampled):
            self._forget(seq)

    def _advance_grammars(self, live: list[tuple[_Request, SampleResult]]) -> tuple[list[int], Any]:
        """Each constrained row's matcher consumes its sampled token: on the mask threads in one call queued on
        the grammar thread (grammar_overlap: -> (rows, its Future)), else one by one here (-> (rows, outcomes):
        the engine before). _wait_grammars reads either."""
        index = [k for k, (req, result) in enumerate(live)
                 if req.row.grammar is not None and not isinstance(result, Exception)]
        if not index:
            return index, []
        states: list[GrammarState] = [live[k][0].row.grammar for k in index]  # type: ignore[misc]
        tokens = [live[k][1][0] for k in index]  # type: ignore[index]
        if self.grammar_overlap:
            compiler = states[0].compiler  # one per engine
            return index, compiler.submit(compiler.advance_all, states, tokens)
        return index, [_advance_one(state, token) for state, token in zip(states, tokens, strict=True)]

    def _wait_grammars(self, advancing: tuple[list[int], Any], rows: int) -> list[bool | Exception | None]:
        """-> per live row: True when its grammar is complete, False when not, the error when its token broke
        it (that row fails alone), None for a row without a grammar or a token."""
        index, outcomes = advancing
        if not isinstance(outcomes, list):
            try:
                outcomes = outcomes.result()
            except Exception as e:  # the batched call itself failed: every constrained row fails with it
                outcomes = [e] * len(index)
        grammars: list[bool | Exception | None] = [None] * rows
        for k, outcome in zip(index, outcomes, strict=True):
            grammars[k] = outcome
        return grammars

    def _output(self, req: _Request, result: SampleResult, text: str) -> RequestOutput:
        if isinstance(result, Exception):
            rid = req.state.seq.request_id
            if isinstance(result, GrammarTooComplex):  # the job's grammar, not us: a warning and its own code
                log.warning("request %s: %s", rid, result)
                error = ("invalid_response_format", str(result))
            else:
                log.error("request %s failed in sampling/post-processing", rid,
                          exc_info=(type(result), result, result.__traceback__))
                error = ("internal", f"{type(result).__name__}: {result}")
            self.scheduler.finish(req.state.seq, FinishReason.STOP)
            self._forget(req.state.seq)
            return self.outputs.output(req.state, [], "", None, error)
        token, logprob = result
        return self.outputs.output(req.state, [token], text, [logprob] if logprob else None)

    def _ended_output(self, seq: Sequence) -> RequestOutput:
        """A request the scheduler ended without running it this step (cancelled or past its deadline)."""
        state = self._requests[seq.request_id].state
        self._forget(seq)
        return self.outputs.output(state, [], "", None)

    def _forget(self, seq: Sequence) -> None:
        """seq ended (the scheduler freed it): drop the engine's side of it."""
        del self._requests[seq.request_id]
        self.runner.release(seq)
        self._num_history -= _needs_history(seq.params)


def _advance_one(state: GrammarState, token_id: int) -> bool | Exception:
    try:
        return state.advance(token_id)
    except RuntimeError as e:  # GrammarTooComplex included
        return e


def _needs_history(params: SamplingParams) -> bool:
    """Penalties and grammars read the output token values when a step samples: while such a request runs,
    each step finishes the one before between its forward and its sampling (step()); with none running, the
    sampling follows the forward at once."""
    return bool(
        params.presence_penalty
        or params.frequency_penalty
        or params.repetition_penalty != 1
        or params.guided is not None
    )


@contextlib.contextmanager
def _response_format_errors(request_id: str, guided: GuidedDecoding) -> Iterator[None]:
    """A GrammarError becomes the request's `invalid_response_format` error, with the compiler's reason."""
    try:
        yield
    except GrammarError as e:
        raise EngineRequestError(
            "invalid_response_format", f"{request_id}: response_format ({guided.kind}) cannot be compiled: {e}"
        ) from e
