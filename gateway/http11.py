"""The HTTP/1.1 protocol tiergate serves with: uvicorn's httptools protocol (llhttp, in C), with
the request line and headers capped at ``MAX_HEAD_BYTES`` (httptools reads them without limit),
and a request it cannot parse answered in OpenAI's error shape: 431 for a head past the cap, 400
for anything else malformed. The connection is closed after either answer; the server carries on.
A head must also arrive whole within ``limits.head_timeout_s``, or it is answered 408 and closed:
httptools reads it for as long as the client likes (uvicorn times only the idle wait between
requests, ``timeout_keep_alive``), so a client sending a header line now and then, with no key,
would hold its connection (and a file descriptor) open forever.

Not uvicorn's h11 protocol, which caps the head itself: h11 parses in Python, and on a small
request it cost the server ~0.16 ms of CPU against httptools' ~0.06 (docs/BENCHMARKS.md, "The
HTTP parser"), for every request, refusals included, on the same interpreter as the engine.

A response to an HTTP/1.0 request that has no ``content-length`` (a stream) is close-delimited, as
h11 sends it: uvicorn's httptools protocol would frame it with ``transfer-encoding: chunked``,
which an HTTP/1.0 client does not know (RFC 9112, 6.1: not to a request below HTTP/1.1), so its
body would carry the chunks' sizes. uvicorn closes an HTTP/1.0 connection after each response."""

from __future__ import annotations

import json

from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol, RequestResponseCycle

from gateway.deadlines import Deadline, Deadlines
from gateway.errors import APIError

MAX_HEAD_BYTES = 64 * 1024  # request line plus headers
HEAD_TIMEOUT_S = 10.0  # limits.head_timeout_s's default


class _Refused(Exception):
    """Raised from the parser's callback once the connection is answered, to stop the parser there
    (httptools raises it on as a parser error: ``send_400_response`` then answers nothing more)."""


