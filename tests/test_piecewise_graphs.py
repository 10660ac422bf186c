"""Piecewise CUDA graphs for the batch step (engine/piecewise_graphs.py): the bucket arithmetic and which steps take
them; on the CPU the same pieces run eagerly over the static buffers (padding rows, the static q and attention
output, the slots past a step's tokens) and greedy tokens equal transformers' in float32 for every architecture,
with mixed, chunked and overlapped steps; on the GPU the same with the pieces captured and replayed."""

from __future__ import annotations

import pytest
import torch
from engine_models import ARCHS, build_hf_model, hf_greedy, prompts
from stoker.engine import EngineRequest, SamplingParams
from stoker.engine.batch import AttentionMetadata, ModelInput
from stoker.engine.config import EngineConfig
from stoker.engine.engine import LLMEngine
from stoker.engine.piecewise_graphs import PiecewiseGraphs, bucket_sizes

CUDA = torch.cuda.is_available()
MAX_NEW = 8


def test_bucket_sizes_four_per_doubling_and_end_at_the_cap() -> None:
    assert bucket_sizes(8192) == [64, 128, 192, 256, 320, 384, 448, 512, 640, 768, 896, 1024, 1280, 1536, 1792,
                                  2048, 2560, 3072, 3584, 4096, 5120, 6144, 7168, 8192]
    assert bucket_sizes(7) == [64]  # the cap rounded up to a multiple of 64
    assert bucket_sizes(1000) == [64, 128, 192, 256, 320, 384, 448, 512, 640, 768, 896, 1024]
    assert bucket_sizes(2100)[-2:] == [2048, 2112]
    for cap in (100, 3000, 12345):
        sizes = bucket_sizes(cap)
        assert all(s % 64 == 0 for s in sizes) and sizes == sorted(set(sizes)) and sizes[-1] >= cap
        assert all(b <= max(a + 64, a * 1.25) for a, b in zip(sizes, sizes[1:], strict=False))  # padding < 25 %
    with pytest.raises(ValueError, match="max_tokens"):
        bucket_sizes(0)


def test_config_rejects_a_negative_token_cap(tmp_path) -> None:
    with pytest.raises(ValueError, match="piecewise_graph_tokens"):
        EngineConfig(model_path=str(tmp_path), device="cpu", piecewise_graph_tokens=-1)


@pytest.fixture(scope="module", params=list(ARCHS))
def arch(request, tmp_path_factory) -> tuple[str, str, object]:
    path = str(tmp_path_factory.mktemp(request.param))
    return request.param, path, build_hf_model(request.param, path)


def _attach(engine: LLMEngine, max_tokens: int) -> PiecewiseGraphs:
    """The engine's runner with piecewise pieces that were never captured: every step with prompt tokens runs
    them eagerly (PiecewiseGraphs.run without graphs), through the same static buffers as replays."""
    runner = engine.runner
    mc = runner.model_config
    graphs = PiecewiseGraphs(runner.model, runner.kv_caches, runner.device, max_tokens, mc.num_heads, mc.head_dim,
                             mc.hidden_size, runner.dtype)
    runner.piecewise_graphs = graphs
    _count_prompt_steps(graphs)
    return graphs


def _count_prompt_steps(graphs: PiecewiseGraphs) -> None:
    """graphs.prompt_steps: the token count of every step with prompt tokens, which all ask fits() (decode-only
    steps ask it too on the CPU, the decode graphs first on the GPU)."""
    prompt_steps = graphs.prompt_steps = []  # type: ignore[attr-defined]
    fits = graphs.fits

    def counted(inp: ModelInput) -> bool:
        if not inp.meta.decode_only:
            prompt_steps.append(inp.input_ids.shape[0])
        return fits(inp)

    graphs.fits = counted  # type: ignore[method-assign]


def _generate(engine: LLMEngine, requests: dict[str, list[int]], late: dict[str, list[int]]) -> dict[str, list[int]]:
    """`requests` added at once, `late` after the second step (they join running decodes: mixed steps)."""
    for rid, ids in requests.items():
        engine.add_request(EngineRequest(rid, prompt_token_ids=ids,
                                         params=SamplingParams(max_tokens=MAX_NEW, temperature=0, ignore_eos=True)))
    got: dict[str, list[int]] = {rid: [] for rid in [*requests, *late]}
    step = 0
    while engine.has_unfinished() or late:
        if step == 2:
            for rid, ids in late.items():
                engine.add_request(EngineRequest(rid, prompt_token_ids=ids, params=SamplingParams(
                    max_tokens=MAX_NEW, temperature=0, ignore_eos=True)))
            late = {}
        for out in engine.step():
            assert out.error_code is None, out.error_message
            got[out.request_id] += out.new_token_ids
        step += 1
        assert step < 500
    return got


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
def test_greedy_tokens_match_transformers_through_the_pieces(arch, overlap: bool) -> None:
    """Several prompts in one step, prompts chunked by a 24-token budget, late requests beside running decodes
    (mixed steps; with overlap their decode ids are pending on the step before): every step with prompt tokens
    goes through the pieces, padded to the 64-token bucket, and the tokens equal transformers'."""
    name, path, model = arch
    engine = LLMEngine(EngineConfig(model_path=path, device="cpu", num_kv_blocks=64, max_num_batched_tokens=24,
                                    async_scheduling=overlap))
    graphs = _attach(engine, 24)
    assert graphs.sizes == [64]
    first = dict(zip(["a", "b", "c"], prompts(5, [3, 30, 9]), strict=True))
    late = dict(zip(["d", "e"], prompts(6, [17, 1]), strict=True))
    got = _generate(engine, first, late)
    # every step with prompt tokens: the first, the rest of b's chunks, the late prompts beside decodes
    assert graphs.replays == len(graphs.prompt_steps) >= 3  # type: ignore[attr-defined]
    for rid, ids in {**first, **late}.items():
        assert got[rid] == hf_greedy(model, ids, MAX_NEW), (name, rid)


