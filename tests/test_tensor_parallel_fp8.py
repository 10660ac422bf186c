"""FP8 checkpoints at tensor_parallel_size 2 (issue 17) on the CPU: real gloo groups of spawned processes,
float32.

The FP8 tensor-parallel twins against the unsharded FP8 layer on the same checkpoint tensors, in every weight
scheme (per tensor with scalar or [1] scales and static input scales, per channel, 128 x 128 blocks under both
scale names, quantized at load), on each path a layer takes: forward, forward_after_norm, and the row-parallel
forward_after_silu, also down its CUDA branch (the fused SiLU-mul-quantize and _scaled_mm, stood in for by
float32 fakes here) which skips forward; then the engine at TP=2 against TP=1 on compressed-tensors
checkpoints of each preset. On the CPU the FP8 layers dequantize and multiply in float32 (no activation
quantization), so the ranks' sums equal the unsharded products up to the order of the float sums."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from engine_models import FP8_PRESETS, build_fp8_checkpoint, build_hf_model, prompts
from stoker.engine import EngineConfig, EngineRequest, SamplingParams
from stoker.engine.engine import LLMEngine
from stoker.engine.kernels.fp8_linear import FP8_DTYPE, dequantize
from stoker.engine.layers import (
    Fp8ColumnParallelGateUp,
    Fp8ColumnParallelQKV,
    Fp8GateUpLinear,
    Fp8Linear,
    Fp8QKVLinear,
    Fp8RowParallelLinear,
)
from stoker.engine.parallel.plan import ShardPlan
from stoker.engine.quant_config import LOAD_TIME_FP8, Fp8Scheme
from stoker.ops.rank_processes import run_ranks
from test_tensor_parallel import _relative, _silu_mul

# Every split on a 128 multiple at 2 ranks, so the block scheme runs too: q rows 2 x 128 a rank, KV rows 128
# (one of 2 KV heads, or the one KV head replicated), intermediate 256; the hidden size two column blocks.
HEAD_DIM, HIDDEN, INTERMEDIATE, TOKENS = 128, 256, 512, 5
SCHEMES = {
    "tensor-static": Fp8Scheme("compressed-tensors", "tensor", "static"),  # scales [1]
    "fp8-tensor-static": Fp8Scheme("fp8", "tensor", "static"),  # AutoFP8's scalar scales []
    "channel-dynamic": Fp8Scheme("compressed-tensors", "channel", "dynamic"),
    "block": Fp8Scheme("compressed-tensors", "block", "dynamic", (128, 128)),
    "fp8-block-inv": Fp8Scheme("fp8", "block", "dynamic", (128, 128), "weight_scale_inv"),
    "load-time": LOAD_TIME_FP8,  # bf16/fp32 weights, quantized per row as each rank copies its part in
}


# ---- the sharded FP8 layers against the unsharded ones ---------------------------------------------------------
def _quantized(w: torch.Tensor, scheme: Fp8Scheme, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """One checkpoint projection in `scheme`'s layout: weight (float8, or float for load-time), its scale as the
    format stores it, and a static input scale (a different one per projection, so their max matters)."""
    if scheme.quantize_at_load:
        # The row's absmax in every 128-column block: a row-parallel rank's columns then quantize with the
        # whole row's scale, to the same bytes as the unsharded layer's (any absmax would be right, this one
        # is comparable).
        w[:, ::128] = w.abs().amax(dim=1, keepdim=True)
        return {"weight": w}
    if scheme.weight_strategy == "tensor":
        scale = w.abs().max() / 448
        stored = scale.reshape(()) if scheme.method == "fp8" else scale.reshape(1)
    elif scheme.weight_strategy == "channel":
        scale = stored = w.abs().amax(dim=1, keepdim=True) / 448  # [N, 1]
    else:
        tiles = w.reshape(w.shape[0] // 128, 128, w.shape[1] // 128, 128).abs().amax(dim=(1, 3))
        stored = tiles / 448  # [N/128, K/128]
        scale = stored.repeat_interleave(128, 0).repeat_interleave(128, 1)
    out = {"weight": (w / scale).to(FP8_DTYPE), scheme.weight_scale_name: stored}
    if scheme.activations == "static":
        value = torch.rand(1, generator=gen) * 0.1 + 0.01
        out["input_scale"] = value.reshape(()) if scheme.method == "fp8" else value
    return out


def _checkpoint(scheme: Fp8Scheme, hq: int, hkv: int) -> dict[str, dict[str, torch.Tensor]]:
    """One layer's checkpoint projections (and inputs under "x"), the same on every rank (seeded)."""
    gen = torch.Generator().manual_seed(hq * 10 + hkv)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen)

    q, kv = hq * HEAD_DIM, hkv * HEAD_DIM
    shapes = {"q": (q, HIDDEN), "k": (kv, HIDDEN), "v": (kv, HIDDEN), "o": (HIDDEN, q), "gate": (INTERMEDIATE, HIDDEN),
              "up": (INTERMEDIATE, HIDDEN), "down": (HIDDEN, INTERMEDIATE)}
    ck = {name: _quantized(randn(*shape), scheme, gen) for name, shape in shapes.items()}
    for name in ("q", "k", "v", "o", "down"):  # biases: q/k/v's by row, o/down's once after the sum
        ck[name]["bias"] = randn(shapes[name][0])
    ck["x"] = {"x": randn(TOKENS, HIDDEN), "residual": randn(TOKENS, HIDDEN), "norm": torch.rand(HIDDEN, generator=gen) + 0.5,
               "attn": randn(TOKENS, q)}
    return ck


