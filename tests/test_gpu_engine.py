"""The engine on the GPU: logits and greedy tokens against transformers, CUDA-graph decode, fast loading.

GPU tests are marked `gpu` and skipped without CUDA; the fast loader and the bucket arithmetic also run on
the CPU so CI checks them everywhere.
"""

from __future__ import annotations

import json
import os
import struct

import pytest
import torch
from stoker.engine.config import EngineConfig
from stoker.engine.cuda_graphs import bucket_sizes, pick_bucket
from stoker.engine.fast_load import load_weights_fast, read_header
from stoker.engine.loader import load_weights
from stoker.engine.make_model import write_tokenizer
from stoker.engine.model_config import ModelConfig
from stoker.engine.models import model_class

CUDA = torch.cuda.is_available()
gpu = [pytest.mark.gpu, pytest.mark.skipif(not CUDA, reason="needs CUDA")]
VOCAB = 384


def _hf_llama(out_dir: str, max_shard_size: str | None = None, init_std: float = 0.08):
    """A small Llama (head_dim 64, GQA 4:1) with random weights scaled so logits are peaked; saved with
    save_pretrained (float32 safetensors) plus make_model's tokenizer. Returns the transformers model."""
    import transformers

    cfg = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=512,
        intermediate_size=1024,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-5,
        initializer_range=init_std,
        bos_token_id=0,
        eos_token_id=1,
        tie_word_embeddings=False,
        rope_theta=10000.0,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, module in model.named_modules():
            if name.endswith("norm"):
                module.weight.uniform_(0.6, 1.4)  # not all ones: a misplaced norm shows
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 1
    model.save_pretrained(out_dir, **({"max_shard_size": max_shard_size} if max_shard_size else {}))
    assert write_tokenizer(out_dir, VOCAB) == VOCAB
    return model


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory):
    path = str(tmp_path_factory.mktemp("gpu_llama"))
    return path, _hf_llama(path, max_shard_size="2MB")  # several shards: the loaders walk the index


@pytest.fixture(scope="module")
def llama_smooth(tmp_path_factory: pytest.TempPathFactory):
    """Initialised at std 0.015: logits of std ~0.35, where bf16 rounding through the layers stays near 1%
    (at std 0.08 transformers' own bf16 run is 5% off its float32 run: no bf16 engine could pass 1e-2)."""
    path = str(tmp_path_factory.mktemp("gpu_llama_smooth"))
    return path, _hf_llama(path, init_std=0.015)


# ---- CPU: bucket arithmetic and the fast loader -----------------------------------------------------------
def test_bucket_sizes_and_pick() -> None:
    assert bucket_sizes(1) == [1]
    assert bucket_sizes(32) == [1, 2, 4, 8, 16, 32]
    assert bucket_sizes(48) == [1, 2, 4, 8, 16, 32, 48]
    sizes = bucket_sizes(48)
    assert [pick_bucket(sizes, n) for n in (1, 2, 3, 5, 17, 33, 48)] == [1, 2, 4, 8, 32, 48, 48]
    with pytest.raises(ValueError, match="no CUDA-graph bucket for a batch of 49"):
        pick_bucket(sizes, 49)
    with pytest.raises(ValueError, match="max_batch must be >= 1"):
        bucket_sizes(0)


def test_buckets_above_64_step_by_64_rows() -> None:
    """Past 64 rows a bucket every 64 (an eighth of an octave once that is larger): a batch of 513 replays
    576, not 1024; the bucket count stays small enough to capture in a couple of seconds."""
    sizes = bucket_sizes(1024)
    assert sizes == [1, 2, 4, 8, 16, 32, 64, *range(128, 1025, 64)]
    assert len(sizes) == 22
    assert [pick_bucket(sizes, n) for n in (65, 129, 200, 513, 575, 577, 1023, 1024)] == [
        128, 192, 256, 576, 576, 640, 1024, 1024]
    assert max(pick_bucket(sizes, n) - n for n in range(65, 1025)) == 63
    big = bucket_sizes(4096)  # 1024-2048 in steps of 128, 2048-4096 of 256
    assert big[21:] == [*range(1024, 2048, 128), *range(2048, 4097, 256)]
    assert bucket_sizes(1000)[-2:] == [960, 1000]  # max_batch off the grid: its own bucket


