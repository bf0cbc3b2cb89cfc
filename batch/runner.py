"""The OpenAI Batch API: ``/v1/files`` and ``/v1/batches``, and the runner that works through
the backlog at the batch tier.

A batch goes ``validating`` -> ``in_progress`` -> ``finalizing`` -> ``completed`` (or ``expired``
after 24 hours), or ``cancelling`` -> ``cancelled``, or ``failed`` when its input file has no
request at all. Bad lines do not fail a batch: they go to its error file, like requests the
endpoint refused. Every line runs as the batch's owner at the batch tier, whoever submitted it,
so batch work only ever uses an otherwise idle GPU.

The runner in each process claims up to ``concurrency`` lines from the store, calls the endpoint
for each (waiting at the gate like any batch-tier request; a 429 means "later", never failure),
and records the outcome. What survives a crash, and why nothing is recorded twice, is the
store's business (``gateway.batch_store``); the runner only has to keep its claims alive
(``touch``) while it works on them and give them back when it stops.

Endpoints a batch can call are ``async (services, caller, body) -> Response`` functions. Chat and
image generations are built in; other features (speech) add theirs at install time::

    services.extras.setdefault("batch_endpoints", {})["/v1/audio/speech"] = lambda s, c, b: speak(s, c, b, None)

A JSON response becomes the output line's ``response.body``; any other (speech audio) becomes
``{"content_type": ..., "encoding": "base64", "data": ...}``.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import os
import random
import re
import secrets
import socket
import time
import uuid
from typing import Any, Awaitable, Callable, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator
from starlette.datastructures import UploadFile
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from gateway.auth import Caller
from gateway.batch_store import BatchInfo, FileInfo, Job, Line, Outcome, Store, open_store
from gateway.chat import complete
from gateway.errors import APIError, bad_request, not_found
from gateway.images import generate
from gateway.schemas import parse, read_json
from gateway.service import Services

log = logging.getLogger("tiergate.batches")

Endpoint = Callable[[Services, Caller, dict], Awaitable[Response]]

BATCH_ENDPOINTS = ("/v1/chat/completions", "/v1/images/generations", "/v1/audio/speech")
WINDOW_S = 24 * 3600
MAX_DELIVERIES = 5  # a line whose process died this many times running it is recorded as failed
RETRIES_503 = 5  # "model unavailable" is retried this often before the line fails
_FORM_SLACK = 64 * 1024  # multipart framing on top of the file itself


async def _chat(svc: Services, caller: Caller, body: dict) -> Response:
    if body.get("stream"):
        raise bad_request("stream is not supported in a batch", "stream")
    return await complete(svc, caller, body, None)


async def _images(svc: Services, caller: Caller, body: dict) -> Response:
    return await generate(svc, caller, body, None)  # response_format "url" is refused: b64_json only


BUILTIN_ENDPOINTS: dict[str, Endpoint] = {"/v1/chat/completions": _chat, "/v1/images/generations": _images}


def install_batches(services: Services) -> list[Route]:
    """Open the configured store and start the runner with the app; the Batch API's routes."""
    cfg = services.config.batch
    data_dir = cfg.data_dir if cfg.data_dir.is_absolute() else services.config.source.parent / cfg.data_dir
    runner = Runner(services, open_store(cfg.store, data_dir))
    services.extras["batches"] = runner
    services.on_startup.append(runner.start)
    services.on_shutdown.append(runner.stop)
    return [
        Route("/v1/files", upload_file, methods=["POST"]),
        Route("/v1/files/{file_id}", get_file, methods=["GET"]),
        Route("/v1/files/{file_id}", delete_file, methods=["DELETE"]),
        Route("/v1/files/{file_id}/content", file_content, methods=["GET"]),
        Route("/v1/batches", create_batch, methods=["POST"]),
        Route("/v1/batches", list_batches, methods=["GET"]),
        Route("/v1/batches/{batch_id}", get_batch, methods=["GET"]),
        Route("/v1/batches/{batch_id}/cancel", cancel_batch, methods=["POST"]),
    ]


# -- files -------------------------------------------------------------------------------------

def _context(request: Request) -> tuple[Services, "Runner", Caller]:
    svc: Services = request.app.state.services
    return svc, svc.extras["batches"], svc.authenticate(request)


