"""The engine's root config: one dataclass, validated once, each component takes its part."""

from __future__ import annotations

import os
from dataclasses import dataclass

_DTYPES = ("float32", "float16", "bfloat16")
LOAD_FORMATS = ("auto", "dummy")
KV_CACHE_DTYPES = ("auto", "fp8")  # auto = the model dtype; fp8 = float8_e4m3fn (engine/kernels/kv_quant.py)
TP_ALL_REDUCES = ("nccl", "symm-mem")  # EngineConfig.tensor_parallel_all_reduce
# How decode steps of <= 16 sequences multiply (engine/models/fused_decode.py); see EngineConfig.decode_kernels.
DECODE_KERNELS = ("auto", "fused", "fused-folded", "cublas")


@dataclass(slots=True)
class EngineConfig:
    model_path: str
    model_name: str | None = None  # served name; None = the model folder's name
    device: str | None = None  # None = "cuda" when available, else "cpu"
    dtype: str | None = None  # None = bfloat16 on CUDA, float32 on CPU
    block_size: int = 16  # tokens per KV block
    num_kv_blocks: int | None = None  # None = as many as the memory budget allows
    kv_cache_memory_bytes: int | None = None  # explicit KV budget; CPU default 256 MiB
    gpu_memory_utilization: float = 0.9  # on CUDA without an explicit budget: share of the GPU we may fill
    # On CUDA: this model's own share of the GPU's total memory for its weights + KV cache (+ activation
    # reserve), independent of what else is loaded, so several engines can share one GPU. None = the
    # gpu_memory_utilization rule. Ignored on the CPU (kv_cache_memory_bytes applies there).
    gpu_memory_share: float | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    max_model_len: int | None = None  # None = the model's max_position_embeddings
    enable_prefix_caching: bool = True
    seed: int | None = None  # seeds the draw of per-request seeds for unseeded requests
    cuda_graphs: bool = True  # on CUDA: capture decode steps per batch bucket at startup (cuda_graphs.py)
    # Overlapped steps (engine.step): schedule and launch step N+1 before reading step N's tokens.
    # None = on for CUDA, off on the CPU (where a step's outputs then come back from the same step() call).
    async_scheduling: bool | None = None
    use_triton: bool = True  # False: the plain-torch kernel references everywhere (A/B runs, debugging)
    # On CUDA: host waits on the GPU sleep (blocking-sync context flag) instead of spinning a core;
    # False keeps CUDA's default scheduling (A/B runs). See model_runner._blocking_sync.
    blocking_sync: bool = True
    # "fp8": quantize an unquantized checkpoint's linears to FP8 at load (per output row; lm_head stays). An FP8
    # checkpoint (quantization_config in config.json) runs as FP8 without it. None = as the checkpoint is.
    quantization: str | None = None
    # "auto": the model folder's *.safetensors. "dummy": random weights made on the device instead (as vLLM's
    # --load-format dummy): only config.json and the tokenizer are read, for benchmarks and smoke tests of shapes
    # whose checkpoint is not at hand (engine/dummy_load.py). An FP8 checkpoint's config is refused with it.
    load_format: str = "auto"
    # Ranks (processes, one GPU each) the model is split over; > 1 spawns ranks 1.. beside this process
    # (engine/parallel). Whether the model's heads divide is checked when the model's config is read.
    tensor_parallel_size: int = 1
    # Every rank on the first visible GPU, the forward's all-reduces over gloo (through host memory: NCCL refuses two
    # ranks on one device): for developing and testing tensor parallelism on a machine with one GPU, never faster
    # than one rank. Needs cuda_graphs=False (a graph cannot capture a gloo collective) and num_kv_blocks or
    # kv_cache_memory_bytes (each rank would size its KV cache from the same GPU's free memory).
    tensor_parallel_shared_gpu: bool = False
    # The forward's all-reduces at tensor_parallel_size > 1 on CUDA: "nccl" (captured in the decode graphs), or
    # "symm-mem": steps of up to 16 tokens (the fused decode path's) through the one-shot all-reduce over symmetric
    # memory (engine/parallel/symm_mem.py: one kernel reading every peer's copy, no multicast), larger ones NCCL.
    # Not yet measured, and a rank that dies while its peers wait inside a one-shot all-reduce is not yet handled:
    # their kernel waits on its signal with no timeout (NCCL's waits are aborted by the launcher's watchdog).
    tensor_parallel_all_reduce: str = "nccl"
    # "fp8": the KV cache in float8_e4m3fn with per-layer k/v scales (the checkpoint's, else 1.0): half the bytes,
    # twice the blocks in the same budget. "auto": the model dtype.
    kv_cache_dtype: str = "auto"
    # Decode steps of <= 16 sequences (a CUDA-graph bucket takes its branch at capture): "fused" = the Triton
    # GEMVs with the rotary + KV-cache write, SiLU-mul and residual-add epilogues (engine/models/fused_decode.py);
    # "fused-folded" = the same with the RMSNorm weights folded into qkv / gate_up at load and the norm in their
    # prologue (no RMSNorm launches; BENCHMARKS.md); "cublas" = the unfused kernels (F.linear); "auto" =
    # "fused-folded" on CUDA with Triton, "cublas" otherwise. FP8 tensor-parallel linears keep their path.
    decode_kernels: str = "auto"
    # The fused decode chain (GEMVs, norm kernels and the decode attention) launched with programmatic dependent
    # launch, each kernel's successor let in early (gemv.py's pdl). None: on for layers with FP8 weights, off for the
    # others. On the H200 (8B, W1, BENCHMARKS.md): FP8 2.722 vs 2.810 ms (session 15, two interleaved runs a side);
    # bf16 4.46 vs 4.26 ms (2026-12-01 21:07 UTC: the graph's plain chain has no launch gap left to hide; 4.39 vs 4.19
    # with session 17's norm kernels); the fused MLP, which FP8 layers do not take, launched with PDL measured slower
    # too (4.11-4.13 vs 4.06 ms, session 19). True / False: every layer (True: the fused MLP with PDL as well). With
    # None, bf16's attention -> o_proj boundary at one token still takes PDL (fused_decode.O_PROJ_PDL); False turns
    # that off too.
    decode_pdl: bool | None = None
    # With decode_kernels fused / fused-folded, the fused decode steps (1-16 tokens) run each layer's MLP as one kernel
    # streaming gate_up and down into a float32 accumulator (atomic adds), plus a small finishing kernel
    # (engine/kernels/fused_mlp.py), instead of two GEMVs: W1 -2.2 % at 8B (H200), and 11-53 us less a layer at 2-16
    # tokens; repeatable up to rounding only. False: the two GEMVs, bit for bit. FP8 weights keep the GEMVs. With
    # fused-folded it is what carries the norms across layers (fused_decode.FOLDED_NORM_CARRY).
    decode_fused_mlp: bool = True
    # Fused decode steps of up to this many tokens run the RMSNorms in the qkv / MLP prologues (fused-folded, and
    # FP8 under it); larger ones run the norm kernel first (the RMSNorm modules: unit gains where g is folded in).
    # The prologue's rms pass (kernels/gemv._row_sumsq) reads x one row at a time, an L2 round trip and a block
    # reduction each, in every program: on the H200 (session 13, 8B, M = 16, us a call) qkv + rotary took 35.0 with
    # the pass against 15.9 without it, and the fused MLP 108.0 at M = 16 against 86.8 at M = 1, where a norm kernel
    # costs ~2.8 us with its boundary (session 5) and the pass ~1.2 us a row. So the pass pays at 1-2 tokens (the
    # graph buckets 1 and 2) and the norm kernel from 4. W1 at N requests (8B, ms a step, this cap against the other
    # side; H200, session 14, ops/bench.py --w1-batch N --decode-kernels auto,auto+proN): N = 2 4.471 vs 4.496 with
    # the norm kernel (pro0); N = 4 4.684 vs 4.755 with the prologues (pro16); N = 8 5.073 vs 5.377; N = 16 5.728
    # vs 6.440.
    decode_prologue_norm_max_m: int = 2
    # Two-nano-batch decode (engine/models/nano_batches.py): decode-only steps of >= decode_overlap_min_rows
    # sequences run as two halves whose GEMMs and attention interleave on two CUDA streams (in the graphs).
    # Off: measured 3.7 % slower at batch 1,024 and 13 % at 512 (8B, H200; BENCHMARKS.md, 14:44 UTC), and 3.6 %
    # slower at 1,024 sustained under the 700 W cap (2026-12-04 18:50 UTC).
    decode_overlap: bool = False
    decode_overlap_min_rows: int = 512
    # With decode_overlap on CUDA: > 0 splits the SMs instead of sharing them: attention on this many
    # persistent programs (one per SM), the GEMMs at cuBLAS's SM target of the rest.
    decode_overlap_sms: int = 0
    # Mixed steps (decodes beside prompt chunks, run eagerly): the decode rows' attention through the decode
    # kernel and only the prompt chunks through the prefill kernel, whose 64-row query tiles would otherwise
    # hold one decode query (x its GROUP heads) each (H200, W2 engine alone: 24.58 -> 24.25 s, and no more
    # alternating 20 / 380 ms step returns; BENCHMARKS.md 18:20 UTC). False: the whole batch through the prefill kernel.
    mixed_decode_attention: bool = True
    # With cuda_graphs: a step that is one sequence's prompt chunk alone (a request arriving at an idle engine)
    # of <= this many tokens replays a graph captured at startup instead of ~330 eager launches
    # (engine/prefill_graphs.py; capped at max_num_batched_tokens and max_model_len). 0: eager. H200, 8B, a lone
    # 512-token prompt (ops/ttft_probe.py, 21:09 UTC): TTFT p50 19.4 ms (15.8-31.4) eager, 12.4 ms (12.2-12.7)
    # replayed; the eager step's launch took 18.3 ms of host for 11.0 ms of kernels. Capture: 12 buckets, 0.38 s.
    prefill_graph_tokens: int = 1024
    # With cuda_graphs: every other step with prompt tokens (several prompts, prompt chunks beside decode rows) of
    # <= this many tokens replays per-layer graphs with the attentions launched eagerly between them
    # (engine/piecewise_graphs.py; capped at max_num_batched_tokens). 0: eager. H200, 8B: W2's 8,192-token prefill
    # step cost the host 27.3 ms of CPU eagerly (ops/step_profile.py, session 11).
    piecewise_graph_tokens: int = 8192

    def __post_init__(self) -> None:
        problems = []
        if not os.path.isdir(self.model_path):
            problems.append(
                f"model_path {self.model_path!r} is not a directory (expected a Hugging Face model folder)"
            )
        if self.model_name is None:
            self.model_name = os.path.basename(os.path.normpath(self.model_path))
        if self.device is None:
            import torch

            self.device = "cuda" if torch.cuda.is_available() else "cpu"
        if not (self.device == "cpu" or self.device.startswith("cuda")):
            problems.append(f"device must be 'cpu' or 'cuda[:N]', got {self.device!r}")
        elif self.device.startswith("cuda:") and self.device != "cuda:0":
            # CUDA graphs, Triton launches and the caching allocator follow the thread's current device, and
            # the engine is built on one thread and stepped on another: GPU N > 0 is untested, so refused.
            problems.append(f"device {self.device!r}: pick the GPU with CUDA_VISIBLE_DEVICES=N and device 'cuda' "
                            "(one worker per GPU); 'cuda:N' with N > 0 is not supported")
        if self.dtype is None:
            self.dtype = "float32" if self.device == "cpu" else "bfloat16"
        if self.load_format not in LOAD_FORMATS:
            problems.append(f"load_format must be one of {LOAD_FORMATS}, got {self.load_format!r}")
        if self.dtype not in _DTYPES:
            problems.append(f"dtype must be one of {_DTYPES}, got {self.dtype!r}")
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            problems.append(f"block_size must be a power of two >= 1, got {self.block_size}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            problems.append(f"num_kv_blocks must be >= 1 or None, got {self.num_kv_blocks}")
        if self.kv_cache_memory_bytes is not None and self.kv_cache_memory_bytes < 1:
            problems.append(f"kv_cache_memory_bytes must be >= 1 or None, got {self.kv_cache_memory_bytes}")
        if not 0 < self.gpu_memory_utilization <= 1:
            problems.append(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.gpu_memory_share is not None and not 0 < self.gpu_memory_share <= 1:
            problems.append(f"gpu_memory_share must be in (0, 1] or None, got {self.gpu_memory_share}")
        if self.max_num_seqs < 1:
            problems.append(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            problems.append(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.max_model_len is not None and self.max_model_len < 2:
            problems.append(f"max_model_len must be >= 2 or None, got {self.max_model_len}")
        if self.quantization not in (None, "fp8"):
            problems.append(f"quantization must be 'fp8' or None, got {self.quantization!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            problems.append(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}")
        problems += self._decode_kernel_problems()
        if not 0 <= self.decode_prologue_norm_max_m <= 16:
            problems.append(f"decode_prologue_norm_max_m must be 0..16 (the fused decode steps' token counts), "
                            f"got {self.decode_prologue_norm_max_m}")
        if self.decode_overlap_min_rows < 2:
            problems.append(f"decode_overlap_min_rows must be >= 2 (two non-empty halves), "
                            f"got {self.decode_overlap_min_rows}")
        if self.decode_overlap_sms < 0:
            problems.append(f"decode_overlap_sms must be >= 0 (0 = the lanes share every SM), got {self.decode_overlap_sms}")
        if self.decode_overlap and self.tensor_parallel_size > 1:
            # Each half's o_proj / down all-reduce would run beside the other half's on a second stream.
            problems.append("decode_overlap is untested with tensor_parallel_size > 1: turn one of them off")
        if self.piecewise_graph_tokens < 0:
            problems.append(f"piecewise_graph_tokens must be >= 0 (0 = batch steps run eagerly), "
                            f"got {self.piecewise_graph_tokens}")
        if self.prefill_graph_tokens < 0:
            problems.append(f"prefill_graph_tokens must be >= 0 (0 = prefill steps run eagerly), "
                            f"got {self.prefill_graph_tokens}")
        if self.tensor_parallel_all_reduce not in TP_ALL_REDUCES:
            problems.append(f"tensor_parallel_all_reduce must be one of {TP_ALL_REDUCES}, "
                            f"got {self.tensor_parallel_all_reduce!r}")
        if self.tensor_parallel_size < 1:
            problems.append(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        elif self.tensor_parallel_shared_gpu:
            problems += self._shared_gpu_problems()
        elif self.tensor_parallel_size > 1 and self.device.startswith("cuda"):
            import torch

            if torch.cuda.device_count() < self.tensor_parallel_size:
                problems.append(f"tensor_parallel_size={self.tensor_parallel_size} needs that many GPUs; "
                                f"{torch.cuda.device_count()} visible (CUDA_VISIBLE_DEVICES picks them)")
        if problems:
            raise ValueError("EngineConfig: " + "; ".join(problems))

    def _shared_gpu_problems(self) -> list[str]:
        if self.device is None or not self.device.startswith("cuda"):
            return [f"tensor_parallel_shared_gpu puts the ranks on one GPU; the device is {self.device!r} (on the CPU the "
                    "ranks share the host anyway: leave it off)"]
        problems = []
        if self.cuda_graphs:
            problems.append("tensor_parallel_shared_gpu runs the all-reduces over gloo, which a CUDA graph cannot "
                            "capture: set cuda_graphs=False")
        if self.num_kv_blocks is None and self.kv_cache_memory_bytes is None:
            problems.append("tensor_parallel_shared_gpu: every rank would size its KV cache from the same GPU's free "
                            "memory: give num_kv_blocks or kv_cache_memory_bytes")
        return problems

    def _decode_kernel_problems(self) -> list[str]:
        if self.decode_kernels not in DECODE_KERNELS:
            return [f"decode_kernels must be one of {DECODE_KERNELS}, got {self.decode_kernels!r}"]
        if not self.decode_kernels.startswith("fused"):
            return []
        if not self.use_triton:
            return [f"decode_kernels={self.decode_kernels!r} runs Triton kernels: drop use_triton=False "
                    "(--no-triton) or pick 'cublas'"]
        # Triton itself reads TRITON_INTERPRET from the environment: its CPU interpreter runs the kernels in tests.
        if self.device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
            return [f"decode_kernels={self.decode_kernels!r} needs a CUDA device (or TRITON_INTERPRET=1, the "
                    "Triton interpreter the CPU tests use); on the CPU pick 'auto' or 'cublas'"]
        return []

    @property
    def torch_dtype(self):  # -> torch.dtype (torch imported lazily: this module stays cheap)
        import torch

        return getattr(torch, self.dtype)  # type: ignore[arg-type]
