"""Model definitions. One Llama-family implementation covers Llama 2/3/3.x, Mistral, Qwen2 and Qwen3.

The registry itself is `engine.model_config.ARCHITECTURES` (name -> class by import path, so that reading a
config needs no torch); `model_class` resolves an entry.
"""

from __future__ import annotations

import importlib

from stoker.engine.model_config import ARCHITECTURES
from stoker.engine.models.base import CausalLM

__all__ = ["CausalLM", "model_class"]


def model_class(architecture: str) -> type[CausalLM]:
    path = ARCHITECTURES.get(architecture)
    if path is None:
        raise ValueError(f"unsupported architecture {architecture!r}; supported: {', '.join(ARCHITECTURES)}")
    module, _, name = path.partition(":")
    cls: type[CausalLM] = getattr(importlib.import_module(module), name)
    return cls
