"""The events the worker sends for a request, built from its state and the engine's output (pure: no Kafka,
no Redis; the service encodes them and queues them for the publish script).

Every event carries the request's attempt and its seq within the attempt (the subscriber's rule: keep the
highest attempt, seqs run 0, 1, 2 ... within it). Latencies start at the Kafka record's timestamp.
"""

from __future__ import annotations

from stoker.engine import RequestOutput
from stoker.schemas import Chunk, Done, Error, Timings, TokenLogprob, TopLogprob, Usage
from stoker.worker.requests import Request


def logprobs(out: RequestOutput) -> list[TokenLogprob] | None:
    if not out.logprobs:
        return None
    return [TokenLogprob(token_id=lp.token_id, logprob=lp.logprob, text=lp.text,
                         top=[TopLogprob(token_id=t.token_id, logprob=t.logprob, text=t.text) for t in lp.top])
            for lp in out.logprobs]


def chunk(req: Request, out: RequestOutput) -> Chunk:
    """The step's new tokens and text, at the request's current seq (the caller advances it). Called per token:
    the common case (no logprobs) makes no further call."""
    return Chunk(request_id=req.job.request_id, attempt=req.attempt, seq=req.seq, text=out.text_delta,
                 token_ids=out.new_token_ids, logprobs=logprobs(out) if out.logprobs else None)


def finished(req: Request, out: RequestOutput, step_ms: float, model: str, worker: str) -> Done | Error:
    """The terminal event of a request the engine finished: `error` when the engine failed it, else `done`
    with the whole text (every chunk's text so far, req.text), usage and timings."""
    if out.error_code is not None:
        return Error(request_id=req.request_id, attempt=req.attempt, seq=req.seq, code=out.error_code,
                     message=out.error_message or "the engine failed this request")
    first = req.first_scheduled_ms if req.first_scheduled_ms is not None else step_ms
    return Done(
        request_id=req.request_id, attempt=req.attempt, seq=req.seq,
        finish_reason=out.finish_reason or "stop",  # type: ignore[arg-type]
        text="".join(req.text),
        usage=Usage(prompt_tokens=out.prompt_tokens, completion_tokens=out.completion_tokens,
                    cached_tokens=out.cached_tokens),
        timings=Timings(queue_ms=max(0.0, first - req.record_ms),
                        ttft_ms=max(0.0, (req.first_token_ms or step_ms) - req.record_ms),
                        total_ms=max(0.0, step_ms - req.record_ms)),
        model=model, worker=worker, tenant=req.job.tenant, metadata=req.job.metadata)


def ended_without_running(req: Request, reason: str, now_ms: float, model: str, worker: str) -> Done:
    """`done` for a request answered before the engine saw it (cancelled, past its deadline): no text, no
    tokens; every latency is the time since the record."""
    total = now_ms - req.record_ms
    return Done(request_id=req.request_id, attempt=req.attempt, seq=req.seq,
                finish_reason=reason,  # type: ignore[arg-type]
                text="", usage=Usage(prompt_tokens=0, completion_tokens=0, cached_tokens=0),
                timings=Timings(queue_ms=total, ttft_ms=total, total_ms=total), model=model,
                worker=worker, tenant=req.job.tenant, metadata=req.job.metadata)


def error(req: Request, code: str, message: str) -> Error:
    return Error(request_id=req.request_id, attempt=req.attempt, seq=req.seq, code=str(code), message=message)
