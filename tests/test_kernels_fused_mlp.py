"""The fused decode MLP (engine/kernels/fused_mlp.py: gate_up + SiLU-mul + down into a float32 accumulator, then the
rounding and the residual add in a second kernel) against the two GEMVs it replaces and their float64 truth, on odd
shapes (the intermediate not a multiple of the program's rows, hidden not a multiple of the down step), M in {1, 3}.

Runs like tests/test_kernels.py: the GPU cases bf16/fp16/fp32 on CUDA; under TRITON_INTERPRET=1 fp32/fp16 on the
CPU, re-run in an interpreter subprocess by the driver at the bottom.
"""
from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")
from kernel_harness import GPU, INTERPRET, NO_CUDA, TOLERANCE, cases, run_under_interpreter  # noqa: E402
from stoker.engine.kernels.fused_mlp import fused_mlp_finish_ref, fused_mlp_ref, fused_mlp_triton  # noqa: E402
from stoker.engine.kernels.gemv import (  # noqa: E402
    GEMV_MAX_M,
    NORM_SUM_UNIT,
    fold_norm_weight,
    gemv_ref,
    norm_sums_buffer,
)

CASES = cases()
HIDDEN, INTER = 200, 75  # 200: several bh steps and a masked tail; 75: the last program's rows partly padding


def rand(*shape: int, device: str, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, device=device) * scale).to(dtype)


def _inputs(num_rows: int, device: str, dtype: torch.dtype, hidden: int = HIDDEN, inter: int = INTER):
    wide = rand(num_rows, hidden + 8, device=device, dtype=dtype, scale=3.0)
    x = wide[:, :hidden]  # a row stride != hidden must be honoured; rms far from 1 so a missing norm shows
    gate_up = rand(2 * inter, hidden, device=device, dtype=dtype, scale=hidden**-0.5)
    down = rand(hidden, inter, device=device, dtype=dtype, scale=inter**-0.5)
    residual = rand(num_rows, hidden, device=device, dtype=dtype)
    g = rand(hidden, device=device, dtype=dtype) + 1
    return x, gate_up, down, residual, g


def _close_to_truth(out: torch.Tensor, ref: torch.Tensor, truth: torch.Tensor, dtype: torch.dtype) -> None:
    """Within twice the reference's own worst error from the float64 truth, plus the dtype's tolerance (the kernel
    sums the down projection in another order than the reference, so neither is the other's rounding)."""
    ref_err = (ref.double() - truth).abs().max().item()
    torch.testing.assert_close(out.double(), truth, atol=TOLERANCE[dtype] + 2 * ref_err, rtol=TOLERANCE[dtype])


@pytest.mark.parametrize("device,dtype", CASES)
@pytest.mark.parametrize("num_rows", [1, 3])
@pytest.mark.parametrize("norm", ["folded", "none"])
def test_fused_mlp_matches_the_two_gemvs(device: str, dtype: torch.dtype, num_rows: int, norm: str) -> None:
    x, gate_up, down, residual, g = _inputs(num_rows, device, dtype)
    folded = norm == "folded"
    out = fused_mlp_triton(x, fold_norm_weight(gate_up, g) if folded else gate_up, down, residual, eps=1e-5,
                           norm_folded=folded)
    assert out.shape == residual.shape and out.dtype == dtype
    # The reference: the norm with its weight g (unfolded), silu-mul, down, residual add: what the model computes.
    act, _ = gemv_ref(x, gate_up, silu_mul=True, norm_weight=g if folded else None, eps=1e-5)
    ref = gemv_ref(act, down, add=residual)[0]
    wide = [t.double() for t in (x, gate_up, down, residual, g)]
    act64, _ = gemv_ref(wide[0], wide[1], silu_mul=True, norm_weight=wide[4] if folded else None, eps=1e-5)
    truth = gemv_ref(act64, wide[2], add=wide[3])[0]
    _close_to_truth(out, ref, truth, dtype)


