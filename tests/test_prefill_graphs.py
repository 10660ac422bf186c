"""Prefill CUDA graphs (engine/prefill_graphs.py): the bucket arithmetic and which steps replay a graph, on the
CPU; on the GPU, greedy tokens with the graphs equal transformers' in float32, chunked prompts included."""

from __future__ import annotations

import pytest
import torch
from stoker.engine.batch import AttentionMetadata, ModelInput
from stoker.engine.prefill_graphs import PrefillGraphs, bucket_sizes

CUDA = torch.cuda.is_available()


def test_bucket_sizes_step_64_then_128_and_end_at_the_cap() -> None:
    assert bucket_sizes(1024) == [64, 128, 192, 256, 320, 384, 448, 512, 640, 768, 896, 1024]
    assert bucket_sizes(512)[-1] == 512 and len(bucket_sizes(512)) == 8
    assert bucket_sizes(40) == [48]  # the cap rounded up to a multiple of 16 (one Triton variant for all)
    assert bucket_sizes(700) == [64, 128, 192, 256, 320, 384, 448, 512, 640, 704]
    assert all(s % 16 == 0 for s in bucket_sizes(3000))
    with pytest.raises(ValueError, match="max_tokens"):
        bucket_sizes(0)


def _graphs(max_tokens: int = 256, max_blocks: int = 8) -> PrefillGraphs:
    return PrefillGraphs(torch.nn.Identity(), [], torch.device("cpu"), max_tokens, max_blocks)  # type: ignore[arg-type]


def _input(tokens: list[int], seqs: int = 1, decode_only: bool = False, num_decodes: int = 0, width: int = 4,
           sampled: int = 1, prev: bool = False) -> ModelInput:
    n = sum(tokens)
    qsl = torch.tensor([0, *torch.tensor(tokens).cumsum(0).tolist()], dtype=torch.int32)
    meta = AttentionMetadata(torch.arange(n), torch.zeros(seqs, width, dtype=torch.int32), qsl,
                             torch.tensor(tokens, dtype=torch.int32), decode_only, num_decodes)
    return ModelInput(torch.ones(n, dtype=torch.int64), torch.arange(n), meta,
                      torch.tensor([n - 1] * sampled, dtype=torch.int64), torch.zeros(2, dtype=torch.int64) if prev else None)


def test_only_one_sequences_prompt_chunk_alone_within_the_buckets_fits() -> None:
    g = _graphs()
    assert g.fits(_input([100]))
    assert g.fits(_input([256])) and not g.fits(_input([257]))  # past the largest bucket: eager
    assert g.fits(_input([40], sampled=0))  # a chunk that does not end its prompt samples nothing
    assert not g.fits(_input([50, 50], seqs=2))  # two prompts in one step (one of them ends: one row sampled)
    assert not g.fits(_input([1], decode_only=True))  # the decode graphs' case
    assert not g.fits(_input([1, 30], seqs=2, num_decodes=1, sampled=2))  # a mixed step
    assert not g.fits(_input([30], prev=True))  # a pending token to read from the step before
    assert not g.fits(_input([30], width=9))  # wider than the static block table
    g.enabled = False
    assert not g.fits(_input([100]))


def test_config_rejects_a_negative_token_cap(tmp_path) -> None:
    from stoker.engine.config import EngineConfig

    with pytest.raises(ValueError, match="prefill_graph_tokens"):
        EngineConfig(model_path=str(tmp_path), device="cpu", prefill_graph_tokens=-1)


@pytest.mark.parametrize("flag,env,field,given", [
    ("--prefill-graph-tokens", "STOKER_PREFILL_GRAPH_TOKENS", "prefill_graph_tokens", ("768", "256")),
    ("--piecewise-graph-tokens", "STOKER_PIECEWISE_GRAPH_TOKENS", "piecewise_graph_tokens", ("0", "2048")),
])
def test_worker_flag_reaches_the_engine_config(tmp_path, monkeypatch, flag: str, env: str, field: str,
                                               given: tuple[str, str]) -> None:
    """The worker's flag, else its environment variable, else the engine's default (engine/piecewise_graphs.py's
    cap too)."""
    import stoker.engine
    from stoker.engine.config import EngineConfig
    from stoker.worker import main as worker_main

    path = str(tmp_path)
    built: list[EngineConfig] = []
    monkeypatch.setattr(stoker.engine, "LLMEngine", built.append)  # the config build_engine makes, no engine
    worker_main.build_engine(worker_main.parse_config(["--model", path, flag, given[0],
                                                       "--no-warmup", "--device", "cpu"], {}))
    worker_main.build_engine(worker_main.parse_config(["--model", path, "--no-warmup", "--device", "cpu"],
                                                      {env: given[1]}))
    worker_main.build_engine(worker_main.parse_config(["--model", path, "--no-warmup", "--device", "cpu"], {}))
    assert [getattr(c, field) for c in built] == [int(given[0]), int(given[1]), getattr(EngineConfig(path), field)]


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("budget", [256, 24], ids=["whole", "chunked"])
def test_fp32_greedy_tokens_match_transformers_with_prefill_graphs(tmp_path, budget: int) -> None:
    """Each request alone (so its prompt is a one-sequence step): prompts of 1-100 tokens, padded to buckets of
    64 / 128; with a 24-token budget the longer ones run in chunks whose non-final ones sample nothing. Greedy
    tokens equal transformers', and every prefill step replayed a graph."""
    from stoker.engine import EngineRequest, SamplingParams
    from stoker.engine.config import EngineConfig
    from stoker.engine.engine import LLMEngine
    from test_gpu_engine import VOCAB, _hf_llama

    path = str(tmp_path)
    hf = _hf_llama(path).to("cuda")
    engine = LLMEngine(EngineConfig(model_path=path, device="cuda", dtype="float32", max_model_len=256,
                                    num_kv_blocks=128, max_num_seqs=8, max_num_batched_tokens=budget,
                                    prefill_graph_tokens=128, decode_kernels="cublas"))  # (fewer compiles)
    graphs = engine.runner.prefill_graphs
    assert graphs is not None and graphs.sizes == ([64, 128] if budget == 256 else [32])
    gen = torch.Generator().manual_seed(3)
    prefill_steps = 0
    for n in (5, 17, 64, 1, 100, 33):
        ids = torch.randint(2, VOCAB, (n,), generator=gen).tolist()
        engine.add_request(EngineRequest(f"r{n}", prompt_token_ids=ids,
                                         params=SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)))
        prefill_steps += -(-n // budget) if n > 1 else 0  # a one-token prompt is a decode-graph step
        got: list[int] = []
        while engine.has_unfinished():
            for out in engine.step():
                assert out.error_code is None, out.error_message
                got += out.new_token_ids
        with torch.no_grad():
            want = hf.generate(torch.tensor([ids], device="cuda"), max_new_tokens=12, do_sample=False)
        assert got == want[0, n:].tolist(), n
    assert graphs.replays == prefill_steps
