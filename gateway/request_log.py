"""One structured log line per request, and the request's id.

``RequestLog`` (ASGI middleware, outermost) gives every request a :class:`RequestRecord`: its id is
the client's ``x-request-id`` when that is printable ASCII of at most ``MAX_ID_CHARS`` characters,
otherwise a new ``req_<hex>``; it is echoed in the response's ``x-request-id`` header (errors and
streams included) and the line is written once the response has ended (a stream's last byte).

What the line says is filled in along the way, through :func:`current` (the record of the request
running in this task): ``Services.authenticate`` notes the caller (its ``key_id``, never the key),
the serving core notes the model, the queue wait at the gate, the wait for the model's load and the
service time, the chat core notes tokens, and the error handlers note the refusal's code. A
response cut after it started (an exception out of the app, or a stream its client left, which
ends quietly) keeps the status it sent, with ``reason`` ``interrupted``. Batch lines have no
record (``current()`` is None).

Lines go to the ``tiergate.requests`` logger; ``Formatter`` writes every log record as one JSON
object (``tiergate serve --log-format json``) or as plain text with the fields as ``key=value``.
``configure`` sends them to stderr through ``LineWriter``, which formats and writes request lines
off the event loop, a batch at a time, and every other line at once, in order.
"""

from __future__ import annotations

import collections
import contextvars
import datetime
import json
import logging
import os
import random
import re
import sys
import threading
import time
from dataclasses import dataclass, field, fields
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

log = logging.getLogger("tiergate.requests")

MAX_ID_CHARS = 128
SCOPE_KEY = "tiergate.request"  # the record in the ASGI scope (for handlers outside this middleware)


@dataclass
class RequestRecord:
    request_id: str
    method: str
    endpoint: str
    status: int | None = None
    reason: str | None = None  # the error's code (queue_full, model_protected, shutting_down, ...)
    key_id: str | None = None
    tier: str | None = None
    model: str | None = None
    queue_wait_s: float | None = None  # at the gate
    load_wait_s: float | None = None  # for the model to become resident
    service_s: float | None = None  # holding the slot and the lease
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    duration_s: float | None = None  # arrival to the response's last byte
    started: float = field(default_factory=time.monotonic, repr=False)

    def fields(self) -> dict[str, Any]:
        return logged(self.__dict__)  # flat, so no deep copy (``asdict``)


def logged(values: dict[str, Any]) -> dict[str, Any]:
    """A record's fields as its line says them (seconds rounded), from its attributes
    (``RequestRecord.__dict__``, or fields already picked)."""
    out = {name: values[name] for name in _LOGGED}
    for name in _SECONDS:
        if out[name] is not None:
            out[name] = round(out[name], 4)
    return out


_LOGGED = tuple(f.name for f in fields(RequestRecord) if f.name != "started")
_SECONDS = tuple(name for name in _LOGGED if name.endswith("_s"))  # the float fields, rounded

_current: contextvars.ContextVar[RequestRecord | None] = contextvars.ContextVar("tiergate_request", default=None)


def current() -> RequestRecord | None:
    """The record of the HTTP request this task is serving; None outside one (batch lines)."""
    return _current.get()


def tallied() -> RequestRecord:
    """A record of its own, never logged, for this task and those it starts from here on: what
    their steps cost is noted in it as in an HTTP request's (the serving core's tokens, a cut
    reply's as its engine counted them), for one that reports it itself (a Realtime response,
    the session's request, whose ``usage`` is what was metered)."""
    record = RequestRecord(f"req_{new_id()}", "", "")
    _current.set(record)
    return record


def note(**fields: Any) -> None:
    """Set ``fields`` on the current request's record, if there is one."""
    record = _current.get()
    if record is not None:
        for name, value in fields.items():
            setattr(record, name, value)


def request_id_of(scope: Scope) -> str | None:
    record = scope.get(SCOPE_KEY)
    return record.request_id if record is not None else None


def valid_request_id(value: str) -> bool:
    return 0 < len(value) <= MAX_ID_CHARS and all(33 <= ord(c) <= 126 for c in value)


_ids = random.Random()  # seeded from os.urandom; ids must be unique, not secret (no system call per id)
if hasattr(os, "register_at_fork"):  # a forked child must not repeat its parent's ids
    os.register_at_fork(after_in_child=_ids.seed)


def new_id() -> str:
    """32 random hex digits, as ``uuid4().hex`` has, without a system call."""
    return f"{_ids.getrandbits(128):032x}"


def _request_id(scope: Scope) -> str:
    for name, value in scope["headers"]:
        if name == b"x-request-id":
            given = value.decode("latin-1")
            if valid_request_id(given):
                return given
            break
    return f"req_{new_id()}"


