"""Fast weight loading: safetensors files straight to the GPU through pinned staging buffers.

The plain loader (`engine.loader.load_weights`) goes tensor by tensor through `safe_open`, which reads
into pageable memory and copies synchronously. Here we parse the safetensors header ourselves (8-byte
little-endian length + JSON: name -> dtype, shape, [begin, end) of the data section), cut each file's data
into groups of whole tensors of up to `group_bytes`, and for each group:
  1. reader threads `preadv` fixed-size chunks of the file range into a ring of pinned host buffers
     (the read releases the GIL, so the threads really read in parallel) and each thread issues a
     `non_blocking` host->device copy of its chunk into one raw uint8 device buffer, on a copy stream (the
     buffer is allocated on that stream: _group_buffer says why);
  2. the main thread waits for the group's copies on the compute stream, views each tensor inside the raw
     buffer (dtype, shape) and hands the view to its layer's `load_weight` (engine.loader.WeightMap), whose
     one copy_ puts it into the (fused) parameter, casting on the GPU.
A pinned buffer goes back to the ring only after an event says its copy finished. Reads of group g+1
overlap the casts of group g. On CPU (tests) the same code runs with pageable buffers.
"""

from __future__ import annotations

import json
import os
import queue
import struct
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch
from stoker.engine.loader import WeightMap, safetensors_files

_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,  # FP8 checkpoints (engine/layers/fp8.py)
    "F8_E5M2": torch.float8_e5m2,  # read so that an FP8 layer can refuse it by name
}


@dataclass(slots=True)
class TensorEntry:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int  # absolute file offsets of the tensor's bytes
    end: int


