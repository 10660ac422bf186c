"""The FP8 KV cache (issue 14, `kv_cache_dtype="fp8"`): the torch reference paths on the CPU.

What is checked, each against something computed another way:
- the cache write stores e4m3(k / k_scale) and e4m3(v / v_scale), saturated, bit for bit;
- attention on an FP8 cache is float32 attention on the dequantized values (a dense SDPA, up to rounding),
  and differs from attention on the unquantized cache by no more than e4m3's rounding can explain;
- the same memory budget holds twice the blocks of a bfloat16 cache;
- the whole engine's greedy tokens and logprobs equal transformers' with an attention that rounds its keys and
  values through the same e4m3 format, with the default scales (1.0) and with a checkpoint's k_scale/v_scale
  (the published Llama-3.1-FP8 layout), whose value is checked to reach the cache write;
- the worker's flag and variable reach EngineConfig.
The Triton kernels' FP8 variants are tested in test_kernels_fp8_kv.py. Random weights: this measures that
we compute the format's arithmetic, not quantization quality (ops/fp8_quality.py does that on a trained model).
"""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
import torch.nn.functional as F
from engine_models import build_hf_model, hf_greedy, hf_logits, prompts
from stoker.engine import EngineRequest, SamplingParams
from stoker.engine.config import EngineConfig
from stoker.engine.engine import LLMEngine
from stoker.engine.kernels import (
    paged_attention_ref,
    paged_decode_attention_ref,
    rope_cos_sin,
    rotary_and_cache_ref,
)
from stoker.engine.kernels.kv_quant import FP8_KV_DTYPE
from stoker.engine.kv_cache import kv_bytes_per_block, num_kv_blocks
from stoker.engine.model_config import ModelConfig

E4M3_UNIT_ROUNDOFF = 2.0**-4  # 3 mantissa bits: a normal value is off by at most half an ulp, 2^-4 relative
E4M3_SUBNORMAL_HALF_ULP = 2.0**-10  # below 2^-6 the grid is uniform with step 2^-9 (absolute, per unit scale)
PROMPTS = prompts(5, [9, 23])
MAX_NEW = 8
TOP = 5
# float32 end to end (see test_fp8.LOGPROB_ATOL), plus the rare key whose float32 value sits on an e4m3
# rounding boundary and rounds the other way in transformers' order of operations.
LOGPROB_ATOL = 2e-3


# ----------------------------------------------------------------------------------------------- helpers


def _e4m3(x: torch.Tensor, scale: float | torch.Tensor) -> torch.Tensor:
    """The format written out here, apart from engine/kernels/kv_quant.py: x / scale in float32, saturated at
    e4m3fn's largest finite value 448, rounded to nearest even by torch's cast."""
    return (x.float() / torch.as_tensor(scale, dtype=torch.float32)).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)


def _e4m3_values(x: torch.Tensor, scale: float | torch.Tensor) -> torch.Tensor:
    """What a read of _e4m3(x, scale) means: the stored number times the scale, in float32."""
    return _e4m3(x, scale).float() * torch.as_tensor(scale, dtype=torch.float32)



def _paged_case(seed: int, context_lens: list[int], query_lens: list[int], block_size: int = 4,
                num_kv_heads: int = 2, group: int = 3, head_dim: int = 24) -> dict:
    """Random float32 k/v caches with each sequence's blocks scattered over the cache, and its queries."""
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-c // block_size) for c in context_lens]
    num_blocks = sum(blocks_per_seq) + 3  # spare blocks hold values no sequence may read
    order = torch.randperm(num_blocks, generator=gen).tolist()
    tables = torch.zeros(len(context_lens), max(blocks_per_seq), dtype=torch.int32)
    for b, n in enumerate(blocks_per_seq):
        tables[b, :n] = torch.tensor(order[:n])
        order = order[n:]
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    return dict(
        q=torch.randn(sum(query_lens), num_kv_heads * group, head_dim, generator=gen),
        k=torch.randn(shape, generator=gen) * 1.5, v=torch.randn(shape, generator=gen) * 3.0,
        block_tables=tables, context_lens=torch.tensor(context_lens, dtype=torch.int32),
        query_start_loc=torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32),
        scale=head_dim**-0.5,
    )


