"""`stoker-worker`: flags and STOKER_* environment -> WorkerConfig -> engine -> Worker, with a SIGTERM drain.

Every flag has an environment variable; click parses both and --help shows each flag's help, default and
variable. A flag given on the command line wins. The names are the ones `stoker` and `stoker-gateway` use for
the same settings (--bootstrap-servers, --job-topic, --redis-url, --prefix; tests/test_config_language.py).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import sys
import time
from importlib import metadata
from typing import Any

import click
from stoker.engine import settle_heap
from stoker.worker.config import WorkerConfig, default_worker_id
from stoker.worker.driver import EngineStalled
from stoker.worker.model_specs import ModelSpec

# (flag, env var, type, default, help): click options built by _command(). bool flags are switches; their
# variables take 1/true/yes/on or 0/false/no/off (anything else is a usage error naming the variable).
_OPTIONS: list[tuple[str, str, Any, Any, str]] = [
    ("--model", "STOKER_MODEL", str, None,
     "model folder (Hugging Face layout); repeat for several: PATH[,name=NAME][,memory=GPU_SHARE]"
     "[,kv_cache_memory_bytes=N], the first serving jobs without `model` (env: several joined by ';')"),
    ("--models-file", "STOKER_MODELS_FILE", str, None,
     "TOML file of [[model]] tables (path, name, memory, kv_cache_memory_bytes), after any --model"),
    ("--model-idle-unload-s", "STOKER_MODEL_IDLE_UNLOAD_S", float, None,
     "unload a model that has had no job this long; its next job reloads it (default: never)"),
    ("--served-model-name", "STOKER_SERVED_MODEL_NAME", str, None, "model name jobs may ask for"),
    ("--fake-engine", "STOKER_FAKE_ENGINE", bool, False, "use the deterministic stand-in engine"),
    ("--fake-step-delay-s", "STOKER_FAKE_STEP_DELAY_S", float, 0.0, "stand-in engine: seconds per step"),
    ("--fake-hang-after-steps", "STOKER_FAKE_HANG_AFTER_STEPS", int, 0,
     "stand-in engine: its step after this many never returns, as on a hung GPU (tests; 0: never)"),
    ("--device", "STOKER_DEVICE", str, None, "cuda or cpu (default: cuda when available)"),
    ("--kv-cache-memory-bytes", "STOKER_KV_CACHE_MEMORY_BYTES", int, None, "KV cache memory budget"),
    ("--max-num-seqs", "STOKER_MAX_NUM_SEQS", int, 256, "max concurrent requests in the batch"),
    ("--max-model-len", "STOKER_MAX_MODEL_LEN", int, None, "context length cap"),
    ("--dtype", "STOKER_DTYPE", str, None, "float32|float16|bfloat16 (default: bfloat16 on CUDA, float32 on CPU)"),
    ("--quantization", "STOKER_QUANTIZATION", str, None,
     "fp8: quantize an unquantized checkpoint's linears to FP8 at load (FP8 checkpoints need no flag)"),
    ("--load-format", "STOKER_LOAD_FORMAT", str, "auto",
     "auto (the folder's *.safetensors) or dummy (random weights made on the GPU from config.json alone: "
     "benchmarks and smoke tests of a shape whose weights are not at hand; its answers mean nothing)"),
    ("--kv-cache-dtype", "STOKER_KV_CACHE_DTYPE", str, "auto",
     "auto (the model dtype) or fp8 (float8_e4m3fn, the checkpoint's k/v scales else 1.0: twice the blocks)"),
    ("--decode-kernels", "STOKER_DECODE_KERNELS", str, "auto",
     "decode steps of <= 16 sequences: auto (fused on CUDA), fused (Triton GEMVs with the rotary/KV-write, "
     "SiLU and residual epilogues), fused-folded (also the RMSNorm in the GEMV prologue) or cublas (A/B)"),
    ("--decode-pdl", "STOKER_DECODE_PDL", bool, False,
     "launch the fused decode kernels of every layer with programmatic dependent launch (default: FP8 layers only)"),
    ("--no-decode-pdl", "STOKER_NO_DECODE_PDL", bool, False,
     "no programmatic dependent launch in any layer, FP8 ones included (A/B)"),
    ("--no-decode-fused-mlp", "STOKER_NO_DECODE_FUSED_MLP", bool, False,
     "small-batch (1-16 token) decode steps run each MLP as two GEMVs (bit-for-bit repeatable), not one streaming "
     "kernel with atomic adds plus a small finishing kernel"),
    ("--decode-prologue-norm-max-m", "STOKER_DECODE_PROLOGUE_NORM_MAX_M", int, 2,
     "fused decode steps of up to this many tokens normalise in the GEMV prologues, larger ones run the norm kernel "
     "first (0..16)"),
    ("--prefill-graph-tokens", "STOKER_PREFILL_GRAPH_TOKENS", int, 1024,
     "a step that is one prompt chunk alone (a request at an idle engine) of <= this many tokens replays a CUDA "
     "graph captured at startup instead of launching ~300 kernels (0: eager)"),
    ("--piecewise-graph-tokens", "STOKER_PIECEWISE_GRAPH_TOKENS", int, 8192,
     "every other step with prompt tokens (several prompts, chunks beside decode rows) of <= this many tokens "
     "replays per-layer CUDA graphs, the attentions launched between them (0: eager)"),
    ("--tensor-parallel", "STOKER_TENSOR_PARALLEL", int, 1,
     "GPUs (one process each) the model is split over: the first N that CUDA_VISIBLE_DEVICES shows"),
    ("--tensor-parallel-all-reduce", "STOKER_TENSOR_PARALLEL_ALL_REDUCE", str, "nccl",
     "with --tensor-parallel > 1: nccl, or symm-mem (steps of up to 16 tokens through a one-shot all-reduce over "
     "symmetric memory, larger ones NCCL; not yet measured, and a rank dying inside one can hang the others)"),
    ("--block-size", "STOKER_BLOCK_SIZE", int, 16, "tokens per KV block (a power of two)"),
    ("--num-kv-blocks", "STOKER_NUM_KV_BLOCKS", int, None, "KV blocks (default: as many as the budget allows)"),
    ("--gpu-memory-utilization", "STOKER_GPU_MEMORY_UTILIZATION", float, 0.9,
     "share of the GPU the engine may fill (when no KV cache budget is given)"),
    ("--max-num-batched-tokens", "STOKER_MAX_NUM_BATCHED_TOKENS", int, 8192,
     "tokens per engine step: lower keeps inter-token latency steadier, higher gives more throughput"),
    ("--seed", "STOKER_SEED", int, None, "seed of the per-request seeds of unseeded requests"),
    ("--no-prefix-caching", "STOKER_NO_PREFIX_CACHING", bool, False, "turn prefix caching off"),
    ("--no-cuda-graphs", "STOKER_NO_CUDA_GRAPHS", bool, False, "run decode steps eagerly (no CUDA graphs)"),
    ("--no-async-scheduling", "STOKER_NO_ASYNC_SCHEDULING", bool, False,
     "step synchronously: no host work overlapped with the GPU's"),
    ("--no-triton", "STOKER_NO_TRITON", bool, False, "plain-torch kernel references instead of Triton (A/B)"),
    ("--no-blocking-sync", "STOKER_NO_BLOCKING_SYNC", bool, False, "keep CUDA's spinning host waits (A/B)"),
    ("--no-warmup", "STOKER_NO_WARMUP", bool, False,
     "skip the warm-up (every prefill, mixed and sampler path run once before ready)"),
    ("--bootstrap-servers", "KAFKA_BOOTSTRAP_SERVERS", str, "127.0.0.1:9092", "Kafka bootstrap servers"),
    ("--job-topic", "STOKER_JOB_TOPIC", str, "stoker.jobs", "job topic"),
    ("--dlq-topic", "STOKER_DLQ_TOPIC", str, "", "dead-letter topic (default: job topic + .dlq)"),
    ("--group-id", "STOKER_GROUP_ID", str, "stoker-workers", "Kafka consumer group"),
    ("--security-protocol", "KAFKA_SECURITY_PROTOCOL", str, "PLAINTEXT", "PLAINTEXT|SSL|SASL_PLAINTEXT|SASL_SSL"),
    ("--sasl-mechanism", "KAFKA_SASL_MECHANISM", str, None, "PLAIN|SCRAM-SHA-256|SCRAM-SHA-512"),
    ("--sasl-username", "KAFKA_SASL_USERNAME", str, None, "SASL user"),
    ("--sasl-password", "KAFKA_SASL_PASSWORD", str, None, "SASL password (prefer the env var)"),
    ("--ssl-cafile", "KAFKA_SSL_CAFILE", str, None, "CA bundle for Kafka TLS"),
    ("--ssl-certfile", "KAFKA_SSL_CERTFILE", str, None, "client certificate for Kafka TLS"),
    ("--ssl-keyfile", "KAFKA_SSL_KEYFILE", str, None, "client key for Kafka TLS"),
    ("--max-poll-records", "STOKER_MAX_POLL_RECORDS", int, 64, "job records taken from Kafka per poll at most"),
    ("--batch-topic", "STOKER_BATCH_TOPIC", str, "", "batch-class topic (default: job topic + .batch, read when it exists)"),
    ("--no-batch-topic", "STOKER_NO_BATCH_TOPIC", bool, False, "read the job topic alone (no batch class)"),
    ("--batch-weight", "STOKER_BATCH_WEIGHT", float, 0.1,
     "batch-class admissions per live one while both wait (0: batch only when no live job waits)"),
    ("--max-backlog-bytes", "STOKER_MAX_BACKLOG_BYTES", int, 64 << 20,
     "jobs read ahead of the engine (admitted by class, priority, tenant share), in bytes"),
    ("--batch-backlog-share", "STOKER_BATCH_BACKLOG_SHARE", float, 0.75,
     "share of --max-backlog-bytes the batch class may fill (the rest stays free for live jobs)"),
    ("--tenant-weight", "STOKER_TENANT_WEIGHT", tuple, (), "TENANT=WEIGHT, repeatable: share of recent tokens"),
    ("--tenant-share-half-life-s", "STOKER_TENANT_SHARE_HALF_LIFE_S", float, 60.0,
     "half-life of the recent tokens that order tenants"),
    ("--tenant-max-running", "STOKER_TENANT_MAX_RUNNING", tuple, (),
     "TENANT=N, repeatable ('*' = every other tenant): requests running at once, over all workers (Redis)"),
    ("--tenant-tokens-per-minute", "STOKER_TENANT_TOKENS_PER_MINUTE", tuple, (),
     "TENANT=N, repeatable ('*' = every other tenant): prompt + completion tokens, over all workers (Redis)"),
    ("--tenant-burst-s", "STOKER_TENANT_BURST_S", float, 60.0, "seconds of its token rate a tenant may use at once"),
    ("--redis-url", "REDIS_URL", str, "redis://127.0.0.1:6379/0", "Redis URL (rediss:// for TLS)"),
    ("--redis-password", "REDIS_PASSWORD", str, None, "Redis password (prefer the env var)"),
    ("--redis-ca-certs", "REDIS_CA_CERTS", str, None, "CA bundle for Redis TLS"),
    ("--prefix", "STOKER_PREFIX", str, "stoker", "Redis key prefix"),
    ("--ttl-s", "STOKER_TTL_S", int, 3600, "TTL of streams and result keys"),
    ("--stream-maxlen", "STOKER_STREAM_MAXLEN", int, 10_000,
     "least length each request stream keeps; raised to max_attempts x (max_model_len + 1) + 1, so even the "
     "longest request the engine can run keeps every chunk for late readers"),
    ("--claim-ttl-s", "STOKER_CLAIM_TTL_S", float, 10.0, "claim TTL (renewed every third of it)"),
    ("--claim-after-launch-s", "STOKER_CLAIM_AFTER_LAUNCH_S", float, 0.005,
     "a job that wakes an idle engine is claimed once its first step has returned, waiting at most this long "
     "(that step's host work needs the GIL the claim would hold; 0: claim at once)"),
    ("--first-token-wait-s", "STOKER_FIRST_TOKEN_WAIT_S", float, 0.002,
     "the engine thread waits at most this long for a step's first tokens to be published before its next "
     "step, whose host work would hold the GIL the publish needs (overlapped engines; 0: never)"),
    ("--redis-outage-leave-s", "STOKER_REDIS_OUTAGE_LEAVE_S", float, 60.0,
     "Redis unreachable this long: leave the consumer group (others take the partitions), rejoin after"),
    ("--max-attempts", "STOKER_MAX_ATTEMPTS", int, 3, "starts before a job is dead-lettered as poison"),
    ("--max-waiting", "STOKER_MAX_WAITING", int, None, "queued requests before intake pauses"),
    ("--drain-timeout-s", "STOKER_DRAIN_TIMEOUT_S", float, 30.0, "SIGTERM: wait this long for running requests"),
    ("--step-stall-timeout-s", "STOKER_STEP_STALL_TIMEOUT_S", float, 300.0,
     "an engine step running longer than this is a hung GPU: hand the jobs back and exit 1 (0: never)"),
    ("--model-load-timeout-s", "STOKER_MODEL_LOAD_TIMEOUT_S", float, 1800.0,
     "several models: a model load running longer than this is stuck, as a hung step (0: never)"),
    ("--grammar-compile-threads", "STOKER_GRAMMAR_COMPILE_THREADS", int, 2,
     "threads compiling new response_format grammars (off the event loop); more wait, intake pauses"),
    ("--grammar-compile-timeout-s", "STOKER_GRAMMAR_COMPILE_TIMEOUT_S", float, 5.0,
     "a response_format that takes longer to compile ends its request with invalid_response_format"),
    ("--worker-id", "STOKER_WORKER_ID", str, None, "worker id (default host-pid-random)"),
    ("--metrics-host", "STOKER_METRICS_HOST", str, "0.0.0.0", "metrics/health bind address"),
    ("--metrics-port", "STOKER_METRICS_PORT", int, 9400, "metrics/health port (0 any, -1 off)"),
    ("--switch-interval-s", "STOKER_SWITCH_INTERVAL_S", float, 0.0005,
     "GIL switch interval: how long the loop may wait for the engine thread"),
    ("--max-tenant-labels", "STOKER_MAX_TENANT_LABELS", int, 100,
     "distinct `tenant` label values in metrics; later tenants are counted as `other`"),
    ("--log-prompts", "STOKER_LOG_PROMPTS", bool, False, "log prompt text (off: prompts may be private)"),
    ("--debug-stages", "STOKER_DEBUG_STAGES", bool, False,
     "serve GET /stages on the metrics port: the latest 256 jobs' request ids with their start stages (off: the "
     "port is often reachable by more than those who may see request ids)"),
    ("--log-level", "STOKER_LOG_LEVEL", str, "INFO", "DEBUG|INFO|WARNING|ERROR"),
    ("--log-format", "STOKER_LOG_FORMAT", str, "kv", "kv or json"),
]


class _ModelOptionType(click.types.StringParamType):
    """--model is repeatable; its variable separates models with ';' (paths may hold spaces)."""

    envvar_list_splitter = ";"


class _EnvOption(click.Option):
    """An option whose environment twin is read from the mapping parse_config was given (os.environ by
    default), so tests pass an environment without touching the process's."""

    def resolve_envvar_value(self, ctx: click.Context) -> str | None:
        env = ctx.find_root().obj
        if env is None or not isinstance(self.envvar, str):
            return super().resolve_envvar_value(ctx)
        return env.get(self.envvar) or None  # an empty variable counts as unset


