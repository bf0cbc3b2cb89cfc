"""What HTTP handlers share on top of the serving core: the client's disconnect as a signal for
``Serving``, a streamed response that closes its source however the stream ends, and a model
request answered as JSON by the serving core a batch line shares (``answered``)."""

from __future__ import annotations

import asyncio
from typing import AsyncIterator, Awaitable, Callable

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from gateway.auth import Caller
from gateway.deadlines import Deadline, Deadlines
from gateway.schemas import read_json
from gateway.service import Services
from gateway.serving import Gone

Answer = Callable[[Services, Caller, dict, "Gone | None"], Awaitable[dict]]


async def answered(request: Request, answer: Answer) -> Response:
    """A model request whose JSON body ``answer`` turns into its JSON answer (the serving core,
    which batch lines call too): admitted (or refused at once), read, answered while the client
    stays; the tier's rate headers on it."""
    svc: Services = request.app.state.services
    caller = svc.admit_caller(request)
    data = await read_json(request, svc.config.limits.max_body)
    async with disconnect_signal(request) as gone:
        result = await answer(svc, caller, data, gone)
    return JSONResponse(result, headers=svc.gate.rate_headers(caller.tier))


WATCH_AFTER_S = 0.05  # a block that ends sooner never starts its watcher
_watch_starts = Deadlines(WATCH_AFTER_S)


class disconnect_signal:
    """``async with disconnect_signal(request) as gone``: a signal set when the client disconnects,
    watched while the block runs from ``WATCH_AFTER_S`` on: a short request (most non-streamed
    ones) costs no watcher task, and a client gone in its first 50 ms is noticed at 50 ms. Leave
    the block before a streamed response starts: the response watches the connection itself.
    (A class, not a generator-based context manager: it is entered once per request.)"""

    def __init__(self, request: Request) -> None:
        self.receive = request.receive
        self.gone = Gone()
        self.watcher: asyncio.Task | None = None
        self.start: Deadline | None = None

    async def __aenter__(self) -> Gone:
        self.start = _watch_starts.after(self._start)
        return self.gone

    async def __aexit__(self, *exc_info: object) -> None:
        self.gone.watched = False
        self.start.cancel()
        if self.watcher is not None:
            # Not awaited (two turns of the loop per request): the watcher ends at its next step,
            # inside the receive it waits in, before anything else can read the connection.
            self.watcher.cancel()

    def _start(self) -> None:
        self.watcher = asyncio.create_task(self._watch())

    async def _watch(self) -> None:
        while (await self.receive())["type"] != "http.disconnect":
            pass
        self.gone.set()


KEEPALIVE = b": keep-alive\n\n"  # an SSE comment: every client's parser skips it
PING = b'event: ping\ndata: {"type": "ping"}\n\n'  # Anthropic's, on its Messages API's streams


class Streamed(StreamingResponse):
    """A streamed response whose ``content`` is always closed when the response ends, including
    when the client disconnects before the first byte: closing it ends the serving core's
    ``Serving`` block, which gives the slot and the lease back.

    An event stream that has sent nothing for ``server.keepalive_s`` (tiers.yaml) sends a
    keep-alive (an SSE comment; Anthropic's ``ping`` event on ``/v1/messages``), so that a proxy's
    idle timeout does not cut a stream that waits: a flex or batch request paused behind paid
    traffic, a reasoning reply whose thinking is left out. A task per stream sleeps until then;
    the stream's own chunks and the keep-alives share one lock around ``send``."""

    def __init__(self, content: AsyncIterator[str | bytes], media_type: str, headers: dict[str, str]) -> None:
        super().__init__(content, media_type=media_type, headers={**headers, "cache-control": "no-cache"})
        self._content = content
        self._keepalive: tuple[float, bytes] | None = None

    async def __call__(self, scope, receive, send) -> None:
        services = getattr(getattr(scope.get("app"), "state", None), "services", None)
        every = services.config.server.keepalive_s if services is not None else 0
        if every > 0 and self.media_type == "text/event-stream":
            self._keepalive = (every, PING if scope.get("path", "").startswith("/v1/messages") else KEEPALIVE)
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._content.aclose()

    async def stream_response(self, send) -> None:
        if self._keepalive is None:
            return await super().stream_response(send)
        every, beat = self._keepalive
        loop, lock = asyncio.get_running_loop(), asyncio.Lock()
        last = [loop.time()]  # when the stream last sent something

        async def keep_alive() -> None:
            while True:
                wait = last[0] + every - loop.time()
                if wait > 0:
                    await asyncio.sleep(wait)
                    continue
                async with lock:  # (behind a chunk being sent, which makes the stream busy again)
                    if loop.time() - last[0] >= every:
                        await send({"type": "http.response.body", "body": beat, "more_body": True})
                        last[0] = loop.time()

        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        beating = asyncio.create_task(keep_alive())
        try:
            async for chunk in self.body_iterator:
                if not isinstance(chunk, bytes | memoryview):
                    chunk = chunk.encode(self.charset)
                async with lock:
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
                    last[0] = loop.time()
        finally:
            beating.cancel()
            await asyncio.gather(beating, return_exceptions=True)
        await send({"type": "http.response.body", "body": b"", "more_body": False})
