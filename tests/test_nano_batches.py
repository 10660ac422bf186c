"""Two-nano-batch decode (engine/models/nano_batches.py, EngineConfig.decode_overlap): a large decode step's layers
run as two halves, interleaved on a GEMM lane and an attention lane. On the CPU the lanes are one and the same
stages run in sequence: the hidden states, the K/V the step writes, and greedy tokens equal the plain order's
and transformers' (float32). On the GPU (tests marked gpu) the halves run on two streams inside the captured
decode graphs, with the same tokens."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from engine_models import build_hf_model, hf_greedy, prompts
from stoker.engine import EngineRequest, SamplingParams
from stoker.engine.batch import AttentionMetadata
from stoker.engine.config import EngineConfig
from stoker.engine.engine import LLMEngine
from stoker.engine.models import llama
from stoker.engine.models.nano_batches import NanoBatchPlan, make_plan, split_meta

CUDA = torch.cuda.is_available()
MAX_NEW = 8
PROMPTS = prompts(7, [5, 12, 3, 20, 9])  # five sequences: halves of 2 and 3 rows


@pytest.fixture(scope="module", params=["llama", "qwen3"])  # qwen3: per-head q/k norms inside stage P
def arch(request, tmp_path_factory) -> tuple[str, Any]:
    path = str(tmp_path_factory.mktemp(request.param))
    return path, build_hf_model(request.param, path, seed=3)


class Spy:
    """Counts the forwards that took the two-half path (wraps the name llama.py calls)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch):
        self.calls, real = 0, llama.nano_batch_layers

        def counted(*args: Any, **kwargs: Any) -> Any:
            self.calls += 1
            return real(*args, **kwargs)

        monkeypatch.setattr(llama, "nano_batch_layers", counted)


def generate(path: str, device: str = "cpu", **kw: Any) -> list[list[int]]:
    engine = LLMEngine(EngineConfig(path, device=device, num_kv_blocks=64, **kw))
    for i, p in enumerate(PROMPTS):
        engine.add_request(EngineRequest(f"r{i}", prompt_token_ids=p,
                                         params=SamplingParams(max_tokens=MAX_NEW, temperature=0, ignore_eos=True)))
    out: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for o in engine.step():
            out.setdefault(o.request_id, []).extend(o.new_token_ids)
    return [out[f"r{i}"] for i in range(len(PROMPTS))]


def test_two_halves_greedy_equals_plain_and_transformers(arch, monkeypatch: pytest.MonkeyPatch) -> None:
    path, hf = arch
    spy = Spy(monkeypatch)
    halves = generate(path, decode_overlap=True, decode_overlap_min_rows=2)
    assert spy.calls >= MAX_NEW - 1, "the decode steps did not take the two-half path"
    calls = spy.calls
    assert generate(path) == halves
    assert spy.calls == calls  # off by default
    assert halves == [hf_greedy(hf, p, MAX_NEW) for p in PROMPTS]


def test_two_halves_only_above_the_row_threshold(arch, monkeypatch: pytest.MonkeyPatch) -> None:
    spy = Spy(monkeypatch)
    generate(arch[0], decode_overlap=True, decode_overlap_min_rows=len(PROMPTS) + 1)
    assert spy.calls == 0  # five sequences never reach six rows; prefill steps never take it either


