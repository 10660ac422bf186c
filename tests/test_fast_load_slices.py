"""The fast loader (engine/fast_load.py) on a tensor-parallel rank (issue 17): it reads each column-parallel
tensor's rows alone (a contiguous byte range), reads a row-parallel tensor's whole rows and takes the rank's
columns on the device, and fills the rank's model exactly as the plain loader (safetensors' get_slice) does.

On the CPU (the same code as on CUDA with pageable staging buffers), float32 models from transformers, several
files, chunks and groups far smaller than the tensors so that runs, chunk boundaries and group boundaries all
occur; no process group is needed to load a rank's part (the plan's comm is used only by forward passes).
"""

from __future__ import annotations

import os
import shutil

import pytest
import torch
from engine_models import build_fp8_checkpoint, build_hf_model, prompts
from stoker.engine.fast_load import TensorEntry, load_weights_fast, narrow_to_rows, read_header
from stoker.engine.loader import load_weights, safetensors_files
from stoker.engine.model_config import ModelConfig
from stoker.engine.models import model_class
from stoker.engine.parallel.plan import rank_model_config

KV1 = {"hidden_size": 48, "num_attention_heads": 6, "num_key_value_heads": 1, "intermediate_size": 96}
ROW_SPLIT = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")  # column-parallel: each rank its rows


def _rank_models(path: str, rank: int, size: int, device: str = "cpu") -> tuple[torch.nn.Module, torch.nn.Module, dict]:
    cfg = rank_model_config(ModelConfig.from_folder(path), rank, size, comm=None)  # type: ignore[arg-type]
    with torch.device(device):
        plain = model_class(cfg.architecture)(cfg, torch.float32, 64)
        fast = model_class(cfg.architecture)(cfg, torch.float32, 64)
    load_weights(plain, path)
    report = load_weights_fast(fast, path, device, threads=3, chunk_bytes=4096, group_bytes=20_000, progress=False)
    return plain, fast, report


def _assert_same(plain: torch.nn.Module, fast: torch.nn.Module) -> None:
    want, got = dict(plain.named_parameters()), dict(fast.named_parameters())
    assert want.keys() == got.keys()
    for name, p in want.items():
        assert torch.equal(got[name], p), name


def _expected_bytes(path: str, size: int, kv_replicated: bool) -> int:
    """What a rank must read: 1/size of every column-parallel tensor with a row per output (weights, biases,
    per-channel scales; K / V whole where the KV heads are replicated), everything else whole (row-parallel
    tensors: their whole rows; per-tensor and input scales; replicated tensors)."""
    total = 0
    for file in safetensors_files(path):
        for e in read_header(file):
            nbytes = e.end - e.begin
            split = any(f".{p}." in e.name for p in ROW_SPLIT) and len(e.shape) > 0 and e.shape[0] > 1
            if split and not (kv_replicated and any(f".{p}." in e.name for p in ("k_proj", "v_proj"))):
                nbytes //= size
            total += nbytes
    return total


@pytest.mark.parametrize(("arch", "shape", "size"), [
    ("llama", None, 2),
    ("qwen2", None, 2),  # q/k/v biases: row-split with their rows
    ("qwen3", None, 2),  # q/k norms, whole
    ("llama", KV1, 3),  # one KV head, replicated on every rank
], ids=["llama-tp2", "qwen2-tp2", "qwen3-tp2", "llama-kv1-tp3"])
def test_a_rank_loads_as_the_plain_loader_reading_only_its_rows(tmp_path, arch: str, shape, size: int):
    path = str(tmp_path / arch)
    build_hf_model(arch, path, shape=shape, max_shard_size="100KB")
    assert len(safetensors_files(path)) > 1
    full = sum(os.path.getsize(f) for f in safetensors_files(path))
    for rank in range(size):
        plain, fast, report = _rank_models(path, rank, size)
        _assert_same(plain, fast)
        assert report["bytes"] == _expected_bytes(path, size, kv_replicated=shape is not None)
        assert report["bytes"] < full


