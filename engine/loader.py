"""Reads a Hugging Face model folder's *.safetensors weights into the model's layers.

The rule for this checkpoint format is `WeightMap`: a checkpoint name is the path of one of our modules plus
its parameter name (`model.layers.3.self_attn.o_proj.weight`), except that the model's `packed_modules`
folds separate projections into a fused one with a shard name (`...self_attn.q_proj.weight` ->
`...self_attn.qkv_proj`, shard "q"). The module's own `load_weight` then places the tensor. Both loaders
(this plain one and engine.fast_load) go through it. Weights go to the device one tensor at a time
(safetensors `safe_open`), copied straight into the parameters: no full host copy of the model is made. A
tensor-parallel layer names the part of a tensor it holds (`checkpoint_slice`) and only that part is read.
"""

from __future__ import annotations

import os

import torch
from stoker.engine.layers.weights import WeightModule, WeightShapeError
from stoker.engine.model_config import read_json

_FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def safetensors_files(path: str) -> list[str]:
    """The weight files: those the index names when there is one, else every *.safetensors."""
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        names = sorted(set(read_json(index).get("weight_map", {}).values()))
        absent = [n for n in names if not os.path.isfile(os.path.join(path, n))]
        if absent:
            raise FileNotFoundError(f"{index} names weight files that are missing: {', '.join(absent)}")
    else:
        names = sorted(n for n in os.listdir(path) if n.endswith(".safetensors"))
    if not names:
        raise FileNotFoundError(
            f"model folder {path!r} has no *.safetensors weights (only safetensors is supported)"
        )
    return [os.path.join(path, n) for n in names]


class WeightMap:
    """Checkpoint tensor name -> (module, parameter, shard); records what was loaded and checks that nothing
    the layers expect is missing."""

    def __init__(self, model: torch.nn.Module):
        self.modules = {name: m for name, m in model.named_modules() if isinstance(m, WeightModule)}
        self.packed: dict[str, tuple[str, str]] = getattr(model, "packed_modules", {})
        self.renamed: dict[str, str] = getattr(model, "renamed_params", {})
        self.loaded: set[tuple[str, str]] = set()

    def destination(self, name: str) -> tuple[str, WeightModule, str, str] | None:
        """(module path, module, parameter, shard), or None for a tensor we do not use (rotary inv_freq,
        lm_head.weight of a tied model, a bias we run without, a layer past num_layers)."""
        for suffix, ours in self.renamed.items():  # a parameter kept elsewhere than the checkpoint names it
            if name.endswith("." + suffix):
                name = name[: -len(suffix)] + ours
                break
        module_name, _, param = name.rpartition(".")
        shard = ""
        parent, _, leaf = module_name.rpartition(".")
        if leaf in self.packed:
            fused, shard = self.packed[leaf]
            module_name = f"{parent}.{fused}" if parent else fused
        module = self.modules.get(module_name)
        if module is None or not module.owns(param):
            return None
        return module_name, module, param, shard

    def load(self, name: str, tensor: torch.Tensor, file: str) -> None:
        """Place checkpoint tensor `name` (read from `file`): the module's load_weight does the one copy."""
        dest = self.destination(name)
        if dest is None:
            raise KeyError(f"weight {name} has no place in this model")
        module_name, module, param, shard = dest
        target = module._parameters.get(param)
        if tensor.dtype in _FP8_DTYPES and target is not None and target.dtype not in _FP8_DTYPES:
            raise ValueError(
                f"weight {name} in {os.path.basename(file)} is {tensor.dtype} but {module_name} is not an FP8 "
                "layer: config.json's quantization_config does not cover it (its ignore list names it?)"
            )
        try:
            module.load_weight(param, tensor, shard)
        except WeightShapeError as e:
            raise ValueError(
                f"weight {name} in {os.path.basename(file)} has shape {e.got}, "
                f"expected {e.expected} from config.json"
            ) from None
        self.loaded.add((f"{module_name}.{param}", shard))

    def check_all_loaded(self, path: str) -> None:
        expected = {
            (f"{module_name}.{param}", shard)
            for module_name, module in self.modules.items()
            for param, shard in module.expected_shards()
        }
        missing = sorted(expected - self.loaded)
        if missing:
            names = [f"{p}[{s}]" if s else p for p, s in missing]
            raise ValueError(
                f"model folder {path!r} lacks weights for: {', '.join(names[:8])}"
                + (f" ... ({len(names)} in all)" if len(names) > 8 else "")
            )
        for module in self.modules.values():
            module.finish_loading()


def load_weights(model: torch.nn.Module, path: str) -> None:
    """Copy every checkpoint tensor into the model, one at a time, cast to the parameter's dtype."""
    from safetensors import safe_open

    weights = WeightMap(model)
    with torch.no_grad():
        for file in safetensors_files(path):
            with safe_open(file, framework="pt", device="cpu") as f:
                for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                    dest = weights.destination(name)
                    if dest is None:
                        continue
                    _, module, param, shard = dest
                    index = module.checkpoint_slice(param, shard)
                    # A slice is read from the file alone (get_slice): a rank never holds a whole weight.
                    tensor = f.get_tensor(name) if index is None else f.get_slice(name)[index]
                    weights.load(name, tensor, file)
    weights.check_all_loaded(path)
