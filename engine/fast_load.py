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

A tensor-parallel rank reads only its part where the file allows (narrow_to_rows): a column-parallel layer's rows
(q / k / v, gate / up, their biases and per-row scales) are one contiguous byte range each; a row-parallel layer's
columns (o_proj, down_proj) are strided in the file, so their whole rows are read and the columns taken on the
device. At TP = 2 on a Llama-3 shape a rank so reads ~0.67 of the layers' weights (0.5 would be exact slices), and
the replicated embedding and LM head whole.
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
    begin: int  # absolute file offsets of the tensor's bytes (after narrow_to_rows: of the rows read)
    end: int
    rest: tuple[slice, ...] | None = None  # what of the rows read the layer takes, applied on the device


def narrow_to_rows(e: TensorEntry, index: tuple[slice, ...] | None) -> TensorEntry:
    """The part of entry `e` to read for a layer that holds `index` of it (checkpoint_slice; None = all): its
    rows are a contiguous byte range, so a row slice (a column-parallel rank's q / k / v or gate / up rows) reads
    only those bytes; the index's other dimensions (a row-parallel rank's columns) are cut on the device from the
    rows read, since columns are strided in the file."""
    if index is None or not e.shape or e.shape[0] == 0:
        return e
    start, stop, step = index[0].indices(e.shape[0])
    rest: tuple[slice, ...] | None
    if step != 1:  # no layer asks for one; read every row and let the device take them
        start, stop, rest = 0, e.shape[0], index
    else:
        rest = (slice(None), *index[1:]) if any(s != slice(None) for s in index[1:]) else None
    row_bytes = (e.end - e.begin) // e.shape[0]
    return TensorEntry(e.name, e.dtype, (stop - start, *e.shape[1:]), e.begin + start * row_bytes,
                       e.begin + stop * row_bytes, rest)


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
    """Tensors in file order packed into groups of at most group_bytes read (a bigger tensor is a group alone).
    The bytes between two entries (another rank's rows, a tensor this model does not use) are not read."""
    groups: list[list[TensorEntry]] = []
    size = 0
    for e in entries:
        if groups and size + (e.end - e.begin) <= group_bytes:
            groups[-1].append(e)
            size += e.end - e.begin
        else:
            groups.append([e])
            size = e.end - e.begin
    return groups


def _runs(group: list[TensorEntry]) -> list[tuple[int, int, int]]:
    """A group's file ranges to read, as (file begin, file end, offset in the group's buffer): entries that
    follow each other in the file with no gap make one run, read in whole chunks."""
    runs: list[tuple[int, int, int]] = []
    at = 0
    for e in group:
        if runs and runs[-1][1] == e.begin:
            runs[-1] = (runs[-1][0], e.end, runs[-1][2])
        else:
            runs.append((e.begin, e.end, at))
        at += e.end - e.begin
    return runs


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
    plan = [(f, [_part(weights, e) for e in read_header(f) if weights.destination(e.name) is not None])
            for f in files]
    total = sum(e.end - e.begin for _, es in plan for e in es)
    staging = _Staging(max(2, threads * 2), chunk_bytes, pinned=cuda)
    copy_stream = torch.cuda.Stream(device) if cuda else None
    bar = _progress_bar(total, progress)
    lock = threading.Lock()

    def fetch(fd: int, raw: torch.Tensor, at: int, offset: int, nbytes: int) -> None:
        # One chunk: file range [offset, offset + nbytes) -> staging buffer -> raw[at:] (async on the copy stream).
        buf, event = staging.free.get()
        try:
            if event is not None:
                event.synchronize()  # the last copy out of this buffer has finished
            _read_into(fd, buf, offset, nbytes)
            event = None
            if copy_stream is not None:
                with torch.cuda.stream(copy_stream):
                    raw[at : at + nbytes].copy_(buf[:nbytes], non_blocking=True)
                    event = torch.cuda.Event()
                    event.record(copy_stream)
            else:
                raw[at : at + nbytes].copy_(buf[:nbytes])
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
                    raw = _group_buffer(sum(e.end - e.begin for e in group), device, copy_stream)
                    futures = [
                        pool.submit(fetch, fd, raw, at + off - begin, off, min(chunk_bytes, end - off))
                        for begin, end, at in _runs(group)
                        for off in range(begin, end, chunk_bytes)
                    ]
                    for fut in futures:
                        fut.result()  # re-raises a reader's error here
                    if copy_stream is not None:
                        compute = torch.cuda.current_stream(device)
                        compute.wait_stream(copy_stream)
                        raw.record_stream(compute)  # its block is not handed out again before the casts ran
                    at = 0
                    for e in group:
                        _place(weights, file, e, raw[at : at + e.end - e.begin])
                        at += e.end - e.begin
                    del raw
            finally:
                os.close(fd)
        if cuda:
            torch.cuda.synchronize(device)
            # The group buffers (up to group_bytes each, cached by the copy stream's pool) back to the device: the
            # KV cache is sized from the free memory next.
            torch.cuda.empty_cache()
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


def _part(weights: WeightMap, e: TensorEntry) -> TensorEntry:
    """The entry narrowed to what its layer holds (a tensor-parallel rank's slice; the whole tensor otherwise)."""
    dest = weights.destination(e.name)
    assert dest is not None  # the plan keeps only tensors with a place
    _, module, param, shard = dest
    return narrow_to_rows(e, module.checkpoint_slice(param, shard))


def _place(weights: WeightMap, file: str, e: TensorEntry, raw: torch.Tensor) -> None:
    # Offsets inside safetensors data are not promised to be aligned to the dtype: realign on the device.
    if raw.data_ptr() % e.dtype.itemsize:
        raw = raw.clone()
    # A view, no copy: the layer's load_weight casts (e.g. float32 file -> bf16 model) on the GPU as it copies;
    # a row-parallel rank's columns are a strided view of the rows read, copied by that same copy_.
    tensor = raw.view(e.dtype).view(e.shape)
    weights.load(e.name, tensor if e.rest is None else tensor[e.rest], file)


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