def _version() -> str:
    try:
        return metadata.version("stoker")
    except metadata.PackageNotFoundError:  # a plain source tree (PYTHONPATH=.), not installed
        return "0+source"


def _command() -> click.Command:
    params: list[click.Parameter] = []
    for flag, var, typ, default, help_text in _OPTIONS:
        if typ is bool:  # a switch; its variable takes 1/true/yes/on (and 0/false/no/off)
            params.append(_EnvOption([flag], is_flag=True, default=False, envvar=var, show_envvar=True,
                                     help=help_text))
        elif flag == "--model":
            params.append(_EnvOption([flag], type=_ModelOptionType(), multiple=True, default=(), envvar=var, show_envvar=True,
                                     help=help_text))
        elif typ is tuple:  # repeatable; its variable takes the values separated by spaces
            params.append(_EnvOption([flag], multiple=True, default=(), envvar=var, show_envvar=True,
                                     help=help_text))
        else:
            params.append(_EnvOption([flag], type=typ, default=default, envvar=var, show_envvar=True,
                                     show_default=default is not None and default != "", help=help_text))
    command = click.Command("stoker-worker", params=params, help="Stoker GPU worker: Kafka in, Redis out.",
                            context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110})
    return click.version_option(_version(), "--version", prog_name="stoker-worker",
                                message="%(prog)s %(version)s")(command)


