"""The residual add in the GEMM's epilogue (Linear.forward_add: `residual.addmm_`): the pair it returns sums to the
unfused pair's (this layer on x, residual), the residual's memory holds the sum, and every case that must not add
there falls back untouched: a bias, another dtype or layout, no residual yet, the row-parallel twin (its sum over the
ranks comes first), the FP8 twin. A Llama MLP and a whole decoder layer's second half give the unfused result through
it, on the CPU in float32 and on the GPU in bf16."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from stoker.engine.kernels import rms_norm_ref, silu_and_mul_ref
from stoker.engine.layers.linear import Linear
from stoker.engine.layers.norm import RMSNorm
from stoker.engine.layers.tensor_parallel import RowParallelLinear
from stoker.engine.model_config import ModelConfig
from stoker.engine.models.llama import LlamaMLP
from stoker.engine.parallel.plan import ShardPlan

CUDA = torch.cuda.is_available()


def _linear(inp: int, out: int, dtype: torch.dtype = torch.float32, device: str = "cpu", bias: bool = False,
            seed: int = 0) -> Linear:
    g = torch.Generator().manual_seed(seed)
    layer = Linear(inp, out, bias=bias, dtype=dtype).to(device)
    layer.weight.data.copy_((torch.randn(out, inp, generator=g) / inp**0.5).to(dtype))
    if layer.bias is not None:
        layer.bias.data.copy_(torch.randn(out, generator=g).to(dtype))
    return layer


def _rand(*shape: int, dtype: torch.dtype = torch.float32, device: str = "cpu", seed: int = 1) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype).to(device)


def test_forward_add_puts_the_sum_in_the_residual() -> None:
    layer = _linear(48, 40)
    x, residual = _rand(7, 48), _rand(7, 40, seed=2)
    before = residual.clone()
    hidden, rest = layer.forward_add(x, residual)
    assert rest is None and hidden.data_ptr() == residual.data_ptr()  # the sum, in the residual's memory
    torch.testing.assert_close(hidden, before + F.linear(x, layer.weight), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("case", ["bias", "no residual", "dtype", "layout", "shape"])
def test_forward_add_falls_back_untouched(case: str) -> None:
    layer = _linear(32, 24, bias=case == "bias")
    x = _rand(5, 32)
    residual: torch.Tensor | None = _rand(5, 24, seed=3)
    if case == "no residual":
        residual = None
    elif case == "dtype":
        residual = _rand(5, 24, dtype=torch.float64)
    elif case == "layout":
        residual = _rand(24, 5).t()  # [5, 24], not contiguous
    elif case == "shape":
        residual = _rand(5, 1).expand(5, 24).contiguous()[:, :12].contiguous()  # [5, 12]: not this layer's output
    kept = None if residual is None else residual.clone()
    hidden, rest = layer.forward_add(x, residual)
    torch.testing.assert_close(hidden, layer(x))
    assert rest is residual
    if kept is not None:
        assert torch.equal(residual, kept)


def test_forward_after_silu_add_is_the_activation_then_forward_add() -> None:
    layer = _linear(24, 16)
    gate_up, residual = _rand(6, 48), _rand(6, 16, seed=4)
    expected = residual + F.linear(silu_and_mul_ref(gate_up), layer.weight)
    hidden, rest = layer.forward_after_silu_add(gate_up, residual)
    assert rest is None
    torch.testing.assert_close(hidden, expected, atol=1e-5, rtol=1e-5)


class _TwoEqualRanks:
    """The sum over two ranks whose partial products are equal: twice this rank's."""

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return x.mul_(2)


def test_row_parallel_twin_leaves_the_residual_to_the_norm() -> None:
    """Added before the all-reduce, the residual would be summed once per rank: the twin returns its reduced
    product and the residual as given."""
    layer = RowParallelLinear(32, 16, dtype=torch.float32,
                              shard=ShardPlan(rank=0, size=2, kv_replicas=1, comm=_TwoEqualRanks()))
    layer.weight.data.copy_(_rand(16, 32, seed=5))
    x, residual = _rand(3, 32), _rand(3, 16, seed=6)
    kept = residual.clone()
    hidden, rest = layer.forward_add(x, residual)
    torch.testing.assert_close(hidden, 2 * F.linear(x, layer.weight))
    assert rest is residual and torch.equal(residual, kept)


