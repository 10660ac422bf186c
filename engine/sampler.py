"""Batched sampling on the device: penalties, min_tokens, temperature, top-k/top-p/min-p, seeded draws, logprobs.

No per-request Python loop touches the vocabulary: per-row settings are [N] tensors, and the few [N, V]
masks (token counts, banned ids) are built with one scatter each. The random draw is a Gumbel-max race
whose noise is a counter-based hash of (seed, output position, vocab index): a seeded request draws the
same tokens whatever else is in the batch, on any device, with no generator state to carry.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from stoker.engine.grammar import GrammarState
from stoker.engine.kernels.token_bitmask import apply_token_bitmask
from stoker.engine.sampling_params import SamplingParams

LOGPROB_FLOOR = -9999.0
_M32 = 0xFFFFFFFF


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (two xor-shift-multiply rounds) on int64 holding values in [0, 2^32).
    The multiplier is < 2^28, so products stay below 2^60: no signed overflow on any device."""
    x = ((x >> 16) ^ x) * 0x45D9F3B & _M32
    x = ((x >> 16) ^ x) * 0x45D9F3B & _M32
    return (x >> 16) ^ x


def uniform_noise(seeds: torch.Tensor, positions: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[N] int64 seeds (< 2^63) and output positions -> [N, V] float32 uniforms in (0, 1), a pure function of
    (seed, position, vocab index)."""
    key = _mix32((seeds & _M32) ^ 0x2545F491)
    key = _mix32(key ^ (seeds >> 32))
    key = _mix32(key ^ (positions & _M32))
    index = torch.arange(vocab_size, device=seeds.device, dtype=torch.int64)
    h = _mix32(_mix32((key[:, None] + index[None, :] * 0x9E3779B1) & _M32))
    return unit_float(h)


def unit_float(h: torch.Tensor) -> torch.Tensor:
    """32-bit hashes (int64 holding 0..2^32-1) -> float32 in (0, 1): the top 23 bits, + 0.5, / 2^23.

    23 bits, not 24: (2^24 - 1) + 0.5 needs 25 bits and rounds to 2^24 in float32, so 24 bits gave exactly 1.0
    for one hash in 2^24; its Gumbel noise was +inf, and on a masked or banned token (-inf) the sum was NaN,
    which argmax takes: about one sampled row-step in 250 at a 66K vocabulary picked a token whatever its
    probability, masked ones included (constrained requests broke their grammar: 7 of 64 within 40 tokens)."""
    return ((h >> 9).to(torch.float32) + 0.5) * (1.0 / (1 << 23))


@dataclass(slots=True)
class SamplingRequest:
    """One row to sample: the request's settings and the token history the penalties need."""

    params: SamplingParams
    seed: int  # resolved: the request's seed, or one drawn at add time
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    stop_ids: tuple[int, ...]  # eos (unless ignore_eos) + stop_token_ids: banned until min_tokens
    grammar: GrammarState | None = None  # structured output: its matcher masks this row's logits


@dataclass(slots=True)
class SamplingBatch:
    """Per-row settings as device tensors, plus host-side flags that let the sampler skip unused stages.
    Tensors a batch's stages never read are None: an all-greedy batch has no temperature..positions, a batch
    without penalties no presence/frequency/repetition (building them costs host time every step)."""

    temperature: torch.Tensor | None  # [N] float32, 0 = greedy
    top_k: torch.Tensor | None  # [N] int64, vocab_size when off
    top_p: torch.Tensor | None  # [N] float32
    min_p: torch.Tensor | None  # [N] float32
    seeds: torch.Tensor | None  # [N] int64
    positions: torch.Tensor | None  # [N] int64: index of the token being drawn among the outputs
    presence: torch.Tensor | None  # [N] float32
    frequency: torch.Tensor | None  # [N] float32
    repetition: torch.Tensor | None  # [N] float32
    output_counts: torch.Tensor | None  # [N, V] float32 counts of output tokens (when a penalty is on)
    prompt_mask: torch.Tensor | None  # [N, V] bool: token in the prompt (when repetition_penalty != 1)
    banned: torch.Tensor | None  # [N, V] bool: stop ids masked until min_tokens
    grammar_rows: torch.Tensor | None  # [R] int64: the rows with a grammar (None when none or all have one)
    grammar_bitmask: torch.Tensor | None  # [R, ceil(V/32)] int32 packed allowed tokens of those rows (None: none)
    num_logprobs: int  # max top-N asked in the batch; 0 = skip
    all_greedy: bool
    any_top_k: bool
    any_top_p: bool
    any_min_p: bool

    @classmethod
    def build(cls, rows: list[SamplingRequest], vocab_size: int, device: torch.device | str) -> SamplingBatch:
        ps = [r.params for r in rows]
        cuda = torch.device(device).type == "cuda"

        def columns(values: list[tuple], dtype: torch.dtype) -> list[torch.Tensor]:
            # One host tensor and one copy for several per-row settings; the columns are device views.
            host = torch.tensor(values, dtype=dtype).T.contiguous()
            if cuda:  # pinned: the copy is truly async, no stream sync
                host = host.pin_memory()
            return list(host.to(device, non_blocking=True).unbind(0))

        def id_mask(id_lists: list[list[int]], counts: bool) -> torch.Tensor:
            # Pad with an extra column V that is dropped after the scatter.
            width = max(1, max(len(ids) for ids in id_lists))
            padded = torch.full((len(id_lists), width), vocab_size, dtype=torch.int64)
            for i, ids in enumerate(id_lists):
                padded[i, : len(ids)] = torch.tensor(ids, dtype=torch.int64)
            if cuda:  # pageable memory would make this copy wait on the host
                padded = padded.pin_memory()
            padded = padded.to(device, non_blocking=True)
            out = torch.zeros(len(id_lists), vocab_size + 1, dtype=torch.float32, device=device)
            out.scatter_add_(1, padded, torch.ones_like(padded, dtype=torch.float32))
            return out[:, :vocab_size] if counts else out[:, :vocab_size] > 0

        want_counts = any(p.presence_penalty or p.frequency_penalty or p.repetition_penalty != 1 for p in ps)
        want_prompt = any(p.repetition_penalty != 1 for p in ps)
        all_greedy = all(p.temperature == 0 for p in ps)
        bans = [list(r.stop_ids) if len(r.output_token_ids) < r.params.min_tokens else [] for r in rows]
        for r in rows if want_counts or want_prompt else ():  # O(context) per row: only when it matters
            bad = [t for t in r.prompt_token_ids + r.output_token_ids if not 0 <= t < vocab_size]
            if bad:
                raise ValueError(f"token ids {bad[:4]} outside the vocabulary (size {vocab_size})")
        temperature = top_k = top_p = min_p = seeds = positions = None
        if not all_greedy:
            temperature, top_p, min_p = columns(
                [(p.temperature, p.top_p, p.min_p) for p in ps], torch.float32
            )
            top_k, seeds, positions = columns(
                [
                    (p.top_k if 0 < p.top_k < vocab_size else vocab_size, r.seed, len(r.output_token_ids))
                    for p, r in zip(ps, rows, strict=True)
                ],
                torch.int64,
            )
        grammar_rows = grammar_bitmask = None
        masks = _grammar_mask_args(rows)
        if masks is not None:  # unconstrained batches skip this entirely
            compiler = masks[0]  # pinned staging, one upload (engine/grammar_masks.py)
            grammar_bitmask, grammar_rows = compiler.staging.masks(*masks[:3], vocab_size, torch.device(device),
                                                                   masks[3])
        presence = frequency = repetition = None
        if want_counts:
            presence, frequency, repetition = columns(
                [(p.presence_penalty, p.frequency_penalty, p.repetition_penalty) for p in ps], torch.float32
            )
        return cls(
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            min_p=min_p,
            seeds=seeds,
            positions=positions,
            presence=presence,
            frequency=frequency,
            repetition=repetition,
            output_counts=id_mask([r.output_token_ids for r in rows], counts=True) if want_counts else None,
            prompt_mask=id_mask([r.prompt_token_ids for r in rows], counts=False) if want_prompt else None,
            banned=id_mask(bans, counts=False) if any(bans) else None,
            grammar_rows=grammar_rows,
            grammar_bitmask=grammar_bitmask,
            num_logprobs=max(p.logprobs for p in ps),
            all_greedy=all_greedy,
            any_top_k=any(0 < p.top_k < vocab_size and not p.greedy for p in ps),
            any_top_p=any(p.top_p < 1 and not p.greedy for p in ps),
            any_min_p=any(p.min_p > 0 and not p.greedy for p in ps),
        )


def _grammar_mask_args(rows: list[SamplingRequest]) -> tuple[Any, list[Any], list[int] | None, list[int]] | None:
    """-> (compiler, matchers, their logits rows or None when every row has one, families) of the constrained
    rows; None when no row has a grammar."""
    constrained = [i for i, r in enumerate(rows) if r.grammar is not None]
    if not constrained:
        return None
    states = [r.grammar for r in rows if r.grammar is not None]
    every = len(constrained) == len(rows)  # then no row index: masked in place (token_bitmask)
    return states[0].compiler, [s.matcher for s in states], None if every else constrained, [s.family for s in states]


def prefetch_grammar_masks(rows: list[SamplingRequest], vocab_size: int, device: torch.device) -> None:
    """Start filling the grammar masks that SamplingBatch.build(rows, vocab_size, device) will take, on the
    grammar compiler's thread (engine/grammar_masks.py), so that the caller's own work overlaps the fill."""
    masks = _grammar_mask_args(rows)
    if masks is not None:
        masks[0].staging.prefetch(*masks[:3], vocab_size, device, masks[3])


@dataclass(slots=True)
class SamplerOutput:
    token_ids: torch.Tensor  # [N] int64
    logprobs: torch.Tensor | None  # [N] float32: the sampled token's raw logprob
    top_ids: torch.Tensor | None  # [N, num_logprobs] int64
    top_logprobs: torch.Tensor | None  # [N, num_logprobs] float32


def apply_penalties(logits: torch.Tensor, b: SamplingBatch) -> torch.Tensor:
    """Repetition (prompt + output; positive logits divided, negative multiplied, as vLLM), then
    frequency (per output occurrence) and presence (once per distinct output token)."""
    if b.output_counts is None:
        return logits
    assert b.repetition is not None and b.frequency is not None and b.presence is not None
    counts = b.output_counts
    seen = counts > 0
    if b.prompt_mask is not None:
        seen_any = seen | b.prompt_mask
        penalty = b.repetition[:, None].expand_as(logits)
        logits = torch.where(seen_any, torch.where(logits > 0, logits / penalty, logits * penalty), logits)
    return logits - b.frequency[:, None] * counts - b.presence[:, None] * seen.to(logits.dtype)


def _mask_top_k_top_p(logits: torch.Tensor, b: SamplingBatch) -> torch.Tensor:
    """Top-k, then top-p over the renormalised survivors (keeps at least the most likely token)."""
    assert b.top_k is not None and b.top_p is not None
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    rank = torch.arange(logits.shape[-1], device=logits.device)[None, :]
    remove = rank >= b.top_k[:, None]
    if b.any_top_p:
        probs = sorted_logits.masked_fill(remove, float("-inf")).softmax(dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs  # probability of the strictly more likely tokens
        remove |= (mass_before >= b.top_p[:, None]) & (b.top_p < 1)[:, None]
    return logits.masked_fill(torch.zeros_like(remove).scatter_(1, order, remove), float("-inf"))


def greedy_argmax(logits: torch.Tensor) -> torch.Tensor:
    """argmax over the vocabulary (first index among ties), in two stages when the row splits into 256 or 64
    equal pieces of >= 256: a single-row argmax over a 128K vocabulary runs on one thread block (~28 us on an
    H200); the pieces reduce in parallel. The first maximal piece holds the first maximal index."""
    n, v = logits.shape
    pieces = next((p for p in (256, 64) if v % p == 0 and v // p >= 256), 0)
    if not pieces or n > 64:
        return logits.argmax(dim=-1)
    piece_max, piece_arg = logits.view(n, pieces, v // pieces).max(dim=-1)
    best = piece_max.argmax(dim=-1, keepdim=True)
    return (best * (v // pieces) + piece_arg.gather(1, best))[:, 0]


class Sampler:
    def __call__(self, logits: torch.Tensor, b: SamplingBatch, greedy: torch.Tensor | None = None) -> SamplerOutput:
        """logits: [N, V] float32 (fresh; may be modified) -> sampled ids and, when asked, logprobs. greedy: the
        argmax of every row of these logits as they came (the decode graph's, cuda_graphs.GREEDY_IN_GRAPH_MAX), taken
        instead of greedy_argmax where no penalty, ban or grammar mask changes the logits first."""
        unchanged = b.output_counts is None and b.banned is None and b.grammar_bitmask is None
        raw_logprobs = logits.log_softmax(dim=-1) if b.num_logprobs else None
        logits = apply_penalties(logits, b)
        if b.banned is not None:
            logits = logits.masked_fill(b.banned, float("-inf"))
        if b.grammar_bitmask is not None:  # after the logprobs: those report the model's own distribution
            apply_token_bitmask(logits, b.grammar_bitmask, b.grammar_rows)
        token_ids = greedy if greedy is not None and unchanged else greedy_argmax(logits)
        if not b.all_greedy:
            assert b.temperature is not None and b.min_p is not None
            assert b.seeds is not None and b.positions is not None
            greedy = b.temperature == 0
            scaled = logits / torch.where(greedy, 1.0, b.temperature)[:, None]
            if b.any_top_k or b.any_top_p:
                scaled = _mask_top_k_top_p(scaled, b)
            if b.any_min_p:
                probs = scaled.softmax(dim=-1)
                scaled = scaled.masked_fill(
                    probs < b.min_p[:, None] * probs.amax(dim=-1, keepdim=True), float("-inf")
                )
            gumbel = -torch.log(-torch.log(uniform_noise(b.seeds, b.positions, logits.shape[-1])))
            token_ids = torch.where(greedy, token_ids, (scaled + gumbel).argmax(dim=-1))
        if not b.num_logprobs:
            return SamplerOutput(token_ids, None, None, None)
        assert raw_logprobs is not None
        floored = raw_logprobs.clamp(min=LOGPROB_FLOOR)
        top_logprobs, top_ids = floored.topk(b.num_logprobs, dim=-1)
        return SamplerOutput(token_ids, floored.gather(1, token_ids[:, None])[:, 0], top_ids, top_logprobs)
