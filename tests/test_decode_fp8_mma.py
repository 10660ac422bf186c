"""decode_fp8_mma.py's Gluon kernel (FP8 cache decode attention, K / V straight into MMA operand registers)
against the plain-torch reference, and where it does not run, the fallback it names.

The kernel itself runs on CUDA only (Gluon has no interpreter): those cases are marked gpu. On the CPU: the
"mma" config falls back to the split kernel (under the interpreter) with the same result, and the kernel
compiles for sm_90: the register form with no shared memory (a layout Triton would route through shared memory
fails `assert_trivial` at compile time, so a compile is a real check), the cp.async form with its ring only.
"""
from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")
from kernel_harness import GPU, INTERPRET, NO_CUDA, close, run_under_interpreter  # noqa: E402
from stoker.engine.kernels import (  # noqa: E402
    attention,
    decode_fp8_mma,
    paged_decode_attention_ref,
    paged_decode_attention_triton,
)
from stoker.engine.kernels.kv_fp8_tiles import DEFAULT_DECODE, Fp8AttentionConfig  # noqa: E402
from test_kernels_fp8_kv import fp8_batch  # noqa: E402

# (Hq, Hkv, D, block_size): Llama-3-8B's heads, a group of 7 at D 64 (Qwen-like), no grouping, a group of 16 at
# D 256, the smallest head the kernel takes
MMA_SHAPES = [(32, 8, 128, 16), (14, 2, 64, 16), (8, 8, 128, 8), (32, 2, 256, 16), (4, 1, 32, 32)]
LENS = [1, 17, 100, 33, 640]  # one key, a tile and a bit, a partial last tile, a long context
MMA_CONFIGS = [Fp8AttentionConfig("mma", 16, 1, 1), Fp8AttentionConfig("mma", 32, 1, 1),
               Fp8AttentionConfig("mma", 64, 1, 1), Fp8AttentionConfig("mma", 128, 1, 1)]
CONFIG_IDS = ["n16", "n32", "n64", "n128"]
# The kernel's forms (decode_fp8_mma.STAGES / HEAD_MAJOR; the default is the cp.async ring of 3, heads first)
FORMS = {
    "regs": {"STAGES": 0, "HEAD_MAJOR": True},
    "regs-batch-first": {"STAGES": 0, "HEAD_MAJOR": False},
    "async2": {"STAGES": 2, "HEAD_MAJOR": True},
    "async3-batch-first": {"STAGES": 3, "HEAD_MAJOR": False},
    "async4": {"STAGES": 4, "HEAD_MAJOR": True},
}

def _check_against_reference(dtype: torch.dtype, hq: int, hkv: int, head_dim: int, block_size: int,
                             config: Fp8AttentionConfig, num_splits: int | None) -> None:
    """Every slot no sequence owns holds NaN (fp8_batch): a key read past a context, or a tile's padding let
    into the softmax, poisons the output."""
    k8, v8, tables, k_scale, v_scale = fp8_batch(LENS, hkv, head_dim, block_size, "cuda")
    context_lens = torch.tensor(LENS, dtype=torch.int32, device="cuda")
    q = torch.randn(len(LENS), hq, head_dim, device="cuda", dtype=dtype)
    assert decode_fp8_mma.supported(q, k8)  # the Gluon kernel runs, not the fallback
    out = paged_decode_attention_triton(q, k8, v8, tables, context_lens, head_dim**-0.5, num_splits,
                                        k_scale=k_scale, v_scale=v_scale, fp8_config=config)
    ref = paged_decode_attention_ref(q, k8, v8, tables, context_lens, head_dim**-0.5, k_scale, v_scale)
    assert torch.isfinite(out).all() and ref.abs().max() > 0.1
    close(out, ref, dtype)


@GPU
@NO_CUDA
@pytest.mark.parametrize("hq,hkv,head_dim,block_size", MMA_SHAPES)
@pytest.mark.parametrize("config", MMA_CONFIGS, ids=CONFIG_IDS)
@pytest.mark.parametrize("num_splits", [1, 3, None])
def test_mma_decode_matches_reference(hq: int, hkv: int, head_dim: int, block_size: int,
                                      config: Fp8AttentionConfig, num_splits: int | None) -> None:
    _check_against_reference(torch.bfloat16, hq, hkv, head_dim, block_size, config, num_splits)


