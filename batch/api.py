"""The Batch API's HTTP routes: ``/v1/files`` (JSONL inputs and the output and error files) and
``/v1/batches``. They find the process's runner at ``app.state.batches``; the routes are mounted
in the app's one route table (``gateway.app``)."""

from __future__ import annotations

import re
import secrets
import time
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator
from starlette.datastructures import UploadFile
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from batch.endpoints import ENDPOINTS
from batch.runner import Runner
from batch.store import BatchInfo, FileInfo
from gateway.auth import Caller
from gateway.errors import APIError, bad_request, not_found
from gateway.schemas import is_count, parse, read_json
from gateway.service import Services

BATCH_ENDPOINTS = tuple(ENDPOINTS)  # the urls a batch's lines may call
WINDOW_S = 24 * 3600
_FORM_SLACK = 64 * 1024  # multipart framing on top of the file itself


# -- files -------------------------------------------------------------------------------------

def _context(request: Request) -> tuple[Services, Runner, Caller]:
    svc: Services = request.app.state.services
    return svc, request.app.state.batches, svc.authenticate(request)


async def upload_file(request: Request) -> Response:
    """POST /v1/files: multipart ``file`` (JSONL) and ``purpose=batch``."""
    svc, runner, caller = _context(request)
    cfg = svc.config.batch
    if not request.headers.get("content-type", "").startswith("multipart/form-data"):
        raise APIError(415, "upload files as multipart/form-data with the fields 'file' and 'purpose'",
                       "unsupported_media_type")
    too_big = APIError(413, f"the file is larger than {cfg.max_file_bytes} bytes", "file_too_large", "file")
    declared = request.headers.get("content-length", "")
    if is_count(declared) and int(declared) > cfg.max_file_bytes + _FORM_SLACK:
        raise too_big
    try:
        form = await _capped(request, cfg.max_file_bytes + _FORM_SLACK, too_big).form(max_files=1, max_fields=8)
    except HTTPException as exc:  # what Starlette's parser says of a malformed body (as /v1/audio/transcriptions)
        raise bad_request(f"malformed multipart body: {exc.detail}", None, "invalid_multipart") from None
    try:
        purpose, upload = form.get("purpose"), form.get("file")
        if purpose is None:
            raise bad_request("missing required parameter: purpose", "purpose", "missing_required_parameter")
        if purpose != "batch":
            raise bad_request(f"purpose is {purpose!r}; this server takes only 'batch' files", "purpose")
        if not isinstance(upload, UploadFile):
            raise bad_request("missing required parameter: file (a file part)", "file", "missing_required_parameter")
        content = await upload.read(cfg.max_file_bytes + 1)
        filename = upload.filename or "upload.jsonl"
        expires_after = _form_expires_after(form)
    finally:
        await form.close()
    if len(content) > cfg.max_file_bytes:
        raise too_big
    try:
        text = content.decode("utf-8")
    except UnicodeDecodeError:
        raise bad_request("the file is not UTF-8 text (JSONL expected)", "file", "invalid_file") from None
    n = sum(1 for ln in text.splitlines() if ln.strip())
    if n > cfg.max_lines:
        raise bad_request(f"the file has {n} requests; at most {cfg.max_lines} are allowed", "file", "too_many_lines")
    now = int(time.time())
    info = FileInfo(f"file-{time.time_ns():016x}{secrets.token_hex(8)}",  # ids sort by time, as batches' do
                    caller.key_id, "batch", filename, len(content), now, now + expires_after.seconds if expires_after else None)
    await runner.store.put_file(info, content)
    return JSONResponse(info.public())


class ExpiresAfter(BaseModel):
    """A file's expiry, as OpenAI takes it: ``seconds`` after its ``created_at``."""

    model_config = ConfigDict(extra="forbid")

    anchor: Literal["created_at"]
    seconds: int = Field(ge=3600, le=30 * 86400)  # OpenAI's bounds: an hour to 30 days


def _form_expires_after(form) -> ExpiresAfter | None:
    """``expires_after[anchor]`` and ``expires_after[seconds]`` of a multipart upload (how the SDKs
    send the object there), or None when neither is given."""
    fields = {k[len("expires_after["):-1]: v for k, v in form.multi_items()
              if k.startswith("expires_after[") and k.endswith("]")}
    if not fields:
        return None
    return parse(_Upload, {"expires_after": fields}).expires_after


class _Upload(BaseModel):
    expires_after: ExpiresAfter


def _capped(request: Request, limit: int, error: APIError) -> Request:
    """``request`` whose body raises ``error`` once more than ``limit`` bytes have arrived."""
    seen = 0

    async def receive() -> dict:
        nonlocal seen
        message = await request.receive()
        seen += len(message.get("body", b""))
        if seen > limit:
            raise error
        return message

    return Request(request.scope, receive)


def _sees(caller: Caller, owner: str) -> bool:
    """An admin key sees every file and batch; any other key only its own."""
    return caller.admin or owner == caller.key_id


async def _owned_file(runner: Runner, caller: Caller, file_id: str, param: str = "file_id") -> FileInfo:
    """The file if ``caller`` may see it; 404 alike for missing files and other keys' files."""
    info = await runner.store.get_file(file_id)
    if info is None or not _sees(caller, info.owner):
        raise not_found(f"no such file: '{file_id}'", param, "file_not_found")
    return info


async def get_file(request: Request) -> Response:
    _, runner, caller = _context(request)
    return JSONResponse((await _owned_file(runner, caller, request.path_params["file_id"])).public())


