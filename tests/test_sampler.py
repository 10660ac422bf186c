"""The batched sampler: seeded draws independent of the batch, top-k/top-p/min-p support, the Gumbel race's
distribution, penalties against a plain reference, min_tokens bans, and logprobs against transformers."""

from __future__ import annotations

import pytest
import torch
from engine_models import build_hf_model, hf_logits, prompts
from stoker.engine import EngineRequest, SamplingParams
from stoker.engine.config import EngineConfig
from stoker.engine.engine import LLMEngine
from stoker.engine.sampler import (
    LOGPROB_FLOOR,
    Sampler,
    SamplingBatch,
    SamplingRequest,
    apply_penalties,
    uniform_noise,
    unit_float,
)

V = 50


def rows_for(
    params: list[SamplingParams],
    seeds: list[int],
    outputs: list[list[int]] | None = None,
    prompt: list[int] | None = None,
    stop_ids: tuple[int, ...] = (),
) -> list[SamplingRequest]:
    outputs = outputs or [[] for _ in params]
    return [
        SamplingRequest(p, s, prompt or [1, 2], o, stop_ids)
        for p, s, o in zip(params, seeds, outputs, strict=True)
    ]


def sample(logits: torch.Tensor, rows: list[SamplingRequest]) -> list[int]:
    return Sampler()(logits.clone(), SamplingBatch.build(rows, logits.shape[-1], "cpu")).token_ids.tolist()


def test_noise_is_a_pure_uniform_function_of_seed_position_index():
    seeds = torch.tensor([0, 1, 2**62 + 5, 0], dtype=torch.int64)
    pos = torch.tensor([0, 0, 3, 1], dtype=torch.int64)
    u = uniform_noise(seeds, pos, 4096)
    assert ((u > 0) & (u < 1)).all()
    assert torch.equal(u, uniform_noise(seeds, pos, 4096))
    assert torch.equal(u[2], uniform_noise(seeds[2:3], pos[2:3], 4096)[0])  # independent of other rows
    assert not torch.equal(u[0], u[3]) and not torch.equal(u[0], u[1])  # position and seed both matter
    hist = torch.histc(u.flatten(), bins=16, min=0, max=1) / u.numel()
    assert (hist - 1 / 16).abs().max() < 0.01


def test_every_hash_maps_strictly_inside_the_unit_interval():
    """Exhaustive over the 24 top bits a hash can have (the low 8 cannot move a float32 in [0.5, 1)): 24 bits +
    0.5 once rounded to exactly 1.0, whose Gumbel noise is +inf (NaN on a masked token, which argmax picks)."""
    u = unit_float(torch.arange(1 << 24, dtype=torch.int64) << 8 | 0xFF)
    assert float(u.min()) > 0 and float(u.max()) < 1
    assert torch.isfinite(-torch.log(-torch.log(u))).all()


def test_seeded_row_does_not_depend_on_the_batch():
    torch.manual_seed(0)
    logits = torch.randn(6, V) * 2
    p = SamplingParams(temperature=0.9, top_k=20, top_p=0.9, seed=7)
    alone = sample(logits[3:4], rows_for([p], [7], [[4, 4, 9]]))
    others = [SamplingParams(temperature=t, top_p=0.5, min_p=0.1) for t in (0.3, 1.5, 0.0, 1.0, 2.0)]
    mixed = sample(
        logits, rows_for([*others[:3], p, *others[3:]], [1, 2, 3, 7, 5, 6], [[], [1], [], [4, 4, 9], [2], []])
    )
    assert mixed[3] == alone[0]


def draws(logits: torch.Tensor, params: SamplingParams, n: int) -> torch.Tensor:
    """n independent draws from one distribution: n rows, one seed each."""
    return torch.tensor(sample(logits.expand(n, -1), rows_for([params] * n, list(range(n)))))


def test_sampling_follows_softmax():
    torch.manual_seed(1)
    logits = torch.randn(1, 8)
    got = torch.bincount(draws(logits, SamplingParams(temperature=0.7), 20000), minlength=8) / 20000
    expected = (logits[0] / 0.7).softmax(-1)
    assert (got - expected).abs().max() < 0.015