def _load(layer: torch.nn.Module, shard: str, tensors: dict[str, torch.Tensor]) -> None:
    """As the loader does: the part of each checkpoint tensor the layer names (all of it when None)."""
    for name, tensor in tensors.items():
        index = layer.checkpoint_slice(name, shard)  # type: ignore[operator]
        layer.load_weight(name, tensor if index is None else tensor[index], shard)  # type: ignore[operator]


class _CudaBranch:
    """Sends fp8.py's forward_after_silu and forward_after_norm down their CUDA branch on the CPU: Triton
    claimed, the fused quantizing kernels and _scaled_mm replaced by float32 stand-ins (activations left
    unquantized, scale 1) that count their calls. Row scales only: the branch never takes block weights."""

    def __init__(self) -> None:
        from stoker.engine.layers import fp8

        self.fp8, self.calls = fp8, 0
        kernels = fp8.kernels

        class Kernels:
            def __getattr__(self, name: str) -> object:
                return getattr(kernels, name)

            @staticmethod
            def use_triton(x: torch.Tensor) -> bool:
                return True

        def silu_mul_quant(gate_up: torch.Tensor, act_scale: torch.Tensor | None):
            return kernels.silu_and_mul(gate_up), torch.ones(gate_up.shape[0], 1)

        def rms_norm_quant(hidden, norm_weight, eps, residual, act_scale):
            h, summed = kernels.rms_norm(hidden, norm_weight, eps, residual)
            return h, torch.ones(h.shape[0], 1), summed

        def scaled_mm(xq, x_scale, weight, scale, bias, dtype):
            self.calls += 1
            return F.linear(xq * x_scale, dequantize(weight, scale, None, torch.float32), bias).to(dtype)

        self.fakes = {"kernels": Kernels(), "takes_scaled_mm": lambda x, w, block: block is None,
                      "silu_mul_quant_fp8_triton": silu_mul_quant, "rms_norm_quant_fp8_triton": rms_norm_quant,
                      "scaled_mm_quantized": scaled_mm}

    def __enter__(self) -> _CudaBranch:
        self.saved = {name: getattr(self.fp8, name) for name in self.fakes}
        for name, fake in self.fakes.items():
            setattr(self.fp8, name, fake)
        return self

    def __exit__(self, *exc: object) -> None:
        for name, real in self.saved.items():
            setattr(self.fp8, name, real)


