"""The paged KV cache: per layer k/v tensors [num_blocks, block_size, num_kv_heads, head_dim], the layout
engine/kernels/attention.py reads."""

from __future__ import annotations

import torch
from stoker.engine.config import EngineConfig
from stoker.engine.kernels.kv_quant import FP8_KV_DTYPE
from stoker.engine.model_config import ModelConfig

CPU_DEFAULT_KV_BYTES = 256 * 2**20


def kv_bytes_per_block(model: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    itemsize = torch.empty((), dtype=dtype).element_size()
    return 2 * model.num_layers * block_size * model.num_kv_heads * model.head_dim * itemsize


def kv_cache_dtype(config: EngineConfig) -> torch.dtype:
    """What the cache holds: float8_e4m3fn for kv_cache_dtype="fp8" (1 byte an element), else the model dtype."""
    return FP8_KV_DTYPE if config.kv_cache_dtype == "fp8" else config.torch_dtype


def activation_reserve_bytes(model: ModelConfig, config: EngineConfig) -> int:
    """Rough peak of one forward's temporaries, kept free on the GPU beside the KV cache: the widest
    per-token tensors (qkv, gate_up, attention out, residual) for a full token budget (twice with the piecewise
    graphs: their pool holds one), plus float32 logits and sampler work (sort, probabilities) for max_num_seqs
    rows. Over-estimates on purpose."""
    itemsize = torch.empty((), dtype=config.torch_dtype).element_size()
    per_token = (model.num_heads + 2 * model.num_kv_heads) * model.head_dim + 3 * model.intermediate_size
    per_token += 4 * model.hidden_size
    tokens = config.max_num_batched_tokens
    if config.cuda_graphs and config.device != "cpu":
        # The piecewise graphs' pool (engine/piecewise_graphs.py) keeps its largest bucket's temporaries for good,
        # beside what the eager parts and the warm-up leave cached.
        tokens += min(config.piecewise_graph_tokens, config.max_num_batched_tokens)
    return tokens * per_token * itemsize + config.max_num_seqs * model.vocab_size * 4 * 6


def num_kv_blocks(model: ModelConfig, config: EngineConfig, weights_bytes: int = 0) -> int:
    """Blocks that fit the budget: num_kv_blocks, else kv_cache_memory_bytes, else (CUDA) gpu_memory_share of
    the GPU's total less this model's weights (`weights_bytes`, as loaded) and an activation reserve, else
    (CUDA) the share given by gpu_memory_utilization left after everything already on the GPU, else 256 MiB
    (CPU)."""
    if config.num_kv_blocks is not None:
        return config.num_kv_blocks
    per_block = kv_bytes_per_block(model, config.block_size, kv_cache_dtype(config))
    budget = config.kv_cache_memory_bytes
    if budget is None and config.device != "cpu" and config.gpu_memory_share is not None:
        budget = _share_budget(model, config, weights_bytes, per_block)
    elif budget is None and config.device != "cpu":
        free, total = torch.cuda.mem_get_info(torch.device(str(config.device)))
        used = total - free  # weights already loaded, plus anything else on the GPU
        budget = int(total * config.gpu_memory_utilization) - used - activation_reserve_bytes(model, config)
    elif budget is None:
        budget = CPU_DEFAULT_KV_BYTES
    blocks = budget // per_block
    if blocks < 1:
        raise ValueError(
            f"KV cache budget of {budget} bytes holds no block of {per_block} bytes: raise kv_cache_memory_bytes"
            " or gpu_memory_utilization, or lower max_num_batched_tokens/max_num_seqs"
        )
    return int(blocks)


def _share_budget(model: ModelConfig, config: EngineConfig, weights_bytes: int, per_block: int) -> int:
    """KV bytes of a model given its own share of the GPU: the share's bytes less its weights and its
    activation reserve. What other engines hold does not count: each has its own share."""
    assert config.gpu_memory_share is not None
    _, total = torch.cuda.mem_get_info(torch.device(str(config.device)))
    share_bytes = int(total * config.gpu_memory_share)
    reserve = activation_reserve_bytes(model, config)
    budget = share_bytes - weights_bytes - reserve
    if budget < per_block:
        gib = 2**30
        raise ValueError(
            f"{config.model_name}: gpu_memory_share={config.gpu_memory_share} is {share_bytes / gib:.2f} GiB, but "
            f"its weights take {weights_bytes / gib:.2f} GiB and the activation reserve {reserve / gib:.2f} GiB, "
            f"leaving no room for one KV block ({per_block} bytes): raise the share (at least "
            f"{(weights_bytes + reserve + 64 * per_block) / total:.3f} for 64 blocks) or lower "
            "max_num_batched_tokens/max_num_seqs"
        )
    return budget


def weights_bytes(module: torch.nn.Module) -> int:
    """Bytes a loaded model's parameters and buffers take (what gpu_memory_share counts as its weights)."""
    tensors = [*module.parameters(), *module.buffers()]
    return sum(t.numel() * t.element_size() for t in tensors)


def allocate_kv_cache(
    model: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device | str
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    shape = (num_blocks, block_size, model.num_kv_heads, model.head_dim)
    # Zeroed: padding slots of block tables may be read (and masked) by the kernels; no NaNs there.
    return [
        (torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
        for _ in range(model.num_layers)
    ]