def _gather(cache: torch.Tensor, table: torch.Tensor, ctx: int) -> torch.Tensor:
    pos = torch.arange(ctx)
    return cache[table[pos // cache.shape[1]].long(), pos % cache.shape[1]]  # [ctx, Hkv, D]


def _dense_attention(case: dict, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """Causal SDPA per sequence over float32 keys/values laid out like the cache: the independent reference."""
    q, out = case["q"], torch.zeros_like(case["q"])
    starts = case["query_start_loc"].tolist()
    for b, ctx in enumerate(case["context_lens"].tolist()):
        n = starts[b + 1] - starts[b]
        k = _gather(keys, case["block_tables"][b], ctx).transpose(0, 1)  # [Hkv, ctx, D]
        v = _gather(values, case["block_tables"][b], ctx).transpose(0, 1)
        visible = torch.arange(ctx)[None, :] <= torch.arange(ctx - n, ctx)[:, None]
        o = F.scaled_dot_product_attention(q[starts[b]:starts[b + 1]].transpose(0, 1), k, v, attn_mask=visible,
                                           scale=case["scale"], enable_gqa=True)
        out[starts[b]:starts[b + 1]] = o.transpose(0, 1)
    return out


def _paged(case: dict, k_cache: torch.Tensor, v_cache: torch.Tensor, decode: bool, **scales) -> torch.Tensor:
    if decode:
        return paged_decode_attention_ref(case["q"], k_cache, v_cache, case["block_tables"], case["context_lens"],
                                          case["scale"], **scales)
    return paged_attention_ref(case["q"], k_cache, v_cache, case["block_tables"], case["query_start_loc"],
                               case["context_lens"], case["scale"], **scales)


CASES = {  # (context lengths, query lengths): decode-only, and prefill chunks mixed with decodes
    "decode": ([13, 1, 30], [1, 1, 1]),
    "mixed": ([17, 5, 26], [17, 1, 9]),
}
K_SCALE, V_SCALE = torch.tensor([0.37]), torch.tensor([2.5])  # distinct, so a swapped scale shows


# -------------------------------------------------------------------------------------- reference attention


@pytest.mark.parametrize("kind", list(CASES))
def test_attention_on_an_fp8_cache_is_float32_attention_on_the_dequantized_values(kind) -> None:
    case = _paged_case(1, *CASES[kind])
    k8, v8 = _e4m3(case["k"], K_SCALE), _e4m3(case["v"], V_SCALE)
    assert k8.dtype == FP8_KV_DTYPE and k8.element_size() == 1
    got = _paged(case, k8, v8, kind == "decode", k_scale=K_SCALE, v_scale=V_SCALE)
    expected = _dense_attention(case, k8.float() * K_SCALE, v8.float() * V_SCALE)
    torch.testing.assert_close(got, expected, atol=2e-6, rtol=1e-5)


def _e4m3_error_bound(case: dict, k_scale: float, v_scale: float) -> torch.Tensor:
    """Per (query, head): the most |out_fp8 - out| can be, to first order, when every cached element x is off
    by at most u|x| + a*scale (u = 2^-4: half an ulp of 3 mantissa bits; a = 2^-10: e4m3's subnormal step).
    A key's score moves by at most d_j = softmax_scale * sum_i |q_i| (u |k_ji| + a k_scale), so its probability
    p_j by at most p_j (d_j + sum_l p_l d_l); hence |dout| <= sum_j p_j |dv_j| + sum_j p_j (d_j + dbar) |v_j|.
    Sound in the worst case (every rounding aligned), so typical errors sit well inside it."""
    u, a = E4M3_UNIT_ROUNDOFF, E4M3_SUBNORMAL_HALF_ULP
    starts, bound = case["query_start_loc"].tolist(), torch.zeros(case["q"].shape[:2])
    group = case["q"].shape[1] // case["k"].shape[2]
    for b, ctx in enumerate(case["context_lens"].tolist()):
        rows, n = slice(starts[b], starts[b + 1]), starts[b + 1] - starts[b]
        k = _gather(case["k"], case["block_tables"][b], ctx).repeat_interleave(group, dim=1)  # [ctx, Hq, D]
        v = _gather(case["v"], case["block_tables"][b], ctx).repeat_interleave(group, dim=1).abs()
        q = case["q"][rows]
        visible = torch.arange(ctx)[None, None, :] <= torch.arange(ctx - n, ctx)[:, None, None]
        probs = (torch.einsum("qhd,khd->qhk", q, k) * case["scale"]).masked_fill(~visible, float("-inf")).softmax(-1)
        d = case["scale"] * torch.einsum("qhd,khd->qhk", q.abs(), u * k.abs() + a * k_scale)
        d_mean = (probs * d).sum(-1, keepdim=True)
        v_part = torch.einsum("qhk,khd->qhd", probs, u * v + a * v_scale)
        score_part = torch.einsum("qhk,khd->qhd", probs * (d + d_mean), v)
        bound[rows] = (v_part + score_part).amax(-1)
    return bound


@pytest.mark.parametrize("kind", list(CASES))
def test_fp8_cache_error_against_the_unquantized_cache_is_within_e4m3_rounding(kind) -> None:
    """The error of attention on the FP8 cache, per query and head, stays inside _e4m3_error_bound (with 25%
    for second-order terms; observed: under 20% of it). Small heads (D = 8) keep the worst case close to the
    typical one, so a cache read without its scales (2x the bound here) fails."""
    case = _paged_case(2, *CASES[kind], head_dim=8)
    k8, v8 = _e4m3(case["k"], K_SCALE), _e4m3(case["v"], V_SCALE)
    got = _paged(case, k8, v8, kind == "decode", k_scale=K_SCALE, v_scale=V_SCALE)
    exact = _paged(case, case["k"], case["v"], kind == "decode")
    error = (got - exact).abs().amax(-1)  # [T, Hq]
    bound = 1.25 * _e4m3_error_bound(case, K_SCALE.item(), V_SCALE.item()) + 1e-6
    assert error.max() > 0 and (error <= bound).all(), (error / bound).max().item()


def test_cache_write_stores_rotated_k_and_v_over_their_scales_in_e4m3() -> None:
    """rotary_and_cache_ref into an FP8 cache stores exactly e4m3(x / scale) of what it stores into a float32 one:
    the rotated k over k_scale, v over v_scale, saturated at +-448 (never NaN); padding slots stay untouched."""
    gen = torch.Generator().manual_seed(3)
    tokens, heads, kv_heads, dim = 7, 4, 2, 16
    q = torch.randn(tokens, heads, dim, generator=gen)
    k = torch.randn(tokens, kv_heads, dim, generator=gen)
    v = torch.randn(tokens, kv_heads, dim, generator=gen)
    v[2, 1, 5] = 1000.0 * V_SCALE.item()  # beyond e4m3's range after the division
    positions = torch.tensor([0, 3, 4, 9, 10, 11, 40])
    slots = torch.tensor([5, 0, 11, -1, 2, 7, 9])  # -1: a padding token, written nowhere
    cos_sin = rope_cos_sin(dim, 64, 10000.0, None)
    shape = (4, 4, kv_heads, dim)
    kf, vf = torch.zeros(shape), torch.zeros(shape)
    k8, v8 = torch.zeros(shape, dtype=FP8_KV_DTYPE), torch.zeros(shape, dtype=FP8_KV_DTYPE)
    rotary_and_cache_ref(q.clone(), k.clone(), v.clone(), positions, cos_sin, kf, vf, slots)
    rotary_and_cache_ref(q.clone(), k.clone(), v.clone(), positions, cos_sin, k8, v8, slots, K_SCALE, V_SCALE)
    assert torch.equal(k8.view(torch.uint8), _e4m3(kf, K_SCALE).view(torch.uint8))
    assert torch.equal(v8.view(torch.uint8), _e4m3(vf, V_SCALE).view(torch.uint8))
    assert v8.view(-1, kv_heads, dim)[11, 1, 5].float().item() == 448.0
    written = torch.zeros(16, dtype=torch.bool)
    written[slots[slots >= 0]] = True
    assert not k8.view(-1, kv_heads, dim)[~written].float().any()
    assert (k8.float() * K_SCALE).sub(kf).abs().max() <= E4M3_UNIT_ROUNDOFF * kf.abs().max()


def test_an_fp8_cache_without_its_scales_is_refused() -> None:
    case = _paged_case(4, [5], [5])
    k8, v8 = _e4m3(case["k"], K_SCALE), _e4m3(case["v"], V_SCALE)
    with pytest.raises(ValueError, match="FP8 KV cache needs a float32 one-element scale tensor on cpu"):
        _paged(case, k8, v8, False)


# ------------------------------------------------------------------------------------------- the engine


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> tuple[str, object]:
    path = str(tmp_path_factory.mktemp("fp8kv_llama"))
    return path, build_hf_model("llama", path)


def test_the_same_budget_holds_twice_the_blocks_of_a_bfloat16_cache(llama) -> None:
    path, _ = llama
    model = ModelConfig.from_folder(path)
    bf16_block = kv_bytes_per_block(model, 16, torch.bfloat16)
    budget = 37 * bf16_block + bf16_block // 2
    blocks = {kv: num_kv_blocks(model, EngineConfig(model_path=path, device="cpu", dtype="bfloat16",
                                                     kv_cache_memory_bytes=budget, kv_cache_dtype=kv))
              for kv in ("auto", "fp8")}
    assert blocks == {"auto": 37, "fp8": 75}  # 37.5 bf16 blocks' bytes: 75 one-byte blocks
    engine = LLMEngine(EngineConfig(model_path=path, device="cpu", kv_cache_memory_bytes=budget, kv_cache_dtype="fp8"))
    k_cache, v_cache = engine.runner.kv_caches[0]
    assert k_cache.dtype == v_cache.dtype == FP8_KV_DTYPE and engine.runner.num_blocks == 75
    assert sum(k.numel() + v.numel() for k, v in engine.runner.kv_caches) <= budget


class Fp8KVReference:
    """transformers' model with an attention that rounds its keys and values through e4m3 with the layer's
    scales before a plain SDPA: the FP8 KV cache computed independently of our kernels."""

    NAME = "stoker_fp8_kv_reference"

    def __init__(self, model, k_scale: float = 1.0, v_scale: float = 1.0):
        from transformers import AttentionInterface, AttentionMaskInterface
        from transformers.integrations.sdpa_attention import sdpa_attention_forward
        from transformers.masking_utils import sdpa_mask

        scales = torch.tensor([k_scale]), torch.tensor([v_scale])

        def attention(module, query, key, value, attention_mask, **kwargs):  # type: ignore[no-untyped-def]
            key, value = _e4m3_values(key, scales[0]), _e4m3_values(value, scales[1])
            return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)

        AttentionInterface.register(self.NAME, attention)
        AttentionMaskInterface.register(self.NAME, sdpa_mask)
        model.set_attn_implementation(self.NAME)
        self.model = model


def _run(engine: LLMEngine, ids: list[int], max_tokens: int = MAX_NEW) -> tuple[list[int], list]:
    engine.add_request(EngineRequest(f"r{len(ids)}-{max_tokens}", prompt_token_ids=ids, params=SamplingParams(
        max_tokens=max_tokens, temperature=0, ignore_eos=True, logprobs=TOP)))
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    assert outs[-1].finished and outs[-1].error_code is None, outs[-1]
    return [t for o in outs for t in o.new_token_ids], [lp for o in outs for lp in (o.logprobs or [])]


def _assert_matches(engine: LLMEngine, reference) -> None:
    """Greedy tokens equal the reference's and each of our top logprobs is the reference's, at LOGPROB_ATOL."""
    for ids in PROMPTS:
        out_ids, lps = _run(engine, ids)
        assert out_ids == hf_greedy(reference, ids, MAX_NEW)
        ref = hf_logits(reference, ids + out_ids).log_softmax(-1)[len(ids) - 1 : -1]
        for i, lp in enumerate(lps):
            for t in lp.top:
                assert abs(t.logprob - ref[i, t.token_id].item()) < LOGPROB_ATOL, (i, t.token_id)


def test_engine_with_an_fp8_cache_matches_a_reference_that_rounds_its_cache_the_same_way(llama) -> None:
    """Scales 1.0 (a checkpoint without kv_cache_scheme). Decodes run the paged decode path, prompts the
    prefill path; both read the cache back through e4m3."""
    import copy

    path, model = llama
    engine = LLMEngine(EngineConfig(model_path=path, device="cpu", num_kv_blocks=32, kv_cache_dtype="fp8"))
    assert engine.runner.model.model.layers[0].self_attn.attn.k_scale.item() == 1.0
    _assert_matches(engine, Fp8KVReference(copy.deepcopy(model)).model)


def _published_fp8_checkpoint(source: tuple[str, object], path: str, k_scale: float, v_scale: float,
                              with_scales: bool = True):
    """A small model in the published Llama-3.1-8B-Instruct-FP8 layout (test_fp8.PUBLISHED["FP8"]: static
    per-tensor FP8 weights and activations, kv_cache_scheme) with per-layer self_attn.k_scale / v_scale."""
    from engine_models import build_fp8_checkpoint
    from safetensors.torch import load_file, save_file
    from test_fp8 import ARCHS_LAYERS, PUBLISHED

    src, model = source
    preset, qc = PUBLISHED["FP8"]
    reference = build_fp8_checkpoint(model, path, preset, prompts(9, [24, 11]))
    for name in os.listdir(src):
        if not name.endswith(".safetensors") and name != "config.json":
            shutil.copy(os.path.join(src, name), path)
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    cfg["quantization_config"] = qc
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    tensors = load_file(os.path.join(path, "model.safetensors"))
    for i in range(ARCHS_LAYERS if with_scales else 0):
        tensors[f"model.layers.{i}.self_attn.k_scale"] = torch.tensor(k_scale)
        tensors[f"model.layers.{i}.self_attn.v_scale"] = torch.tensor(v_scale)
    save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    return reference


@pytest.fixture(scope="module")
def fp8_source(tmp_path_factory) -> tuple[str, object]:
    pytest.importorskip("compressed_tensors")
    from engine_models import ARCHS, FP8_DIMS

    ARCHS.setdefault("llama_fp8", ("LlamaConfig", FP8_DIMS))
    path = str(tmp_path_factory.mktemp("fp8kv_fp8_source"))
    return path, build_hf_model("llama_fp8", path)


def test_checkpoint_kv_scales_reach_the_cache_write_and_the_reads(fp8_source, tmp_path) -> None:
    """k_scale/v_scale from a kv_cache_scheme checkpoint: layer 0's cache after a prompt holds exactly
    e4m3(k / k_scale) of the k a float32 cache holds for the same prompt (layer 0's k does not depend on
    the cache), and the generated tokens and logprobs are those of the reference with these scales."""
    k_scale, v_scale = 0.0421, 0.0173
    reference = _published_fp8_checkpoint(fp8_source, str(tmp_path), k_scale, v_scale)
    ids = PROMPTS[1]
    caches = {}
    for kv in ("auto", "fp8"):
        engine = LLMEngine(EngineConfig(model_path=str(tmp_path), device="cpu", num_kv_blocks=32, kv_cache_dtype=kv))
        _run(engine, ids, max_tokens=1)  # the prompt alone is written (a sampled token is cached on its next step)
        caches[kv] = engine.runner.kv_caches[0]
    attn = engine.runner.model.model.layers[1].self_attn.attn
    assert (attn.k_scale.item(), attn.v_scale.item()) == (torch.tensor(k_scale).item(), torch.tensor(v_scale).item())
    for float_cache, fp8_cache, scale in zip(caches["auto"], caches["fp8"], (k_scale, v_scale), strict=True):
        assert float_cache.abs().max() > 10 * scale  # values that a scale of 1.0 would store otherwise
        expected = _e4m3(float_cache, torch.tensor([scale]))
        assert torch.equal(fp8_cache.view(torch.uint8), expected.view(torch.uint8))
    _assert_matches(engine, Fp8KVReference(reference, k_scale, v_scale).model)


def test_a_kv_cache_scheme_checkpoint_without_its_scales_is_refused(fp8_source, tmp_path) -> None:
    _published_fp8_checkpoint(fp8_source, str(tmp_path), 1.0, 1.0, with_scales=False)
    with pytest.raises(ValueError, match=r"lacks weights for: .*self_attn\.attn\.k_scale"):
        LLMEngine(EngineConfig(model_path=str(tmp_path), device="cpu", num_kv_blocks=8, kv_cache_dtype="fp8"))


def test_unknown_kv_cache_dtype_is_refused_naming_the_choices(llama) -> None:
    with pytest.raises(ValueError, match=r"kv_cache_dtype must be one of \('auto', 'fp8'\), got 'fp16'"):
        EngineConfig(model_path=llama[0], device="cpu", kv_cache_dtype="fp16")


def test_worker_flag_and_variable_reach_the_engine_config(llama, capsys, monkeypatch) -> None:
    import stoker.engine
    from stoker.worker import main as worker_main

    path = llama[0]
    cfg = worker_main.parse_config(["--model", path, "--kv-cache-dtype", "fp8", "--no-warmup"], {})
    built: list[EngineConfig] = []
    monkeypatch.setattr(stoker.engine, "LLMEngine", built.append)  # the config build_engine makes, no engine
    worker_main.build_engine(cfg)
    assert built[0].kv_cache_dtype == "fp8"
    assert worker_main.parse_config(["--model", path], {"STOKER_KV_CACHE_DTYPE": "fp8"}).kv_cache_dtype == "fp8"
    assert worker_main.parse_config(["--model", path], {}).kv_cache_dtype == "auto"
    with pytest.raises(SystemExit) as exit_:
        worker_main.parse_config(["--model", path, "--kv-cache-dtype", "e5m2"], {})
    assert exit_.value.code == 2 and "--kv-cache-dtype must be auto or fp8, got 'e5m2'" in capsys.readouterr().err


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_engine_with_an_fp8_cache_matches_its_torch_reference_path(llama) -> None:
    """On CUDA (float32, so the comparison is tight): the Triton cache writes (the rotary kernel's in prefill, the
    fused decode path's qkv epilogue in decode steps: decode_kernels "auto") and both attention kernels' FP8
    variants, under CUDA graphs, give the tokens and logprobs of the same engine on the torch references."""
    path, _ = llama
    runs = {}
    for use_triton in (True, False):
        engine = LLMEngine(EngineConfig(model_path=path, device="cuda", dtype="float32", num_kv_blocks=64,
                                        kv_cache_dtype="fp8", use_triton=use_triton, max_num_seqs=8))
        runs[use_triton] = [_run(engine, ids) for ids in PROMPTS]
        engine.close()
    for (fast_ids, fast_lps), (ref_ids, ref_lps) in zip(runs[True], runs[False], strict=True):
        assert fast_ids == ref_ids
        for fast, ref in zip(fast_lps, ref_lps, strict=True):
            for a, b in zip(fast.top, ref.top, strict=True):
                assert a.token_id == b.token_id and abs(a.logprob - b.logprob) < LOGPROB_ATOL
