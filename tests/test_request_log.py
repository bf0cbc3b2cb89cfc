"""The request log's writer (gateway.request_log.LineWriter): request lines are queued on the
caller's thread and written by the writer's thread; every other line goes out at once, after
the queued ones; flush and close leave nothing queued. And what a line says of a stream its
client left, or of a request whose client left while sending its body (``RequestLog``, on a
server in this process)."""

from __future__ import annotations

import json
import logging
import socket
import time

import httpx
import pytest

from gateway.request_log import Formatter, LineWriter, RequestRecord
from tests.helpers import start_server, stream_and_leave, write_config


class Captured:
    """What reached stderr so far (pytest's ``capsys``: the writer writes to the stderr of the moment)."""

    def __init__(self, capsys) -> None:
        self.capsys, self.text = capsys, ""

    def getvalue(self) -> str:
        self.text += self.capsys.readouterr().err
        return self.text


@pytest.fixture
def captured(capsys) -> Captured:
    return Captured(capsys)


@pytest.fixture
def logger():
    log = logging.getLogger("tiergate.test-request-log")
    log.propagate, log.level = False, logging.INFO
    yield log
    for handler in log.handlers:
        handler.close()
    log.handlers.clear()


def writer(log: logging.Logger, period: float) -> LineWriter:
    handler = LineWriter(period=period)
    handler.setFormatter(Formatter(json_lines=False))
    log.addHandler(handler)
    return handler


def request_line(log: logging.Logger, n: int) -> None:
    record = RequestRecord(f"r{n}", "POST", "/v1/chat/completions", status=200, duration_s=0.123456)
    log.info("request", extra={"request": record.fields()})


def request_ids(text: str) -> list[str]:
    return [word.split("=", 1)[1] for word in text.split() if word.startswith("request_id=")]


def test_request_lines_wait_for_the_writer_and_flush_writes_them(captured, logger):
    handler = writer(logger, period=60)  # the thread would not write for a minute
    for n in range(3):
        request_line(logger, n)
    assert captured.getvalue() == ""  # queued, not written on the caller's thread
    handler.flush()
    assert request_ids(captured.getvalue()) == ["r0", "r1", "r2"]
    assert "duration_s=0.1235" in captured.getvalue()


def test_other_lines_go_out_at_once_after_the_queued_ones(captured, logger):
    writer(logger, period=60)
    request_line(logger, 0)
    request_line(logger, 1)
    logger.warning("the store is slow")
    lines = captured.getvalue().splitlines()
    assert len(lines) == 3
    assert request_ids(lines[0]) == ["r0"] and request_ids(lines[1]) == ["r1"]
    assert lines[2].endswith("WARNING tiergate.test-request-log: the store is slow")


def test_the_thread_writes_queued_lines_in_one_batch(captured, logger):
    handler = writer(logger, period=0.05)
    for n in range(20):
        request_line(logger, n)
    handler._thread.join(0.5)  # noqa: SLF001 - wait a while (it never ends by itself)
    assert request_ids(captured.getvalue()) == [f"r{n}" for n in range(20)]


def test_close_leaves_nothing_queued_and_later_lines_are_written_at_once(captured, logger):
    handler = writer(logger, period=60)
    request_line(logger, 0)
    handler.close()
    assert request_ids(captured.getvalue()) == ["r0"]
    assert not handler._thread.is_alive()  # noqa: SLF001
    request_line(logger, 1)
    assert request_ids(captured.getvalue()) == ["r0", "r1"]


