"""Which models a worker serves: `--model PATH[,name=N][,memory=S][,kv_cache_memory_bytes=B]` (repeatable) and
a TOML file of `[[model]]` tables with the same keys (a relative path is relative to the file). Pure Python (no torch): WorkerConfig validates with it.

    [[model]]
    path = "/models/llama-3.1-8b"
    name = "llama"
    memory = 0.45          # this model's share of the GPU (weights + KV cache)
"""

from __future__ import annotations

import dataclasses
import os
import tomllib
from dataclasses import dataclass
from typing import Any

# Kept out of every model's share: the CUDA context (~0.5 GiB), the CUDA-graph pools and the allocator's
# fragmentation live outside what gpu_memory_share counts (4% of an H200 is 5.6 GiB).
MEMORY_SHARE_MARGIN = 0.04
_KEYS = ("path", "name", "memory", "kv_cache_memory_bytes")
_SYNTAX = "--model PATH[,name=NAME][,memory=SHARE][,kv_cache_memory_bytes=BYTES]"


@dataclass(frozen=True, slots=True)
class ModelSpec:
    path: str
    name: str | None = None  # served name; None = the folder's name
    memory: float | None = None  # share of the GPU's total memory for weights + KV (EngineConfig.gpu_memory_share)
    kv_cache_memory_bytes: int | None = None  # explicit KV budget (the CPU's rule; wins over `memory`)

    @property
    def served_name(self) -> str:
        return self.name or os.path.basename(os.path.normpath(self.path))

    def engine_overrides(self) -> dict[str, Any]:
        """EngineConfig keyword arguments this spec sets over the worker's shared engine settings."""
        out: dict[str, Any] = {"model_path": self.path, "model_name": self.served_name}
        if self.memory is not None:
            out["gpu_memory_share"] = self.memory
        if self.kv_cache_memory_bytes is not None:
            out["kv_cache_memory_bytes"] = self.kv_cache_memory_bytes
        return out


def parse_model_option(text: str) -> ModelSpec:
    """One --model value. A bare path is the single-model form of old; options follow commas."""
    path, *options = text.split(",")
    fields: dict[str, Any] = {"path": path.strip()}
    for option in options:
        key, sep, value = option.partition("=")
        key = key.strip().replace("-", "_")
        if not sep or key not in _KEYS[1:]:
            raise ValueError(f"--model {text!r}: {option!r} is not one of name=, memory=, kv_cache_memory_bytes= "
                             f"(syntax: {_SYNTAX})")
        fields[key] = value.strip()
    return _spec(fields, f"--model {text!r}")


def load_models_file(path: str) -> list[ModelSpec]:
    """The `[[model]]` tables of a TOML file, in order."""
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except OSError as exc:
        raise ValueError(f"--models-file {path!r} cannot be read: {exc.strerror}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"--models-file {path!r} is not valid TOML: {exc}") from None
    tables = data.get("model")
    if not isinstance(tables, list) or not tables or not all(isinstance(t, dict) for t in tables):
        raise ValueError(f"--models-file {path!r}: expected one [[model]] table per model, with path = \"...\"")
    specs = [_spec(table, f"{path} [[model]] #{i + 1}") for i, table in enumerate(tables)]
    # A relative folder is relative to the file (as compose files do), not to wherever the worker starts.
    base = os.path.dirname(os.path.abspath(path))
    return [dataclasses.replace(s, path=os.path.join(base, s.path)) for s in specs]


def _spec(fields: dict[str, Any], where: str) -> ModelSpec:
    unknown = sorted(set(fields) - set(_KEYS))
    if unknown:
        raise ValueError(f"{where}: unknown key(s) {unknown}; known: {list(_KEYS)}")
    if not isinstance(fields.get("path"), str) or not fields["path"]:
        raise ValueError(f"{where}: `path` (the model folder) is missing")
    try:
        memory = float(fields["memory"]) if fields.get("memory") not in (None, "") else None
        kv = int(fields["kv_cache_memory_bytes"]) if fields.get("kv_cache_memory_bytes") not in (None, "") else None
    except (TypeError, ValueError):
        raise ValueError(f"{where}: memory must be a number in (0, 1) and kv_cache_memory_bytes an integer") from None
    if memory is not None and not 0 < memory < 1:
        raise ValueError(f"{where}: memory={memory} must be a share of the GPU in (0, 1), e.g. memory=0.45")
    if kv is not None and kv < 1:
        raise ValueError(f"{where}: kv_cache_memory_bytes must be >= 1, got {kv}")
    name = fields.get("name")
    if name is not None and (not isinstance(name, str) or not name.strip()):
        raise ValueError(f"{where}: name must be a non-empty string")
    return ModelSpec(fields["path"], name.strip() if name else None, memory, kv)


def check_model_set(specs: list[ModelSpec]) -> list[str]:
    """Problems with a set of models (empty when fine): served names must differ, and the GPU shares given
    must leave the margin free."""
    problems = []
    names = [s.served_name for s in specs]
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        problems.append(f"served model names must differ, {repeated} repeat: give each a name= ({_SYNTAX})")
    shares = [s.memory for s in specs if s.memory is not None]
    if sum(shares) > 1 - MEMORY_SHARE_MARGIN + 1e-9:
        problems.append(f"the models' memory shares sum to {sum(shares):.3f}, over {1 - MEMORY_SHARE_MARGIN:.2f} "
                        f"(1 less a {MEMORY_SHARE_MARGIN} margin for the CUDA context and graphs): lower them")
    if shares and len(shares) != len(specs):
        problems.append("give every model a memory= share or none: a model without one would size its KV cache "
                        "from what the others left free")
    return problems
