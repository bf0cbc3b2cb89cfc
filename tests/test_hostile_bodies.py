"""Hostile request bodies over real HTTP: each gets a 4xx in OpenAI's error shape (never a 500 or
a dropped connection), and afterwards the server still answers /healthz and a normal chat."""

from __future__ import annotations

import base64
import http.client
import io
import json
import re
import logging
import socket
import threading
import time

import httpx
import pytest

from tests.helpers import start_server, write_config

GOOD = {"model": "tiny-chat", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
BODY_TIMEOUT_S = 2.0
HEAD_TIMEOUT_S = 1.5


@pytest.fixture(scope="module")
def server(tiny_chat, tiny_stt, tmp_path_factory):
    folder = tmp_path_factory.mktemp("hostile")
    extra = (f"limits:\n  max_body: 1MiB\n  max_chat_tokens: 64\n  body_timeout_s: {BODY_TIMEOUT_S}\n"
             f"  head_timeout_s: {HEAD_TIMEOUT_S}\n")
    running = start_server(write_config(folder, {"tiny-chat": ("chat", tiny_chat), "tiny-stt": ("stt", tiny_stt)}, extra))
    yield running
    running.stop()


def _still_serving(server) -> None:
    assert httpx.get(f"{server.url}/healthz", timeout=10).json() == {"status": "ok"}
    r = httpx.post(f"{server.base_url}/chat/completions", json=GOOD, timeout=60,
                   headers={"Authorization": f"Bearer {server.keys['paid']}"})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["role"] == "assistant"


def _error(status: int, body: bytes, want_status: int, code: str | None = None, param: str | None = None) -> dict:
    assert status == want_status, body[:300]
    err = json.loads(body)["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["code"], str) and err["message"]
    if code is not None:
        assert err["code"] == code, err
    assert err["param"] == param, err
    return err


def _port(server) -> int:
    return int(server.url.rsplit(":", 1)[1])


def _head(server, length: int | None, content_type: str = "application/json", extra: bytes = b"") -> bytes:
    size = b"Content-Length: %d\r\n" % length if length is not None else b""
    return (b"POST /v1/chat/completions HTTP/1.1\r\nHost: test\r\nAuthorization: Bearer "
            + server.keys["paid"].encode() + b"\r\nContent-Type: " + content_type.encode() + b"\r\n"
            + size + extra + b"\r\n")


def _read_response(sock: socket.socket) -> tuple[int, dict[str, str], bytes]:
    """One whole HTTP/1.1 response (with Content-Length) from the socket: a dropped connection
    before it is whole fails the test."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, f"the connection closed before a response: {data!r}"
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, v in (ln.split(":", 1) for ln in lines[1:])}
    while len(body) < int(headers["content-length"]):
        chunk = sock.recv(65536)
        assert chunk, "the connection closed inside the response body"
        body += chunk
    return int(lines[0].split()[1]), headers, body


def _raw(server, request: bytes) -> tuple[int, dict[str, str], bytes]:
    with socket.create_connection(("127.0.0.1", _port(server)), timeout=30) as sock:
        sock.sendall(request)
        return _read_response(sock)


def _post(server, raw: bytes) -> tuple[int, bytes]:
    r = httpx.post(f"{server.base_url}/chat/completions", content=raw, timeout=30,
                   headers={"Authorization": f"Bearer {server.keys['paid']}", "Content-Type": "application/json"})
    return r.status_code, r.content


def _with(**fields) -> bytes:
    return json.dumps({**GOOD, **fields}).encode()


def _with_literal(name: str, literal: bytes) -> bytes:
    """GOOD plus a field whose value is written as is (JSON that json.dumps would not write)."""
    return json.dumps(GOOD).encode()[:-1] + b', "' + name.encode() + b'": ' + literal + b"}"


# Refused while the body is parsed: param is null, the message says what is wrong.
JSON_LEVEL = {
    "100k nested arrays": (b"[" * 100_000 + b"]" * 100_000, "deeper than"),
    "100k nested objects": (b'{"a":' * 100_000 + b"1" + b"}" * 100_000, "deeper than"),
    "not UTF-8": (_with(model="tiny-chat").replace(b"tiny-chat", b"tiny-\xff\xfechat"), "not valid UTF-8"),
    "overlong UTF-8": (_with(user="x").replace(b'"x"', b'"\xc0\xaf"'), "not valid UTF-8"),
    "UTF-16": (json.dumps(GOOD).encode("utf-16"), "not valid UTF-8"),
    "lone surrogate": (_with_literal("user", b'"a\\ud800b"'), "surrogate"),
    "NaN": (_with_literal("temperature", b"NaN"), "NaN"),
    "Infinity": (_with_literal("temperature", b"Infinity"), "Infinity"),
    "-Infinity": (_with_literal("temperature", b"-Infinity"), "Infinity"),
    "1e400": (_with_literal("temperature", b"1e400"), "out of range"),
    "10**5000": (_with_literal("seed", b"1" + b"0" * 5000), "digits"),
    "duplicate key": (_with_literal("model", b'"other-model"'), 'duplicate key "model"'),
    "expands when parsed": (b"[" + b"0," * 300_000 + b"0]", "more than"),
    "many empty objects": (b"[" + b"{}," * 200_000 + b"{}]", "more than"),
    "not JSON": (b'{"model": ', "not valid JSON"),
}


@pytest.mark.parametrize("name", list(JSON_LEVEL))
def test_unparsable_body_is_400(server, name):
    raw, says = JSON_LEVEL[name]
    assert len(raw) < 1024 * 1024  # under the size cap: refused for what it is, not its size
    status, _, body = _raw(server, _head(server, len(raw)) + raw)
    err = _error(status, body, 400, "invalid_json")
    assert says in err["message"]
    _still_serving(server)


# Parsed, then refused by type or range: param names the field.
TYPED = {
    "stream as a string": (_with(stream="yes"), "stream", "invalid_type"),
    "stream as a number": (_with(stream=1), "stream", "invalid_type"),
    "temperature as a string": (_with(temperature="1"), "temperature", "invalid_type"),
    "max_tokens as a float": (_with(max_tokens=2.0), "max_tokens", "invalid_type"),
    "max_tokens 10**30": (_with(max_tokens=10**30), "max_tokens", "invalid_value"),
    "seed 10**30": (_with(seed=10**30), "seed", "invalid_value"),
    "seed -2**64": (_with(seed=-(2**64)), "seed", "invalid_value"),
    "temperature 1e300": (_with(temperature=1e300), "temperature", "invalid_value"),
    "nested bool as a string": (_with(stream=True, stream_options={"include_usage": "true"}),
                                "stream_options.include_usage", "invalid_type"),
}


@pytest.mark.parametrize("name", list(TYPED))
def test_wrong_type_or_range_is_400_with_param(server, name):
    raw, param, code = TYPED[name]
    _error(*_post(server, raw), 400, code, param)
    _still_serving(server)


def test_an_int_is_a_fine_float(server):
    status, body = _post(server, _with(temperature=1, top_p=1))
    assert status == 200, body


DEEP = "[" * 2000 + "]" * 2000  # json.loads raises RecursionError past ~1000 levels


def _png() -> bytes:
    from PIL import Image

    out = io.BytesIO()
    Image.new("RGB", (8, 8)).save(out, "PNG")
    return out.getvalue()


# JSON text inside a field (read by a second parse): as deep as a body may be, or a 400 naming it
JSON_TEXT = {
    "structured_outputs.json": ("/chat/completions", {**GOOD, "structured_outputs": {"json": DEEP}}, None,
                                "structured_outputs.json"),
    "a compaction item": ("/responses", {"model": "tiny-chat", "max_output_tokens": 1, "input": [
        {"type": "compaction", "encrypted_content": base64.urlsafe_b64encode(DEEP.encode()).decode()},
        {"role": "user", "content": "hi"}]}, None, "input[0].encrypted_content"),
    "chunking_strategy": ("/audio/transcriptions", {"model": "tiny-stt", "chunking_strategy": '{"a": ' + DEEP + "}"},
                          "file", "chunking_strategy"),
    "an image edit's adapters": ("/images/edits", {"model": "tiny-image", "prompt": "x", "adapters": DEEP}, "image",
                                 "adapters"),
}


@pytest.mark.parametrize("name", list(JSON_TEXT))
def test_json_text_in_a_field_nested_past_the_parser_is_400(server, name):
    path, fields, upload, param = JSON_TEXT[name]
    headers = {"Authorization": f"Bearer {server.keys['paid']}"}
    if upload is None:
        r = httpx.post(f"{server.base_url}{path}", json=fields, headers=headers, timeout=30)
    else:
        r = httpx.post(f"{server.base_url}{path}", data=fields, headers=headers, timeout=30,
                       files={upload: ("a.png", _png())})
    _error(r.status_code, r.content, 400, None, param)


@pytest.mark.parametrize("path", ["/audio/transcriptions", "/files", "/images/edits", "/images/variations"])
def test_multipart_with_10000_parts_is_400(server, path):
    boundary = "hostileboundary"
    parts = "".join(f'--{boundary}\r\nContent-Disposition: form-data; name="f{i}"\r\n\r\nx\r\n' for i in range(10_000))
    raw = (parts + f"--{boundary}--\r\n").encode()
    assert len(raw) < 1024 * 1024
    started = time.monotonic()
    r = httpx.post(f"{server.base_url}{path}", content=raw, timeout=30,
                   headers={"Authorization": f"Bearer {server.keys['paid']}",
                            "Content-Type": f"multipart/form-data; boundary={boundary}"})
    assert time.monotonic() - started < 10  # refused at the part limit, not after the whole body
    _error(r.status_code, r.content, 400, "invalid_multipart")
    _still_serving(server)


def test_multipart_text_fields_still_convert(server):
    """The form's fields arrive as strings: strict JSON types do not apply to them."""
    r = httpx.post(f"{server.base_url}/audio/transcriptions", timeout=30,
                   headers={"Authorization": f"Bearer {server.keys['paid']}"},
                   data={"model": "tiny-stt", "temperature": "5"}, files={"file": ("a.wav", b"not audio")})
    _error(r.status_code, r.content, 400, "invalid_value", "temperature")  # parsed as a number, then out of range


def test_header_section_of_1mb_is_431(server):
    request = _head(server, 2, extra=b"X-Padding: " + b"a" * (1024 * 1024) + b"\r\n") + b"{}"
    with socket.create_connection(("127.0.0.1", _port(server)), timeout=30) as sock:
        try:
            sock.sendall(request)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the server may answer and close before the whole head is sent
        status, headers, body = _read_response(sock)
    _error(status, body, 431, "request_header_fields_too_large")
    assert headers["connection"] == "close"
    _still_serving(server)


def test_a_head_just_under_the_cap_and_a_large_body_sent_with_it_are_served(server):
    """The cap counts the head only: a body in the same packets as its head does not count."""
    from gateway.http11 import MAX_HEAD_BYTES

    padding = b"X-Padding: " + b"a" * (MAX_HEAD_BYTES - 1024) + b"\r\n"
    raw = _with(messages=[{"role": "user", "content": "hi " * 100_000}], max_tokens=1)  # ~300 KB
    assert len(raw) > 4 * MAX_HEAD_BYTES
    with socket.create_connection(("127.0.0.1", _port(server)), timeout=60) as sock:
        sock.sendall(_head(server, len(raw), extra=padding) + raw)
        status, _, body = _read_response(sock)
    assert status != 431, body[:300]
    _error(status, body, 400, "context_length_exceeded", "messages")  # the app read it, and answered
    with socket.create_connection(("127.0.0.1", _port(server)), timeout=60) as sock:
        sock.sendall(_head(server, len(_with()), extra=padding) + _with())
        status, _, body = _read_response(sock)
    assert status == 200, body[:300]


def _head_of(server, size: int, body: bytes, extra: bytes = b"") -> bytes:
    """A chat request's head for ``body`` of exactly ``size`` bytes, request line to blank line."""
    bare = _head(server, len(body), extra=extra + b"X-Padding: \r\n")
    head = _head(server, len(body), extra=extra + b"X-Padding: " + b"a" * (size - len(bare)) + b"\r\n")
    assert len(head) == size
    return head


def _responses(sock: socket.socket, most: int) -> list[tuple[int, bytes]]:
    """Up to ``most`` responses, fewer if the server closes the connection after one."""
    answers = []
    while len(answers) < most:
        try:
            status, headers, body = _read_response(sock)
        except AssertionError:  # closed before another response
            break
        answers.append((status, body))
        if headers.get("connection") == "close":
            break
    return answers


@pytest.mark.parametrize("over", [0, 1], ids=["at the cap", "a byte over"])
@pytest.mark.parametrize("cut", [None, 0, -2], ids=["one write", "cut at the cap", "cut in the blank line"])
def test_the_head_cap_is_exact_however_the_head_arrives(server, over, cut):
    """A head of exactly MAX_HEAD_BYTES is served and one a byte longer is 431, whether it comes
    in one read with its body or in two: the cap counts the head's own bytes, those of the read
    that completes it included."""
    from gateway.http11 import MAX_HEAD_BYTES

    body = _with()
    size = MAX_HEAD_BYTES + over
    request = _head_of(server, size, body) + body
    with socket.create_connection(("127.0.0.1", _port(server)), timeout=60) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if cut is None:
            sock.sendall(request)
        else:
            at = MAX_HEAD_BYTES if cut == 0 else size + cut
            sock.sendall(request[:at])
            time.sleep(0.3)  # read apart from the rest
            sock.sendall(request[at:])
        status, _, answer = _read_response(sock)
    if over:
        _error(status, answer, 431, "request_header_fields_too_large")
    else:
        assert status == 200, answer[:300]
    _still_serving(server)


def _chunked(body: bytes) -> bytes:
    pieces = [body[i:i + 10] for i in range(0, len(body), 10)]
    return b"".join(b"%x;n=v\r\n%s\r\n" % (len(p), p) for p in pieces) + b"0\r\nX-Trailer: t\r\n\r\n"


@pytest.mark.parametrize("over", [0, 1], ids=["at the cap", "a byte over"])
@pytest.mark.parametrize("framing", ["content-length", "chunked"])
def test_the_head_cap_counts_a_pipelined_head_alone(server, over, framing):
    """Two requests in one write: the second's head counts from its own first byte, not the
    first request and its body read with it."""
    from gateway.http11 import MAX_HEAD_BYTES

    body = _with()
    if framing == "chunked":
        first = _head(server, None, extra=b"Transfer-Encoding: chunked\r\n") + _chunked(body)
    else:
        first = _head(server, len(body)) + body
    second = _head_of(server, MAX_HEAD_BYTES + over, body) + body
    with socket.create_connection(("127.0.0.1", _port(server)), timeout=60) as sock:
        sock.sendall(first + b"\r\n" + second)  # a line end between requests is allowed
        answers = _responses(sock, 2)
    if over:  # answered as soon as its head is read: the first request may not be
        assert answers and answers[-1][0] == 431, answers
        _error(*answers[-1], 431, "request_header_fields_too_large")
    else:
        assert [status for status, _ in answers] == [200, 200], answers
    _still_serving(server)


@pytest.mark.parametrize("over", [0, 1], ids=["at the cap", "a byte over"])
def test_a_pipelined_head_read_with_the_request_before_counts_alone(over):
    """The read boundary decides nothing: a read that holds a request, its body and most of a
    pipelined head past the cap (its end inside that head) counted the whole read as the head's,
    and a head at the cap was refused 431 (the test above failed so when the machine was slow to
    read). The protocol is driven directly, with the reads split there."""
    import asyncio

    from uvicorn.config import Config
    from uvicorn.server import ServerState

    from gateway.http11 import MAX_HEAD_BYTES, GatewayHttpToolsProtocol

    class Transport(asyncio.Transport):
        def __init__(self) -> None:
            super().__init__()
            self.written, self.closed = [], False

        def write(self, data) -> None:
            if not self.closed:  # (as asyncio's: nothing goes out after a close)
                self.written.append(bytes(data))

        def close(self) -> None:
            self.closed = True

        def is_closing(self) -> bool:
            return self.closed

        def get_extra_info(self, name, default=None):
            return {"peername": ("127.0.0.1", 1), "sockname": ("127.0.0.1", 2)}.get(name, default)

        def pause_reading(self) -> None:
            pass

        def resume_reading(self) -> None:
            pass

    async def app(scope, receive, send) -> None:
        while (await receive()).get("more_body"):
            pass
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
        await send({"type": "http.response.body", "body": b"ok"})

    def request(size: int, body: bytes) -> bytes:
        bare = b"POST /x HTTP/1.1\r\nHost: a\r\nContent-Length: %d\r\nX-Padding: \r\n\r\n" % len(body)
        return bare[:-4] + b"a" * (size - len(bare)) + b"\r\n\r\n" + body

    async def main() -> bytes:
        config = Config(app=app, log_config=None, lifespan="off")
        config.load()
        protocol = GatewayHttpToolsProtocol(config=config, server_state=ServerState(), app_state={})
        transport = Transport()
        protocol.connection_made(transport)
        body = b"x" * 2000
        both = request(200, body) + request(MAX_HEAD_BYTES + over, body)
        split = 200 + len(body) + MAX_HEAD_BYTES - 100  # with the first request: past the cap
        protocol.data_received(both[:split])
        if not transport.closed:
            protocol.data_received(both[split:])
        await asyncio.sleep(0.2)
        protocol.connection_lost(None)
        return b"".join(transport.written)

    sent = asyncio.run(main())
    statuses = [int(status) for status in re.findall(rb"HTTP/1\.1 (\d{3}) ", sent)]
    if over:  # answered as soon as its head is read: the request before it may not be
        assert statuses in ([431], [200, 431]), sent[:500]
    else:
        assert statuses == [200, 200], sent[:500]


def test_malformed_request_line_is_400_and_the_server_carries_on(server):
    with socket.create_connection(("127.0.0.1", _port(server)), timeout=30) as sock:
        sock.sendall(b"NOT HTTP AT ALL\r\n\r\n")
        status, headers, body = _read_response(sock)
    _error(status, body, 400, "invalid_http_request")
    assert headers["connection"] == "close"
    _still_serving(server)


def test_slow_body_is_cut_off_with_408_while_others_are_served(server):
    raw = _with()
    with socket.create_connection(("127.0.0.1", _port(server)), timeout=30) as sock:
        sock.sendall(_head(server, len(raw)))
        started = time.monotonic()
        stop = threading.Event()

        def drip() -> None:  # one byte every 0.2 s: the whole body would take ~14 s
            for byte in raw[:-1]:
                if stop.wait(0.2):
                    return
                try:
                    sock.sendall(bytes([byte]))
                except OSError:
                    return

        dripping = threading.Thread(target=drip, daemon=True)
        dripping.start()
        _still_serving(server)  # others are answered meanwhile
        try:
            status, headers, body = _read_response(sock)
        finally:
            stop.set()
            dripping.join(5)
    waited = time.monotonic() - started
    _error(status, body, 408, "request_timeout")
    assert BODY_TIMEOUT_S <= waited < BODY_TIMEOUT_S + 10
    _still_serving(server)


def _closed(sock: socket.socket) -> bool:
    """Whether the server has closed the connection (nothing more to read)."""
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:  # a byte the client sent after the close: reset
        return True


def _dripping(sock: socket.socket, stop: threading.Event) -> threading.Thread:
    """A thread sending a header line every 0.3 s until ``stop`` (or the server closes)."""
    def drip() -> None:
        n = 0
        while not stop.wait(0.3):
            n += 1
            try:
                sock.sendall(b"X-Slow-%d: x\r\n" % n)
            except OSError:
                return

    dripping = threading.Thread(target=drip, daemon=True)
    dripping.start()
    return dripping


@pytest.mark.parametrize("idle", [False, True], ids=["a header line now and then", "idle half-sent"])
def test_a_head_not_whole_in_time_is_408_and_closed(server, idle):
    """A client with no key that never finishes its request line and headers (a header line every
    0.3 s, or half a head left idle) gets a 408 ``request_timeout`` in OpenAI's shape within
    ``limits.head_timeout_s`` and its connection closed, instead of holding it for as long as it
    likes; others are served meanwhile."""
    with socket.create_connection(("127.0.0.1", _port(server)), timeout=HEAD_TIMEOUT_S + 10) as sock:
        started = time.monotonic()
        stop = threading.Event()
        if idle:
            sock.sendall(b"GET /v1/models HTTP/1.1\r\nHost: te")
        else:
            sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: test\r\n")
            dripping = _dripping(sock, stop)
        try:
            status, headers, body = _read_response(sock)
            waited = time.monotonic() - started
        finally:
            stop.set()
        if not idle:
            dripping.join(5)
        assert _closed(sock)
    _error(status, body, 408, "request_timeout")
    assert headers["connection"] == "close"
    assert HEAD_TIMEOUT_S - 0.1 <= waited < HEAD_TIMEOUT_S + 5
    _still_serving(server)


def test_a_connection_that_sends_nothing_is_closed_unanswered(server):
    """A new connection that sends no byte is closed after ``limits.head_timeout_s`` with no
    answer (as an idle kept-alive one is): a client would read a 408 as its next request's."""
    with socket.create_connection(("127.0.0.1", _port(server)), timeout=HEAD_TIMEOUT_S + 10) as sock:
        started = time.monotonic()
        assert sock.recv(65536) == b""
        waited = time.monotonic() - started
    assert HEAD_TIMEOUT_S - 0.1 <= waited < HEAD_TIMEOUT_S + 5


@pytest.mark.parametrize("then", [b"GET /healthz HTTP/1.1\r\nHo", b"\r\n"], ids=["half a head", "a line end"])
def test_a_kept_alive_connection_times_each_head_from_its_first_byte(server, then):
    """On a kept-alive connection each head has its own ``limits.head_timeout_s``, from the first
    byte after the idle wait: requests spread over longer than that are all served, and a next
    head that does not come whole is cut off: half of one with a 408, only a line end (no head
    begun) with the connection closed unanswered."""
    healthz = b"GET /healthz HTTP/1.1\r\nHost: test\r\n\r\n"
    with socket.create_connection(("127.0.0.1", _port(server)), timeout=HEAD_TIMEOUT_S + 10) as sock:
        for _ in range(3):  # 3 x 0.8 s: longer than one head's time, on one connection
            sock.sendall(healthz)
            status, headers, _ = _read_response(sock)
            assert status == 200 and headers.get("connection") != "close"
            time.sleep(0.8)
        sock.sendall(then)
        started = time.monotonic()
        if then == b"\r\n":
            assert _closed(sock)
        else:
            status, headers, body = _read_response(sock)
            assert _closed(sock)
            _error(status, body, 408, "request_timeout")
        waited = time.monotonic() - started
    assert HEAD_TIMEOUT_S - 0.1 <= waited < HEAD_TIMEOUT_S + 5


def test_a_pipelined_head_is_timed_from_the_response_before_it(server):
    """Half a head sent behind a whole request (one write) is timed once that request is
    answered: the first is served, then the half head is a 408 and a close."""
    with socket.create_connection(("127.0.0.1", _port(server)), timeout=HEAD_TIMEOUT_S + 10) as sock:
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: test\r\n\r\nGET /healthz HTTP/1.1\r\nHo")
        status, _, _ = _read_response(sock)
        assert status == 200
        started = time.monotonic()
        status, _, body = _read_response(sock)
        waited = time.monotonic() - started
        assert _closed(sock)
    _error(status, body, 408, "request_timeout")
    assert HEAD_TIMEOUT_S - 0.3 <= waited < HEAD_TIMEOUT_S + 5


def test_client_leaving_mid_body_leaves_no_error(server, caplog):
    caplog.set_level(logging.INFO)
    raw = _with()
    with socket.create_connection(("127.0.0.1", _port(server)), timeout=30) as sock:
        sock.sendall(_head(server, len(raw)) + raw[: len(raw) // 2])
        time.sleep(0.3)
    time.sleep(0.3)
    _still_serving(server)
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text


def test_a_500_keeps_the_connection_for_the_next_request(server, monkeypatch, caplog):
    """A request that fails with an error nothing expected is a 500 ``internal_error`` (logged
    once, with its traceback) on a connection that stays open: the client's next request on it
    is answered, not reset, and nothing announces a close that does not come."""
    def broken() -> list:
        raise RuntimeError("a bug")

    monkeypatch.setattr(server.services.adapters, "rows", broken)
    caplog.set_level(logging.ERROR)
    conn = http.client.HTTPConnection("127.0.0.1", _port(server), timeout=30)  # one connection, never replaced
    auth = {"Authorization": f"Bearer {server.keys['paid']}", "Content-Type": "application/json"}
    conn.request("GET", "/v1/models", headers={**auth, "x-request-id": "req-broken"})
    failed = conn.getresponse()
    body = json.loads(failed.read())
    assert failed.status == 500 and body["error"]["code"] == "internal_error", body
    assert not failed.will_close and failed.getheader("x-request-id") == "req-broken"
    time.sleep(0.3)  # time for the server to drop the connection, were it to
    monkeypatch.undo()
    for method, path, sent in (("GET", "/v1/models", None), ("POST", "/v1/chat/completions", json.dumps(GOOD))):
        conn.request(method, path, body=sent, headers=auth)
        answer = conn.getresponse()
        assert answer.status == 200, answer.read()
        answer.read()
    conn.close()
    logged = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(logged) == 1 and "unexpected error on GET /v1/models" in logged[0].getMessage(), caplog.text
    assert logged[0].exc_info is not None


def test_a_stream_to_an_http_1_0_client_is_not_chunked(server):
    """HTTP/1.0 has no chunked coding (RFC 9112, 6.1): a stream to an HTTP/1.0 request (a proxy or
    a tool that speaks it) is its SSE text alone, ended by the close, with no chunk sizes in it;
    a response with a length keeps it."""
    body = _with(stream=True, temperature=0)
    for request, streamed in ((b"POST /v1/chat/completions HTTP/1.0\r\nAuthorization: Bearer "
                               + server.keys["paid"].encode() + b"\r\nContent-Type: application/json\r\n"
                               + b"Content-Length: %d\r\n\r\n" % len(body) + body, True),
                              (b"GET /healthz HTTP/1.0\r\n\r\n", False)):
        with socket.create_connection(("127.0.0.1", _port(server)), timeout=30) as sock:
            sock.sendall(request)
            data = b""
            while chunk := sock.recv(65536):  # the server closes the connection after the response
                data += chunk
        head, _, answer = data.partition(b"\r\n\r\n")
        head = head.decode("latin-1").lower()
        assert head.startswith("http/1.1 200") and "transfer-encoding" not in head, data[:300]
        if streamed:
            events = answer.decode().split("\n\n")
            assert events[-2:] == ["data: [DONE]", ""], answer[-200:]
            assert all(e.startswith("data: ") for e in events[:-1]), answer[:300]
            assert json.loads(events[0][len("data: "):])["object"] == "chat.completion.chunk"
        else:
            assert "content-length" in head and json.loads(answer) == {"status": "ok"}
