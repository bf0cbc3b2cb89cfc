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


class GatewayHttpToolsProtocol(HttpToolsProtocol):
    head_limit = MAX_HEAD_BYTES

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._in_head = True  # from a message's first byte until its headers are complete
        self._head_bytes = 0  # bytes received while in the head (the parser keeps all of them)

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._in_head, self._head_bytes = True, 0

    def on_headers_complete(self) -> None:
        self._in_head = False
        super().on_headers_complete()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        # Counted after parsing, so that a body arriving with its head is never counted: a chunk
        # counts only when the parser is still inside a head at its end.
        if self._in_head and not self.transport.is_closing():
            self._head_bytes += len(data)
            if self._head_bytes > self.head_limit:
                self._refuse(APIError(431, f"the request line and headers are longer than {self.head_limit} bytes",
                                      "request_header_fields_too_large"))

    def send_400_response(self, msg: str) -> None:
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