@pytest.mark.parametrize("device,dtype", CASES)
@pytest.mark.parametrize("num_rows", [1, 3])
def test_fused_mlp_without_residual_is_the_partial_sum(device: str, dtype: torch.dtype, num_rows: int) -> None:
    """residual None (a tensor-parallel rank's row-parallel down, summed by the all-reduce): down(act) alone,
    rounded as the residual form rounds before its add; the accumulator still left zero."""
    x, gate_up, down, residual, g = _inputs(num_rows, device, dtype)
    acc = torch.zeros(GEMV_MAX_M * HIDDEN, dtype=torch.float32, device=device)
    out = fused_mlp_triton(x, fold_norm_weight(gate_up, g), down, None, eps=1e-5, accumulator=acc)
    assert out.shape == x.shape and out.dtype == dtype and out.is_contiguous()
    assert not acc.any()
    act, _ = gemv_ref(x, gate_up, silu_mul=True, norm_weight=g, eps=1e-5)
    ref = gemv_ref(act, down)[0]
    wide = [t.double() for t in (x, gate_up, down, g)]
    act64, _ = gemv_ref(wide[0], wide[1], silu_mul=True, norm_weight=wide[3], eps=1e-5)
    _close_to_truth(out, ref, gemv_ref(act64, wide[2])[0], dtype)
    # the same launch with the residual is this partial plus the residual, to the dtype's rounding
    with_residual = fused_mlp_triton(x, fold_norm_weight(gate_up, g), down, residual, eps=1e-5, accumulator=acc)
    torch.testing.assert_close(with_residual, (out.float() + residual.float()).to(dtype), atol=TOLERANCE[dtype],
                               rtol=TOLERANCE[dtype])
    assert fused_mlp_ref(x, fold_norm_weight(gate_up, g), down, None, eps=1e-5).shape == x.shape


@pytest.mark.parametrize("device,dtype", CASES)
def test_fused_mlp_norm_is_per_row_and_rows_are_independent(device: str, dtype: torch.dtype) -> None:
    # Rows of very different scale: each normalised by its own rms; and a row's output is the one it gets alone.
    x, gate_up, down, residual, _ = _inputs(3, device, dtype)
    x = (x.float() * torch.tensor([[0.01], [1.0], [30.0]], device=device)).to(dtype)
    together = fused_mlp_triton(x, gate_up, down, residual, eps=1e-6)
    tol = TOLERANCE[dtype]  # (the accumulator's adds may land in another order: equal within rounding)
    for i in range(3):
        alone = fused_mlp_triton(x[i : i + 1], gate_up, down, residual[i : i + 1], eps=1e-6)
        torch.testing.assert_close(together[i : i + 1].float(), alone.float(), atol=tol, rtol=tol)
    ref = fused_mlp_ref(x, gate_up, down, residual, eps=1e-6)
    torch.testing.assert_close(together.float(), ref.float(), atol=tol * 4, rtol=tol * 4)


@pytest.mark.parametrize("device,dtype", CASES)
def test_fused_mlp_leaves_its_accumulator_zero(device: str, dtype: torch.dtype) -> None:
    """Every program adds into one [M, H] float32 accumulator that the second kernel reads and zeroes: a layer after
    a layer (or a step after a step) finds it zero again, so one static buffer serves them all; a short or
    non-float32 one is refused."""
    x, gate_up, down, residual, _ = _inputs(3, device, dtype)
    acc = torch.zeros(3 * HIDDEN + 5, device=device)
    first = fused_mlp_triton(x, gate_up, down, residual, eps=1e-5, accumulator=acc)
    assert torch.count_nonzero(acc) == 0
    second = fused_mlp_triton(x, gate_up, down, residual, eps=1e-5, accumulator=acc)
    tol = TOLERANCE[dtype]  # the adds' order may differ from run to run: equal within rounding, not bitwise
    torch.testing.assert_close(second.float(), first.float(), atol=tol, rtol=tol)
    acc[HIDDEN + 7] = 1.0  # a stale accumulator shows in the output: the launch really reads this buffer
    stale = fused_mlp_triton(x, gate_up, down, residual, eps=1e-5, accumulator=acc)
    assert (stale[1, 7].float() - first[1, 7].float()).abs() > 0.5
    with pytest.raises(ValueError, match="the accumulator must be contiguous float32"):
        fused_mlp_triton(x, gate_up, down, residual, eps=1e-5, accumulator=acc[:10])
    with pytest.raises(ValueError, match="the accumulator must be contiguous float32"):
        fused_mlp_triton(x, gate_up, down, residual, eps=1e-5, accumulator=acc.double())


