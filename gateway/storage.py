"""The Batch API's storage path: uploaded files, batch states and each batch's log of answered lines.

One folder (local by default; a shared volume when several gateway replicas serve the same files):

    files/{file_id}.json           the file object (OpenAI's fields, plus how many requests it holds)
    files/{file_id}.jsonl          its content
    batches/{batch_id}.json        the batch's state (gateway.batch_state.BatchState)
    batches/{batch_id}.log         answered lines, appended as they are gathered (one JSON object a line)
    batches/{batch_id}.cancel      present once someone asked to cancel (any replica may write it)

Whole files are written atomically (a temporary file in the same folder, fsync, rename, fsync the folder),
so a reader or a restarted gateway sees the old version or the new one, never half of one. The log is
append-only: a crash can leave a torn last line, which `read_log` ignores (that line was not acknowledged
as gathered, so it is gathered again from its result key).
"""

from __future__ import annotations

import contextlib
import os
import re
import time
import uuid
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, Literal

import msgspec

_ID = re.compile(r"(file|batch)[-_][A-Za-z0-9_-]{1,100}")


def new_id(kind: Literal["file", "batch"]) -> str:
    return f"file-{uuid.uuid4().hex}" if kind == "file" else f"batch_{uuid.uuid4().hex}"


def atomic_write(path: Path, data: bytes) -> None:
    """Replace `path` with `data` all at once, durably (the rename is the commit)."""
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        with open(tmp, "wb") as out:
            out.write(data)
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    _fsync_dir(path.parent)


def _fsync_dir(folder: Path) -> None:
    """Makes a rename or a new file in `folder` survive a crash of the machine, not only of the process."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class FileObject(msgspec.Struct, kw_only=True):
    """OpenAI's file object, as stored and as answered."""

    id: str
    bytes: int
    created_at: int
    filename: str
    purpose: str
    object: str = "file"
    status: str = "processed"
    expires_at: int | None = None
    status_details: str | None = None
    requests: int = 0  # non-blank lines of an input file (ours: the caller's limit check needs it once)

    def public(self) -> dict[str, Any]:
        out = msgspec.to_builtins(self)
        out.pop("requests")
        return out

    def expired(self, now_s: float) -> bool:
        return self.expires_at is not None and self.expires_at <= now_s


