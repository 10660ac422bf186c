"""GPU bench of the engine at the Llama-3-8B shape, with floors measured in the same run and a transformers peer.

    PYTHONPATH=. python ops/bench.py [--shape 8b|1b|70b|tiny] [--w2-requests 1024] [--hf-w2-requests 256]
                                     [--decode-kernels cublas,fused,fused+pdl] [--skip-w2] [--load-format dummy]

Writes random bf16 weights once (safetensors, 4 shards) under --model-dir (with --load-format dummy only the
config and tokenizer: the engine makes weights of the same spread on the GPU), then:
  floors  read bandwidth (device copy, bytes read + written / time) and bf16 matmul rate (8192^3); with
          --dtype fp8 (the bf16 weights quantized at load) also the row-wise FP8 rate, and the W1/W2 floors
          count the bytes stored (FP8 weights + scales, bf16 lm_head) and the FP8 rate for the linears;
  W3      engine start to ready: first (cold: page cache dropped when the kernel allows) and second (warm);
          weights-on-GPU time and graph-capture time from the engine's startup report;
  W1      1 request, 512 prompt tokens, 256 new (greedy, ignore_eos): TPOT and tok/s; with several
          --decode-kernels settings, W1 again on a fresh engine for each setting after the first (A/B);
          --w1-batch N: N such requests at once (TPOT = time per decode step of N tokens; the floor reads the
          weights once and N contexts);
  W2      N requests x 512 random prompt tokens x 256 new, all added at once: output tok/s and total time,
          process CPU seconds / wall, GPU idle share between decode steps (CUDA events);
  peer    transformers generate on the same folder: W1, and W2 at batch --hf-w2-requests.
Prints one table (figure | floor | peer | target) and writes $OUT/bench.json when OUT is set.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import re
import resource
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch

SHAPES: dict[str, dict[str, Any]] = {
    "8b": dict(
        hidden_size=4096,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        intermediate_size=14336,
        vocab_size=128256,
    ),
    "1b": dict(  # Llama-3.2-1B-class (head_dim 64), its embedding untied here
        hidden_size=2048,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=64,
        intermediate_size=8192,
        vocab_size=128256,
    ),
    "70b": dict(  # Llama-3-70B (issue 17: TP = 2 and up; 131 GiB of bf16 weights, so --load-format dummy)
        hidden_size=8192,
        num_hidden_layers=80,
        num_attention_heads=64,
        num_key_value_heads=8,
        head_dim=128,
        intermediate_size=28672,
        vocab_size=128256,
    ),
    "8b-rank2": dict(  # what one rank of the 8B at TP = 2 computes (half the heads and intermediate, whole LM head):
        # its W1 on one GPU is a rank's kernels without the all-reduces, beside the TP = 2 run's (issue 17)
        hidden_size=4096,
        num_hidden_layers=32,
        num_attention_heads=16,
        num_key_value_heads=4,
        head_dim=128,
        intermediate_size=7168,
        vocab_size=128256,
    ),
    "tiny": dict(
        hidden_size=512,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=64,
        intermediate_size=1024,
        vocab_size=32000,
    ),
}


def log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", flush=True)


# ---- floors ----------------------------------------------------------------------------------------------
def measure_floors(fp8: bool = False) -> dict[str, float]:
    def timed(fn, warm: int, reps: int) -> float:
        for _ in range(warm):
            fn()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3 / reps

    n = 2 * 2**30 // 2  # 2 GiB of bf16, far past the 60 MB L2
    x = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    y = torch.empty_like(x)
    bw = 2 * x.numel() * 2 / timed(lambda: y.copy_(x), 3, 20)
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    rate = 2 * 8192**3 / timed(lambda: a @ b, 3, 10)
    floors = {"bandwidth_Bps": bw, "matmul_flops": rate}
    if fp8:  # the rate the FP8 linears can reach: row-wise scaled _scaled_mm, as engine/kernels/fp8_linear.py
        a8, b8 = a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn)
        sa = torch.ones(8192, 1, device="cuda")
        sb = torch.ones(1, 8192, device="cuda")
        mm = lambda: torch._scaled_mm(a8, b8.t(), scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16)  # noqa: E731
        floors["fp8_matmul_flops"] = 2 * 8192**3 / timed(mm, 3, 10)
    return floors


# ---- the model folder ------------------------------------------------------------------------------------
def write_model(path: str, shape: dict[str, Any], device: str = "cuda", weights: bool = True) -> float:
    """Random bf16 weights (std 0.02, norms 1: engine/dummy_load.py's) as 4 safetensors shards + index, config and
    a tokenizer. `device` draws them (cpu: for dry runs of the tiny shape without a GPU). weights=False: the config
    and the tokenizer alone, for --load-format dummy (the engine then makes the same weights on the GPU)."""
    from safetensors.torch import save_file
    from stoker.engine.make_model import write_tokenizer

    done = "model.safetensors.index.json" if weights else "config.json"
    if os.path.isfile(os.path.join(path, done)):
        return 0.0
    t0 = time.perf_counter()
    os.makedirs(path, exist_ok=True)
    write_tokenizer(path, 384)  # prompts are token ids; the detokenizer maps unknown ids to nothing
    config = dict(
        architectures=["LlamaForCausalLM"],
        model_type="llama",
        hidden_act="silu",
        max_position_embeddings=8192,
        rms_norm_eps=1e-5,
        rope_theta=500000.0,
        tie_word_embeddings=False,
        bos_token_id=0,
        eos_token_id=1,
        torch_dtype="bfloat16",
        **shape,
    )
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    if not weights:
        return time.perf_counter() - t0
    from stoker.engine.dummy_load import checkpoint_layout, dummy_tensor
    from stoker.engine.model_config import ModelConfig

    # The checkpoint the engine's --load-format dummy makes on `device` (the same names, shapes and values), written
    # out in 4 shards by layer: the embedding first, the final norm and the LM head last.
    shards: list[dict[str, torch.Tensor]] = [{} for _ in range(4)]
    for name, dims, fill in checkpoint_layout(ModelConfig.from_folder(path)):
        layer = re.match(r"model\.layers\.(\d+)\.", name)
        shard = int(layer.group(1)) * 4 // shape["num_hidden_layers"] if layer else 0 if "embed_tokens" in name else 3
        shards[shard][name] = dummy_tensor(name, dims, fill, torch.bfloat16, device).cpu()
    names = [f"model-{i + 1:05d}-of-00004.safetensors" for i in range(4)]
    threads = [
        threading.Thread(target=save_file, args=(s, os.path.join(path, n), {"format": "pt"}))
        for s, n in zip(shards, names, strict=True)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    index = {"metadata": {}, "weight_map": {k: n for s, n in zip(shards, names, strict=True) for k in s}}
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump(index, f)
    os.sync()
    return time.perf_counter() - t0


def drop_page_cache() -> bool:
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


# ---- our engine ------------------------------------------------------------------------------------------
def engine_config(path: str, max_num_seqs: int, device: str = "cuda", quantization: str | None = None,
                  max_num_batched_tokens: int = 8192, tensor_parallel_size: int = 1, kv_cache_dtype: str = "auto",
                  decode: str = "auto", load_format: str = "auto"):
    """The bench's engine settings (ops/bench_e2e.py gives the worker the same ones, from this object).
    decode: an EngineConfig.decode_kernels value, "+pdl" appended for decode_pdl (see decode_setting)."""
    from stoker.engine import EngineConfig

    # A/B switches, read here at the edge (the engine itself reads no environment): STOKER_TRITON=0 runs the
    # torch references, STOKER_BLOCKING_SYNC=0 keeps CUDA's default (spinning) host waits.
    use_triton = os.environ.get("STOKER_TRITON", "1") != "0"
    blocking_sync = os.environ.get("STOKER_BLOCKING_SYNC", "1") != "0"
    # STOKER_TP_ALL_REDUCE=symm-mem: the one-shot all-reduce for the small steps (EngineConfig.tensor_parallel_all_reduce)
    tp_all_reduce = os.environ.get("STOKER_TP_ALL_REDUCE", "nccl")
    return EngineConfig(
        model_path=path,
        device=device,
        dtype="bfloat16" if device.startswith("cuda") else "float32",
        max_model_len=1024,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        enable_prefix_caching=False,
        gpu_memory_utilization=0.9,
        use_triton=use_triton,
        blocking_sync=blocking_sync,
        quantization=quantization,
        tensor_parallel_size=tensor_parallel_size,
        tensor_parallel_all_reduce=tp_all_reduce,
        kv_cache_dtype=kv_cache_dtype,
        load_format=load_format,
        **decode_setting(decode),
    )


# Kernel-module switches a --decode-kernels item may set for its own engine (an A/B of kernel forms, not engine
# settings): "+nosums" / "+sums" turn gemv.ROW_SUM_FP8 (the one-token FP8 loop's in-register run sums) off / on;
# "+rowbf16" / "+sumbf16" put 16-bit weights on that loop (gemv.ROW_ACC_BF16) with the run sums (ROW_SUM_BF16);
# "+opdl" / "+noopdl" launch the attention and o_proj of a chain without PDL with it or not (fused_decode.O_PROJ_PDL);
# "+qkvfirst" lets the attention in before the qkv GEMV's wait (fused_decode.QKV_TRIGGER_FIRST); "+norowbf16" /
# "+nosumbf16" turn ROW_ACC_BF16 / ROW_SUM_BF16 off; "+fp8pro" runs FP8's norms in the GEMV prologues again
# (fused_decode.FP8_PROLOGUE_NORM).
KERNEL_FLAGS = {
    "sums": ("gemv", "ROW_SUM_FP8", True), "nosums": ("gemv", "ROW_SUM_FP8", False),
    "rowbf16": ("gemv", "ROW_ACC_BF16", True), "sumbf16": ("gemv", "ROW_SUM_BF16", True),
    "opdl": ("fused_decode", "O_PROJ_PDL", True), "qkvfirst": ("fused_decode", "QKV_TRIGGER_FIRST", True),
    "norowbf16": ("gemv", "ROW_ACC_BF16", False), "nosumbf16": ("gemv", "ROW_SUM_BF16", False),
    "noopdl": ("fused_decode", "O_PROJ_PDL", False), "fp8pro": ("fused_decode", "FP8_PROLOGUE_NORM", True),
    "carry": ("fused_decode", "NORM_CARRY", True), "nocarry": ("fused_decode", "NORM_CARRY", False),
}
# Launch-table entries an item may replace for its own engine: "+m1=KERNEL:N:K:SHAPE:CONVERT" one
# fused_decode.FP8_FUSED_M1 entry (e.g. m1=add:4096:4096:1x4x4096w4s3:asm-join), "+tune=KIND:N:K:SHAPE" one
# gemv._TUNED_M1 entry (bf16 one-token shapes; e.g. tune=plain:4096:4096:1x4x2048w4s3); SHAPE is
# BMxBNxBKwWARPSsSTAGES, then pTILES for GemvConfig.pdl_tiles, rREGS for its maxnreg, and a trailing "dot" for the
# tensor-core tile.
KERNEL_TABLES = {"m1": ("fused_decode", "FP8_FUSED_M1"), "tune": ("gemv", "_TUNED_M1")}
_KERNEL_DEFAULTS: dict[tuple[str, str], Any] = {}
_SET_DEFAULTS: dict[tuple[str, str], Any] = {}  # the values "+set=" items replaced, as they were before


def _kernel_module(name: str):
    from stoker.engine import cuda_graphs
    from stoker.engine.kernels import attention, decode_fp8_mma, gemv
    from stoker.engine.layers import linear
    from stoker.engine.models import fused_decode

    return {"gemv": gemv, "fused_decode": fused_decode, "attention": attention, "decode_fp8_mma": decode_fp8_mma,
            "cuda_graphs": cuda_graphs, "linear": linear}[name]


def _set_flag(text: str) -> tuple[str, str, Any]:
    """"set=MODULE.NAME=VALUE" -> (module, name, value): any int / float / True / False module constant of gemv,
    fused_decode, attention, decode_fp8_mma, cuda_graphs or linear (e.g. set=attention.DECODE_TILE_N=32), for that
    item's engine only."""
    m = re.fullmatch(r"set=(gemv|fused_decode|attention|decode_fp8_mma|cuda_graphs|linear)\.([A-Z][A-Z0-9_]*)=(.+)",
                     text)
    if m is None:
        raise ValueError(f"--decode-kernels '+set=MODULE.NAME=VALUE' expected (MODULE gemv, fused_decode, attention, "
                         f"decode_fp8_mma, cuda_graphs or linear), got {text!r}")
    module, name, raw = m.groups()
    current = getattr(_kernel_module(module), name)  # AttributeError for a name the module lacks
    if isinstance(current, bool):
        if raw not in ("True", "False"):
            raise ValueError(f"{module}.{name} is a bool: True or False, got {raw!r}")
        return module, name, raw == "True"
    if not isinstance(current, int | float):
        raise ValueError(f"{module}.{name} is not a number or a bool")
    return module, name, type(current)(raw)


def parse_gemv_shape(text: str):
    """"1x4x2048w4s3" -> GemvConfig(1, 4, 2048, False, 4, 3); "p4" after it: pdl_tiles 4; "r64": maxnreg 64; "dot"
    last: the tensor-core tile."""
    from stoker.engine.kernels.gemv import GemvConfig

    m = re.fullmatch(r"(\d+)x(\d+)x(\d+)w(\d+)(?:s(\d+))?(?:p(\d+))?(?:r(\d+))?(dot)?", text)
    if m is None:
        raise ValueError(f"a GEMV launch shape like 1x4x2048w4s3 (or 1x4x1024w4s3p4, 16x16x256w1s4dot) expected, "
                         f"got {text!r}")
    bm, bn, bk, warps, stages, tiles, regs, dot = m.groups()
    return GemvConfig(int(bm), int(bn), int(bk), dot is not None, int(warps), int(stages or 3), int(tiles or 1),
                      int(regs) if regs else None)


def _table_entry(table: str, text: str) -> tuple[tuple[str, int, int], Any]:
    parts = text.split(":")
    if table == "m1" and len(parts) == 5:
        return (parts[0], int(parts[1]), int(parts[2])), (parse_gemv_shape(parts[3]), parts[4])
    if table == "tune" and len(parts) == 4:
        return (parts[0], int(parts[1]), int(parts[2])), parse_gemv_shape(parts[3])
    raise ValueError(f"--decode-kernels '+{table}=...': KERNEL:N:K:SHAPE{':CONVERT' if table == 'm1' else ''} "
                     f"expected, got {text!r}")


def apply_kernel_flags(text: str) -> None:
    """Set the kernel-module switches and launch-table entries of one --decode-kernels item before its engine is
    built (its CUDA graphs are captured then); an item without them gets the modules' own values back (the
    tables as they were when the first item ran, i.e. after --fp8-m1-table)."""
    for module, name, _ in KERNEL_FLAGS.values():
        key = (module, name)
        _KERNEL_DEFAULTS.setdefault(key, getattr(_kernel_module(module), name))
        setattr(_kernel_module(module), name, _KERNEL_DEFAULTS[key])
    for module, name in KERNEL_TABLES.values():
        key = (module, name)
        _KERNEL_DEFAULTS.setdefault(key, dict(getattr(_kernel_module(module), name)))
        table = getattr(_kernel_module(module), name)
        table.clear()
        table.update(_KERNEL_DEFAULTS[key])
    for (module, name), value in _SET_DEFAULTS.items():  # what earlier items' "set=" changed
        setattr(_kernel_module(module), name, value)
    for flag in text.split("+")[1:]:
        if flag.startswith("set="):
            module, name, value = _set_flag(flag)
            _SET_DEFAULTS.setdefault((module, name), getattr(_kernel_module(module), name))
            setattr(_kernel_module(module), name, value)
        elif flag in KERNEL_FLAGS:
            module, name, value = KERNEL_FLAGS[flag]
            setattr(_kernel_module(module), name, value)
        elif flag.split("=", 1)[0] in KERNEL_TABLES:
            table, entry = flag.split("=", 1)
            key, value = _table_entry(table, entry)
            module, name = KERNEL_TABLES[table]
            getattr(_kernel_module(module), name)[key] = value


def decode_setting(text: str) -> dict[str, Any]:
    """"fused+pdl" -> {"decode_kernels": "fused", "decode_pdl": True}: one --decode-kernels item ("+nopdl": False;
    neither: EngineConfig's default); "+nomlp" / "+mlp" sets decode_fused_mlp; KERNEL_FLAGS ("+sums", "+opdl", ...)
    and KERNEL_TABLES ("+m1=...", "+tune=...") are kernel-module settings (apply_kernel_flags), none of the engine. "+overlap"
    adds decode_overlap (two-nano-batch decode steps, engine/models/nano_batches.py), "+overlapN" with N rows
    as its threshold (decode_overlap_min_rows), "+smsK" K SMs for its attention lane (decode_overlap_sms); "+proN"
    normalises in the GEMV prologues up to N tokens a step (decode_prologue_norm_max_m)."""
    kernels, *flags = text.split("+")
    setting: dict[str, Any] = {"decode_kernels": kernels}  # decode_pdl: EngineConfig's default unless +pdl / +nopdl
    for flag in flags:
        rows = flag.removeprefix("overlap")
        if flag in KERNEL_FLAGS or flag.split("=", 1)[0] in KERNEL_TABLES or flag.startswith("set="):
            continue
        if flag in ("pdl", "nopdl"):
            setting["decode_pdl"] = flag == "pdl"
        elif flag in ("mlp", "nomlp"):
            setting["decode_fused_mlp"] = flag == "mlp"
        elif flag.startswith("overlap") and (rows == "" or rows.isdigit()):
            setting["decode_overlap"] = True
            setting |= {"decode_overlap_min_rows": int(rows)} if rows else {}
        elif flag.startswith("sms") and flag[3:].isdigit():
            setting["decode_overlap_sms"] = int(flag[3:])
        elif flag.startswith("pro") and flag[3:].isdigit():
            setting["decode_prologue_norm_max_m"] = int(flag[3:])
        else:
            raise ValueError(f"--decode-kernels item {text!r}: a decode_kernels value, optionally with '+pdl', "
                             "'+nopdl', '+mlp', '+nomlp', '+overlap[N]', '+smsK', '+proN', or KERNEL_FLAGS / KERNEL_TABLES items")
    return setting


def start_engine(path: str, max_num_seqs: int, device: str = "cuda", quantization: str | None = None,
                 tensor_parallel_size: int = 1, kv_cache_dtype: str = "auto", decode: str = "auto", config=None,
                 max_num_batched_tokens: int = 8192, load_format: str = "auto"):
    """The engine and its seconds to ready; `config` (an EngineConfig) replaces the other settings when given."""
    from stoker.engine import LLMEngine

    t0 = time.perf_counter()
    apply_kernel_flags(decode)
    if config is None:
        config = engine_config(path, max_num_seqs, device, quantization, tensor_parallel_size=tensor_parallel_size,
                               kv_cache_dtype=kv_cache_dtype, decode=decode,
                               max_num_batched_tokens=max_num_batched_tokens, load_format=load_format)
    eng = LLMEngine(config)
    if str(config.device).startswith("cuda"):
        torch.cuda.synchronize()
    return eng, time.perf_counter() - t0


def random_prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(2, vocab, (n, length), generator=gen).tolist()


class StepProbe:
    """CUDA events around each decode step's GPU work (forward launch .. sampler's last kernel): the gap from
    one decode step's end to the next one's start is time the GPU had nothing queued."""

    def __init__(self, eng):
        self.runner = eng.runner
        self.pairs: list[list[Any]] = []  # [start event, end event] per decode step
        self._orig_forward, self._orig_sampler = self.runner.forward, self.runner.sampler
        self._decode = False
        self.forwards = 0  # forward calls so far, and the index of the last one that was not decode-only
        self.last_mixed = -1

        def forward(inp):
            self._decode = bool(inp.meta.decode_only)
            if not self._decode:
                self.last_mixed = self.forwards
            self.forwards += 1
            if self._decode:
                ev = torch.cuda.Event(enable_timing=True)
                ev.record()
                self.pairs.append([ev, None])
            return self._orig_forward(inp)

        def sampler(logits, batch, greedy=None):
            out = self._orig_sampler(logits, batch, greedy=greedy)
            if self._decode:
                ev = torch.cuda.Event(enable_timing=True)
                ev.record()
                self.pairs[-1][1] = ev
            return out

        self.runner.forward, self.runner.sampler = forward, sampler

    def close(self) -> dict[str, float]:
        self.runner.forward, self.runner.sampler = self._orig_forward, self._orig_sampler
        torch.cuda.synchronize()
        p = [x for x in self.pairs if x[1] is not None]
        busy = sum(s.elapsed_time(e) for s, e in p)
        span = p[0][0].elapsed_time(p[-1][1]) if p else 0.0
        # Only gaps between consecutive decode steps: the span may also hold eager prefill steps.
        gaps = [p[i][1].elapsed_time(p[i + 1][0]) for i in range(len(p) - 1)]
        gaps = [g for g in gaps if g < 50]  # a gap over 50 ms holds a prefill step between two decodes
        return {
            "decode_steps": len(p),
            "decode_busy_ms": busy,
            "span_ms": span,
            "idle_ms": sum(gaps),
            "idle_share": sum(gaps) / (busy + sum(gaps)) if p else 0.0,
            "mean_gap_ms": sum(gaps) / max(1, len(gaps)),
        }


def thread_cpu() -> dict[str, float]:
    """CPU seconds (user + system) of each thread of this process, keyed "name:tid" (from /proc)."""
    from stoker.ops.proc_cpu import threads_cpu_s

    return {f"{name}:{tid}": cpu for tid, (name, cpu) in threads_cpu_s().items()}


def busiest_threads(before: dict[str, float], after: dict[str, float], n: int = 6) -> list[tuple[str, float]]:
    delta = {k: v - before.get(k, 0.0) for k, v in after.items()}
    return sorted(((k, round(v, 2)) for k, v in delta.items() if v > 0), key=lambda kv: -kv[1])[:n]


def run_requests(
    eng, prompts: list[list[int]], max_tokens: int, tag: str, probe: StepProbe | None = None
) -> dict[str, Any]:
    """Runs the prompts to the end. With a probe: also splits wall and process CPU at the step that ran the
    last prefill (mixed) forward: the prefill phase (adds included) vs the pure-decode phase."""
    from stoker.engine import EngineRequest, SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    t0 = time.perf_counter()
    ru0 = resource.getrusage(resource.RUSAGE_SELF)
    for i, p in enumerate(prompts):
        eng.add_request(EngineRequest(f"{tag}{i}", prompt_token_ids=p, params=params))
    stamps: list[float] = []
    cpu_stamps: list[float] = []  # process CPU seconds at each step's end
    mixed_step = -1  # index of the step whose forward was the last mixed one
    main0 = time.thread_time()
    produced = 0
    while eng.has_unfinished():
        before = probe.last_mixed if probe is not None else -1
        for out in eng.step():
            if out.error_code:
                raise RuntimeError(f"{out.request_id}: {out.error_code} {out.error_message}")
            produced += len(out.new_token_ids)
        stamps.append(time.perf_counter())
        cpu_stamps.append(time.process_time())
        if probe is not None and probe.last_mixed != before:
            mixed_step = len(stamps) - 1
    wall = time.perf_counter() - t0
    main = time.thread_time() - main0
    ru1 = resource.getrusage(resource.RUSAGE_SELF)
    cpu = (ru1.ru_utime - ru0.ru_utime) + (ru1.ru_stime - ru0.ru_stime)
    mid = len(stamps) // 2  # the second half of the steps: pure decode for W2 (prefills end in the first)
    return {
        "wall_s": wall,
        "tokens": produced,
        "tok_s": produced / wall,
        "cpu_s": cpu,
        "cpu_cores": cpu / wall,
        "cpu_main_thread_s": main,
        "cpu_cores_second_half": (cpu_stamps[-1] - cpu_stamps[mid]) / max(1e-9, stamps[-1] - stamps[mid]),
        **(_phases(t0, ru0, stamps, cpu_stamps, mixed_step) if 0 <= mixed_step < len(stamps) - 1 else {}),
        "stamps": stamps,
        "t0": t0,
    }


def _phases(t0: float, ru0: Any, stamps: list[float], cpu: list[float], k: int) -> dict[str, float]:
    """Prefill phase: from the first add to the end of step k (the last mixed forward; overlapped steps
    finish it one step later, which this ignores); decode phase: the rest."""
    cpu0 = ru0.ru_utime + ru0.ru_stime
    pre_wall, dec_wall = stamps[k] - t0, stamps[-1] - stamps[k]
    return {
        "prefill_phase_s": pre_wall,
        "prefill_phase_cpu_cores": (cpu[k] - cpu0) / max(1e-9, pre_wall),
        "decode_phase_s": dec_wall,
        "decode_phase_cpu_cores": (cpu[-1] - cpu[k]) / max(1e-9, dec_wall),
    }


def triton_variants() -> dict[str, int]:
    """Compiled variants per Triton kernel of the engine (each specialization is a host-side compile)."""
    import stoker.engine.kernels.activation as act
    import stoker.engine.kernels.attention as att
    import stoker.engine.kernels.gemv as gemv
    import stoker.engine.kernels.rmsnorm as rms
    import stoker.engine.kernels.rotary as rot

    out = {}
    for mod in (act, att, gemv, rms, rot):
        for name, fn in vars(mod).items():
            caches = getattr(fn, "device_caches", None)
            if caches is not None and name.endswith("_kernel"):
                out[name] = sum(len(c[0]) for c in caches.values())
    return out


def _out_file(name: str) -> str:
    return os.path.join(os.environ.get("OUT") or ".", name)


def profile_w1(eng, vocab: int, prompt: int) -> None:
    """torch.profiler over 32 batch-1 decode steps: the GPU kernel table (time per kernel), to see where a
    step's time goes against the bandwidth floor. Written to $OUT/w1_profile.txt."""
    from stoker.engine import EngineRequest, SamplingParams
    from stoker.ops.kernel_path import critical_path, path_table, spans_from_trace
    from torch.profiler import ProfilerActivity, profile

    eng.add_request(EngineRequest(
        "prof",
        prompt_token_ids=random_prompts(1, prompt, vocab, 9)[0],
        params=SamplingParams(temperature=0.0, max_tokens=80, ignore_eos=True),
    ))
    for _ in range(40):  # prefill and warm decode steps
        eng.step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(32):
            eng.step()
        torch.cuda.synchronize()
    while eng.has_unfinished():
        eng.step()
    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=45, max_name_column_width=90)
    # Under PDL those totals count each kernel's wait: the critical-path charges (ops/kernel_path.py) do not.
    trace_path = _out_file("w1_trace.json")
    prof.export_chrome_trace(trace_path)
    path = path_table(critical_path(spans_from_trace(json.loads(Path(trace_path).read_text()))), rows=30, per=32)
    with open(_out_file("w1_profile.txt"), "w") as f:
        f.write("32 decode steps at batch 1 (graphs on), per-kernel totals:\n" + table
                + "\n\nWhat each kernel adds to the step's critical path, per step:\n" + path + "\n")
    log("W1 profile:\n" + table + "\nW1 critical path, per step:\n" + path)


