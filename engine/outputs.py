"""What the engine hands back each step, and the error it raises for a request it cannot take.

A stable interface: the worker (and its stand-in engine, worker/fake_engine.py) relies on it.
Pure Python, no torch.

The engine API (`from stoker.engine import ...`: LLMEngine, EngineConfig, EngineRequest, SamplingParams and the
types below) that the worker drives:
    engine = LLMEngine(EngineConfig(model_path=..., ...))       # loads the model folder
    engine.model_name: str; engine.max_model_len: int; engine.tokenizer (encode/decode/chat template)
    engine.add_request(EngineRequest(request_id, prompt=... | messages=... | prompt_token_ids=...,
                                     params=SamplingParams(...), priority=0, deadline_ms=None)) -> None
        thread-safe; validates synchronously and raises EngineRequestError (codes below);
        the request joins the batch at the next step().
    engine.abort(request_id) -> None          thread-safe; ends it (CANCELLED) at the next step()
    engine.step() -> list[RequestOutput]      one scheduling + forward + sampling step; call from ONE thread
    engine.has_unfinished() -> bool
    engine.stats() -> EngineStats
"""

from __future__ import annotations

from dataclasses import dataclass, field


class EngineRequestError(ValueError):
    """A request the engine refuses. `code` is the wire contract's stable error code."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code  # "context_length_exceeded" | "invalid_job" | "internal" ...
        self.message = message


@dataclass(slots=True)
class TopLogprob:
    token_id: int
    logprob: float
    text: str = ""  # the token decoded alone (a partial UTF-8 character shows as U+FFFD)


@dataclass(slots=True)
class TokenLogprob:
    """The sampled token's logprob and the top-N alternatives, from the distribution before temperature and
    penalties; finite (floored at -9999.0)."""

    token_id: int
    logprob: float
    top: list[TopLogprob] = field(default_factory=list)
    text: str = ""  # the token decoded alone, as in TopLogprob


@dataclass(slots=True)
class RequestOutput:
    """What one request gained in one step. A request appears in a step's outputs when it produced tokens,
    text, or finished."""

    request_id: str
    new_token_ids: list[int]
    text_delta: str  # never a broken UTF-8 character, never a partial stop string
    logprobs: list[TokenLogprob] | None  # one per new token when the request asked for logprobs
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "cancelled" | "deadline" when finished
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int  # prompt tokens served from the prefix cache
    first_scheduled_ms: float | None = None  # epoch ms of the first step that ran it (for queue_ms)
    # Set when the engine failed this request alone (finished=True, finish_reason=None).
    error_code: str | None = None
    error_message: str | None = None


@dataclass(slots=True)
class EngineStats:
    num_running: int
    num_waiting: int
    kv_blocks_total: int
    kv_blocks_free: int
    prefix_cache_queries: int  # prompt tokens looked up
    prefix_cache_hits: int  # of which found cached
    prompt_tokens_total: int
    generation_tokens_total: int

    @property
    def kv_usage(self) -> float:
        return 1.0 - self.kv_blocks_free / max(1, self.kv_blocks_total)