class Storage:
    """Files and batch states under one root folder; every method is blocking file I/O (the HTTP side runs
    the slow ones in a thread)."""

    def __init__(self, root: Path):
        self.root = root
        self.files, self.batches = root / "files", root / "batches"
        self.files.mkdir(parents=True, exist_ok=True)
        self.batches.mkdir(parents=True, exist_ok=True)

    @staticmethod
    def valid_id(value: str) -> bool:
        """Ids come from URLs: only our own shape may become a path (no '..', no '/')."""
        return _ID.fullmatch(value) is not None

    # ---- files ----------------------------------------------------------------------------------------------
    def put_file(self, meta: FileObject, content: bytes | Path) -> None:
        """Content first, then the object: a file is listed only once its content is whole. A Path is moved in
        (an upload spooled to a temporary file in the same folder)."""
        target = self.files / f"{meta.id}.jsonl"
        if isinstance(content, Path):
            os.replace(content, target)
            _fsync_dir(self.files)
        else:
            atomic_write(target, content)
        atomic_write(self.files / f"{meta.id}.json", msgspec.json.encode(meta))

    def spool_path(self) -> Path:
        """A temporary path beside the files, for an upload written as it arrives."""
        return self.files / f".upload-{uuid.uuid4().hex}.tmp"

    def get_file(self, file_id: str, now_s: float | None = None) -> FileObject | None:
        """The file object, or None when unknown, deleted or expired."""
        if not self.valid_id(file_id):
            return None
        try:
            meta = msgspec.json.decode((self.files / f"{file_id}.json").read_bytes(), type=FileObject)
        except FileNotFoundError:
            return None
        return None if meta.expired(time.time() if now_s is None else now_s) else meta

    def content_path(self, file_id: str) -> Path:
        return self.files / f"{file_id}.jsonl"

    def list_files(self, now_s: float | None = None) -> list[FileObject]:
        now = time.time() if now_s is None else now_s
        found = []
        for path in self.files.glob("*.json"):
            with contextlib.suppress(FileNotFoundError, msgspec.DecodeError):  # deleted meanwhile, or foreign
                meta = msgspec.json.decode(path.read_bytes(), type=FileObject)
                if not meta.expired(now):
                    found.append(meta)
        return sorted(found, key=lambda f: (f.created_at, f.id))

    def delete_file(self, file_id: str) -> bool:
        """Object first: once it is gone the file is unknown, whatever happens to the content after."""
        if not self.valid_id(file_id):
            return False
        try:
            (self.files / f"{file_id}.json").unlink()
        except FileNotFoundError:
            return False
        self.content_path(file_id).unlink(missing_ok=True)
        return True

    def sweep_expired(self, now_s: float | None = None) -> list[str]:
        """Deletes expired files; their ids. Unreadable objects are left for a person to look at."""
        now = time.time() if now_s is None else now_s
        gone = []
        for path in self.files.glob("*.json"):
            with contextlib.suppress(FileNotFoundError, msgspec.DecodeError):
                meta = msgspec.json.decode(path.read_bytes(), type=FileObject)
                if meta.expired(now) and self.delete_file(meta.id):
                    gone.append(meta.id)
        for stale in self.files.glob(".upload-*.tmp"):  # uploads cut off by a crash, after an hour
            with contextlib.suppress(FileNotFoundError):
                if stale.stat().st_mtime < now - 3600:
                    stale.unlink()
        return gone

    # ---- batches ----------------------------------------------------------------------------------------------
    def state_path(self, batch_id: str) -> Path:
        return self.batches / f"{batch_id}.json"

    def put_state(self, batch_id: str, data: bytes) -> None:
        atomic_write(self.state_path(batch_id), data)

    def get_state(self, batch_id: str) -> bytes | None:
        if not self.valid_id(batch_id):
            return None
        try:
            return self.state_path(batch_id).read_bytes()
        except FileNotFoundError:
            return None

    def batch_ids(self) -> list[str]:
        return sorted(p.stem for p in self.batches.glob("batch_*.json"))

    def request_cancel(self, batch_id: str, at_s: int) -> None:
        """Any replica may ask; the one gathering the batch acts on it. The first ask's time stands."""
        path = self.batches / f"{batch_id}.cancel"
        if not path.exists():
            atomic_write(path, str(at_s).encode())

    def cancel_requested(self, batch_id: str) -> int | None:
        try:
            return int((self.batches / f"{batch_id}.cancel").read_bytes())
        except (FileNotFoundError, ValueError):
            return None

    # ---- the log of answered lines ------------------------------------------------------------------------------
    def log_path(self, batch_id: str) -> Path:
        return self.batches / f"{batch_id}.log"

    def append_log(self, batch_id: str, entries: Iterable[bytes]) -> None:
        """Appends encoded entries (one JSON object each), durably, before the caller counts them."""
        data = b"".join(e + b"\n" for e in entries)
        if not data:
            return
        with open(self.log_path(batch_id), "ab") as out:
            out.write(data)
            out.flush()
            os.fsync(out.fileno())

    def read_log(self, batch_id: str) -> Iterator[bytes]:
        """The log's whole lines; a torn last line (a crash mid-append: no newline after it) is skipped."""
        try:
            data = self.log_path(batch_id).read_bytes()
        except FileNotFoundError:
            return
        for line in data[:data.rfind(b"\n") + 1].split(b"\n"):
            if line.strip():
                yield line

    def repair_log(self, batch_id: str) -> None:
        """Cuts a torn last line off, so that the next append starts a line of its own (the gatherer calls it
        when it takes the batch over)."""
        path = self.log_path(batch_id)
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            return
        whole = data.rfind(b"\n") + 1
        if whole < len(data):
            with open(path, "r+b") as out:
                out.truncate(whole)
                os.fsync(out.fileno())
