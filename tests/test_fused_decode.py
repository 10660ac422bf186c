"""The fused small-M decode path in the model (engine/models/fused_decode.py, issue 13 item 1).

- On the CPU under TRITON_INTERPRET=1 (the driver at the bottom re-runs this file so): float32 engines with
  decode_kernels "fused" / "fused-folded" against transformers (greedy tokens, and every decode step's
  logprobs against transformers' teacher-forced log-softmax) and against the unfused engine, for a tiny
  Llama, a tiny Qwen2 (q/k/v bias) and a tiny Qwen3 (per-head q/k norm); decode batches shrink from 5 to 1
  so both multiply paths of the kernels run (tl.dot above 4 tokens, CUDA cores below); FP8 weights and the FP8
  KV cache through the fused path.
- Anywhere: the setting's validation, its resolution and the worker flags that carry it.
- On the GPU (marked gpu): bf16 fused decode against the cublas path with CUDA graphs on (logits within bf16
  tolerance, no further from transformers float32 than transformers' own bf16; greedy tokens equal), and PDL.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

triton = pytest.importorskip("triton")
from engine_models import build_hf_model, hf_greedy, hf_logits, prompts  # noqa: E402
from kernel_harness import INTERPRET, e4m3_steps, exact_fp8_casts, run_under_interpreter  # noqa: E402
from stoker.engine import EngineRequest, SamplingParams  # noqa: E402
from stoker.engine.config import EngineConfig  # noqa: E402
from stoker.engine.engine import LLMEngine  # noqa: E402
from stoker.engine.layers import RMSNorm  # noqa: E402
from stoker.engine.models import fused_decode  # noqa: E402

interpreted = pytest.mark.skipif(not INTERPRET, reason="runs in the interpreter subprocess (the driver below)")
CUDA = torch.cuda.is_available()
gpu = [pytest.mark.gpu, pytest.mark.skipif(not CUDA, reason="needs CUDA")]

PROMPTS = prompts(5, [3, 11, 6, 17, 1])
MAX_TOKENS = [3, 5, 7, 5, 3]  # the decode batch goes 5 -> 3 -> 1 sequences


def generate(engine: LLMEngine, ids: list[list[int]], max_tokens: list[int]) -> dict[str, Any]:
    """Greedy with logprobs -> {rid: (tokens, [the sampled token's logprob per step], [the gap between the top
    two logprobs per step])}."""
    for i, (p, n) in enumerate(zip(ids, max_tokens, strict=True)):
        params = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, logprobs=2)
        engine.add_request(EngineRequest(f"r{i}", prompt_token_ids=p, params=params))
    got: dict[str, tuple[list[int], list[float], list[float]]] = {f"r{i}": ([], [], []) for i in range(len(ids))}
    while engine.has_unfinished():
        for out in engine.step():
            assert out.error_code is None, out.error_message
            tokens, logprobs, gaps = got[out.request_id]
            tokens.extend(out.new_token_ids)
            logprobs.extend(lp.logprob for lp in out.logprobs or [])
            gaps.extend(lp.top[0].logprob - lp.top[1].logprob for lp in out.logprobs or [])
    return got


def cpu_engine(path: str, decode_kernels: str, **kw: Any) -> LLMEngine:
    return LLMEngine(EngineConfig(model_path=path, device="cpu", num_kv_blocks=32, decode_kernels=decode_kernels,
                                  **kw))


class SpyCalls:
    """Counts fused decode layer calls (so a test knows the fused path, not a fallback, made its tokens)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch):
        import stoker.engine.models.llama as llama

        self.calls = 0
        self.mlp_rows: list[int] = []  # the token count of every fused-MLP launch (kernels/fused_mlp.py)
        self.mlp_args: list[tuple[bool, ...]] = []  # each launch's (norm_sums, sums_out, pdl, finish_early) given
        original = llama.fused_decode_layer
        original_mlp = fused_decode.fused_mlp_triton

        def spy(*args: Any, **kwargs: Any) -> Any:
            self.calls += 1
            return original(*args, **kwargs)

        def spy_mlp(x: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            self.mlp_rows.append(x.shape[0])
            self.mlp_args.append((kwargs.get("norm_sums") is not None, kwargs.get("sums_out") is not None,
                                  bool(kwargs.get("pdl")), bool(kwargs.get("finish_early"))))
            return original_mlp(x, *args, **kwargs)

        monkeypatch.setattr(llama, "fused_decode_layer", spy)
        monkeypatch.setattr(fused_decode, "fused_mlp_triton", spy_mlp)


def count_norm_calls(monkeypatch: pytest.MonkeyPatch, carried: list[bool] | None = None) -> list[tuple[int, bool]]:
    """Records each fused qkv and gate_up GEMV launch as (its token count, whether it took a prologue norm weight);
    into `carried`, whether it took a carried norm's sums (norm_sums), in launch order."""
    calls: list[tuple[int, bool]] = []
    for name in ("gemv_triton", "gemv_rotary_cache_triton"):
        original = getattr(fused_decode, name)

        def spy(x: torch.Tensor, *args: Any, _original: Any = original, **kwargs: Any) -> Any:
            if kwargs.get("silu_mul") or "cos_sin" in kwargs:  # gate_up and qkv: the two after a norm
                calls.append((x.shape[0], kwargs.get("norm_weight") is not None))
                if carried is not None:
                    carried.append(kwargs.get("norm_sums") is not None)
            return _original(x, *args, **kwargs)

        monkeypatch.setattr(fused_decode, name, spy)
    return calls


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3"])
def arch(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str, Any]:
    if not INTERPRET:
        pytest.skip("runs in the interpreter subprocess")
    path = str(tmp_path_factory.mktemp(request.param))
    return request.param, path, build_hf_model(request.param, path)


# ------------------------------------------------------------- CPU, interpreter: against HF and the unfused path
@interpreted
@pytest.mark.parametrize("mode", ["fused", "fused-folded", "fused-folded+pdl", "fused-folded+pro0",
                                  "fused-folded+pro16", "fused-folded+nocarry"])
def test_fused_decode_greedy_matches_transformers_and_unfused(arch, mode: str, monkeypatch) -> None:
    """+pdl: decode_pdl on. On the CPU that checks the setting's way through the engine only (the report, the
    pdl arguments of every launch): the interpreter drops the launch attribute and the attention is the torch
    reference there; the PDL kernels themselves are tests/test_kernels_decode_pdl.py's and the GPU cases below.
    +proN: decode_prologue_norm_max_m N (0: the norm kernel at every step; 16: the prologues at every step; the
    default (2) splits this test's steps of 5, 3 and 1 tokens between the two).
    "fused-folded" carries its norms (fused_decode.FOLDED_NORM_CARRY): every norm but the first layer's input norm
    becomes sums added by o_proj (for the MLP) and the MLP's finishing kernel (for the next qkv), whose buffers are
    poisoned first as a step that stopped halfway leaves them (the first layer's qkv and o_proj zero them); so
    the cap applies to the first layer's input norm only. +nocarry: the prologues / norm kernels in every layer."""
    name, path, hf = arch
    if mode != "fused" and name != "llama":
        pytest.skip("the folded variants once (llama) keep the interpreter run short")
    mode, _, flag = mode.partition("+")
    pdl = flag == "pdl"
    carry = mode == "fused-folded" and flag != "nocarry"
    monkeypatch.setattr(fused_decode, "FOLDED_NORM_CARRY", flag != "nocarry")
    # the finishing kernel at every step (the spies below count it); its fold into the next qkv, the default at one
    # token, is test_mlp_finish_in_qkv_matches_the_finishing_kernel's
    monkeypatch.setattr(fused_decode, "MLP_FINISH_IN_QKV", False)
    cap = {"decode_prologue_norm_max_m": int(flag[3:])} if flag.startswith("pro") else {}  # else the default
    spy = SpyCalls(monkeypatch)
    qkv_carried: list[bool] = []
    count_norm_calls(monkeypatch, qkv_carried)  # (the MLP is fused_mlp_triton: only the qkv launches land here)
    fused = cpu_engine(path, mode, decode_pdl=pdl, **cap)
    prologue_max_m = fused.config.decode_prologue_norm_max_m
    report = fused.runner.startup["decode_kernels"]
    assert report["mode"] == mode and report["fused_layers"] == 2 and "fallback" not in report
    assert report["pdl"] == pdl and report["norm_carry"] == carry
    first = fused.runner.model.model.layers[0].fused_decode
    assert first.pdl_off == (not pdl)  # decode_pdl=False given: none at all
    assert report["prologue_norm_max_m"] == (prologue_max_m if mode == "fused-folded" else 0)
    if carry:
        assert first.carry is not None and first.carry.x_post is None and first.carry.x_next is None  # sums only
        first.carry.sums_post.fill_(12_345_678_901)
        first.carry.sums_next.fill_(98_765_432_101)
    import stoker.engine.models.llama as llama

    norms = {"calls": 0, "inside": False}  # RMSNorm calls made inside the fused decode layers
    original_norm, fused_layer = RMSNorm.forward, llama.fused_decode_layer

    def count_norm(module: Any, *args: Any, **kwargs: Any) -> Any:
        norms["calls"] += norms["inside"]
        return original_norm(module, *args, **kwargs)

    def inside(*args: Any, **kwargs: Any) -> Any:
        norms["inside"] = True
        try:
            return fused_layer(*args, **kwargs)
        finally:
            norms["inside"] = False

    monkeypatch.setattr(RMSNorm, "forward", count_norm)
    monkeypatch.setattr(llama, "fused_decode_layer", inside)
    got = generate(fused, PROMPTS, MAX_TOKENS)
    decode_steps = max(MAX_TOKENS) - 1
    assert spy.calls == 2 * decode_steps, "the fused path did not make every decode step"
    # Every decode step ran its MLPs fused (two layers, the step's live sequences as rows), PDL or not.
    live = [sum(n - 1 > step for n in MAX_TOKENS) for step in range(decode_steps)]
    assert max(live) > 1 and min(live) == 1  # steps of several tokens and of one
    assert spy.mlp_rows == [rows for rows in live for _ in range(2)]
    # carried: both MLPs read the sums o_proj added, the first also adds the second layer's; PDL as the chain's; the
    # finishing kernel early where FINISH_EARLY is on, unless decode_pdl is False
    early = pdl and fused_decode.FINISH_EARLY
    assert spy.mlp_args == [(carry, carry and i == 0, pdl, early) for _ in live for i in range(2)], spy.mlp_args
    assert qkv_carried == [False, carry] * decode_steps, qkv_carried
    # the norm kernels the decode steps ran: two a layer where a step does not normalise in the prologues; carried,
    # only the first layer's input norm
    kernel_steps = [rows for rows in live if mode == "fused" or rows > prologue_max_m]
    assert norms["calls"] == (len(kernel_steps) if carry else 2 * 2 * len(kernel_steps))
    if mode == "fused-folded" and not flag:
        assert 0 < len(kernel_steps) < len(live)  # the default cap: both kinds of step
    unfused = generate(cpu_engine(path, "cublas"), PROMPTS, MAX_TOKENS)
    assert spy.calls == 2 * decode_steps, "the cublas engine took the fused path"
    for i, (p, n) in enumerate(zip(PROMPTS, MAX_TOKENS, strict=True)):
        tokens, logprobs, _ = got[f"r{i}"]
        assert tokens == hf_greedy(hf, p, n), f"prompt {i}: fused tokens differ from transformers"
        assert tokens == unfused[f"r{i}"][0], f"prompt {i}: fused tokens differ from the unfused engine"
        # Every step's logprob against transformers' teacher-forced log-softmax and the unfused engine's.
        hf_lp = torch.log_softmax(hf_logits(hf, p + tokens[:-1])[len(p) - 1 :], dim=-1)
        want = hf_lp[torch.arange(n), torch.tensor(tokens)]
        torch.testing.assert_close(torch.tensor(logprobs), want, atol=2e-4, rtol=0)
        torch.testing.assert_close(logprobs, unfused[f"r{i}"][1], atol=1e-4, rtol=0)


# Three layers (the middle one finishes the MLP before it and leaves its own unfinished), hidden 72 (not a power of
# two) and Hq * D = 64 != hidden.
PENDING_SHAPE: dict[str, Any] = {"num_hidden_layers": 3, "hidden_size": 72, "intermediate_size": 100, "head_dim": 16}


def spy_pending(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """Counts the fused path's launches of the MLP_FINISH_IN_QKV hand-off: MLPs left unfinished and finished, qkv
    GEMVs on an accumulator, GEMVs zeroing one."""
    seen = dict.fromkeys(("unfinished", "finished", "qkv_on_accumulator", "zeroing"), 0)
    mlp, gemv, rope = fused_decode.fused_mlp_triton, fused_decode.gemv_triton, fused_decode.gemv_rotary_cache_triton

    def spy_mlp(*args: Any, **kwargs: Any) -> Any:
        seen["finished" if kwargs.get("finish", True) else "unfinished"] += 1
        return mlp(*args, **kwargs)

    def spy_gemv(*args: Any, **kwargs: Any) -> Any:
        seen["zeroing"] += kwargs.get("zero_accumulator") is not None
        return gemv(*args, **kwargs)

    def spy_rope(*args: Any, **kwargs: Any) -> Any:
        seen["qkv_on_accumulator"] += bool(kwargs.get("x_accumulator"))
        return rope(*args, **kwargs)

    monkeypatch.setattr(fused_decode, "fused_mlp_triton", spy_mlp)
    monkeypatch.setattr(fused_decode, "gemv_triton", spy_gemv)
    monkeypatch.setattr(fused_decode, "gemv_rotary_cache_triton", spy_rope)
    return seen


@interpreted
@pytest.mark.parametrize("name", ["llama", "qwen3"])
def test_mlp_finish_in_qkv_matches_the_finishing_kernel(name: str, tmp_path, monkeypatch) -> None:
    """fused_decode.MLP_FINISH_IN_QKV on ("fused-folded", float32, the carried norms): every layer's MLP but the last
    launches its streaming kernel alone, the next layer's qkv takes its accumulator and the stream (x_accumulator)
    and that layer's o_proj zeroes the accumulator, at every decode step (5, 3 and 1 tokens). Greedy tokens equal
    transformers' and the switch-off engine's; every step's logprob and the final norm's input are within float32
    rounding of the switch-off run's (not bitwise: qkv sums the finished stream's rms in float32 in its K loop where
    the finishing kernel adds it into fixed-point slots); the carried slots, poisoned first, and every layer's
    accumulator are zero after the run. Qwen3: its per-head q / k norm in qkv (one program a head)."""
    hf = build_hf_model(name, str(tmp_path), shape=PENDING_SHAPE)
    seen = spy_pending(monkeypatch)
    monkeypatch.setattr(fused_decode, "MLP_FINISH_IN_QKV_MAX_M", 16)  # every step of this test (the default: 1)
    runs, finals, counts = {}, {}, {}
    for on in (False, True):
        monkeypatch.setattr(fused_decode, "MLP_FINISH_IN_QKV", on)
        engine = cpu_engine(str(tmp_path), "fused-folded")
        layers = [layer.fused_decode for layer in engine.runner.model.model.layers]
        assert [fd.mlp_pending_max_m for fd in layers] == ([16, 16, 0] if on else [0, 0, 0])
        carry = layers[0].carry
        assert carry is not None and carry.x_next is None  # the folded carried norms
        carry.sums_post.fill_(12_345_678_901)  # as a step that stopped halfway leaves them
        carry.sums_next.fill_(98_765_432_101)
        final_norm, finals[on] = engine.runner.model.model.norm, []
        original = final_norm.forward

        def record(hidden: torch.Tensor, *args: Any, _inputs: list = finals[on], _original: Any = original,
                   **kwargs: Any) -> Any:
            _inputs.append(hidden.clone())
            return _original(hidden, *args, **kwargs)

        monkeypatch.setattr(final_norm, "forward", record)
        seen.update(dict.fromkeys(seen, 0))
        runs[on] = generate(engine, PROMPTS, MAX_TOKENS)
        counts[on] = dict(seen)
        assert not carry.sums_post.any() and not carry.sums_next.any()
        assert not any(fd.mlp_accumulator.any() for fd in layers), "an accumulator left dirty"
    steps = max(MAX_TOKENS) - 1  # three layers a step: two hand-offs where the switch is on
    assert counts[False] == {"unfinished": 0, "finished": 3 * steps, "qkv_on_accumulator": 0, "zeroing": 0}
    assert counts[True] == {"unfinished": 2 * steps, "finished": steps, "qkv_on_accumulator": 2 * steps,
                            "zeroing": 2 * steps}, counts[True]
    assert len(finals[True]) == len(finals[False]) > steps
    for on_input, off_input in zip(finals[True], finals[False], strict=True):
        # float32 rounding of the stream's scale (it reaches ~100 here; up to 3.6e-5 apart, a few ulps, when written)
        scale = off_input.abs().max().item()
        torch.testing.assert_close(on_input, off_input, atol=2e-6 * scale, rtol=1e-5)
    for i, (p, n) in enumerate(zip(PROMPTS, MAX_TOKENS, strict=True)):
        tokens, logprobs, _ = runs[True][f"r{i}"]
        assert tokens == runs[False][f"r{i}"][0] == hf_greedy(hf, p, n), f"prompt {i}"
        torch.testing.assert_close(logprobs, runs[False][f"r{i}"][1], atol=1e-5, rtol=0)
        hf_lp = torch.log_softmax(hf_logits(hf, p + tokens[:-1])[len(p) - 1 :], dim=-1)
        torch.testing.assert_close(torch.tensor(logprobs), hf_lp[torch.arange(n), torch.tensor(tokens)], atol=2e-4,
                                   rtol=0)


@interpreted
@pytest.mark.parametrize("mode", ["fused-folded", "fused-folded+pro0"])
def test_tensor_parallel_ranks_take_the_fused_path(arch, mode: str) -> None:
    """TP = 2 (two processes, gloo): each rank's qkv / attention on its heads, o_proj and the MLP on its columns as
    partial sums (rank 0's with the residual added in the epilogue) that the all-reduce sums into the stream; no
    carried norms (a rank's epilogue sees a partial sum). Every layer fused on rank 0, and greedy tokens and every
    step's logprob equal to the TP = 1 fused engine's and transformers'. +pro0: the norm kernels at every step
    (decode_prologue_norm_max_m 0) instead of the prologue norms at 1-2 tokens."""
    name, path, hf = arch
    if name == "qwen2":
        pytest.skip("llama (both modes) and qwen3 (per-head q / k norms in a rank's qkv epilogue) keep the run short")
    if name == "qwen3" and mode != "fused-folded":
        pytest.skip("the norm kernels' form once (llama)")
    mode, _, flag = mode.partition("+")
    cap = {"decode_prologue_norm_max_m": 0} if flag == "pro0" else {}
    want = generate(cpu_engine(path, mode, **cap), PROMPTS, MAX_TOKENS)
    engine = cpu_engine(path, mode, tensor_parallel_size=2, **cap)
    try:
        report = engine.runner.startup["decode_kernels"]
        assert report["fused_layers"] == 2 and "fallback" not in report and report["norm_carry"] is False, report
        first = engine.runner.model.model.layers[0].fused_decode
        assert first.shard is not None and (first.shard.rank, first.shard.size) == (0, 2)
        got = generate(engine, PROMPTS, MAX_TOKENS)
    finally:
        engine.close()
    for i, (p, n) in enumerate(zip(PROMPTS, MAX_TOKENS, strict=True)):
        tokens, logprobs, _ = got[f"r{i}"]
        assert tokens == want[f"r{i}"][0] == hf_greedy(hf, p, n), f"prompt {i}"
        torch.testing.assert_close(logprobs, want[f"r{i}"][1], atol=1e-4, rtol=0)


@interpreted
def test_folding_rewrites_the_weights_in_place(arch) -> None:
    """fused-folded: qkv / gate_up hold W diag(g) in their own storage (no second copy on the device), the norms
    hold ones, no other parameter changes, no byte is added; planning again folds nothing twice."""
    from stoker.engine.kv_cache import weights_bytes

    name, path, _ = arch
    if name != "llama":
        pytest.skip("once is enough")
    model = cpu_engine(path, "cublas").runner.model
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    storage = {n: p.data_ptr() for n, p in model.named_parameters()}
    size = weights_bytes(model)
    for _ in range(2):
        assert model.plan_decode("fused-folded", False, torch.float32, True, 2)["fused_layers"] == 2
        assert {n: p.data_ptr() for n, p in model.named_parameters()} == storage and weights_bytes(model) == size
        folded = {}
        for i in range(2):
            for lin, norm in (("self_attn.qkv_proj", "input_layernorm"), ("mlp.gate_up_proj", "post_attention_layernorm")):
                w, g = f"model.layers.{i}.{lin}.weight", f"model.layers.{i}.{norm}.weight"
                folded[w] = before[w] * before[g][None, :]
                folded[g] = torch.ones_like(before[g])
        for n, p in model.named_parameters():
            torch.testing.assert_close(p, folded.get(n, before[n]), atol=1e-6, rtol=1e-6, msg=n)


@interpreted
@pytest.mark.parametrize("mode", ["fused", "fused+nocarry", "fused-folded", "fused-folded+prologue"])
def test_fp8_weights_take_the_fused_path(arch, mode: str, monkeypatch) -> None:
    """FP8 weights (quantized per row at load) run the fused kernels with their row scales, unfolded even under
    "fused-folded" (folding would requantize), which keeps the RMSNorm kernels like "fused" unless
    fused_decode.FP8_PROLOGUE_NORM is set ("+prologue"; off by default since session 17): then both run in the qkv /
    gate_up prologues with the norm weight applied to x (no separate norm kernel): every decode step fused,
    the weights untouched by planning, and greedy tokens and logprobs equal to the unfused FP8 engine's (the
    dequantizing reference path, which tests/test_fp8.py holds to transformers on the dequantized weights). The
    folded-mode run reads the weights as int32 words through the bit trick ("bits-join") in every kernel, the
    others as the engine picks (on the CPU: Triton's cast; the PTX conversion is the GPU's). Without the prologue
    the norms are carried (fused_decode.NORM_CARRY) but for the first layer's input norm: gate_up and the second
    layer's qkv take the sums o_proj / down left (their slots poisoned first, as a step that stopped halfway leaves
    them: the first layer's qkv and o_proj zero them); "+nocarry" runs the norm kernels instead."""
    name, path, _ = arch
    if name == "qwen3" or (mode != "fused" and name != "llama"):
        pytest.skip("llama every mode, qwen2 (bias in the FP8 qkv epilogue) once: the interpreter run stays short")
    mode, _, flag = mode.partition("+")
    monkeypatch.setattr(fused_decode, "FP8_PROLOGUE_NORM", flag == "prologue")
    monkeypatch.setattr(fused_decode, "NORM_CARRY", flag != "nocarry")
    if mode == "fused-folded":
        monkeypatch.setattr(fused_decode, "FP8_WEIGHT_CONVERT", dict.fromkeys(("rope", "silu", "add"), "bits-join"))
    spy = SpyCalls(monkeypatch)
    carried: list[bool] = []
    norm_calls = count_norm_calls(monkeypatch, carried)
    engine = cpu_engine(path, mode, quantization="fp8")
    report = engine.runner.startup["decode_kernels"]
    assert report["fused_layers"] == 2 and "fallback" not in report, report
    assert report["norm_carry"] == (flag == ""), report
    layer = engine.runner.model.model.layers[0]
    assert not layer.fused_decode.folded and layer.input_layernorm.weight.ne(1).any()
    # EngineConfig.decode_pdl None: FP8 layers launch with PDL (the interpreter drops the launch attribute)
    assert engine.config.decode_pdl is None and layer.fused_decode.pdl and report["pdl"] and not layer.fused_decode.pdl_off
    if layer.fused_decode.carry is not None:  # as a step that stopped halfway would leave them: the next starts clean
        layer.fused_decode.carry.sums_post.fill_(12_345_678_901)
        layer.fused_decode.carry.sums_next.fill_(98_765_432_101)
    got = generate(engine, PROMPTS[:3], MAX_TOKENS[:3])
    assert spy.calls == 2 * (max(MAX_TOKENS[:3]) - 1), "the fused path did not make every decode step"
    # each fused layer call: qkv and gate_up take the norm weight themselves ("fused-folded", steps of up to
    # decode_prologue_norm_max_m tokens; the larger ones run the norm kernel first) or none ("fused")
    prologue = mode == "fused-folded" and flag == "prologue"
    assert layer.fused_decode.prologue_max_m == (engine.config.decode_prologue_norm_max_m if prologue else 0)
    assert len(norm_calls) == 2 * spy.calls
    if prologue:
        cap = engine.config.decode_prologue_norm_max_m
        assert all(has_norm == (rows <= cap) for rows, has_norm in norm_calls), norm_calls
        assert {has_norm for _, has_norm in norm_calls} == {True, False}, "steps on both sides of the cut-over"
    else:
        assert not any(has_norm for _, has_norm in norm_calls)
    # per fused step: qkv, gate_up of layer 0, then of layer 1; all but layer 0's qkv carried
    assert carried == ([False, True, True, True] if flag == "" else [False] * 4) * (spy.calls // 2), carried
    unfused = generate(cpu_engine(path, "cublas", quantization="fp8"), PROMPTS[:3], MAX_TOKENS[:3])
    for rid, (tokens, logprobs, _) in got.items():
        assert tokens == unfused[rid][0], f"{rid}: fused FP8 tokens differ from the unfused FP8 engine"
        torch.testing.assert_close(logprobs, unfused[rid][1], atol=1e-4, rtol=0)


@interpreted
@pytest.mark.parametrize("mode", ["fused", "fused-folded", "fused+fp8"])
def test_fp8_kv_cache_takes_the_fused_path(arch, mode: str, monkeypatch) -> None:
    """An FP8 KV cache through the qkv epilogue: every layer fused (no fallback), every decode step fused, k / k_scale
    and v / v_scale stored as the unfused rotary stores them, and greedy tokens equal to the unfused engine's on the
    same cache. Each layer gets its own scales away from 1.0 (a scale that does not reach the kernel, or the other
    tensor's, shows). The decode attention launches with PDL where the chain has it ("+fp8": FP8 weights, whose
    layers launch with PDL; its early first tile converted from FP8 as the loop converts) and without it elsewhere. Llama in each mode, Qwen2 (bias) and Qwen3 (q/k
    norm) under "fused". The interpreter's float32 -> FP8 cast is made the GPU's (kernel_harness.exact_fp8_casts):
    otherwise the fused kernel would store some values halved where the unfused torch cast rounds them
    (test_gemv_rotary_cache_fp8_on_values_that_need_no_rounding checks the kernel's own cast under the interpreter)."""
    from stoker.engine.layers import PagedAttention

    name, path, _ = arch
    if mode != "fused" and name != "llama":
        pytest.skip("llama every mode, qwen2 (bias) and qwen3 (q/k norm) under fused: the interpreter run stays short")
    mode, _, flag = mode.partition("+")
    quant = {"quantization": "fp8"} if flag == "fp8" else {}
    exact_fp8_casts(monkeypatch)
    attention_pdl: list[bool] = []
    original_attention = PagedAttention.forward

    def spy_attention(module: Any, *args: Any, **kwargs: Any) -> Any:
        attention_pdl.append(bool(kwargs.get("pdl")))
        return original_attention(module, *args, **kwargs)

    monkeypatch.setattr(PagedAttention, "forward", spy_attention)
    engines = {}
    for kernels in (mode, "cublas"):
        engine = cpu_engine(path, kernels, kv_cache_dtype="fp8", **quant)
        for i, layer in enumerate(engine.runner.model.model.layers):
            # |k| and |v| stay below 10 in these runs (unit scales): stored values up to ~400, inside +-448
            layer.self_attn.attn.k_scale.data.fill_(0.02 * (i + 1))
            layer.self_attn.attn.v_scale.data.fill_(0.03 * (i + 1))
        engines[kernels] = engine
    report = engines[mode].runner.startup["decode_kernels"]
    assert report["fused_layers"] == 2 and "fallback" not in report, report
    assert engines[mode].runner.kv_caches[0][0].dtype == torch.float8_e4m3fn
    assert engines[mode].runner.model.model.layers[0].fused_decode.pdl == (flag == "fp8")
    spy = SpyCalls(monkeypatch)
    got = generate(engines[mode], PROMPTS[:3], MAX_TOKENS[:3])
    assert spy.calls == 2 * (max(MAX_TOKENS[:3]) - 1), "the fused path did not make every decode step"
    assert attention_pdl and any(attention_pdl) == (flag == "fp8"), attention_pdl
    unfused = generate(engines["cublas"], PROMPTS[:3], MAX_TOKENS[:3])
    assert spy.calls == 2 * (max(MAX_TOKENS[:3]) - 1), "the cublas engine took the fused path"
    for rid, (tokens, logprobs, _) in got.items():
        assert tokens == unfused[rid][0], f"{rid}: fused tokens differ from the unfused engine's on the FP8 cache"
        torch.testing.assert_close(logprobs, unfused[rid][1], atol=1e-4, rtol=0)
    # The same requests in the same order take the same blocks in both engines, so the caches hold the same numbers,
    # up to the one e4m3 step a float32 k or v an ulp apart (the GEMV's sums against F.linear's) can land on; in
    # these runs they were equal byte for byte. Without exact_fp8_casts the interpreter's cast parted the greedy
    # tokens in 3 of these 5 runs, and cached values up to 243 steps apart.
    for (k, v), (k_ref, v_ref) in zip(engines[mode].runner.kv_caches, engines["cublas"].runner.kv_caches, strict=True):
        for cache, ref in ((k, k_ref), (v, v_ref)):
            steps = e4m3_steps(cache, ref)
            written = (cache.view(torch.uint8) != 0) | (ref.view(torch.uint8) != 0)
            assert written.any() and steps.max().item() <= 1, steps.max().item()
            assert (steps[written] == 0).float().mean().item() > 0.99


# ----------------------------------------------------------------------------------- anywhere: the setting
def test_decode_kernels_setting_is_validated(tmp_path, monkeypatch) -> None:
    path = str(tmp_path)
    with pytest.raises(ValueError, match=r"decode_kernels must be one of \('auto', 'fused', 'fused-folded', "
                                         r"'cublas'\), got 'triton'"):
        EngineConfig(model_path=path, device="cpu", decode_kernels="triton")
    with pytest.raises(ValueError, match=r"decode_kernels='fused' runs Triton kernels: drop use_triton=False"):
        EngineConfig(model_path=path, device="cpu", decode_kernels="fused", use_triton=False)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match=r"decode_kernels='fused-folded' needs a CUDA device \(or TRITON_INTERPRET"):
        EngineConfig(model_path=path, device="cpu", decode_kernels="fused-folded")
    for ok in ("auto", "cublas"):
        assert EngineConfig(model_path=path, device="cpu", decode_kernels=ok).decode_kernels == ok


def test_fp8_launch_takes_the_one_token_table_on_the_gpu_only(monkeypatch) -> None:
    """fp8_launch: FP8_FUSED_M1's shape and conversion for one token on the GPU, FP8_FUSED_DOT's for 2-16;
    otherwise FP8_WEIGHT_CONVERT with the W8A16 table for o_proj / down and the launcher's own shape for the
    others; the cast where the words or the PTX cannot run (K not whole words, the CPU)."""
    from stoker.engine.kernels.fp8_linear import fp8_gemv_config
    from stoker.engine.kernels.gemv import GemvConfig

    tuned, dot = GemvConfig(1, 4, 2048, False, 8, 3), GemvConfig(16, 16, 256, True, 2, 4)
    monkeypatch.setattr(fused_decode, "FP8_FUSED_M1", {("add", 4096, 14336): (tuned, "asm-join")})
    monkeypatch.setattr(fused_decode, "FP8_FUSED_DOT", {"add": (dot, "asm-join")})
    monkeypatch.setattr(fused_decode, "FP8_WEIGHT_CONVERT", {"rope": "cast", "silu": "asm-join", "add": "bits-join"})
    launch = fused_decode.fp8_launch
    assert launch("add", 4096, 14336, 1, True) == (tuned, "asm-join")
    assert launch("add", 4096, 14336, 2, True) == (dot, "asm-join")
    assert launch("add", 4096, 14336, 16, True) == (dot, "asm-join")
    assert launch("rope", 6144, 4096, 4, True) == (None, "cast")  # no dot entry: the launcher's own
    assert launch("add", 4096, 14336, 2, False) == (None, "bits-join")
    assert launch("add", 4096, 4096, 1, True) == (fp8_gemv_config(4096, 4096, 1, True), "bits-join")
    assert launch("add", 4096, 14336, 1, False) == (None, "bits-join")
    assert launch("silu", 28672, 4096, 1, True) == (None, "asm-join")
    assert launch("silu", 28672, 4096, 1, False) == (None, "cast")  # no PTX off the GPU
    assert launch("add", 4096, 4098, 1, True)[1] == "cast"  # K not whole int32 words


def test_o_proj_pdl_only_where_o_proj_loads_several_tiles_before_its_wait(monkeypatch) -> None:
    """_o_proj_pdl: every layer of a PDL chain; without one (bf16), under O_PROJ_PDL, only where the o_proj launch
    at that step's token count loads more than one K tile before its wait (the 8B entry at one token, on the GPU);
    never off the GPU, at 2-16 tokens (the tensor-core tile), for other shapes (one tile early: measured a loss) or
    with decode_pdl False."""
    from types import SimpleNamespace

    class Weight:
        def __init__(self, n: int, k: int, cuda: bool) -> None:
            self.shape, self.is_cuda = (n, k), cuda

        def element_size(self) -> int:
            return 2

    def fd(n: int, k: int, cuda: bool = True, pdl: bool = False, pdl_off: bool = False) -> Any:
        return SimpleNamespace(pdl=pdl, pdl_off=pdl_off, o_proj=SimpleNamespace(weight=Weight(n, k, cuda)))

    monkeypatch.setattr(fused_decode, "O_PROJ_PDL", True)
    o_pdl = fused_decode._o_proj_pdl
    assert o_pdl(fd(4096, 4096), 1) and not o_pdl(fd(4096, 4096), 2) and not o_pdl(fd(4096, 4096), 16)
    assert not o_pdl(fd(4096, 4096, cuda=False), 1) and not o_pdl(fd(2048, 2048), 1)
    assert o_pdl(fd(2048, 2048, pdl=True), 3)
    assert not o_pdl(fd(4096, 4096, pdl_off=True), 1)  # decode_pdl False: none at all
    monkeypatch.setattr(fused_decode, "O_PROJ_PDL", False)
    assert not o_pdl(fd(4096, 4096), 1) and o_pdl(fd(4096, 4096, pdl=True), 1)


def test_qkv_pdl_follows_the_chain_or_the_o_proj_boundary(monkeypatch) -> None:
    """_qkv_pdl: qkv launches with PDL in a PDL chain (FP8), and under QKV_PDL wherever the attention -> o_proj
    boundary does (bf16 at one token), so the attention gets in while qkv streams; otherwise not."""
    from types import SimpleNamespace

    monkeypatch.setattr(fused_decode, "QKV_PDL", True)
    qkv_pdl = fused_decode._qkv_pdl
    assert qkv_pdl(SimpleNamespace(pdl=True), False) and qkv_pdl(SimpleNamespace(pdl=False), True)
    assert not qkv_pdl(SimpleNamespace(pdl=False), False)
    monkeypatch.setattr(fused_decode, "QKV_PDL", False)
    assert not qkv_pdl(SimpleNamespace(pdl=False), True) and qkv_pdl(SimpleNamespace(pdl=True), False)


def test_auto_is_fused_folded_on_cuda_with_triton_only(tmp_path) -> None:
    def resolve(device: str, **kw: Any) -> str:
        config = EngineConfig(model_path=str(tmp_path), device="cpu")
        config.device = device  # as __post_init__ leaves it on a CUDA machine (none is needed to resolve)
        for name, value in kw.items():
            setattr(config, name, value)
        return fused_decode.resolve_decode_kernels(config)

    assert resolve("cpu") == "cublas"
    assert resolve("cuda") == "fused-folded"
    assert resolve("cuda", decode_kernels="fused") == "fused"
    assert resolve("cuda", use_triton=False) == "cublas"
    assert resolve("cuda", decode_kernels="cublas") == "cublas"
    assert resolve("cuda", decode_kernels="fused-folded") == "fused-folded"


def test_worker_flags_reach_the_engine_config(tmp_path, capsys, monkeypatch) -> None:
    import stoker.engine
    from stoker.worker import main as worker_main

    path = str(tmp_path)
    cfg = worker_main.parse_config(["--model", path, "--decode-kernels", "fused-folded", "--decode-pdl",
                                    "--no-warmup", "--device", "cpu"], {})
    built: list[EngineConfig] = []
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # lets EngineConfig accept a fused setting on the CPU
    monkeypatch.setattr(stoker.engine, "LLMEngine", built.append)  # the config build_engine makes, no engine
    worker_main.build_engine(cfg)
    assert (built[0].decode_kernels, built[0].decode_pdl, built[0].decode_fused_mlp) == ("fused-folded", True, True)
    worker_main.build_engine(worker_main.parse_config(["--model", path, "--no-decode-fused-mlp", "--no-warmup",
                                                       "--device", "cpu", "--decode-prologue-norm-max-m", "5"], {}))
    assert built[1].decode_fused_mlp is False and built[1].decode_prologue_norm_max_m == 5
    assert built[0].decode_prologue_norm_max_m == 2
    assert worker_main.parse_config(["--model", path], {"STOKER_DECODE_PROLOGUE_NORM_MAX_M": "0"}
                                    ).decode_prologue_norm_max_m == 0
    env = {"STOKER_DECODE_KERNELS": "cublas", "STOKER_DECODE_PDL": "1"}
    assert (worker_main.parse_config(["--model", path], env).decode_kernels,
            worker_main.parse_config(["--model", path], env).decode_pdl) == ("cublas", True)
    # PDL: --decode-pdl every layer, --no-decode-pdl none, neither the engine's default (None: FP8 layers only)
    worker_main.build_engine(worker_main.parse_config(["--model", path, "--no-decode-pdl", "--no-warmup", "--device", "cpu"], {}))
    worker_main.build_engine(worker_main.parse_config(["--model", path, "--no-warmup", "--device", "cpu"], {}))
    assert (built[2].decode_pdl, built[3].decode_pdl) == (False, None)
    with pytest.raises(SystemExit) as exit_:
        worker_main.parse_config(["--model", path, "--decode-pdl", "--no-decode-pdl"], {})
    assert exit_.value.code == 2
    assert "contradict" in capsys.readouterr().err
    assert worker_main.parse_config(["--model", path], {}).decode_kernels == "auto"
    with pytest.raises(SystemExit) as exit_:
        worker_main.parse_config(["--model", path, "--decode-kernels", "gemv"], {})
    assert exit_.value.code == 2
    assert "--decode-kernels must be auto, fused, fused-folded or cublas, got 'gemv'" in capsys.readouterr().err


def test_config_refuses_a_prologue_norm_cap_outside_the_fused_steps(tmp_path) -> None:
    for bad in (-1, 17):
        with pytest.raises(ValueError, match="decode_prologue_norm_max_m must be 0..16"):
            EngineConfig(model_path=str(tmp_path), device="cpu", decode_prologue_norm_max_m=bad)
    assert EngineConfig(model_path=str(tmp_path), device="cpu").decode_prologue_norm_max_m == 2


# ------------------------------------------------------------------------------------------- GPU, bf16
def _hf_llama_gpu(path: str, init_std: float) -> Any:
    """A small Llama (hidden 512, head_dim 64, GQA 4:1, 4 layers) in float32, saved to `path`."""
    shape = dict(hidden_size=512, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=8,
                 num_key_value_heads=2, initializer_range=init_std)
    return build_hf_model("llama", path, shape=shape)


def _gpu_engine(path: str, dtype: str, decode_kernels: str, pdl: bool | None = False,
                fused_mlp: bool = True) -> LLMEngine:
    return LLMEngine(EngineConfig(model_path=path, device="cuda", dtype=dtype, max_num_seqs=8, max_model_len=256,
                                  num_kv_blocks=128, decode_kernels=decode_kernels, decode_pdl=pdl,
                                  decode_fused_mlp=fused_mlp))


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_bf16_fused_decode_matches_cublas_with_cuda_graphs(tmp_path) -> None:
    """Decode logprobs of the fused paths (plain and folded, with the fused MLP and with its two GEMVs; graph buckets
    1..8) against the cublas path's, all bf16, and against transformers float32: the fused paths no further off than
    cublas (x1.25 + 2e-2). Greedy tokens equal to cublas's up to a near-tie (top two logprobs within 0.05, where two
    bf16 roundings may pick differently) and for at least 3 steps. On the two-GEMV path PDL changes no token, and
    folded no bit, against the same path without it; the fused MLP's atomic adds may change bits, so its runs (the
    carried norms, PDL from decode_pdl True or, decode_pdl None, the default, fused_decode.MLP_PDL) are held to the
    bounds only."""
    hf = _hf_llama_gpu(str(tmp_path), 0.015).to("cuda")
    ids = prompts(7, [5, 37, 70, 12])
    max_tokens = [8, 8, 6, 4]
    runs = {}
    for mode, pdl, mlp in (("cublas", False, True), ("fused", False, False), ("fused", True, False),
                           ("fused-folded", False, False), ("fused-folded", True, False),
                           ("fused-folded", False, True), ("fused-folded", True, True), ("fused-folded", None, True)):
        engine = _gpu_engine(str(tmp_path), "bfloat16", mode, pdl, fused_mlp=mlp)
        assert engine.runner.graphs is not None
        report = engine.runner.startup["decode_kernels"]
        assert report["fused_layers"] == (0 if mode == "cublas" else 4), report
        assert report["fused_mlp_max_m"] == (16 if mode != "cublas" and mlp else 0), report
        assert report["norm_carry"] == (mode == "fused-folded" and mlp), report
        before = engine.runner.graphs.replays
        runs[mode, pdl, mlp] = generate(engine, ids, max_tokens)
        assert engine.runner.graphs.replays - before >= max(max_tokens) - 1
        engine.close()
    for i, (p, n) in enumerate(zip(ids, max_tokens, strict=True)):
        rid = f"r{i}"
        cublas, pdl_run = runs["cublas", False, True][rid], runs["fused", True, False][rid]
        # PDL changes when a kernel starts, not what it computes (against the two-GEMV path without it)
        assert pdl_run[0] == runs["fused", False, False][rid][0]
        torch.testing.assert_close(pdl_run[1], runs["fused", False, False][rid][1], atol=1e-3, rtol=0)
        # The whole chain under PDL (the attention included, gemv's PDL_* variants as they are): the same bits.
        assert runs["fused-folded", True, False][rid][:2] == runs["fused-folded", False, False][rid][:2], rid
        # the folded weights (W diag(g) rounded) and the fused MLP with the carried norms held to the same bounds
        for key in (("fused", False, False), ("fused-folded", False, False), ("fused-folded", False, True),
                    ("fused-folded", True, True), ("fused-folded", None, True)):
            _check_against_cublas_and_hf(hf, p, n, i, runs[key][rid], cublas)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("pdl", [None, True], ids=["pdl-default", "pdl-every-kernel"])
def test_bf16_mlp_finish_in_qkv_matches_the_finishing_kernel_with_cuda_graphs(tmp_path, monkeypatch,
                                                                              pdl: bool | None) -> None:
    """fused_decode.MLP_FINISH_IN_QKV on against off, bf16 "fused-folded" with the fused MLP and the carried norms,
    CUDA graphs on (buckets 1..4 here), 4 layers (three hand-offs a step): greedy tokens equal up to a near-tie, every
    step's logprob within 3e-2 of the switch-off run's and no further from transformers float32 (as the fused paths
    against cublas: _check_against_cublas_and_hf); the carried slots and every accumulator zero after the run. pdl
    None: the engine's default chain (at this small shape no PDL launch in bf16: O_PROJ_PDL wants the 8B o_proj entry,
    which tests/test_kernels_fused_mlp.py's CUDA-graph case runs); True (decode_pdl): every kernel with PDL, the MLP's
    streaming kernel and the qkv that reads its accumulator included."""
    hf = _hf_llama_gpu(str(tmp_path), 0.015).to("cuda")
    ids = prompts(7, [5, 37, 70, 12])
    max_tokens = [8, 8, 6, 4]
    runs = {}
    monkeypatch.setattr(fused_decode, "MLP_FINISH_IN_QKV_MAX_M", 16)  # every bucket (the default: one token)
    for on in (False, True):
        monkeypatch.setattr(fused_decode, "MLP_FINISH_IN_QKV", on)
        engine = _gpu_engine(str(tmp_path), "bfloat16", "fused-folded", pdl)
        assert engine.runner.graphs is not None
        layers = [layer.fused_decode for layer in engine.runner.model.model.layers]
        assert [fd.mlp_pending_max_m for fd in layers] == ([16, 16, 16, 0] if on else [0] * 4)
        before = engine.runner.graphs.replays
        runs[on] = generate(engine, ids, max_tokens)
        assert engine.runner.graphs.replays - before >= max(max_tokens) - 1
        carry = layers[0].carry
        assert carry is not None and not carry.sums_post.any() and not carry.sums_next.any()
        assert not any(fd.mlp_accumulator.any() for fd in layers), "an accumulator left dirty"
        engine.close()
    for i, (p, n) in enumerate(zip(ids, max_tokens, strict=True)):
        _check_against_cublas_and_hf(hf, p, n, i, runs[True][f"r{i}"], runs[False][f"r{i}"])


def _check_against_cublas_and_hf(hf: Any, p: list[int], n: int, i: int, fused: Any, cublas: Any) -> None:
    """One prompt's fused-path run (tokens, logprobs, top-two gaps) against cublas's and transformers'."""
    # Greedy equal up to a near-tie: where the two bf16 paths part, cublas's top two were within bf16 noise.
    same = next((t for t in range(n) if fused[0][t] != cublas[0][t]), n)
    if same < n:
        assert cublas[2][same] < 0.05, (f"prompt {i}: tokens part at step {same} although cublas's top two "
                                        f"logprobs are {cublas[2][same]:.3f} apart: {fused[0]} vs {cublas[0]}")
    assert same >= min(n, 3), f"prompt {i}: fused and cublas part at step {same}"
    with torch.no_grad():
        hf_lp = torch.log_softmax(hf(torch.tensor([p + fused[0][:-1]], device="cuda")).logits[0, len(p) - 1 :]
                                  .float(), dim=-1).cpu()
    want = hf_lp[torch.arange(same), torch.tensor(fused[0][:same])]
    fused_err = (torch.tensor(fused[1][:same]) - want).abs().max().item()
    cublas_err = (torch.tensor(cublas[1][:same]) - want).abs().max().item()
    assert fused_err <= 1.25 * cublas_err + 2e-2, f"prompt {i}: fused {fused_err:.3e} vs cublas {cublas_err:.3e}"
    torch.testing.assert_close(fused[1][:same], cublas[1][:same], atol=3e-2, rtol=0)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("mode", ["fused", "fused-folded", "fused-folded+pdl", "fused-folded+finish-in-qkv"])
def test_fp32_fused_decode_greedy_matches_transformers_on_the_gpu(tmp_path, mode: str, monkeypatch) -> None:
    """+finish-in-qkv: fused_decode.MLP_FINISH_IN_QKV on (the MLP's finishing kernel folded into the next qkv)."""
    mode, _, flag = mode.partition("+")
    monkeypatch.setattr(fused_decode, "MLP_FINISH_IN_QKV", flag == "finish-in-qkv")
    hf = _hf_llama_gpu(str(tmp_path), 0.08).to("cuda")
    ids = prompts(8, [5, 17, 33, 1])
    engine = _gpu_engine(str(tmp_path), "float32", mode, flag == "pdl")
    assert engine.runner.startup["decode_kernels"]["fused_layers"] == 4
    layers = [layer.fused_decode for layer in engine.runner.model.model.layers]
    assert (layers[0].mlp_pending_max_m > 0) == (flag == "finish-in-qkv")
    got = generate(engine, ids, [12] * len(ids))
    for i, p in enumerate(ids):
        with torch.no_grad():
            want = hf.generate(torch.tensor([p], device="cuda"), max_new_tokens=12, do_sample=False)
        assert got[f"r{i}"][0] == want[0, len(p) :].tolist(), f"prompt {i}"


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("kv", ["auto", "fp8"])
def test_fp8_fused_decode_matches_the_unfused_fp8_path_on_the_gpu(tmp_path, dtype: str, kv: str) -> None:
    """FP8 weights (quantized per row at load) through the fused kernels, CUDA graphs on, with the GPU's own
    conversions (gate_up's inline-PTX "asm-join"), against the same FP8 weights on the unfused path (the W8A16
    GEMV, norm / rotary / SiLU kernels): float32 greedy tokens equal and logprobs within 1e-3; bfloat16 tokens
    equal up to a near-tie (top two within 0.05) for at least 3 steps, logprobs within 3e-2. kv "fp8": both on an
    FP8 KV cache (the fused qkv epilogue writes it; the PDL chain's decode attention launches without PDL there)."""
    _hf_llama_gpu(str(tmp_path), 0.08 if dtype == "float32" else 0.015)
    ids = prompts(9, [5, 37, 70, 12])
    max_tokens = [8, 8, 6, 4]
    runs = {}
    for mode in ("cublas", "fused"):
        engine = LLMEngine(EngineConfig(model_path=str(tmp_path), device="cuda", dtype=dtype, max_num_seqs=8,
                                        max_model_len=256, num_kv_blocks=128, decode_kernels=mode,
                                        quantization="fp8", kv_cache_dtype=kv))
        assert engine.runner.startup["decode_kernels"]["fused_layers"] == (4 if mode == "fused" else 0)
        before = engine.runner.graphs.replays
        runs[mode] = generate(engine, ids, max_tokens)
        assert engine.runner.graphs.replays - before >= max(max_tokens) - 1
        engine.close()
    for rid, (tokens, logprobs, _) in runs["fused"].items():
        ref_tokens, ref_logprobs, ref_gaps = runs["cublas"][rid]
        if dtype == "float32":
            assert tokens == ref_tokens, rid
            torch.testing.assert_close(logprobs, ref_logprobs, atol=1e-3, rtol=0)
            continue
        same = next((t for t in range(len(tokens)) if tokens[t] != ref_tokens[t]), len(tokens))
        if same < len(tokens):
            assert ref_gaps[same] < 0.05, f"{rid}: tokens part at step {same}: {tokens} vs {ref_tokens}"
        assert same >= min(len(tokens), 3), rid
        torch.testing.assert_close(logprobs[:same], ref_logprobs[:same], atol=3e-2, rtol=0)


# --------------------------------------------------------------------------------------------- the driver
@pytest.mark.slow
@pytest.mark.skipif(INTERPRET, reason="this is the interpreter run itself")
def test_fused_decode_under_triton_interpreter() -> None:
    run_under_interpreter(__file__)
