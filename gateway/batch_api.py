"""The Batch API's HTTP side, as the official `openai` client calls it: /v1/files and /v1/batches.

    POST   /v1/files                 multipart: `file` (JSONL), `purpose` ("batch"), optional expires_after
    GET    /v1/files                 ?purpose= &limit= &order= &after=  (a cursor page)
    GET    /v1/files/{id}            the file object
    GET    /v1/files/{id}/content    the bytes (input, output and error files alike)
    DELETE /v1/files/{id}
    POST   /v1/batches               {input_file_id, endpoint, completion_window, metadata, output_expires_after}
    GET    /v1/batches               ?limit= &after=  (newest first)
    GET    /v1/batches/{id}          status, request_counts, output_file_id, error_file_id, usage
    POST   /v1/batches/{id}/cancel

Every answer comes from the storage path, so any replica serves any batch's files; the gathering itself
is gateway.batches'. A file that is not JSONL is a 400 at upload; a JSONL line that is not a valid request
becomes a line of the batch's error file.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

from starlette.datastructures import FormData, UploadFile
from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, Response
from starlette.routing import Route
from stoker.client.options import option
from stoker.gateway.batch_lines import ENDPOINTS, NotJSONL, check_jsonl, parse_window
from stoker.gateway.batch_state import BatchState, encode_state
from stoker.gateway.batches import BatchConfig, BatchService
from stoker.gateway.mapping import APIError, json_object
from stoker.gateway.storage import FileObject, new_id

log = logging.getLogger("stoker.gateway.batch_api")
EXPIRES_AFTER_S = (3600, 30 * 86400)  # OpenAI's range for expires_after.seconds: an hour to 30 days
MAX_METADATA_PAIRS, MAX_METADATA_KEY, MAX_METADATA_VALUE = 16, 64, 512
COPY_CHUNK = 1 << 20
F = TypeVar("F", bound=Callable[..., Any])


def route_label(path: str) -> str | None:
    """The metrics label of a Batch API path (ids folded, so labels stay few), or None for other paths."""
    parts = path.rstrip("/").split("/")
    if parts[:3] not in (["", "v1", "files"], ["", "v1", "batches"]):
        return None
    return "/".join(parts[:3] + ["{id}"] * (len(parts) > 3) + parts[4:5])


def batch_options(f: F) -> F:
    """The gateway's Batch API flags (`stoker-gateway --help` shows them with their environment twins)."""
    for decl, env, kind, default, text in reversed([
        ("--storage-path", "STOKER_STORAGE_PATH", Path, Path.home() / ".local/share/stoker/gateway",
         "folder of the Batch API's files and batch states (shared by replicas that serve the same batches)"),
        ("--batch-topic", "STOKER_BATCH_TOPIC", str, None, "topic of every batch job (default: per line, the batch "
         "topic that the workers serving its model name in their heartbeats)"),
        ("--batch-max-in-flight", "STOKER_BATCH_MAX_IN_FLIGHT", int, 2048, "lines of one batch out at a time"),
        ("--batch-lease-ttl", "STOKER_BATCH_LEASE_TTL_S", float, 10.0,
         "seconds before another replica takes over the batches of one that died"),
        ("--max-upload-bytes", "STOKER_MAX_UPLOAD_BYTES", int, 200 * 1024 * 1024, "largest file /v1/files takes"),
        ("--batch-max-requests", "STOKER_BATCH_MAX_REQUESTS", int, 50_000, "most requests in one batch file"),
    ]):
        f = option(decl, env=env, type=kind, default=default, show_default=default is not None, help=text)(f)
    return f


def batch_config(params: dict[str, Any]) -> BatchConfig:
    return BatchConfig(storage_path=params["storage_path"], batch_topic=params["batch_topic"] or None,
                       max_in_flight=params["batch_max_in_flight"], lease_ttl_s=params["batch_lease_ttl"],
                       max_upload_bytes=params["max_upload_bytes"], max_requests=params["batch_max_requests"])


def _int_param(value: Any, name: str, low: int, high: int) -> int:
    try:
        number = int(value)
    except (TypeError, ValueError):
        number = low - 1
    if not low <= number <= high or isinstance(value, bool):
        raise APIError(400, f"`{name}` must be an integer in [{low}, {high}], got {value!r}", param=name,
                       code="invalid_value")
    return number


def _page(items: Sequence[Any], ids: list[str], after: str | None, limit: int) -> dict[str, Any]:
    """A cursor page (the openai client asks the next one with after=<last id> while has_more)."""
    start = ids.index(after) + 1 if after in ids else 0
    data = list(items[start:start + limit])
    shown = ids[start:start + limit]
    return {"object": "list", "data": data, "has_more": start + limit < len(ids),
            "first_id": shown[0] if shown else None, "last_id": shown[-1] if shown else None}


