"""The Batch API's HTTP routes: ``/v1/files`` (JSONL inputs and the output and error files),
``/v1/uploads`` (an input file sent in parts) and ``/v1/batches``. They find the process's runner at ``app.state.batches``; the routes are mounted
in the app's one route table (``gateway.app``)."""

from __future__ import annotations

import asyncio
import hashlib
import mimetypes
import re
import secrets
import time
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator
from starlette.datastructures import UploadFile
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from batch.endpoints import ENDPOINTS
from batch.lines import jsonl_lines
from batch.runner import Runner
from batch.store import BatchInfo, FileInfo
from batch.uploads import MAX_PART_BYTES, PartRefused, UploadInfo, UploadStore
from batch.uploads import TTL_S as UPLOAD_TTL_S
from gateway.auth import Caller
from gateway.errors import APIError, bad_request, not_found
from gateway.multipart import FORM_SLACK, Multipart
from gateway.schemas import is_count, parse, read_json
from gateway.service import Services
from gateway.vision import image_type

BATCH_ENDPOINTS = tuple(ENDPOINTS)  # the urls a batch's lines may call
WINDOW_S = 24 * 3600
PURPOSES = ("batch", "assistants", "user_data", "fine-tune", "vision")  # a batch's input, a document for vector
# stores, a fine-tuning job's examples (tuning/: checked whole when a job names it), or an image a response reads
# (an input_image's file_id: gateway/responses.py; user_data files may be images too)


# -- files -------------------------------------------------------------------------------------

def batch_context(request: Request) -> tuple[Services, Runner, Caller]:
    """A batch route's services, the process's runner, and the authenticated caller (no gate: these
    routes take no slot). Shared with Anthropic's message batches (``batch.message_batches``)."""
    svc: Services = request.app.state.services
    return svc, request.app.state.batches, svc.authenticate(request)


async def upload_file(request: Request) -> Response:
    """POST /v1/files: multipart ``file`` and ``purpose``: ``batch`` (JSONL, a batch's input) or a
    document for vector stores (``assistants``, ``user_data``: read when a vector store adds it)."""
    svc, runner, caller = batch_context(request)
    cfg = svc.config.batch
    too_big = APIError(413, f"the file is larger than {cfg.max_file_bytes} bytes", "file_too_large", "file")
    async with Multipart(request, cfg.max_file_bytes, "the fields 'file' and 'purpose'", "file", max_fields=8,
                         too_large=too_big) as form:
        purpose, upload = form.get("purpose"), form.get("file")
        if purpose is None:
            raise bad_request("missing required parameter: purpose", "purpose", "missing_required_parameter")
        if purpose not in PURPOSES:
            raise bad_request(f"purpose is {purpose!r}; this server takes {', '.join(map(repr, PURPOSES))} files", "purpose")
        if not isinstance(upload, UploadFile):
            raise bad_request("missing required parameter: file (a file part)", "file", "missing_required_parameter")
        content = await upload.read(cfg.max_file_bytes + 1)
        filename = upload.filename or "upload.jsonl"
        expires_after = _form_expires_after(form)
    if len(content) > cfg.max_file_bytes:
        raise too_big
    info = await new_file(svc, runner, caller, filename, content, expires_after.seconds if expires_after else None,
                           purpose=purpose)
    return JSONResponse(info.public())


async def new_file(svc: Services, runner: Runner, caller: Caller, filename: str, content: bytes,
                    expires_after_s: int | None, param: str = "file", purpose: str = "batch") -> FileInfo:
    """A file of ``purpose`` made of ``content`` and stored. A batch input must be UTF-8 JSON lines,
    at most ``batch.max_lines`` (a 400 naming ``param`` otherwise); a document is kept as sent."""
    if purpose == "batch":  # (a file of up to batch.max_file_bytes: decoded and counted off the event loop)
        await asyncio.to_thread(_check_lines, svc, content, param)
    elif purpose == "fine-tune":
        try:
            content.decode("utf-8")
        except UnicodeDecodeError:
            raise bad_request("a fine-tuning file is UTF-8 JSON lines", param, "invalid_file") from None
    elif purpose == "vision" and image_type(content) is None:
        raise bad_request("a vision file is an image (PNG, JPEG, WebP or GIF)", param, "invalid_file")
    now = int(time.time())
    info = FileInfo(f"file-{time.time_ns():016x}{secrets.token_hex(8)}",  # ids sort by time, as batches' do
                    caller.key_id, purpose, filename, len(content), now, now + expires_after_s if expires_after_s else None)
    await runner.store.put_file(info, content)
    return info


