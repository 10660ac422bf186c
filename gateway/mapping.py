"""OpenAI's request and response shapes <-> Stoker jobs and events: pure functions, no HTTP, no Kafka.

A request body becomes job fields (`job_fields`), or an APIError that says what is wrong; a job's events
become OpenAI's completion and chat-completion objects and SSE chunks (`CompletionShape`, `ChatShape`).

A request with `n` choices (and, for /v1/completions, a list of prompts) becomes one job per choice: choice
`index` = prompt number * n + k, as vLLM numbers them. Logprobs are rendered from the events' entries, each of
which carries its token's text (contract 1.1), so the gateway needs no tokenizer.

Every field is either used, one of IGNORED_FIELDS (sent by stock SDKs, changing nothing here), at a value
in NO_OP_VALUES, or answered 400 naming it: nothing is silently dropped. Not supported: best_of > 1, echo,
suffix, tools/functions, logit_bias, guided_grammar, non-text content parts.
finish_reason passes the contract's `cancelled` and `deadline` through.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import msgspec
from stoker.client.client import TextAssembler
from stoker.schemas import Chunk, Done, TokenLogprob

# Contract error codes -> HTTP status: the caller's fault, a missing model, or ours.
STATUS_FOR_CODE = {"invalid_job": 400, "context_length_exceeded": 400, "unsupported_version": 400,
                   "invalid_response_format": 400,
                   "message_too_large": 413, "unknown_model": 404}


class APIError(Exception):
    """Answered as OpenAI's error object: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> dict[str, Any]:
        kind = {400: "invalid_request_error", 404: "invalid_request_error", 413: "invalid_request_error",
                422: "invalid_request_error", 503: "service_unavailable", 504: "timeout"}.get(self.status, "server_error")
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}