def _sums_of(s: torch.Tensor) -> torch.Tensor:
    """A carried norm's slots for the rows of s (one slot a token): each row's sum(s^2) in NORM_SUM_UNIT fixed point."""
    sums = norm_sums_buffer(GEMV_MAX_M, s.device)
    sums[: s.shape[0], 0] = ((s.double() ** 2).sum(dim=1) * NORM_SUM_UNIT).round().long()
    return sums


@pytest.mark.parametrize("device,dtype", CASES)
@pytest.mark.parametrize("num_rows", [1, 3])
@pytest.mark.parametrize("launch", ["plain", "pdl", "early"])
def test_fused_mlp_carried_sums(device: str, dtype: torch.dtype, num_rows: int, launch: str) -> None:
    """The carried norms in their folded form (fused_decode.FOLDED_NORM_CARRY): the streaming kernel takes each
    token's sum of squares from the slots (norm_sums) instead of its rms pass over x, and equals the folded-prologue
    launch; the finishing kernel adds each token's sum(out^2) into sums_out (fixed point: within a unit a program of
    the float64 sum) and zeroes zero_sums (here the slots just read, every row of them); launched plain, with PDL or
    with the finishing kernel early (griddepcontrol on the GPU only). Poisoned slots show in the output: the kernel
    really reads them."""
    pdl = {"pdl": launch == "pdl", "finish_early": launch == "early"}
    x, gate_up, down, residual, g = _inputs(num_rows, device, dtype)
    folded = fold_norm_weight(gate_up, g)
    sums = _sums_of(x)
    sums[num_rows:] = 99  # rows past M: never read, zeroed all the same
    sums_next = norm_sums_buffer(GEMV_MAX_M, device)
    out = fused_mlp_triton(x, folded, down, residual, eps=1e-5, norm_folded=False, norm_sums=sums,
                           sums_out=sums_next, zero_sums=sums, **pdl)
    prologue = fused_mlp_triton(x, folded, down, residual, eps=1e-5, **pdl)
    tol = TOLERANCE[dtype]  # the sums' fixed point and the accumulator's order: equal within rounding
    torch.testing.assert_close(out.float(), prologue.float(), atol=tol, rtol=tol)
    act, _ = gemv_ref(x, gate_up, silu_mul=True, norm_weight=g, eps=1e-5)
    wide = [t.double() for t in (x, gate_up, down, residual, g)]
    act64, _ = gemv_ref(wide[0], wide[1], silu_mul=True, norm_weight=wide[4], eps=1e-5)
    _close_to_truth(out, gemv_ref(act, down, add=residual)[0], gemv_ref(act64, wide[2], add=wide[3])[0], dtype)
    assert not sums.any(), "the slots read were not zeroed"
    programs = triton.cdiv(HIDDEN, 256 if device == "cuda" else 32)
    torch.testing.assert_close(sums_next[:num_rows, 0].double() / NORM_SUM_UNIT, (out.double() ** 2).sum(dim=1),
                               rtol=1e-6, atol=programs / NORM_SUM_UNIT)
    assert not sums_next[num_rows:].any()
    poisoned = _sums_of(x * 4)  # sums 16x too large: every output row's MLP part shrinks 4x
    wrong = fused_mlp_triton(x, folded, down, residual, eps=1e-5, norm_folded=False, norm_sums=poisoned, **pdl)
    assert (wrong.float() - out.float()).abs().max() > 10 * tol
    assert poisoned.any(), "no zero_sums given: the slots must stay as they were"