def _check_lines(svc: Services, content: bytes, param: str) -> None:
    limit = svc.config.batch.max_lines
    try:
        text = content.decode("utf-8")
    except UnicodeDecodeError:
        raise bad_request("the file is not UTF-8 text (JSONL expected)", param, "invalid_file") from None
    n = sum(1 for ln in jsonl_lines(text) if ln.strip())
    if n > limit:
        raise bad_request(f"the file has {n} requests; at most {limit} are allowed", param, "too_many_lines")


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
    _, runner, caller = batch_context(request)
    return JSONResponse((await _owned_file(runner, caller, request.path_params["file_id"])).public())


async def list_files(request: Request) -> Response:
    """GET /v1/files?purpose=&limit=&order=&after=: the caller's files (an admin's: everyone's),
    newest first unless ``order=asc``; ``limit`` 1 to 10,000, 10,000 unless given (OpenAI's)."""
    _, runner, caller = batch_context(request)
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
    _, runner, caller = batch_context(request)
    info = await _owned_file(runner, caller, request.path_params["file_id"])
    content = await runner.store.file_content(info.id)
    if content is None:  # deleted meanwhile
        raise not_found(f"no such file: '{info.id}'", "file_id", "file_not_found")
    safe = re.sub(r"[^A-Za-z0-9._-]", "_", info.filename)  # the uploader chose it: keep it out of the header
    return Response(content, media_type=media_type(info.filename),
                    headers={"content-disposition": f'attachment; filename="{safe}"'})


def media_type(filename: str) -> str:
    """A file's content type by its name's extension (JSONL, which ``mimetypes`` does not know: a
    batch's and a fine-tuning file's), else ``application/octet-stream``."""
    if filename.lower().endswith(".jsonl"):
        return "application/jsonl"
    return mimetypes.guess_type(filename, strict=False)[0] or "application/octet-stream"


async def delete_file(request: Request) -> Response:
    _, runner, caller = batch_context(request)
    info = await _owned_file(runner, caller, request.path_params["file_id"])
    stores = getattr(request.app.state, "vector_stores", None)
    if stores is not None:  # first, so that a failure leaves the file there to delete again
        await stores.remove_everywhere([info.id])
    deleted = await runner.store.delete_file(info.id)
    return JSONResponse({"id": info.id, "object": "file", "deleted": deleted})


# -- uploads (a file in parts: client.uploads.upload_file_chunked) ------------------------------

UPLOAD_MIME_TYPES = ("application/jsonl", "application/x-ndjson", "application/json", "text/jsonl", "text/plain")
IMAGE_MIME_TYPES = ("image/png", "image/jpeg", "image/webp", "image/gif")
# what an upload of each purpose may declare itself to be (documents: any type; their text is read when used)
MIME_TYPES_BY_PURPOSE = {"batch": UPLOAD_MIME_TYPES, "fine-tune": UPLOAD_MIME_TYPES, "vision": IMAGE_MIME_TYPES}


