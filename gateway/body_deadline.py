"""A deadline for reading each request body, as ASGI middleware.

A client that sends its body too slowly (one byte a second, say) gets a 408 in OpenAI's shape and
its connection closed, instead of holding a connection and a handler open for as long as it
likes. The clock starts when the app first asks for the body and stops once the body is whole;
waiting for the client's disconnect afterwards (streamed responses) is not limited. A client
that leaves halfway through its body leaves no traceback behind: the app's handler answers it
499 (``gateway.app``: logged so, the answer dropped), and one raised outside it ends here.
"""

from __future__ import annotations

import asyncio

from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway.deadlines import Deadline, Deadlines
from gateway.errors import APIError


class BodyDeadline:
    def __init__(self, app: ASGIApp, seconds: float) -> None:
        self.app = app
        self.seconds = seconds
        self.deadlines = Deadlines(seconds)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        deadline: Deadline | None = None  # set at the first read, for the whole body
        reader: asyncio.Task | None = None  # the task waiting for a piece of the body, if any
        expired = whole = False

        def expire() -> None:
            nonlocal expired
            expired = True
            if reader is not None:
                reader.cancel()

        async def receive_in_time() -> Message:
            # one deadline per request rather than asyncio.timeout per read: a third of its cost
            nonlocal deadline, reader, whole
            if whole:
                return await receive()
            if deadline is None:
                deadline = self.deadlines.after(expire)
            if not expired:
                reader = asyncio.current_task()
                try:
                    message = await receive()
                except asyncio.CancelledError:
                    if not (expired and reader.uncancel() == 0):  # not (only) the deadline's
                        raise
                else:
                    whole = message["type"] != "http.request" or not message.get("more_body", False)
                    if whole:
                        deadline.cancel()
                    return message
                finally:
                    reader = None
            raise APIError(408, f"the request body did not arrive within {self.seconds:g} s", "request_timeout")

        try:
            await self.app(scope, receive_in_time, send)
        except ClientDisconnect:
            pass  # the client left before its body was whole: there is no one to answer
        finally:
            if deadline is not None and not whole:  # (once whole, it was cancelled)
                deadline.cancel()