def parse_config(argv: list[str] | None = None, env: dict[str, str] | None = None) -> WorkerConfig:
    """WorkerConfig from flags (default: sys.argv) and environment (default: os.environ). Bad usage and
    --help/--version exit as click does (SystemExit 2 with one line naming the flag or variable, or 0)."""
    command = _command()
    try:
        with command.make_context("stoker-worker", list(sys.argv[1:] if argv is None else argv), obj=env) as ctx:
            values = dict(ctx.params)
            if values["worker_id"] is None:
                values["worker_id"] = default_worker_id()
            try:
                values |= model_values(values.pop("model"), values.pop("models_file"))
                return WorkerConfig(**values)
            except ValueError as exc:
                raise click.UsageError(str(exc), ctx) from None
    except click.exceptions.Exit as exc:  # --help, --version
        raise SystemExit(exc.exit_code) from None
    except click.ClickException as exc:
        exc.show()
        raise SystemExit(exc.exit_code) from None


class _KVFormatter(logging.Formatter):
    """`ts=... level=... logger=... event=... k=v` lines (the message already holds key=value pairs)."""

    def __init__(self, as_json: bool):
        super().__init__()
        self.as_json = as_json

    def format(self, record: logging.LogRecord) -> str:
        ts = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z"
        msg = record.getMessage()
        if record.exc_info:
            msg += " exc=" + json.dumps(self.formatException(record.exc_info))
        if self.as_json:
            return json.dumps({"ts": ts, "level": record.levelname.lower(), "logger": record.name, "msg": msg})
        return f"ts={ts} level={record.levelname.lower()} logger={record.name} {msg}"