def _fresh_model(path: str, device: str, dtype: torch.dtype) -> torch.nn.Module:
    mc = ModelConfig.from_folder(path)
    with torch.device(device):
        return model_class(mc.architecture)(mc, dtype, 64)


@pytest.mark.parametrize(
    "device,dtype",
    [
        pytest.param("cpu", torch.float32, id="cpu-f32"),
        pytest.param("cuda", torch.bfloat16, id="cuda-bf16", marks=gpu),
        pytest.param("cuda", torch.float32, id="cuda-f32", marks=gpu),
    ],
)
def test_fast_load_matches_reference_loader(llama, device: str, dtype: torch.dtype) -> None:
    path, _ = llama
    ref, fast = _fresh_model(path, device, dtype), _fresh_model(path, device, dtype)
    for name, p in fast.named_parameters():
        # Anything left unwritten fails the comparison; but the FP8 KV scales keep their constructor value
        # (1.0) when the checkpoint has none (no kv_cache_scheme), under either loader.
        if not name.endswith(("k_scale", "v_scale")):
            p.data.fill_(float("nan"))
    load_weights(ref, path)
    # Tiny chunks and groups: tensors split over many chunks, groups of several tensors, many threads.
    stats = load_weights_fast(
        fast, path, device, threads=4, chunk_bytes=4096 + 8, group_bytes=300_000, progress=False
    )
    assert stats["files"] > 1 and stats["bytes"] > 0
    for (name, a), (_, b) in zip(ref.named_parameters(), fast.named_parameters(), strict=True):
        assert torch.equal(a, b), name


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_fast_load_behind_a_busy_compute_stream(llama, monkeypatch) -> None:
    """The loader's casts run on the compute stream, its copies on a copy stream that does not wait for it. With the
    compute stream held back (a GPU busy with another process or another model's steps; here a sleep kernel ahead
    of every cast), no group's buffer may be overwritten by the next group's copies before its casts ran: every
    parameter equals the reference loader's. Before the fix (fast_load._group_buffer) the buffers came from the
    compute stream's pool, and every engine built while another process kept the GPU busy had corrupt weights."""
    from stoker.engine import fast_load

    path, _ = llama
    ref, fast = _fresh_model(path, "cuda", torch.float32), _fresh_model(path, "cuda", torch.float32)
    load_weights(ref, path)
    for p in fast.parameters():
        p.data.fill_(float("nan"))
    place = fast_load._place

    def late_place(*args, **kwargs):
        torch.cuda._sleep(20_000_000)  # ~10 ms of GPU cycles ahead of this tensor's cast, on the compute stream
        return place(*args, **kwargs)

    monkeypatch.setattr(fast_load, "_place", late_place)
    torch.cuda.synchronize()
    # A cached segment on the compute stream, so no cudaMalloc (which may synchronize the device) happens mid-load
    # and the groups' buffers would come from it, the freed ones coalescing back, as in a long-running process.
    warm = torch.empty(256 * 2**20, dtype=torch.uint8, device="cuda")
    del warm
    stats = load_weights_fast(fast, path, "cuda", threads=4, chunk_bytes=65536, progress=False)
    assert stats["files"] > 1
    for (name, a), (_, b) in zip(ref.named_parameters(), fast.named_parameters(), strict=True):
        if not name.endswith(("k_scale", "v_scale")):
            assert torch.equal(a, b), name


def test_fast_load_rejects_bad_files(tmp_path, llama) -> None:
    path, _ = llama
    short = tmp_path / "short.safetensors"
    short.write_bytes(b"\x01\x02")
    with pytest.raises(ValueError, match="not a safetensors file"):
        read_header(str(short))
    bad = tmp_path / "bad.safetensors"
    header = json.dumps({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 8]}}).encode()
    bad.write_bytes(struct.pack("<Q", len(header)) + header + b"\0" * 16)
    with pytest.raises(ValueError, match="tensor w has a byte range"):
        read_header(str(bad))
    entries = read_header(
        os.path.join(path, sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))[0])
    )
    assert entries == sorted(entries, key=lambda e: e.begin) and all(e.end > e.begin for e in entries)


