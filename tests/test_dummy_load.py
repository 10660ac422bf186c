"""load_format "dummy" (engine/dummy_load.py): random weights from config.json alone, for benchmarks of shapes
whose checkpoint is not at hand (issue 17's 70B). On the CPU, float32:

- the layout it makes is exactly the checkpoint transformers writes for the same config (names and shapes), for
  each architecture we load;
- an engine on dummy weights gives the same greedy tokens and logprobs as an engine loading those very tensors
  from safetensors (so the dummy path runs the loaders' own rules, FP8 quantization at load included), from a
  folder without a single weight file;
- at TP = 2 (real gloo ranks) the dummy model is the TP = 1 dummy model, cut: the same tokens;
- an FP8 checkpoint's config is refused with it, and the setting is checked and reaches the engine from the
  worker's flag and variable.
"""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from engine_models import build_hf_model, prompts
from safetensors import safe_open
from safetensors.torch import save_file
from stoker.engine import EngineConfig, EngineRequest, SamplingParams
from stoker.engine.dummy_load import checkpoint_layout, dummy_tensor
from stoker.engine.engine import LLMEngine
from stoker.engine.model_config import ModelConfig

ARCHS = ["llama", "llama_tied", "qwen2", "qwen3"]  # a tied embedding: no lm_head tensor
PROMPTS = prompts(7, [5, 11, 26])
MAX_NEW = 6


def _hf_tensors(path: str) -> dict[str, tuple[int, ...]]:
    shapes: dict[str, tuple[int, ...]] = {}
    for name in sorted(os.listdir(path)):
        if name.endswith(".safetensors"):
            with safe_open(os.path.join(path, name), framework="pt") as f:
                for key in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                    shapes[key] = tuple(f.get_slice(key).get_shape())
    return shapes


def _config_only(src: str, dst: str) -> str:
    """A model folder with the source's config.json, tokenizer and generation config: no weights."""
    os.makedirs(dst)
    for name in os.listdir(src):
        if name.endswith(".json") and not name.endswith(".index.json"):
            shutil.copy(os.path.join(src, name), dst)
    return dst


def _save_dummy(src_config_only: str, dst: str, dtype: torch.dtype = torch.float32, device: str = "cpu") -> str:
    """The dummy checkpoint (as drawn on `device`) written out as safetensors, beside a copy of the config: what
    load_format "auto" reads."""
    shutil.copytree(src_config_only, dst)
    mc = ModelConfig.from_folder(dst)
    tensors = {name: dummy_tensor(name, shape, fill, dtype, device).cpu()
               for name, shape, fill in checkpoint_layout(mc)}
    save_file(tensors, os.path.join(dst, "model.safetensors"))
    return dst


def _run(engine: LLMEngine, tag: str) -> tuple[list[list[int]], list[list[float]]]:
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0, ignore_eos=True, logprobs=1)
    for i, ids in enumerate(PROMPTS):
        engine.add_request(EngineRequest(f"{tag}-{i}", prompt_token_ids=ids, params=params))
    tokens: dict[str, list[int]] = {}
    logprobs: dict[str, list[float]] = {}
    for _ in range(500):
        for out in engine.step():
            assert out.error_code is None, out
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            logprobs.setdefault(out.request_id, []).extend(lp.logprob for lp in (out.logprobs or []))
        if not engine.has_unfinished():
            break
    keys = [f"{tag}-{i}" for i in range(len(PROMPTS))]
    return [tokens[k] for k in keys], [logprobs[k] for k in keys]


def _engine(path: str, device: str = "cpu", **kw) -> LLMEngine:
    return LLMEngine(EngineConfig(model_path=path, device=device, num_kv_blocks=64, max_num_batched_tokens=24, **kw))


@pytest.mark.parametrize("arch", ARCHS)
def test_layout_is_the_checkpoint_transformers_writes(tmp_path, arch: str):
    path = str(tmp_path / arch)
    build_hf_model(arch, path)
    layout = checkpoint_layout(ModelConfig.from_folder(path))
    assert len({name for name, _, _ in layout}) == len(layout)
    assert {name: shape for name, shape, _ in layout} == _hf_tensors(path)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("quantization", [None, "fp8"])
def test_dummy_engine_equals_an_engine_loading_the_same_tensors(tmp_path, arch: str, quantization):
    build_hf_model(arch, str(tmp_path / "hf"))
    bare = _config_only(str(tmp_path / "hf"), str(tmp_path / "bare"))
    assert not any(n.endswith(".safetensors") for n in os.listdir(bare))
    saved = _save_dummy(bare, str(tmp_path / "saved"))
    dummy = _engine(bare, load_format="dummy", quantization=quantization)
    assert dummy.runner.startup["load_format"] == "dummy"
    got = _run(dummy, "dummy")
    want = _run(_engine(saved, quantization=quantization), "saved")
    assert got[0] == want[0]
    assert got[1] == want[1]  # float32 on the same tensors through the same layers: the same bits
    # Not a degenerate model (zeros, a constant): the prompts do not all continue alike.
    assert len({tuple(t) for t in got[0]}) > 1