@GPU
@NO_CUDA
@pytest.mark.parametrize("form", list(FORMS))
@pytest.mark.parametrize("hq,hkv,head_dim,block_size", MMA_SHAPES)
@pytest.mark.parametrize("config", MMA_CONFIGS[1:2], ids=CONFIG_IDS[1:2])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_mma_decode_forms_match_reference(monkeypatch: pytest.MonkeyPatch, form: str, hq: int, hkv: int,
                                          head_dim: int, block_size: int, config: Fp8AttentionConfig,
                                          num_splits: int) -> None:
    """Every other form of the kernel (loads into registers, cp.async rings of 2 and 4 slots, either grid order)
    on every shape: block sizes below, at and above the tile, contexts that end mid-tile and mid-ring, tiles past
    a split's end copied (masked) ahead."""
    for name, value in FORMS[form].items():
        monkeypatch.setattr(decode_fp8_mma, name, value)
    _check_against_reference(torch.bfloat16, hq, hkv, head_dim, block_size, config, num_splits)


@GPU
@NO_CUDA
@pytest.mark.parametrize("hq,hkv,head_dim,block_size", MMA_SHAPES[:2])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_mma_decode_fp16_queries(hq: int, hkv: int, head_dim: int, block_size: int, num_splits: int) -> None:
    _check_against_reference(torch.float16, hq, hkv, head_dim, block_size, MMA_CONFIGS[0], num_splits)


@GPU
@NO_CUDA
def test_mma_decode_into_a_strided_output_view() -> None:
    """out as a view with a row stride wider than Hq * D (a mixed step's decode rows): written through its
    strides, the columns around it untouched."""
    lens = [5, 77]
    k8, v8, tables, k_scale, v_scale = fp8_batch(lens, 8, 128, 16, "cuda")
    context_lens = torch.tensor(lens, dtype=torch.int32, device="cuda")
    q = torch.randn(2, 32, 128, device="cuda", dtype=torch.bfloat16)
    wide = torch.full((2, 40, 128), 7.0, device="cuda", dtype=torch.bfloat16)
    config = Fp8AttentionConfig("mma", 16, 1, 1)
    paged_decode_attention_triton(q, k8, v8, tables, context_lens, 0.1, 1, k_scale=k_scale, v_scale=v_scale,
                                  fp8_config=config, out=wide[:, 4:36])
    close(wide[:, 4:36], paged_decode_attention_ref(q, k8, v8, tables, context_lens, 0.1, k_scale, v_scale),
          torch.bfloat16)
    assert (wide[:, :4] == 7).all() and (wide[:, 36:] == 7).all()


@GPU
@NO_CUDA
def test_mma_decode_reads_a_cache_not_16_byte_aligned() -> None:
    """cp.async copies 16 bytes from 16-byte boundaries: caches that start elsewhere (views one byte into their
    storage) take the register form, with the same answer. Without that fallback the launch fails: Triton
    specializes on the pointers' alignment, and the ring's copies of an unaligned cache do not compile."""
    lens = [29, 70]
    k8, v8, tables, k_scale, v_scale = fp8_batch(lens, 2, 128, 16, "cuda")
    shifted = [torch.empty(c.numel() + 1, device="cuda", dtype=torch.uint8)[1:].view(torch.float8_e4m3fn)
               .view(c.shape) for c in (k8, v8)]
    for dst, src in zip(shifted, (k8, v8), strict=True):
        dst.copy_(src)
        assert dst.data_ptr() % 16
    context_lens = torch.tensor(lens, dtype=torch.int32, device="cuda")
    q = torch.randn(2, 8, 128, device="cuda", dtype=torch.bfloat16)
    assert decode_fp8_mma.STAGES > 0  # the default is the ring
    out = paged_decode_attention_triton(q, *shifted, tables, context_lens, 0.1, 1, k_scale=k_scale, v_scale=v_scale,
                                        fp8_config=Fp8AttentionConfig("mma", 16, 1, 1))
    close(out, paged_decode_attention_ref(q, k8, v8, tables, context_lens, 0.1, k_scale, v_scale), torch.bfloat16)


@GPU
@NO_CUDA
def test_mma_decode_clamps_queries_beyond_fp16() -> None:
    """The dots run in fp16: a bf16 q past fp16's range is clamped (as the split kernel's f16 modes do)."""
    lens = [40, 9]
    k8, v8, tables, k_scale, v_scale = fp8_batch(lens, 2, 64, 16, "cuda")
    context_lens = torch.tensor(lens, dtype=torch.int32, device="cuda")
    q = torch.randn(2, 8, 64, device="cuda", dtype=torch.bfloat16)
    q[0, 0, 3] = 2.0e5
    out = paged_decode_attention_triton(q, k8, v8, tables, context_lens, 1e-4, 1, k_scale=k_scale, v_scale=v_scale,
                                        fp8_config=Fp8AttentionConfig("mma", 16, 1, 1))
    clamped = q.float().clamp(-65504, 65504).to(torch.bfloat16)
    assert torch.isfinite(out).all()
    close(out, paged_decode_attention_ref(clamped, k8, v8, tables, context_lens, 1e-4, k_scale, v_scale),
          torch.bfloat16)


