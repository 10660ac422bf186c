"""OpenAI's request and response shapes <-> Stoker jobs and events: pure functions, no HTTP, no Kafka.

A request body becomes job fields (`job_fields`), or an APIError that says what is wrong; a job's events
become OpenAI's completion and chat-completion objects and SSE chunks (`CompletionShape`, `ChatShape`).

Not supported, answered 400 rather than silently ignored: n > 1, best_of > 1, echo, suffix, logprobs (the
gateway has no tokenizer to render token strings), tools/functions, guided_grammar, logit_bias, non-text content parts. finish_reason passes the contract's `cancelled` and `deadline` through.
"""

from __future__ import annotations

import time
from typing import Any

import msgspec
from stoker.schemas import Done

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


def reject_unsupported(body: dict[str, Any], chat: bool) -> None:
    n = typed(body, "n", int, "an integer")
    if n is not None and n != 1:
        raise APIError(400, "only n=1 is supported: submit several requests instead", param="n", code="unsupported")
    for name in ("tools", "functions", "tool_choice", "function_call", "logit_bias"):
        if body.get(name):
            raise APIError(400, f"`{name}` is not supported by this gateway", param=name, code="unsupported")
    for name in ("guided_grammar", "guided_decoding_backend", "guided_whitespace_pattern"):
        if body.get(name) is not None:
            raise APIError(400, f"`{name}` is not supported: use response_format, guided_json, guided_regex or "
                           "guided_choice", param=name, code="unsupported")
    logprob_fields = ("logprobs", "top_logprobs") if chat else ("logprobs",)
    for name in logprob_fields:
        if body.get(name):  # chat: logprobs=true; completions: logprobs=N > 0
            raise APIError(400, f"`{name}` is not supported: the gateway has no tokenizer to render tokens",
                           param=name, code="unsupported")
    if not chat:
        if body.get("echo"):
            raise APIError(400, "`echo` is not supported", param="echo", code="unsupported")
        if body.get("suffix"):
            raise APIError(400, "`suffix` is not supported", param="suffix", code="unsupported")
        best_of = typed(body, "best_of", int, "an integer")
        if best_of is not None and best_of != 1:
            raise APIError(400, "only best_of=1 is supported", param="best_of", code="unsupported")


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
                              ("priority", integer, "an integer")):
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


def completion_prompt(body: dict[str, Any]) -> dict[str, Any]:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        return {"prompt": prompt}
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return {"prompt_token_ids": prompt}
    raise APIError(400, "`prompt` must be a string, a list of token ids, or a list of one of those "
                   "(batches: send one request each)", param="prompt", code="invalid_value")


def usage(done: Done) -> dict[str, Any]:
    u = done.usage
    return {"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens,
            "total_tokens": u.prompt_tokens + u.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": u.cached_tokens}}


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


def job_fields(body: dict[str, Any], chat: bool) -> tuple[dict[str, Any], bool, bool]:
    """A request body (already a JSON object) -> (job fields but the model, stream?, include usage?)."""
    reject_unsupported(body, chat)
    fields: dict[str, Any] = {"messages": chat_messages(body)} if chat else completion_prompt(body)
    fields.update(sampling(body, default_max_tokens=None if chat else 16))  # OpenAI's legacy default
    constraint = response_format(body)
    if constraint is not None:
        fields.update(response_format=constraint, v=2)
    stream = typed(body, "stream", bool, "a boolean") or False
    opts = body.get("stream_options") or {}
    include_usage = bool(isinstance(opts, dict) and opts.get("include_usage"))
    return fields, stream, include_usage


class Shape:
    object_whole = object_chunk = ""

    def __init__(self, id_: str, model: str):
        self.id, self.model, self.created = id_, model, int(time.time())

    def _base(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def usage_chunk(self, done: Done) -> dict[str, Any]:
        return self._base(self.object_chunk) | {"choices": [], "usage": usage(done)}

    def chunk(self, delta: str | None, finish_reason: str | None, first: bool = False) -> dict[str, Any]:
        raise NotImplementedError

    def whole(self, done: Done) -> dict[str, Any]:
        raise NotImplementedError


class CompletionShape(Shape):
    object_whole = object_chunk = "text_completion"

    def chunk(self, delta: str | None, finish_reason: str | None, first: bool = False) -> dict[str, Any]:
        choice = {"index": 0, "text": delta or "", "logprobs": None, "finish_reason": finish_reason}
        return self._base(self.object_chunk) | {"choices": [choice]}

    def whole(self, done: Done) -> dict[str, Any]:
        choice = {"index": 0, "text": done.text, "logprobs": None, "finish_reason": done.finish_reason}
        return self._base(self.object_whole) | {"choices": [choice], "usage": usage(done)}


class ChatShape(Shape):
    object_whole, object_chunk = "chat.completion", "chat.completion.chunk"

    def chunk(self, delta: str | None, finish_reason: str | None, first: bool = False) -> dict[str, Any]:
        body: dict[str, Any] = {"role": "assistant", "content": ""} if first else {}
        if delta:
            body["content"] = delta
        choice = {"index": 0, "delta": body, "logprobs": None, "finish_reason": finish_reason}
        return self._base(self.object_chunk) | {"choices": [choice]}

    def whole(self, done: Done) -> dict[str, Any]:
        choice = {"index": 0, "message": {"role": "assistant", "content": done.text}, "logprobs": None,
                  "finish_reason": done.finish_reason}
        return self._base(self.object_whole) | {"choices": [choice], "usage": usage(done)}


def shape_for(chat: bool, request_id: str, model: str) -> Shape:
    """The response shape of a job: its OpenAI id is the kind's prefix and the job's request id."""
    return ChatShape(f"chatcmpl-{request_id}", model) if chat else CompletionShape(f"cmpl-{request_id}", model)