class GatewayHttpToolsProtocol(HttpToolsProtocol):
    """The head is bounded twice: while it arrives, by the reads that end inside it (the parser
    keeps them all), and once complete, by its own lines as parsed (``_head_size``), so a head that
    arrives in one read, with its body, or behind another request, is held to the cap as well.

    And it is timed: a new connection's head is due ``head_deadlines.seconds`` after the
    connection is made, a kept-alive one's after the first read that ends the idle wait (which is
    uvicorn's keep-alive timeout), whatever that read holds (line ends, the rest of a body its app
    answered unread), and a pipelined one's after the response before it. One deadline per
    request, from a FIFO shared by all (gateway/deadlines.py): no loop timer each."""

    head_limit = MAX_HEAD_BYTES
    head_deadlines = Deadlines(HEAD_TIMEOUT_S)

    @classmethod
    def timed(cls, head_timeout_s: float) -> type[GatewayHttpToolsProtocol]:
        """This protocol with heads due within ``head_timeout_s`` (uvicorn takes a class)."""
        return type(cls.__name__, (cls,), {"head_deadlines": Deadlines(head_timeout_s)})

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._in_head = True  # from a message's first byte until its headers are complete
        self._head_bytes = 0  # bytes of the reads that ended while in the head
        self._read = 0  # the length of the read being parsed
        self._ended_in_read = False  # whether a message ended in the read being parsed
        self._pipelined = False  # whether the head being read began after a message ended in the same read
        self._head_slack = 0  # bytes of such a read that may be the head's, not counted in _head_bytes
        self._head_due: Deadline | None = None  # pending while a head is awaited and no response is

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._head_due = self.head_deadlines.after(self._head_late)

    def connection_lost(self, exc: Exception | None) -> None:
        if self._head_due is not None:
            self._head_due.cancel()
        super().connection_lost(exc)

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._in_head, self._head_bytes, self._pipelined, self._head_slack = True, 0, self._ended_in_read, 0

    def on_message_complete(self) -> None:
        super().on_message_complete()
        self._ended_in_read = True

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self._in_head and self._head_due is None and not self.transport.is_closing():
            self._head_due = self.head_deadlines.after(self._head_late)  # a pipelined head, begun meanwhile

    def _head_late(self) -> None:
        self._head_due = None
        if self.transport.is_closing():
            return
        if self.scope is None or not self._in_head:
            # no head begun (a new connection that sent nothing, a browser's preconnect say, or only line ends or the
            # rest of an answered body since the last head): closed unanswered, as an idle kept-alive connection is,
            # since its client would read an unasked-for 408 as its next request's answer
            self.transport.close()
            return
        message = f"the request line and headers did not arrive within {self.head_deadlines.seconds:g} s"
        self._refuse(APIError(408, message, "request_timeout"))

    def on_headers_complete(self) -> None:
        self._in_head = False
        if self._head_due is not None:
            self._head_due.cancel()
            self._head_due = None
        # (the head is no longer than what arrived since it began: nearly every request skips the sum)
        over = self._head_bytes + self._head_slack + self._read > self.head_limit
        if over and self._head_size() > self.head_limit:
            self._refuse(self._too_large())
            raise _Refused  # before its request starts: the parser stops here
        super().on_headers_complete()

    def _start_asgi_task(self, cycle: RequestResponseCycle, app) -> None:
        if cycle.scope.get("http_version") == "1.0":
            app = _close_delimited(app, cycle)
        super()._start_asgi_task(cycle, app)

    def _parsed_head(self) -> int:
        """A lower bound of the bytes of a head begun in this read: its URL and its whole header
        lines so far (the method is known at the head's end)."""
        return len(self.url) + sum(len(name) + len(value) + 4 for name, value in self.headers)

    def _head_size(self) -> int:
        """The complete head's bytes: its request line, and each header line as ``name: value``
        with its CRLF, and the blank line (a header written without the space, or with spaces
        after its value, is counted a byte or so off)."""
        line = len(self.parser.get_method()) + 1 + len(self.url) + len(" HTTP/1.1\r\n")
        return line + sum(len(name) + len(value) + 4 for name, value in self.headers) + 2

    def data_received(self, data: bytes) -> None:
        if self.timeout_keep_alive_task is not None and self._head_due is None:  # (uvicorn cancels it, below)
            self._head_due = self.head_deadlines.after(self._head_late)  # the idle wait is over: a head is due
        self._read, self._ended_in_read, self._pipelined = len(data), False, False
        super().data_received(data)
        # Counted after parsing, so that a body arriving with its head is never counted: a read
        # counts here only when the parser is still inside a head at its end (a read that
        # completes a head is measured in ``on_headers_complete``), whole, unless the head began
        # after a message that ended in it (pipelined: the request before and its body came in
        # the same read), which counts what was parsed of it (its URL and whole header lines),
        # the rest kept as slack: a header line in progress is counted at the head's end
        if self._in_head and not self.transport.is_closing():
            if self._pipelined:
                self._head_bytes = self._parsed_head()
                self._head_slack = len(data) - self._head_bytes
            else:
                self._head_bytes += len(data)
            if self._head_bytes > self.head_limit:
                self._refuse(self._too_large())

    def _too_large(self) -> APIError:
        return APIError(431, f"the request line and headers are longer than {self.head_limit} bytes",
                        "request_header_fields_too_large")

    def send_400_response(self, msg: str) -> None:
        if self.transport.is_closing():
            return  # answered already (``_Refused``)
        self._refuse(APIError(400, "the request is not valid HTTP/1.1", "invalid_http_request"))

    def _refuse(self, error: APIError) -> None:
        body = json.dumps(error.body()).encode()
        head = [STATUS_LINE[error.status]]
        for name, value in self.server_state.default_headers:
            head += [name, b": ", value, b"\r\n"]
        head += [b"content-type: application/json\r\ncontent-length: ", str(len(body)).encode(),
                 b"\r\nconnection: close\r\n\r\n", body]
        self.transport.write(b"".join(head))
        self.transport.close()


def _close_delimited(app, cycle: RequestResponseCycle):
    """``app`` answering an HTTP/1.0 request on ``cycle``: a response without ``content-length``
    or ``transfer-encoding`` is sent as is and ends with the connection (HTTP/1.0 is never kept
    alive), not chunked; each body part passes uvicorn's length check as a part of its own size."""

    async def answer(scope, receive, send) -> None:
        delimited = False

        async def send_delimited(message) -> None:
            nonlocal delimited
            if message["type"] == "http.response.start" and not cycle.response_started:
                names = {name.lower() for name, _ in message.get("headers", ())}
                if b"content-length" not in names and b"transfer-encoding" not in names:
                    delimited, cycle.chunked_encoding = True, False  # uvicorn adds no transfer-encoding
            elif delimited and message["type"] == "http.response.body" and not cycle.response_complete:
                cycle.expected_content_length = len(message.get("body", b""))
            await send(message)

        await app(scope, receive, send_delimited)

    return answer