@pytest.mark.parametrize(
    ("params", "allowed"),
    [
        (SamplingParams(top_k=5), lambda p: p.argsort(descending=True)[:5]),
        (
            SamplingParams(top_p=0.6),
            lambda p: p.argsort(descending=True)[
                : int((p.sort(descending=True)[0].cumsum(0) < 0.6).sum()) + 1
            ],
        ),
        (SamplingParams(min_p=0.3), lambda p: (p >= 0.3 * p.max()).nonzero()[:, 0]),
        (SamplingParams(top_k=8, top_p=0.5, min_p=0.05, temperature=1.3), None),
    ],
)
def test_filters_never_emit_outside_the_allowed_set(params, allowed):
    torch.manual_seed(2)
    logits = torch.randn(1, V) * 1.5
    got = set(draws(logits, params, 3000).tolist())
    probs = logits[0].softmax(-1)
    if allowed is None:  # combined: top-k, then top-p over the renormalised top-k (min-p rarely binds)
        top = (logits[0] / 1.3).topk(8)
        renorm = top.values.softmax(-1)
        allowed_set = set(top.indices[: int((renorm.cumsum(0) < 0.5).sum()) + 1].tolist())
    else:
        allowed_set = set(allowed(probs).tolist())
    assert got <= allowed_set, f"emitted {got - allowed_set}"
    assert len(got) > 1 or len(allowed_set) == 1  # it samples, not argmax


def test_penalties_match_a_plain_reference():
    torch.manual_seed(3)
    logits = torch.randn(3, V) * 3
    params = [
        SamplingParams(repetition_penalty=1.7, presence_penalty=0.5, frequency_penalty=0.3),
        SamplingParams(frequency_penalty=-1.0),
        SamplingParams(),
    ]
    prompts_ = [[1, 2, 3, 3], [4], [5]]
    outputs = [[3, 7, 7, 7, 9], [8, 8], [6]]
    rows = [SamplingRequest(p, 0, pr, o, ()) for p, pr, o in zip(params, prompts_, outputs, strict=True)]
    got = apply_penalties(logits.clone(), SamplingBatch.build(rows, V, "cpu"))
    expected = logits.clone()
    for i, (p, pr, out) in enumerate(zip(params, prompts_, outputs, strict=True)):
        for t in set(pr + out):
            x = expected[i, t].item()
            expected[i, t] = x / p.repetition_penalty if x > 0 else x * p.repetition_penalty
        for t in set(out):
            expected[i, t] -= p.frequency_penalty * out.count(t) + p.presence_penalty
    torch.testing.assert_close(got, expected)
    # Greedy sampling sees the penalised logits.
    greedy = SamplingParams(temperature=0, frequency_penalty=2.0)
    top = int(logits[0].argmax())
    assert sample(logits[:1], [SamplingRequest(greedy, 0, [1], [top] * 10, ())])[0] != top


def test_min_tokens_bans_stop_ids():
    logits = torch.zeros(1, V)
    logits[0, 3] = 50.0  # token 3 (a stop id) would always win
    params = SamplingParams(temperature=0, min_tokens=2)
    ban = [SamplingRequest(params, 0, [1], [9], (3, 4))]
    assert sample(logits, ban)[0] not in (3, 4)
    done = [SamplingRequest(params, 0, [1], [9, 9], (3, 4))]  # min_tokens reached
    assert sample(logits, done)[0] == 3


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("llama"))
    return path, build_hf_model("llama", path)


def run_one(engine: LLMEngine, rid: str, ids: list[int], params: SamplingParams):
    engine.add_request(EngineRequest(rid, prompt_token_ids=ids, params=params))
    outs = []
    while engine.has_unfinished():
        outs += [o for o in engine.step() if o.request_id == rid]
    return outs


def test_logprobs_match_transformers(llama):
    path, model = llama
    engine = LLMEngine(EngineConfig(path, device="cpu", num_kv_blocks=32))
    ids = prompts(11, [9])[0]
    params = SamplingParams(
        max_tokens=6, temperature=1.4, repetition_penalty=1.3, seed=5, logprobs=4, ignore_eos=True
    )
    outs = run_one(engine, "r", ids, params)
    out_ids = [t for o in outs for t in o.new_token_ids]
    lps = [lp for o in outs for lp in (o.logprobs or [])]
    assert len(lps) == len(out_ids) == 6
    ref = hf_logits(model, ids + out_ids).log_softmax(-1)[len(ids) - 1 : -1]  # before temperature/penalties
    for i, (tok, lp) in enumerate(zip(out_ids, lps, strict=True)):
        assert lp.token_id == tok and abs(lp.logprob - ref[i, tok].item()) < 1e-4
        top = ref[i].topk(4)
        assert [t.token_id for t in lp.top] == top.indices.tolist()
        torch.testing.assert_close(torch.tensor([t.logprob for t in lp.top]), top.values, atol=1e-4, rtol=0)


