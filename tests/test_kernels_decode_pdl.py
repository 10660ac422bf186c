"""The fused decode chain under programmatic dependent launch (issue 13): the decode attention's PDL form
(engine/kernels/decode_pdl.py: the first key tile read before griddepcontrol.wait, the newest key after it) and
the GEMV's PDL form (its first weight tile loaded before the wait).

- CPU (TRITON_INTERPRET=1, via the driver at the bottom) and GPU: the attention's peeled first tile against the
  reference, with the newest key inside and outside the first tile, one and several splits, both combines.
- GPU only (PDL does not exist in the interpreter): the attention bitwise equal to its plain launch, and a layer's
  chain qkv + rotary + cache write -> attention -> o_proj -> gate_up -> down, all with PDL, captured in a CUDA graph
  and replayed on new inputs, bitwise equal to the same chain launched without PDL.
"""
from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")
from kernel_harness import GPU, INTERPRET, NO_CUDA, cases, close, run_under_interpreter  # noqa: E402
from stoker.engine.kernels import rope_cos_sin  # noqa: E402
from stoker.engine.kernels.attention import (  # noqa: E402
    decode_combine_counters,
    paged_decode_attention_ref,
    paged_decode_attention_triton,
)
from stoker.engine.kernels.gemv import GemvConfig, gemv_rotary_cache_triton, gemv_triton  # noqa: E402
from stoker.engine.kernels.rmsnorm import rms_norm_triton  # noqa: E402
from test_kernels import paged_batch  # noqa: E402

CASES = cases()