# ---- GPU: logits and tokens against transformers ---------------------------------------------------------
def _engine(path: str, dtype: str, **kw):
    from stoker.engine.engine import LLMEngine

    return LLMEngine(
        EngineConfig(
            model_path=path,
            device="cuda",
            dtype=dtype,
            max_model_len=256,
            num_kv_blocks=128,
            max_num_seqs=8,
            **kw,
        )
    )


def _input(
    runner,
    ids: list[int],
    positions: list[int],
    slots: list[int],
    tables: list[list[int]],
    qsl: list[int],
    ctx: list[int],
    samples: list[int],
    decode_only: bool,
):
    from stoker.engine.batch import AttentionMetadata, ModelInput

    width = max(len(t) for t in tables)
    tables = [t + [0] * (width - len(t)) for t in tables]
    meta = AttentionMetadata(
        runner._tensor(slots, torch.int64),
        runner._tensor(tables, torch.int32),
        runner._tensor(qsl, torch.int32),
        runner._tensor(ctx, torch.int32),
        decode_only,
    )
    return ModelInput(
        runner._tensor(ids, torch.int64),
        runner._tensor(positions, torch.int64),
        meta,
        runner._tensor(samples, torch.int64),
    )


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_bf16_logits_match_transformers_prefill_and_graph_decode(llama_smooth) -> None:
    """Our bf16 logits against transformers' float32 logits on the same weights: within 1e-2, and no
    further off than transformers' own bf16 run (times 1.25)."""
    import copy

    path, hf = llama_smooth
    hf = hf.to("cuda")
    hf_bf16 = copy.deepcopy(hf).to(torch.bfloat16)
    engine = _engine(path, "bfloat16")
    runner = engine.runner
    assert runner.graphs is not None and runner.graphs.sizes == [1, 2, 4, 8]
    gen = torch.Generator().manual_seed(1)
    lens, extra = [37, 5, 70], 4  # 3 sequences: a decode batch of 3 replays bucket 4 with one pad row
    seqs = [torch.randint(2, VOCAB, (n + extra,), generator=gen).tolist() for n in lens]
    with torch.no_grad():
        ref = [hf(torch.tensor([s], device="cuda")).logits[0].float() for s in seqs]
        peer = [hf_bf16(torch.tensor([s], device="cuda")).logits[0].float() for s in seqs]
    bs = runner.block_size
    tables = [list(range(8 * i, 8 * i + 8)) for i in range(len(seqs))]  # 128 tokens of blocks each

    def slot(i: int, p: int) -> int:
        return tables[i][p // bs] * bs + p % bs

    # Prefill all three prompts in one mixed batch, logits of every prompt position.
    ids, pos, slots, qsl = [], [], [], [0]
    for i, n in enumerate(lens):
        ids += seqs[i][:n]
        pos += list(range(n))
        slots += [slot(i, p) for p in range(n)]
        qsl.append(qsl[-1] + n)
    inp = _input(runner, ids, pos, slots, tables, qsl, lens, list(range(len(ids))), False)
    ours = runner.forward(inp)
    theirs = torch.cat([ref[i][:n] for i, n in enumerate(lens)])
    err = ((ours - theirs).norm() / theirs.norm()).item()
    hf_err = max((((p - r).norm() / r.norm()).item() for p, r in zip(peer, ref, strict=True)))
    assert err <= 1e-2 and err <= 1.25 * hf_err, (
        f"prefill logits rel error {err:.2e} (transformers bf16 {hf_err:.2e})"
    )
    # Decode the next tokens (teacher-forced) through the captured graphs.
    before = runner.graphs.replays
    for step in range(extra):
        p = [n + step for n in lens]
        inp = _input(
            runner,
            [seqs[i][p[i]] for i in range(3)],
            p,
            [slot(i, p[i]) for i in range(3)],
            tables,
            [0, 1, 2, 3],
            [x + 1 for x in p],
            [0, 1, 2],
            True,
        )
        ours = runner.forward(inp)
        theirs = torch.stack([ref[i][p[i]] for i in range(3)])
        err = ((ours - theirs).norm() / theirs.norm()).item()
        assert err <= 1e-2 and err <= 1.25 * hf_err, f"decode step {step}: logits rel error {err:.2e}"
    assert runner.graphs.replays == before + extra


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("cuda_graphs", [True, False], ids=["graphs", "eager"])
def test_fp32_greedy_tokens_match_transformers(llama, cuda_graphs: bool) -> None:
    from stoker.engine import EngineRequest, SamplingParams

    path, hf = llama
    hf = hf.to("cuda")
    engine = _engine(path, "float32", cuda_graphs=cuda_graphs)
    # which sampling calls took the greedy ids the decode graph computed (cuda_graphs.GREEDY_IN_GRAPH_MAX)
    taken: list[bool] = []
    sampler = engine.runner.sampler
    engine.runner.sampler = lambda logits, b, greedy=None: taken.append(greedy is not None) or sampler(
        logits, b, greedy=greedy)
    replays0 = engine.runner.graphs.replays if cuda_graphs else 0
    gen = torch.Generator().manual_seed(2)
    prompts = {f"r{n}": torch.randint(2, VOCAB, (n,), generator=gen).tolist() for n in (5, 17, 33, 64, 1)}
    for rid, ids in prompts.items():
        engine.add_request(EngineRequest(
            rid, prompt_token_ids=ids, params=SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
        ))
    got: dict[str, list[int]] = {rid: [] for rid in prompts}
    while engine.has_unfinished():
        for out in engine.step():
            assert out.error_code is None, out.error_message
            got[out.request_id] += out.new_token_ids
    for rid, ids in prompts.items():
        with torch.no_grad():
            want = hf.generate(torch.tensor([ids], device="cuda"), max_new_tokens=24, do_sample=False)
        assert got[rid] == want[0, len(ids) :].tolist(), rid
    if cuda_graphs:  # every replayed step sampled from the graph's own argmax (all rows sample, <= 8 rows)
        assert engine.runner.graphs is not None and engine.runner.graphs.replays >= 20
        assert sum(taken) == engine.runner.graphs.replays - replays0
        assert engine.runner.startup["graph_capture_s"] > 0 and engine.runner.startup["load_s"] > 0
    else:
        assert engine.runner.graphs is None and not any(taken)


_GPU_HOG = """
import sys, time, torch
a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
print("ready", flush=True)
end = time.time() + float(sys.argv[1])
while time.time() < end:
    for _ in range(10):
        a @ a
    torch.cuda.synchronize()
"""


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_engines_built_while_another_process_keeps_the_gpu_busy(llama) -> None:
    """A worker may start (or load a second model) on a GPU another process or model is using: its CUDA work then
    waits for time slices while the host runs ahead. Engines built and stepped then must still load the right
    weights and give transformers' greedy tokens (float32). Before fast_load._group_buffer every engine built
    under such a load in a session-12 stress run had corrupt weights (wrong tokens from the first one)."""
    import subprocess
    import sys

    from stoker.engine import EngineRequest, SamplingParams

    path, hf = llama
    hf = hf.to("cuda")
    gen = torch.Generator().manual_seed(4)
    prompts = [torch.randint(2, VOCAB, (n,), generator=gen).tolist() for n in (3, 6, 2, 9, 45)]
    with torch.no_grad():
        want = [hf.generate(torch.tensor([p], device="cuda"), max_new_tokens=8, do_sample=False)[0, len(p) :].tolist()
                for p in prompts]
    hog = subprocess.Popen([sys.executable, "-c", _GPU_HOG, "90"], stdout=subprocess.PIPE, text=True)
    try:
        assert hog.stdout is not None and hog.stdout.readline().strip() == "ready"
        for build in range(2):
            engine = _engine(path, "float32", max_num_batched_tokens=24)
            for i, p in enumerate(prompts):
                engine.add_request(EngineRequest(f"b{build}-{i}", prompt_token_ids=p,
                                                 params=SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)))
            got: dict[str, list[int]] = {}
            while engine.has_unfinished():
                for out in engine.step():
                    assert out.error_code is None, out.error_message
                    got.setdefault(out.request_id, []).extend(out.new_token_ids)
            assert [got[f"b{build}-{i}"] for i in range(len(prompts))] == want, f"engine {build}"
            assert hog.poll() is None, "the competing process ended before the engine did: the GPU was not shared"
            engine.close()
    finally:
        hog.kill()
        hog.wait()


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_mixed_steps_compile_no_new_triton_variants_and_waits_sleep(llama) -> None:
    """After one warm-up request, mixed prefill/decode steps of other token and sequence counts reuse the
    compiled kernels: a variant compiled mid-run costs ~1 s of host time while the GPU idles. And the
    engine switched the GPU's waits to blocking sync (sleep, not spin)."""
    from stoker.engine import EngineRequest, SamplingParams
    from stoker.engine.kernels import activation, attention, rmsnorm, rotary

    path, _ = llama
    # Eager lone prompts: with prefill graphs the one warm-up request would replay a graph (whose variants were
    # compiled at capture) and leave the eager variants this test is about to the mixed steps.
    engine = _engine(path, "bfloat16", prefill_graph_tokens=0)
    assert engine.runner.startup["blocking_sync"] is True
    kernels = {
        "prefill": attention._prefill_kernel,
        "rotary": rotary._rotary_and_cache_kernel,
        "rms_norm": rmsnorm._rms_norm_kernel,
        "silu": activation._silu_and_mul_kernel,
    }

    def variants() -> dict[str, int]:
        return {k: sum(len(c[0]) for c in fn.device_caches.values()) for k, fn in kernels.items()}

    def run(prompts: list[list[int]]) -> int:
        steps = 0
        for i, ids in enumerate(prompts):  # one add per step: batches of 1..n sequences, odd and even sizes
            engine.add_request(EngineRequest(f"x{len(prompts)}-{i}", prompt_token_ids=ids, params=SamplingParams(max_tokens=6)))
            engine.step()
            steps += 1
        while engine.has_unfinished():
            for out in engine.step():
                assert out.error_code is None, out.error_message
            steps += 1
        return steps

    gen = torch.Generator().manual_seed(3)
    run([torch.randint(2, VOCAB, (5,), generator=gen).tolist()])
    before = variants()
    run([torch.randint(2, VOCAB, (n,), generator=gen).tolist() for n in (7, 12, 33, 3, 18, 1, 64)])
    assert variants() == before


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("split", [True, False], ids=["split", "whole"])
def test_fp32_greedy_tokens_match_transformers_in_mixed_steps(llama, split: bool) -> None:
    """Requests join a decoding batch with prompts chunked over several steps (a small token budget), so mixed
    steps carry >= 4 decode rows: with mixed_decode_attention they run the decode kernel, the chunks the prefill
    kernel; greedy tokens equal transformers either way (the split is checked to have happened)."""
    from stoker.engine import EngineRequest, SamplingParams

    path, hf = llama
    hf = hf.to("cuda")
    engine = _engine(path, "float32", max_num_batched_tokens=24, mixed_decode_attention=split)
    splits: list[int] = []
    to_device = engine.runner.to_device
    engine.runner.to_device = lambda packed, prev: (splits.append(packed.num_decodes), to_device(packed, prev))[1]
    gen = torch.Generator().manual_seed(4)
    plan = {0: (3, 6, 2, 9, 4), 3: (45,), 6: (70, 1)}  # step -> prompt lengths added before it
    prompts: dict[str, list[int]] = {}
    got: dict[str, list[int]] = {}
    step = 0
    while engine.has_unfinished() or step <= max(plan):
        for n in plan.get(step, ()):
            rid = f"m{len(prompts)}"
            prompts[rid] = torch.randint(2, VOCAB, (n,), generator=gen).tolist()
            got[rid] = []
            engine.add_request(EngineRequest(rid, prompt_token_ids=prompts[rid],
                                             params=SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)))
        for out in engine.step():
            assert out.error_code is None, out.error_message
            got[out.request_id] += out.new_token_ids
        step += 1
    assert any(splits) is split, splits
    for rid, ids in prompts.items():
        with torch.no_grad():
            want = hf.generate(torch.tensor([ids], device="cuda"), max_new_tokens=16, do_sample=False)
        assert got[rid] == want[0, len(ids) :].tolist(), rid
