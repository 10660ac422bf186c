"""A stand-in for LLMEngine: the same API (engine/outputs.py), no model, tokens at once and deterministic.

Used by the transport benchmark and the fast worker tests, so the worker's Kafka/Redis plumbing can be
measured and tested without a model. Token i of a request is derived from (request_id, i) by a hash, and
its text is one word per token, so any two runs of the same request produce the same completion.
Priority order, max_tokens, stop strings, deadlines and aborts behave as in the real engine.

Three test hooks (only here, never in the real engine): a prompt containing FAIL_MARKER makes the request
fail alone with error_code "internal" on its first step; `step_delay_s` stretches each step to
stand in for GPU time; `hang_after_steps` makes the step after that many never return, as a hung GPU's
would (the worker's step watchdog, worker.service).
"""

from __future__ import annotations

import heapq
import threading
import time
import zlib
from dataclasses import dataclass, field

from stoker.engine import (
    EngineRequest,
    EngineRequestError,
    EngineStats,
    RequestOutput,
    SamplingParams,
    TokenLogprob,
    TopLogprob,
)

FAIL_MARKER = "__stoker_fail__"
_BLOCK_SIZE = 16


def fake_token_id(request_id: str, index: int, vocab_size: int) -> int:
    return zlib.crc32(f"{request_id}/{index}".encode()) % vocab_size


def fake_token_text(token_id: int) -> str:
    return f" w{token_id}"


def fake_logprob(token_id: int, alternatives: int, vocab_size: int) -> TokenLogprob:
    """A made-up but well-formed entry: the sampled token is the likeliest, then the ids after it, each
    alternative half as likely as the one before (log 0.5 apart), with each token's text."""
    top = [TopLogprob((token_id + k) % vocab_size, -0.5 - 0.6931 * k, fake_token_text((token_id + k) % vocab_size))
           for k in range(alternatives)]
    return TokenLogprob(token_id, -0.5, top, fake_token_text(token_id))


class FakeTokenizer:
    """Whitespace 'tokenizer' with the encode/decode shape of the real one."""

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size

    def encode(self, text: str) -> list[int]:
        return [zlib.crc32(word.encode()) % self.vocab_size for word in text.split()] or [0]

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(fake_token_text(t) for t in token_ids)


@dataclass(slots=True)
class _FakeRequest:
    request_id: str
    num_prompt_tokens: int
    params: SamplingParams
    priority: int
    deadline_ms: float | None
    arrival: int
    fail: bool
    output_token_ids: list[int] = field(default_factory=list)
    text: str = ""
    emitted_text_len: int = 0  # chars of `text` already handed out (stop strings hold text back)
    first_scheduled_ms: float | None = None

    def sort_key(self) -> tuple[int, int]:
        return (self.priority, self.arrival)


