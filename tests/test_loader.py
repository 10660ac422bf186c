"""Model folder loading: sharded safetensors, make_model's folder in both transformers and ours, config
variants (rope_parameters vs rope_scaling, eos lists), and clear errors for broken folders."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from engine_models import build_hf_model, hf_greedy, prompts
from stoker.engine import EngineRequest, SamplingParams
from stoker.engine.config import EngineConfig
from stoker.engine.engine import LLMEngine
from stoker.engine.make_model import make_model
from stoker.engine.model_config import ModelConfig


def greedy_tokens(engine: LLMEngine, ids: list[int], n: int) -> list[int]:
    engine.add_request(EngineRequest(
        "r", prompt_token_ids=ids, params=SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
    ))
    out: list[int] = []
    while engine.has_unfinished():
        for o in engine.step():
            out += o.new_token_ids
    return out


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("llama"))
    build_hf_model("llama", path)
    return path


def broken_copy(src: str, dst, edit=None) -> str:
    shutil.copytree(src, dst)
    if edit:
        edit(str(dst))
    return str(dst)


def test_multi_shard_checkpoint(tmp_path):
    model = build_hf_model("qwen2", str(tmp_path), max_shard_size="60KB")
    shards = [n for n in os.listdir(tmp_path) if n.endswith(".safetensors")]
    assert os.path.isfile(tmp_path / "model.safetensors.index.json") and len(shards) > 2
    engine = LLMEngine(EngineConfig(str(tmp_path), device="cpu", num_kv_blocks=32))
    ids = prompts(7, [12])[0]
    assert greedy_tokens(engine, ids, 8) == hf_greedy(model, ids, 8)


def test_make_model_loads_in_transformers_and_ours(tmp_path):
    import transformers

    path = make_model(str(tmp_path / "tiny"), "tiny", seed=3)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    hf_tok = transformers.AutoTokenizer.from_pretrained(path)
    engine = LLMEngine(EngineConfig(path, device="cpu", num_kv_blocks=32))
    text = "The stoker keeps the fire fed 🔥 東京"
    assert engine.tokenizer.encode(text) == hf_tok(text)["input_ids"]
    assert engine.tokenizer.encode(text)[0] == engine.tokenizer.bos_token_id
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    hf_chat = hf_tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert engine.tokenizer.apply_chat_template(messages) == hf_chat
    assert engine.tokenizer.encode_chat(messages) == hf_tok(hf_chat, add_special_tokens=False)["input_ids"]
    ids = engine.tokenizer.encode(text)
    hf.generation_config.eos_token_id = None
    assert greedy_tokens(engine, ids, 8) == hf_greedy(hf, ids, 8)
    assert engine.eos_token_ids == {1, 5}  # generation_config's list [</s>, <|end|>]
    assert engine.model_name == "tiny"


def test_rope_parameters_and_legacy_keys_agree(tmp_path):
    legacy = {
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": 10,
        "hidden_size": 8,
        "intermediate_size": 16,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "rope_theta": 500000.0,
        "eos_token_id": 2,
        "rope_scaling": {
            "type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    }
    new = {k: v for k, v in legacy.items() if k not in ("rope_theta", "rope_scaling")}
    new["rope_parameters"] = {**legacy["rope_scaling"], "rope_type": "llama3", "rope_theta": 500000.0}
    del new["rope_parameters"]["type"]
    configs = []
    for name, cfg in (("legacy", legacy), ("new", new)):
        os.makedirs(tmp_path / name)
        (tmp_path / name / "config.json").write_text(json.dumps(cfg))
        (tmp_path / name / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7]}))
        configs.append(ModelConfig.from_folder(str(tmp_path / name)))
    for c in configs:
        assert c.rope_theta == 500000.0 and c.rope_scaling is not None
        assert c.rope_scaling["rope_type"] == "llama3" and c.rope_scaling["factor"] == 8.0
        assert c.eos_token_ids == [2, 7] and c.num_kv_heads == 2 and c.head_dim == 4


def test_unknown_architecture(llama_dir, tmp_path):
    def edit(path: str) -> None:
        file = os.path.join(path, "config.json")
        with open(file) as f:
            cfg = json.load(f)
        cfg["architectures"] = ["GPT2LMHeadModel"]
        with open(file, "w") as f:
            json.dump(cfg, f)

    path = broken_copy(llama_dir, tmp_path / "m", edit)
    with pytest.raises(ValueError, match="GPT2LMHeadModel.*supported: LlamaForCausalLM"):
        LLMEngine(EngineConfig(path, device="cpu"))


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"hidden_act": "gelu_pytorch_tanh"}, "hidden_act 'gelu_pytorch_tanh' is not supported"),
        ({"mlp_bias": True}, "mlp_bias is not supported"),
        ({"attention_bias": True}, "attention_bias is not supported for LlamaForCausalLM"),
        ({"num_key_value_heads": 3}, r"num_attention_heads \(\d+\) is not a multiple of num_key_value_heads \(3\)"),
        ({"intermediate_size": 0}, "sizes must be positive integers, got intermediate_size=0"),
        ({"hidden_size": "64"}, "sizes must be positive integers, got hidden_size='64'"),
    ],
)
def test_config_features_we_do_not_run_are_refused(llama_dir, tmp_path, change, match):
    """A checkpoint whose MLP or attention the engine would compute differently (another activation, biases where
    the kernels take none) is refused at load, naming the key, not served wrong."""
    def edit(path: str) -> None:
        file = os.path.join(path, "config.json")
        with open(file) as f:
            cfg = json.load(f)
        cfg.update(change)
        with open(file, "w") as f:
            json.dump(cfg, f)

    path = broken_copy(llama_dir, tmp_path / "m", edit)
    with pytest.raises(ValueError, match=match):
        LLMEngine(EngineConfig(path, device="cpu", num_kv_blocks=8))
    assert ModelConfig.from_folder(llama_dir).architecture == "LlamaForCausalLM"  # the unedited model loads


@pytest.mark.parametrize(
    ("remove", "error", "match"),
    [
        ("config.json", FileNotFoundError, "no config.json"),
        ("model.safetensors", FileNotFoundError, r"no \*\.safetensors"),
        ("tokenizer.json", FileNotFoundError, "no tokenizer.json"),
    ],
)
def test_missing_files(llama_dir, tmp_path, remove, error, match):
    path = broken_copy(llama_dir, tmp_path / "m", lambda p: os.remove(os.path.join(p, remove)))
    with pytest.raises(error, match=match):
        LLMEngine(EngineConfig(path, device="cpu", num_kv_blocks=8))


def test_missing_and_misshapen_weights(llama_dir, tmp_path):
    from safetensors.torch import load_file, save_file

    weights = load_file(os.path.join(llama_dir, "model.safetensors"))

    def without_k(path: str) -> None:
        save_file(
            {k: v for k, v in weights.items() if "layers.1.self_attn.k_proj" not in k},
            os.path.join(path, "model.safetensors"),
        )

    path = broken_copy(llama_dir, tmp_path / "a", without_k)
    with pytest.raises(ValueError, match=r"lacks weights for: model\.layers\.1\.self_attn\.qkv_proj\.weight\[k\]"):
        LLMEngine(EngineConfig(path, device="cpu", num_kv_blocks=8))

    def misshapen(path: str) -> None:
        bad = dict(weights)
        bad["model.norm.weight"] = torch.ones(3)
        save_file(bad, os.path.join(path, "model.safetensors"))

    path = broken_copy(llama_dir, tmp_path / "b", misshapen)
    with pytest.raises(ValueError, match=r"model\.norm\.weight.*shape \(3,\), expected \(64,\)"):
        LLMEngine(EngineConfig(path, device="cpu", num_kv_blocks=8))


def test_engine_config_validation(llama_dir, tmp_path):
    with pytest.raises(ValueError, match="is not a directory"):
        EngineConfig(str(tmp_path / "nope"), device="cpu")
    with pytest.raises(ValueError, match="block_size must be a power of two"):
        EngineConfig(llama_dir, device="cpu", block_size=12)
    with pytest.raises(ValueError, match="dtype must be one of"):
        EngineConfig(llama_dir, device="cpu", dtype="float64")
    with pytest.raises(ValueError, match="exceeds the model's max_position_embeddings=512"):
        LLMEngine(EngineConfig(llama_dir, device="cpu", max_model_len=4096, num_kv_blocks=8))
    cfg = EngineConfig(llama_dir, device="cpu")
    assert cfg.dtype == "float32" and cfg.model_name == os.path.basename(llama_dir)
    # The KV pool bounds the context: 8 blocks of 16 tokens.
    assert LLMEngine(EngineConfig(llama_dir, device="cpu", num_kv_blocks=8)).max_model_len == 128