def setup_logging(level: str, fmt: str) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_KVFormatter(fmt == "json"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    logging.getLogger("aiokafka").setLevel(max(logging.WARNING, root.level))


def model_values(options: tuple[str, ...], models_file: str | None) -> dict[str, Any]:
    """WorkerConfig's `model`/`models` from the --model values and --models-file. One bare path is the
    single-model form of old (`model` alone); anything more fills `models`. ValueError names what is wrong."""
    from stoker.worker.model_specs import load_models_file, parse_model_option

    if len(options) == 1 and "," not in options[0] and models_file is None:
        return {"model": options[0]}
    specs = [parse_model_option(text) for text in options]
    specs += load_models_file(models_file) if models_file is not None else []
    return {"model": specs[0].path if specs else None, "models": tuple(specs)}


def build_engine(cfg: WorkerConfig) -> Any:
    """The one engine, or a ModelSet over several (or over one that may unload when idle)."""
    if len(cfg.models) > 1 or cfg.model_idle_unload_s is not None:
        from stoker.worker.models import ModelSet

        specs = {spec.served_name: spec for spec in cfg.model_specs()}
        return ModelSet(list(specs) or ["fake"], lambda name: _build_one(cfg, specs.get(name)),
                        idle_unload_s=cfg.model_idle_unload_s, exclusive_load=_graphs_on_cuda(cfg))
    return _build_one(cfg, cfg.models[0] if cfg.models else None)


def _graphs_on_cuda(cfg: WorkerConfig) -> bool:
    if cfg.fake_engine or cfg.no_cuda_graphs or cfg.device == "cpu":
        return False
    import torch

    return torch.cuda.is_available()


def engine_settings(cfg: WorkerConfig, spec: ModelSpec | None) -> dict[str, Any]:
    """EngineConfig's keywords for one engine: the worker's settings, a model spec's own path, name and memory over
    them. Every engine setting the worker has an option for is passed, so the worker's defaults must be the
    engine's (tests/test_worker_units.py holds the two to each other)."""
    kwargs: dict[str, Any] = {
        "model_path": cfg.model, "max_num_seqs": cfg.max_num_seqs, "dtype": cfg.dtype, "block_size": cfg.block_size,
        "num_kv_blocks": cfg.num_kv_blocks, "gpu_memory_utilization": cfg.gpu_memory_utilization,
        "max_num_batched_tokens": cfg.max_num_batched_tokens, "seed": cfg.seed,
        "enable_prefix_caching": not cfg.no_prefix_caching, "cuda_graphs": not cfg.no_cuda_graphs,
        "async_scheduling": False if cfg.no_async_scheduling else None, "use_triton": not cfg.no_triton,
        "blocking_sync": not cfg.no_blocking_sync, "quantization": cfg.quantization, "load_format": cfg.load_format,
        "tensor_parallel_size": cfg.tensor_parallel, "tensor_parallel_all_reduce": cfg.tensor_parallel_all_reduce,
        "kv_cache_dtype": cfg.kv_cache_dtype,
        "decode_kernels": cfg.decode_kernels, "decode_pdl": True if cfg.decode_pdl else False if cfg.no_decode_pdl else None,
        "decode_fused_mlp": not cfg.no_decode_fused_mlp, "decode_prologue_norm_max_m": cfg.decode_prologue_norm_max_m,
        "prefill_graph_tokens": cfg.prefill_graph_tokens, "piecewise_graph_tokens": cfg.piecewise_graph_tokens,
    }
    if cfg.served_model_name:
        kwargs["model_name"] = cfg.served_model_name
    if cfg.device:
        kwargs["device"] = cfg.device
    if cfg.kv_cache_memory_bytes:
        kwargs["kv_cache_memory_bytes"] = cfg.kv_cache_memory_bytes
    if cfg.max_model_len:
        kwargs["max_model_len"] = cfg.max_model_len
    if spec is not None:
        kwargs |= spec.engine_overrides()
    return kwargs


def _build_one(cfg: WorkerConfig, spec: ModelSpec | None) -> Any:
    """One engine: the worker's engine settings, with a model spec's own path, name and memory over them."""
    if cfg.fake_engine:
        from stoker.worker.fake_engine import FakeEngine

        name = spec.served_name if spec is not None else cfg.served_model_name or "fake"
        return FakeEngine(name, max_num_seqs=cfg.max_num_seqs,
                          max_model_len=cfg.max_model_len or 4096, step_delay_s=cfg.fake_step_delay_s,
                          hang_after_steps=cfg.fake_hang_after_steps)
    from stoker.engine import EngineConfig, LLMEngine

    engine = LLMEngine(EngineConfig(**engine_settings(cfg, spec)))
    if not cfg.no_warmup:
        from stoker.engine import warm_up

        # A reload (idle unload, then a job) of a model this process has warmed: its kernels are compiled.
        key = spec.served_name if spec is not None else cfg.model
        report = warm_up(engine, light=key in _WARMED)
        _WARMED.add(key)
        logging.getLogger("stoker.worker").info(
            "event=engine_warmed_up seconds=%.2f requests=%d steps=%d largest_step_tokens=%d mixed_steps=%d "
            "waves=%s", report.seconds, report.requests, report.steps, report.largest_step_tokens,
            report.mixed_steps, ",".join(w.replace(" ", "_") for w in report.waves))
    return engine


_WARMED: set[str | None] = set()  # the models this process has warmed up in full (by served name)


async def serve(cfg: WorkerConfig) -> None:
    # The engine thread and the asyncio loop share the GIL. A loop woken by a socket (a Kafka record, a
    # Redis reply) waits up to the switch interval for the engine thread to let go: at Python's 5 ms default,
    # produce -> first event p99 measured 18-21 ms (ops/bench_transport.py, 2-core box); at 1 ms 10.5 ms,
    # at 0.2 ms 9.2 ms. Hand-offs cost microseconds, so a short interval is cheap.
    sys.setswitchinterval(cfg.switch_interval_s)
    from stoker.worker.service import Worker

    log = logging.getLogger("stoker.worker")
    started = time.monotonic()
    engine = await asyncio.to_thread(build_engine, cfg)  # loading may take minutes; keep signals responsive
    log.info("event=engine_loaded model=%s load_s=%.1f",
             ",".join(getattr(engine, "model_names", None) or [getattr(engine, "model_name", "?")]),
             time.monotonic() - started)
    worker = Worker(cfg, engine)
    settle_heap()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, worker.request_stop)
    try:
        await worker.run()
    finally:  # a tensor-parallel engine stops its rank processes (the stand-in engine has nothing to stop)
        close = getattr(engine, "close", None)
        if close is not None:
            await asyncio.to_thread(close)


def main(argv: list[str] | None = None) -> int:
    cfg = parse_config(argv)
    setup_logging(cfg.log_level, cfg.log_format)
    try:
        asyncio.run(serve(cfg))
    except RuntimeError as exc:
        logging.getLogger("stoker.worker").error("event=worker_failed error=%r", str(exc))
        if isinstance(exc.__cause__, EngineStalled):
            # The stalled step's thread is still inside the engine, and the interpreter's teardown (CUDA, NCCL)
            # would wait on it: leave now. The jobs are already handed back.
            logging.shutdown()
            os._exit(1)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