def json_object(data: bytes) -> dict[str, Any]:
    """A request body that must be a JSON object (every POST route's), or the 400 that says what it is not."""
    try:
        body = msgspec.json.decode(data)
    except (msgspec.DecodeError, RecursionError) as exc:  # RecursionError: nested past the decoder's limit
        raise APIError(400, f"the body is not valid JSON: {exc}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise APIError(400, "the body must be a JSON object")
    return body



def status_for(code: str) -> int:
    """The HTTP status of a request that failed with this contract error code."""
    return STATUS_FOR_CODE.get(code, 500)


def typed(body: dict[str, Any], name: str, kinds: type | tuple[type, ...], what: str) -> Any:
    """The field's value if present and of the right JSON type (bool is not a number here), else 422."""
    value = body.get(name)
    if value is None:
        return None
    kinds_t = kinds if isinstance(kinds, tuple) else (kinds,)
    if isinstance(value, bool) and bool not in kinds_t or not isinstance(value, kinds_t):
        raise APIError(422, f"`{name}` must be {what}, got {type(value).__name__}", param=name, code="invalid_type")
    return value


MAX_CHOICES = 128  # jobs one request may fan out to (n x prompts): a bound on what one call can queue
MAX_LOGPROBS = 20  # the contract's bound on alternatives per token
# Sent by stock SDKs and frameworks; accepted and ignored because they change nothing here (no stored
# completions, one service tier, no tools to run in parallel; OpenAI's `metadata` is for stored completions).
IGNORED_FIELDS = frozenset({"store", "service_tier", "parallel_tool_calls", "metadata", "prompt_cache_key",
                            "safety_identifier"})
# Fields we do not support, accepted only at the value that asks for nothing.
NO_OP_VALUES: dict[str, tuple[Any, ...]] = {
    "logit_bias": ({},), "tools": ([],), "functions": ([],), "tool_choice": ("none",), "function_call": ("none",),
    "echo": (False,), "suffix": ("",), "best_of": (1,), "modalities": (["text"],),
}
_SAMPLING_FIELDS = frozenset({
    "model", "stream", "stream_options", "n", "max_tokens", "temperature", "top_p", "presence_penalty",
    "frequency_penalty", "seed", "stop", "user", "logprobs", "response_format",
    # vLLM's extra sampling parameters
    "top_k", "min_p", "repetition_penalty", "min_tokens", "ignore_eos", "priority", "stop_token_ids",
    "include_stop_str_in_output",
    # output constraints (OpenAI's response_format above; vLLM's extensions), mapped by response_format()
    "guided_json", "guided_regex", "guided_choice", "structured_outputs",
})
SUPPORTED_FIELDS = {True: _SAMPLING_FIELDS | {"messages", "max_completion_tokens", "top_logprobs"},
                    False: _SAMPLING_FIELDS | {"prompt"}}


def reject_unsupported(body: dict[str, Any], chat: bool) -> None:
    """400 naming the first field this gateway would otherwise drop. null means absent (OpenAI's rule)."""
    supported = SUPPORTED_FIELDS[chat]
    for name, value in body.items():
        if value is None or name in supported or name in IGNORED_FIELDS:
            continue
        if name in NO_OP_VALUES and any(value == v and type(value) is type(v) for v in NO_OP_VALUES[name]):
            continue
        raise APIError(400, f"`{name}` is not supported by this gateway" + (
            f" (only {', '.join(msgspec.json.encode(v).decode() for v in NO_OP_VALUES[name])} is accepted)"
            if name in NO_OP_VALUES else ""), param=name, code="unsupported")


def choices_per_prompt(body: dict[str, Any]) -> int:
    n = typed(body, "n", int, "an integer")
    if n is None:
        return 1
    if not 1 <= n <= MAX_CHOICES:
        raise APIError(400, f"`n` must be in [1, {MAX_CHOICES}], got {n}", param="n", code="invalid_value")
    return int(n)


def logprobs_asked(body: dict[str, Any], chat: bool) -> int | None:
    """Alternatives per token to show, or None when no logprobs are asked. Chat: `logprobs` (bool) with
    `top_logprobs` (0-20); completions: `logprobs` (0-20), as in OpenAI's legacy API."""
    if chat:
        wanted = typed(body, "logprobs", bool, "a boolean")
        top = typed(body, "top_logprobs", int, "an integer")
        if top is not None and not wanted:
            raise APIError(400, "`top_logprobs` needs `logprobs: true`", param="top_logprobs", code="invalid_value")
        name, count = "top_logprobs", (top or 0) if wanted else None
    else:
        name, count = "logprobs", typed(body, "logprobs", int, "an integer")
    if count is not None and not 0 <= count <= MAX_LOGPROBS:
        raise APIError(400, f"`{name}` must be in [0, {MAX_LOGPROBS}], got {count}", param=name,
                       code="invalid_value")
    return count


def sampling(body: dict[str, Any], default_max_tokens: int | None) -> dict[str, Any]:
    """OpenAI (and vLLM's extra) sampling fields -> job fields; ranges are checked by schemas."""
    number, integer = (int, float), int
    out: dict[str, Any] = {}
    max_tokens = typed(body, "max_completion_tokens", integer, "an integer")
    if max_tokens is None:
        max_tokens = typed(body, "max_tokens", integer, "an integer")
    if max_tokens is None:
        max_tokens = default_max_tokens
    if max_tokens is not None:
        out["max_tokens"] = max_tokens
    for name, kinds, what in (("temperature", number, "a number"), ("top_p", number, "a number"),
                              ("presence_penalty", number, "a number"), ("frequency_penalty", number, "a number"),
                              ("seed", integer, "an integer"), ("top_k", integer, "an integer"),
                              ("min_p", number, "a number"), ("repetition_penalty", number, "a number"),
                              ("min_tokens", integer, "an integer"), ("ignore_eos", bool, "a boolean"),
                              ("priority", integer, "an integer"),
                              ("include_stop_str_in_output", bool, "a boolean")):
        value = typed(body, name, kinds, what)
        if value is not None:
            out[name] = value
    stop = body.get("stop")
    if isinstance(stop, str):
        out["stop"] = [stop]
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        out["stop"] = stop
    elif stop is not None:
        raise APIError(422, "`stop` must be a string or a list of strings", param="stop", code="invalid_type")
    stop_ids = typed(body, "stop_token_ids", list, "a list of token ids")
    if stop_ids is not None:
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in stop_ids):
            raise APIError(422, "`stop_token_ids` must be a list of integers", param="stop_token_ids",
                           code="invalid_type")
        out["stop_token_ids"] = stop_ids
    user = body.get("user")
    if isinstance(user, str) and user:
        out["tenant"] = user
    return out


