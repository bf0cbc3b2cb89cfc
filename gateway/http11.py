"""The HTTP/1.1 protocol tiergate serves with: uvicorn's h11 protocol, whose parser caps the
request line and headers (httptools reads headers without limit), answering a request it cannot
parse in OpenAI's error shape: 431 for a head past the cap, 400 for anything else malformed. The
connection is closed after either answer; the server carries on."""

from __future__ import annotations

import json

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from gateway.errors import APIError

MAX_HEAD_BYTES = 64 * 1024  # request line plus headers


class GatewayH11Protocol(H11Protocol):
    def send_400_response(self, msg: str) -> None:
        pending, _ = self.conn.trailing_data  # h11 refuses a head by its unparsed bytes passing the cap
        limit = self.config.h11_max_incomplete_event_size or MAX_HEAD_BYTES
        if len(pending) > limit:
            error = APIError(431, f"the request line and headers are longer than {limit} bytes",
                             "request_header_fields_too_large")
        else:
            error = APIError(400, "the request is not valid HTTP/1.1", "invalid_http_request")
        body = json.dumps(error.body()).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                   (b"connection", b"close")]
        for event in (h11.Response(status_code=error.status, headers=headers), h11.Data(data=body), h11.EndOfMessage()):
            self.transport.write(self.conn.send(event))
        self.transport.close()