def test_logprobs_are_floored():
    logits = torch.zeros(1, V)
    logits[0, 0] = 30000.0  # every other token's logprob is about -30000
    out = Sampler()(
        logits, SamplingBatch.build(rows_for([SamplingParams(temperature=0, logprobs=3)], [0]), V, "cpu")
    )
    assert out.top_logprobs is not None and out.top_logprobs[0, 1:].eq(LOGPROB_FLOOR).all()


def test_seeded_request_same_alone_and_in_a_mixed_batch(llama):
    path, _ = llama
    ids = prompts(12, [7])[0]
    params = SamplingParams(max_tokens=10, temperature=1.0, top_p=0.95, seed=1234, ignore_eos=True)
    alone = [
        t
        for o in run_one(LLMEngine(EngineConfig(path, device="cpu", num_kv_blocks=32)), "s", ids, params)
        for t in o.new_token_ids
    ]
    engine = LLMEngine(EngineConfig(path, device="cpu", num_kv_blocks=32, max_num_batched_tokens=8))
    for i, p in enumerate(prompts(13, [5, 14, 3])):
        engine.add_request(EngineRequest(
            f"o{i}",
            prompt_token_ids=p,
            params=SamplingParams(max_tokens=12, temperature=0.8, ignore_eos=True),
        ))
    engine.step()  # the seeded request joins a running, chunked batch
    mixed = [t for o in run_one(engine, "s", ids, params) for t in o.new_token_ids]
    assert mixed == alone
    other_seed = SamplingParams(max_tokens=10, temperature=1.0, top_p=0.95, seed=99, ignore_eos=True)
    assert [t for o in run_one(engine, "t", ids, other_seed) for t in o.new_token_ids] != alone


def test_greedy_argmax_two_stage_keeps_the_first_maximum():
    from stoker.engine.sampler import greedy_argmax

    gen = torch.Generator().manual_seed(3)
    for n, v in [(1, 128256), (5, 64 * 256), (2, 64 * 257), (3, 384), (70, 64 * 256)]:
        x = torch.randn(n, v, generator=gen)
        x[:, v // 3] = x.max() + 1
        x[:, v // 2] = x.max()  # a tie later in the row: the first index must win
        assert torch.equal(greedy_argmax(x), x.argmax(dim=-1)), (n, v)
        coarse = torch.randint(0, 3, (n, v), generator=gen).float()  # many ties across pieces
        assert torch.equal(greedy_argmax(coarse), coarse.argmax(dim=-1)), (n, v)


def test_the_decode_graphs_greedy_ids_are_taken_only_where_nothing_changes_the_logits():
    """Sampler(greedy=...): the argmax the decode graph computed (cuda_graphs.GREEDY_IN_GRAPH_MAX) stands for
    greedy_argmax when the logits reach the argmax as they came; a penalty, a min_tokens ban or a grammar mask
    changes them first, and then the sampler takes its own argmax. Given ids that are not the argmax, so which one
    was taken shows; random rows still sample and the greedy rows of a mixed batch get the given ids."""
    logits = torch.zeros(2, V)
    logits[:, 3] = 50.0
    given = torch.tensor([7, 8])
    plain = SamplingBatch.build(rows_for([SamplingParams(temperature=0)] * 2, [0, 0]), V, "cpu")
    assert Sampler()(logits.clone(), plain, greedy=given).token_ids.tolist() == [7, 8]
    assert Sampler()(logits.clone(), plain).token_ids.tolist() == [3, 3]
    mixed = SamplingBatch.build(rows_for([SamplingParams(temperature=0), SamplingParams(temperature=1.0)], [0, 5]),
                                V, "cpu")
    assert Sampler()(logits.clone(), mixed, greedy=given).token_ids.tolist() == [7, 3]  # row 1 draws 3 (50 logits)
    changed = [
        rows_for([SamplingParams(temperature=0, frequency_penalty=0.1)] * 2, [0, 0], outputs=[[1], [1]]),
        rows_for([SamplingParams(temperature=0, min_tokens=3)] * 2, [0, 0], stop_ids=(9,)),
    ]
    for rows in changed:
        batch = SamplingBatch.build(rows, V, "cpu")
        assert Sampler()(logits.clone(), batch, greedy=given).token_ids.tolist() == [3, 3]