def test_request_lines_skip_the_logging_call_only_where_the_writer_alone_would_get_them(captured, monkeypatch):
    """``takes``: the fast path (``queue_request``) stands for ``log.handle`` only when the line
    would reach this writer alone; the line it queues is written like a logged one."""
    import datetime
    import time

    from gateway import request_log

    root = logging.getLogger("tiergate-test-root")
    child = logging.getLogger("tiergate-test-root.mid.requests")
    monkeypatch.setattr(request_log, "_root", root)
    handler = LineWriter(period=60)
    handler.setFormatter(Formatter(json_lines=False))
    root.handlers[:] = [handler]
    try:
        assert handler.takes(child)
        other = logging.NullHandler()
        for place in (child, logging.getLogger("tiergate-test-root.mid"), root):
            place.addHandler(other)
            assert not handler.takes(child)  # the line would also reach ``other``
            place.removeHandler(other)
        child.propagate = False
        assert not handler.takes(child)
        child.propagate = True

        before = time.time()
        record = RequestRecord("r9", "POST", "/v1/embeddings", status=200, duration_s=0.123456)
        handler.queue_request(record.__dict__.copy())  # as RequestLog queues it: the writer picks the fields
        assert captured.getvalue() == ""  # queued
        handler.flush()
        line = captured.getvalue()
        assert request_ids(line) == ["r9"] and "tiergate.requests: request" in line
        assert line.split(": request ", 1)[1].strip() == "request_id=r9 method=POST endpoint=/v1/embeddings status=200 " \
            "duration_s=0.1235"  # the logged fields only, rounded; not ``started``
        stamp = datetime.datetime.fromisoformat(line.split()[0]).timestamp()
        assert before - 0.002 <= stamp <= time.time()  # the time it was queued, not written
        handler.close()
        assert not handler.takes(child)
    finally:
        root.handlers.clear()
        handler.close()


def test_a_forked_child_does_not_repeat_its_parents_ids():
    """Ids come from a seeded PRNG (no system call per id); a fork reseeds it in the child."""
    import os

    from gateway.request_log import new_id

    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.write(write, new_id().encode())
        os._exit(0)
    os.close(write)
    os.waitpid(pid, 0)
    child = os.read(read, 64).decode()
    os.close(read)
    assert len(child) == 32 and child != new_id()


@pytest.mark.parametrize("json_lines", [False, True])
def test_a_queued_request_line_is_written_as_its_log_record_would_be(json_lines):
    """The writer formats a queued request line without making its LogRecord
    (``Formatter.request_line``): the same text as ``Formatter.format`` of that record, quoting
    and rounding included, in both formats."""
    from gateway.request_log import _request_record

    formatter = Formatter(json_lines=json_lines)
    records = [RequestRecord("r1", "POST", "/v1/chat/completions", status=200, key_id="k1", tier="paid",
                             model="tiny-chat", queue_wait_s=0.000123456, load_wait_s=0.0, service_s=1.5,
                             prompt_tokens=12, completion_tokens=1, duration_s=0.0023456),
               RequestRecord('id with "quotes" and spaces', "GET", "/v1/models", status=429, reason="queue_full"),
               RequestRecord("r3", "POST", "/v1/embeddings", status=500, reason="", duration_s=float("inf"))]
    for created in (0.0, 1764500000.1234567, 1764500000.9999):
        for record in records:
            fields = record.fields()
            assert formatter.request_line(created, fields) == formatter.format(_request_record(created, fields))


def test_a_library_with_its_own_handler_still_formats_after_configure():
    """``configure`` leaves logging's process and thread fields filled: vLLM's handler writes
    ``%(process)d``, and with them off every vLLM line became a "--- Logging error ---" traceback
    (about 80 KB per model load, enough to fill a pipe nobody reads and block the server)."""
    import subprocess
    import sys

    program = (
        "import logging, os\n"
        "from gateway import request_log\n"
        "request_log.configure(json_lines=True)\n"
        "handler = logging.StreamHandler()\n"
        "handler.setFormatter(logging.Formatter('pid=%(process)d thread=%(thread)d %(processName)s %(message)s'))\n"
        "library = logging.getLogger('a-library')\n"
        "library.addHandler(handler)\n"
        "library.propagate = False\n"
        "library.warning('hello')\n"
        "print(os.getpid())\n"
    )
    done = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=60, check=True)
    assert "Logging error" not in done.stderr
    assert f"pid={done.stdout.strip()} thread=" in done.stderr and "MainProcess hello" in done.stderr