def _fp8_layer_errors(rank: int, size: int, comm, scheme_name: str, cases: list[tuple[int, int]]) -> dict[str, float]:
    """Per case (Hq, Hkv): the largest relative difference of each sharded FP8 layer from what the unsharded
    one gives for this rank's heads / intermediate rows, and of the row-parallel sums from the whole products;
    1.0 for a static activation scale that differs."""
    scheme = SCHEMES[scheme_name]
    errors: dict[str, float] = {}
    kw = {"dtype": torch.float32, "scheme": scheme}
    for hq, hkv in cases:
        ck, tag = _checkpoint(scheme, hq, hkv), f"{hq}/{hkv}"
        x, residual, norm, attn = (ck["x"][k] for k in ("x", "residual", "norm", "attn"))
        plan = ShardPlan(rank, size, max(1, size // hkv), comm)
        local_kv = max(1, hkv // size)
        full_qkv = Fp8QKVLinear(HIDDEN, hq, hkv, HEAD_DIM, bias=True, **kw)
        qkv = Fp8ColumnParallelQKV(HIDDEN, hq // size, local_kv, HEAD_DIM, bias=True, shard=plan, **kw)
        for s in "qkv":
            _load(full_qkv, s, ck[s])
            _load(qkv, s, ck[s])
        my_q = list(range(rank * hq // size, (rank + 1) * hq // size))
        for layer in (full_qkv, qkv):
            layer.finish_loading()
        errors[f"qkv {tag}"] = _relative(qkv(x), _my_heads(full_qkv(x), hq, hkv, my_q))
        errors[f"qkv after norm {tag}"] = _relative(
            qkv.forward_after_norm(x, residual, norm, 1e-5)[0],
            _my_heads(full_qkv.forward_after_norm(x, residual, norm, 1e-5)[0], hq, hkv, my_q))
        if scheme.activations == "static":  # the max of the q, k and v input scales: all whole on every rank
            errors[f"qkv act_scale {tag}"] = float(not torch.equal(qkv.act_scale, full_qkv.act_scale))

        o_full = Fp8Linear(hq * HEAD_DIM, HIDDEN, bias=True, **kw)
        o = Fp8RowParallelLinear(hq // size * HEAD_DIM, HIDDEN, bias=True, shard=plan, **kw)
        _load(o_full, "", ck["o"])
        _load(o, "", ck["o"])
        my_cols = attn.view(TOKENS, hq, HEAD_DIM)[:, my_q].flatten(1)
        errors[f"o_proj {tag}"] = _relative(o(my_cols), o_full(attn))

        gu_full = Fp8GateUpLinear(HIDDEN, INTERMEDIATE, **kw)
        gu = Fp8ColumnParallelGateUp(HIDDEN, INTERMEDIATE // size, shard=plan, **kw)
        down_full = Fp8Linear(INTERMEDIATE, HIDDEN, bias=True, **kw)
        down = Fp8RowParallelLinear(INTERMEDIATE // size, HIDDEN, bias=True, shard=plan, **kw)
        for layer in (gu_full, gu):
            _load(layer, "gate", ck["gate"])
            _load(layer, "up", ck["up"])
        _load(down_full, "", ck["down"])
        _load(down, "", ck["down"])
        for layer in (o_full, o, gu_full, gu, down_full, down):
            layer.finish_loading()
        whole = down_full.forward_after_silu(gu_full(x))
        errors[f"mlp {tag}"] = _relative(down.forward_after_silu(gu(x)), whole)
        errors[f"mlp forward {tag}"] = _relative(down(_silu_mul(gu(x))), whole)
        if scheme.block_size is None:
            with _CudaBranch() as cuda:
                errors[f"mlp cuda branch {tag}"] = _relative(down.forward_after_silu(gu(x)),
                                                            down_full.forward_after_silu(gu_full(x)))
                # A row-parallel layer after a norm: not what a Llama block builds, but the path must still sum.
                h = my_cols + 1
                after_norm = o.forward_after_norm(h, None, torch.ones(h.shape[1]), 1e-5)[0]
                errors[f"o_proj cuda branch after norm {tag}"] = _relative(
                    after_norm, o(F.rms_norm(h, (h.shape[1],), eps=1e-5)))
                errors[f"cuda branch taken {tag}"] = float(cuda.calls != 3)  # down x2, o's after-norm
    return errors


def _my_heads(full: torch.Tensor, hq: int, hkv: int, my_q: list[int]) -> torch.Tensor:
    """The unsharded qkv output's columns for q heads `my_q` and the KV heads they attend with (GQA: q head h
    reads KV head h // (Hq / Hkv))."""
    my_kv = sorted({h // (hq // hkv) for h in my_q})
    q_full = full[:, : hq * HEAD_DIM].view(TOKENS, hq, HEAD_DIM)
    k_full = full[:, hq * HEAD_DIM : (hq + hkv) * HEAD_DIM].view(TOKENS, hkv, HEAD_DIM)
    v_full = full[:, (hq + hkv) * HEAD_DIM :].view(TOKENS, hkv, HEAD_DIM)
    return torch.cat([q_full[:, my_q].flatten(1), k_full[:, my_kv].flatten(1), v_full[:, my_kv].flatten(1)], 1)


@pytest.mark.parametrize("scheme", list(SCHEMES))
def test_sharded_fp8_layers_match_unsharded(scheme: str):
    # KV heads split (one of 2 a rank) and replicated (the one KV head on both ranks).
    for rank, errors in enumerate(run_ranks(_fp8_layer_errors, 2, scheme, [(4, 2), (4, 1)])):
        bad = {name: err for name, err in errors.items() if err > 1e-5}
        assert not bad, f"rank {rank} of 2, {scheme}: {bad}"


# ---- the whole engine: TP=2 == TP=1, token for token -----------------------------------------------------------
TP_FP8_DIMS = dict(hidden_size=HIDDEN, intermediate_size=INTERMEDIATE, num_attention_heads=4, num_key_value_heads=2,
                   head_dim=HEAD_DIM)
PROMPTS = prompts(3, [7, 26])
MAX_NEW = 8
TOP = 5
# float32 on both sides, the same dequantized weights; only the order of the sums differs (the all-reduce),
# on logits of tens (the test models' peaked logits): test_fp8.py's tolerance for the same kind of difference.
LOGPROB_ATOL = 5e-4


@pytest.fixture(scope="module")
def fp8_source(tmp_path_factory) -> tuple[str, object]:
    from engine_models import ARCHS

    pytest.importorskip("compressed_tensors")
    ARCHS["llama_fp8_tp"] = ("LlamaConfig", TP_FP8_DIMS)
    path = str(tmp_path_factory.mktemp("fp8_tp_source"))
    return path, build_hf_model("llama_fp8_tp", path)


def _checkpoint_folder(source: tuple[str, object], path: str, preset: str) -> str:
    import os
    import shutil

    src, model = source
    build_fp8_checkpoint(model, path, preset, prompts(9, [24, 11]))
    for name in os.listdir(src):  # the tokenizer files
        if not name.endswith(".safetensors") and name != "config.json":
            shutil.copy(os.path.join(src, name), path)
    return path


def _greedy(engine: LLMEngine, tag: str) -> list[tuple[list[int], list[dict[int, float]]]]:
    """Per prompt: the greedy tokens, and per generated position the logprobs of the top tokens."""
    for i, ids in enumerate(PROMPTS):
        params = SamplingParams(max_tokens=MAX_NEW, temperature=0, ignore_eos=True, logprobs=TOP)
        engine.add_request(EngineRequest(f"{tag}-{i}", prompt_token_ids=ids, params=params))
    tokens: dict[str, list[int]] = {}
    logprobs: dict[str, list[dict[int, float]]] = {}
    while engine.has_unfinished():
        for out in engine.step():
            assert out.error_code is None, out
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            logprobs.setdefault(out.request_id, []).extend({t.token_id: t.logprob for t in lp.top}
                                                           for lp in out.logprobs or [])
    return [(tokens[f"{tag}-{i}"], logprobs[f"{tag}-{i}"]) for i in range(len(PROMPTS))]


def _engine(path: str, tp: int) -> LLMEngine:
    # 24 tokens a step: the 26-token prompt is chunked, and steps mix decodes with prompt chunks.
    return LLMEngine(EngineConfig(model_path=path, device="cpu", num_kv_blocks=64, max_num_batched_tokens=24,
                                  tensor_parallel_size=tp))


@pytest.mark.parametrize("preset", FP8_PRESETS)
def test_fp8_engine_at_tp2_equals_tp1(preset: str, fp8_source, tmp_path):
    path = _checkpoint_folder(fp8_source, str(tmp_path), preset)
    want = _greedy(_engine(path, 1), "tp1")
    engine = _engine(path, 2)
    try:
        layer = engine.runner.model.model.layers[0]
        assert isinstance(layer.self_attn.qkv_proj, Fp8ColumnParallelQKV)
        assert isinstance(layer.mlp.down_proj, Fp8RowParallelLinear)
        got = _greedy(engine, "tp2")
    finally:
        engine.close()
    for (want_ids, want_lps), (got_ids, got_lps) in zip(want, got, strict=True):
        assert got_ids == want_ids, preset
        assert len(got_lps) == len(want_lps) == MAX_NEW
        for position, (w, g) in enumerate(zip(want_lps, got_lps, strict=True)):
            for token, logprob in g.items():
                if token in w:  # a top token at the edge of the top 5 may swap with its neighbour
                    assert abs(logprob - w[token]) < LOGPROB_ATOL, (preset, position, token)
            assert max(g, key=g.__getitem__) == max(w, key=w.__getitem__)


def test_block_fp8_checkpoint_whose_split_is_not_128_aligned_is_refused_at_startup(tmp_path):
    """engine_models.FP8_DIMS (head_dim 64, intermediate 384) at 2 ranks: KV rows 64, intermediate 192."""
    from engine_models import ARCHS, FP8_DIMS

    pytest.importorskip("compressed_tensors")
    ARCHS["llama_fp8"] = ("LlamaConfig", FP8_DIMS)
    src = str(tmp_path / "src")
    source = (src, build_hf_model("llama_fp8", src))
    path = _checkpoint_folder(source, str(tmp_path / "block"), "FP8_BLOCK")
    with pytest.raises(ValueError, match=r"tensor_parallel_size=2 cannot split .*every split must be a multiple of "
                                         r"128: a rank's q rows = 128, KV rows = 64, intermediate slice = 192"):
        _engine(path, 2)