class RequestLog:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        record = RequestRecord(_request_id(scope), scope["method"], scope["path"])
        scope[SCOPE_KEY] = record
        echo = (b"x-request-id", record.request_id.encode())
        ended = left = False  # the response's last byte was sent; the client left after it started, before that

        async def send_with_id(message: Message) -> None:
            nonlocal ended
            if message["type"] == "http.response.start":
                record.status = message["status"]
                message = {**message, "headers": [*message.get("headers", []), echo]}
            elif message["type"] == "http.response.pathsend" or (
                    message["type"] == "http.response.body" and not message.get("more_body", False)):
                ended = True
            await send(message)

        async def receive_watched() -> Message:
            nonlocal left
            message = await receive()
            if message["type"] == "http.disconnect" and record.status is not None and not ended:
                left = True
            return message

        token = _current.set(record)
        try:
            await self.app(scope, receive_watched, send_with_id)
            # A stream whose client left ends quietly (Starlette stops it on ``http.disconnect``;
            # the server drops what is sent after it): cut after it started, as below.
            if record.status is not None and (left or not ended):
                record.reason = record.reason or "interrupted"
        except BaseException:
            if record.status is None:  # the server answers 500 after this
                record.status, record.reason = 500, record.reason or "internal_error"
            else:  # the response had started: cut (a drain's timeout, a crash mid-stream)
                record.reason = record.reason or "interrupted"
            raise
        finally:
            _current.reset(token)
            record.duration_s = time.monotonic() - record.started
            if not log.isEnabledFor(logging.INFO):  # the fields are built only for a line that is written
                pass
            elif _writer is not None and _writer.takes(log):
                _writer.queue_request(record.__dict__.copy())  # the writer's thread picks the fields
            else:
                log.handle(log.makeRecord(log.name, logging.INFO, "", 0, "request", (), None,
                                          extra={"request": record.fields()}))  # no caller lookup


class Formatter(logging.Formatter):
    """Every log record on one line: a JSON object (``json=True``) or text. A request line's
    fields (``extra={"request": ...}``) become the object's keys, or ``key=value`` pairs."""

    def __init__(self, json_lines: bool) -> None:
        super().__init__()
        self.json_lines = json_lines

    def format(self, record: logging.LogRecord) -> str:
        fields: dict[str, Any] = getattr(record, "request", None) or {}
        when = datetime.datetime.fromtimestamp(record.created, datetime.timezone.utc)
        if self.json_lines:
            doc = {"ts": when.isoformat(timespec="milliseconds"), "level": record.levelname.lower(),
                   "logger": record.name, "message": record.getMessage(), **fields}
            if record.exc_info:
                doc["exception"] = self.formatException(record.exc_info)
            return json.dumps(doc, default=str)
        line = f"{when.isoformat(timespec='milliseconds')} {record.levelname} {record.name}: {record.getMessage()}"
        if fields:
            line += " " + " ".join(f"{k}={_text(v)}" for k, v in fields.items() if v is not None)
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        return line

    def request_line(self, created: float, fields: dict[str, Any]) -> str:
        """What ``format`` writes for a request line of ``log`` made at ``created`` with these
        fields, without making its ``LogRecord`` (a third of the writer's work per line)."""
        when = datetime.datetime.fromtimestamp(created, datetime.timezone.utc).isoformat(timespec="milliseconds")
        if self.json_lines:
            return json.dumps({"ts": when, "level": "info", "logger": log.name, "message": "request", **fields},
                              default=str)
        line = f"{when} INFO {log.name}: request"
        if fields:
            line += " " + " ".join(f"{k}={_text(v)}" for k, v in fields.items() if v is not None)
        return line


_QUOTED = re.compile(r'[\s"]')  # \s: what str.isspace() calls whitespace


def _text(value: Any) -> str:
    if type(value) in _NUMBERS:  # no space nor quote in a number's text
        return str(value)
    text = str(value)
    return json.dumps(text) if (not text or _QUOTED.search(text)) else text


_NUMBERS = frozenset({int, float})