def test_padding_rows_write_no_kv_after_a_longer_step(tmp_path) -> None:
    """A short step right after a longer one in the same bucket: the static slots past its tokens still hold the
    longer step's slots unless run() resets them; were they kept, the padding rows would overwrite those
    sequences' cached keys and values and their later tokens would change."""
    path = str(tmp_path)
    model = build_hf_model("llama", path)
    engine = LLMEngine(EngineConfig(model_path=path, device="cpu", num_kv_blocks=64, max_num_batched_tokens=64,
                                    async_scheduling=False))
    graphs = _attach(engine, 64)
    long_prompts = dict(zip(["x", "y"], prompts(7, [29, 31]), strict=True))  # one 60-token step
    short = dict(zip(["z"], prompts(8, [5]), strict=True))  # joins them later: a 7-token mixed step
    got = _generate(engine, long_prompts, short)
    assert graphs.prompt_steps == [60, 7]  # type: ignore[attr-defined]
    assert graphs.replays == 2
    for rid, ids in {**long_prompts, **short}.items():
        assert got[rid] == hf_greedy(model, ids, MAX_NEW), rid


def test_prefix_cache_hits_and_preemption_through_the_pieces(tmp_path) -> None:
    """Prompts whose chunks start past a cached prefix (their attention reads context the step did not write),
    and preempted requests recomputed from their prompts, through the pieces: tokens equal transformers'."""
    path = str(tmp_path)
    model = build_hf_model("llama", path)
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0, ignore_eos=True)

    def run(engine: LLMEngine, requests: dict[str, list[int]]) -> dict[str, list[int]]:
        for rid, ids in requests.items():
            engine.add_request(EngineRequest(rid, prompt_token_ids=ids, params=params))
        got: dict[str, list[int]] = {rid: [] for rid in requests}
        while engine.has_unfinished():
            for out in engine.step():
                assert out.error_code is None, out.error_message
                got[out.request_id] += out.new_token_ids
                if out.finished and out.request_id.startswith("hit"):
                    assert out.cached_tokens >= 32, out  # the shared prefix came from the cache
        return got

    engine = LLMEngine(EngineConfig(model_path=path, device="cpu", num_kv_blocks=64, block_size=8,
                                    async_scheduling=False))
    graphs = _attach(engine, engine.config.max_num_batched_tokens)
    shared = prompts(3, [40])[0]
    tails = prompts(4, [5, 1, 9])
    requests = {"first": shared + tails[0]} | {f"hit{i}": shared + t for i, t in enumerate(tails[1:])}
    got = run(engine, {"first": requests.pop("first")}) | run(engine, requests)
    assert graphs.replays == 2
    for rid, ids in ({"first": shared + tails[0]} | requests).items():
        assert got[rid] == hf_greedy(model, ids, MAX_NEW), rid

    # 4-token blocks, 16 of them: 64 tokens for five requests of 11-36: some are preempted and recomputed.
    engine = LLMEngine(EngineConfig(model_path=path, device="cpu", num_kv_blocks=16, block_size=4, max_model_len=64,
                                    async_scheduling=False))
    graphs = _attach(engine, engine.config.max_num_batched_tokens)
    preempted: list[str] = []
    schedule = engine.scheduler.schedule

    def spy():  # type: ignore[no-untyped-def]
        out = schedule()
        preempted.extend(seq.request_id for seq in out.preempted)
        return out

    engine.scheduler.schedule = spy  # type: ignore[method-assign]
    requests = {f"p{i}": ids for i, ids in enumerate(prompts(1, [3, 17, 9, 26, 1]))}
    got = run(engine, requests)
    assert preempted, "nothing was preempted: the test does not test preemption"
    assert graphs.replays == len(graphs.prompt_steps) >= 2  # type: ignore[attr-defined]
    for rid, ids in requests.items():
        assert got[rid] == hf_greedy(model, ids, MAX_NEW), rid


