"""Input processing: an EngineRequest -> a Sequence the scheduler can run (checks, tokenize or render the
chat template, the context limit, the stop token ids). Runs on the caller's thread, inside add_request."""

from __future__ import annotations

from typing import Any

from stoker.engine.outputs import EngineRequestError
from stoker.engine.request import EngineRequest
from stoker.engine.sequence import Sequence
from stoker.engine.tokenizer import Tokenizer


class InputProcessor:
    def __init__(self, tokenizer: Tokenizer, vocab_size: int, max_model_len: int, eos_token_ids: frozenset[int]):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.eos_token_ids = eos_token_ids

    def process(self, request: EngineRequest) -> Sequence:
        """Raises EngineRequestError ("invalid_job", "context_length_exceeded") for a request we cannot run."""
        request_id, params = request.request_id, request.params
        if not isinstance(request_id, str) or not request_id:
            raise EngineRequestError("invalid_job", "request_id must be a non-empty string")
        ids = self._prompt_ids(request)
        self._check_stop_token_ids(request_id, params.stop_token_ids)
        if len(ids) + params.max_tokens > self.max_model_len:
            raise EngineRequestError(
                "context_length_exceeded",
                f"{request_id}: prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) exceeds the "
                f"model's context of {self.max_model_len} tokens; shorten the prompt or lower max_tokens",
            )
        stop_ids = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else self.eos_token_ids)
        return Sequence(
            request_id, ids, params, priority=request.priority, deadline_ms=request.deadline_ms,
            stop_token_ids=stop_ids,
        )

    def _check_stop_token_ids(self, request_id: str, stop_token_ids: tuple[int, ...]) -> None:
        """Beside the prompt id check: the sampler bans these by index until min_tokens, so one past the
        vocabulary would index out of range (on a GPU, a device-side assert that takes the worker down)."""
        vocab = self.vocab_size
        bad = [t for t in stop_token_ids if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab]
        if bad:
            raise EngineRequestError(
                "invalid_job",
                f"{request_id}: stop_token_ids {bad[:5]} are not token ids of this model (0 <= id < {vocab})",
            )

    def _prompt_ids(self, request: EngineRequest) -> list[int]:
        request_id, prompt, messages = request.request_id, request.prompt, request.messages
        given = [
            name
            for name, v in (
                ("prompt", prompt),
                ("messages", messages),
                ("prompt_token_ids", request.prompt_token_ids),
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
            ids = list(request.prompt_token_ids)  # type: ignore[arg-type]
            vocab = self.vocab_size
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