def chat_messages(body: dict[str, Any]) -> list[dict[str, str]]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise APIError(400, "`messages` must be a non-empty list", param="messages", code="invalid_value")
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise APIError(400, f"messages[{i}] must be an object with a `role`", param=f"messages[{i}]")
        role, content = message["role"], message.get("content")
        role = "system" if role == "developer" else role  # OpenAI's newer name for the system role
        if isinstance(content, list):  # content parts: text only (the engine is text-only)
            texts = []
            for part in content:
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise APIError(400, f"messages[{i}]: only text content parts are supported",
                                   param=f"messages[{i}].content", code="unsupported")
                texts.append(part["text"])
            content = "".join(texts)
        if not isinstance(content, str):
            raise APIError(400, f"messages[{i}].content must be a string or text parts",
                           param=f"messages[{i}].content", code="invalid_value")
        out.append({"role": role, "content": content})
    return out


def _one_prompt(prompt: Any) -> dict[str, Any] | None:
    if isinstance(prompt, str):
        return {"prompt": prompt}
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return {"prompt_token_ids": prompt}
    return None


def completion_prompts(body: dict[str, Any]) -> list[dict[str, Any]]:
    """`prompt`: a string, a list of token ids, or a batch (a list of either) -> one prompt field per prompt."""
    prompt = body.get("prompt")
    one = _one_prompt(prompt)
    if one is not None:
        return [one]
    batch = [_one_prompt(p) for p in prompt] if isinstance(prompt, list) and prompt else [None]
    if any(p is None for p in batch):
        raise APIError(400, "`prompt` must be a string, a list of token ids, or a non-empty list of those",
                       param="prompt", code="invalid_value")
    return batch  # type: ignore[return-value]


def sse(payload: dict[str, Any] | str) -> bytes:
    data = payload if isinstance(payload, str) else msgspec.json.encode(payload).decode()
    return f"data: {data}\n\n".encode()


def response_format(body: dict[str, Any]) -> dict[str, Any] | None:
    """OpenAI's `response_format` (json_schema, json_object; text = none) and vLLM's extensions (`guided_json`,
    `guided_regex`, `guided_choice`, or `structured_outputs: {json | regex | choice}`) -> the job's
    `response_format`, or None. At most one of them; the contract checks the shape (a bad one is a 400)."""
    found: list[tuple[str, dict[str, Any]]] = []
    fmt = body.get("response_format")
    if fmt is not None:
        if not isinstance(fmt, dict) or fmt.get("type") not in ("text", "json_object", "json_schema"):
            raise APIError(400, "`response_format` must be {\"type\": \"text\" | \"json_object\" | \"json_schema\"}",
                           param="response_format", code="unsupported")
        if fmt["type"] == "json_schema":
            spec = fmt.get("json_schema")
            if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
                raise APIError(400, "`response_format.json_schema.schema` must be a JSON Schema object",
                               param="response_format", code="invalid_type")
            found.append(("response_format", {"type": "json_schema", "json_schema": {
                k: spec[k] for k in ("name", "schema", "strict") if spec.get(k) is not None}}))
        elif fmt["type"] == "json_object":
            found.append(("response_format", {"type": "json_object"}))
    structured = body.get("structured_outputs")
    if structured is not None and not isinstance(structured, dict):
        raise APIError(422, "`structured_outputs` must be an object", param="structured_outputs", code="invalid_type")
    sources = [(f"guided_{k}", body.get(f"guided_{k}")) for k in ("json", "regex", "choice")]
    sources += [(f"structured_outputs.{k}", (structured or {}).get(k)) for k in ("json", "regex", "choice")]
    for name in ("grammar", "json_object", "structural_tag"):
        if (structured or {}).get(name) is not None:
            raise APIError(400, f"`structured_outputs.{name}` is not supported", param="structured_outputs",
                           code="unsupported")
    for name, value in sources:
        if value is None:
            continue
        if name.endswith("json"):
            try:
                schema = msgspec.json.decode(value) if isinstance(value, str) else value
            except msgspec.DecodeError as exc:
                raise APIError(400, f"`{name}` is not valid JSON: {exc}", param=name, code="invalid_json") from None
            if not isinstance(schema, dict):
                raise APIError(422, f"`{name}` must be a JSON Schema object", param=name, code="invalid_type")
            found.append((name, {"type": "json_schema", "json_schema": {"schema": schema}}))
        elif name.endswith("regex"):
            if not isinstance(value, str):
                raise APIError(422, f"`{name}` must be a string", param=name, code="invalid_type")
            found.append((name, {"type": "regex", "pattern": value}))
        else:
            if not isinstance(value, list) or not all(isinstance(c, str) for c in value):
                raise APIError(422, f"`{name}` must be a list of strings", param=name, code="invalid_type")
            found.append((name, {"type": "choice", "choices": value}))
    if len(found) > 1:
        raise APIError(400, f"give at most one output constraint, got {', '.join(n for n, _ in found)}",
                       param=found[1][0], code="unsupported")
    return found[0][1] if found else None