def _mlp(dtype: torch.dtype, device: str, hidden: int = 64, inter: int = 96) -> tuple[LlamaMLP, RMSNorm]:
    cfg = ModelConfig(
        architecture="LlamaForCausalLM", vocab_size=32, hidden_size=hidden, intermediate_size=inter, num_layers=1,
        num_heads=4, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-5, rope_theta=10000.0, rope_scaling=None,
        max_position_embeddings=64, tie_word_embeddings=False, attention_bias=False, qk_norm=False,
        eos_token_ids=[0], bos_token_id=None, sliding_window=None)
    mlp = LlamaMLP(cfg, dtype, "model.layers.0.mlp").to(device)
    norm = RMSNorm(hidden, 1e-5, dtype=dtype).to(device)
    g = torch.Generator().manual_seed(9)
    for p in [*mlp.parameters(), *norm.parameters()]:
        p.data.copy_((torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5 + (1.0 if p.dim() == 1 else 0.0))
                     .to(dtype))
    return mlp, norm


@pytest.mark.parametrize("device,dtype", [
    pytest.param("cpu", torch.float32, id="cpu-fp32"),
    pytest.param("cuda", torch.bfloat16, id="cuda-bf16",
                 marks=[pytest.mark.gpu, pytest.mark.skipif(not CUDA, reason="needs CUDA")]),
])
@pytest.mark.parametrize("first", [False, True], ids=["residual", "first layer"])
def test_mlp_after_norm_sums_as_unfused(device: str, dtype: torch.dtype, first: bool) -> None:
    """The MLP's (hidden, residual) pair sums to residual + hidden + mlp(norm(residual + hidden)), whether a
    residual came in or (the first layer's way) the hidden states are the sum already."""
    mlp, norm = _mlp(dtype, device)
    hidden, residual = _rand(9, 64, dtype=dtype, device=device), _rand(9, 64, dtype=dtype, device=device, seed=7)
    summed = hidden if first else (hidden.float() + residual.float()).to(dtype)
    normed = rms_norm_ref(summed, norm.weight, 1e-5)[0]
    down = F.linear(silu_and_mul_ref(F.linear(normed, mlp.gate_up_proj.weight)), mlp.down_proj.weight)
    expected = (summed.float() + down.float()).to(dtype)
    out, rest = mlp.forward_after_norm(hidden.clone(), None if first else residual.clone(), norm)
    assert rest is None  # plain linears: the sum came back as the hidden states
    tol = 1e-5 if dtype == torch.float32 else 1.6e-2
    torch.testing.assert_close(out, expected, atol=tol, rtol=tol)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("tokens", [1024, 8192])
def test_cublas_epilogue_add_equals_the_norms_add_on_gpu(tokens: int) -> None:
    """At W2's row counts, the 8B o_proj's shape: the epilogue's sum within bf16's rounding of the unfused sum
    (the norm's float32 add of the rounded product), and the normed output the next GEMM reads likewise."""
    layer = _linear(4096, 4096, torch.bfloat16, "cuda")
    x, residual = _rand(tokens, 4096, dtype=torch.bfloat16, device="cuda"), _rand(
        tokens, 4096, dtype=torch.bfloat16, device="cuda", seed=8)
    weight = torch.ones(4096, dtype=torch.bfloat16, device="cuda")
    normed_unfused, sum_unfused = rms_norm_ref(layer(x), weight, 1e-5, residual)
    hidden, rest = layer.forward_add(x, residual.clone())
    assert rest is None
    torch.testing.assert_close(hidden, sum_unfused, atol=1.6e-2, rtol=1.6e-2)
    torch.testing.assert_close(rms_norm_ref(hidden, weight, 1e-5)[0], normed_unfused, atol=1.6e-2, rtol=1.6e-2)
