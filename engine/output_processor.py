"""Output processing: sampled tokens -> RequestOutputs (detokenize with stop strings, logprobs, usage).

The stop strings are found here, before the scheduler applies the stop rule (update_from_output), so that
a stop string wins over max_tokens on the same token; the text is flushed once the scheduler ended the
sequence. Pure Python apart from reading the sampler's host tensors.
"""

from __future__ import annotations

from dataclasses import dataclass

from stoker.engine.detokenizer import Decoder, IncrementalDetokenizer
from stoker.engine.outputs import RequestOutput, TokenLogprob, TopLogprob
from stoker.engine.sampler import SamplerOutput
from stoker.engine.sequence import Sequence, SequenceStatus

FINISHED = SequenceStatus.FINISHED


@dataclass(slots=True)
class RequestState:
    """The output side of one request."""

    seq: Sequence
    detokenizer: IncrementalDetokenizer
    first_scheduled_ms: float | None = None


# One sampled row as the host got it: (token id, its logprob entry when asked for), or why sampling failed.
SampleResult = tuple[int, TokenLogprob | None] | Exception


class OutputProcessor:
    def __init__(self, tokenizer: Decoder):
        self.tokenizer = tokenizer
        # token id -> the token decoded alone, for logprob entries (contract 1.1). Bounded by the vocabulary;
        # filled only by requests that ask for logprobs, so the plain decode path pays nothing.
        self._token_texts: dict[int, str] = {}

    def token_text(self, token_id: int) -> str:
        """One token decoded alone, special tokens included; a partial UTF-8 character shows as U+FFFD."""
        text = self._token_texts.get(token_id)
        if text is None:
            text = self._token_texts[token_id] = self.tokenizer.decode([token_id], skip_special_tokens=False)
        return text

    def new_request(self, seq: Sequence) -> RequestState:
        params = seq.params
        detokenizer = IncrementalDetokenizer(
            self.tokenizer, seq.prompt_token_ids, params.stop, params.include_stop_str_in_output
        )
        return RequestState(seq, detokenizer)

    @staticmethod
    def detokenize(state: RequestState, token_id: int) -> tuple[str, bool]:
        """A new token of a running sequence (before the scheduler fills its placeholder) -> (text delta,
        whether a stop string ended here). Stop strings count only once min_tokens are out."""
        detokenizer, seq = state.detokenizer, state.seq
        # (min_tokens matters only to stop strings: the common request has none, and skips the count)
        past_min = not detokenizer.stop or seq.num_known_output_tokens + 1 >= seq.params.min_tokens
        text = detokenizer.add_token(token_id, past_min)
        return text, detokenizer.stopped

    def unpack(self, out: SamplerOutput, seqs: list[Sequence]) -> list[SampleResult]:
        """The sampler's host tensors -> one result per row (row i is seqs[i])."""
        token_ids = out.token_ids.tolist()
        if out.logprobs is None or out.top_ids is None or out.top_logprobs is None:
            return [(t, None) for t in token_ids]
        lps, top_ids, top_lps = out.logprobs.tolist(), out.top_ids.tolist(), out.top_logprobs.tolist()
        results: list[SampleResult] = []
        for i, (seq, token) in enumerate(zip(seqs, token_ids, strict=True)):
            n = seq.params.logprobs
            if not n:
                results.append((token, None))
                continue
            text = self.token_text
            top = [TopLogprob(t, lp, text(t)) for t, lp in zip(top_ids[i][:n], top_lps[i][:n], strict=True)]
            results.append((token, TokenLogprob(token, lps[i], top, text(token))))
        return results

    @staticmethod
    def output_token(state: RequestState, token_id: int, text: str) -> RequestOutput:
        """output(state, [token_id], text, None) for a request that asked for no logprobs: the common output,
        once per running request per step."""
        seq = state.seq
        if seq.status is not FINISHED:
            return RequestOutput(seq.request_id, [token_id], text, None, False, None, len(seq.prompt_token_ids),
                                 len(seq.output_token_ids) - seq.num_pending, seq.num_cached_tokens,
                                 state.first_scheduled_ms)
        reason = seq.finish_reason
        return RequestOutput(seq.request_id, [token_id], text + state.detokenizer.flush(), None, True,
                             reason.value if reason is not None else None, len(seq.prompt_token_ids),
                             len(seq.output_token_ids) - seq.num_pending, seq.num_cached_tokens,
                             state.first_scheduled_ms)

    @staticmethod
    def output(
        state: RequestState,
        token_ids: list[int],
        text: str,
        logprobs: list[TokenLogprob] | None,
        error: tuple[str, str] | None = None,
    ) -> RequestOutput:
        """The step's output of one request, after the scheduler's update: a finished sequence also gets the
        text its detokenizer held back (a possible stop-string prefix, an unfinished character)."""
        seq = state.seq
        finished = seq.is_finished
        if finished and error is None:
            text += state.detokenizer.flush()
        reason = seq.finish_reason if error is None else None
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
            state.first_scheduled_ms,
            error[0] if error else None,
            error[1] if error else None,
        )