def cprofile_w2(eng, vocab: int, n: int, prompt: int) -> None:
    """cProfile of the host side of a W2-like run (n requests, 48 new tokens): where the CPU goes per step.
    Written to $OUT/w2_cprofile.txt (cProfile slows the Python it measures: shares matter, not totals)."""
    import cProfile
    import io
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    run_requests(eng, random_prompts(n, prompt, vocab, 11), 48, "cp")
    prof.disable()
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(35)
    with open(_out_file("w2_cprofile.txt"), "w") as f:
        f.write(buf.getvalue())


# ---- transformers peer -----------------------------------------------------------------------------------
def hf_peer(path: str, vocab: int, w2_requests: int, prompt: int, new: int) -> dict[str, Any]:
    import transformers

    res: dict[str, Any] = {}
    t0 = time.perf_counter()
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, device_map="cuda")
    model.eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 1
    torch.cuda.synchronize()
    res["load_s"] = time.perf_counter() - t0

    def gen(ids: torch.Tensor, n: int) -> float:
        torch.cuda.synchronize()
        t = time.perf_counter()
        with torch.no_grad():
            out = model.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n, do_sample=False
            )
        torch.cuda.synchronize()
        assert out.shape[1] == ids.shape[1] + n, out.shape
        return time.perf_counter() - t

    one = torch.tensor(random_prompts(1, prompt, vocab, 7), device="cuda")
    gen(one, 8)  # warm-up
    t1, tn = gen(one, 1), gen(one, new)
    res["w1_tpot_ms"] = (tn - t1) / (new - 1) * 1e3
    res["w1_tok_s"] = new / tn
    try:
        batch = torch.tensor(random_prompts(w2_requests, prompt, vocab, 8), device="cuda")
        t = gen(batch, new)
        res["w2_batch"], res["w2_wall_s"], res["w2_tok_s"] = w2_requests, t, w2_requests * new / t
    except torch.OutOfMemoryError as e:
        res["w2_error"] = f"OOM: {e}"[:200]
    return res