def test_dummy_tensors_are_deterministic_by_name_and_differ_between_names():
    a = dummy_tensor("model.layers.0.mlp.up_proj.weight", (8, 4), None, torch.float32, "cpu")
    assert torch.equal(a, dummy_tensor("model.layers.0.mlp.up_proj.weight", (8, 4), None, torch.float32, "cpu"))
    assert not torch.equal(a, dummy_tensor("model.layers.1.mlp.up_proj.weight", (8, 4), None, torch.float32, "cpu"))
    # The seed reaches the generator (the CPU generator keeps 32 bits of a seed: a seed in the high bits was lost).
    assert not torch.equal(a, dummy_tensor("model.layers.0.mlp.up_proj.weight", (8, 4), None, torch.float32, "cpu",
                                           seed=1))
    assert abs(a.std().item() - 0.02) < 0.01  # the bench models' spread
    assert torch.equal(dummy_tensor("model.norm.weight", (4,), 1.0, torch.float32, "cpu"), torch.ones(4))


@pytest.mark.parametrize(("arch", "shape"), [
    ("llama", None),
    ("qwen2", None),  # q/k/v biases: cut with their rows
    ("llama", {"hidden_size": 48, "num_attention_heads": 6, "num_key_value_heads": 1, "intermediate_size": 96}),
], ids=["llama", "qwen2", "llama-kv1"])
def test_dummy_at_tp2_is_the_tp1_dummy_model_cut(tmp_path, arch: str, shape):
    bare = str(tmp_path / "bare")
    build_hf_model(arch, str(tmp_path / "hf"), shape=shape)
    _config_only(str(tmp_path / "hf"), bare)
    want = _run(_engine(bare, load_format="dummy"), "tp1")
    engine = _engine(bare, load_format="dummy", tensor_parallel_size=2)
    try:
        # Rank 0 keeps its share of the split tensors only (the report counts what a rank keeps).
        assert engine.runner.startup["dummy_bytes"] < sum(p.numel() * p.element_size()
                                                          for p in _engine(bare, load_format="dummy").runner.model
                                                          .parameters())
        got = _run(engine, "tp2")
    finally:
        engine.close()
    assert got[0] == want[0]
    assert max(abs(x - y) for a, b in zip(got[1], want[1], strict=True) for x, y in zip(a, b, strict=True)) < 1e-4


def test_an_fp8_checkpoint_config_is_refused(tmp_path):
    bare = str(tmp_path / "bare")
    build_hf_model("llama", str(tmp_path / "hf"))
    _config_only(str(tmp_path / "hf"), bare)
    cfg_path = os.path.join(bare, "config.json")
    with open(cfg_path) as f:
        cfg = json.load(f)
    cfg["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic"}
    with open(cfg_path, "w") as f:
        json.dump(cfg, f)
    with pytest.raises(ValueError, match="load_format 'dummy' makes an unquantized checkpoint, but this "
                                         "config.json declares an FP8 one"):
        _engine(bare, load_format="dummy")


def test_the_setting_is_checked_and_reaches_the_engine_from_the_worker(tmp_path, capsys, monkeypatch):
    import stoker.engine
    from stoker.worker import main as worker_main

    path = str(tmp_path / "hf")
    build_hf_model("llama", path)
    with pytest.raises(ValueError, match=r"load_format must be one of \('auto', 'dummy'\), got 'random'"):
        EngineConfig(model_path=path, device="cpu", load_format="random")
    cfg = worker_main.parse_config(["--model", path, "--load-format", "dummy", "--no-warmup"], {})
    built: list[EngineConfig] = []
    monkeypatch.setattr(stoker.engine, "LLMEngine", built.append)  # the config build_engine makes, no engine
    worker_main.build_engine(cfg)
    assert built[0].load_format == "dummy"
    assert worker_main.parse_config(["--model", path], {"STOKER_LOAD_FORMAT": "dummy"}).load_format == "dummy"
    assert worker_main.parse_config(["--model", path], {}).load_format == "auto"
    with pytest.raises(SystemExit) as exit_:
        worker_main.parse_config(["--model", path, "--load-format", "zeros"], {})
    assert exit_.value.code == 2 and "--load-format must be auto or dummy, got 'zeros'" in capsys.readouterr().err


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("quantization", [None, "fp8"])
def test_gpu_dummy_engine_equals_an_engine_loading_the_same_tensors(tmp_path, quantization):
    """On CUDA in bfloat16 (the fast loader on the saved side; CUDA graphs and the fused decode on both): the same
    greedy tokens, logprobs within bfloat16's run-to-run spread (the fused MLP's atomic adds are not ordered)."""
    build_hf_model("llama", str(tmp_path / "hf"))
    bare = _config_only(str(tmp_path / "hf"), str(tmp_path / "bare"))
    saved = _save_dummy(bare, str(tmp_path / "saved"), torch.bfloat16, "cuda")
    dummy = _engine(bare, "cuda", load_format="dummy", quantization=quantization)
    got = _run(dummy, "dummy")
    dummy.close()
    want = _run(_engine(saved, "cuda", quantization=quantization), "saved")
    assert got[0] == want[0]
    assert max(abs(x - y) for a, b in zip(got[1], want[1], strict=True) for x, y in zip(a, b, strict=True)) < 0.05