@pytest.mark.parametrize("preset", ["FP8", "FP8_DYNAMIC"])
def test_a_rank_of_an_fp8_checkpoint_loads_as_the_plain_loader(tmp_path, preset: str):
    """FP8 weights by rows, per-channel scales by row, per-tensor and input scales whole (0-d and 1-element
    tensors), row-parallel weights by columns."""
    pytest.importorskip("compressed_tensors")
    src = str(tmp_path / "src")
    model = build_hf_model("llama", src)
    path = str(tmp_path / preset)
    build_fp8_checkpoint(model, path, preset, prompts(9, [24, 11]))
    for name in os.listdir(src):
        if not name.endswith(".safetensors") and name != "config.json":
            shutil.copy(os.path.join(src, name), path)
    for rank in range(2):
        plain, fast, report = _rank_models(path, rank, 2)
        _assert_same(plain, fast)
        assert report["bytes"] == _expected_bytes(path, 2, kv_replicated=False)


def test_narrow_to_rows_reads_a_row_range_and_cuts_columns_on_the_device():
    e = TensorEntry("w", torch.float32, (6, 10), begin=1000, end=1000 + 6 * 10 * 4)
    rows = narrow_to_rows(e, (slice(2, 5),))
    assert (rows.begin, rows.end, rows.shape, rows.rest) == (1000 + 2 * 40, 1000 + 5 * 40, (3, 10), None)
    cols = narrow_to_rows(e, (slice(None), slice(4, 8)))
    assert (cols.begin, cols.end, cols.shape, cols.rest) == (1000, 1240, (6, 10), (slice(None), slice(4, 8)))
    both = narrow_to_rows(e, (slice(1, 3), slice(0, 5)))
    assert (both.begin, both.end, both.shape, both.rest) == (1040, 1120, (2, 10), (slice(None), slice(0, 5)))
    stepped = narrow_to_rows(e, (slice(0, 6, 2),))  # no layer asks for one: every row, cut on the device
    assert (stepped.begin, stepped.end, stepped.rest) == (1000, 1240, (slice(0, 6, 2),))
    assert narrow_to_rows(e, None) is e
    scalar = TensorEntry("s", torch.float32, (), begin=8, end=12)
    assert narrow_to_rows(scalar, None) is scalar


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_rank_loads_on_cuda_as_the_plain_loader(tmp_path):
    """Pinned staging, the copy stream and the column cut of a strided view on the GPU."""
    path = str(tmp_path / "qwen2")
    build_hf_model("qwen2", path, max_shard_size="100KB")
    for rank in range(2):
        plain, fast, report = _rank_models(path, rank, 2, "cuda")
        _assert_same(plain, fast)
        assert report["bytes"] == _expected_bytes(path, 2, kv_replicated=False)


def test_a_tensor_at_a_misaligned_offset_in_its_group_is_realigned_before_the_view():
    """Entries are packed back to back in a group's byte buffer, so a float32 tensor after a bfloat16 one of odd
    length starts 2 bytes off a 4-byte boundary; _place copies it to an aligned buffer first (a view there would
    be refused or read garbage), and a row-parallel cut (rest) still applies to it."""
    from stoker.engine import fast_load

    values = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    raw = torch.zeros(2 + values.numel() * 4, dtype=torch.uint8)
    raw[2:] = values.view(-1).view(torch.uint8)
    got: dict[str, torch.Tensor] = {}

    class Weights:
        def load(self, name: str, tensor: torch.Tensor, file: str) -> None:
            got[name] = tensor.clone()

    entry = TensorEntry("w", torch.float32, (3, 4), begin=0, end=48)
    fast_load._place(Weights(), "f", entry, raw[2:])  # type: ignore[arg-type]
    assert raw[2:].data_ptr() % 4 != 0 and torch.equal(got["w"], values)
    cut = TensorEntry("w", torch.float32, (3, 4), begin=0, end=48, rest=(slice(None), slice(1, 3)))
    fast_load._place(Weights(), "f", cut, raw[2:])  # type: ignore[arg-type]
    assert torch.equal(got["w"], values[:, 1:3])