def apply_fp8_m1_table(path: str) -> None:
    """--fp8-m1-table: the picked one-token FP8 launches in place of fused_decode.FP8_FUSED_M1's own."""
    from stoker.engine.kernels.gemv import GemvConfig
    from stoker.engine.models import fused_decode

    if not os.path.exists(path):
        log(f"--fp8-m1-table {path}: no such file, the table stays {fused_decode.FP8_FUSED_M1}")
        return
    for entry in json.loads(Path(path).read_text()):
        key = (entry["kernel"], entry["n"], entry["k"])
        fused_decode.FP8_FUSED_M1[key] = (GemvConfig(*entry["config"]), entry["convert"])
    log(f"FP8_FUSED_M1 from {path}: {fused_decode.FP8_FUSED_M1}")


# ---- main ------------------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="8b")
    ap.add_argument("--model-dir", default=None, help="default /tmp/stoker-bench-<shape>")
    ap.add_argument("--w2-requests", type=int, default=1024)
    ap.add_argument("--hf-w2-requests", type=int, default=256)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--new", type=int, default=256)
    ap.add_argument("--w1-batch", type=int, default=1,
                    help="W1's requests at once (decode steps of that many tokens; the peer's W1 stays one)")
    ap.add_argument("--max-num-seqs", type=int, default=1024)
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--skip-cold", action="store_true", help="no cold start (page cache drop + first engine)")
    ap.add_argument("--skip-w2", action="store_true", help="no W2 (--profile then gives the W1 kernel table alone)")
    ap.add_argument("--skip-w1", action="store_true",
                    help="no W1 (its one-request warm run still compiles the prefill path before W2)")
    ap.add_argument("--decode-kernels", default="auto",
                    help="comma-separated EngineConfig.decode_kernels settings (auto|fused|fused-folded|cublas, each "
                         "optionally +pdl / +nopdl, +overlap[N] (decode_overlap, N its min rows), +smsK (decode_overlap_sms), "
                         "+nosums (gemv.ROW_SUM_FP8 off for that engine)): the first runs "
                         "everything; each other one runs W1 on a fresh engine")
    ap.add_argument("--profile", action="store_true",
                    help="W1 kernel table, W2 decode/prefill step kernel tables (ops/step_profile.py) "
                         "and W2 host cProfile into $OUT")
    ap.add_argument("--dtype", choices=["bf16", "fp8"], default="bf16",
                    help="fp8: the bf16 weights quantized to FP8 at load (--quantization fp8; lm_head stays bf16)")
    ap.add_argument("--kv-cache-dtype", choices=["auto", "fp8"], default="auto",
                    help="fp8: the FP8 KV cache (scales 1.0: the bench's model has no kv_cache_scheme); the floors "
                         "count 1 byte per cached element")
    ap.add_argument("--tensor-parallel", type=int, default=1,
                    help="GPUs the engine splits the model over (issue 17; BENCHMARKS.md, session 24). "
                         "The weight-byte floors below count rank 0's shard")
    ap.add_argument("--load-format", choices=["auto", "dummy"], default="auto",
                    help="dummy: no weight files; the engine makes random weights of the same spread on the GPU "
                         "(EngineConfig.load_format: the 70B shape, whose 131 GiB no bench disk holds). Implies "
                         "--skip-cold and --skip-hf; the W3 weight row is then the dummy fill, not a load")
    ap.add_argument("--fp8-m1-table", default=None,
                    help="JSON of FP8_FUSED_M1 entries (ops/bench_fp8_fused.py --pick) that replace the table of "
                         "engine/models/fused_decode.py for this run (a missing file leaves the table as it is)")
    ap.add_argument("--heap", choices=["worker", "default"], default="worker",
                    help="worker: freeze the heap after the warm start and raise the young GC threshold, as the worker "
                         "does once loaded (settle_heap); default: Python's GC as it comes")
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192,
                    help="the engine's token budget per step (EngineConfig.max_num_batched_tokens): W2's prefill chunk size")
    ap.add_argument("--mixed-split", default="on",
                    help="EngineConfig.mixed_decode_attention for W2: on | off | a comma list (W2 once per setting on "
                         "the same engine, in order; the last one is the table's W2 and --profile's)")
    args = ap.parse_args(argv)
    if args.load_format == "dummy":  # nothing on disk to load cold, nothing for transformers to load
        args.skip_cold = args.skip_hf = True
    if args.fp8_m1_table:
        apply_fp8_m1_table(args.fp8_m1_table)
    if any(s not in ("on", "off") for s in args.mixed_split.split(",")):
        ap.error(f"--mixed-split: on, off or a comma list of them, got {args.mixed_split!r}")
    decodes = args.decode_kernels.split(",")
    if args.skip_w1 and (args.skip_w2 or len(decodes) > 1):
        ap.error("--skip-w1 runs W2 alone: not with --skip-w2 or several --decode-kernels")
    for d in decodes:
        decode_setting(d)  # a typo fails here, before the floors and the weights
    if not torch.cuda.is_available():
        print("ops/bench.py needs a CUDA GPU", file=sys.stderr)
        return 2
    import logging

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    shape = SHAPES[args.shape]
    path = args.model_dir or f"/tmp/stoker-bench-{args.shape}" + ("-dummy" if args.load_format == "dummy" else "")
    r: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d"),
        "gpu": torch.cuda.get_device_name(),
        "shape": args.shape,
        "argv": sys.argv[1:],
        "torch": torch.__version__,
        "dtype": args.dtype,
        "kv_cache_dtype": args.kv_cache_dtype,
        "tensor_parallel": args.tensor_parallel,
    }
    quantization = "fp8" if args.dtype == "fp8" else None
    log("floors")
    r["floors"] = measure_floors(fp8=quantization is not None)
    torch.cuda.empty_cache()
    bw, rate = r["floors"]["bandwidth_Bps"], r["floors"]["matmul_flops"]
    log(f"bandwidth {bw / 1e12:.2f} TB/s, bf16 matmul {rate / 1e12:.0f} TFLOP/s; writing weights")
    r["write_s"] = write_model(path, shape, weights=args.load_format != "dummy")
    r["load_format"] = args.load_format
    if not args.skip_cold:
        r["page_cache_dropped"] = drop_page_cache()
        log(
            f"weights written in {r['write_s']:.1f} s; cold start (page cache dropped: {r['page_cache_dropped']})"
        )
        eng, r["cold_ready_s"] = start_engine(path, args.max_num_seqs, quantization=quantization,
                                              tensor_parallel_size=args.tensor_parallel,
                                              kv_cache_dtype=args.kv_cache_dtype, decode=decodes[0],
                                              max_num_batched_tokens=args.max_num_batched_tokens,
                                              load_format=args.load_format)
        r["cold_startup"] = {k: v for k, v in eng.runner.startup.items()}
        eng.close()  # tensor parallel: its rank processes hold the other GPUs
        del eng
        gc.collect()
        torch.cuda.empty_cache()
    log("warm start")
    eng, r["warm_ready_s"] = start_engine(path, args.max_num_seqs, quantization=quantization,
                                          tensor_parallel_size=args.tensor_parallel, kv_cache_dtype=args.kv_cache_dtype,
                                          decode=decodes[0], max_num_batched_tokens=args.max_num_batched_tokens,
                                          load_format=args.load_format)
    r["warm_startup"] = dict(eng.runner.startup)
    log(f"startup: {r['warm_startup']}")
    r["heap"] = args.heap
    if args.heap == "worker":
        from stoker.engine import settle_heap

        settle_heap()
    mc = eng.model_config
    # Bytes each decode step streams, as stored: FP8 weights (1 byte) and their float32 scales, the bf16
    # lm_head and norms; the embedding is gathered, not streamed.
    weight_bytes = sum(p.numel() * p.element_size() for p in eng.runner.model.parameters() if p is not None)
    weight_bytes -= mc.vocab_size * mc.hidden_size * 2
    params_active = sum(p.numel() for n, p in eng.runner.model.named_parameters()
                        if p.dtype != torch.float32 and "embed_tokens" not in n)  # scales are not multiplied
    lm_head_params = mc.vocab_size * mc.hidden_size
    # The linears run at the FP8 rate under --dtype fp8 (lm_head and attention at bf16's).
    linear_rate = r["floors"].get("fp8_matmul_flops", rate)
    gemm_s = lambda tokens: 2 * tokens * ((params_active - lm_head_params) / linear_rate  # noqa: E731
                                          + lm_head_params / rate)
    kv_per_token = 2 * mc.num_layers * mc.num_kv_heads * mc.head_dim * (1 if args.kv_cache_dtype == "fp8" else 2)
    vocab = r["vocab"] = mc.vocab_size

    # W1
    avg_ctx = args.prompt + args.new / 2
    if args.skip_w1:
        run_requests(eng, random_prompts(1, args.prompt, vocab, 1), 16, "warm")  # W1's warm run: the prefill path
    else:
        w1_bytes = weight_bytes + args.w1_batch * avg_ctx * kv_per_token
        r["w1"], r["w1_gpu"] = measure_w1(eng, args, vocab, w1_bytes / bw * 1e3)
        r["w1_by_decode"] = {decodes[0]: [w1_summary(r["w1"], r["warm_startup"])]}
        log(f"W1 {r['w1']}")
    if args.skip_w2:
        if args.profile:  # the W1 kernel table alone (W2's tables need W2)
            profile_w1(eng, vocab, args.prompt)
        return finish(eng, r, args, path, decodes, quantization)

    # W2 (--mixed-split a,b: first once per other setting, on the same engine; the last one is the table's W2)
    *others, last = args.mixed_split.split(",")
    r["w2_by_mixed_split"] = {}
    for setting in others:
        eng.config.mixed_decode_attention = setting == "on"  # read by the runner at every step
        ab_probe = StepProbe(eng)
        again = run_requests(eng, random_prompts(args.w2_requests, args.prompt, vocab, 3), args.new, f"w2{setting}",
                             ab_probe)
        ab_probe.close()  # (restores the runner's methods before the next probe wraps them)
        r["w2_by_mixed_split"][setting] = mixed_split_summary(again)
        log(f"W2 with mixed split {setting}: {r['w2_by_mixed_split'][setting]}")
    eng.config.mixed_decode_attention = last == "on"
    probe = StepProbe(eng)
    threads0 = thread_cpu()
    variants0 = triton_variants()
    from stoker.ops.gpu_clock import ClockLog

    with ClockLog() as clocks:  # nvidia-smi's own process: the SM clock and power through W2
        w2 = run_requests(eng, random_prompts(args.w2_requests, args.prompt, vocab, 3), args.new, "w2", probe)
    r["w2_clock"] = clocks.summary()
    r["w2_by_mixed_split"][last] = mixed_split_summary(w2)
    r["triton_variants"] = {"before_w2": variants0, "after_w2": triton_variants()}
    r["w2_threads"] = busiest_threads(threads0, thread_cpu())
    r["w2_gpu"] = probe.close()
    w2.pop("stamps"), w2.pop("t0")
    r["w2"] = w2
    n, p_len, new = args.w2_requests, args.prompt, args.new
    attn = lambda ctx_sq: 2 * ctx_sq * mc.num_heads * mc.head_dim * mc.num_layers  # noqa: E731 (QK^T + PV)
    prefill_s = gemm_s(n * p_len) + n * attn(p_len * p_len) / rate
    decode_s = 0.0
    for step in range(new - 1):  # the first new token comes from the prefill
        ctx = p_len + step + 1
        decode_s += max(gemm_s(n) + n * 2 * attn(ctx) / rate, (weight_bytes + n * ctx * kv_per_token) / bw)
    r["w2"]["floor_s"] = prefill_s + decode_s
    r["w2"]["floor_note"] = f"all {n} sequences in every decode step (ideal batching)"
    log(f"W2 {r['w2']} gpu {r['w2_gpu']}")
    log(f"Triton variants {r['triton_variants']}")
    compiled = midrun_compiles(r)
    if compiled:
        log(f"!!! W2 COMPILED {sum(n for _, n in compiled.values())} TRITON VARIANT(S) MID-RUN (~1 s of host each, "
            f"inside steps: the W2 figure holds them): {compiled}")
    r["graph_replays"] = eng.runner.graphs.replays if eng.runner.graphs else 0
    if args.profile:
        if not args.skip_w1:
            profile_w1(eng, vocab, args.prompt)
        from stoker.ops.step_profile import profile_w2_steps

        prefill_tokens = min(args.w2_requests, eng.config.max_num_batched_tokens // args.prompt) * args.prompt
        r["w2_step_profile"] = profile_w2_steps(eng, vocab, args.w2_requests, args.prompt, prefill_tokens,
                                                os.environ.get("OUT") or ".", log)
        cprofile_w2(eng, vocab, args.w2_requests, args.prompt)
        # W2 again with one intra-op CPU thread: shows what torch's thread pool costs the host.
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        threads0 = thread_cpu()
        again = run_requests(eng, random_prompts(args.w2_requests, args.prompt, vocab, 3), args.new, "w2b")
        r["w2_one_thread"] = {
            k: again[k] for k in ("wall_s", "cpu_cores", "cpu_main_thread_s", "cpu_cores_second_half")
        }
        r["w2_one_thread"]["threads"] = busiest_threads(threads0, thread_cpu())
        torch.set_num_threads(threads)
        log(f"W2 threads {r['w2_threads']}; with 1 intra-op thread: {r['w2_one_thread']}")
    return finish(eng, r, args, path, decodes, quantization)


def midrun_compiles(r: dict[str, Any]) -> dict[str, tuple[int, int]]:
    """Kernels that compiled variants during W2 -> (variants before, new ones); empty when none did."""
    before, after = r["triton_variants"]["before_w2"], r["triton_variants"]["after_w2"]
    return {k: (before.get(k, 0), n - before.get(k, 0)) for k, n in after.items() if n > before.get(k, 0)}


def mixed_split_summary(w2: dict[str, Any]) -> dict[str, Any]:
    return {k: w2.get(k) for k in ("wall_s", "prefill_phase_s", "decode_phase_s", "cpu_cores")}


def measure_w1(eng, args: argparse.Namespace, vocab: int, floor_ms: float) -> tuple[dict[str, Any], dict[str, Any]]:
    """W1 on `eng` -> (TPOT, TTFT, tok/s, wall and floor; the GPU idle probe's figures)."""
    # Compile the prefill shapes, and a whole W1's worth of decode steps first: on a freshly started H200 the first
    # engine's first ~second of decode ran 6-8 % slow at full clocks (BENCHMARKS.md 2026-12-04, session 25), so a
    # 16-token warm-up left that in the figure.
    run_requests(eng, random_prompts(args.w1_batch, args.prompt, vocab, 1), args.new, "warm")
    probe = StepProbe(eng)
    from stoker.ops.gpu_clock import ClockLog

    with ClockLog() as clocks:  # W1's GPU clock too: the same code ran 3.93-4.25 ms on fresh H200s (session 25)
        w1 = run_requests(eng, random_prompts(args.w1_batch, args.prompt, vocab, 2), args.new, "w1")
    gpu = probe.close()
    st = w1.pop("stamps")
    return {
        "tpot_ms": (st[-1] - st[0]) / (len(st) - 1) * 1e3,
        "ttft_ms": (st[0] - w1.pop("t0")) * 1e3,
        "tok_s": w1["tok_s"],
        "wall_s": w1["wall_s"],
        "floor_ms": floor_ms,
        "batch": args.w1_batch,
        "clock": clocks.summary(),
    }, gpu


def w1_summary(w1: dict[str, Any], startup: dict[str, Any]) -> dict[str, Any]:
    return {"tpot_ms": w1["tpot_ms"], "x_floor": w1["tpot_ms"] / w1["floor_ms"], "ttft_ms": w1["ttft_ms"],
            "decode": startup.get("decode_kernels"), "graph_capture_s": startup.get("graph_capture_s"),
            "sm_mhz_median": w1.get("clock", {}).get("sm_mhz_median")}


def close_engine(eng) -> None:
    gc.unfreeze()  # a frozen engine's reference cycles (its graphs, modules) are never collected: GPU memory kept
    eng.close()  # tensor parallel: its rank processes hold the other GPUs
    gc.collect()
    torch.cuda.empty_cache()


def finish(eng, r: dict[str, Any], args: argparse.Namespace, path: str, decodes: list[str],
           quantization: str | None) -> int:
    """After W1 (and W2) of the first decode setting: W1 of each other setting on a fresh engine (the A/B),
    the transformers peer, the table and $OUT/bench.json."""
    close_engine(eng)
    for decode in decodes[1:]:
        log(f"W1 with --decode-kernels {decode}")
        eng, _ = start_engine(path, args.max_num_seqs, quantization=quantization,
                              tensor_parallel_size=args.tensor_parallel, kv_cache_dtype=args.kv_cache_dtype,
                              decode=decode, max_num_batched_tokens=args.max_num_batched_tokens,
                              load_format=args.load_format)
        w1, _ = measure_w1(eng, args, eng.model_config.vocab_size, r["w1"]["floor_ms"])
        r["w1_by_decode"].setdefault(decode, []).append(w1_summary(w1, eng.runner.startup))
        log(f"W1 {decode}: {r['w1_by_decode'][decode][-1]}")
        close_engine(eng)
    vocab = r["vocab"]
    if not args.skip_hf:
        log("transformers peer")
        try:
            r["hf"] = hf_peer(path, vocab, min(args.hf_w2_requests, args.w2_requests), args.prompt, args.new)
        except Exception as e:  # report, don't lose the rest of the run
            r["hf"] = {"error": f"{type(e).__name__}: {e}"[:300]}
        gc.collect()
        torch.cuda.empty_cache()
        log(f"HF {r['hf']}")
    print_table(r, args)
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "bench.json"), "w") as f:
            json.dump(r, f, indent=2, default=str)
    return 0


