"""Overlapped steps (EngineConfig.async_scheduling) on the CPU: everything a request sees (tokens, text,
finish reason, usage, logprobs) equals the synchronous engine's, also when a request stops while its next
token is already in flight, is aborted in flight, samples with seeds, or needs penalties (whose step finishes
the step before between its forward and its sampling); and no KV block leaks."""

from __future__ import annotations

import numpy as np
import pytest
from engine_models import build_hf_model, prompts
from stoker.engine import EngineRequest, SamplingParams
from stoker.engine.config import EngineConfig
from stoker.engine.engine import LLMEngine
from stoker.engine.sequence import PENDING_TOKEN


@pytest.fixture(scope="module")
def path(tmp_path_factory) -> str:
    out = str(tmp_path_factory.mktemp("llama"))
    build_hf_model("llama", out, seed=4)
    return out


def make(path: str, overlap: bool, **kw) -> LLMEngine:
    return LLMEngine(EngineConfig(path, device="cpu", num_kv_blocks=32, async_scheduling=overlap, **kw))


def drain(engine: LLMEngine, on_step=None) -> dict[str, dict]:
    """Run to the end; per request: tokens, text, final reason/usage, logprobs, and the number of outputs."""
    seen: dict[str, dict] = {}
    steps = 0
    while engine.has_unfinished():
        outs = engine.step()
        steps += 1
        assert steps < 500
        if on_step:
            on_step(steps, outs)
        for o in outs:
            r = seen.setdefault(o.request_id, {"tokens": [], "text": "", "logprobs": [], "finished": 0})
            assert not r["finished"], f"{o.request_id}: output after finishing"
            assert PENDING_TOKEN not in o.new_token_ids
            r["tokens"] += o.new_token_ids
            r["text"] += o.text_delta
            r["logprobs"] += [(lp.token_id, round(lp.logprob, 4)) for lp in o.logprobs or []]
            r["finished"] += o.finished
            r["final"] = (o.finish_reason, o.completion_tokens, o.prompt_tokens, o.error_code)
    stats = engine.stats()
    assert stats.kv_blocks_free == stats.kv_blocks_total, "KV blocks leaked"
    assert stats.num_running == stats.num_waiting == 0 and engine._inflight is None
    return seen


def both(path: str, requests: list[tuple[str, list[int], SamplingParams]], **kw) -> dict[str, dict]:
    results = []
    for overlap in (False, True):
        engine = make(path, overlap, **kw)
        for rid, ids, params in requests:
            engine.add_request(EngineRequest(rid, prompt_token_ids=ids, params=params))
        results.append(drain(engine))
    sync, over = results
    assert over == sync
    return sync


def test_first_step_only_launches_then_tokens_arrive_one_call_later(path):
    engine = make(path, True)
    engine.add_request(EngineRequest(
        "r", prompt_token_ids=prompts(1, [7])[0], params=SamplingParams(temperature=0, max_tokens=3)
    ))
    assert engine.step() == []  # prefill launched, its token still on the "device"
    seq = engine._requests["r"].state.seq
    assert seq.output_token_ids == [PENDING_TOKEN] and seq.num_pending == 1
    out = engine.step()  # decode launched on the pending token, then the prefill's token read
    assert len(out) == 1 and len(out[0].new_token_ids) == 1 and out[0].completion_tokens == 1
    assert seq.num_pending == 1 and seq.output_token_ids[0] == out[0].new_token_ids[0]


