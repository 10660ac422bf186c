"""The worker's one root config, validated at construction. The environment and the command line are read
only in worker.main; tests build a WorkerConfig directly."""

from __future__ import annotations

import os
import re
import socket
import uuid
from dataclasses import dataclass, field

from stoker.schemas.codec import DEFAULT_MAX_MESSAGE_BYTES
from stoker.schemas.names import (
    DEFAULT_MAX_ATTEMPTS,
    DEFAULT_TTL_S,
    JOBS_TOPIC,
    REDIS_PREFIX,
    Names,
    default_batch_topic,
    default_dlq_topic,
)
from stoker.worker.admission import parse_weights
from stoker.worker.model_specs import ModelSpec, check_model_set
from stoker.worker.tenant_limits import TenantLimits, parse_limits


def default_worker_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


@dataclass(slots=True)
class WorkerConfig:
    # Engine
    model: str | None = None  # model folder (Hugging Face layout); None only with fake_engine
    served_model_name: str | None = None  # the name jobs may ask for; None = the engine's (folder name)
    # Several models (worker/model_specs.py): every model, the first being the default; empty = the one `model`
    models: tuple[ModelSpec, ...] = ()
    model_idle_unload_s: float | None = None  # unload a model with no job this long; None = never
    fake_engine: bool = False  # the deterministic stand-in (benchmarks, tests)
    fake_step_delay_s: float = 0.0  # stand-in only: time one step takes
    fake_hang_after_steps: int = 0  # stand-in only: its step after this many never returns (a hung GPU); 0 = never
    device: str | None = None  # "cuda", "cpu"; None = cuda when available
    kv_cache_memory_bytes: int | None = None  # memory budget for the KV cache; None = the engine's default
    max_num_seqs: int = 256  # requests in the running batch at most
    max_model_len: int | None = None
    dtype: str | None = None  # float32 | float16 | bfloat16; None = bfloat16 on CUDA, float32 on CPU
    quantization: str | None = None  # "fp8": quantize an unquantized checkpoint at load (EngineConfig's field)
    load_format: str = "auto"  # "dummy": random weights from config.json alone (EngineConfig.load_format)
    tensor_parallel: int = 1  # GPUs (ranks) the model is split over (EngineConfig.tensor_parallel_size)
    tensor_parallel_all_reduce: str = "nccl"  # nccl | symm-mem (EngineConfig.tensor_parallel_all_reduce)
    kv_cache_dtype: str = "auto"  # "fp8": the FP8 KV cache (EngineConfig.kv_cache_dtype)
    decode_kernels: str = "auto"  # auto | fused | fused-folded | cublas (EngineConfig.decode_kernels)
    decode_pdl: bool = False  # the fused decode kernels with programmatic dependent launch in every layer
    no_decode_pdl: bool = False  # ... in none (neither: FP8-weight layers only, EngineConfig.decode_pdl None)
    no_decode_fused_mlp: bool = False  # small-batch decode MLPs as two GEMVs (EngineConfig.decode_fused_mlp off)
    decode_prologue_norm_max_m: int = 2  # steps normalising in the GEMV prologues (EngineConfig's field)
    prefill_graph_tokens: int = 1024  # a lone prompt chunk of <= this many tokens as a CUDA graph (EngineConfig's)
    piecewise_graph_tokens: int = 8192  # other prompt steps: per-layer CUDA graphs up to this many tokens
    block_size: int = 16  # tokens per KV block (a power of two)
    num_kv_blocks: int | None = None  # None = as many as the memory budget allows
    gpu_memory_utilization: float = 0.9  # share of the GPU the engine may fill (without kv_cache_memory_bytes)
    max_num_batched_tokens: int = 8192  # tokens per engine step: lower = steadier inter-token latency
    seed: int | None = None  # seeds the per-request seeds of unseeded requests
    no_prefix_caching: bool = False
    no_cuda_graphs: bool = False
    no_async_scheduling: bool = False  # step synchronously (no overlap of host work with the GPU's)
    no_triton: bool = False  # the plain-torch kernel references (A/B runs, debugging)
    no_blocking_sync: bool = False  # keep CUDA's spinning host waits (A/B runs)
    no_warmup: bool = False  # skip running every serving path once before ready (engine/warmup.py)
    # Kafka
    bootstrap_servers: str = "127.0.0.1:9092"
    job_topic: str = JOBS_TOPIC
    dlq_topic: str = ""  # empty = job_topic + ".dlq"
    group_id: str = "stoker-workers"
    security_protocol: str = "PLAINTEXT"  # PLAINTEXT | SSL | SASL_PLAINTEXT | SASL_SSL
    sasl_mechanism: str | None = None  # PLAIN | SCRAM-SHA-256 | SCRAM-SHA-512
    sasl_username: str | None = None
    sasl_password: str | None = None
    ssl_cafile: str | None = None
    ssl_certfile: str | None = None
    ssl_keyfile: str | None = None
    max_poll_records: int = 64
    # Priority classes and tenants (worker.admission, worker.tenant_limits; README "Tenants and priority classes")
    batch_topic: str = ""  # empty = job_topic + ".batch" (read when it exists)
    no_batch_topic: bool = False  # read the job topic alone
    batch_weight: float = 0.1  # batch admissions per live one while both wait; 0 = batch only when no live waits
    max_backlog_bytes: int = 64 << 20  # jobs read ahead of the engine, in bytes (an estimate of what they hold)
    batch_backlog_share: float = 0.75  # of max_backlog_bytes the batch class may fill: the rest is kept for live
    tenant_weight: tuple[str, ...] = ()  # TENANT=WEIGHT: shares of recent tokens (default 1)
    tenant_share_half_life_s: float = 60.0  # how fast a tenant's recent tokens are forgotten
    tenant_max_running: tuple[str, ...] = ()  # TENANT=N ('*' = each tenant without its own): across workers
    tenant_tokens_per_minute: tuple[str, ...] = ()  # TENANT=N: prompt + completion tokens, across workers
    tenant_burst_s: float = 60.0  # a tenant's token bucket holds this many seconds of its rate
    # Redis
    redis_url: str = "redis://127.0.0.1:6379/0"  # rediss:// for TLS
    redis_password: str | None = None  # overrides the URL's
    redis_ca_certs: str | None = None
    prefix: str = REDIS_PREFIX
    ttl_s: int = DEFAULT_TTL_S  # stream, result key
    # Least cap per request stream; the worker raises it to fit its longest request (Worker.stream_cap)
    stream_maxlen: int = 10_000
    claim_ttl_s: float = 10.0
    # A job that wakes an idle engine is claimed once the engine's step has launched it, waiting at most this
    # long (Worker._until_launched; 0: claim at once). With the prefill step replayed as a CUDA graph its step()
    # returns soon after the add, and W1's TTFT on the H200 was 1.0 ms lower with 5 ms than with 0 (16.16 vs
    # 17.18 ms p50, 56 lone requests each, BENCHMARKS.md 2026-12-02); before those graphs the wait only moved
    # the claim into that step, and it was off.
    claim_after_launch_s: float = 0.005
    # The engine thread waits at most this long for a step's first tokens to be published before its next
    # step (EngineDriver._let_first_tokens_out; overlapped engines; 0: never)
    first_token_wait_s: float = 0.002
    # Unreachable this long, the worker leaves the consumer group so others take its partitions
    redis_outage_leave_s: float = 60.0
    attempts_ttl_s: int = 86_400
    max_attempts: int = DEFAULT_MAX_ATTEMPTS
    # Intake and shutdown
    max_waiting: int | None = None  # requests queued in the engine beyond the batch; None = max_num_seqs
    min_free_kv_fraction: float = 0.02  # pause intake below this share of free KV blocks
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    drain_timeout_s: float = 30.0
    # One engine step running longer than this is a hung GPU (or a tensor-parallel peer gone inside a one-shot
    # all-reduce, which nothing interrupts): the worker hands its jobs back and exits 1 instead of renewing their
    # claims forever. 0 = never. A step is milliseconds; the generous default leaves room for a cold Triton
    # compile or a model loading inside a step (SGLang's watchdog default is the same 300 s).
    step_stall_timeout_s: float = 300.0
    # Several models in one worker: a model's load (on demand, after an idle unload) running longer than this is
    # as stuck; a step of another model waiting for that load does not count against step_stall_timeout_s.
    # 0 = never.
    model_load_timeout_s: float = 1800.0
    # Structured output (worker.grammar_gate): a response_format not compiled yet compiles on one of these
    # threads; one that takes longer ends its request with `invalid_response_format`
    grammar_compile_threads: int = 2
    grammar_compile_timeout_s: float = 5.0
    # Operations
    worker_id: str = field(default_factory=default_worker_id)
    metrics_host: str = "0.0.0.0"
    metrics_port: int = 9400  # 0 = pick a free port, -1 = off
    switch_interval_s: float = 0.0005  # sys.setswitchinterval, set by worker.main (see there why)
    max_tenant_labels: int = 100  # distinct `tenant` metric labels; later tenants count as "other"
    log_prompts: bool = False
    debug_stages: bool = False  # GET /stages on the health port (it lists request ids: off unless asked for)
    log_level: str = "INFO"
    log_format: str = "kv"  # kv | json

    def __post_init__(self) -> None:
        problems = []
        if self.models and not self.model:
            self.model = self.models[0].path  # readers of `model` see the default model's folder
        if not self.fake_engine and not self.model:
            problems.append("no model: set --model / STOKER_MODEL to a model folder (or STOKER_FAKE_ENGINE=1)")
        problems += self._model_set_problems()
        if self.max_num_seqs < 1:
            problems.append(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.decode_pdl and self.no_decode_pdl:
            problems.append("--decode-pdl and --no-decode-pdl contradict each other: give one or neither")
        # The engine checks its settings again (EngineConfig); these fail before the model loads.
        if self.tensor_parallel < 1:
            problems.append(f"--tensor-parallel must be >= 1, got {self.tensor_parallel}")
        if self.tensor_parallel_all_reduce not in ("nccl", "symm-mem"):
            problems.append(f"--tensor-parallel-all-reduce must be nccl or symm-mem, "
                            f"got {self.tensor_parallel_all_reduce!r}")
        if self.quantization not in (None, "fp8"):
            problems.append(f"quantization must be fp8 or unset, got {self.quantization!r}")
        if self.load_format not in ("auto", "dummy"):
            problems.append(f"--load-format must be auto or dummy, got {self.load_format!r}")
        if self.kv_cache_dtype not in ("auto", "fp8"):
            problems.append(f"--kv-cache-dtype must be auto or fp8, got {self.kv_cache_dtype!r}")
        if self.decode_kernels not in ("auto", "fused", "fused-folded", "cublas"):
            problems.append(f"--decode-kernels must be auto, fused, fused-folded or cublas, got {self.decode_kernels!r}")
        if self.dtype not in (None, "float32", "float16", "bfloat16"):
            problems.append(f"dtype must be float32, float16 or bfloat16, got {self.dtype!r}")
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            problems.append(f"block_size must be a power of two >= 1, got {self.block_size}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            problems.append(f"num_kv_blocks must be >= 1, got {self.num_kv_blocks}")
        if not 0 < self.gpu_memory_utilization <= 1:
            problems.append(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.max_num_batched_tokens < 1:
            problems.append(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.max_waiting is None:
            self.max_waiting = self.max_num_seqs
        if self.max_waiting < 1:
            problems.append(f"max_waiting must be >= 1, got {self.max_waiting}")
        if not 0 <= self.min_free_kv_fraction < 1:
            problems.append(f"min_free_kv_fraction must be in [0, 1), got {self.min_free_kv_fraction}")
        if self.max_poll_records < 1:
            problems.append(f"max_poll_records must be >= 1, got {self.max_poll_records}")
        if self.security_protocol not in ("PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL"):
            problems.append(f"security_protocol must be PLAINTEXT, SSL, SASL_PLAINTEXT or SASL_SSL, got "
                            f"{self.security_protocol!r}")
        if self.security_protocol.startswith("SASL") and not self.sasl_mechanism:
            problems.append(f"security_protocol {self.security_protocol} needs a sasl_mechanism")
        if not self.redis_url.startswith(("redis://", "rediss://", "unix://")):
            problems.append(f"redis_url must start with redis://, rediss:// or unix://, got {self.redis_url!r}")
        for name in ("ttl_s", "stream_maxlen", "attempts_ttl_s", "max_attempts", "max_message_bytes"):
            if getattr(self, name) < 1:
                problems.append(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_tenant_labels < 0:
            problems.append(f"max_tenant_labels must be >= 0 (0: every tenant counts as other), got "
                            f"{self.max_tenant_labels}")
        if not 0 <= self.first_token_wait_s <= 0.1:
            problems.append(f"first_token_wait_s must be in [0, 0.1] seconds, got {self.first_token_wait_s}")
        if not 0 <= self.claim_after_launch_s <= 1:
            problems.append(f"claim_after_launch_s must be in [0, 1] seconds, got {self.claim_after_launch_s}")
        if self.claim_ttl_s < 1:
            problems.append(f"claim_ttl_s must be >= 1 s (renewed every third of it), got {self.claim_ttl_s}")
        if self.redis_outage_leave_s <= 0:
            problems.append(f"redis_outage_leave_s must be > 0, got {self.redis_outage_leave_s}")
        if self.grammar_compile_threads < 1:
            problems.append(f"grammar_compile_threads must be >= 1, got {self.grammar_compile_threads}")
        if self.grammar_compile_timeout_s <= 0:
            problems.append(f"grammar_compile_timeout_s must be > 0 seconds, got {self.grammar_compile_timeout_s}")
        if self.drain_timeout_s < 0:
            problems.append(f"drain_timeout_s must be >= 0, got {self.drain_timeout_s}")
        if self.step_stall_timeout_s < 0:
            problems.append(f"step_stall_timeout_s must be >= 0 (0 = never), got {self.step_stall_timeout_s}")
        if self.model_load_timeout_s < 0:
            problems.append(f"model_load_timeout_s must be >= 0 (0 = never), got {self.model_load_timeout_s}")
        if self.fake_hang_after_steps < 0:
            problems.append(f"fake_hang_after_steps must be >= 0, got {self.fake_hang_after_steps}")
        if not 0 < self.switch_interval_s <= 0.1:
            problems.append(f"switch_interval_s must be in (0, 0.1] seconds, got {self.switch_interval_s}")
        if not -1 <= self.metrics_port <= 65535:
            problems.append(f"metrics_port must be -1 (off), 0 (any) or a port, got {self.metrics_port}")
        if self.log_format not in ("kv", "json"):
            problems.append(f"log_format must be kv or json, got {self.log_format!r}")
        if not self.worker_id or any(c.isspace() for c in self.worker_id):
            problems.append(f"worker_id must be non-empty without whitespace, got {self.worker_id!r}")
        problems += self._tenancy_problems()
        try:
            self.names  # noqa: B018 -- validates the prefix and topic names
        except ValueError as exc:
            problems.append(str(exc))
        if problems:
            raise ValueError("invalid worker config: " + "; ".join(problems))

    def model_specs(self) -> list[ModelSpec]:
        """The models to serve, first = default: `models`, else the single `model` of old (empty: fake engine)."""
        if self.models:
            return list(self.models)
        return [ModelSpec(self.model, self.served_model_name)] if self.model else []

    def _model_set_problems(self) -> list[str]:
        problems = check_model_set(self.model_specs())
        if self.models and self.served_model_name:
            problems.append("served_model_name names the single model: with several, give each a name= instead")
        if self.model_idle_unload_s is not None and self.model_idle_unload_s <= 0:
            problems.append(f"model_idle_unload_s must be > 0 seconds (or unset: never), got {self.model_idle_unload_s}")
        # Each engine of a ModelSet would start its own rank processes on the same first N GPUs, and memory=
        # shares are not split per rank: untested, so refused rather than left to fail at load.
        if self.tensor_parallel > 1 and len(self.models) > 1:
            problems.append(f"--tensor-parallel {self.tensor_parallel} serves one model per worker, got "
                            f"{len(self.models)} models: run one worker per model (each with its own --job-topic "
                            "and --group-id), or drop --tensor-parallel")
        return problems

    def _tenancy_problems(self) -> list[str]:
        problems = []
        if self.no_batch_topic and self.batch_topic:
            problems.append(f"batch_topic {self.batch_topic!r} and no_batch_topic contradict: give one")
        if self.batch_topic and not re.fullmatch(r"[A-Za-z0-9._-]{1,249}", self.batch_topic):
            problems.append(f"batch_topic must be 1-249 chars of [A-Za-z0-9._-] (a Kafka topic), got {self.batch_topic!r}")
        if self.batch_topic and self.batch_topic in (self.job_topic, self.names_dlq_topic):
            problems.append(f"batch_topic must differ from the job and dead-letter topics, got {self.batch_topic!r}")
        if not 0 <= self.batch_weight < 1000:
            problems.append(f"batch_weight must be in [0, 1000), got {self.batch_weight}")
        if self.max_backlog_bytes < 1 << 20:
            problems.append(f"max_backlog_bytes must be >= 1 MiB (1048576), got {self.max_backlog_bytes}")
        if not 0 < self.batch_backlog_share <= 1:
            problems.append(f"batch_backlog_share must be in (0, 1], got {self.batch_backlog_share}")
        for name in ("tenant_share_half_life_s", "tenant_burst_s"):
            if not getattr(self, name) > 0:
                problems.append(f"{name} must be > 0, got {getattr(self, name)}")
        try:
            self.tenant_limits()
            parse_weights(self.tenant_weight, "tenant_weight")
        except ValueError as exc:
            problems.append(str(exc))
        return problems

    @property
    def names_dlq_topic(self) -> str:
        return self.dlq_topic or default_dlq_topic(self.job_topic)

    @property
    def batch_topic_name(self) -> str | None:
        """The batch class's topic, or None when switched off."""
        return None if self.no_batch_topic else (self.batch_topic or default_batch_topic(self.job_topic))

    def tenant_weights(self) -> dict[str, float]:
        return parse_weights(self.tenant_weight, "tenant_weight")

    def tenant_limits(self) -> TenantLimits:
        return TenantLimits(parse_limits(self.tenant_max_running, "tenant_max_running"),
                            parse_limits(self.tenant_tokens_per_minute, "tenant_tokens_per_minute"),
                            self.tenant_burst_s)

    @property
    def names(self) -> Names:
        return Names(redis_prefix=self.prefix, jobs_topic=self.job_topic, dlq_topic=self.dlq_topic)

    def kafka_security(self) -> dict[str, object]:
        """aiokafka keyword arguments for TLS / SASL."""
        args: dict[str, object] = {"security_protocol": self.security_protocol}
        if "SSL" in self.security_protocol:
            from aiokafka.helpers import create_ssl_context

            args["ssl_context"] = create_ssl_context(cafile=self.ssl_cafile, certfile=self.ssl_certfile,
                                                     keyfile=self.ssl_keyfile)
        if self.security_protocol.startswith("SASL"):
            args.update(sasl_mechanism=self.sasl_mechanism, sasl_plain_username=self.sasl_username,
                        sasl_plain_password=self.sasl_password)
        return args
