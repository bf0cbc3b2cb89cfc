"""Calling a Starlette app in-process, as a stream: the replica serves a forwarded HTTP request
through the very app ``tiergate serve`` runs (every endpoint, SSE included), with its lifespan, and
a forwarded WebSocket (the Realtime API) as a session whose client messages arrive in a queue."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Forwarded:
    """An HTTP request as the ingress forwards it (plain data: it crosses processes)."""

    method: str
    path: str
    query: bytes = b""
    headers: list[tuple[bytes, bytes]] = field(default_factory=list)
    body: bytes = b""


@dataclass
class Head:
    """The first item of a forwarded response: its status and headers; the body chunks follow."""

    status: int
    headers: list[tuple[bytes, bytes]]


async def call(app, request: Forwarded) -> AsyncIterator[Head | bytes]:
    """Run ``request`` through ``app``; yield its ``Head``, then its body chunks as they are sent.
    Closing the iterator early is a client disconnect (the app sees ``http.disconnect``)."""
    out: asyncio.Queue = asyncio.Queue()
    gone = asyncio.Event()
    sent_body = False

    async def receive() -> dict[str, Any]:
        nonlocal sent_body
        if not sent_body:
            sent_body = True
            return {"type": "http.request", "body": request.body, "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        await out.put(message)

    scope = {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "scheme": "http",
        "method": request.method, "path": request.path, "raw_path": request.path.encode(),
        "query_string": request.query, "root_path": "", "headers": request.headers,
        "client": ("127.0.0.1", 0), "server": ("127.0.0.1", 80),
    }
    task = asyncio.ensure_future(app(scope, receive, send))
    task.add_done_callback(lambda t: out.put_nowait(None))
    try:
        while True:
            message = await out.get()
            if message is None:
                if task.exception() is not None:
                    raise task.exception()
                return
            if message["type"] == "http.response.start":
                yield Head(message["status"], [(bytes(k), bytes(v)) for k, v in message.get("headers", [])])
            elif message["type"] == "http.response.body":
                if message.get("body"):
                    yield bytes(message["body"])
                if not message.get("more_body", False):
                    return
    finally:
        gone.set()
        if not task.done():
            try:  # not wait_for: it can swallow a cancel on 3.11 (gh-86296)
                async with asyncio.timeout(5):
                    await asyncio.shield(task)
            except Exception:  # noqa: BLE001 - TimeoutError, or the app's own error: it is over
                task.cancel()


@dataclass
class Opening:
    """A WebSocket handshake as the ingress forwards it (plain data: it crosses processes)."""

    path: str
    query: bytes = b""
    headers: list[tuple[bytes, bytes]] = field(default_factory=list)
    subprotocols: list[str] = field(default_factory=list)
    denial: bool = False  # the client's server can answer the handshake with an HTTP response


ENDS = {"websocket.close", "websocket.http.response.body"}  # the app's last message (a body without more_body)


async def session(app, opening: Opening, inbox: asyncio.Queue) -> AsyncIterator[dict[str, Any]]:
    """Run the WebSocket ``opening`` through ``app``: the app receives the handshake, then what
    is put in ``inbox`` (ASGI ``websocket.receive`` and ``websocket.disconnect`` messages); yield
    every message it sends (``websocket.accept``, ``.send``, ``.close``, or its HTTP denial), until
    its last. Closing the iterator early is the client gone (the app sees ``websocket.disconnect``)."""
    out: asyncio.Queue = asyncio.Queue()
    connected = False

    async def receive() -> dict[str, Any]:
        nonlocal connected
        if not connected:
            connected = True
            return {"type": "websocket.connect"}
        return await inbox.get()

    scope = {
        "type": "websocket", "asgi": {"version": "3.0"}, "http_version": "1.1", "scheme": "ws",
        "path": opening.path, "raw_path": opening.path.encode(), "query_string": opening.query, "root_path": "",
        "headers": opening.headers, "subprotocols": list(opening.subprotocols),
        "client": ("127.0.0.1", 0), "server": ("127.0.0.1", 80),
        "extensions": {"websocket.http.response": {}} if opening.denial else {},
    }
    task = asyncio.ensure_future(app(scope, receive, out.put))
    task.add_done_callback(lambda t: out.put_nowait(None))
    try:
        while (message := await out.get()) is not None:
            message = {k: bytes(v) if isinstance(v, (bytearray, memoryview)) else v for k, v in message.items()}
            yield message
            if message["type"] in ENDS and not message.get("more_body", False):
                return
        if task.exception() is not None:
            raise task.exception()
    finally:
        if not task.done():
            inbox.put_nowait({"type": "websocket.disconnect", "code": 1001})
            try:  # not wait_for (see ``call``)
                async with asyncio.timeout(5):
                    await asyncio.shield(task)
            except Exception:  # noqa: BLE001 - TimeoutError, or the app's own error: it is over
                task.cancel()


class Lifespan:
    """The app's ASGI lifespan (start-up and shut-down hooks), driven by hand."""

    def __init__(self, app) -> None:
        self.app = app
        self._inbox: asyncio.Queue = asyncio.Queue()
        self._outbox: asyncio.Queue = asyncio.Queue()
        self._task: asyncio.Task | None = None

    async def start(self) -> None:
        self._task = asyncio.ensure_future(
            self.app({"type": "lifespan", "asgi": {"version": "3.0"}, "state": {}}, self._inbox.get, self._outbox.put))
        await self._inbox.put({"type": "lifespan.startup"})
        message = await self._outbox.get()
        if message["type"] != "lifespan.startup.complete":
            raise RuntimeError(f"the app did not start: {message.get('message', message['type'])}")

    async def stop(self) -> None:
        if self._task is None:
            return
        await self._inbox.put({"type": "lifespan.shutdown"})
        await self._outbox.get()
        await self._task
