"""A decode step's inputs into the decode graphs' static buffers in one launch (engine/kernels/graph_inputs.py)
against the copies it replaced (decode_inputs_ref): pending token ids resolved from the previous step's ids (the
row clamped as resolve_pending clamps it), padding rows' slots -1 and context lengths 1, a block table wider than one
column block, and what the launch must leave alone (padding rows' ids, positions and tables; columns past the
step's width). On the CPU under TRITON_INTERPRET=1 (the driver at the bottom), on CUDA as a gpu case."""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")
from kernel_harness import GPU, INTERPRET, NO_CUDA, run_under_interpreter  # noqa: E402
from stoker.engine.kernels import graph_inputs  # noqa: E402
from stoker.engine.kernels.graph_inputs import TABLE_BLOCK, decode_inputs_ref, decode_inputs_triton  # noqa: E402

DEVICES = ["cpu"] if INTERPRET else [pytest.param("cuda", marks=[GPU, NO_CUDA])]


def _static(rows: int, cols: int, device: str) -> tuple[torch.Tensor, ...]:
    """Static buffers holding an earlier step's values (nothing the launch may assume zero)."""
    g = torch.Generator().manual_seed(1)
    return (torch.randint(0, 1000, (rows,), generator=g).to(device),
            torch.randint(0, 500, (rows,), generator=g).to(device),
            torch.randint(0, 900, (rows,), generator=g).to(device),
            torch.randint(1, 500, (rows,), generator=g).to(torch.int32).to(device),
            torch.randint(0, 60, (rows, cols), generator=g).to(torch.int32).to(device))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("n, bucket, width, pending", [(1, 1, 3, True), (3, 4, TABLE_BLOCK + 6, True),
                                                       (5, 8, 7, False), (4, 4, 1, True)])
def test_decode_inputs_kernel_equals_the_copies(device: str, n: int, bucket: int, width: int, pending: bool) -> None:
    g = torch.Generator().manual_seed(n + width)
    ids = torch.randint(0, 1000, (n,), generator=g)
    prev = None
    if pending:  # rows' ids pending on the previous step's row 2, 0, .. (and one row id past its end: clamped)
        prev = torch.randint(0, 1000, (3,), generator=g).to(device)
        ids[0] = -1 - 2
        ids[n - 1] = -1 - (n - 1) % 3
        if n > 2:
            ids[1] = -1 - 7
    inp = (ids.to(device), torch.randint(0, 300, (n,), generator=g).to(device),
           torch.randint(0, 4000, (n,), generator=g).to(device),
           torch.randint(1, 300, (n,), generator=g).to(torch.int32).to(device),
           torch.randint(0, 200, (n, width), generator=g).to(torch.int32).to(device))
    want = _static(8, TABLE_BLOCK + 10, device)
    got = tuple(t.clone() for t in want)
    decode_inputs_ref(inp, prev, want, bucket)
    decode_inputs_triton(inp, prev, got, bucket)
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)
    if pending:  # by hand too: each pending row's id is prev_tokens[min(-1 - id, 2)]
        for i, t in enumerate(ids.tolist()):
            if t < 0:
                assert got[0][i].item() == prev[min(-1 - t, 2)].item()
    assert (got[2][n:bucket] == -1).all() and (got[3][n:bucket] == 1).all()


@pytest.mark.parametrize("device", DEVICES)
def test_decode_inputs_are_checked(device: str) -> None:
    inp = (torch.zeros(2, dtype=torch.int64, device=device), torch.zeros(2, dtype=torch.int64, device=device),
           torch.zeros(2, dtype=torch.int64, device=device), torch.ones(2, dtype=torch.int32, device=device),
           torch.zeros(2, 3, dtype=torch.int32, device=device))
    static = _static(4, 3, device)
    with pytest.raises(ValueError, match="do not fit bucket"):
        decode_inputs_triton(inp, None, static, 1)  # a bucket smaller than the step
    with pytest.raises(ValueError, match="do not fit bucket"):
        decode_inputs_triton(inp, None, _static(4, 2, device), 2)  # a table wider than the static one
    with pytest.raises(ValueError, match="context_lens must be contiguous"):
        decode_inputs_triton((*inp[:3], inp[3].long(), inp[4]), None, static, 2)
    with pytest.raises(ValueError, match="prev_tokens"):
        decode_inputs_triton(inp, torch.zeros(0, dtype=torch.int64, device=device), static, 2)


@pytest.mark.parametrize("switch", [True, False])
def test_dispatcher_follows_the_engines_triton_switch(switch: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """decode_inputs takes the kernel only where kernels.use_triton says so (CUDA, Triton importable, and not
    EngineConfig(use_triton=False)), like every op of engine/kernels; the copies otherwise."""
    calls: list[tuple[str, object]] = []
    monkeypatch.setattr(graph_inputs, "decode_inputs_triton", lambda *a: calls.append(("kernel", a)))
    monkeypatch.setattr(graph_inputs, "decode_inputs_ref", lambda *a: calls.append(("copies", a)))
    monkeypatch.setattr(graph_inputs.kernels, "use_triton", lambda x: switch)
    args = ((torch.zeros(1, dtype=torch.int64),), None, (), 1)
    graph_inputs.decode_inputs(*args)
    assert calls == [("kernel" if switch else "copies", args)]


@pytest.mark.slow
@pytest.mark.skipif(INTERPRET, reason="this is the interpreter run itself")
def test_graph_inputs_under_triton_interpreter() -> None:
    run_under_interpreter(__file__)
