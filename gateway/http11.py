"""The HTTP/1.1 protocol tiergate serves with: uvicorn's httptools protocol (llhttp, in C), with
the request line and headers capped at ``MAX_HEAD_BYTES`` (httptools reads them without limit),
and a request it cannot parse answered in OpenAI's error shape: 431 for a head past the cap, 400
for anything else malformed. The connection is closed after either answer; the server carries on.

Not uvicorn's h11 protocol, which caps the head itself: h11 parses in Python, and on a small
request it cost the server ~0.16 ms of CPU against httptools' ~0.06 (docs/BENCHMARKS.md, "The
HTTP parser"), for every request, refusals included, on the same interpreter as the engine."""

from __future__ import annotations

import json

from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

from gateway.errors import APIError

MAX_HEAD_BYTES = 64 * 1024  # request line plus headers


class _Refused(Exception):
    """Raised from the parser's callback once the connection is answered, to stop the parser there
    (httptools raises it on as a parser error: ``send_400_response`` then answers nothing more)."""


class GatewayHttpToolsProtocol(HttpToolsProtocol):
    """The head is bounded twice: while it arrives, by the reads that end inside it (the parser
    keeps them all), and once complete, by its own lines as parsed (``_head_size``), so a head that
    arrives in one read, with its body, or behind another request, is held to the cap as well."""

    head_limit = MAX_HEAD_BYTES

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._in_head = True  # from a message's first byte until its headers are complete
        self._head_bytes = 0  # bytes of the reads that ended while in the head
        self._read = 0  # the length of the read being parsed

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._in_head, self._head_bytes = True, 0

    def on_headers_complete(self) -> None:
        self._in_head = False
        # (the head is no longer than what arrived since it began: nearly every request skips the sum)
        if self._head_bytes + self._read > self.head_limit and self._head_size() > self.head_limit:
            self._refuse(self._too_large())
            raise _Refused  # before its request starts: the parser stops here
        super().on_headers_complete()

    def _head_size(self) -> int:
        """The complete head's bytes: its request line, and each header line as ``name: value``
        with its CRLF, and the blank line (a header written without the space, or with spaces
        after its value, is counted a byte or so off)."""
        line = len(self.parser.get_method()) + 1 + len(self.url) + len(" HTTP/1.1\r\n")
        return line + sum(len(name) + len(value) + 4 for name, value in self.headers) + 2

    def data_received(self, data: bytes) -> None:
        self._read = len(data)
        super().data_received(data)
        # Counted after parsing, so that a body arriving with its head is never counted: a read
        # counts here only when the parser is still inside a head at its end (a read that
        # completes a head is measured in ``on_headers_complete``).
        if self._in_head and not self.transport.is_closing():
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