def test_mma_not_supported_where_it_cannot_run() -> None:
    """CPU tensors, a cache in q's dtype, a group over 16 rows, a head_dim the layouts do not take: False."""
    k8 = torch.zeros(2, 16, 2, 128).to(torch.float8_e4m3fn)
    assert not decode_fp8_mma.supported(torch.zeros(1, 8, 128), k8)  # the CPU
    if torch.cuda.is_available():
        cuda8 = k8.cuda()
        q = torch.zeros(1, 8, 128, device="cuda", dtype=torch.bfloat16)
        assert decode_fp8_mma.supported(q, cuda8) == (torch.cuda.get_device_capability() >= (8, 9))  # hardware e4m3
        assert not decode_fp8_mma.supported(q, torch.zeros(2, 16, 2, 128, device="cuda", dtype=torch.bfloat16))
        assert not decode_fp8_mma.supported(torch.zeros(1, 8, 128, device="cuda"), cuda8)  # float32 q
        assert not decode_fp8_mma.supported(torch.zeros(1, 34, 128, device="cuda", dtype=torch.bfloat16),
                                            cuda8)  # a group of 17
        assert not decode_fp8_mma.supported(torch.zeros(1, 8, 80, device="cuda", dtype=torch.bfloat16),
                                            torch.zeros(2, 16, 2, 80, device="cuda").to(torch.float8_e4m3fn))


def test_default_runs_the_mma_kernel_for_one_split_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """No config: decode_fp8_mma's kernel at DECODE_FP8_MMA_TILE_N for a launch of one split where it runs, the
    split kernel's DEFAULT_DECODE otherwise (more splits, switched off, or a shape it cannot take); a config given
    is kept, or falls back to the split kernel's words where the Gluon kernel cannot run."""
    q, k8 = torch.zeros(1, 8, 128), torch.zeros(2, 16, 2, 128).to(torch.float8_e4m3fn)
    monkeypatch.setattr(decode_fp8_mma, "supported", lambda q, k: True)
    config, mma = attention._decode_fp8_config(q, k8, None, 1)
    assert mma and config == Fp8AttentionConfig("mma", attention.DECODE_FP8_MMA_TILE_N, 1, 1)
    assert attention._decode_fp8_config(q, k8, None, 2) == (DEFAULT_DECODE, False)
    given = Fp8AttentionConfig("mma", 32, 1, 2)
    assert attention._decode_fp8_config(q, k8, given, 3) == (given, True)
    assert attention._decode_fp8_config(q, k8, Fp8AttentionConfig("f16"), 1) == (Fp8AttentionConfig("f16"), False)
    monkeypatch.setattr(attention, "DECODE_FP8_MMA", False)
    assert attention._decode_fp8_config(q, k8, None, 1) == (DEFAULT_DECODE, False)
    monkeypatch.setattr(attention, "DECODE_FP8_MMA", True)
    monkeypatch.setattr(decode_fp8_mma, "supported", lambda q, k: False)
    assert attention._decode_fp8_config(q, k8, None, 1) == (DEFAULT_DECODE, False)
    assert attention._decode_fp8_config(q, k8, given, 1)[0] == Fp8AttentionConfig("f16-vwords", 64, 1, 2)


@pytest.mark.skipif(not INTERPRET, reason="the interpreter's fallback (its run below)")
def test_mma_config_falls_back_under_the_interpreter() -> None:
    """Where the Gluon kernel cannot run, "mma" runs the split kernel (f16-vwords): the same answer as the
    reference, at any split count."""
    lens = [1, 17, 40]
    k8, v8, tables, k_scale, v_scale = fp8_batch(lens, 2, 64, 16, "cpu")
    context_lens = torch.tensor(lens, dtype=torch.int32)
    q = torch.randn(3, 6, 64, dtype=torch.float16)
    for num_splits in (1, 3):
        out = paged_decode_attention_triton(q, k8, v8, tables, context_lens, 0.1, num_splits, k_scale=k_scale,
                                            v_scale=v_scale, fp8_config=Fp8AttentionConfig("mma", 16, 1, 1))
        close(out, paged_decode_attention_ref(q, k8, v8, tables, context_lens, 0.1, k_scale, v_scale),
              torch.float16)