def _metadata(value: Any) -> dict[str, str] | None:
    if value is None:
        return None
    if (not isinstance(value, dict) or len(value) > MAX_METADATA_PAIRS or not all(
            isinstance(k, str) and isinstance(v, str) and len(k) <= MAX_METADATA_KEY and len(v) <= MAX_METADATA_VALUE
            for k, v in value.items())):
        raise APIError(400, f"`metadata` must be an object of at most {MAX_METADATA_PAIRS} string pairs (keys up to "
                       f"{MAX_METADATA_KEY} characters, values up to {MAX_METADATA_VALUE})", param="metadata",
                       code="invalid_value")
    return value


def _expires_after(anchor: Any, seconds: Any, name: str, default_s: int) -> int:
    """OpenAI's {anchor: "created_at", seconds} -> seconds after creation; absent -> the default."""
    if anchor is None and seconds is None:
        return default_s
    if anchor != "created_at":
        raise APIError(400, f"`{name}.anchor` must be \"created_at\", got {anchor!r}", param=name, code="invalid_value")
    return _int_param(seconds, f"{name}.seconds", *EXPIRES_AFTER_S)


ROUTE_TABLE = (("/v1/files", "create_file", "POST"), ("/v1/files", "list_files", "GET"),
               ("/v1/files/{file_id}", "get_file", "GET"), ("/v1/files/{file_id}", "delete_file", "DELETE"),
               ("/v1/files/{file_id}/content", "file_content", "GET"), ("/v1/batches", "create_batch", "POST"),
               ("/v1/batches", "list_batches", "GET"), ("/v1/batches/{batch_id}", "get_batch", "GET"),
               ("/v1/batches/{batch_id}/cancel", "cancel_batch", "POST"))


def batch_routes(api: Callable[[], BatchAPI]) -> list[Route]:
    """The Batch API's routes; `api` returns the BatchAPI, which exists once the app's lifespan started."""
    def endpoint(name: str) -> Callable[[Request], Any]:
        async def answer(request: Request) -> Response:
            handler = api()
            try:
                return await getattr(handler, name)(request)
            except APIError as exc:
                return handler.on_error(request, exc)
        return answer

    return [Route(path, endpoint(name), methods=[method]) for path, name, method in ROUTE_TABLE]