def decode_batch(model: Any, rows: int, device: str, dtype: torch.dtype, seed: int = 0):
    """A decode-only step of `rows` sequences over random caches (shuffled blocks, contexts 3..40)."""
    cfg, block = model.cfg, 4
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(3, 41, (rows,), generator=g)
    per_seq = -(-40 // block)
    tables = torch.randperm(rows * per_seq, generator=g).view(rows, per_seq)
    pos = lens - 1
    slots = tables[torch.arange(rows), pos // block] * block + pos % block
    meta = AttentionMetadata(slots.to(device), tables.to(torch.int32).to(device),
                             torch.arange(rows + 1, dtype=torch.int32, device=device), lens.to(torch.int32).to(device),
                             decode_only=True)
    shape = (rows * per_seq, block, cfg.num_kv_heads, cfg.head_dim)
    caches = [(torch.randn(shape, generator=g).to(device, dtype), torch.randn(shape, generator=g).to(device, dtype))
              for _ in range(cfg.num_layers)]
    ids = torch.randint(0, cfg.vocab_size, (rows,), generator=g).to(device)
    return ids, pos.to(device), meta, caches


def load_model(path: str, device: str, dtype: torch.dtype) -> Any:
    from stoker.engine.loader import load_weights
    from stoker.engine.model_config import ModelConfig

    cfg = ModelConfig.from_folder(path)
    with torch.device(device):
        model = llama.LlamaForCausalLM(cfg, dtype, 512)
    load_weights(model, path)
    return model.eval()


@pytest.mark.parametrize("rows", [7, 2])  # odd: halves of 3 and 4; the smallest split: 1 and 1
def test_two_halves_hidden_and_cache_equal_plain(arch, rows: int) -> None:
    model = load_model(arch[0], "cpu", torch.float32)
    ids, pos, meta, caches = decode_batch(model, rows, "cpu", torch.float32)
    plain_caches = [(k.clone(), v.clone()) for k, v in caches]
    with torch.inference_mode():
        plain = model(ids, pos, meta, plain_caches)
        model.plan_nano_batches(NanoBatchPlan(2, None))
        halves = model(ids, pos, meta, caches)
    torch.testing.assert_close(halves, plain, rtol=1e-5, atol=1e-5)
    # Every row's K/V written, in its slot (the float32 GEMMs at half the rows round a little differently).
    slot = meta.slot_mapping
    for (k, v), (pk, pv) in zip(caches, plain_caches, strict=True):
        flat, plain_flat = torch.stack([k, v]).flatten(1, 2), torch.stack([pk, pv]).flatten(1, 2)
        torch.testing.assert_close(flat[:, slot], plain_flat[:, slot], rtol=1e-5, atol=1e-5)
        untouched = torch.ones(flat.shape[1], dtype=torch.bool)
        untouched[slot] = False
        assert torch.equal(flat[:, untouched], plain_flat[:, untouched])


def test_split_meta_rebases_the_second_half() -> None:
    meta = AttentionMetadata(torch.arange(5) * 3, torch.arange(10, dtype=torch.int32).view(5, 2),
                             torch.arange(6, dtype=torch.int32), torch.tensor([4, 5, 6, 7, 8], dtype=torch.int32),
                             decode_only=True)
    first, second = split_meta(meta, 2)
    assert first.slot_mapping.tolist() == [0, 3] and second.slot_mapping.tolist() == [6, 9, 12]
    assert second.block_tables.tolist() == [[4, 5], [6, 7], [8, 9]]
    assert first.query_start_loc.tolist() == [0, 1, 2] and second.query_start_loc.tolist() == [0, 1, 2, 3]
    assert first.context_lens.tolist() == [4, 5] and second.context_lens.tolist() == [6, 7, 8]


def test_config_refuses_what_it_cannot_run(tmp_path) -> None:
    with pytest.raises(ValueError, match="decode_overlap_min_rows must be >= 2"):
        EngineConfig(str(tmp_path), device="cpu", decode_overlap=True, decode_overlap_min_rows=1)
    with pytest.raises(ValueError, match="decode_overlap is untested with tensor_parallel_size > 1"):
        EngineConfig(str(tmp_path), device="cpu", decode_overlap=True, tensor_parallel_size=2)
    with pytest.raises(ValueError, match="min_rows >= 2"):
        make_plan(True, 1, torch.device("cpu"))
    with pytest.raises(ValueError, match="attention_sms must be >= 0"):
        make_plan(True, 2, torch.device("cpu"), -1)
    with pytest.raises(ValueError, match="decode_overlap_sms must be >= 0"):
        EngineConfig(str(tmp_path), device="cpu", decode_overlap=True, decode_overlap_sms=-4)
    assert make_plan(False, 512, torch.device("cpu")) is None
    assert make_plan(True, 512, torch.device("cpu"), 16) == NanoBatchPlan(512, None)  # one lane: nothing to split


# ---------------------------------------------------------------------------------------------- GPU


@pytest.mark.parametrize("rows", [9, 64])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("attention_sms", [0, 24], ids=["shared-sms", "split-sms"])
@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_two_streams_equal_plain_in_a_graph(arch, rows: int, dtype: torch.dtype, attention_sms: int) -> None:
    """The two lanes captured in one CUDA graph (fork/join through events) write the same K/V and produce the
    plain order's hidden states, replayed twice (the second replay checks that nothing was consumed); also with
    the SMs split (persistent attention, the GEMMs' cuBLAS SM target lowered)."""
    model = load_model(arch[0], "cuda", dtype)
    ids, pos, meta, caches = decode_batch(model, rows, "cuda", dtype)
    plain_caches = [(k.clone(), v.clone()) for k, v in caches]
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    with torch.inference_mode():
        plain = model(ids, pos, meta, plain_caches)
        model.plan_nano_batches(make_plan(True, 2, torch.device("cuda"), attention_sms))
        model(ids, pos, meta, caches)  # eager on two streams first (compiles), then captured
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            halves = model(ids, pos, meta, caches)
        for _ in range(2):
            halves.fill_(float("nan"))
            graph.replay()
            torch.cuda.synchronize()
            torch.testing.assert_close(halves, plain, rtol=tol, atol=tol)
    for (k, v), (pk, pv) in zip(caches, plain_caches, strict=True):
        torch.testing.assert_close(k, pk, rtol=tol, atol=tol)
        torch.testing.assert_close(v, pv, rtol=tol, atol=tol)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_engine_two_streams_greedy_equals_plain_on_gpu(arch, monkeypatch: pytest.MonkeyPatch) -> None:
    """float32 on the GPU with CUDA graphs (buckets captured with the two lanes): tokens equal the plain engine's
    and transformers'."""
    path, hf = arch
    spy = Spy(monkeypatch)
    halves = generate(path, device="cuda", dtype="float32", decode_overlap=True, decode_overlap_min_rows=2,
                      max_num_seqs=8)
    assert spy.calls > 0  # captured into the graphs (each capture is one call)
    assert halves == generate(path, device="cuda", dtype="float32", max_num_seqs=8)
    assert halves == [hf_greedy(hf, p, MAX_NEW) for p in PROMPTS]