def w1_decode_rows(r: dict[str, Any]) -> list[tuple[str, ...]]:
    """One row per --decode-kernels setting (the A/B), when more than one engine ran: an item given several times
    (interleaved repeats) lists every run's figure in run order."""
    by: dict[str, list[dict[str, Any]]] = r.get("w1_by_decode", {})
    if sum(len(runs) for runs in by.values()) < 2:
        return []
    return [(f"W1 TPOT, decode {name}", ", ".join(f"{v['tpot_ms']:.3f}" for v in runs) + " ms",
             f"{r['w1']['floor_ms']:.2f} ms", "",
             ", ".join(f"{v['x_floor']:.3f}" for v in runs)
             + f"x floor; fused layers {(runs[0]['decode'] or {}).get('fused_layers')}"
             + ("; SM MHz " + ", ".join(f"{v['sm_mhz_median']:.0f}" if v.get("sm_mhz_median") else "-" for v in runs)
                if any(v.get("sm_mhz_median") for v in runs) else ""))
            for name, runs in by.items()]


def w2_rows(r: dict[str, Any], args: argparse.Namespace) -> list[tuple[str, ...]]:
    hf, w2, g = r.get("hf", {}), r["w2"], r["w2_gpu"]
    hf_w2 = hf.get("w2_tok_s")
    return [
        (
            f"W2 total ({args.w2_requests} x {args.prompt}+{args.new})",
            f"{w2['wall_s']:.2f} s",
            f"{w2['floor_s']:.2f} s",
            "",
            f"<= 1.4x floor: {w2['wall_s'] / w2['floor_s']:.2f}x",
        ),
        (
            "W2 output tok/s",
            f"{w2['tok_s']:.0f}",
            f"{w2['tokens'] / w2['floor_s']:.0f}",
            f"{hf_w2:.0f} (bs {hf.get('w2_batch')})"
            if hf_w2
            else str(hf.get("w2_error", hf.get("error", "-"))),
            f">= 6x HF: {w2['tok_s'] / hf_w2:.1f}x" if hf_w2 else "",
        ),
        (
            "W2 CPU (process cores)",
            f"{w2['cpu_cores']:.2f}",
            "",
            "",
            f"<= 0.3 (main thread {w2['cpu_main_thread_s'] / w2['wall_s']:.2f}; "
            f"second half of the steps {w2['cpu_cores_second_half']:.2f})",
        ),
        (
            "W2 prefill phase / decode phase",
            f"{w2.get('prefill_phase_s', float('nan')):.2f} s / {w2.get('decode_phase_s', float('nan')):.2f} s",
            "",
            "",
            f"process cores {w2.get('prefill_phase_cpu_cores', float('nan')):.2f} / "
            f"{w2.get('decode_phase_cpu_cores', float('nan')):.2f}; Triton compiles during W2: "
            f"{sum(r['triton_variants']['after_w2'].values()) - sum(r['triton_variants']['before_w2'].values())}",
        ),
        (
            "W2 Triton compiles mid-run",
            str(sum(n for _, n in midrun_compiles(r).values())),
            "",
            "",
            "must be 0" + "".join(f"; !!! {k} +{n} (had {b})" for k, (b, n) in midrun_compiles(r).items()),
        ),
        clock_row("W2", r.get("w2_clock", {})),
        (
            "W2 GPU idle between decode steps",
            f"{100 * g['idle_share']:.1f} %",
            "",
            "",
            f"< 5% ({g['decode_steps']} decode steps, mean gap {g['mean_gap_ms']:.2f} ms)",
        ),
    ]


