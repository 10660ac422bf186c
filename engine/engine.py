"""LLMEngine: the API the worker drives (see engine/outputs.py for the contract)."""

from __future__ import annotations

import logging
import random
import threading
import time
from dataclasses import dataclass
from typing import Any

import torch

from engine.config import EngineConfig
from engine.detokenizer import IncrementalDetokenizer
from engine.model_config import ModelConfig
from engine.model_runner import ModelRunner, PendingSample
from engine.outputs import EngineRequestError, EngineStats, RequestOutput, TokenLogprob, TopLogprob
from engine.sampler import SamplerOutput, SamplingRequest
from engine.scheduler import ScheduledChunk, Scheduler, SchedulerConfig, SchedulerOutput
from engine.sequence import PENDING_TOKEN, FinishReason, SamplingParams, Sequence
from engine.tokenizer import Tokenizer

log = logging.getLogger(__name__)


@dataclass(slots=True)
class _Request:
    seq: Sequence
    seed: int  # the request's seed, or one drawn at add time: seeded and unseeded draw the same way
    stop_ids: frozenset[int]  # eos (unless ignore_eos) and stop_token_ids
    detokenizer: IncrementalDetokenizer
    row: SamplingRequest  # refers to the sequence's own token lists, so it is built once per request
    first_scheduled_ms: float | None = None


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
        self.model_config = ModelConfig.from_folder(config.model_path)
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
        self.runner = ModelRunner(config, mc, max_len)
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
            )
        )
        self.eos_token_ids = frozenset(mc.eos_token_ids) | (
            {self.tokenizer.eos_token_id} if self.tokenizer.eos_token_id is not None else set()
        )
        self._lock = threading.Lock()
        self._inbox: list[tuple[str, Any]] = []  # ("add", _Request) | ("abort", request_id), in call order
        self._pending_ids: set[str] = set()  # added, not yet applied: catches duplicates across threads
        self._requests: dict[str, _Request] = {}  # applied and unfinished; touched only by step()
        self._rng = random.Random(config.seed)
        # Overlapped steps (see step()): on unless the config turns them off; CPU default off, so a step's
        # outputs come back from the same step() call there (the tests read it that way).
        self.async_scheduling: bool = (
            config.async_scheduling
            if config.async_scheduling is not None
            else self.runner.device.type == "cuda"
        )
        self._inflight: _Launched | None = None
        self._prefix_caching = config.enable_prefix_caching
        self._num_history = 0  # live requests whose penalties read the output token values
        self._prompt_tokens_total = 0
        self._generation_tokens_total = 0

    # ---- thread-safe inbox -------------------------------------------------------------------------------
    def add_request(
        self,
        request_id: str,
        *,
        prompt: str | None = None,
        messages: list[dict[str, Any]] | None = None,
        prompt_token_ids: list[int] | None = None,
        params: SamplingParams | None = None,
        priority: int = 0,
        deadline_ms: float | None = None,
    ) -> None:
        params = params if params is not None else SamplingParams()
        if not isinstance(request_id, str) or not request_id:
            raise EngineRequestError("invalid_job", "request_id must be a non-empty string")
        ids = self._prompt_ids(request_id, prompt, messages, prompt_token_ids)
        if len(ids) + params.max_tokens > self.max_model_len:
            raise EngineRequestError(
                "context_length_exceeded",
                f"{request_id}: prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) exceeds the "
                f"model's context of {self.max_model_len} tokens; shorten the prompt or lower max_tokens",
            )
        stop_ids = frozenset(params.stop_token_ids) | (
            frozenset() if params.ignore_eos else self.eos_token_ids
        )
        seq = Sequence(request_id, ids, params, priority=priority, deadline_ms=deadline_ms)
        detok = IncrementalDetokenizer(self.tokenizer, ids, params.stop, params.include_stop_str_in_output)
        with self._lock:
            if request_id in self._pending_ids or request_id in self._requests:
                raise EngineRequestError(
                    "invalid_job", f"request_id {request_id!r} is already queued or running"
                )
            seed = params.seed if params.seed is not None else self._rng.getrandbits(63)
            self._pending_ids.add(request_id)
            row = SamplingRequest(params, seed, seq.prompt_token_ids, seq.output_token_ids, tuple(stop_ids))
            self._inbox.append(("add", _Request(seq, seed, stop_ids, detok, row)))

    def _prompt_ids(
        self,
        request_id: str,
        prompt: str | None,
        messages: list[dict[str, Any]] | None,
        prompt_token_ids: list[int] | None,
    ) -> list[int]:
        given = [
            name
            for name, v in (
                ("prompt", prompt),
                ("messages", messages),
                ("prompt_token_ids", prompt_token_ids),
            )
            if v is not None
        ]
        if len(given) != 1:
            raise EngineRequestError(
                "invalid_job",
                f"{request_id}: give exactly one of prompt, messages, "
                f"prompt_token_ids (got {', '.join(given) or 'none'})",
            )
        if prompt is not None:
            if not isinstance(prompt, str):
                raise EngineRequestError("invalid_job", f"{request_id}: prompt must be a string")
            ids = self.tokenizer.encode(prompt) if prompt else []
        elif messages is not None:
            if (
                not isinstance(messages, list)
                or not all(
                    isinstance(m, dict) and isinstance(m.get("role"), str) and "content" in m
                    for m in messages
                )
                or not messages
            ):
                raise EngineRequestError(
                    "invalid_job",
                    f"{request_id}: messages must be a non-empty list of {{role, content}} objects",
                )
            try:
                ids = self.tokenizer.encode_chat(messages)
            except Exception as e:  # a template's raise_exception or a jinja error: the request's fault
                raise EngineRequestError(
                    "invalid_job", f"{request_id}: cannot render the chat template: {e}"
                ) from e
        else:
            ids = list(prompt_token_ids)  # type: ignore[arg-type]
            vocab = self.model_config.vocab_size
            # Fast path in C (map/set/min/max): a 1024 x 512 batch of ids costs ~10 ms here, not ~0.3 s of a
            # per-id Python loop. Anything but plain ints (bool, an int subclass, numpy ints) takes the slow path.
            if ids and set(map(type, ids)) == {int} and min(ids) >= 0 and max(ids) < vocab:
                bad: list[Any] = []
            else:  # find what is wrong, for the message (the empty prompt is reported below)
                bad = [t for t in ids if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab]
            if bad:
                raise EngineRequestError(
                    "invalid_job",
                    f"{request_id}: prompt_token_ids {bad[:5]} are not "
                    f"token ids of this model (0 <= id < {vocab})",
                )
        if not ids:
            raise EngineRequestError(
                "invalid_job", f"{request_id}: the prompt is empty; give at least one token"
            )
        return ids

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

    # ---- the loop ----------------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Apply the inbox (adds, aborts) -> schedule -> launch forward + sampling -> report.

        Overlapped (async_scheduling): step N's results are read only after step N+1 was scheduled, prepared
        and launched; N+1 decodes the tokens N sampled straight from N's device tensor (a sampled token sits
        in output_token_ids as PENDING_TOKEN until then). So while the GPU runs N+1 the host appends N's
        tokens, detokenizes, checks stops and builds the outputs; a sequence that turns out to have finished
        in N has its N+1 token discarded. Outputs of a step come back from the next step() call. Requests
        with penalties need the token values on the host, so while one runs the engine steps synchronously."""
        self._apply_inbox()
        outputs: list[RequestOutput] = []
        if self._inflight is not None and self._num_history:
            outputs += self._finish_step(self._inflight)
            self._inflight = None
        out = self.scheduler.schedule()
        outputs += [self._ended_output(seq.request_id) for seq in out.ended]
        launched = self._launch(out) if out.chunks else None
        if self._inflight is not None:
            outputs += self._finish_step(self._inflight)
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
                self._requests[item.seq.request_id] = item
                self.scheduler.add(item.seq)
                self._prompt_tokens_total += item.seq.num_prompt_tokens
                self._num_history += _needs_history(item.seq.params)
            else:
                self.scheduler.abort(item)

    def _launch(self, out: SchedulerOutput) -> _Launched:
        now_ms = time.time() * 1000
        requests = self._requests
        sampling: list[ScheduledChunk] = []
        for chunk in out.chunks:
            req = requests[chunk.seq.request_id]
            if req.first_scheduled_ms is None:
                req.first_scheduled_ms = now_ms
            if chunk.samples:
                sampling.append(chunk)
        prev = self._inflight
        inp = self.runner.prepare(out, *((prev.token_ids, prev.rows) if prev is not None else ()))
        logits = self.runner.forward(inp)
        token_ids, parts = self._sample(logits, [requests[c.seq.request_id].row for c in sampling])
        self.scheduler.postprocess(out)
        for chunk in sampling:
            chunk.seq.output_token_ids.append(PENDING_TOKEN)
            chunk.seq.num_pending += 1
        return _Launched(sampling, {c.seq: i for i, c in enumerate(sampling)}, token_ids, parts)

    def _sample(
        self, logits: Any, rows: list[SamplingRequest]
    ) -> tuple[Any, list[tuple[int, PendingSample | Exception]]]:
        """Sample all rows at once; if that fails, row by row, so one bad request fails alone (its row's
        device token is 0, read by nobody: the request ends when its result is processed)."""
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

    def _finish_step(self, launched: _Launched) -> list[RequestOutput]:
        """Wait for a launched step's sampled tokens (a blocking sync) and process them."""
        results: list[tuple[int, TokenLogprob | None] | Exception] = []
        parts, sampling = launched.parts, launched.sampling
        for k, (first, part) in enumerate(parts):
            end = parts[k + 1][0] if k + 1 < len(parts) else len(sampling)
            try:
                if isinstance(part, Exception):
                    raise part
                results.extend(self._unpack(part.wait(), sampling[first:end]))
            except Exception as e:  # the rows this part covers fail alone
                results.extend([e] * (end - first))
        outputs: list[RequestOutput] = []
        requests = self._requests
        for chunk, result in zip(launched.sampling, results, strict=True):
            req = requests.get(chunk.seq.request_id)
            if req is None or req.seq is not chunk.seq:
                continue  # ended meanwhile (aborted, past its deadline): its token is discarded
            outputs.append(self._process(req, result))
        return outputs

    @staticmethod
    def _unpack(
        out: SamplerOutput, chunks: list[ScheduledChunk]
    ) -> list[tuple[int, TokenLogprob | None] | Exception]:
        token_ids = out.token_ids.tolist()
        if out.logprobs is None or out.top_ids is None or out.top_logprobs is None:
            return [(t, None) for t in token_ids]
        lps, top_ids, top_lps = out.logprobs.tolist(), out.top_ids.tolist(), out.top_logprobs.tolist()
        results: list[tuple[int, TokenLogprob | None] | Exception] = []
        for i, (chunk, token) in enumerate(zip(chunks, token_ids, strict=True)):
            n = chunk.seq.params.logprobs
            top = [TopLogprob(t, lp) for t, lp in zip(top_ids[i][:n], top_lps[i][:n], strict=True)]
            results.append((token, TokenLogprob(token, lps[i], top) if n else None))
        return results

    def _process(self, req: _Request, result: tuple[int, TokenLogprob | None] | Exception) -> RequestOutput:
        try:
            if isinstance(result, Exception):
                raise result
            return self._append(req, *result)
        except Exception as e:
            log.exception("request %s failed in sampling/post-processing", req.seq.request_id)
            self._retire(req, FinishReason.STOP)
            return self._output(
                req, [], "", None, finished=True, reason=None, error=("internal", f"{type(e).__name__}: {e}")
            )

    def _append(self, req: _Request, token: int, logprob: TokenLogprob | None) -> RequestOutput:
        seq, params = req.seq, req.seq.params
        # The oldest pending placeholder is this token's (a newer one may belong to the step in flight).
        outs = seq.output_token_ids
        num_outputs = len(outs) - seq.num_pending + 1
        outs[num_outputs - 1] = token
        seq.num_pending -= 1
        self._generation_tokens_total += 1
        past_min = num_outputs >= params.min_tokens
        text = req.detokenizer.add_token(token, past_min)
        reason: FinishReason | None = None
        if req.detokenizer.stopped or (token in req.stop_ids and past_min):
            reason = FinishReason.STOP
        elif (
            num_outputs >= params.max_tokens or len(seq.prompt_token_ids) + num_outputs >= self.max_model_len
        ):
            reason = FinishReason.LENGTH
        if reason is not None:
            text += req.detokenizer.flush()
            self._retire(req, reason)
        elif self._prefix_caching:  # blocks holding this token may now be hashed
            self.scheduler.tokens_known(seq)
        return self._output(req, [token], text, [logprob] if logprob else None, reason is not None, reason)

    def _retire(self, req: _Request, reason: FinishReason) -> None:
        """End a request the engine decided to stop: drop a token sampled past the end, free its blocks."""
        seq = req.seq
        _drop_pending(seq)
        self.scheduler.finish(seq, reason)
        self._forget(req)

    def _forget(self, req: _Request) -> None:
        del self._requests[req.seq.request_id]
        self.runner.release(req.seq)
        self._num_history -= _needs_history(req.seq.params)

    def _ended_output(self, request_id: str) -> RequestOutput:
        """A request the scheduler ended without running it this step (cancelled or past its deadline)."""
        req = self._requests[request_id]
        _drop_pending(req.seq)
        self._forget(req)
        return self._output(req, [], req.detokenizer.flush(), None, True, req.seq.finish_reason)

    @staticmethod
    def _output(
        req: _Request,
        token_ids: list[int],
        text: str,
        logprobs: list[TokenLogprob] | None,
        finished: bool,
        reason: FinishReason | None,
        error: tuple[str, str] | None = None,
    ) -> RequestOutput:
        seq = req.seq
        # Positional (the field order of RequestOutput): this runs once per request per step.
        return RequestOutput(
            seq.request_id,
            token_ids,
            text,
            logprobs if seq.params.logprobs else None,
            finished,
            reason.value if reason is not None else None,
            len(seq.prompt_token_ids),
            len(seq.output_token_ids) - seq.num_pending,
            seq.num_cached_tokens,
            req.first_scheduled_ms,
            error[0] if error else None,
            error[1] if error else None,
        )


def _needs_history(params: SamplingParams) -> bool:
    """Penalties read the output token values, which overlapped steps do not have on the host in time."""
    return bool(params.presence_penalty or params.frequency_penalty or params.repetition_penalty != 1)


def _drop_pending(seq: Sequence) -> None:
    if seq.num_pending:
        del seq.output_token_ids[-seq.num_pending :]
        seq.num_pending = 0
