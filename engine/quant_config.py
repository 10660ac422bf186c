"""The quantization schemes we run, read from config.json's `quantization_config` (pure Python, no torch).

Two checkpoint forms and one load-time option, all FP8 E4M3 weights with float32 scales:
- `quant_method: compressed-tensors` (llm-compressor's output, the `-FP8` / `-FP8-dynamic` / `-FP8-BLOCK`
  checkpoints): one config group targeting `Linear`, `format` float-quantized (or naive-quantized, the same
  bytes for 8-bit floats); weights symmetric, static, strategy `tensor`, `channel` or `block` [128, 128];
  input activations static per-tensor (`input_scale` in the checkpoint), dynamic per-token, or (with block
  weights) dynamic per group of 128; the `ignore` list (must cover lm_head: our lm_head stays unquantized).
- `quant_method: fp8` (AutoFP8 / vLLM's older form): per-tensor weight scales, `activation_scheme` static or
  dynamic; with `weight_block_size` [128, 128], block scales named `weight_scale_inv`.
- `--quantization fp8` on an unquantized checkpoint: weights quantized per output row at load, activations
  per token.
Anything else is refused with a message naming what was found.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

QUANTIZATION_CHOICES = ("fp8",)  # EngineConfig.quantization / --quantization


@dataclass(slots=True, frozen=True)
class Fp8Scheme:
    method: str  # "compressed-tensors" | "fp8" | "load-time"
    weight_strategy: str  # "tensor" | "channel" | "block"
    activations: str  # "static" (per-tensor input_scale from the checkpoint) | "dynamic" (per token at run time)
    block_size: tuple[int, int] | None = None  # (rows, cols) of one weight scale, "block" only
    weight_scale_name: str = "weight_scale"  # "weight_scale_inv" in the older fp8 block form
    ignore: tuple[str, ...] = ()  # module names (or "re:<regex>") left unquantized
    kv_cache_scheme: dict[str, Any] | None = field(default=None, compare=False)

    @property
    def quantize_at_load(self) -> bool:
        return self.method == "load-time"

    def ignores(self, module_name: str) -> bool:
        """Whether a checkpoint module (`model.layers.0.self_attn.q_proj`, `lm_head`) stays unquantized."""
        for entry in self.ignore:
            if entry.startswith("re:"):
                if re.match(entry[3:], module_name):
                    return True
            elif entry == module_name:
                return True
        return False


LOAD_TIME_FP8 = Fp8Scheme("load-time", "channel", "dynamic", ignore=("lm_head",))


def _refuse(where: str, what: str) -> ValueError:
    return ValueError(
        f"{where}: unsupported quantization: {what}. Supported: compressed-tensors float-quantized FP8 (weights "
        "tensor/channel/block [128, 128], activations static per-tensor or dynamic per-token), and quant_method "
        "fp8; or an unquantized checkpoint with --quantization fp8"
    )


def _check_float8(where: str, kind: str, args: dict[str, Any]) -> None:
    if args.get("type") != "float" or int(args.get("num_bits", 0)) != 8:
        raise _refuse(where, f"{kind} type={args.get('type')!r} num_bits={args.get('num_bits')!r} (need float, 8)")
    if args.get("symmetric") is False:
        raise _refuse(where, f"asymmetric {kind}")


def _compressed_tensors(qc: dict[str, Any], where: str) -> Fp8Scheme:
    groups = qc.get("config_groups") or {}
    if len(groups) != 1:
        raise _refuse(where, f"{len(groups)} config_groups (we run exactly one)")
    (group,) = groups.values()
    fmt = group.get("format") or qc.get("format")
    if fmt not in ("float-quantized", "naive-quantized"):
        raise _refuse(where, f"format {fmt!r}")
    if group.get("targets") != ["Linear"]:
        raise _refuse(where, f"targets {group.get('targets')!r} (need ['Linear'])")
    if group.get("output_activations"):
        raise _refuse(where, "output_activations quantization")
    weights = group.get("weights") or {}
    _check_float8(where, "weights", weights)
    if weights.get("dynamic"):
        raise _refuse(where, "dynamic weight scales")
    strategy = weights.get("strategy")
    block: tuple[int, int] | None = None
    if strategy == "block":
        structure = weights.get("block_structure")
        if list(structure or []) != [128, 128]:
            raise _refuse(where, f"weight block_structure {structure!r} (need [128, 128])")
        block = (128, 128)
    elif strategy not in ("tensor", "channel"):
        raise _refuse(where, f"weight strategy {strategy!r}")
    acts = group.get("input_activations")
    if not acts:
        raise _refuse(where, "weight-only FP8 (input_activations null)")
    _check_float8(where, "input_activations", acts)
    act_strategy, dynamic = acts.get("strategy"), bool(acts.get("dynamic"))
    if act_strategy == "tensor" and not dynamic:
        activations = "static"
    elif dynamic and (act_strategy == "token" or (act_strategy == "group" and acts.get("group_size") == 128)):
        activations = "dynamic"  # per-group-of-128 dynamic (FP8_BLOCK) runs as per token: coarser, same format
    else:
        raise _refuse(where, f"input activations strategy {act_strategy!r} dynamic={dynamic}")
    return Fp8Scheme(
        "compressed-tensors", strategy, activations, block, ignore=tuple(qc.get("ignore") or ()),
        kv_cache_scheme=_kv_cache_scheme(qc.get("kv_cache_scheme"), where),
    )


def _kv_cache_scheme(kv: Any, where: str) -> dict[str, Any] | None:
    if not kv:
        return None
    _check_float8(where, "kv_cache_scheme", kv)
    if kv.get("strategy") != "tensor" or kv.get("dynamic"):
        raise _refuse(where, f"kv_cache_scheme strategy {kv.get('strategy')!r} dynamic={kv.get('dynamic')!r}")
    return dict(kv)


def _fp8(qc: dict[str, Any], where: str) -> Fp8Scheme:
    if qc.get("fmt", "e4m3") != "e4m3":
        raise _refuse(where, f"fp8 fmt {qc.get('fmt')!r} (need e4m3)")
    activations = qc.get("activation_scheme", "dynamic")
    if activations not in ("static", "dynamic"):
        raise _refuse(where, f"activation_scheme {activations!r}")
    ignore = tuple(qc.get("ignored_layers") or qc.get("modules_to_not_convert") or ("lm_head",))
    block_size = qc.get("weight_block_size")
    if block_size is None:
        return Fp8Scheme("fp8", "tensor", activations, ignore=ignore)
    if list(block_size) != [128, 128]:
        raise _refuse(where, f"weight_block_size {block_size!r} (need [128, 128])")
    if activations != "dynamic":
        raise _refuse(where, "static activations with block weights")
    return Fp8Scheme("fp8", "block", "dynamic", (128, 128), "weight_scale_inv", ignore)


def parse_quantization(cfg: dict[str, Any], where: str, requested: str | None = None) -> Fp8Scheme | None:
    """config.json (already read) -> the scheme its weights are in, or the load-time scheme `requested`
    (--quantization) asks for on an unquantized checkpoint; None = plain weights."""
    if requested is not None and requested not in QUANTIZATION_CHOICES:
        raise ValueError(f"quantization must be one of {QUANTIZATION_CHOICES} or None, got {requested!r}")
    qc = cfg.get("quantization_config") or cfg.get("compression_config")
    if not qc:
        return LOAD_TIME_FP8 if requested == "fp8" else None
    method = qc.get("quant_method")
    if method == "compressed-tensors":
        scheme = _compressed_tensors(qc, where)
    elif method == "fp8":
        scheme = _fp8(qc, where)
    else:
        raise _refuse(where, f"quant_method {method!r}")
    if not scheme.ignores("lm_head"):
        raise _refuse(where, f"a quantized lm_head (ignore list {list(scheme.ignore)!r} lacks lm_head)")
    return scheme