def test_stops_with_a_token_in_flight_match_sync(path):
    ids = prompts(21, [6, 11, 3])
    greedy = make(path, False)
    greedy.add_request(EngineRequest("g", prompt_token_ids=ids[0], params=SamplingParams(temperature=0, max_tokens=8)))
    stream = drain(greedy)["g"]["tokens"]
    text = greedy.tokenizer.decode(stream)
    stop_text = text[len(text) // 2 : len(text) // 2 + 2]
    reqs = [
        ("stop_id", ids[0], SamplingParams(temperature=0, max_tokens=8, stop_token_ids=(stream[2],))),
        (
            "stop_str",
            ids[0],
            SamplingParams(temperature=0, max_tokens=8, stop=(stop_text,) if stop_text.strip() else ()),
        ),
        (
            "min_tokens",
            ids[0],
            SamplingParams(temperature=0, max_tokens=8, min_tokens=4, stop_token_ids=(stream[2],)),
        ),
        ("length", ids[1], SamplingParams(temperature=0, max_tokens=5)),
        ("one", ids[2], SamplingParams(temperature=0, max_tokens=1)),
    ]
    got = both(path, reqs)
    assert got["stop_id"]["final"][:2] == ("stop", 3) and got["stop_id"]["tokens"] == stream[:3]
    assert got["length"]["final"][:2] == ("length", 5) and got["one"]["final"][:2] == ("length", 1)
    assert got["min_tokens"]["final"][1] >= 4


def test_seeded_sampling_and_logprobs_match_sync(path):
    ids = prompts(5, [4, 9, 13, 2])
    reqs = [
        (f"s{i}", p, SamplingParams(temperature=0.9, top_p=0.9, seed=100 + i, max_tokens=7, logprobs=2))
        for i, p in enumerate(ids)
    ]
    reqs.append(("greedy", ids[0], SamplingParams(temperature=0, max_tokens=6, logprobs=1)))
    got = both(path, reqs)
    assert all(len(got[r[0]]["logprobs"]) == got[r[0]]["final"][1] for r in reqs)


def test_penalties_read_the_step_befores_values_and_match_sync(path):
    ids = prompts(9, [5, 8])
    reqs = [
        (
            "pen",
            ids[0],
            SamplingParams(temperature=0, max_tokens=9, repetition_penalty=1.3, frequency_penalty=0.5),
        ),
        ("plain", ids[1], SamplingParams(temperature=0, max_tokens=9)),
    ]
    both(path, reqs)
    engine = make(path, True)
    engine.add_request(EngineRequest(reqs[1][0], prompt_token_ids=reqs[1][1], params=reqs[1][2]))
    engine.step()
    assert engine._inflight is not None  # overlapped while no penalties run
    engine.add_request(EngineRequest(reqs[0][0], prompt_token_ids=reqs[0][1], params=reqs[0][2]))
    engine.step()  # finishes the step before ahead of sampling: the new request's penalties read its values
    for r in engine._requests.values():
        assert (
            r.state.seq.num_pending <= 1
            and PENDING_TOKEN not in r.state.seq.output_token_ids[: r.state.seq.num_output_tokens - 1]
        )


def test_abort_and_deadline_in_flight(path):
    ids = prompts(31, [9, 9])
    engine = make(path, True)
    long = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    engine.add_request(EngineRequest("a", prompt_token_ids=ids[0], params=long))
    engine.add_request(EngineRequest("b", prompt_token_ids=ids[1], params=long))

    def on_step(step: int, outs) -> None:
        if step == 3:
            engine.abort("a")  # "a" has a token in flight now

    got = drain(engine, on_step)
    assert got["a"]["final"][0] == "cancelled" and got["a"]["final"][1] == len(got["a"]["tokens"]) == 2
    assert got["b"]["final"][:2] == ("length", 40)


def test_prefix_cache_under_overlap_hashes_only_known_tokens(path):
    # Block size 4 and 10 new tokens: generated tokens fill blocks while their values are still in flight.
    # A second request repeating prompt + output must hit those blocks and still produce the same tokens.
    ids = prompts(13, [7])[0]
    engine = make(path, True, block_size=4)
    engine.add_request(EngineRequest("first", prompt_token_ids=ids, params=SamplingParams(temperature=0, max_tokens=10)))
    first = drain(engine)["first"]["tokens"]
    for block in engine.scheduler.block_manager.blocks:
        assert PENDING_TOKEN not in block.token_ids
    again = ids + first[:8]
    engine.add_request(EngineRequest("again", prompt_token_ids=again, params=SamplingParams(temperature=0, max_tokens=2)))
    got = drain(engine)["again"]
    assert got["final"][1] == 2 and got["tokens"] == first[8:10]
    assert engine.stats().prefix_cache_hits >= 12


def test_host_block_table_mirror_appends_rewrites_after_preemption_and_grows():
    from stoker.engine.model_runner import _BlockTables
    from stoker.engine.sequence import Sequence

    tables = _BlockTables(max_blocks=8)
    seqs = [Sequence(f"s{i}", [1]) for i in range(100)]  # more live sequences than the initial 64 rows
    for i, seq in enumerate(seqs):
        seq.block_table = [i, i + 1]
    rows = [tables.row(seq) for seq in seqs]
    assert len(set(rows)) == 100 and tables.array.shape[0] >= 100
    seqs[3].block_table.append(7)  # a decode step allocated a block: only the new entry is written
    assert list(tables.array[tables.row(seqs[3]), :3]) == [3, 4, 7]
    seqs[5].block_table[:] = [9]  # preempted and re-admitted: a new table, written from the start
    seqs[5].num_preemptions += 1
    assert tables.array[tables.row(seqs[5]), 0] == 9
    freed = tables.row(seqs[0])
    tables.release(seqs[0])
    newcomer = Sequence("new", [1], block_table=[42])
    assert tables.row(newcomer) == freed and tables.array[freed, 0] == 42
    with pytest.raises(ValueError, match="exceed max_model_len"):
        tables.row(Sequence("long", [1], block_table=list(range(9))))


def test_prepare_starts_every_device_part_16_byte_aligned(path):
    """Triton compiles a kernel variant per 16-byte-alignment class of each pointer: the parts of the packed
    uploads must start aligned whatever the batch's token and sequence counts, and hold the right values."""
    from stoker.engine.model_runner import _pack

    engine = make(path, False)
    seen: list = []
    forward = engine.runner.forward

    def spy(inp):
        seen.append(inp)
        return forward(inp)

    engine.runner.forward = spy
    # Odd token and sequence counts in mixed steps: 3 prompts of 5, 7 and 9 tokens, decodes beside prefills.
    for i, n in enumerate((5, 7, 9)):
        engine.add_request(EngineRequest(
            f"r{i}", prompt_token_ids=[3 + i] * n, params=SamplingParams(max_tokens=3, temperature=0)
        ))
        engine.step()
    drain(engine)
    assert any(not inp.meta.decode_only for inp in seen[1:]) and len(seen) > 4
    for inp in seen:
        m = inp.meta
        for t in (
            inp.input_ids,
            inp.positions,
            inp.sample_indices,
            m.slot_mapping,
            m.block_tables,
            m.query_start_loc,
            m.context_lens,
        ):
            assert t.data_ptr() % 16 == 0, (t.shape, t.dtype)
        assert m.query_start_loc[0] == 0 and m.query_start_loc[-1] == inp.input_ids.shape[0]
        assert m.block_tables.shape[0] == m.context_lens.shape[0] == m.query_start_loc.shape[0] - 1
        assert (m.context_lens > 0).all() and (inp.sample_indices < inp.input_ids.shape[0]).all()
    packed, starts = _pack([np.arange(3), np.arange(5) + 10, np.arange(0)], np.int32)
    assert starts == [0, 4, 12] and packed[4:9].tolist() == list(range(10, 15)) and len(packed) == 12