def test_fp8_weights_and_kv_cache_through_the_pieces_as_eagerly(tmp_path) -> None:
    """FP8 linears (their norm and SiLU fused into the activation quantization, per token: padding rows cannot
    move a real row's scale) and the FP8 KV cache through the pieces: the same greedy tokens as the same engine
    eager (the FP8 model is not transformers', so the eager engine is the reference)."""
    path = str(tmp_path)
    build_hf_model("llama", path)
    first = dict(zip(["a", "b", "c"], prompts(11, [3, 30, 9]), strict=True))
    late = dict(zip(["d", "e"], prompts(12, [17, 1]), strict=True))
    runs = []
    for pieces in (False, True):
        engine = LLMEngine(EngineConfig(model_path=path, device="cpu", num_kv_blocks=64, max_num_batched_tokens=24,
                                        quantization="fp8", kv_cache_dtype="fp8", async_scheduling=False))
        graphs = _attach(engine, 24) if pieces else None
        runs.append(_generate(engine, first, late))
        if graphs is not None:
            assert graphs.replays == len(graphs.prompt_steps) >= 3  # type: ignore[attr-defined]
    assert runs[1] == runs[0]
    assert all(len(t) == MAX_NEW for t in runs[0].values())


def _input(tokens: int, decode_only: bool = False) -> ModelInput:
    meta = AttentionMetadata(torch.arange(tokens), torch.zeros(1, 4, dtype=torch.int32),
                             torch.tensor([0, tokens], dtype=torch.int32), torch.tensor([tokens], dtype=torch.int32),
                             decode_only)
    return ModelInput(torch.ones(tokens, dtype=torch.int64), torch.arange(tokens), meta,
                      torch.tensor([tokens - 1]))


def test_which_steps_take_the_pieces(tmp_path) -> None:
    path = str(tmp_path)
    build_hf_model("llama", path)
    engine = LLMEngine(EngineConfig(model_path=path, device="cpu", num_kv_blocks=16))
    assert engine.runner.piecewise_graphs is None  # not on the CPU (no graphs there)
    graphs = _attach(engine, 100)
    assert graphs.sizes == [64, 128]
    assert graphs.fits(_input(1)) and graphs.fits(_input(128)) and not graphs.fits(_input(129))
    assert not graphs.fits(_input(4, decode_only=True))  # the decode graphs' case
    graphs.enabled = False
    assert not graphs.fits(_input(8))


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("name", ["llama", "qwen3"])
def test_fp32_greedy_tokens_match_transformers_with_piecewise_graphs(tmp_path, name: str) -> None:
    """The pieces captured at startup and replayed: several prompts at once, chunks and late requests beside
    decodes (24-token budget), the prefill graphs off so that every step with prompt tokens is a replay."""
    path = str(tmp_path)
    model = build_hf_model(name, path)
    engine = LLMEngine(EngineConfig(model_path=path, device="cuda", dtype="float32", max_model_len=256,
                                    num_kv_blocks=128, max_num_seqs=8, max_num_batched_tokens=24,
                                    prefill_graph_tokens=0, decode_kernels="cublas"))
    graphs = engine.runner.piecewise_graphs
    assert graphs is not None and graphs.sizes == [64] and len(graphs.graphs[64]) == model.config.num_hidden_layers + 1
    _count_prompt_steps(graphs)
    first = dict(zip(["a", "b", "c"], prompts(5, [3, 30, 9]), strict=True))
    late = dict(zip(["d", "e"], prompts(6, [17, 1]), strict=True))
    got = _generate(engine, first, late)
    assert graphs.replays == len(graphs.prompt_steps) >= 3  # type: ignore[attr-defined]
    for rid, ids in {**first, **late}.items():
        assert got[rid] == hf_greedy(model, ids, MAX_NEW), rid


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_bf16_replayed_logits_match_the_eager_step(tmp_path) -> None:
    """bf16 with Triton kernels, buckets up to 512 tokens: every replayed step's logits against the same step
    run eagerly right after it (its K/V rewritten with the same values), within bf16's rounding."""
    from stoker.engine.batch import resolve_pending

    path = str(tmp_path)
    build_hf_model("llama", path)
    engine = LLMEngine(EngineConfig(model_path=path, device="cuda", dtype="bfloat16", max_model_len=256,
                                    num_kv_blocks=256, max_num_seqs=16, max_num_batched_tokens=512,
                                    prefill_graph_tokens=0))
    runner, graphs = engine.runner, engine.runner.piecewise_graphs
    assert graphs is not None and graphs.sizes[-1] == 512
    replay, compared = graphs.run, []

    def checked(inp: ModelInput) -> torch.Tensor:
        logits = replay(inp).clone()
        hidden = runner.model(resolve_pending(inp.input_ids, inp.prev_tokens), inp.positions, inp.meta,
                              runner.kv_caches)
        eager = runner.model.compute_logits(hidden[inp.sample_indices])
        torch.testing.assert_close(logits, eager, rtol=0.05, atol=0.05 * float(eager.abs().max()))
        compared.append(inp.input_ids.shape[0])
        return logits

    graphs.run = checked  # type: ignore[method-assign]
    first = {f"r{i}": p for i, p in enumerate(prompts(9, [200, 90, 33, 7, 150]))}
    late = {f"l{i}": p for i, p in enumerate(prompts(10, [60, 5]))}
    _generate(engine, first, late)
    assert len(compared) >= 2 and max(compared) > 256  # a full bucket and smaller ones