@pytest.mark.parametrize("device,dtype", CASES)
@pytest.mark.parametrize("num_rows", [1, 3])
def test_fused_mlp_left_unfinished_hands_on_its_accumulator(device: str, dtype: torch.dtype, num_rows: int) -> None:
    """finish=False (fused_decode.MLP_FINISH_IN_QKV): the streaming kernel alone. It returns the accumulator's first
    M * H floats as [M, H], holding the down projection's float32 sums (left for the next layer's qkv to finish and
    its o_proj to zero), and fused_mlp_finish_ref of them is what the finishing kernel stores: bit for bit under the
    interpreter (its programs add in one order every run), within the dtype's rounding on the GPU (atomics land in
    any order). The finishing kernel's arguments are refused with it."""
    x, gate_up, down, residual, g = _inputs(num_rows, device, dtype)
    folded = fold_norm_weight(gate_up, g)
    buffer = torch.zeros(GEMV_MAX_M * HIDDEN, device=device)
    acc = fused_mlp_triton(x, folded, down, residual, eps=1e-5, accumulator=buffer, finish=False)
    assert acc.shape == (num_rows, HIDDEN) and acc.dtype == torch.float32 and acc.data_ptr() == buffer.data_ptr()
    assert not buffer[num_rows * HIDDEN :].any()
    act, _ = gemv_ref(x, gate_up, silu_mul=True, norm_weight=g, eps=1e-5)
    wide = [t.double() for t in (x, gate_up, down, g)]
    act64, _ = gemv_ref(wide[0], wide[1], silu_mul=True, norm_weight=wide[3], eps=1e-5)
    _close_to_truth(acc, gemv_ref(act, down)[0], gemv_ref(act64, wide[2])[0], dtype)
    finished = fused_mlp_triton(x, folded, down, residual, eps=1e-5)
    tol = 0.0 if INTERPRET else TOLERANCE[dtype]
    torch.testing.assert_close(fused_mlp_finish_ref(acc, residual), finished, atol=tol, rtol=tol)
    sums = norm_sums_buffer(GEMV_MAX_M, device)
    for finishing in ({"sums_out": sums}, {"zero_sums": sums}, {"finish_early": True}):
        with pytest.raises(ValueError, match="finishing kernel's; finish=False launches none"):
            fused_mlp_triton(x, folded, down, residual, eps=1e-5, finish=False, **finishing)


def test_fused_mlp_refuses_bad_carried_sums() -> None:
    x, gate_up, down, residual, _ = _inputs(2, "cpu", torch.float32)
    sums = norm_sums_buffer(GEMV_MAX_M, "cpu")
    with pytest.raises(ValueError, match="pass norm_folded=False"):
        fused_mlp_triton(x, gate_up, down, residual, eps=1e-5, norm_sums=sums)
    with pytest.raises(ValueError, match="norm_sums must be a contiguous int64"):
        fused_mlp_triton(x, gate_up, down, residual, eps=1e-5, norm_folded=False, norm_sums=sums.float())
    with pytest.raises(ValueError, match="sums_out must be a contiguous int64"):
        fused_mlp_triton(x, gate_up, down, residual, eps=1e-5, sums_out=sums[:1])
    with pytest.raises(ValueError, match="zero_sums needs a power-of-two"):
        fused_mlp_triton(x, gate_up, down, residual, eps=1e-5, zero_sums=norm_sums_buffer(3, "cpu"))


def test_fused_mlp_rejects_bad_arguments() -> None:
    x, gate_up, down, residual, _ = _inputs(1, "cpu", torch.float32)
    with pytest.raises(ValueError, match="shapes disagree"):
        fused_mlp_triton(x, gate_up, down[:, :-1], residual, eps=1e-5)
    with pytest.raises(ValueError, match="one dtype expected"):
        fused_mlp_triton(x, gate_up, down.half(), residual, eps=1e-5)
    with pytest.raises(ValueError, match="1..16 tokens"):
        big = torch.zeros(17, HIDDEN)
        fused_mlp_triton(big, gate_up, down, big, eps=1e-5)


