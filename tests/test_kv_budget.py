"""The KV budget of a model with its own share of the GPU (EngineConfig.gpu_memory_share), so that several
engines can share one GPU: the share counts this model's weights and nothing else that is loaded. The GPU's
memory query is replaced by fixed numbers: the arithmetic is what is tested, on any machine."""

from __future__ import annotations

import pytest
import torch
from engine_models import build_hf_model
from stoker.engine import EngineConfig
from stoker.engine.kv_cache import activation_reserve_bytes, kv_bytes_per_block, num_kv_blocks, weights_bytes
from stoker.engine.model_config import ModelConfig

GIB = 2**30


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> str:
    out = str(tmp_path_factory.mktemp("llama"))
    build_hf_model("llama", out)
    return out


def config(folder: str, **kw: object) -> EngineConfig:
    return EngineConfig(model_path=folder, device="cuda", dtype="bfloat16", max_num_seqs=8,
                        max_num_batched_tokens=512, **kw)  # type: ignore[arg-type]


def test_a_share_sizes_the_kv_cache_from_the_share_less_the_weights(folder, monkeypatch):
    total = 8 * GIB
    # Other engines hold 90% of the GPU already: a share does not care, the rule of old does.
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (total // 10, total))
    mc = ModelConfig.from_folder(folder)
    weights = 300 * 2**20
    shared = config(folder, gpu_memory_share=0.25)
    per_block = kv_bytes_per_block(mc, 16, torch.bfloat16)
    expected = (int(total * 0.25) - weights - activation_reserve_bytes(mc, shared)) // per_block
    assert num_kv_blocks(mc, shared, weights) == expected > 1000
    assert num_kv_blocks(mc, config(folder, gpu_memory_share=0.5), weights) > 2 * expected  # linear in the share
    with pytest.raises(ValueError, match="holds no block"):  # the old rule: 0.9 of the GPU less what is used
        num_kv_blocks(mc, config(folder), weights)
    explicit = config(folder, gpu_memory_share=0.25, kv_cache_memory_bytes=64 * per_block)
    assert num_kv_blocks(mc, explicit, weights) == 64  # an explicit KV budget still wins


def test_a_share_too_small_for_the_weights_is_refused_with_what_to_do(folder, monkeypatch):
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (80 * GIB, 80 * GIB))
    mc = ModelConfig.from_folder(folder)
    with pytest.raises(ValueError, match=r"gpu_memory_share=0.1 is 8.00 GiB, but its weights take 16.00 GiB.*"
                                         r"raise the share \(at least 0.2"):
        num_kv_blocks(mc, config(folder, gpu_memory_share=0.1), 16 * GIB)


def test_share_must_be_a_fraction(folder):
    for bad in (0.0, 1.5):
        with pytest.raises(ValueError, match="gpu_memory_share must be in"):
            config(folder, gpu_memory_share=bad)


def test_weights_bytes_counts_parameters_and_buffers():
    module = torch.nn.Linear(10, 4).to(torch.bfloat16)
    module.register_buffer("table", torch.zeros(3, dtype=torch.float32))
    assert weights_bytes(module) == (10 * 4 + 4) * 2 + 3 * 4


def test_close_frees_the_weights_and_the_kv_cache_even_while_the_engine_is_still_referenced(folder):
    import gc
    import weakref

    from stoker.engine import LLMEngine

    engine = LLMEngine(EngineConfig(model_path=folder, device="cpu", kv_cache_memory_bytes=1 << 20))
    model, kv = weakref.ref(engine.runner.model), weakref.ref(engine.runner.kv_caches[0][0])
    engine.close()  # what an idle unload calls (worker/models.py)
    gc.collect()
    assert model() is None and kv() is None


def test_the_reserve_counts_the_piecewise_graphs_pool(folder):
    """With the piecewise graphs (the CUDA default) the reserve holds a second full-budget forward's temporaries:
    their pool keeps one; without them (flag 0, graphs off, the CPU) it is as before."""
    mc = ModelConfig.from_folder(folder)
    per_token = ((mc.num_heads + 2 * mc.num_kv_heads) * mc.head_dim + 3 * mc.intermediate_size + 4 * mc.hidden_size) * 2
    plain = activation_reserve_bytes(mc, config(folder, piecewise_graph_tokens=0))
    assert activation_reserve_bytes(mc, config(folder)) == plain + 512 * per_token  # capped at the 512-token budget
    assert activation_reserve_bytes(mc, config(folder, piecewise_graph_tokens=128)) == plain + 128 * per_token
    assert activation_reserve_bytes(mc, config(folder, cuda_graphs=False)) == plain
    cpu = EngineConfig(model_path=folder, device="cpu", dtype="bfloat16", max_num_seqs=8, max_num_batched_tokens=512)
    assert activation_reserve_bytes(mc, cpu) == plain
