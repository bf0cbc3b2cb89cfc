"""A deadline for reading each request body, as ASGI middleware.

A client that sends its body too slowly (one byte a second, say) gets a 408 in OpenAI's shape and
its connection closed, instead of holding a connection and a handler open for as long as it
likes. The clock starts when the app first asks for the body and stops once the body is whole;
waiting for the client's disconnect afterwards (streamed responses) is not limited. A client
that leaves halfway through its body gets no answer and leaves no traceback behind.
"""

from __future__ import annotations

import asyncio

from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway.errors import APIError


class BodyDeadline:
    def __init__(self, app: ASGIApp, seconds: float) -> None:
        self.app = app
        self.seconds = seconds

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        deadline: float | None = None
        whole = False

        async def receive_in_time() -> Message:
            nonlocal deadline, whole
            if whole:
                return await receive()
            if deadline is None:
                deadline = asyncio.get_running_loop().time() + self.seconds
            try:  # asyncio's own timeout: a quarter of anyio.fail_after's cost, on every request
                async with asyncio.timeout_at(deadline):
                    message = await receive()
            except TimeoutError:
                raise APIError(408, f"the request body did not arrive within {self.seconds:g} s",
                               "request_timeout") from None
            whole = message["type"] != "http.request" or not message.get("more_body", False)
            return message

        try:
            await self.app(scope, receive_in_time, send)
        except ClientDisconnect:
            pass  # the client left before its body was whole: there is no one to answer