@GPU
@NO_CUDA
@pytest.mark.parametrize("form", ["plain", "pdl", "carried-pdl", "carried-early", "carried-pdl-early"])
@pytest.mark.parametrize("inter", [14336, 8192], ids=["8b", "1b"])
def test_fused_mlp_bf16_engine_shapes_in_a_cuda_graph(inter: int, form: str) -> None:
    """The engine's launches at the 8B and 1B MLP shapes (bi 128 and 64), replayed from a CUDA graph with a static
    accumulator, against the two GEMVs they replace (bf16: within the dtype's tolerance of each other). pdl: both
    launches with programmatic dependent launch after an o_proj-like GEMV launched with it (the chain the engine
    runs); carried-pdl: that GEMV's epilogue adds the sums the MLP reads (sums only: g folded into gate_up), and the
    finishing kernel adds the next norm's sums and zeroes the ones read; early: the finishing kernel launched as the
    MLP starts (fused_decode.FINISH_EARLY), followed by another GEMV launched with PDL that reads its output."""
    from stoker.engine.kernels.gemv import NormCarryOut, gemv_triton

    torch.manual_seed(0)
    hidden = 4096 if inter == 14336 else 2048
    x, gate_up, down, residual, _ = _inputs(1, "cuda", torch.bfloat16, hidden=hidden, inter=inter)
    w_o = rand(hidden, hidden, device="cuda", dtype=torch.bfloat16, scale=hidden**-0.5)
    h = rand(1, hidden, device="cuda", dtype=torch.bfloat16)
    acc = torch.zeros(hidden, device="cuda")
    pdl, carried, early = form in ("pdl", "carried-pdl", "carried-pdl-early"), form.startswith("carried"), \
        form.endswith("early")
    sums, sums_next = norm_sums_buffer(GEMV_MAX_M, "cuda"), norm_sums_buffer(GEMV_MAX_M, "cuda")

    def step() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        carry = {"carry": NormCarryOut(None, None, sums)} if carried else {}
        s, _ = gemv_triton(h, w_o, add=residual, pdl=pdl, **carry)
        mlp = {"norm_folded": False, "norm_sums": sums, "sums_out": sums_next, "zero_sums": sums} if carried else {}
        out = fused_mlp_triton(s, gate_up, down, s, eps=1e-5, accumulator=acc, pdl=pdl, finish_early=early, **mlp)
        return s, out, gemv_triton(out, w_o, pdl=True)[0]  # a successor under PDL (the next qkv's place)

    step()
    sums_next.zero_()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        s, out, after = step()
    h.copy_(rand(1, hidden, device="cuda", dtype=torch.bfloat16, scale=3.0))
    graph.replay()
    act, _ = gemv_triton(s, gate_up, silu_mul=True, norm_folded=True, eps=1e-5)
    two = gemv_triton(act, down, add=s)[0]
    tol = TOLERANCE[torch.bfloat16]
    torch.testing.assert_close(out.float(), two.float(), atol=tol, rtol=tol)
    torch.testing.assert_close(after, gemv_triton(out, w_o)[0], rtol=0, atol=0)  # it read the finished output
    assert torch.count_nonzero(acc) == 0
    assert not sums.any()
    if carried:
        torch.testing.assert_close(sums_next[0, 0].double() / NORM_SUM_UNIT, (out.double() ** 2).sum(),
                                   rtol=1e-6, atol=1e-4)