def clock_row(workload: str, clock: dict[str, Any]) -> tuple[str, ...]:
    """The SM clock and power through W1 or W2 (ops/gpu_clock.py): the H200 runs W2 at its power cap, below the
    clock of the floors' burst; W1's clock says whether a slow W1 was a slow GPU."""
    label = f"{workload} SM clock / power (nvidia-smi)"
    if "sm_mhz_median" not in clock:
        return (label, "-", "", "", str(clock.get("error", "not sampled")))
    reasons = ", ".join(f"{k}: {n}" for k, n in clock["throttle_reasons"].items())
    return (label, f"{clock['sm_mhz_median']:.0f} MHz / {clock['power_w_median']:.0f} W",
            "", "", f"median of {clock['samples']}; clock p10-p90 {clock['sm_mhz_p10']:.0f}-{clock['sm_mhz_p90']:.0f}, "
            f"max {clock['sm_mhz_max']:.0f}; power max {clock['power_w_max']:.0f} W; throttle reasons {reasons} "
            "(0x4: SW power cap)")


def mixed_split_rows(r: dict[str, Any]) -> list[tuple[str, ...]]:
    """One row per --mixed-split setting, when more than one ran."""
    by = r.get("w2_by_mixed_split", {})
    if len(by) < 2:
        return []
    floor = r["w2"]["floor_s"]
    return [(f"W2, mixed split {name}", f"{v['wall_s']:.2f} s", f"{floor:.2f} s", "",
             f"{v['wall_s'] / floor:.3f}x floor; prefill / decode phase {v.get('prefill_phase_s') or float('nan'):.2f} / "
             f"{v.get('decode_phase_s') or float('nan'):.2f} s; CPU {v['cpu_cores']:.2f}") for name, v in by.items()]


