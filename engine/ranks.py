"""Tensor parallelism at the engine's level: rank 0's model runner (with the other ranks started beside it)
and the loop of ranks > 0, which receive each step's input, run the same forward on their shard and never
sample. The pieces (how a model splits, the groups, the step shipping, the launcher) are in engine/parallel;
the sharded layers in engine/layers/tensor_parallel.py."""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import threading

import torch
import torch.distributed as dist
from stoker.engine.config import EngineConfig
from stoker.engine.model_config import ModelConfig
from stoker.engine.model_runner import ModelRunner
from stoker.engine.parallel import step_io
from stoker.engine.parallel.comm import STARTUP_TIMEOUT, RankComm, rank_device
from stoker.engine.parallel.launcher import RankGroup, check_agreement, fingerprint
from stoker.engine.parallel.plan import check_shardable, rank_model_config

log = logging.getLogger(__name__)


def start_runner(config: EngineConfig, model: ModelConfig, max_model_len: int) -> ModelRunner:
    """The model runner of rank 0: the whole model on one rank, or rank 0's shard with ranks 1.. started."""
    size = config.tensor_parallel_size
    if size == 1:
        return ModelRunner(config, model, max_model_len)
    check_shardable(model, size, config.model_path)  # before spawning anything
    ranks = RankGroup(config, max_model_len, rank_main)
    try:
        with ranks.guard():  # a rank that fails to load: TensorParallelError naming it, not a gloo error
            return ModelRunner(config, rank_model_config(model, 0, size, ranks.comm), max_model_len,
                               comm=ranks.comm, ranks=ranks)
    except BaseException:
        ranks.close()
        raise


def rank_main(config: EngineConfig, rank: int, size: int, port: int, max_model_len: int,
              env: dict[str, str]) -> None:
    """A rank > 0 process: join, load this rank's shard, then run every step rank 0 ships until it stops.
    Any failure exits 1 (rank 0's watchdog sees it); a rank 0 that is gone ends us too."""
    os.environ.update(env)
    logging.basicConfig(level=logging.INFO, format=f"rank{rank} %(levelname)s %(name)s: %(message)s")
    threading.Thread(target=_exit_with_parent, daemon=True, name="stoker-tp-parent").start()
    try:
        comm = _join(config, rank, size, port)
        check_agreement(comm, fingerprint(config, max_model_len))
        model = rank_model_config(ModelConfig.from_folder(config.model_path, config.quantization), rank, size, comm)
        runner = ModelRunner(config, model, max_model_len, comm=comm)
        _serve(runner, comm)
    except BaseException:
        log.exception("tensor-parallel rank %d failed", rank)
        os._exit(1)
    os._exit(0)  # not through interpreter teardown: the groups' destructors may wait on peers already gone


def _join(config: EngineConfig, rank: int, size: int, port: int) -> RankComm:
    device = rank_device(str(config.device), rank, config.tensor_parallel_shared_gpu)
    if device.type == "cuda":  # config.device "cuda" then means this GPU (the current device)
        torch.cuda.set_device(device)
    else:  # the ranks share the host's cores
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // size))
    store = dist.TCPStore("127.0.0.1", port, size, is_master=False, timeout=STARTUP_TIMEOUT)
    store.set(f"joined/{rank}", "1")
    return RankComm(rank, size, store, device, shared_gpu=config.tensor_parallel_shared_gpu)


def _serve(runner: ModelRunner, comm: RankComm) -> None:
    """One forward per step rank 0 ships, in the same order as rank 0's, until it ships a stop."""
    while (step := step_io.receive(comm)) is not None:
        packed, prev_tokens = step
        runner.forward_shard(runner.to_device(packed, prev_tokens))


def _exit_with_parent() -> None:
    parent = mp.parent_process()
    if parent is not None:
        parent.join()
        os._exit(1)