async def upload_file(request: Request) -> Response:
    """POST /v1/files: multipart ``file`` (JSONL) and ``purpose=batch``."""
    svc, runner, caller = _context(request)
    cfg = svc.config.batch
    if not request.headers.get("content-type", "").startswith("multipart/form-data"):
        raise APIError(415, "upload files as multipart/form-data with the fields 'file' and 'purpose'",
                       "unsupported_media_type")
    too_big = APIError(413, f"the file is larger than {cfg.max_file_bytes} bytes", "file_too_large", "file")
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > cfg.max_file_bytes + _FORM_SLACK:
        raise too_big
    async with _capped(request, cfg.max_file_bytes + _FORM_SLACK, too_big).form(max_files=1, max_fields=8) as form:
        purpose, upload = form.get("purpose"), form.get("file")
        if purpose is None:
            raise bad_request("missing required parameter: purpose", "purpose", "missing_required_parameter")
        if purpose != "batch":
            raise bad_request(f"purpose is {purpose!r}; this server takes only 'batch' files", "purpose")
        if not isinstance(upload, UploadFile):
            raise bad_request("missing required parameter: file (a file part)", "file", "missing_required_parameter")
        content = await upload.read(cfg.max_file_bytes + 1)
        filename = upload.filename or "upload.jsonl"
    if len(content) > cfg.max_file_bytes:
        raise too_big
    try:
        text = content.decode("utf-8")
    except UnicodeDecodeError:
        raise bad_request("the file is not UTF-8 text (JSONL expected)", "file", "invalid_file") from None
    n = sum(1 for ln in text.splitlines() if ln.strip())
    if n > cfg.max_lines:
        raise bad_request(f"the file has {n} requests; at most {cfg.max_lines} are allowed", "file", "too_many_lines")
    info = FileInfo(f"file-{uuid.uuid4().hex}", caller.key_id, "batch", filename, len(content), int(time.time()))
    await runner.store.put_file(info, content)
    return JSONResponse(info.public())


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


async def _owned_file(runner: "Runner", caller: Caller, file_id: str, param: str = "file_id") -> FileInfo:
    """The file if ``caller`` may see it; 404 alike for missing files and other keys' files."""
    info = await runner.store.get_file(file_id)
    if info is None or not (caller.admin or info.owner == caller.key_id):
        raise not_found(f"no such file: '{file_id}'", param, "file_not_found")
    return info


async def get_file(request: Request) -> Response:
    _, runner, caller = _context(request)
    return JSONResponse((await _owned_file(runner, caller, request.path_params["file_id"])).public())


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
    output_expires_after: dict[str, Any] | None = None  # accepted; outputs are kept until deleted

    @field_validator("metadata")
    @classmethod
    def _metadata(cls, v: dict[str, str] | None) -> dict[str, str] | None:
        if v is not None and (len(v) > 16 or any(len(k) > 64 or len(x) > 512 for k, x in v.items())):
            raise ValueError("at most 16 pairs, keys up to 64 characters, values up to 512")
        return v


async def create_batch(request: Request) -> Response:
    svc, runner, caller = _context(request)
    body = parse(BatchCreate, await read_json(request, svc.config.limits.max_body))
    if body.endpoint not in runner.endpoints():
        served = ", ".join(sorted(runner.endpoints()))
        raise bad_request(f"{body.endpoint} is not served in batches by this server (it serves {served})", "endpoint")
    info = await _owned_file(runner, caller, body.input_file_id, "input_file_id")
    if info.purpose != "batch":
        raise bad_request(f"the file's purpose is {info.purpose!r}, not 'batch'", "input_file_id")
    now = int(time.time())
    batch = BatchInfo(id=f"batch_{time.time_ns():016x}{secrets.token_hex(4)}",  # ids sort by time
                      owner=caller.key_id, endpoint=body.endpoint, input_file_id=info.id,
                      completion_window=body.completion_window, created_at=now, expires_at=now + WINDOW_S,
                      metadata=body.metadata)
    await runner.store.create_batch(batch)
    runner.soon("validate", batch.id)
    return JSONResponse(batch.public())