@GPU
@NO_CUDA
@pytest.mark.parametrize("num_rows", [1, 5])
@pytest.mark.parametrize("inter", [14336, 8192], ids=["8b", "1b"])
def test_mlp_finished_by_the_next_qkv_in_a_cuda_graph(inter: int, num_rows: int) -> None:
    """fused_decode.MLP_FINISH_IN_QKV's launches at the engine's shapes (bf16; qkv and o_proj with PDL, o_proj's K
    tiles before its wait at one token on the 8B entry), captured in a CUDA graph and replayed on new inputs: o_proj
    (its residual add and the MLP's sums) -> the MLP's streaming kernel alone -> the next qkv on its accumulator and
    the stream (stores the new stream, zeroes the MLP's slots) -> the next o_proj (zeroes the accumulator), against
    the chain with the finishing kernel (adding the next qkv's sums) and the carried qkv in a graph of its own: the
    new stream, qkv and the last o_proj within bf16's tolerance (the atomics' order and the rms's two sums: not
    bitwise), and the accumulator and both slot buffers zero after every replay."""
    from stoker.engine.kernels import rope_cos_sin
    from stoker.engine.kernels.gemv import NormCarryOut, gemv_rotary_cache_triton, gemv_triton

    torch.manual_seed(0)
    dt, dev = torch.bfloat16, "cuda"
    hidden, heads, kv_heads = (4096, 32, 8) if inter == 14336 else (2048, 32, 8)
    head_dim = hidden // heads
    x, gate_up, down, _, g = _inputs(num_rows, dev, dt, hidden=hidden, inter=inter)
    gate_up = fold_norm_weight(gate_up, g)
    w_o = rand(hidden, hidden, device=dev, dtype=dt, scale=hidden**-0.5)
    w_qkv = rand((heads + 2 * kv_heads) * head_dim, hidden, device=dev, dtype=dt, scale=hidden**-0.5)
    h = rand(num_rows, hidden, device=dev, dtype=dt)
    caches = [rand(64, 16, kv_heads, head_dim, device=dev, dtype=dt) for _ in range(2)]
    rope = {"num_heads": heads, "num_kv_heads": kv_heads, "positions": torch.arange(num_rows, device=dev) + 100,
            "cos_sin": rope_cos_sin(head_dim, 512, 500000.0, None, device=dev), "k_cache": caches[0],
            "v_cache": caches[1], "slot_mapping": torch.arange(num_rows, device=dev) * 3, "eps": 1e-5, "pdl": True}
    acc = torch.zeros(GEMV_MAX_M * hidden, device=dev)
    sums_post, sums_next = norm_sums_buffer(GEMV_MAX_M, dev), norm_sums_buffer(GEMV_MAX_M, dev)

    def chain(pending: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        s, _ = gemv_triton(h, w_o, add=x, pdl=True, carry=NormCarryOut(None, None, sums_post), zero_sums=sums_next)
        mlp = {"eps": 1e-5, "norm_folded": False, "norm_sums": sums_post, "accumulator": acc}
        if pending:
            sums = fused_mlp_triton(s, gate_up, down, s, **mlp, finish=False)
            qkv, stream = gemv_rotary_cache_triton(sums, w_qkv, None, **rope, norm_residual=s, norm_folded=True,
                                                   x_accumulator=True, zero_sums=sums_post)
            zero = {"zero_accumulator": sums}
        else:
            stream = fused_mlp_triton(s, gate_up, down, s, **mlp, sums_out=sums_next, zero_sums=sums_post)
            qkv, _ = gemv_rotary_cache_triton(stream, w_qkv, None, **rope, norm_sums=sums_next)
            zero = {}
        out, _ = gemv_triton(qkv[:, :hidden], w_o, add=stream, pdl=True, zero_sums=sums_next, **zero)
        return stream, qkv, out

    graphs, outputs = {}, {}
    for pending in (False, True):
        for _ in range(2):  # compile outside the capture
            chain(pending)
        graphs[pending] = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graphs[pending]):
            outputs[pending] = chain(pending)
    tol = TOLERANCE[dt]
    for _ in range(3):
        x.copy_(rand(num_rows, hidden, device=dev, dtype=dt, scale=2.0))
        h.copy_(rand(num_rows, hidden, device=dev, dtype=dt))
        for pending in (False, True):
            graphs[pending].replay()
            torch.cuda.synchronize()
            assert not acc.any() and not sums_post.any() and not sums_next.any(), pending
        for got, want in zip(outputs[True], outputs[False], strict=True):
            torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


@pytest.mark.skipif(INTERPRET, reason="this is the interpreter run itself")
def test_fused_mlp_under_triton_interpreter() -> None:
    run_under_interpreter(__file__)