# vLLM's lines in JSON in every engine process: tests/test_reaper.py, on a real engine start.


@pytest.fixture(scope="module")
def server(tiny_chat, tmp_path_factory):
    s = start_server(write_config(tmp_path_factory.mktemp("request-log"), {"tiny-chat": ("chat", tiny_chat)}))
    yield s
    s.stop()


def logged_line(caplog, request_id: str) -> dict:
    """The request log line of ``request_id``, once written (after the response's last byte)."""
    deadline = time.monotonic() + 10
    while not (lines := [r.request for r in caplog.records
                         if getattr(r, "request", {}).get("request_id") == request_id]):
        assert time.monotonic() < deadline, f"no request log line for {request_id}"
        time.sleep(0.01)
    (line,) = lines
    return line


def test_a_stream_its_client_leaves_is_logged_interrupted(server, tiny_chat, caplog):
    """The client closes a long chat stream after its first chunk: Starlette ends the stream
    quietly, yet the line says it was cut (its status the 200 already sent, ``reason:
    interrupted``), as README's "Request logs" documents. Whole answers, streamed or not, are
    logged without a reason."""
    from transformers import AutoTokenizer

    caplog.set_level("INFO", logger="tiergate.requests")
    eos = AutoTokenizer.from_pretrained(str(tiny_chat)).eos_token_id
    body = {"model": "tiny-chat", "messages": [{"role": "user", "content": "hi"}], "temperature": 0,
            "logit_bias": {str(eos): -100}}  # no early end: the stream is still going when the client leaves
    url, auth = f"{server.base_url}/chat/completions", {"Authorization": f"Bearer {server.keys['paid']}"}
    stream_and_leave(url, {**auth, "x-request-id": "left-mid-stream"}, {**body, "max_tokens": 400}, chunks=1)
    with httpx.stream("POST", url, headers={**auth, "x-request-id": "whole-stream"}, timeout=60,
                      json={**body, "max_tokens": 3, "stream": True}) as whole:
        assert whole.read().decode().rstrip().endswith("data: [DONE]")
    plain = httpx.post(url, headers={**auth, "x-request-id": "whole-plain"}, timeout=60, json={**body, "max_tokens": 2})
    assert plain.status_code == 200

    left = logged_line(caplog, "left-mid-stream")
    assert (left["status"], left["reason"], left["model"]) == (200, "interrupted", "tiny-chat")
    assert 1 <= left["completion_tokens"] < 400, left  # the tokens it cost, far fewer than asked for
    for request_id, tokens in (("whole-stream", 3), ("whole-plain", 2)):
        line = logged_line(caplog, request_id)
        assert (line["status"], line["reason"], line["completion_tokens"]) == (200, None, tokens), line


@pytest.mark.parametrize("framing", ["content-length", "chunked"])
def test_a_client_that_leaves_mid_body_is_logged_499(server, caplog, framing):
    """The client sends its head and half its body, then closes: nothing is answered (nobody is
    there to read it), and the line says it left before its response started, a ``status`` 499
    as README's "Request logs" documents, whether the body had a length or came chunked."""
    caplog.set_level("INFO", logger="tiergate.requests")
    body = json.dumps({"model": "tiny-chat", "messages": [{"role": "user", "content": "hi"}]}).encode()
    half = body[: len(body) // 2]
    framed = b"Content-Length: %d\r\n\r\n%s" % (len(body), half) if framing == "content-length" else \
        b"Transfer-Encoding: chunked\r\n\r\n%x\r\n%s\r\n" % (len(half), half)
    host, port = server.url.removeprefix("http://").rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
                     b"Authorization: Bearer " + server.keys["paid"].encode() + b"\r\n"
                     b"x-request-id: left-mid-body-" + framing.encode() + b"\r\n" + framed)
        time.sleep(0.3)  # the server is reading the body when the client goes

    line = logged_line(caplog, f"left-mid-body-{framing}")
    assert (line["status"], line["endpoint"], line["tier"]) == (499, "/v1/chat/completions", "paid"), line