async def _owned_batch(runner: "Runner", caller: Caller, batch_id: str) -> BatchInfo:
    batch = await runner.store.get_batch(batch_id)
    if batch is None or not (caller.admin or batch.owner == caller.key_id):
        raise not_found(f"no such batch: '{batch_id}'", "batch_id", "batch_not_found")
    return batch


async def get_batch(request: Request) -> Response:
    _, runner, caller = _context(request)
    return JSONResponse((await _owned_batch(runner, caller, request.path_params["batch_id"])).public())


async def list_batches(request: Request) -> Response:
    """GET /v1/batches?after=&limit=: the caller's batches (an admin's: everyone's), newest first."""
    _, runner, caller = _context(request)
    raw = request.query_params.get("limit", "20")
    if not raw.isdigit() or not 1 <= int(raw) <= 100:
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


# -- input validation --------------------------------------------------------------------------

def parse_input(content: bytes, endpoint: str) -> tuple[list[Line], list[Outcome]]:
    """The runnable lines of an input file, and an error outcome for each bad one. Blank lines
    are skipped; a line's index is its position in the file (0-based)."""
    lines: list[Line] = []
    invalid: list[Outcome] = []
    seen: set[str] = set()
    for index, raw in enumerate(content.decode("utf-8", errors="replace").splitlines()):
        if raw.strip():
            checked = _check_line(index, raw, endpoint, seen)
            (lines if isinstance(checked, Line) else invalid).append(checked)
    return lines, invalid


def _check_line(index: int, raw: str, endpoint: str, seen: set[str]) -> Line | Outcome:
    def bad(code: str, message: str, custom_id: str | None = None) -> Outcome:
        return error_line(index, custom_id, code, f"line {index + 1}: {message}")

    try:
        doc = json.loads(raw)
    except ValueError:
        return bad("invalid_json", "not valid JSON")
    if not isinstance(doc, dict):
        return bad("invalid_json", "not a JSON object")
    cid = doc.get("custom_id")
    if not isinstance(cid, str) or not cid:
        return bad("missing_custom_id", "custom_id must be a non-empty string")
    if cid in seen:
        return bad("duplicate_custom_id", f"custom_id {cid!r} is used by an earlier line", cid)
    seen.add(cid)
    if doc.get("method") != "POST":
        return bad("invalid_method", f"method is {doc.get('method')!r}; only POST is supported", cid)
    if doc.get("url") != endpoint:
        return bad("invalid_url", f"url is {doc.get('url')!r}; this batch's endpoint is {endpoint}", cid)
    if not isinstance(doc.get("body"), dict):
        return bad("invalid_body", "body must be a JSON object", cid)
    return Line(index, cid, doc["body"])


def error_line(index: int, custom_id: str | None, code: str, message: str) -> Outcome:
    """An error-file line for a request that got no response (bad line, cancelled, expired)."""
    return Outcome(index, False, {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": custom_id,
                                  "response": None, "error": {"code": code, "message": message}})


def response_line(line: Line, status: int, body: Any, request_id: str) -> Outcome:
    """An output-file line (2xx) or error-file line (anything else) for a request that ran."""
    return Outcome(line.index, 200 <= status < 300, {
        "id": f"batch_req_{uuid.uuid4().hex}", "custom_id": line.custom_id,
        "response": {"status_code": status, "request_id": request_id, "body": body}, "error": None})


async def _served(response: Response) -> tuple[int, Any, dict[str, str]]:
    """Play ``response`` into memory (any kind, streaming too) -> (status, body for the line,
    headers)."""
    start: dict = {}
    body = bytearray()

    async def send(message: dict) -> None:
        if message["type"] == "http.response.start":
            start.update(message)
        elif message["type"] == "http.response.body":
            body.extend(message.get("body", b""))

    async def receive() -> dict:  # a batch line has no client to disconnect
        await asyncio.Event().wait()
        return {"type": "http.disconnect"}

    scope = {"type": "http", "asgi": {"spec_version": "2.4"}, "method": "POST", "path": "/", "headers": []}
    await response(scope, receive, send)
    headers = {k.decode().lower(): v.decode() for k, v in start.get("headers", [])}
    ctype = headers.get("content-type", "")
    if ctype.startswith("application/json"):
        return start["status"], json.loads(body), headers
    data = base64.b64encode(bytes(body)).decode()
    return start["status"], {"content_type": ctype, "encoding": "base64", "data": data}, headers