async def list_files(request: Request) -> Response:
    """GET /v1/files?purpose=&limit=&order=&after=: the caller's files (an admin's: everyone's),
    newest first unless ``order=asc``; ``limit`` 1 to 10,000, 10,000 unless given (OpenAI's)."""
    _, runner, caller = _context(request)
    query = request.query_params
    raw = query.get("limit", "10000")
    if not is_count(raw) or not 1 <= int(raw) <= 10_000:
        raise bad_request(f"limit must be an integer from 1 to 10000, not {raw!r}", "limit")
    order = query.get("order", "desc")
    if order not in ("asc", "desc"):
        raise bad_request(f"order must be 'asc' or 'desc', not {order!r}", "order")
    limit, after = int(raw), query.get("after") or None
    owner = None if caller.admin else caller.key_id
    page = await runner.store.list_files(owner, query.get("purpose") or None, after, limit + 1, order == "asc")
    if page is None:
        raise bad_request(f"no such file to list after: '{after}' (deleted or expired since: list from the start)",
                          "after", "file_not_found")
    data = [f.public() for f in page[:limit]]
    return JSONResponse({"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
                         "last_id": data[-1]["id"] if data else None, "has_more": len(page) > limit})


async def file_content(request: Request) -> Response:
    _, runner, caller = _context(request)
    info = await _owned_file(runner, caller, request.path_params["file_id"])
    content = await runner.store.file_content(info.id)
    if content is None:  # deleted meanwhile
        raise not_found(f"no such file: '{info.id}'", "file_id", "file_not_found")
    safe = re.sub(r"[^A-Za-z0-9._-]", "_", info.filename)  # the uploader chose it: keep it out of the header
    return Response(content, media_type="application/jsonl", headers={"content-disposition": f'attachment; filename="{safe}"'})


async def delete_file(request: Request) -> Response:
    _, runner, caller = _context(request)
    info = await _owned_file(runner, caller, request.path_params["file_id"])
    deleted = await runner.store.delete_file(info.id)
    return JSONResponse({"id": info.id, "object": "file", "deleted": deleted})


# -- batches -----------------------------------------------------------------------------------

class BatchCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")

    input_file_id: str = Field(min_length=1)
    endpoint: Literal[BATCH_ENDPOINTS]
    completion_window: Literal["24h"]
    metadata: dict[str, str] | None = None
    output_expires_after: ExpiresAfter | None = None  # the output and error files' expiry

    @field_validator("metadata")
    @classmethod
    def _metadata(cls, v: dict[str, str] | None) -> dict[str, str] | None:
        if v is not None and (len(v) > 16 or any(len(k) > 64 or len(x) > 512 for k, x in v.items())):
            raise ValueError("at most 16 pairs, keys up to 64 characters, values up to 512")
        return v


async def create_batch(request: Request) -> Response:
    svc, runner, caller = _context(request)
    body = parse(BatchCreate, await read_json(request, svc.config.limits.max_body))
    if body.endpoint not in runner.endpoints:
        served = ", ".join(sorted(runner.endpoints))
        raise bad_request(f"{body.endpoint} is not served in batches by this server (it serves {served})", "endpoint")
    info = await _owned_file(runner, caller, body.input_file_id, "input_file_id")
    if info.purpose != "batch":
        raise bad_request(f"the file's purpose is {info.purpose!r}, not 'batch'", "input_file_id")
    now = int(time.time())
    batch = BatchInfo(id=f"batch_{time.time_ns():016x}{secrets.token_hex(4)}",  # ids sort by time
                      owner=caller.key_id, endpoint=body.endpoint, input_file_id=info.id,
                      completion_window=body.completion_window, created_at=now, expires_at=now + WINDOW_S,
                      metadata=body.metadata,
                      output_expires_after_s=body.output_expires_after.seconds if body.output_expires_after else None)
    await runner.store.create_batch(batch)
    runner.soon("validate", batch.id)
    return JSONResponse(batch.public())


async def _owned_batch(runner: Runner, caller: Caller, batch_id: str) -> BatchInfo:
    batch = await runner.store.get_batch(batch_id)
    if batch is None or not _sees(caller, batch.owner):
        raise not_found(f"no such batch: '{batch_id}'", "batch_id", "batch_not_found")
    return batch


async def get_batch(request: Request) -> Response:
    _, runner, caller = _context(request)
    return JSONResponse((await _owned_batch(runner, caller, request.path_params["batch_id"])).public())


async def list_batches(request: Request) -> Response:
    """GET /v1/batches?after=&limit=: the caller's batches (an admin's: everyone's), newest first."""
    _, runner, caller = _context(request)
    raw = request.query_params.get("limit", "20")
    if not is_count(raw) or not 1 <= int(raw) <= 100:
        raise bad_request(f"limit must be an integer from 1 to 100, not {raw!r}", "limit")
    limit = int(raw)
    owner = None if caller.admin else caller.key_id
    page = await runner.store.list_batches(owner, request.query_params.get("after") or None, limit + 1)
    data = [b.public() for b in page[:limit]]
    return JSONResponse({"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
                         "last_id": data[-1]["id"] if data else None, "has_more": len(page) > limit})


async def cancel_batch(request: Request) -> Response:
    _, runner, caller = _context(request)
    batch = await _owned_batch(runner, caller, request.path_params["batch_id"])
    if await runner.store.set_status(batch.id, ["validating", "in_progress"], "cancelling",
                                     cancelling_at=int(time.time())):
        runner.soon("finish", batch.id)
    else:
        batch = await _owned_batch(runner, caller, batch.id)
        if batch.status not in ("cancelling", "cancelled"):
            raise APIError(409, f"cannot cancel a batch that is {batch.status}", "batch_not_cancellable")
    return JSONResponse((await _owned_batch(runner, caller, batch.id)).public())
