"""Anthropic's Message Batches API (``client.messages.batches`` in the ``anthropic`` SDK) on the
Batch API's store and runner: ``POST /v1/messages/batches``, ``GET`` one or a list, ``POST
.../cancel``, ``DELETE`` one, and ``GET .../results``.

A message batch is a batch (``batch.api``) whose lines call ``/v1/messages``
(``gateway.messages.message_result``): its requests become the lines of an input file the caller
owns (``message_batch.jsonl``), so they run at the batch tier, yield to live traffic, survive a
restart and are shared by every process on the store, as any batch's. Its id is the batch's with
Anthropic's prefix (``msgbatch_x`` is ``batch_x``; the OpenAI routes show it too, with its
endpoint). The object is Anthropic's:

* ``processing_status``: ``in_progress`` (validating, running or writing its files),
  ``canceling``, ``ended``;
* ``request_counts``: every request is ``processing`` until the batch ends, then ``succeeded``,
  ``errored``, ``canceled`` or ``expired`` (as Anthropic counts them);
* times as RFC 3339 strings; ``results_url`` once it ended.

Each request's ``params`` are checked when its line runs, as Anthropic checks them: a bad one is
an ``errored`` result with the error the live endpoint gives (tiergate's error object, with
Anthropic's ``"type": "error"`` around it). Results come in the requests' order. Deleting a batch
(ended only: cancel it first) deletes its input and result files with it.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from datetime import datetime, timezone
from typing import Any

from pydantic import Field
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from batch.api import batch_context, new_file, start_batch
from batch.runner import Runner
from batch.store import TERMINAL, BatchInfo
from gateway.auth import Caller
from gateway.errors import APIError, bad_request, not_found
from gateway.schemas import _Body, is_count, json_object, parse, read_body

ENDPOINT = "/v1/messages"
PREFIX = "msgbatch_"
CUSTOM_ID = re.compile(r"[A-Za-z0-9_-]{1,64}")
# an error line's code for a request that never ran, and the result it is
UNRUN = {"batch_cancelled": "canceled", "batch_expired": "expired"}


class BatchRequest(_Body):
    custom_id: str
    params: dict[str, Any]  # a Messages request, checked when it runs


class MessageBatchCreate(_Body):
    requests: list[BatchRequest] = Field(min_length=1)


def public_id(batch_id: str) -> str:
    return PREFIX + batch_id.removeprefix("batch_")


def _internal(message_batch_id: str) -> str:
    return "batch_" + message_batch_id.removeprefix(PREFIX)


async def _owned(runner: Runner, caller: Caller, message_batch_id: str) -> BatchInfo:
    """The message batch if ``caller`` may see it: 404 alike for a missing one, another key's, and
    a batch that is not a message batch."""
    batch = None
    if message_batch_id.startswith(PREFIX):
        batch = await runner.store.get_batch(_internal(message_batch_id))
    if batch is None or batch.endpoint != ENDPOINT or not (caller.admin or batch.owner == caller.key_id):
        raise not_found(f"no such message batch: '{message_batch_id}'", "message_batch_id", "batch_not_found")
    return batch


def _time(seconds: int | None) -> str | None:
    if seconds is None:
        return None
    return datetime.fromtimestamp(seconds, timezone.utc).isoformat().replace("+00:00", "Z")


async def _lines(runner: Runner, file_id: str | None) -> list[dict[str, Any]]:
    """The JSON lines of a file (parsed in a worker thread: an input may be many megabytes)."""
    content = await runner.store.file_content(file_id) if file_id else None
    return await asyncio.to_thread(lambda: [json.loads(x) for x in (content or b"").decode().splitlines() if x.strip()])


async def _shown(request: Request, runner: Runner, batch: BatchInfo) -> dict[str, Any]:
    """Anthropic's ``message_batch`` object of ``batch``."""
    doc = batch.public()
    ended = batch.status in TERMINAL
    counts = {"processing": 0, "succeeded": 0, "errored": 0, "canceled": 0, "expired": 0}
    if not ended:
        counts["processing"] = batch.total or batch.requests or 0  # (counted by the runner once validated)
    else:
        counts["succeeded"] = batch.completed
        for line in await _lines(runner, doc["error_file_id"]):
            counts[UNRUN.get((line.get("error") or {}).get("code"), "errored")] += 1
    pid = public_id(batch.id)
    ended_at = next((doc[f"{s}_at"] for s in ("completed", "cancelled", "expired", "failed") if doc[f"{s}_at"]), None)
    return {"id": pid, "type": "message_batch",
            "processing_status": "ended" if ended else "canceling" if batch.status == "cancelling" else "in_progress",
            "request_counts": counts, "created_at": _time(batch.created_at), "expires_at": _time(batch.expires_at),
            "ended_at": _time(ended_at), "cancel_initiated_at": _time(doc["cancelling_at"]), "archived_at": None,
            "results_url": str(request.url_for("message_batch_results", message_batch_id=pid)) if ended else None}


