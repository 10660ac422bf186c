"""Eager (prefill and mixed) steps write their logits into the decode graphs' static buffer (ModelRunner._eager_logits)
instead of a fresh [N, V] float32 tensor per step, which in W2 grew with N every mixed step (8 MB to 0.5 GB).

On the CPU there are no CUDA graphs: a stand-in with the graphs' `logits` buffer (and no bucket that fits) takes
their place, so the runner's real eager path writes into it; greedy tokens must equal a run without it, rows past
the buffer's must fall back to a fresh tensor, and the switch must turn it off."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from stoker.engine import EngineRequest, SamplingParams
from stoker.engine.config import EngineConfig
from stoker.engine.engine import LLMEngine


@dataclass
class GraphsStandIn:
    """What _forward and _eager_logits read of DecodeGraphs: the shared logits, and fits() (never: all eager)."""

    logits: torch.Tensor

    def fits(self, inp: Any) -> bool:
        return False


def run(model: str, rows: int | None, share: bool = True) -> tuple[dict[str, list[int]], list[bool], GraphsStandIn | None]:
    """Five requests, two joining mid-run (mixed steps) -> (tokens per request, per forward whether its logits were
    a view of the stand-in's buffer, the stand-in)."""
    engine = LLMEngine(EngineConfig(model_path=model, device="cpu", max_num_seqs=8, max_model_len=128,
                                    max_num_batched_tokens=16, num_kv_blocks=64))
    runner = engine.runner
    graphs = None
    if rows is not None:
        graphs = GraphsStandIn(torch.full((rows, runner.model_config.vocab_size), float("nan")))
        runner.graphs = graphs  # type: ignore[assignment]
    runner.share_graph_logits = share
    shared: list[bool] = []
    forward = runner.forward

    def spy(inp: Any) -> torch.Tensor:
        logits = forward(inp)
        shared.append(graphs is not None and logits.untyped_storage().data_ptr()
                      == graphs.logits.untyped_storage().data_ptr())
        return logits

    runner.forward = spy  # type: ignore[method-assign]
    greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    plan = {0: [[5, 6, 7], [9, 10, 11, 12, 13]], 2: [list(range(20, 41))], 4: [[3, 4], list(range(50, 62))]}
    got: dict[str, list[int]] = {}
    step = 0
    while engine.has_unfinished() or step <= max(plan):
        for ids in plan.get(step, []):
            rid = f"r{len(got)}"
            got[rid] = []
            engine.add_request(EngineRequest(rid, prompt_token_ids=ids, params=greedy))
        for out in engine.step():
            got[out.request_id] += out.new_token_ids
        step += 1
    return got, shared, graphs


def test_eager_steps_write_logits_into_the_graphs_buffer(tiny_model: str) -> None:
    want, _, _ = run(tiny_model, None)
    got, shared, graphs = run(tiny_model, 8)
    assert got == want
    assert shared and all(shared), shared  # every forward was eager and wrote into the buffer
    assert graphs is not None and not torch.isnan(graphs.logits[0]).any()


def test_rows_past_the_buffer_and_the_switch_take_a_fresh_tensor(tiny_model: str) -> None:
    want, _, _ = run(tiny_model, None)
    got, shared, _ = run(tiny_model, 1)  # one row: steps sampling two or more rows cannot use it
    assert got == want
    assert any(shared) and not all(shared), shared
    got, shared, _ = run(tiny_model, 8, share=False)
    assert got == want
    assert not any(shared), shared