def w1_rows(r: dict[str, Any], hf: dict[str, Any]) -> list[tuple[str, ...]]:
    """W1's rows (none under --skip-w1)."""
    if "w1" not in r:
        return []
    w1 = r["w1"]
    return [
        (
            f"W1 TPOT (bs {w1.get('batch', 1)}, 512+256)",
            f"{w1['tpot_ms']:.2f} ms",
            f"{w1['floor_ms']:.2f} ms",
            f"{hf.get('w1_tpot_ms', float('nan')):.2f} ms",
            f"<= 1.10x floor: {w1['tpot_ms'] / w1['floor_ms']:.2f}x",
        ),
        (
            "W1 tok/s",
            f"{w1['tok_s']:.1f}",
            f"{1e3 / w1['floor_ms']:.1f}",
            f"{hf.get('w1_tok_s', float('nan')):.1f}",
            f"TTFT {w1['ttft_ms']:.0f} ms",
        ),
        (
            "W1 GPU idle between decode steps",
            f"{100 * r['w1_gpu']['idle_share']:.1f} %",
            "",
            "",
            f"GPU busy {r['w1_gpu']['decode_busy_ms'] / max(1, r['w1_gpu']['decode_steps']):.2f} ms/step, "
            f"mean gap {r['w1_gpu']['mean_gap_ms']:.2f} ms",
        ),
        clock_row("W1", w1.get("clock", {})),
    ]