class LineWriter(logging.Handler):
    """Writes log lines to whatever ``sys.stderr`` is when they are written (a replaced or closed
    stderr, as under a test runner, is not kept).

    Request lines (one per request, logged on the event loop) are only queued there: a thread
    formats what has queued and writes it in one write, ``period`` seconds after the first of them
    arrived (0.1 s: at a few hundred requests a second the thread wakes once per ten lines or
    more, not once per one or two as at 10 ms, and each wake-up costs the event loop and the
    engine thread turns at the interpreter lock). Every other line (start-up, warnings, errors)
    is written at once, after what is queued, so lines keep their order. ``flush`` writes what is
    queued, and ``logging.shutdown`` flushes and closes every handler at exit: a line is never
    lost at shutdown."""

    def __init__(self, period: float = 0.1) -> None:
        super().__init__()
        self.period = period
        self._queued: collections.deque[logging.LogRecord | tuple[float, dict]] = collections.deque()
        self._writing = threading.Lock()  # one writer at a time, in order
        self._arrived = threading.Event()
        self._closing = threading.Event()  # wakes the thread from its wait at close
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="tiergate-log", daemon=True)
        self._thread.start()

    def emit(self, record: logging.LogRecord) -> None:
        queue_it = not (self._closed or record.exc_info) and self._thread.is_alive()  # not in a forked child
        if queue_it and getattr(record, "request", None) is not None:
            self._queued.append(record)  # its fields are its own dict, built for this line
            if not self._arrived.is_set():
                self._arrived.set()
            return
        with self._writing:
            lines = self._drained()
            try:
                lines.append(self.format(record))
            except Exception:  # noqa: BLE001 - logging's own convention: report, never raise
                self.handleError(record)
            self._write(lines)

    def takes(self, logger: logging.Logger) -> bool:
        """Whether a line of ``logger`` would reach this handler alone, unfiltered, and be queued:
        then ``queue_request`` may stand for ``logger.handle``."""
        if logger.filters or self.filters or self.level > logging.INFO or self._closed:
            return False
        while logger is not _root:  # the loggers the line passes on its way to the root's handlers
            if logger.handlers or not logger.propagate or logger.parent is None:
                return False
            logger = logger.parent
        return _root.handlers == [self] and self._thread.is_alive()

    def queue_request(self, values: dict[str, Any]) -> None:
        """Queue a request line of ``log`` without a ``LogRecord`` on the event loop: ``values``
        are its record's attributes (a copy of ``RequestRecord.__dict__``) or its fields; the
        writer's thread picks and rounds them (``logged``)."""
        self._queued.append((time.time(), values))
        if not self._arrived.is_set():
            self._arrived.set()

    def flush(self) -> None:
        with self._writing:
            self._write(self._drained())

    def close(self) -> None:
        self._closed = True
        self._closing.set()
        self._arrived.set()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(5)
        self.flush()
        super().close()

    def _run(self) -> None:
        while not self._closed:
            self._arrived.wait()
            self._closing.wait(self.period)  # lines that arrive meanwhile go in the same write
            self._arrived.clear()
            self.flush()

    def _drained(self) -> list[str]:
        lines = []
        direct = self.formatter if type(self.formatter) is Formatter else None  # request lines without a LogRecord
        while self._queued:
            item = self._queued.popleft()
            try:
                if isinstance(item, tuple):  # queue_request's (time, values)
                    created, fields = item[0], logged(item[1])
                    lines.append(direct.request_line(created, fields) if direct
                                 else self.format(_request_record(created, fields)))
                else:
                    lines.append(self.format(item))
            except Exception:  # noqa: BLE001
                self.handleError(item if isinstance(item, logging.LogRecord) else _request_record(item[0], item[1]))
        return lines

    @staticmethod
    def _write(lines: list[str]) -> None:
        if not lines:
            return
        stream = sys.stderr
        try:
            stream.write("\n".join(lines) + "\n")
            stream.flush()
        except (OSError, ValueError):  # stderr closed or gone: nowhere to write
            pass


def _request_record(created: float, fields: dict[str, Any]) -> logging.LogRecord:
    record = log.makeRecord(log.name, logging.INFO, "", 0, "request", (), None, extra={"request": fields})
    record.created, record.msecs = created, (created - int(created)) * 1000
    return record


_root = logging.getLogger()
_writer: LineWriter | None = None  # configure's handler: request lines go to it directly


def configure(json_lines: bool, level: int = logging.INFO) -> None:
    """Send every logger (uvicorn's included) and Python's warnings through one ``LineWriter``
    on stderr with ``Formatter``."""
    logging.captureWarnings(True)  # (logging's process and thread fields stay: libraries with their own
    # handlers write them, as vLLM's does with %(process)d)
    handler = LineWriter()
    handler.setFormatter(Formatter(json_lines))
    root = logging.getLogger()
    for old in root.handlers:
        if isinstance(old, LineWriter):
            old.close()
    root.handlers[:] = [handler]
    root.setLevel(level)
    global _writer
    _writer = handler
    if json_lines:
        _vllm_through()


class LibraryHandler(logging.Handler):
    """A library's handler that writes as tiergate does: through ``configure``'s writer in the
    process that configured it, else (a child process the library started) on stderr with
    ``Formatter``."""

    def __init__(self, json_lines: bool) -> None:
        super().__init__()
        self.setFormatter(Formatter(json_lines))

    def emit(self, record: logging.LogRecord) -> None:
        if _writer is not None:
            _writer.handle(record)
            return
        try:
            sys.stderr.write(self.format(record) + "\n")
            sys.stderr.flush()
        except Exception:  # noqa: BLE001 - logging's convention
            self.handleError(record)


def _vllm_through() -> None:
    """vLLM configures its own logger (its own format, on stdout) in this process and in each
    engine process it starts, from ``VLLM_LOGGING_CONFIG_PATH`` when that is set: point it at
    ``vllm_logging.json``, which sends the ``vllm`` logger to :class:`LibraryHandler` in JSON, so
    that its lines are tiergate's lines in every process. An operator's own vLLM logging settings
    are kept."""
    if "VLLM_LOGGING_CONFIG_PATH" in os.environ or os.environ.get("VLLM_CONFIGURE_LOGGING") == "0":
        return
    os.environ["VLLM_LOGGING_CONFIG_PATH"] = os.path.join(os.path.dirname(__file__), "vllm_logging.json")