class BatchAPI:
    def __init__(self, service: BatchService, on_error: Callable[[Request, APIError], Response]):
        self.service, self.storage, self.cfg = service, service.storage, service.cfg
        self.on_error = on_error

    # ---- files ------------------------------------------------------------------------------------------------
    async def create_file(self, request: Request) -> Response:
        limit = self.cfg.max_upload_bytes
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > limit + COPY_CHUNK:  # + room for the form
            raise APIError(413, f"the upload is {length} bytes, over the limit of {limit}: split the file",
                           code="file_too_large")
        try:
            form = await request.form(max_files=1, max_fields=8)
        except Exception as exc:  # a body that is not a form: starlette's multipart parser says why
            raise APIError(400, f"send the file as multipart/form-data (fields `file`, `purpose`): {exc}",
                           code="invalid_form") from None
        try:
            return JSONResponse((await self._store_upload(form)).public())
        finally:
            await form.close()

    async def _store_upload(self, form: FormData) -> FileObject:
        if form.get("purpose") != "batch":
            raise APIError(400, f"`purpose` must be \"batch\" (the only use of files here), got {form.get('purpose')!r}",
                           param="purpose", code="invalid_value")
        upload = form.get("file")
        if not isinstance(upload, UploadFile):
            raise APIError(400, "send the JSONL file in the multipart field `file`", param="file", code="invalid_value")
        expires_s = _expires_after(form.get("expires_after[anchor]"), form.get("expires_after[seconds]"),
                                   "expires_after", self.cfg.file_expires_s)
        spool = self.storage.spool_path()
        try:
            size = await self._copy(upload, spool)
            try:
                count = await asyncio.to_thread(lambda: check_jsonl(spool.read_bytes(), self.cfg.max_requests))
            except NotJSONL as exc:
                raise APIError(400, f"{upload.filename or 'the file'}: {exc}", param="file", code="invalid_file") from None
            now = int(time.time())
            meta = FileObject(id=new_id("file"), bytes=size, created_at=now, filename=upload.filename or "batch.jsonl",
                              purpose="batch", expires_at=now + expires_s, requests=count)
            await asyncio.to_thread(self.storage.put_file, meta, spool)
            return meta
        finally:
            spool.unlink(missing_ok=True)

    async def _copy(self, upload: UploadFile, target: Path) -> int:
        size = 0
        with open(target, "wb") as out:
            while chunk := await upload.read(COPY_CHUNK):
                size += len(chunk)
                if size > self.cfg.max_upload_bytes:
                    raise APIError(413, f"the file is over the limit of {self.cfg.max_upload_bytes} bytes: split it",
                                   param="file", code="file_too_large")
                out.write(chunk)
        return size

    def _file(self, request: Request) -> FileObject:
        file_id = request.path_params["file_id"]
        meta = self.storage.get_file(file_id)
        if meta is None:
            raise APIError(404, f"no file {file_id!r} (never uploaded, deleted or expired)", param="file_id",
                           code="file_not_found")
        return meta

    async def get_file(self, request: Request) -> Response:
        return JSONResponse(self._file(request).public())

    async def file_content(self, request: Request) -> Response:
        meta = self._file(request)
        return FileResponse(self.storage.content_path(meta.id), media_type="application/jsonl",
                            filename=meta.filename)

    async def delete_file(self, request: Request) -> Response:
        meta = self._file(request)
        deleted = await asyncio.to_thread(self.storage.delete_file, meta.id)
        return JSONResponse({"id": meta.id, "object": "file", "deleted": deleted})

    async def list_files(self, request: Request) -> Response:
        query = request.query_params
        limit = _int_param(query.get("limit", 10_000), "limit", 1, 10_000)
        order = query.get("order", "desc")
        if order not in ("asc", "desc"):
            raise APIError(400, f"`order` must be \"asc\" or \"desc\", got {order!r}", param="order",
                           code="invalid_value")
        files = await asyncio.to_thread(self.storage.list_files)
        files = [f for f in files if query.get("purpose") in (None, f.purpose)]
        if order == "desc":
            files.reverse()
        return JSONResponse(_page([f.public() for f in files], [f.id for f in files], query.get("after"), limit))

    # ---- batches ---------------------------------------------------------------------------------------------
    async def create_batch(self, request: Request) -> Response:
        body = json_object(await request.body())
        state = self._new_state(body)
        await asyncio.to_thread(self.storage.put_state, state.id, encode_state(state))
        try:
            await self.service.kick(state.id)
        except Exception as exc:  # saved already: the next scan (of any replica) starts it
            log.warning("batch %s: not started at once (%s: %s); the next scan will", state.id, type(exc).__name__, exc)
        return JSONResponse(self._view(state))

    def _new_state(self, body: dict[str, Any]) -> BatchState:
        endpoint = body.get("endpoint")
        if endpoint not in ENDPOINTS:
            raise APIError(400, f"`endpoint` must be one of {', '.join(ENDPOINTS)}, got {endpoint!r}",
                           param="endpoint", code="invalid_value")
        file_id = body.get("input_file_id")
        meta = self.storage.get_file(file_id) if isinstance(file_id, str) else None
        if meta is None or meta.purpose != "batch":
            raise APIError(400 if meta else 404, f"`input_file_id` {file_id!r} is not an uploaded file of purpose "
                           "batch: upload it with POST /v1/files first", param="input_file_id",
                           code="invalid_value" if meta else "file_not_found")
        try:
            window_s = parse_window(body.get("completion_window"))
        except ValueError as exc:
            raise APIError(400, str(exc), param="completion_window", code="invalid_value") from None
        after = body.get("output_expires_after") or {}
        if not isinstance(after, dict):
            raise APIError(400, "`output_expires_after` must be an object", param="output_expires_after")
        now = time.time()
        return BatchState(
            id=new_id("batch"), input_file_id=meta.id, endpoint=endpoint, completion_window=body["completion_window"],
            created_at=int(now), deadline_ms=int((now + window_s) * 1000), metadata=_metadata(body.get("metadata")),
            output_expires_s=_expires_after(after.get("anchor"), after.get("seconds"), "output_expires_after",
                                            self.cfg.output_expires_s), total=meta.requests)

    def _state(self, request: Request) -> BatchState:
        batch_id = request.path_params["batch_id"]
        state = self.service.load(batch_id)
        if state is None:
            raise APIError(404, f"no batch {batch_id!r}", param="batch_id", code="batch_not_found")
        return state

    def _view(self, state: BatchState) -> dict[str, Any]:
        """The batch object; a cancel asked for and not yet seen by the replica gathering it shows already."""
        view = state.public()
        asked = self.storage.cancel_requested(state.id)
        if asked is not None and state.status in ("validating", "in_progress"):
            view.update(status="cancelling", cancelling_at=asked)
        return view

    async def get_batch(self, request: Request) -> Response:
        return JSONResponse(self._view(await asyncio.to_thread(self._state, request)))

    async def list_batches(self, request: Request) -> Response:
        limit = _int_param(request.query_params.get("limit", 20), "limit", 1, 100)
        states = [s for s in map(self.service.load, await asyncio.to_thread(self.storage.batch_ids)) if s is not None]
        states.sort(key=lambda s: (s.created_at, s.id), reverse=True)
        return JSONResponse(_page([self._view(s) for s in states], [s.id for s in states],
                                  request.query_params.get("after"), limit))

    async def cancel_batch(self, request: Request) -> Response:
        state = await asyncio.to_thread(self._state, request)
        if state.status in ("completed", "failed", "expired"):
            raise APIError(409, f"batch {state.id} is {state.status}: there is nothing left to cancel",
                           param="batch_id", code="batch_not_cancellable")
        if state.status != "cancelled":
            await asyncio.to_thread(self.storage.request_cancel, state.id, int(time.time()))
        with contextlib.suppress(Exception):  # nobody gathers it yet: take it now, so the cancel is acted on
            await self.service.kick(state.id)
        return JSONResponse(self._view(state))