async def create(request: Request) -> Response:
    """POST /v1/messages/batches: ``requests``, each a ``custom_id`` (unique in the batch,
    1-64 of ``[A-Za-z0-9_-]``) and the ``params`` of a Messages request."""
    svc, runner, caller = batch_context(request)
    raw = await read_body(request, svc.config.batch.max_file_bytes)
    content, count = await asyncio.to_thread(_input_file, raw)  # (a body of many megabytes: off the event loop)
    info = await new_file(svc, runner, caller, "message_batch.jsonl", content, None, param="requests")
    batch = await start_batch(runner, caller, ENDPOINT, info, requests=count)
    return JSONResponse(await _shown(request, runner, batch))


def _input_file(raw: bytes) -> tuple[bytes, int]:
    """The batch input file (JSON lines calling /v1/messages) of a create's body, and its count of
    requests; 400 naming what is wrong."""
    body = parse(MessageBatchCreate, json_object(raw))
    seen: set[str] = set()
    for i, r in enumerate(body.requests):
        if not CUSTOM_ID.fullmatch(r.custom_id):
            raise bad_request("a custom_id is 1 to 64 letters, digits, '_' or '-'", f"requests[{i}].custom_id")
        if r.custom_id in seen:
            raise bad_request(f"custom_id {r.custom_id!r} is not unique in the batch", f"requests[{i}].custom_id")
        seen.add(r.custom_id)
    content = "".join(json.dumps({"custom_id": r.custom_id, "method": "POST", "url": ENDPOINT, "body": r.params}) + "\n"
                      for r in body.requests).encode()
    return content, len(body.requests)


async def retrieve(request: Request) -> Response:
    _, runner, caller = batch_context(request)
    batch = await _owned(runner, caller, request.path_params["message_batch_id"])
    return JSONResponse(await _shown(request, runner, batch))


async def list_batches(request: Request) -> Response:
    """GET /v1/messages/batches?limit=&after_id=&before_id=: the caller's message batches (an
    admin's: everyone's), newest first; ``limit`` 1 to 1000, 20 unless given (Anthropic's).
    ``after_id`` gives the page after that batch, ``before_id`` the page before it."""
    _, runner, caller = batch_context(request)
    query = request.query_params
    raw = query.get("limit", "20")
    if not is_count(raw) or not 1 <= int(raw) <= 1000:
        raise bad_request(f"limit must be an integer from 1 to 1000, not {raw!r}", "limit")
    limit, after, before = int(raw), query.get("after_id"), query.get("before_id")
    if after and before:
        raise bad_request("give after_id or before_id, not both", "before_id")
    owner = None if caller.admin else caller.key_id
    store, found, start = runner.store, [], None  # the store lists newest first, after an id (ids sort by time)
    if before:  # every message batch newer than it; the page is the last ``limit`` of them
        edge = _internal(before)
        while True:
            chunk = await store.list_batches(owner, start, 100)
            found += [b for b in chunk if b.id > edge and b.endpoint == ENDPOINT]
            if len(chunk) < 100 or chunk[-1].id <= edge:
                break
            start = chunk[-1].id
        page, more = found[-limit:], len(found) > limit
    else:
        start = _internal(after) if after else None
        while len(found) <= limit:
            chunk = await store.list_batches(owner, start, 100)
            found += [b for b in chunk if b.endpoint == ENDPOINT]
            if len(chunk) < 100:
                break
            start = chunk[-1].id
        page, more = found[:limit], len(found) > limit
    data = [await _shown(request, runner, b) for b in page]
    return JSONResponse({"data": data, "has_more": more, "first_id": data[0]["id"] if data else None,
                         "last_id": data[-1]["id"] if data else None})


