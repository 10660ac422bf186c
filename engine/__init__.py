"""Stoker's inference engine: loader, model, kernels, paged KV cache, scheduler, sampler, tokenizer.

No I/O beyond reading the model folder. The names below are the public API (engine/outputs.py states the
contract); callers import them from here, never from the modules. Importing this package is cheap: torch is
imported only when LLMEngine is first used (the worker's stand-in engine and its tests never import it).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from stoker.engine.config import EngineConfig
from stoker.engine.heap import settle_heap
from stoker.engine.os_threads import name_os_thread
from stoker.engine.outputs import EngineRequestError, EngineStats, RequestOutput, TokenLogprob, TopLogprob
from stoker.engine.request import EngineRequest
from stoker.engine.sampling_params import GuidedDecoding, SamplingParams

if TYPE_CHECKING:
    from stoker.engine.engine import LLMEngine
    from stoker.engine.warmup import WarmupReport, warm_up

__all__ = [
    "EngineConfig", "EngineRequest", "EngineRequestError", "EngineStats", "GuidedDecoding", "LLMEngine",
    "RequestOutput", "SamplingParams", "TokenLogprob", "TopLogprob", "WarmupReport", "name_os_thread", "settle_heap",
    "warm_up",
]


def __getattr__(name: str) -> Any:
    if name == "LLMEngine":  # torch and the model code load here, on first use
        from stoker.engine.engine import LLMEngine

        return LLMEngine
    if name in ("warm_up", "WarmupReport"):
        from stoker.engine import warmup

        return getattr(warmup, name)
    raise AttributeError(f"module 'engine' has no attribute {name!r}")