def print_table(r: dict[str, Any], args: argparse.Namespace) -> None:
    hf = r.get("hf", {})
    ws = r["warm_startup"]
    rows = [
        ("floor: read bandwidth", f"{r['floors']['bandwidth_Bps'] / 1e12:.2f} TB/s", "", "", ""),
        ("floor: bf16 matmul 8192^3", f"{r['floors']['matmul_flops'] / 1e12:.0f} TFLOP/s", "", "", ""),
        *([("floor: fp8 matmul 8192^3 (row-wise)", f"{r['floors']['fp8_matmul_flops'] / 1e12:.0f} TFLOP/s", "", "",
            "")] if "fp8_matmul_flops" in r["floors"] else []),
        *w1_rows(r, hf),
        *w1_decode_rows(r),
        *(w2_rows(r, args) if "w2" in r else []),
        *([("W2 token budget per step (--max-num-batched-tokens)", str(args.max_num_batched_tokens), "", "", "")]
          if "w2" in r else []),
        *mixed_split_rows(r),
        (
            "W3 weights on GPU (warm)",
            f"{ws.get('load_s', 0):.2f} s",
            "",
            f"HF load {hf.get('load_s', float('nan')):.1f} s",
            f"< 2 s ({ws.get('gb_per_s', 0):.1f} GB/s)" if ws.get("load_format") != "dummy"
            else "--load-format dummy: random weights made on the GPU, not a load",
        ),
        (
            "W3 graph capture",
            f"{ws.get('graph_capture_s', 0):.2f} s",
            "",
            "",
            f"{len(ws.get('graph_buckets', []))} buckets",
        ),
        ("W3 ready (warm)", f"{r['warm_ready_s']:.2f} s", "", "", "< 6 s"),
    ]
    if "cold_ready_s" in r:
        rows.append(
            (
                "W3 ready (cold, first start)",
                f"{r['cold_ready_s']:.2f} s",
                "",
                "",
                f"weights {r['cold_startup'].get('load_s', 0):.2f} s; page cache dropped: {r['page_cache_dropped']}",
            )
        )
    widths = [
        max(len(str(row[i])) for row in rows + [("figure", "ours", "floor", "transformers", "target")])
        for i in range(5)
    ]
    line = lambda cells: "| " + " | ".join(str(c).ljust(w) for c, w in zip(cells, widths, strict=True)) + " |"  # noqa: E731
    print(line(("figure", "ours", "floor", "transformers", "target / note")))
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for row in rows:
        print(line(row))


if __name__ == "__main__":
    sys.exit(main())