def _compile_sm90(tile_n: int, head_dim: int, group: int, stages: int):  # noqa: ANN202
    """The sm_90 compile of the kernel as the launcher would build it (3 splits, 8 kv heads, blocks of 16)."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    signature = {name: "*fp32" for name in ("part_out_ptr", "part_max_ptr", "part_sum_ptr", "k_scale_ptr",
                                            "v_scale_ptr")}
    signature |= {"q_ptr": "*bf16", "k_cache_ptr": "*fp8e4nv", "v_cache_ptr": "*fp8e4nv", "block_tables_ptr": "*i32",
                  "context_lens_ptr": "*i32", "out_ptr": "*bf16", "qk_scale": "fp32", "q_seq_stride": "i32",
                  "q_head_stride": "i32", "block_table_stride": "i32", "out_seq_stride": "i32",
                  "out_head_stride": "i32"}
    k_load, v_load = decode_fp8_mma.load_layouts(tile_n, head_dim)
    constexprs = {"NUM_KV_HEADS": 8, "GROUP": group, "BLOCK_G": max(8, triton.next_power_of_2(group)),
                  "HEAD_DIM": head_dim, "BLOCK_SIZE": 16, "TILE_N": tile_n, "NUM_SPLITS": 3, "K_LOAD": k_load,
                  "V_LOAD": v_load, "HEAD_MAJOR": True, "STAGES": stages}
    signature |= {name: "constexpr" for name in constexprs}
    # the pointers 16-byte aligned, as the JIT specializes torch's allocations (the launcher checks the caches')
    aligned = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(signature) if name.endswith("_ptr")}
    source = GluonASTSource(decode_fp8_mma._decode_fp8_mma_kernel, signature, constexprs=constexprs, attrs=aligned)
    try:
        return triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": 1})
    except RuntimeError as e:  # no CUDA toolchain in this triton install
        if "ptxas" in str(e).lower():
            pytest.skip(f"no ptxas for sm_90 here: {e}")
        raise


@pytest.mark.skipif(INTERPRET or not decode_fp8_mma.HAS_GLUON, reason="compiles with Triton's JIT (no Gluon here)")
@pytest.mark.parametrize("tile_n,head_dim,group", [(16, 128, 4), (32, 64, 7), (64, 256, 16), (16, 32, 1),
                                                   (128, 128, 8)])
def test_mma_kernel_compiles_for_sm90_without_shared_memory(tile_n: int, head_dim: int, group: int) -> None:
    """The register form: every convert_layout into an MMA operand asserts it moves no data (a compile error
    otherwise), and the kernel uses no shared memory."""
    kernel = _compile_sm90(tile_n, head_dim, group, 0)
    assert kernel.metadata.shared == 0
    ptx = kernel.asm["ptx"]
    assert "mma.sync.aligned.m16n8k16" in ptx and "cvt.rn.f16x2.e4m3x2" in ptx
    assert "ld.shared" not in ptx and "st.shared" not in ptx


@pytest.mark.skipif(INTERPRET or not decode_fp8_mma.HAS_GLUON, reason="compiles with Triton's JIT (no Gluon here)")
@pytest.mark.parametrize("tile_n,head_dim,group,stages", [(16, 128, 4, 3), (32, 64, 7, 2), (16, 256, 16, 2),
                                                          (16, 32, 1, 4)])
def test_mma_kernel_async_form_copies_into_its_ring(tile_n: int, head_dim: int, group: int, stages: int) -> None:
    """The cp.async form: the ring is STAGES slots of a K and a V tile, filled by cp.async copies that no register
    waits on (16 bytes each from head_dim 128 on, where a lane's share of a key row is that wide; D / 8 and D / 4
    bytes below), read back by shared loads as wide (the swizzle keeps them whole); nothing else goes through
    shared memory and no K / V tile is loaded into registers."""
    kernel = _compile_sm90(tile_n, head_dim, group, stages)
    assert kernel.metadata.shared == stages * 2 * tile_n * head_dim
    ptx = kernel.asm["ptx"]
    assert "cp.async.wait_group" in ptx and "st.shared" not in ptx and "ld.global.v4" not in ptx
    if head_dim >= 128:
        copies = [line for line in ptx.splitlines() if "cp.async.cg.shared.global" in line]
        assert copies and all(", 0x10, " in line for line in copies)
        assert "ld.shared.v4.b32" in ptx
    else:
        assert "cp.async.ca.shared.global" in ptx or "cp.async.cg.shared.global" in ptx


@pytest.mark.slow
@pytest.mark.skipif(INTERPRET, reason="this is the interpreter run itself")
def test_decode_fp8_mma_under_triton_interpreter() -> None:
    run_under_interpreter(__file__)
