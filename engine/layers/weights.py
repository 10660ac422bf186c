"""The weight-loading contract every layer with parameters follows (the loaders in engine.loader and
engine.fast_load drive it; neither knows what a layer holds)."""

from __future__ import annotations

import torch
from torch import nn


class WeightShapeError(ValueError):
    """A checkpoint tensor whose shape is not the one the config implies; the loader adds its name and file."""

    def __init__(self, got: tuple[int, ...], expected: tuple[int, ...]):
        super().__init__(f"shape {got}, expected {expected}")
        self.got, self.expected = got, expected


def copy_into(target: torch.Tensor, loaded: torch.Tensor) -> None:
    """The one copy of a load: checkpoint tensor (any float dtype, any device) -> its place in a parameter,
    cast and moved by copy_ itself, so no loader ever makes a second copy."""
    if tuple(loaded.shape) != tuple(target.shape):
        raise WeightShapeError(tuple(loaded.shape), tuple(target.shape))
    target.copy_(loaded)


def empty_param(*shape: int, dtype: torch.dtype) -> nn.Parameter:
    """Uninitialised, on the current default device: every element is written by the loader (a parameter left
    unwritten is reported by check_all_loaded before the model runs)."""
    return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)


class WeightModule(nn.Module):
    """A layer that owns parameters. Checkpoint tensor `<module path>.<param>` is handed to
    `load_weight(param, tensor, shard)`; the default fills the parameter whole. Fused or sharded layers
    override `load_weight` and `expected_shards` (shard = which part of a fused parameter a tensor is)."""

    def owns(self, param_name: str) -> bool:
        """Whether a checkpoint tensor named `param_name` belongs here (False: the loader skips it, e.g. the
        zero bias a checkpoint saved for a layer we run without one)."""
        return self._parameters.get(param_name) is not None

    def load_weight(self, param_name: str, loaded: torch.Tensor, shard: str = "") -> None:
        if shard:
            raise ValueError(f"{type(self).__name__}.{param_name} has no shard {shard!r}")
        copy_into(self._parameters[param_name].data, loaded)  # type: ignore[union-attr]

    def checkpoint_slice(self, param_name: str, shard: str) -> tuple[slice, ...] | None:
        """The part of checkpoint tensor (param_name, shard) this module holds, as an index into it; None =
        all of it. Tensor-parallel layers return their rank's rows or columns, which the loader reads alone."""
        return None

    def finish_loading(self) -> None:
        """Called once every tensor is in (after the completeness check): derive what depends on several
        tensors (an FP8 layer's one activation scale from its shards' input_scales)."""

    def expected_shards(self) -> list[tuple[str, str]]:
        """Every (parameter, shard) a complete checkpoint fills: the loaders check them all."""
        return [(name, "") for name, p in self._parameters.items() if p is not None]
