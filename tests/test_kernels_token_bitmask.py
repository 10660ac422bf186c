"""The grammar bitmask kernel (engine/kernels/token_bitmask.py) against its definition, apply_token_bitmask_ref,
and the op on CUDA launching nothing that synchronizes (here rather than in tests/test_structured_output.py, which
needs jsonschema: the GPU machine has none).

Runs like tests/test_kernels.py: fp32/fp16 on the CPU under TRITON_INTERPRET=1 (the driver at the bottom re-runs
this file so), bf16/fp16/fp32 on CUDA (marked gpu). Odd vocabularies (a partial last word, a partial last
program), masks wider than the vocabulary needs, every row or a subset in any order.
"""
from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")
from kernel_harness import GPU, INTERPRET, NO_CUDA, cases, run_under_interpreter  # noqa: E402
from stoker.engine.kernels.token_bitmask import (  # noqa: E402
    WORDS_PER_PROGRAM,
    apply_token_bitmask,
    apply_token_bitmask_ref,
    apply_token_bitmask_triton,
)

CASES = cases()
# a partial word, a whole word plus one, a partial program, past one program (WORDS_PER_PROGRAM * 32 = 2,048)
VOCABS = [1, 33, 97, WORDS_PER_PROGRAM * 32 + 45]


def _inputs(vocab: int, dtype: torch.dtype, rows: list[int] | None, extra_words: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(7, vocab, generator=gen).to(dtype)
    count = 7 if rows is None else len(rows)
    words = (vocab + 31) // 32 + extra_words
    bitmask = torch.randint(-(2**31), 2**31 - 1, (count, words), generator=gen, dtype=torch.int64).to(torch.int32)
    return logits, bitmask, None if rows is None else torch.tensor(rows)


@pytest.mark.parametrize("device,dtype", CASES)
@pytest.mark.parametrize("vocab", VOCABS)
@pytest.mark.parametrize("rows", [None, [5, 0, 3]], ids=["every-row", "subset"])
def test_kernel_matches_reference(device: str, dtype: torch.dtype, vocab: int, rows: list[int] | None) -> None:
    logits, bitmask, row_index = _inputs(vocab, dtype, rows, extra_words=1, seed=vocab)
    want = logits.clone()
    apply_token_bitmask_ref(want, bitmask, row_index)
    got = logits.to(device)
    apply_token_bitmask_triton(got, bitmask.to(device), None if row_index is None else row_index.to(device))
    assert torch.equal(got.cpu(), want)  # exact: -inf written or the value left alone
    assert torch.isinf(want).any()


@pytest.mark.parametrize("device,dtype", CASES[:1])
def test_kernel_refuses_what_it_cannot_mask(device: str, dtype: torch.dtype) -> None:
    logits, bitmask, _ = _inputs(97, dtype, None, extra_words=0, seed=1)
    logits, bitmask = logits.to(device), bitmask.to(device)
    with pytest.raises(ValueError, match="covers fewer"):
        apply_token_bitmask_triton(logits, bitmask[:, :2], None)
    with pytest.raises(ValueError, match="contiguous"):
        apply_token_bitmask_triton(logits.t().contiguous().t(), bitmask, None)


@pytest.mark.parametrize("switch", [True, False])
def test_op_takes_the_kernel_only_where_the_engines_triton_switch_says(switch: bool, monkeypatch) -> None:
    """apply_token_bitmask launches the kernel only where kernels.use_triton says so (CUDA, Triton importable, and
    not EngineConfig(use_triton=False)); the torch path otherwise, which masks the same tokens."""
    from stoker.engine.kernels import token_bitmask

    launched: list[bool] = []
    monkeypatch.setattr(token_bitmask, "apply_token_bitmask_triton", lambda *a: launched.append(True))
    monkeypatch.setattr(token_bitmask.kernels, "use_triton", lambda x: switch)
    logits = torch.zeros(2, 40)
    bitmask = torch.tensor([[0b101, 0], [-1, 0]], dtype=torch.int32)
    apply_token_bitmask(logits, bitmask, None)
    assert launched == ([True] if switch else [])
    if not switch:
        expected = torch.zeros(2, 40)
        apply_token_bitmask_ref(expected, bitmask, None)
        assert torch.equal(logits, expected)


@GPU
@NO_CUDA
@pytest.mark.parametrize("every_row", [True, False])
def test_bitmask_op_never_synchronizes_the_gpu(every_row):
    """The op is launched while the step's forward still runs: an op that synchronizes (a copy from pageable host
    memory, an .item()) makes the host wait for the whole forward (H200, 17:54 UTC: 14 ms a step at batch
    1,024, and the GPU then idle for the next forward's launch). Past the first call on a device (the bit
    table's one copy), nothing in it may synchronize."""
    gen = torch.Generator().manual_seed(7)
    logits = torch.randn(6, 1001, generator=gen)
    rows = None if every_row else torch.tensor([4, 1, 3])
    bitmask = torch.randint(-(2**31), 2**31 - 1, (6 if every_row else 3, 32), generator=gen, dtype=torch.int64)
    bitmask = bitmask.to(torch.int32)
    want = logits.clone()
    apply_token_bitmask_ref(want, bitmask, rows)
    device = torch.device("cuda")
    on_device = [t if t is None else t.to(device) for t in (logits, bitmask, rows)]
    apply_token_bitmask(on_device[0].clone(), on_device[1], on_device[2])  # the table's one copy to the device
    got = on_device[0].clone()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        apply_token_bitmask(got, on_device[1], on_device[2])
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert torch.equal(got.cpu(), want)


@pytest.mark.skipif(INTERPRET, reason="this is the interpreter run itself")
def test_token_bitmask_kernel_under_triton_interpreter() -> None:
    run_under_interpreter(__file__)