async def cancel(request: Request) -> Response:
    """POST /v1/messages/batches/{id}/cancel: no more of its requests start; the batch ends once
    those running have, the rest ``canceled``. A batch that ended is a 409."""
    _, runner, caller = batch_context(request)
    batch = await _owned(runner, caller, request.path_params["message_batch_id"])
    now = int(time.time())
    if await runner.store.set_status(batch.id, ["validating", "in_progress"], "cancelling", cancelling_at=now):
        runner.soon("finish", batch.id)
    else:
        batch = await runner.store.get_batch(batch.id) or batch
        if batch.status not in ("cancelling", "cancelled"):
            raise APIError(409, f"cannot cancel a message batch that has ended ({batch.status})",
                           "batch_not_cancellable")
    return JSONResponse(await _shown(request, runner, await _owned(runner, caller, public_id(batch.id))))


async def delete(request: Request) -> Response:
    """DELETE /v1/messages/batches/{id}: a batch that has ended, with its input and results."""
    _, runner, caller = batch_context(request)
    batch = await _owned(runner, caller, request.path_params["message_batch_id"])
    if not await runner.store.delete_batch(batch.id):
        raise APIError(409, "a message batch can be deleted once it has ended: cancel it first", "batch_not_ended")
    doc = batch.public()
    for file_id in (batch.input_file_id, doc["output_file_id"], doc["error_file_id"]):
        if file_id:
            await runner.store.delete_file(file_id)
    return JSONResponse({"id": public_id(batch.id), "type": "message_batch_deleted"})


async def results(request: Request) -> Response:
    """GET /v1/messages/batches/{id}/results: one JSON line per request, in the requests' order:
    ``custom_id`` and its ``result`` (``succeeded`` with the ``message``, ``errored`` with the
    error, ``canceled`` or ``expired``). 409 before the batch has ended."""
    _, runner, caller = batch_context(request)
    batch = await _owned(runner, caller, request.path_params["message_batch_id"])
    if batch.status not in TERMINAL:
        raise APIError(409, "the message batch has not ended: its results come once it has", "batch_not_ended")
    doc = batch.public()
    order = [ln["custom_id"] for ln in await _lines(runner, batch.input_file_id)]
    found = {ln["custom_id"]: ln for f in ("output_file_id", "error_file_id") for ln in await _lines(runner, doc[f])}
    out = await asyncio.to_thread(
        lambda: "".join(json.dumps({"custom_id": c, "result": _result(found[c])}) + "\n" for c in order if c in found))
    return Response(out, media_type="application/x-jsonl")


def _result(line: dict[str, Any]) -> dict[str, Any]:
    """Anthropic's result of one output or error file line."""
    response = line.get("response")
    if response is not None and 200 <= response["status_code"] < 300:
        return {"type": "succeeded", "message": response["body"]}
    if response is None:
        error = line.get("error") or {}
        if error.get("code") in UNRUN:
            return {"type": UNRUN[error["code"]]}
        error = {"message": error.get("message", ""), "type": "invalid_request_error", "param": None,
                 "code": error.get("code")}
    else:
        error = response["body"]["error"]
    return {"type": "errored", "error": {"type": "error", "error": error}}