class FakeEngine:
    """Same public surface as engine.engine.LLMEngine. add_request/abort are thread-safe; step() runs on
    one thread. max_num_seqs bounds the running batch; the rest wait in priority order."""

    def __init__(
        self,
        model_name: str = "fake",
        *,
        max_model_len: int = 4096,
        max_num_seqs: int = 256,
        num_kv_blocks: int = 16384,
        vocab_size: int = 32000,
        step_delay_s: float = 0.0,
        hang_after_steps: int = 0,
    ):
        if max_num_seqs < 1 or max_model_len < 2 or num_kv_blocks < 1:
            raise ValueError("FakeEngine needs max_num_seqs >= 1, max_model_len >= 2, num_kv_blocks >= 1")
        self.model_name = model_name
        self.max_model_len = max_model_len
        self.max_num_seqs = max_num_seqs
        self.num_kv_blocks = num_kv_blocks
        self.vocab_size = vocab_size
        self.step_delay_s = step_delay_s
        self.hang_after_steps = hang_after_steps
        self.steps = 0
        self.tokenizer = FakeTokenizer(vocab_size)
        self._lock = threading.Lock()
        self._inbox: list[_FakeRequest] = []
        self._aborts: set[str] = set()
        self._waiting: list[tuple[tuple[int, int], _FakeRequest]] = []  # heap by (priority, arrival)
        self._running: dict[str, _FakeRequest] = {}
        self._arrivals = 0
        self._prompt_tokens_total = 0
        self._generation_tokens_total = 0

    # -- thread-safe API --------------------------------------------------------------------------------
    def add_request(self, request: EngineRequest) -> None:
        request_id, prompt, messages, prompt_token_ids = (
            request.request_id, request.prompt, request.messages, request.prompt_token_ids
        )
        params, priority, deadline_ms = request.params, request.priority, request.deadline_ms
        if sum(x is not None for x in (prompt, messages, prompt_token_ids)) != 1:
            raise EngineRequestError("invalid_job", "give exactly one of prompt, messages, prompt_token_ids")
        if prompt is not None:
            num_prompt = len(self.tokenizer.encode(prompt))
        elif messages is not None:
            num_prompt = sum(len(self.tokenizer.encode(str(m.get("content", "")))) + 2 for m in messages)
        else:
            assert prompt_token_ids is not None
            if not prompt_token_ids:
                raise EngineRequestError("invalid_job", "prompt_token_ids is empty")
            bad = [t for t in prompt_token_ids if not 0 <= t < self.vocab_size]
            if bad:
                raise EngineRequestError("invalid_job", f"prompt_token_ids out of [0, {self.vocab_size}): {bad[:5]}")
            num_prompt = len(prompt_token_ids)
        bad_stop = [t for t in params.stop_token_ids if not 0 <= t < self.vocab_size]
        if bad_stop:
            raise EngineRequestError("invalid_job", f"stop_token_ids out of [0, {self.vocab_size}): {bad_stop[:5]}")
        if num_prompt + params.max_tokens > self.max_model_len:
            raise EngineRequestError(
                "context_length_exceeded",
                f"prompt ({num_prompt} tokens) + max_tokens ({params.max_tokens}) exceeds the model's context "
                f"of {self.max_model_len} tokens: shorten the prompt or lower max_tokens",
            )
        fail = prompt is not None and FAIL_MARKER in prompt
        with self._lock:
            self._arrivals += 1
            self._inbox.append(
                _FakeRequest(request_id, num_prompt, params, priority, deadline_ms, self._arrivals, fail)
            )

    def abort(self, request_id: str) -> None:
        with self._lock:
            self._aborts.add(request_id)

    def has_unfinished(self) -> bool:
        with self._lock:
            return bool(self._inbox or self._waiting or self._running or self._aborts)

    def stats(self) -> EngineStats:
        with self._lock:
            used = sum(
                -(-(r.num_prompt_tokens + len(r.output_token_ids)) // _BLOCK_SIZE) for r in self._running.values()
            )
            return EngineStats(
                num_running=len(self._running),
                num_waiting=len(self._waiting) + len(self._inbox),
                kv_blocks_total=self.num_kv_blocks,
                kv_blocks_free=max(0, self.num_kv_blocks - used),
                prefix_cache_queries=self._prompt_tokens_total,
                prefix_cache_hits=0,
                prompt_tokens_total=self._prompt_tokens_total,
                generation_tokens_total=self._generation_tokens_total,
            )

    # -- the loop: apply the inbox and aborts, end expired, admit by priority, one token each ---------------
    def step(self) -> list[RequestOutput]:
        self.steps += 1
        if self.hang_after_steps and self.steps > self.hang_after_steps:
            threading.Event().wait()  # never set: the step never returns (its thread lets go of the GIL)
        if self.step_delay_s:
            time.sleep(self.step_delay_s)
        now_ms = time.time() * 1000
        outputs: list[RequestOutput] = []
        with self._lock:
            inbox, self._inbox = self._inbox, []
            aborts, self._aborts = self._aborts, set()
        for req in inbox:
            heapq.heappush(self._waiting, (req.sort_key(), req))
        # Aborted or expired requests end without running, wherever they are.
        if aborts or any(r.deadline_ms is not None for r in self._running.values()) or self._waiting:
            kept: list[tuple[tuple[int, int], _FakeRequest]] = []
            for key, req in self._waiting:
                reason = self._end_reason(req, aborts, now_ms)
                if reason:
                    outputs.append(self._final(req, reason))
                else:
                    kept.append((key, req))
            if len(kept) != len(self._waiting):
                heapq.heapify(kept)
                self._waiting = kept
            for rid, req in list(self._running.items()):
                reason = self._end_reason(req, aborts, now_ms)
                if reason:
                    del self._running[rid]
                    outputs.append(self._final(req, reason))
        while self._waiting and len(self._running) < self.max_num_seqs:
            _, req = heapq.heappop(self._waiting)
            req.first_scheduled_ms = now_ms
            self._prompt_tokens_total += req.num_prompt_tokens
            self._running[req.request_id] = req
        for rid, req in list(self._running.items()):
            out = self._advance(req)
            if out.finished:
                del self._running[rid]
            outputs.append(out)
        return outputs

    @staticmethod
    def _end_reason(req: _FakeRequest, aborts: set[str], now_ms: float) -> str | None:
        if req.request_id in aborts:
            return "cancelled"
        if req.deadline_ms is not None and now_ms >= req.deadline_ms:
            return "deadline"
        return None

    def _final(self, req: _FakeRequest, reason: str, new_ids: list[int] | None = None) -> RequestOutput:
        delta = req.text[req.emitted_text_len :]  # flush held-back text
        req.emitted_text_len = len(req.text)
        return self._output(req, new_ids or [], delta, True, reason)

    def _output(
        self, req: _FakeRequest, new_ids: list[int], delta: str, finished: bool, reason: str | None
    ) -> RequestOutput:
        return RequestOutput(
            request_id=req.request_id,
            new_token_ids=new_ids,
            text_delta=delta,
            logprobs=[fake_logprob(t, req.params.logprobs, self.vocab_size) for t in new_ids]
            if req.params.logprobs and new_ids else None,
            finished=finished,
            finish_reason=reason,
            prompt_tokens=req.num_prompt_tokens,
            completion_tokens=len(req.output_token_ids),
            cached_tokens=0,
            first_scheduled_ms=req.first_scheduled_ms,
        )

    def _advance(self, req: _FakeRequest) -> RequestOutput:
        if req.fail:
            out = self._output(req, [], "", True, None)
            out.error_code, out.error_message = "internal", "fake engine: this request asked to fail"
            return out
        token = fake_token_id(req.request_id, len(req.output_token_ids), self.vocab_size)
        req.output_token_ids.append(token)
        req.text += fake_token_text(token)
        self._generation_tokens_total += 1
        params = req.params
        for stop in params.stop:
            at = req.text.find(stop)
            if at >= 0 and len(req.output_token_ids) >= params.min_tokens:
                req.text = req.text[: at + len(stop)] if params.include_stop_str_in_output else req.text[:at]
                return self._final(req, "stop", [token])
        if len(req.output_token_ids) >= params.max_tokens:
            return self._final(req, "length", [token])
        # Hold back a tail that could still grow into a stop string (as the real detokenizer does).
        hold = 0
        for stop in params.stop:
            for n in range(min(len(stop) - 1, len(req.text)), 0, -1):
                if req.text.endswith(stop[:n]):
                    hold = max(hold, n)
                    break
        upto = max(req.emitted_text_len, len(req.text) - hold)
        delta = req.text[req.emitted_text_len : upto]
        req.emitted_text_len = upto
        return self._output(req, [token], delta, False, None)