# -- the runner --------------------------------------------------------------------------------

class Runner:
    """Claims lines from the store, runs them at the batch tier, records their outcomes, and
    finishes batches. One per process; any number of processes may share a store."""

    def __init__(self, svc: Services, store: Store) -> None:
        cfg = svc.config.batch
        self.svc = svc
        self.store = store
        self.tier = next((t.name for t in svc.gate.tiers.values() if t.is_batch), svc.config.tier_names[-1])
        self.concurrency = min(cfg.concurrency, svc.gate.tiers[self.tier].max_inflight)
        self.reclaim_after_s = cfg.reclaim_after_s
        self.tick_s = min(1.0, cfg.reclaim_after_s / 4)  # heartbeat: well inside the reclaim timeout
        self.poll_s = 0.5  # how often an idle runner looks for work other processes queued
        self.name = f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(3)}"
        self.recorded = 0  # lines whose outcome this process wrote (tests, logs)
        self._running: dict[str, tuple[Job, asyncio.Task]] = {}
        self._dropping: set[str] = set()  # tokens of jobs cancelled because their batch stopped
        self._batches: dict[str, BatchInfo] = {}  # batches of running jobs, refreshed every tick
        self._soon: dict[tuple[str, str], asyncio.Task] = {}
        self._loops: list[asyncio.Task] = []
        self._wake = asyncio.Event()

    def endpoints(self) -> dict[str, Endpoint]:
        return {**BUILTIN_ENDPOINTS, **self.svc.extras.get("batch_endpoints", {})}

    async def start(self) -> None:
        await self.store.open()
        self._wake = asyncio.Event()
        self._loops = [asyncio.create_task(loop(), name=f"batch-{loop.__name__}")
                       for loop in (self._claim_loop, self._heartbeat_loop, self._sweep_loop)]
        log.info("batch runner %s: %d at a time at the %s tier, store %s", self.name, self.concurrency,
                 self.tier, type(self.store).__name__)

    async def stop(self) -> None:
        """Stop claiming, abandon running lines and hand them back for others (or the next start)."""
        tasks = self._loops + [t for _, t in self._running.values()] + list(self._soon.values())
        unfinished = [job for job, _ in self._running.values()]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        try:
            await self.store.release(self.name, unfinished)
        except Exception:  # noqa: BLE001 - they will be reclaimed after the timeout instead
            log.warning("could not hand back %d batch lines; they run again after %gs",
                        len(unfinished), self.reclaim_after_s)
        await self.store.close()
        log.info("batch runner %s stopped: recorded %d lines", self.name, self.recorded)

    def soon(self, what: Literal["validate", "finish"], batch_id: str) -> None:
        """Validate or finish ``batch_id`` in the background (once at a time per process)."""
        key = (what, batch_id)
        if key in self._soon:
            return
        work = self._validate(batch_id) if what == "validate" else self._finish(batch_id)
        task = asyncio.create_task(self._logged(work, f"{what} {batch_id}"))
        self._soon[key] = task
        task.add_done_callback(lambda _: self._soon.pop(key, None))

    @staticmethod
    async def _logged(work: Awaitable[None], what: str) -> None:
        try:
            await work
        except Exception:  # noqa: BLE001 - the sweep tries again
            log.exception("batch: %s failed; will retry", what)

    # -- loops
    async def _claim_loop(self) -> None:
        while True:
            free = self.concurrency - len(self._running)
            jobs: list[Job] = []
            if free > 0:
                try:
                    jobs = await self.store.claim(self.name, free, self.reclaim_after_s)
                except Exception:  # noqa: BLE001 - the store is down: keep trying
                    log.exception("batch: claiming lines failed")
            for job in jobs:
                if job.token not in self._running:  # not one of ours that was slow to be touched
                    self._running[job.token] = (job, asyncio.create_task(self._run(job)))
            if jobs:
                continue
            self._wake.clear()
            try:
                await asyncio.wait_for(self._wake.wait(), self.poll_s if free > 0 else None)
            except TimeoutError:
                pass

    async def _heartbeat_loop(self) -> None:
        """Keep our claims alive, and drop lines of batches that stopped (cancelled, expired)."""
        while True:
            await asyncio.sleep(self.tick_s)
            running = dict(self._running)  # lines claimed while we await are looked at next tick
            try:
                await self.store.touch(self.name, [job for job, _ in running.values()])
                latest = {b: await self.store.get_batch(b) for b in {job.batch_id for job, _ in running.values()}}
            except Exception:  # noqa: BLE001
                log.exception("batch: heartbeat failed")
                continue
            self._batches = {b: info for b, info in latest.items() if info is not None}
            for token, (job, task) in running.items():
                info = latest[job.batch_id]
                if (info is None or info.status != "in_progress") and token in self._running:
                    self._dropping.add(token)
                    task.cancel()

    async def _sweep_loop(self) -> None:
        """Pick up what a dead process left: unvalidated or unfinished batches, and expiry."""
        sweep_s = max(self.tick_s, min(5.0, self.reclaim_after_s / 2))
        while True:
            try:
                await self._sweep()
            except Exception:  # noqa: BLE001
                log.exception("batch: sweep failed")
            await asyncio.sleep(sweep_s)

    async def _sweep(self) -> None:
        now = int(time.time())
        for batch_id in await self.store.open_batches():
            batch = await self.store.get_batch(batch_id)
            if batch is None:
                continue
            if batch.status == "validating":
                self.soon("validate", batch_id)
            elif batch.status in ("cancelling", "finalizing") or batch.done >= batch.total or now >= batch.expires_at:
                self.soon("finish", batch_id)

    # -- one line
    async def _run(self, job: Job) -> None:
        try:
            batch = self._batches.get(job.batch_id) or await self.store.get_batch(job.batch_id)
            if batch is None or batch.status != "in_progress":
                await self.store.ack(job)  # cancelled or over: its outcome is (or will be) filled in
                return
            self._batches.setdefault(job.batch_id, batch)
            if job.deliveries > MAX_DELIVERIES:
                outcome = error_line(job.line.index, job.line.custom_id, "too_many_attempts",
                                     f"the request was started {job.deliveries - 1} times and never finished")
            else:
                outcome = await self._call(batch, job.line)
            recorded = await self.store.record(job, outcome)
            if recorded.new:
                self.recorded += 1
                if recorded.done >= recorded.total:
                    self.soon("finish", job.batch_id)
        except asyncio.CancelledError:
            if job.token in self._dropping:  # its batch stopped: the entry goes, the outcome is filled in
                await asyncio.shield(self.store.ack(job))
            raise
        except Exception:  # noqa: BLE001 - the store failed: the line is reclaimed and runs again
            log.exception("batch: line %s of %s failed to record", job.line.custom_id, job.batch_id)
        finally:
            self._running.pop(job.token, None)
            self._dropping.discard(job.token)
            self._wake.set()

    async def _call(self, batch: BatchInfo, line: Line) -> Outcome:
        """Run one line as its batch's owner at the batch tier. Waiting is never failure: a 429
        (queue full, model protected) is retried after its Retry-After, for as long as it takes;
        a 503 a few times. Any other error is the line's outcome."""
        endpoint = self.endpoints().get(batch.endpoint)
        caller = Caller(tier=self.tier, key_id=batch.owner)
        attempt = 0
        while True:
            request_id = f"req_{uuid.uuid4().hex}"
            if endpoint is None:
                return response_line(line, 404, APIError(404, f"{batch.endpoint} is not served here", "not_found").body(),
                                     request_id)
            try:
                status, body, headers = await _served(await endpoint(self.svc, caller, dict(line.body)))
            except APIError as exc:
                status, body, headers = exc.status, exc.body(), exc.headers
            except Exception as exc:  # noqa: BLE001 - a bug or a worker crash: this line failed
                log.exception("batch: line %s of %s raised", line.custom_id, batch.id)
                err = APIError(500, f"the request failed: {type(exc).__name__}", "internal_error")
                status, body, headers = 500, err.body(), {}
            if status == 429 or (status == 503 and attempt < RETRIES_503):
                attempt += 1
                await asyncio.sleep(_backoff(headers, attempt))
                continue
            return response_line(line, status, body, request_id)

    # -- whole batches
    async def _validate(self, batch_id: str) -> None:
        if not await self.store.lock(batch_id, self.name, self.reclaim_after_s):
            return  # another process is on it
        try:
            all_bad = await self._validate_locked(batch_id)
        finally:
            await self.store.unlock(batch_id, self.name)
        if all_bad:
            self.soon("finish", batch_id)

    async def _validate_locked(self, batch_id: str) -> bool:
        """Parse the input and start the batch; True if it started with nothing to run."""
        batch = await self.store.get_batch(batch_id)
        if batch is None or batch.status != "validating":
            return False
        content = await self.store.file_content(batch.input_file_id)
        if content is None:
            await self._fail(batch, "file_not_found", f"the input file {batch.input_file_id} was deleted")
            return False
        lines, invalid = await asyncio.to_thread(parse_input, content, batch.endpoint)
        if not lines and not invalid:
            await self._fail(batch, "empty_file", "the input file has no requests")
            return False
        if not await self.store.start(batch_id, lines, invalid, int(time.time())):
            return False
        self._wake.set()
        return not lines

    async def _fail(self, batch: BatchInfo, code: str, message: str) -> None:
        errors = {"object": "list", "data": [{"code": code, "message": message, "param": "input_file_id", "line": None}]}
        await self.store.set_status(batch.id, ["validating"], "failed", failed_at=int(time.time()), errors=errors)

    async def _finish(self, batch_id: str) -> None:
        if not await self.store.lock(batch_id, self.name, self.reclaim_after_s):
            return
        try:
            await self._finish_locked(batch_id)
        finally:
            await self.store.unlock(batch_id, self.name)

    async def _finish_locked(self, batch_id: str) -> None:
        """Write the output and error files and end the batch: ``completed``, ``expired`` (time ran
        out: what had not run gets a ``batch_expired`` error line) or ``cancelled`` (likewise,
        ``batch_cancelled``). Safe to repeat after a crash: the files get the same ids and
        content, and only one process's final compare-and-set succeeds."""
        now = int(time.time())
        batch = await self.store.get_batch(batch_id)
        if batch is None:
            return
        if batch.status == "in_progress":
            if now >= batch.expires_at:
                await self.store.fill(batch_id, lambda ln: error_line(
                    ln.index, ln.custom_id, "batch_expired", "the batch expired before this request ran"))
                batch = await self.store.get_batch(batch_id)
            if batch.done < batch.total:
                return
            if await self.store.set_status(batch_id, ["in_progress"], "finalizing", finalizing_at=now):
                batch.status = "finalizing"
            else:
                batch = await self.store.get_batch(batch_id)  # cancelled meanwhile
        if batch.status == "cancelling":
            await self.store.fill(batch_id, lambda ln: error_line(
                ln.index, ln.custom_id, "batch_cancelled", "the batch was cancelled before this request ran"))
        elif batch.status != "finalizing":
            return
        outcomes = await self.store.outcomes(batch_id)
        fields: dict[str, Any] = {"output_file_id": None, "error_file_id": None}
        for ok, key, suffix in ((True, "output_file_id", "output"), (False, "error_file_id", "error")):
            chosen = [o.line for o in outcomes if o.ok is ok]
            if chosen:
                content = "".join(json.dumps(x) + "\n" for x in chosen).encode()
                info = FileInfo(f"file-{batch_id.removeprefix('batch_')}-{suffix}", batch.owner, "batch_output",
                                f"{batch_id}_{suffix}.jsonl", len(content), now)
                await self.store.put_file(info, content)
                fields[key] = info.id
        if batch.status == "cancelling":
            status = "cancelled"
        elif any((o.line.get("error") or {}).get("code") == "batch_expired" for o in outcomes):
            status = "expired"
        else:
            status = "completed"
        fields[f"{status}_at"] = now
        if await self.store.set_status(batch_id, [batch.status], status, **fields):
            log.info("batch %s %s: %d completed, %d failed", batch_id, status,
                     sum(o.ok for o in outcomes), sum(not o.ok for o in outcomes))


def _backoff(headers: dict[str, str], attempt: int) -> float:
    """The error's Retry-After if it gave one, else exponential; with jitter, at most 60 s."""
    given = {k.lower(): v for k, v in headers.items()}.get("retry-after")
    base = float(given) if given and given.replace(".", "", 1).isdigit() else min(2.0 ** attempt, 30.0)
    return min(base, 60.0) * random.uniform(0.8, 1.2)