def read_header(path: str) -> list[TensorEntry]:
    """The tensors of one safetensors file, sorted by offset, with absolute byte ranges."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise ValueError(f"{path}: not a safetensors file (shorter than its 8-byte header length)")
        (n,) = struct.unpack("<Q", raw)
        if n > size - 8:
            raise ValueError(f"{path}: header length {n} runs past the end of the file ({size} bytes)")
        try:
            header = json.loads(f.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ValueError(f"{path}: safetensors header is not valid JSON: {e}") from e
    base = 8 + n
    entries = []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if info["dtype"] not in _DTYPES:
            raise ValueError(f"{path}: tensor {name} has unsupported dtype {info['dtype']}")
        begin, end = info["data_offsets"]
        dtype, shape = _DTYPES[info["dtype"]], tuple(int(s) for s in info["shape"])
        numel = 1
        for s in shape:
            numel *= s
        if end - begin != numel * dtype.itemsize or base + end > size:
            raise ValueError(
                f"{path}: tensor {name} has a byte range [{begin}, {end}) that does not match "
                f"its shape {shape} and dtype {info['dtype']}, or runs past the file"
            )
        entries.append(TensorEntry(name, dtype, shape, base + begin, base + end))
    return sorted(entries, key=lambda e: e.begin)


def _groups(entries: list[TensorEntry], group_bytes: int) -> list[list[TensorEntry]]:
    """Consecutive tensors packed into groups of at most group_bytes (a bigger tensor is a group alone)."""
    groups: list[list[TensorEntry]] = []
    for e in entries:
        if groups and e.end - groups[-1][0].begin <= group_bytes:
            groups[-1].append(e)
        else:
            groups.append([e])
    return groups


class _Staging:
    """A ring of host buffers; each goes back to the ring with the event of the copy that reads it."""

    def __init__(self, count: int, chunk_bytes: int, pinned: bool):
        self.chunk_bytes = chunk_bytes
        self.free: queue.Queue[tuple[torch.Tensor, torch.cuda.Event | None]] = queue.Queue()
        for _ in range(count):
            self.free.put((torch.empty(chunk_bytes, dtype=torch.uint8, pin_memory=pinned), None))


def _read_into(fd: int, buf: torch.Tensor, offset: int, nbytes: int) -> None:
    view = buf.numpy().data.cast("B")[:nbytes]  # the ndarray's buffer, as bytes
    done = 0
    while done < nbytes:
        got = os.preadv(fd, [view[done:]], offset + done)
        if got <= 0:
            raise OSError(f"short read at offset {offset + done} (wanted {nbytes - done} more bytes)")
        done += got


def load_weights_fast(
    model: torch.nn.Module,
    path: str,
    device: torch.device | str,
    *,
    threads: int = 8,
    chunk_bytes: int = 64 * 2**20,
    group_bytes: int = 2 * 2**30,
    progress: bool = True,
) -> dict[str, Any]:
    """Same contract as `engine.loader.load_weights` (a WeightMap and the layers' load_weight), faster.
    Returns {"load_s", "bytes", "gb_per_s", "files"}."""
    device = torch.device(device)
    cuda = device.type == "cuda"
    t0 = time.perf_counter()
    weights = WeightMap(model)
    files = safetensors_files(path)
    plan = [(f, [e for e in read_header(f) if weights.destination(e.name) is not None]) for f in files]
    total = sum(e.end - e.begin for _, es in plan for e in es)
    staging = _Staging(max(2, threads * 2), chunk_bytes, pinned=cuda)
    copy_stream = torch.cuda.Stream(device) if cuda else None
    bar = _progress_bar(total, progress)
    lock = threading.Lock()

    def fetch(fd: int, raw: torch.Tensor, begin: int, offset: int, nbytes: int) -> None:
        # One chunk: file range -> staging buffer -> device buffer (async on the copy stream).
        buf, event = staging.free.get()
        try:
            if event is not None:
                event.synchronize()  # the last copy out of this buffer has finished
            _read_into(fd, buf, offset, nbytes)
            event = None
            if copy_stream is not None:
                with torch.cuda.stream(copy_stream):
                    raw[offset - begin : offset - begin + nbytes].copy_(buf[:nbytes], non_blocking=True)
                    event = torch.cuda.Event()
                    event.record(copy_stream)
            else:
                raw[offset - begin : offset - begin + nbytes].copy_(buf[:nbytes])
        finally:
            staging.free.put((buf, event))
        if bar is not None:
            with lock:
                bar.update(nbytes)

    with ThreadPoolExecutor(max_workers=threads, thread_name_prefix="stoker-load") as pool, torch.no_grad():
        for file, entries in plan:
            fd = os.open(file, os.O_RDONLY)
            try:
                for group in _groups(entries, group_bytes):
                    begin, end = group[0].begin, group[-1].end
                    raw = _group_buffer(end - begin, device, copy_stream)
                    futures = [
                        pool.submit(fetch, fd, raw, begin, off, min(chunk_bytes, end - off))
                        for off in range(begin, end, chunk_bytes)
                    ]
                    for fut in futures:
                        fut.result()  # re-raises a reader's error here
                    if copy_stream is not None:
                        compute = torch.cuda.current_stream(device)
                        compute.wait_stream(copy_stream)
                        raw.record_stream(compute)  # its block is not handed out again before the casts ran
                    for e in group:
                        _place(weights, file, e, raw[e.begin - begin : e.end - begin])
                    del raw
            finally:
                os.close(fd)
        if cuda:
            torch.cuda.synchronize(device)
    if bar is not None:
        bar.close()
    weights.check_all_loaded(path)
    seconds = time.perf_counter() - t0
    return {"load_s": seconds, "bytes": total, "gb_per_s": total / seconds / 1e9, "files": len(files)}


def _group_buffer(nbytes: int, device: torch.device, copy_stream: torch.cuda.Stream | None) -> torch.Tensor:
    """A group's raw device buffer, allocated on the stream that writes it (the copy stream on CUDA).

    Why not on the compute stream, where the casts read it: the copy stream does not wait for the compute stream,
    so a block allocated there could be the previous group's, freed by `del raw` while its casts are still
    queued behind other work on the compute stream (a GPU busy with another process, another model's steps):
    the copies would overwrite bytes not yet cast. That happened on the H200 (2026-12-02, session 12: every engine
    built while another process kept the GPU busy loaded corrupt weights, tests/test_gpu_engine.py
    test_fast_load_behind_a_busy_compute_stream). Allocated on the copy stream and recorded on the compute
    stream, the block goes back to the copy stream's pool only once the casts that read it have run."""
    if copy_stream is None:
        return torch.empty(nbytes, dtype=torch.uint8, device=device)
    with torch.cuda.stream(copy_stream):
        return torch.empty(nbytes, dtype=torch.uint8, device=device)


def _place(weights: WeightMap, file: str, e: TensorEntry, raw: torch.Tensor) -> None:
    # Offsets inside safetensors data are not promised to be aligned to the dtype: realign on the device.
    if raw.data_ptr() % e.dtype.itemsize:
        raw = raw.clone()
    # A view, no copy: the layer's load_weight casts (e.g. float32 file -> bf16 model) on the GPU as it copies.
    weights.load(e.name, raw.view(e.dtype).view(e.shape), file)


def _progress_bar(total: int, enabled: bool) -> Any:
    if not enabled:
        return None
    try:
        from tqdm import tqdm
    except ImportError:  # tqdm is optional: loading works the same without a bar
        return None
    return tqdm(
        total=total,
        unit="B",
        unit_scale=True,
        unit_divisor=1024,
        desc="loading weights",
        mininterval=0.25,
        leave=False,
    )