def _decode(lens: list[int], hq: int, hkv: int, head_dim: int, block_size: int, device: str,
            dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    k_cache, v_cache, block_tables = paged_batch(lens, hkv, head_dim, block_size, device, dtype)
    context_lens = torch.tensor(lens, dtype=torch.int32, device=device)
    q = torch.randn(len(lens), hq, head_dim, device=device, dtype=dtype)
    return q, k_cache, v_cache, block_tables, context_lens


# Contexts: 1 and 5 (the newest key in split 0's only tile), 17 / 33 / 100 (in a later split or tile).
@pytest.mark.parametrize("device,dtype", CASES)
@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("fused_combine", [False, True])
def test_pdl_decode_attention_matches_reference(device: str, dtype: torch.dtype, num_splits: int,
                                                fused_combine: bool) -> None:
    lens = [1, 17, 100, 33, 5]
    q, k_cache, v_cache, block_tables, context_lens = _decode(lens, 6, 2, 40, 8, device, dtype)
    counters = decode_combine_counters(len(lens), 2, device) if fused_combine else None
    out = paged_decode_attention_triton(q, k_cache, v_cache, block_tables, context_lens, 0.1, num_splits,
                                        counters=counters, pdl=True)
    close(out, paged_decode_attention_ref(q, k_cache, v_cache, block_tables, context_lens, 0.1), dtype)


@pytest.mark.parametrize("device,dtype", CASES)
def test_pdl_decode_attention_reads_the_newest_key_after_the_wait(device: str, dtype: torch.dtype) -> None:
    """The newest key / value is taken from its second load: a large newest value changes the output as much
    as the reference says (were it left at the early tile's zero, the output would miss it)."""
    lens = [9, 4]
    q, k_cache, v_cache, block_tables, context_lens = _decode(lens, 4, 1, 16, 8, device, dtype)
    for seq, n in enumerate(lens):  # the newest key aligned with q, its value large: it dominates the output
        block, offset = block_tables[seq, (n - 1) // 8], (n - 1) % 8
        k_cache[block, offset, 0] = q[seq, 0] * 4
        v_cache[block, offset, 0] = 8.0
    out = paged_decode_attention_triton(q, k_cache, v_cache, block_tables, context_lens, 0.25, 1, pdl=True)
    close(out, paged_decode_attention_ref(q, k_cache, v_cache, block_tables, context_lens, 0.25), dtype)


# An FP8 cache in every conversion mode the split kernel has (kv_fp8_tiles.py): the early tile converted as the
# loop converts, so the PDL launch is the plain launch's result (the interpreter: the same peeled code path).
@pytest.mark.parametrize("device,dtype", CASES)
@pytest.mark.parametrize("mode", ["f16", "cast", "bits", "f16-vwords"])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_pdl_decode_attention_on_an_fp8_cache_matches_its_plain_launch(device: str, dtype: torch.dtype, mode: str,
                                                                       num_splits: int) -> None:
    from stoker.engine.kernels.kv_fp8_tiles import Fp8AttentionConfig
    from test_kernels_fp8_kv import fp8_batch

    lens = [1, 17, 100, 33, 5]
    k8, v8, block_tables, k_scale, v_scale = fp8_batch(lens, 2, 40, 8, device)
    context_lens = torch.tensor(lens, dtype=torch.int32, device=device)
    q = torch.randn(len(lens), 6, 40, device=device, dtype=dtype)
    config = Fp8AttentionConfig(mode)
    counters = decode_combine_counters(len(lens), 2, device)
    kw = dict(k_scale=k_scale, v_scale=v_scale, fp8_config=config, counters=counters)
    pdl = paged_decode_attention_triton(q, k8, v8, block_tables, context_lens, 0.1, num_splits, pdl=True, **kw)
    plain = paged_decode_attention_triton(q, k8, v8, block_tables, context_lens, 0.1, num_splits, **kw)
    torch.testing.assert_close(pdl, plain, rtol=0, atol=0)
    close(pdl, paged_decode_attention_ref(q, k8, v8, block_tables, context_lens, 0.1, k_scale, v_scale), dtype)


@pytest.mark.skipif(not INTERPRET, reason="CPU tensors: runs under the interpreter (the driver at the bottom)")
def test_a_pdl_launch_where_the_gluon_kernel_would_run_takes_the_split_kernels_own_config(monkeypatch) -> None:
    """One split on an FP8 cache would run decode_fp8_mma.py's Gluon kernel (tile 16, one warp); it reads no early
    tile, so a PDL launch runs the split kernel, at DEFAULT_DECODE's launch (not the Gluon kernel's tile and warps).
    The Gluon kernel is made available here and the split kernel's launch recorded instead of run."""
    from stoker.engine.kernels import attention, decode_fp8_mma
    from stoker.engine.kernels.kv_fp8_tiles import DEFAULT_DECODE
    from test_kernels_fp8_kv import fp8_batch

    launches: list[dict] = []

    class Recorder:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: launches.append(kwargs)

    monkeypatch.setattr(decode_fp8_mma, "supported", lambda q, k_cache: True)
    monkeypatch.setattr(decode_fp8_mma, "decode_fp8_mma", lambda *a, **k: launches.append({"gluon": True}))
    monkeypatch.setattr(attention, "_decode_split_kernel", Recorder())
    k8, v8, block_tables, k_scale, v_scale = fp8_batch([9, 4], 2, 32, 8, "cpu")
    q = torch.randn(2, 4, 32)
    args = (q, k8, v8, block_tables, torch.tensor([9, 4], dtype=torch.int32), 0.1, 1)
    paged_decode_attention_triton(*args, k_scale=k_scale, v_scale=v_scale)
    assert launches == [{"gluon": True}]  # without PDL: the Gluon kernel
    launches.clear()
    paged_decode_attention_triton(*args, k_scale=k_scale, v_scale=v_scale, pdl=True)
    config, mma = attention._fp8_config_that_runs(q, k8, DEFAULT_DECODE)
    want_args, want_launch = attention._fp8_launch(True, config, q, decode=True)
    assert not mma and want_launch != {"num_warps": 1, "num_stages": 1}  # not the Gluon config's one warp
    assert len(launches) == 1 and launches[0]["USE_PDL"] is True
    assert {k: launches[0][k] for k in (*want_args, *want_launch)} == {**want_args, **want_launch}


# ------------------------------------------------------------------------------------------- GPU only
@GPU
@NO_CUDA
@pytest.mark.parametrize("batch", [1, 4])
def test_pdl_decode_attention_is_bitwise_the_plain_launch(batch: int) -> None:
    torch.manual_seed(1)
    lens = [700, 65, 64, 1][:batch]
    q, k_cache, v_cache, block_tables, context_lens = _decode(lens, 32, 8, 128, 16, "cuda", torch.bfloat16)
    for counters in (None, decode_combine_counters(batch, 8, "cuda")):
        plain = paged_decode_attention_triton(q, k_cache, v_cache, block_tables, context_lens, 0.088,
                                              counters=counters)
        pdl = paged_decode_attention_triton(q, k_cache, v_cache, block_tables, context_lens, 0.088,
                                            counters=counters, pdl=True)
        torch.testing.assert_close(pdl, plain, rtol=0, atol=0)


class _Layer:
    """A small Llama layer's decode weights and one paged cache (batch `rows`, contexts up to 150 keys)."""

    def __init__(self, rows: int, hidden: int = 512, inter: int = 1376, heads: int = 8, kv_heads: int = 2,
                 head_dim: int = 64, block_size: int = 16) -> None:
        dt, dev = torch.bfloat16, "cuda"
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.w_qkv = torch.randn((heads + 2 * kv_heads) * head_dim, hidden, device=dev).mul(hidden**-0.5).to(dt)
        self.w_o = torch.randn(hidden, heads * head_dim, device=dev).mul(hidden**-0.5).to(dt)
        self.w_gu = torch.randn(2 * inter, hidden, device=dev).mul(hidden**-0.5).to(dt)
        self.w_d = torch.randn(hidden, inter, device=dev).mul(inter**-0.5).to(dt)
        self.cos_sin = rope_cos_sin(head_dim, 512, 10000.0, None, device=dev)
        blocks_per_seq = 10
        self.k_cache = torch.randn(rows * blocks_per_seq, block_size, kv_heads, head_dim, device=dev).to(dt)
        self.v_cache = torch.randn_like(self.k_cache)
        self.block_tables = torch.randperm(rows * blocks_per_seq, device=dev, dtype=torch.int32).view(rows, -1)
        self.context_lens = torch.tensor([150, 17, 64, 1][:rows], dtype=torch.int32, device=dev)
        positions = self.context_lens.long() - 1
        self.positions = positions
        blocks = self.block_tables.gather(1, (positions // block_size).view(-1, 1).int()).view(-1).long()
        self.slots = blocks * block_size + positions % block_size
        self.counters = decode_combine_counters(rows, kv_heads, dev)
        self.unit = torch.ones(hidden, device=dev, dtype=dt)

    def forward(self, x: torch.Tensor, pdl: bool, form: str = "prologue") -> torch.Tensor:
        """norm-folded-style qkv (prologue norm, unit gain) -> attention -> o + residual -> gate_up -> down.
        form "norms": the FP8 chain's other form, PDL RMSNorm kernels before qkv and gate_up, qkv letting the
        attention in before its own wait (pdl_trigger_first), o_proj with all of K loaded before its wait."""
        rows = x.shape[0]
        norms = form == "norms"
        h = rms_norm_triton(x, self.unit, 1e-5, pdl=pdl)[0] if norms else x
        qkv, _ = gemv_rotary_cache_triton(
            h, self.w_qkv, None, num_heads=self.heads, num_kv_heads=self.kv_heads, positions=self.positions,
            cos_sin=self.cos_sin, k_cache=self.k_cache, v_cache=self.v_cache, slot_mapping=self.slots,
            norm_folded=not norms, eps=1e-5, pdl=pdl, pdl_trigger_first=pdl and norms)
        q = qkv[:, : self.heads * self.head_dim].view(rows, self.heads, self.head_dim)
        attn = paged_decode_attention_triton(q, self.k_cache, self.v_cache, self.block_tables, self.context_lens,
                                             self.head_dim**-0.5, counters=self.counters, pdl=pdl)
        early = None
        if norms:  # hidden 512: four K tiles of 128, all of them before the wait
            early = GemvConfig(1, 4, 128, False, 4, 3, 4) if rows == 1 else GemvConfig(16, 16, 128, True, 4, 2, 4)
        stream, _ = gemv_triton(attn.reshape(rows, -1), self.w_o, add=x, pdl=pdl, config=early)
        if norms:
            act, _ = gemv_triton(rms_norm_triton(stream, self.unit, 1e-5, pdl=pdl)[0], self.w_gu, silu_mul=True,
                                 pdl=pdl)
        else:
            act, _ = gemv_triton(stream, self.w_gu, silu_mul=True, norm_folded=True, eps=1e-5, pdl=pdl)
        return gemv_triton(act, self.w_d, add=stream, pdl=pdl)[0]


@GPU
@NO_CUDA
@pytest.mark.parametrize("rows", [1, 4])
@pytest.mark.parametrize("form", ["prologue", "norms"])
def test_pdl_layer_chain_replays_in_a_cuda_graph_bitwise(rows: int, form: str) -> None:
    """Two layers' chain with every kernel PDL-launched (the attention included), captured and replayed on new
    inputs, against the chain launched without PDL: outputs and the KV caches bitwise equal. The attention reads
    the key / value the qkv kernel just wrote, so a wait placed too late shows up here as a mismatch; in the
    "norms" form the attention is let in before qkv's own wait and the norm kernels sit in the chain."""
    torch.manual_seed(2)
    layer = _Layer(rows)
    static_x = torch.randn(rows, 512, device="cuda").to(torch.bfloat16)
    for _ in range(2):  # compile outside the capture
        layer.forward(layer.forward(static_x, True, form), True, form)
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        static_out = layer.forward(layer.forward(static_x, True, form), True, form)
    for _ in range(3):
        static_x.copy_(torch.randn(rows, 512, device="cuda").to(torch.bfloat16))
        graph.replay()
        k_after, v_after = layer.k_cache.clone(), layer.v_cache.clone()
        expected = layer.forward(layer.forward(static_x, False, form), False, form)
        torch.testing.assert_close(static_out, expected, rtol=0, atol=0)
        torch.testing.assert_close(k_after, layer.k_cache, rtol=0, atol=0)
        torch.testing.assert_close(v_after, layer.v_cache, rtol=0, atol=0)


@pytest.mark.slow
@pytest.mark.skipif(INTERPRET, reason="this is the interpreter run itself")
def test_decode_pdl_under_triton_interpreter() -> None:
    run_under_interpreter(__file__)
