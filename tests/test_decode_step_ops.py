"""The small ops around a decode step (issue 13 item 2): the pending-token gather that runs eagerly or inside
the decode graph, and the LM head that writes float32 logits in one GEMM on CUDA."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from stoker.engine.batch import resolve_pending
from stoker.engine.layers.embedding import lm_head_logits

CUDA = torch.cuda.is_available()


def test_resolve_pending_reads_the_previous_steps_tokens() -> None:
    prev = torch.tensor([501, 502, 503, 504])
    # Known ids pass through; -1 - r takes row r of the previous step's sample.
    ids = torch.tensor([7, -1 - 2, 9, -1 - 0, -1 - 3])
    assert resolve_pending(ids, prev).tolist() == [7, 503, 9, 501, 504]
    assert resolve_pending(ids[[0, 2]], prev).tolist() == [7, 9]
    plain = torch.tensor([3, 4])
    assert resolve_pending(plain, None) is plain


def test_lm_head_logits_float32_into_out() -> None:
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(5, 24, generator=gen)
    weight = torch.randn(37, 24, generator=gen)
    ref = F.linear(hidden.double(), weight.double()).float()
    got = lm_head_logits(hidden, weight)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    buffer = torch.full((8, 37), float("nan"))
    into = lm_head_logits(hidden, weight, buffer[:5])
    assert into.data_ptr() == buffer.data_ptr()
    torch.testing.assert_close(buffer[:5], ref, rtol=1e-5, atol=1e-5)
    assert buffer[5:].isnan().all()  # rows past the batch are not touched


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_lm_head_logits_one_gemm_to_float32_on_cuda(dtype: torch.dtype) -> None:
    """bf16/fp16 operands: float32 logits straight from the GEMM (no cast kernel), as close to the float64
    product as the old bf16-rounded-then-cast logits were, or closer."""
    from torch.profiler import ProfilerActivity, profile

    gen = torch.Generator(device="cuda").manual_seed(0)
    hidden = torch.randn(67, 512, device="cuda", generator=gen).to(dtype)
    weight = (torch.randn(3001, 512, device="cuda", generator=gen) * 0.05).to(dtype)
    exact = F.linear(hidden.double(), weight.double())
    old = F.linear(hidden, weight).float()
    out = torch.empty(80, 3001, device="cuda")
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        got = lm_head_logits(hidden, weight, out[:67])
        torch.cuda.synchronize()
    assert got.dtype == torch.float32 and got.data_ptr() == out.data_ptr()
    assert (got.double() - exact).abs().max() <= (old.double() - exact).abs().max()
    kernels = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    assert not any("copy" in k.lower() or "elementwise" in k.lower() for k in kernels), kernels


class _Replay:
    """Stands in for a captured CUDA graph on the CPU: a replay re-runs the captured forward on the static
    buffers, so everything DecodeGraphs does around a replay (static copies, padding rows, the in-graph
    pending-token gather, the shared logits rows) runs as on the GPU."""

    def __init__(self, graphs, bucket: int):
        self.graphs, self.bucket = graphs, bucket

    def replay(self) -> None:
        self.graphs._forward(self.bucket)


def test_decode_graph_bookkeeping_gives_the_eager_tokens(tmp_path) -> None:
    """Overlapped greedy decoding through DecodeGraphs.run (replays faked on the CPU) gives the tokens of the
    eager engine: batches of 1..5 sequences replay buckets 1, 2, 4, 8 with padding rows, and every decode
    input holds pending tokens that only the step's fill of the static buffers resolves (on the CPU its copies,
    graph_inputs.decode_inputs_ref; the kernel is tested against them in tests/test_kernels_graph_inputs.py)."""
    from engine_models import build_hf_model, prompts
    from stoker.engine import EngineRequest, SamplingParams
    from stoker.engine.config import EngineConfig
    from stoker.engine.cuda_graphs import DecodeGraphs
    from stoker.engine.engine import LLMEngine

    build_hf_model("llama", str(tmp_path), seed=5)

    def run(with_graphs: bool) -> tuple[dict[str, list[int]], int]:
        engine = LLMEngine(EngineConfig(str(tmp_path), device="cpu", num_kv_blocks=48, max_num_seqs=8,
                                        async_scheduling=True))
        runner = engine.runner
        graphs = None
        if with_graphs:
            graphs = DecodeGraphs(runner.model, runner.kv_caches, runner.device, runner.block_size, 8,
                                  engine.max_model_len)
            vocab = runner.model.compute_logits(torch.zeros(1, engine.model_config.hidden_size)).shape[1]
            graphs.logits = torch.full((8, vocab), float("nan"))  # rows a replay does not write stay NaN
            graphs.graphs = {b: _Replay(graphs, b) for b in graphs.sizes}
            runner.graphs = graphs
        tokens: dict[str, list[int]] = {}
        for i, ids in enumerate(prompts(11, [5, 9, 3, 12, 7])):
            engine.add_request(EngineRequest(f"r{i}", prompt_token_ids=ids,
                                             params=SamplingParams(temperature=0.0, max_tokens=6 + 2 * i)))
            for out in engine.step():  # one add per step: decode batches grow 1, 2, .. 5 (and shrink)
                tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
        while engine.has_unfinished():
            for out in engine.step():
                tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
        return tokens, 0 if graphs is None else graphs.replays

    eager, _ = run(False)
    graphed, replays = run(True)
    assert replays >= 10
    assert graphed == eager and all(len(t) == 6 + 2 * int(r[1:]) for r, t in graphed.items())