class UploadCreate(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    bytes: int = Field(ge=0)
    filename: str = Field(min_length=1, max_length=512)
    mime_type: str
    purpose: str
    expires_after: ExpiresAfter | None = None  # the file's, once made


class UploadComplete(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    part_ids: list[str] = Field(max_length=10_000)
    md5: str | None = None


def _uploads(request: Request) -> UploadStore:
    return request.app.state.uploads


async def _owned_upload(request: Request, caller: Caller) -> UploadInfo:
    upload_id = request.path_params["upload_id"]
    upload = await _uploads(request).get(upload_id)
    if upload is None or not _sees(caller, upload.owner):
        raise not_found(f"no such upload: '{upload_id}'", "upload_id", "upload_not_found")
    return upload


def _not_pending(upload: UploadInfo) -> APIError:
    return bad_request(f"the upload is {upload.status_at(time.time())}, not pending", None, "upload_not_pending")


async def _shown(runner: Runner, upload: UploadInfo) -> dict:
    """The upload as the API shows it: a completed one with its file (None once the file is deleted)."""
    file = await runner.store.get_file(upload.file_id) if upload.file_id else None
    return upload.public(file.public() if file else None)


async def create_upload(request: Request) -> Response:
    """POST /v1/uploads: an upload that takes parts for an hour, then ``complete`` makes the file, of
    any purpose ``POST /v1/files`` takes (a batch's lines, a document for a vector store, ...)."""
    svc, _, caller = batch_context(request)
    body = parse(UploadCreate, await read_json(request, svc.config.limits.max_body))
    if body.purpose not in PURPOSES:
        raise bad_request(f"purpose is {body.purpose!r}; this server takes {', '.join(map(repr, PURPOSES))} files",
                          "purpose")
    allowed = MIME_TYPES_BY_PURPOSE.get(body.purpose)
    if allowed is not None and body.mime_type not in allowed:
        what = "an image" if body.purpose == "vision" else "JSON lines"
        raise bad_request(f"mime_type is {body.mime_type!r}; a {body.purpose} file is {what}: one of {', '.join(allowed)}",
                          "mime_type", "unsupported_mime_type")
    if body.bytes > svc.config.batch.max_file_bytes:
        raise bad_request(f"bytes is {body.bytes}; this server takes files of at most {svc.config.batch.max_file_bytes} bytes",
                          "bytes", "file_too_large")
    now = int(time.time())
    upload = UploadInfo(f"upload_{time.time_ns():016x}{secrets.token_hex(8)}", caller.key_id, body.filename, body.purpose,
                        body.bytes, body.mime_type, now, now + UPLOAD_TTL_S,
                        body.expires_after.seconds if body.expires_after else None)
    await _uploads(request).create(upload)
    return JSONResponse(upload.public())


async def add_upload_part(request: Request) -> Response:
    """POST /v1/uploads/{id}/parts: multipart ``data``, one part of at most 64 MiB."""
    svc, _, caller = batch_context(request)
    limit = min(MAX_PART_BYTES, svc.config.batch.max_file_bytes)
    too_big = APIError(413, f"a part is at most {limit} bytes", "part_too_large", "data")
    declared = request.headers.get("content-length", "")
    if is_count(declared) and int(declared) > limit + FORM_SLACK:  # before the upload is looked up, as before
        raise too_big
    upload = await _owned_upload(request, caller)
    async with Multipart(request, limit, "the field 'data'", "data", max_fields=4, too_large=too_big) as form:
        part = form.get("data")
        if not isinstance(part, UploadFile):
            raise bad_request("missing required parameter: data (a file part)", "data", "missing_required_parameter")
        data = await part.read(limit + 1)
    if len(data) > limit:
        raise too_big
    part_id, now = f"part_{secrets.token_hex(12)}", time.time()
    try:
        await _uploads(request).add_part(upload.id, part_id, data, now)
    except PartRefused as refused:
        if refused.reason == "not_pending":
            raise _not_pending(await _owned_upload(request, caller)) from None
        raise bad_request(f"this part's {len(data)} bytes would bring the upload to {refused.received + len(data)}, "
                          f"past the {upload.bytes} it was created for", "data", "upload_too_large") from None
    return JSONResponse({"id": part_id, "object": "upload.part", "created_at": int(now), "upload_id": upload.id})


async def complete_upload(request: Request) -> Response:
    """POST /v1/uploads/{id}/complete: ``part_ids`` in order (parts left out are dropped) and an
    optional ``md5`` of the whole; the parts must add up to the upload's ``bytes``. The file is
    checked as ``POST /v1/files`` checks one. Completing a completed upload again returns it."""
    svc, runner, caller = batch_context(request)
    body = parse(UploadComplete, await read_json(request, svc.config.limits.max_body))
    upload = await _owned_upload(request, caller)
    if upload.status == "completed":
        return JSONResponse(await _shown(runner, upload))
    if upload.status_at(time.time()) != "pending":
        raise _not_pending(upload)
    if len(set(body.part_ids)) != len(body.part_ids):
        raise bad_request("part_ids names a part twice", "part_ids")
    held = await _uploads(request).parts(upload.id, body.part_ids)
    missing = [p for p, data in zip(body.part_ids, held) if data is None]
    if missing:
        raise bad_request(f"the upload has no part '{missing[0]}'", "part_ids", "part_not_found")
    content = b"".join(held)
    if len(content) != upload.bytes:
        raise bad_request(f"the parts add up to {len(content)} bytes; the upload was created for {upload.bytes}",
                          "part_ids", "bytes_mismatch")
    if body.md5 is not None and await asyncio.to_thread(lambda: hashlib.md5(content).hexdigest()) != body.md5.lower():
        raise bad_request("the parts' md5 is not the one given", "md5", "md5_mismatch")
    info = await new_file(svc, runner, caller, upload.filename, content, upload.file_expires_after_s, "part_ids",
                           upload.purpose)
    ended = await _uploads(request).end(upload.id, "completed", info.id, time.time())
    if ended is None:  # another call completed or cancelled it meanwhile (or it expired): one file only
        await runner.store.delete_file(info.id)
        upload = await _owned_upload(request, caller)
        if upload.status != "completed":
            raise _not_pending(upload)
        return JSONResponse(await _shown(runner, upload))
    return JSONResponse(ended.public(info.public()))


async def cancel_upload(request: Request) -> Response:
    """POST /v1/uploads/{id}/cancel: no more parts; those received are deleted."""
    _, runner, caller = batch_context(request)
    upload = await _owned_upload(request, caller)
    if upload.status == "cancelled":
        return JSONResponse(upload.public())
    ended = await _uploads(request).end(upload.id, "cancelled", None, time.time())
    if ended is None:
        raise _not_pending(await _owned_upload(request, caller))
    return JSONResponse(ended.public())


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
    svc, runner, caller = batch_context(request)
    body = parse(BatchCreate, await read_json(request, svc.config.limits.max_body))
    if body.endpoint not in runner.endpoints:
        served = ", ".join(sorted(runner.endpoints))
        raise bad_request(f"{body.endpoint} is not served in batches by this server (it serves {served})", "endpoint")
    info = await _owned_file(runner, caller, body.input_file_id, "input_file_id")
    if info.purpose != "batch":
        raise bad_request(f"the file's purpose is {info.purpose!r}, not 'batch'", "input_file_id")
    batch = await start_batch(runner, caller, body.endpoint, info, body.metadata,
                              body.output_expires_after.seconds if body.output_expires_after else None)
    return JSONResponse(batch.public())


async def start_batch(runner: Runner, caller: Caller, endpoint: str, input_file: FileInfo,
                      metadata: dict[str, str] | None = None, output_expires_after_s: int | None = None,
                      requests: int | None = None) -> BatchInfo:
    """A new batch of ``caller``'s running ``input_file``'s lines on ``endpoint`` (``requests`` of
    them, where the caller knows), stored and handed to the runner to validate (OpenAI's batches
    here, Anthropic's message batches too)."""
    now = int(time.time())
    batch = BatchInfo(id=f"batch_{time.time_ns():016x}{secrets.token_hex(4)}",  # ids sort by time
                      owner=caller.key_id, endpoint=endpoint, input_file_id=input_file.id, completion_window="24h",
                      created_at=now, expires_at=now + WINDOW_S, metadata=metadata,
                      output_expires_after_s=output_expires_after_s, requests=requests)
    await runner.store.create_batch(batch)
    runner.soon("validate", batch.id)
    return batch


async def _owned_batch(runner: Runner, caller: Caller, batch_id: str) -> BatchInfo:
    batch = await runner.store.get_batch(batch_id)
    if batch is None or not _sees(caller, batch.owner):
        raise not_found(f"no such batch: '{batch_id}'", "batch_id", "batch_not_found")
    return batch


async def get_batch(request: Request) -> Response:
    _, runner, caller = batch_context(request)
    return JSONResponse((await _owned_batch(runner, caller, request.path_params["batch_id"])).public())


async def list_batches(request: Request) -> Response:
    """GET /v1/batches?after=&limit=: the caller's batches (an admin's: everyone's), newest first."""
    _, runner, caller = batch_context(request)
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
    _, runner, caller = batch_context(request)
    batch = await _owned_batch(runner, caller, request.path_params["batch_id"])
    if await runner.store.set_status(batch.id, ["validating", "in_progress"], "cancelling",
                                     cancelling_at=int(time.time())):
        runner.soon("finish", batch.id)
    else:
        batch = await _owned_batch(runner, caller, batch.id)
        if batch.status not in ("cancelling", "cancelled"):
            raise APIError(409, f"cannot cancel a batch that is {batch.status}", "batch_not_cancellable")
    return JSONResponse((await _owned_batch(runner, caller, batch.id)).public())