@dataclass(slots=True)
class Plan:
    """What one OpenAI request asks: the prompt of each group, n choices per group, shared sampling fields."""

    prompts: list[dict[str, Any]]  # {"messages"} | {"prompt"} | {"prompt_token_ids"}, one per prompt
    sampling: dict[str, Any]
    n: int = 1
    stream: bool = False
    include_usage: bool = False
    top_logprobs: int | None = None  # alternatives per token to show; None = no logprobs

    def jobs(self) -> list[dict[str, Any]]:
        """Job fields (but the model) of each choice, in choice-index order: prompt i's k-th is i * n + k."""
        return [prompt | self.sampling for prompt in self.prompts for _ in range(self.n)]


def plan_request(body: dict[str, Any], chat: bool) -> Plan:
    """A request body (already a JSON object) -> its Plan, or an APIError naming what is wrong."""
    reject_unsupported(body, chat)
    prompts = [{"messages": chat_messages(body)}] if chat else completion_prompts(body)
    fields = sampling(body, default_max_tokens=None if chat else 16)  # OpenAI's legacy default
    n = choices_per_prompt(body)
    if n * len(prompts) > MAX_CHOICES:
        raise APIError(400, f"n ({n}) x prompts ({len(prompts)}) is over {MAX_CHOICES} choices: split the request",
                       param="n", code="invalid_value")
    top = logprobs_asked(body, chat)
    if top is not None:
        fields["logprobs"] = max(1, top)  # the job's 0 means none; the sampled token's entry needs >= 1
    constraint = response_format(body)
    if constraint is not None:
        fields.update(response_format=constraint, v=2)
    stream = typed(body, "stream", bool, "a boolean") or False
    opts = body.get("stream_options") or {}
    include_usage = bool(isinstance(opts, dict) and opts.get("include_usage"))
    return Plan(prompts, fields, n, stream, include_usage, top)


class LogprobAssembler:
    """A choice's logprob entries, shown once across takeovers, as TextAssembler does for text: a new
    attempt's entries are shown only past the number already shown."""

    def __init__(self) -> None:
        self.shown = 0
        self._attempt = 0
        self.entries: list[TokenLogprob] = []  # the latest attempt's, in order

    def feed(self, chunk: Chunk) -> list[TokenLogprob]:
        if chunk.attempt != self._attempt:
            self._attempt, self.entries = chunk.attempt, []
        self.entries += chunk.logprobs or []
        new = self.entries[self.shown:]
        self.shown += len(new)
        return new


@dataclass(slots=True)
class Choice:
    """One choice of a response as its events arrive (streaming), or once its done event is in."""

    index: int
    text: TextAssembler = field(default_factory=TextAssembler)
    logprobs: LogprobAssembler = field(default_factory=LogprobAssembler)
    text_offset: int = 0  # completions' logprobs: characters of token text before the next entry
    done: Done | None = None


def token_text(entry: Any) -> str:
    """The token's text; from a worker older than contract 1.1 (no `text`), vLLM's `token_id:N` form."""
    return entry.text if entry.text is not None else f"token_id:{entry.token_id}"


def chat_logprobs(entries: list[TokenLogprob], top: int) -> dict[str, Any]:
    """OpenAI's chat `logprobs`: {"content": [{token, logprob, bytes, top_logprobs: [...]}, ...]}."""
    def one(entry: Any) -> dict[str, Any]:
        text = token_text(entry)
        return {"token": text, "logprob": entry.logprob, "bytes": list(text.encode())}

    return {"content": [one(e) | {"top_logprobs": [one(t) for t in e.top[:top]]} for e in entries],
            "refusal": None}


def completion_logprobs(entries: list[TokenLogprob], top: int, choice: Choice) -> dict[str, Any]:
    """OpenAI's legacy completions `logprobs`: parallel lists, and per token a {text: logprob} of the top
    alternatives plus the sampled token (as vLLM does). text_offset runs on across a stream's chunks."""
    tokens, offsets, tops = [], [], []
    for entry in entries:
        text = token_text(entry)
        tokens.append(text)
        offsets.append(choice.text_offset)
        choice.text_offset += len(text)
        alternatives = {token_text(t): t.logprob for t in entry.top[:top]}
        alternatives.setdefault(text, entry.logprob)
        tops.append(alternatives)
    return {"tokens": tokens, "token_logprobs": [e.logprob for e in entries], "top_logprobs": tops,
            "text_offset": offsets}


def total_usage(dones: list[Done], n: int) -> dict[str, Any]:
    """Usage of a request's choices: completion tokens of all; prompt (and cached) tokens once per prompt,
    though each of its n jobs read it."""
    firsts = dones[::n]
    prompt = sum(d.usage.prompt_tokens for d in firsts)
    completion = sum(d.usage.completion_tokens for d in dones)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": sum(d.usage.cached_tokens for d in firsts)}}


class Shape:
    """The response objects of one request: whole (not streaming) or chunk by chunk, for every choice."""

    object_whole = object_chunk = ""

    def __init__(self, id_: str, model: str, top_logprobs: int | None = None):
        self.id, self.model, self.created = id_, model, int(time.time())
        self.top_logprobs = top_logprobs

    def _base(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def _text(self, text: str | None, first: bool, whole: bool) -> dict[str, Any]:
        raise NotImplementedError

    def _logprobs(self, entries: list[TokenLogprob], choice: Choice) -> dict[str, Any]:
        raise NotImplementedError

    def usage_chunk(self, usage: dict[str, Any]) -> dict[str, Any]:
        return self._base(self.object_chunk) | {"choices": [], "usage": usage}

    def chunk(self, choice: Choice, delta: str | None, finish_reason: str | None, first: bool = False,
              entries: list[TokenLogprob] | None = None) -> dict[str, Any]:
        logprobs = self._logprobs(entries, choice) if self.top_logprobs is not None and entries else None
        return self._base(self.object_chunk) | {"choices": [
            {"index": choice.index, **self._text(delta, first, False), "logprobs": logprobs,
             "finish_reason": finish_reason}]}

    def whole(self, choices: list[Choice], n: int = 1) -> dict[str, Any]:
        out, dones = [], []
        for choice in choices:
            done = choice.done
            assert done is not None, "whole() takes finished choices"
            logprobs = self._logprobs(choice.logprobs.entries, choice) if self.top_logprobs is not None else None
            out.append({"index": choice.index, **self._text(done.text, False, True), "logprobs": logprobs,
                        "finish_reason": done.finish_reason})
            dones.append(done)
        return self._base(self.object_whole) | {"choices": out, "usage": total_usage(dones, n)}


class CompletionShape(Shape):
    object_whole = object_chunk = "text_completion"

    def _text(self, text: str | None, first: bool, whole: bool) -> dict[str, Any]:
        return {"text": text or ""}

    def _logprobs(self, entries: list[TokenLogprob], choice: Choice) -> dict[str, Any]:
        return completion_logprobs(entries, self.top_logprobs or 0, choice)


class ChatShape(Shape):
    object_whole, object_chunk = "chat.completion", "chat.completion.chunk"

    def _text(self, text: str | None, first: bool, whole: bool) -> dict[str, Any]:
        if whole:
            return {"message": {"role": "assistant", "content": text}}
        delta: dict[str, Any] = {"role": "assistant", "content": ""} if first else {}
        if text:
            delta["content"] = text
        return {"delta": delta}

    def _logprobs(self, entries: list[TokenLogprob], choice: Choice) -> dict[str, Any]:
        return chat_logprobs(entries, self.top_logprobs or 0)


def shape_for(chat: bool, request_id: str, model: str, top_logprobs: int | None = None) -> Shape:
    """The response shape of a request: its OpenAI id is the kind's prefix and its first job's request id."""
    cls, prefix = (ChatShape, "chatcmpl") if chat else (CompletionShape, "cmpl")
    return cls(f"{prefix}-{request_id}", model, top_logprobs)
