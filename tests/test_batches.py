"""The Batch API end to end: the openai SDK round trip against a real uvicorn, bad lines, uploads
and ownership over HTTP, the runner's behaviour (batch tier, 429 is "later", cancel, expiry) with
a stand-in endpoint, and real tiergate processes: two of them sharing one store (kill -9 and
restart is ``tests/test_batch_fill.py``'s, in a batch wide enough to be caught with many lines in
flight)."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import gc
import io
import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import httpx
import openai
import pytest
from batch import api
from batch.endpoints import Binary
from batch.lines import parse_input
from batch.runner import Runner, open_store
from batch.sqlite_store import SQLiteStore
from batch.store import BatchInfo, FileInfo
from gateway.app import build_services
from gateway.auth import KeyRing, key_id
from gateway.config import load_config
from gateway.errors import APIError
from tests.forked import ForkedServer
from tests.helpers import TIERS, spare_port, stand_in_batch_server, start_server, write_config
from tests.test_batch_store import redis_server

ROOT = Path(__file__).resolve().parents[1]
BATCH_CONFIG = ("batch:\n  reclaim_after_s: 1\n  max_file_bytes: 256KiB\n  max_lines: 400\n"
                "limits:\n  max_chat_tokens: 64\n")
ENDED = ("completed", "failed", "expired", "cancelled")


def chat_line(i: int, **body) -> dict:
    return {"custom_id": f"req-{i}", "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": "tiny-chat", "messages": [{"role": "user", "content": f"hello {i}"}],
                     "max_tokens": 2, **body}}


def jsonl(rows: list) -> bytes:
    return "".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows).encode()


def sdk(server, who: str = "paid") -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key=server.keys[who], max_retries=0)


def submit(client: openai.OpenAI, content: bytes, **kw):
    f = client.files.create(file=("in.jsonl", io.BytesIO(content)), purpose="batch")
    return client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h", **kw)


def wait(client: openai.OpenAI, batch_id: str, until=lambda b: b.status in ENDED, timeout: float = 60):
    deadline = time.time() + timeout
    seen = []
    while True:
        b = client.batches.retrieve(batch_id)
        if not seen or seen[-1] != b.status:
            seen.append(b.status)
        if until(b):
            b.seen = seen
            return b
        if time.time() > deadline:
            raise AssertionError(f"batch {batch_id} stuck: {b.status} {b.request_counts}")
        time.sleep(0.05)


def lines_of(client: openai.OpenAI, file_id: str | None) -> list[dict]:
    if file_id is None:
        return []
    return [json.loads(x) for x in client.files.content(file_id).text.splitlines()]


@pytest.fixture(scope="module")
def server(tiny_chat, tiny_image, tiny_tts, tmp_path_factory):
    models = {"tiny-chat": ("chat", tiny_chat), "tiny-image": ("image", tiny_image), "tiny-tts": ("tts", tiny_tts)}
    srv = start_server(write_config(tmp_path_factory.mktemp("batch-server"), models, BATCH_CONFIG))
    yield srv
    srv.stop()


@pytest.fixture
def fake_server(tiny_chat, tmp_path):
    """A server whose batch lines go to a stand-in chat endpoint (set ``srv.fake``)."""
    srv = stand_in_batch_server(tmp_path, tiny_chat, BATCH_CONFIG, "/v1/chat/completions")
    yield srv
    srv.stop()


# -- the API with the real chat model --------------------------------------------------------------

def test_sdk_round_trip(server):
    c = sdk(server)
    b = submit(c, jsonl([chat_line(i) for i in range(12)]), metadata={"job": "nightly"})
    assert b.status == "validating" and b.metadata == {"job": "nightly"}
    assert b.expires_at == b.created_at + 24 * 3600
    done = wait(c, b.id)
    assert done.status == "completed", done
    assert done.seen[-1] == "completed" and set(done.seen) <= {"validating", "in_progress", "finalizing", "completed"}
    assert (done.request_counts.total, done.request_counts.completed, done.request_counts.failed) == (12, 12, 0)
    assert done.error_file_id is None and done.in_progress_at and done.finalizing_at and done.completed_at
    out = lines_of(c, done.output_file_id)
    assert [x["custom_id"] for x in out] == [f"req-{i}" for i in range(12)]
    for x in out:
        assert x["error"] is None and x["id"].startswith("batch_req_")
        assert x["response"]["status_code"] == 200 and x["response"]["request_id"]
        assert x["response"]["body"]["object"] == "chat.completion"
        assert x["response"]["body"]["usage"]["completion_tokens"] <= 2
    assert_usage_totals(done, out)
    assert b.model is None and b.usage is None  # known once it is validated, and once it ends
    meta = c.files.retrieve(done.output_file_id)
    assert meta.purpose == "batch_output" and meta.bytes == len(c.files.content(done.output_file_id).content)
    assert b.id in [x.id for x in c.batches.list(limit=100)]


def test_bad_lines_go_to_the_error_file_and_the_rest_runs(server):
    c = sdk(server)
    rows = [
        chat_line(0),
        "{not json",
        "[1, 2]",
        {"method": "POST", "url": "/v1/chat/completions", "body": {}},  # no custom_id
        {**chat_line(0), "body": {"model": "tiny-chat"}},  # duplicate custom_id
        {**chat_line(5), "method": "GET"},
        {**chat_line(6), "url": "/v1/embeddings"},
        {**chat_line(7), "body": "text"},
        "",  # blank lines are skipped
        chat_line(9, model="no-such-model"),  # the endpoint says 404
        chat_line(10, max_tokens=100000),  # the endpoint says 400 (above max_chat_tokens)
        chat_line(11, stream=True),  # streaming has no place in a batch
        chat_line(12),
    ]
    done = wait(c, submit(c, jsonl(rows)).id)
    assert done.status == "completed"
    assert (done.request_counts.total, done.request_counts.completed, done.request_counts.failed) == (12, 2, 10)
    out = lines_of(c, done.output_file_id)
    assert [x["custom_id"] for x in out] == ["req-0", "req-12"]
    assert done.model is None  # its lines name two models
    assert done.usage.input_tokens == sum(x["response"]["body"]["usage"]["prompt_tokens"] for x in out) > 0
    errors = lines_of(c, done.error_file_id)
    got = [(x["custom_id"], (x["error"] or {}).get("code") or x["response"]["status_code"]) for x in errors]
    assert got == [(None, "invalid_json"), (None, "invalid_json"), (None, "missing_custom_id"),
                   ("req-0", "duplicate_custom_id"), ("req-5", "invalid_method"), ("req-6", "invalid_url"),
                   ("req-7", "invalid_body"), ("req-9", 404), ("req-10", 400), ("req-11", 400)]
    assert errors[0]["error"]["message"].startswith("line 2:")
    refused = {x["custom_id"]: x["response"]["body"]["error"] for x in errors if x["response"]}
    assert refused["req-10"]["param"] == "max_tokens" and refused["req-11"]["param"] == "stream"
    assert refused["req-9"]["code"] == "model_not_found"


def test_a_line_holding_a_unicode_line_separator_is_one_line(server):
    """JSON strings may hold U+2028, U+2029 and U+0085 unescaped (JavaScript's JSON.stringify writes
    them so); a line ends only at a newline (``\\n``, ``\\r\\n``, ``\\r``), not there too."""
    def text(rows: list[dict]) -> bytes:
        return "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows).encode()

    seps = "\u2028\u2029\x85"
    rows = [chat_line(i, messages=[{"role": "user", "content": f"a{sep}b"}]) for i, sep in enumerate(seps)]
    lines, invalid = parse_input(text(rows).replace(b"\n", b"\r\n", 1), "/v1/chat/completions")
    assert invalid == [] and [(ln.index, ln.custom_id) for ln in lines] == [(0, "req-0"), (1, "req-1"), (2, "req-2")]
    assert lines[0].body["messages"][0]["content"] == "a\u2028b"
    many = text([chat_line(i, messages=[{"role": "user", "content": "a\u2028b"}]) for i in range(300)])
    f = sdk(server).files.create(file=("in.jsonl", io.BytesIO(many)), purpose="batch")  # 300 lines of 400, not 600
    assert f.bytes == len(many)


def test_a_byte_order_mark_before_the_first_line_is_skipped():
    """A UTF-8 file saved with a BOM (Windows tools write one) is the same JSON lines."""
    lines, invalid = parse_input(b"\xef\xbb\xbf" + jsonl([chat_line(0), chat_line(1)]), "/v1/chat/completions")
    assert invalid == [] and [ln.custom_id for ln in lines] == ["req-0", "req-1"]


def test_a_line_nested_deeper_than_a_request_body_is_an_invalid_json_line():
    """A line's body may nest as deep as a request body (32 levels), no deeper: json.loads raises
    RecursionError past ~1000 levels, and a line just under that parsed here but not where the
    store wrote it (a deeper stack), so its batch stayed validating, retried forever."""
    def line(depth: int) -> str:
        body = json.dumps(chat_line(0)["body"])[:-1] + ', "user": ' + "[" * depth + "]" * depth + "}"
        return '{"custom_id": "req-0", "method": "POST", "url": "/v1/chat/completions", "body": ' + body + "}"

    lines, invalid = parse_input(jsonl([line(31)]), "/v1/chat/completions")  # the body: 32 levels
    assert invalid == [] and len(lines) == 1
    for depth in (32, 985, 2000):
        lines, invalid = parse_input(jsonl([line(depth)]), "/v1/chat/completions")
        assert lines == [] and [o.line["error"]["code"] for o in invalid] == ["invalid_json"], depth
        assert "deeper than" in invalid[0].line["error"]["message"]


def test_image_batch_returns_png_b64(server):
    c = sdk(server)
    line = {"method": "POST", "url": "/v1/images/generations",
            "body": {"model": "tiny-image", "prompt": "a cat", "size": "32x32", "num_inference_steps": 1}}
    rows = [{**line, "custom_id": "img-0"}, {**line, "custom_id": "img-url", "body": {**line["body"], "response_format": "url"}},
            {**line, "custom_id": "img-stream", "body": {**line["body"], "stream": True}},
            {**line, "custom_id": "img-jpeg", "body": {**line["body"], "output_format": "jpeg"}}]
    f = c.files.create(file=("in.jsonl", io.BytesIO(jsonl(rows))), purpose="batch")
    b = c.batches.create(input_file_id=f.id, endpoint="/v1/images/generations", completion_window="24h")
    done = wait(c, b.id)
    assert (done.status, done.request_counts.completed, done.request_counts.failed) == ("completed", 2, 2)
    out = {x["custom_id"]: x["response"]["body"] for x in lines_of(c, done.output_file_id)}
    assert base64.b64decode(out["img-0"]["data"][0]["b64_json"]).startswith(b"\x89PNG")
    jpeg = base64.b64decode(out["img-jpeg"]["data"][0]["b64_json"])
    assert jpeg.startswith(b"\xff\xd8\xff") and out["img-jpeg"]["output_format"] == "jpeg"
    refused = {x["custom_id"]: x["response"]["body"]["error"]["param"] for x in lines_of(c, done.error_file_id)}
    assert refused == {"img-url": "response_format", "img-stream": "stream"}


def test_speech_batch_returns_audio_as_base64(server):
    import soundfile

    c = sdk(server)
    rows = [{"custom_id": f"say-{i}", "method": "POST", "url": "/v1/audio/speech",
             "body": {"model": "tiny-tts", "input": f"Hello number {i}. Bye.", "voice": "alloy", "response_format": "wav"}}
            for i in range(2)]
    rows.append({"custom_id": "sse", "method": "POST", "url": "/v1/audio/speech",  # a line's output is the file
                 "body": {"model": "tiny-tts", "input": "Hi.", "voice": "alloy", "stream_format": "sse"}})
    f = c.files.create(file=("in.jsonl", io.BytesIO(jsonl(rows))), purpose="batch")
    b = c.batches.create(input_file_id=f.id, endpoint="/v1/audio/speech", completion_window="24h")
    done = wait(c, b.id)
    assert (done.status, done.request_counts.completed, done.request_counts.failed) == ("completed", 2, 1)
    (refused,) = lines_of(c, done.error_file_id)
    assert refused["custom_id"] == "sse" and refused["response"]["status_code"] == 400
    assert refused["response"]["body"]["error"]["param"] == "stream_format"
    for line in lines_of(c, done.output_file_id):
        body = line["response"]["body"]
        assert body["content_type"] == "audio/wav" and body["encoding"] == "base64"
        audio, rate = soundfile.read(io.BytesIO(base64.b64decode(body["data"])))
        assert len(audio) > 0 and rate > 0


def test_the_demo_script_submits_watches_and_prints(server):
    run = subprocess.run([sys.executable, str(ROOT / "scripts" / "batch_demo.py"), "--base-url", server.base_url,
                          "--api-key", server.keys["free"], "-n", "5", "--max-tokens", "3"],
                         capture_output=True, timeout=60)
    out = run.stdout.decode()  # not text=True: that would turn the bar's \r into newlines
    assert run.returncode == 0, run.stderr.decode()
    assert "\r[" + "#" * 30 + "] 5/5  completed" in out
    assert [ln.split(":")[0].strip() for ln in out.splitlines()[-5:]] == [f"q-{i}" for i in range(5)]


def test_an_input_without_requests_fails_the_batch(server):
    c = sdk(server)
    done = wait(c, submit(c, b"\n\n").id)
    assert done.status == "failed" and done.failed_at
    assert done.errors.data[0].code == "empty_file"


def test_other_keys_get_404_and_admins_see_everything(server):
    owner, other, admin = sdk(server, "paid"), sdk(server, "free"), sdk(server, "admin")
    b = submit(owner, jsonl([chat_line(1)]))
    done = wait(owner, b.id)
    f = done.input_file_id
    for call in (lambda: other.files.retrieve(f), lambda: other.files.content(f), lambda: other.files.delete(f),
                 lambda: other.batches.retrieve(b.id), lambda: other.batches.cancel(b.id),
                 lambda: other.files.content(done.output_file_id),
                 lambda: other.batches.create(input_file_id=f, endpoint="/v1/chat/completions",
                                              completion_window="24h")):
        with pytest.raises(openai.NotFoundError) as exc:
            call()
        assert exc.value.body["type"] == "not_found_error"
    assert b.id not in [x.id for x in other.batches.list(limit=100)]
    assert admin.batches.retrieve(b.id).status == "completed"
    assert b.id in [x.id for x in admin.batches.list(limit=100)]
    assert admin.files.content(done.output_file_id).text == owner.files.content(done.output_file_id).text
    assert owner.files.delete(f).deleted is True
    with pytest.raises(openai.NotFoundError):
        owner.files.retrieve(f)


def test_upload_errors_are_openai_shaped(server):
    url, auth = f"{server.base_url}/files", {"Authorization": f"Bearer {server.keys['paid']}"}

    def post(**kw):
        r = httpx.post(url, headers=auth, **kw)
        return r.status_code, r.json()["error"]

    status, err = post(json={"purpose": "batch"})
    assert status == 415 and err["code"] == "unsupported_media_type"
    status, err = post(files={"file": ("a.jsonl", b"{}\n")}, data={"purpose": "evals"})
    assert (status, err["param"]) == (400, "purpose")
    status, err = post(files={"file": ("a.png", b"{}\n")}, data={"purpose": "vision"})
    assert (status, err["param"], err["code"]) == (400, "file", "invalid_file")  # a vision file is an image
    status, err = post(files={"file": ("a.jsonl", b"\xff\xfe{}")}, data={"purpose": "fine-tune"})
    assert (status, err["param"], err["code"]) == (400, "file", "invalid_file")  # fine-tuning files are UTF-8 JSONL
    status, err = post(data={"purpose": "batch", "x": "1"}, files={"other": ("a", b"")})
    assert (status, err["param"], err["code"]) == (400, "file", "missing_required_parameter")
    status, err = post(files={"file": ("a.jsonl", b"x" * (300 * 1024))}, data={"purpose": "batch"})
    assert (status, err["code"]) == (413, "file_too_large")
    status, err = post(files={"file": ("a.jsonl", b"{}\n" * 401)}, data={"purpose": "batch"})
    assert (status, err["param"], err["code"]) == (400, "file", "too_many_lines")
    status, err = post(files={"file": ("a.jsonl", b"\xff\xfe{}")}, data={"purpose": "batch"})
    assert (status, err["param"]) == (400, "file")
    r = httpx.post(url, headers=auth, files={"file": ("a.jsonl", b"{}\n" * 400)}, data={"purpose": "batch"})
    assert r.status_code == 200 and r.json()["bytes"] == 1200 and r.json()["filename"] == "a.jsonl"
    odd = httpx.post(url, headers=auth, files={"file": ("名前 x.jsonl", b"{}\n")}, data={"purpose": "batch"}).json()
    assert odd["filename"] == "名前 x.jsonl"
    got = httpx.get(f"{url}/{odd['id']}/content", headers=auth)  # the name is not latin-1: kept out of the header
    assert got.status_code == 200 and got.content == b"{}\n"
    assert got.headers["content-disposition"] == 'attachment; filename="___x.jsonl"'
    assert got.headers["content-type"].startswith("application/jsonl")
    for name, purpose, content_type in [("notes.md", "assistants", "text/markdown"), ("data.bin", "user_data",
                                        "application/octet-stream"), ("report.pdf", "user_data", "application/pdf")]:
        made = httpx.post(url, headers=auth, files={"file": (name, b"%PDF-1.4 or words")}, data={"purpose": purpose})
        got = httpx.get(f"{url}/{made.json()['id']}/content", headers=auth)  # each file as the type it is
        assert got.headers["content-type"].split(";")[0] == content_type, name


def test_create_errors_name_the_field(server):
    c = sdk(server)
    f = c.files.create(file=("in.jsonl", io.BytesIO(jsonl([chat_line(0)]))), purpose="batch")
    cases = [({"completion_window": "48h"}, "completion_window"), ({"endpoint": "/v1/audio/transcriptions"}, "endpoint"),
             ({"metadata": {f"k{i}": "v" for i in range(17)}}, "metadata"),
             ({"input_file_id": "file-nope"}, "input_file_id")]
    for change, param in cases:
        args = {"input_file_id": f.id, "endpoint": "/v1/chat/completions", "completion_window": "24h", **change}
        with pytest.raises(openai.APIStatusError) as exc:
            c.batches.create(**args)
        assert exc.value.body["param"] == param, change
    with pytest.raises(openai.BadRequestError) as exc:
        c.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h",
                         extra_body={"priority": "high"})
    assert exc.value.body["code"] == "unknown_parameter"


def test_files_and_a_batchs_outputs_expire_when_asked(server):
    """``expires_after`` on an upload and ``output_expires_after`` on a batch (OpenAI's: an hour to
    30 days after ``created_at``) set the files' ``expires_at``; from then on the file and its
    content are 404. Bad values are a 400 naming the field."""
    c = sdk(server)
    hour = {"anchor": "created_at", "seconds": 3600}
    f = c.files.create(file=("in.jsonl", io.BytesIO(jsonl([chat_line(0), chat_line(1, max_tokens=-1)]))),
                       purpose="batch", expires_after=hour)
    assert f.expires_at == f.created_at + 3600 and c.files.retrieve(f.id).expires_at == f.expires_at
    b = c.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h",
                         output_expires_after={"anchor": "created_at", "seconds": 7200})
    done = wait(c, b.id)
    for file_id in (done.output_file_id, done.error_file_id):
        out = c.files.retrieve(file_id)
        assert out.expires_at == out.created_at + 7200
    assert c.files.retrieve(submit(c, jsonl([chat_line(0)])).input_file_id).expires_at is None  # none asked
    # an hour later (the file's expiry moved back to now, in the server's store)
    db = sqlite3.connect(server.services.config.source.parent / "tiergate-data" / "batches.sqlite3")
    with db:
        db.execute("UPDATE files SET expires_at = ? WHERE id = ?", (int(time.time()), f.id))
    db.close()
    for call in (lambda: c.files.retrieve(f.id), lambda: c.files.content(f.id), lambda: c.files.delete(f.id)):
        with pytest.raises(openai.NotFoundError):
            call()
    for bad, param in (({"anchor": "created_at", "seconds": 60}, "expires_after.seconds"),
                       ({"anchor": "last_active_at", "seconds": 3600}, "expires_after.anchor")):
        with pytest.raises(openai.BadRequestError) as exc:
            c.files.create(file=("in.jsonl", io.BytesIO(b"{}\n")), purpose="batch", expires_after=bad)
        assert exc.value.body["param"] == param
        with pytest.raises(openai.BadRequestError) as exc:
            c.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h",
                             output_expires_after=bad)
        assert exc.value.body["param"] == "output_" + param


def test_list_pages_newest_first(server):
    c = sdk(server, "subscriber")
    ids = [submit(c, jsonl([chat_line(i)])).id for i in range(3)]
    first = c.batches.list(limit=2)
    assert [b.id for b in first.data] == ids[::-1][:2] and first.has_more
    rest = c.batches.list(limit=2, after=first.data[-1].id)
    assert [b.id for b in rest.data] == [ids[0]] and not rest.has_more
    for i in ids:
        wait(c, i)


def test_files_list_in_pages_by_purpose_and_key(server):
    """``GET /v1/files`` through the SDK: the key's own files, newest first or oldest first, a
    purpose at a time, in pages the SDK follows; an admin key lists everyone's. Bad parameters
    are a 400 naming the parameter."""
    c, other, admin = sdk(server, "free"), sdk(server, "subscriber"), sdk(server, "admin")
    made = [c.files.create(file=(f"in{i}.jsonl", io.BytesIO(jsonl([chat_line(i)]))), purpose="batch").id
            for i in range(3)]
    page = c.files.list(purpose="batch", limit=2)
    assert [f.id for f in page.data] == made[::-1][:2] and page.has_more
    rest = c.files.list(purpose="batch", limit=2, after=page.data[-1].id)
    assert [f.id for f in rest.data][:1] == [made[0]]
    followed = [f.id for f in c.files.list(purpose="batch", limit=1)]  # the SDK's iteration: page after page
    assert [i for i in followed if i in made] == made[::-1]
    oldest_first = [f.id for f in c.files.list(order="asc")]
    assert [i for i in oldest_first if i in made] == made
    assert not set(made) & {f.id for f in other.files.list()}
    assert set(made) <= {f.id for f in admin.files.list()}
    assert c.files.delete(made[1]).deleted
    assert made[1] not in [f.id for f in c.files.list()]
    done = wait(c, c.batches.create(input_file_id=made[0], endpoint="/v1/chat/completions",
                                    completion_window="24h").id)
    outputs = [f for f in c.files.list(purpose="batch_output")]
    assert done.output_file_id in [f.id for f in outputs] and {f.purpose for f in outputs} == {"batch_output"}
    auth = {"Authorization": f"Bearer {server.keys['free']}"}
    for query, param in (({"limit": "0"}, "limit"), ({"limit": "10001"}, "limit"), ({"limit": "x"}, "limit"),
                         ({"order": "newest"}, "order"), ({"after": made[1]}, "after"), ({"after": "file-nope"}, "after")):
        r = httpx.get(f"{server.base_url}/files", params=query, headers=auth)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (query, r.text)
        assert isinstance(r.json()["error"]["code"], str)


# -- the runner, with a stand-in endpoint ----------------------------------------------------------

def test_every_line_runs_as_its_owner_at_the_batch_tier_and_429_means_later(fake_server):
    seen, refusals = [], Counter()

    async def fake(svc, caller, body):
        seen.append((caller.tier, caller.key_id))
        n = body["messages"][0]["content"]
        if refusals[n] < 2:  # every line is refused twice first
            refusals[n] += 1
            raise APIError(429, "the batch tier's queue is full", "queue_full", headers={"retry-after": "0"})
        return {"echo": n}

    fake_server.fake = fake
    c = sdk(fake_server, "paid")  # a paid key submits; the lines still run at the batch tier
    done = wait(c, submit(c, jsonl([chat_line(i) for i in range(20)])).id)
    assert (done.status, done.request_counts.completed, done.request_counts.failed) == ("completed", 20, 0)
    assert set(seen) == {("batch", key_id(fake_server.keys["paid"]))}
    assert len(seen) == 60
    assert [x["response"]["body"]["echo"] for x in lines_of(c, done.output_file_id)] == [f"hello {i}" for i in range(20)]


def test_binary_responses_are_stored_as_base64_with_their_type(fake_server):
    async def fake(svc, caller, body):
        return Binary(b"RIFF\x00\x01binary", "audio/wav")

    fake_server.fake = fake
    c = sdk(fake_server)
    out = lines_of(c, wait(c, submit(c, jsonl([chat_line(0)])).id).output_file_id)[0]["response"]["body"]
    assert out == {"content_type": "audio/wav", "encoding": "base64",
                   "data": base64.b64encode(b"RIFF\x00\x01binary").decode()}


def test_lines_claimed_during_a_slow_heartbeat_are_not_dropped(tiny_chat, tmp_path):
    """The heartbeat drops lines whose batch stopped; a line of a new batch claimed while the
    heartbeat was waiting on the store must not look like one (it would never get an outcome)."""

    class SlowStore(SQLiteStore):
        async def get_batch(self, batch_id):
            await asyncio.sleep(0.03)
            return await super().get_batch(batch_id)

    async def fake(svc, caller, body):
        await asyncio.sleep(0.05)
        return {"ok": True}

    async def go():
        config = load_config(write_config(tmp_path, {"tiny-chat": ("chat", tiny_chat)}, "batch:\n  reclaim_after_s: 0.2\n"))
        svc = build_services(config, KeyRing({t: [f"k-{t}"] for t in TIERS}))
        runner = Runner(svc, SlowStore(tmp_path / "b.sqlite3"), {"/v1/chat/completions": fake})
        await runner.start()
        ids = []
        for i in range(15):
            f = FileInfo(f"file-{i}", "me", "batch", "in.jsonl", 1, 0)
            await runner.store.put_file(f, jsonl([chat_line(i)]))
            b = BatchInfo(f"batch_{i:04d}", "me", "/v1/chat/completions", f.id, "24h", 0, int(time.time()) + 60)
            await runner.store.create_batch(b)
            runner.soon("validate", b.id)
            ids.append(b.id)
            await asyncio.sleep(0.02)
        deadline = time.time() + 10
        while time.time() < deadline:
            statuses = [(await runner.store.get_batch(i)).status for i in ids]
            if all(s == "completed" for s in statuses):
                break
            await asyncio.sleep(0.1)
        await runner.stop()
        await svc.arbiter.stop()
        return statuses

    assert asyncio.run(go()) == ["completed"] * 15


def test_concurrency_stays_within_the_batch_tier(fake_server):
    now, peak = [0], [0]

    async def fake(svc, caller, body):
        now[0] += 1
        peak[0] = max(peak[0], now[0])
        await asyncio.sleep(0.01)
        now[0] -= 1
        return {}

    fake_server.fake = fake
    c = sdk(fake_server)
    wait(c, submit(c, jsonl([chat_line(i) for i in range(40)])).id)
    assert peak[0] == fake_server.services.gate.tiers["batch"].max_inflight == 4


def test_cancel_stops_the_rest_and_keeps_what_finished(fake_server):
    started = []

    async def fake(svc, caller, body):
        started.append(body["messages"][0]["content"])
        await asyncio.sleep(0.1)
        return {"ok": True}

    fake_server.fake = fake
    c = sdk(fake_server)
    b = submit(c, jsonl([chat_line(i) for i in range(200)]))
    wait(c, b.id, until=lambda x: x.request_counts.completed >= 8)
    cancelling = c.batches.cancel(b.id)
    assert cancelling.status in ("cancelling", "cancelled") and cancelling.cancelling_at
    done = wait(c, b.id, timeout=10)
    assert done.status == "cancelled" and done.cancelled_at
    counts = done.request_counts
    assert counts.total == 200 and counts.completed + counts.failed == 200 and 8 <= counts.completed < 100
    out, errors = lines_of(c, done.output_file_id), lines_of(c, done.error_file_id)
    assert len(out) == counts.completed and len(errors) == counts.failed
    assert {x["error"]["code"] for x in errors} == {"batch_cancelled"}
    assert sorted(x["custom_id"] for x in out + errors) == sorted(f"req-{i}" for i in range(200))
    time.sleep(0.5)
    assert len(started) < 100  # the rest never ran
    assert c.batches.cancel(b.id).status == "cancelled"  # cancelling twice is harmless
    with pytest.raises(openai.ConflictError):
        c.batches.cancel(wait(c, submit(c, jsonl([chat_line(0)])).id).id)  # a completed batch


def test_a_batch_out_of_time_expires_with_what_it_finished(fake_server, monkeypatch):
    async def fake(svc, caller, body):
        if body["messages"][0]["content"] != "hello 0":
            await asyncio.sleep(3600)  # never finishes in time
        return {"ok": True}

    fake_server.fake = fake
    monkeypatch.setattr(api, "WINDOW_S", 2)
    c = sdk(fake_server)
    done = wait(c, submit(c, jsonl([chat_line(i) for i in range(6)])).id, timeout=15)
    assert done.status == "expired" and done.expired_at and done.expires_at == done.created_at + 2
    assert (done.request_counts.completed, done.request_counts.failed) == (1, 5)
    assert [x["custom_id"] for x in lines_of(c, done.output_file_id)] == ["req-0"]
    assert {x["error"]["code"] for x in lines_of(c, done.error_file_id)} == {"batch_expired"}


# -- real tiergate processes -----------------------------------------------------------------------

class Proc:
    """``tiergate serve`` in a process of its own (forked ready-imported: ``tests/forked.py``), with
    its keys in the environment."""

    started: list["Proc"] = []  # killed at the end of each test, whatever happened

    def __init__(self, config: Path, keys: dict[str, str], log: Path) -> None:
        Proc.started.append(self)
        self.port = spare_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = {**os.environ, **{f"TEST_KEYS_{t.upper()}": k for t, k in keys.items()}}
        env.setdefault("OMP_NUM_THREADS", "1")  # two torch processes on two cores: no oversubscription
        self.log = log
        self.proc = ForkedServer(["serve", "--config", str(config), "--port", str(self.port)], env, log, ROOT)

    def ready(self) -> "Proc":
        deadline = time.time() + 60
        while True:
            try:
                if httpx.get(f"{self.url}/healthz", timeout=1).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            if self.proc.poll() is not None or time.time() > deadline:
                raise RuntimeError(f"tiergate did not start:\n{self.log.read_text()[-3000:]}")
            time.sleep(0.1)

    def client(self, key: str) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=key, max_retries=2)

    def kill9(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def stop(self) -> int:
        """SIGTERM (a clean shutdown); the number of lines this process recorded, from its log."""
        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(30)
        recorded = [ln for ln in self.log.read_text().splitlines() if "batch runner" in ln and "stopped" in ln]
        return int(recorded[-1].split("recorded ")[1].split()[0])


def test_a_forked_server_process_comes_from_a_one_thread_forkserver_with_the_stack_imported():
    """What ``tests/forked.py`` rests on: a process forked from its forkserver has tiergate's
    stack imported already (the point: no ~8 s of imports per server), and the forkserver runs
    one thread (a fork copies only that one: no other may be running there, holding a lock)."""
    from tests import forked

    answers = forked._CONTEXT.Queue()
    child = forked._CONTEXT.Process(target=forked.threads_and_imports, args=(answers,))
    child.start()
    try:
        assert answers.get(timeout=120) == (1, ["gateway.app", "torch", "transformers"])
    finally:
        child.join(30)


@pytest.fixture(autouse=True)
def _no_stray_processes():
    yield
    while Proc.started:
        p = Proc.started.pop()
        if p.proc.poll() is None:
            p.proc.kill()
            p.proc.wait(10)


def proc_config(folder: Path, tiny_chat: Path, store: str) -> tuple[Path, dict[str, str]]:
    config = write_config(folder, {"tiny-chat": ("chat", tiny_chat)},
                          f"batch:\n  store: {store}\n  reclaim_after_s: 2\n")
    return config, {t: f"key-{t}" for t in TIERS}


def check_exactly_once(client: openai.OpenAI, batch_id: str, n: int) -> None:
    done = wait(client, batch_id, timeout=120)
    assert done.status == "completed", done
    assert (done.request_counts.total, done.request_counts.completed, done.request_counts.failed) == (n, n, 0)
    out = lines_of(client, done.output_file_id)
    ids = [x["custom_id"] for x in out]
    assert len(ids) == n and sorted(ids) == sorted(f"req-{i}" for i in range(n))
    assert all(x["response"]["status_code"] == 200 for x in out)
    assert done.error_file_id is None
    assert_usage_totals(done, out)


def assert_usage_totals(batch, out: list[dict]) -> None:
    """The batch's model and ``usage``: the sums of its output lines' usage, each line once."""
    assert batch.model == "tiny-chat"
    prompt = sum(x["response"]["body"]["usage"]["prompt_tokens"] for x in out)
    completion = sum(x["response"]["body"]["usage"]["completion_tokens"] for x in out)
    assert prompt > 0 and completion > 0
    assert (batch.usage.input_tokens, batch.usage.output_tokens, batch.usage.total_tokens) == (
        prompt, completion, prompt + completion)
    assert batch.usage.input_tokens_details.cached_tokens == 0
    assert batch.usage.output_tokens_details.reasoning_tokens == 0


@pytest.mark.parametrize("store", ["redis", "sqlite"])  # sqlite: one file shared on one machine
def test_two_processes_share_one_store_and_split_a_batch(store, tiny_chat, tmp_path):
    with contextlib.ExitStack() as stack:
        if store == "redis":
            store = stack.enter_context(redis_server(tmp_path))
        config, keys = proc_config(tmp_path, tiny_chat, store)
        a, b = Proc(config, keys, tmp_path / "a.log"), Proc(config, keys, tmp_path / "b.log")
        for p in (a.ready(), b.ready()):  # both load the model first, so both are in the race from the start
            p.client(keys["paid"]).chat.completions.create(model="tiny-chat", max_tokens=1,
                                                           messages=[{"role": "user", "content": "warm up"}])
        try:
            n = 100  # seconds of work: both join in
            submitted = submit(a.client(keys["paid"]), jsonl([chat_line(i, max_tokens=24) for i in range(n)]))
            check_exactly_once(b.client(keys["paid"]), submitted.id, n)  # either process serves it
        finally:
            by_a, by_b = a.stop(), b.stop()
        assert by_a + by_b == n  # each outcome was written by exactly one of them
        assert by_a > 0 and by_b > 0, (by_a, by_b)


@pytest.mark.parametrize("yields", range(6))
def test_a_runner_stops_when_its_wake_up_lands_just_before_the_stop(tiny_chat, tmp_path, yields):
    """``stop`` cancels the claim loop while it waits for work. On Python 3.11,
    ``asyncio.wait_for`` swallows a cancellation that arrives after the awaited event fired and
    before the waiting task resumed (gh-86296): the loop went on claiming and ``stop`` never
    returned (a 300 s hang in CI). Here the wake-up lands ``yields`` loop turns before the stop,
    which covers that window whatever its width."""

    async def go():
        config = load_config(write_config(tmp_path, {"tiny-chat": ("chat", tiny_chat)}, "batch:\n  reclaim_after_s: 0.2\n"))
        svc = build_services(config, KeyRing({t: [f"k-{t}"] for t in TIERS}))
        runner = Runner(svc, SQLiteStore(tmp_path / "b.sqlite3"))
        await runner.start()
        await asyncio.sleep(0.1)  # nothing to claim: the claim loop waits for a wake-up
        loops = list(runner._loops)
        runner._wake.set()
        for _ in range(yields):
            await asyncio.sleep(0)
        stopping = asyncio.create_task(runner.stop())
        done, _ = await asyncio.wait({stopping}, timeout=10)
        for task in loops:  # a loop that ignored the stop's cancel gets another, to end the test
            task.cancel()
        await svc.arbiter.stop()
        return stopping in done

    assert asyncio.run(go()), "the runner's stop() did not return: a loop ignored its cancellation"


@pytest.mark.parametrize("call", ["shapes", "touch", "open_batches"], ids=["claim", "heartbeat", "sweep"])
def test_a_runner_stops_when_its_store_swallows_the_cancel(tiny_chat, tmp_path, call):
    """redis-py sends every command through ``asyncio.wait_for``, which on Python 3.11 swallows a
    cancel that lands as the send finishes (``storage.redis``): a runner stopped while a loop was
    in such a call hung a test for 300 s. Here the store call of each loop in turn (the claim
    loop's, the heartbeat's, the sweep's) swallows the stop's cancel and returns as the send
    would: ``stop`` must return all the same."""

    async def go():
        config = load_config(write_config(tmp_path, {"tiny-chat": ("chat", tiny_chat)}, "batch:\n  reclaim_after_s: 0.2\n"))
        svc = build_services(config, KeyRing({t: [f"k-{t}"] for t in TIERS}))
        runner = Runner(svc, SQLiteStore(tmp_path / "b.sqlite3"))
        real, inside, swallowed = getattr(runner.store, call), asyncio.Event(), []

        async def swallowing(*args, **kwargs):
            inside.set()
            try:
                await asyncio.sleep(0.5)  # the command on its way when the stop's cancel lands
            except asyncio.CancelledError:
                if swallowed:  # once is enough: later cancels (the test's cleanup) go through
                    raise
                swallowed.append(True)  # as wait_for on 3.11 when the send had finished: the cancel is gone
            return await real(*args, **kwargs)

        setattr(runner.store, call, swallowing)
        await runner.start()
        async with asyncio.timeout(10):
            await inside.wait()
        loops = list(runner._loops)
        stopping = asyncio.create_task(runner.stop())
        done, _ = await asyncio.wait({stopping}, timeout=10)
        for task in loops:  # a loop that ignored the stop gets another cancel, to end the test
            task.cancel()
        await asyncio.gather(stopping, return_exceptions=True)
        await svc.arbiter.stop()
        return stopping in done

    assert asyncio.run(go()), "the runner's stop() did not return: a loop went on after its store swallowed the cancel"


def test_lines_claimed_as_a_stop_lands_are_handed_back_not_left_running(tiny_chat, tmp_path):
    """The claim loop's store call can swallow the stop's cancel (``storage.redis``): the call
    returns the lines it claimed and the loop starts them before it sees the stop. ``hand_back``
    listed the running lines before the loops had ended, so those were neither cancelled nor
    handed back: they ran on through the shutdown, and one cut by its model's unloading was
    recorded failed (a 500, "the request failed: Cancelled") instead of running elsewhere."""
    from batch.shapes import shape_of
    from batch.store import Line

    async def go():
        extra = "batch:\n  reclaim_after_s: 60\n"
        config = load_config(write_config(tmp_path, {"tiny-chat": ("chat", tiny_chat)}, extra))
        svc = build_services(config, KeyRing({t: [f"k-{t}"] for t in TIERS}))
        runner = Runner(svc, SQLiteStore(tmp_path / "b.sqlite3"))
        setup = SQLiteStore(tmp_path / "b.sqlite3")
        await setup.open()
        now = int(time.time())
        info = BatchInfo(id=f"batch_{time.time_ns():024x}", owner="k", endpoint="/v1/chat/completions",
                         input_file_id="file-x", completion_window="24h", created_at=now, expires_at=now + 86400)
        await setup.create_batch(info)
        body = {"model": "tiny-chat", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        queued = [Line(i, f"req-{i}", body, shape_of(svc, "/v1/chat/completions", body)) for i in range(3)]
        await setup.start(info.id, queued, [], now=now)
        real, inside, swallowed = runner.store.claim, asyncio.Event(), []

        async def swallowing(*args, **kwargs):
            inside.set()
            try:
                await asyncio.sleep(0.5)  # the claim on its way when the stop's cancel lands
            except asyncio.CancelledError:
                if swallowed:
                    raise
                swallowed.append(True)  # as wait_for on 3.11 when the send had finished: the cancel is gone
            return await real(*args, **kwargs)

        runner.store.claim = swallowing
        await runner.start()
        async with asyncio.timeout(10):
            await inside.wait()
        await runner.stop()
        left = [t for t in asyncio.all_tasks() if t.get_coro().__qualname__ == "Runner._run" and not t.done()]
        for t in left:
            t.cancel()
        await asyncio.gather(*left, return_exceptions=True)
        again = await setup.claim("heir", 10, 60)  # handed back: another process takes them at once
        await setup.close()
        await svc.arbiter.stop()
        return swallowed, len(left), sorted(j.line.index for j in again)

    swallowed, left, again = asyncio.run(go())
    assert swallowed and left == 0 and again == [0, 1, 2], (left, again)


@pytest.mark.parametrize("store", ["sqlite", "redis"])
def test_validating_and_cancelling_a_big_batch_leave_the_event_loop_free(store, tiny_chat, tmp_path, request):
    """Validating a batch of the most lines a file may have (its lines' shapes, queueing them) and
    cancelling it (every line filled with ``batch_cancelled``, the outcomes read, the files
    written) take a second or more each, but hold the event loop only a short while at a time, so
    every other request goes on: a coroutine ticking beside each is held up by a small part of it
    at most (it was held for 0.5 to 2.3 s). The garbage collector is off meanwhile: a full
    collection holds the loop wherever the objects were made (the test process's own, the batch's
    half a million), and is ``gateway.collector``'s business. A loaded machine can hold up one run
    (other processes, other tests' servers in this process), so a second one is tried before failing:
    the hold this checks for comes back every time."""
    n = 50000

    async def timed(work) -> tuple[float, float]:
        """How long ``work`` took, and the longest the event loop was held meanwhile."""
        gaps = [0.0]

        async def tick() -> None:
            while True:
                at = time.perf_counter()
                await asyncio.sleep(0.002)
                gaps.append(time.perf_counter() - at)

        ticker = asyncio.create_task(tick())
        await asyncio.sleep(0.02)
        began = time.perf_counter()
        await work
        took = time.perf_counter() - began
        ticker.cancel()
        return took, max(gaps)

    async def go(attempt: int):
        config = load_config(write_config(tmp_path, {"tiny-chat": ("chat", tiny_chat)}, "batch:\n  max_lines: 50000\n"))
        svc = build_services(config, KeyRing({t: [f"k-{t}"] for t in TIERS}))
        spec = request.getfixturevalue("redis_url") if store == "redis" else "sqlite"
        runner = Runner(svc, open_store(spec, tmp_path))  # its loops not started: nothing claims the lines
        await runner.store.open()
        f = FileInfo(f"file-big{attempt}", "me", "batch", "in.jsonl", 1, 0)
        await runner.store.put_file(f, jsonl([chat_line(i) for i in range(n)]))
        b = BatchInfo(f"batch_big{attempt}", "me", "/v1/chat/completions", f.id, "24h", 0, int(time.time()) + 600)
        await runner.store.create_batch(b)
        gc.disable()
        try:
            validating = await timed(runner._validate(b.id))
            assert (await runner.store.get_batch(b.id)).status == "in_progress"
            assert await runner.store.set_status(b.id, ["in_progress"], "cancelling", cancelling_at=1)
            cancelling = await timed(runner._finish(b.id))
        finally:
            gc.enable()
        ended = await runner.store.get_batch(b.id)
        await runner.store.close()
        await svc.arbiter.stop()
        return ended, {"validating": validating, "cancelling": cancelling}

    runs = []
    for attempt in range(2):
        ended, phases = asyncio.run(go(attempt))
        assert (ended.status, ended.failed, ended.total) == ("cancelled", n, n)
        runs.append({what: f"held {held:.2f} s at once, of {took:.2f} s" for what, (took, held) in phases.items()})
        if all(held < took / 8 for took, held in phases.values()):
            return
    raise AssertionError(f"the event loop was held for a large part of a phase in both runs: {runs}")


def test_total_usage_reads_each_endpoints_usage_and_counts_only_the_output_file():
    """``batch.lines.total_usage`` over a table of output and error lines: chat and completions'
    prompt/completion tokens, responses' input/output tokens with their details, embeddings'
    prompt tokens; speech (no usage), an error line with a body and a line that never ran add
    nothing."""
    from batch.lines import error_line, total_usage
    from batch.store import Outcome

    def ran(i: int, body, ok: bool = True) -> Outcome:
        return Outcome(i, ok, {"custom_id": f"r{i}", "response": {"status_code": 200 if ok else 400, "body": body},
                               "error": None})

    outcomes = [
        ran(0, {"object": "chat.completion", "usage": {"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10,
                                                        "prompt_tokens_details": {"cached_tokens": 2}}}),
        ran(1, {"object": "text_completion", "usage": {"prompt_tokens": 5, "completion_tokens": 4, "total_tokens": 9}}),
        ran(2, {"object": "response", "usage": {"input_tokens": 11, "output_tokens": 6, "total_tokens": 17,
                                                "input_tokens_details": {"cached_tokens": 1},
                                                "output_tokens_details": {"reasoning_tokens": 2}}}),
        ran(3, {"object": "list", "usage": {"prompt_tokens": 13, "total_tokens": 13}}),
        ran(4, {"type": "binary", "content_type": "audio/wav", "data": "UklGRg=="}),
        ran(5, {"error": {"message": "no", "usage": {"prompt_tokens": 100}}, "usage": {"prompt_tokens": 100}}, ok=False),
        error_line(6, "r6", "batch_expired", "the batch expired before this request ran"),
    ]
    assert total_usage(outcomes) == {"input_tokens": 36, "input_tokens_details": {"cached_tokens": 3},
                                     "output_tokens": 13, "output_tokens_details": {"reasoning_tokens": 2},
                                     "total_tokens": 49}
    assert total_usage([])["total_tokens"] == 0


def test_a_redis_outage_is_one_warning_per_loop_not_a_traceback_per_turn(tiny_chat, tmp_path, caplog):
    """Redis stops for a few seconds under an idle server: each loop that calls the store every
    turn (the batch runner's, the vector stores' indexer, the responses' reclaim, the managed
    keys' refresh, the stored responses' stops channel) logs one warning when it meets the outage and one when the store answers again, and no
    traceback (one per turn before: 118 in a 10 s outage)."""
    import logging

    port = spare_port()
    (tmp_path / "redis").mkdir()
    config = "batch:\n  store: {url}\n  reclaim_after_s: 2\nresponses:\n  reclaim_after_s: 3\n"
    with redis_server(tmp_path / "redis", port) as url:
        s = start_server(write_config(tmp_path, {"tiny-chat": ("chat", tiny_chat)}, config.format(url=url)))
    try:
        with caplog.at_level(logging.INFO, logger="tiergate"):
            time.sleep(4)  # several turns of every loop
            with redis_server(tmp_path / "redis", port):
                time.sleep(4)
                # (read while it runs: its stop at the end is a second outage, which the stops channel meets at once)
                records = [r for r in caplog.records if r.name.startswith("tiergate")]
    finally:
        s.stop()
    assert not [r.getMessage() for r in records if r.exc_info]
    down = [r.getMessage().split(": the store does not answer")[0] for r in records
            if ": the store does not answer" in r.getMessage()]
    back = [r.getMessage().split(": the store answers again")[0] for r in records
            if ": the store answers again" in r.getMessage()]
    assert len(down) == len(set(down)) and sorted(back) == sorted(down), (down, back)
    assert {"batch: claiming lines", "batch: sweep", "vector stores: claiming or recording a file",
            "background: reclaiming responses whose process died", "stored responses: the stops channel"} <= set(down)


def test_a_loop_logs_a_bug_with_its_traceback_every_time_and_a_store_down_once(caplog):
    """``storage.outage``: a store that does not answer is one warning until it answers again
    (then one more); any other failure is an error with its traceback, each time."""
    import logging

    import redis

    from storage.outage import Outage

    outage = Outage(logging.getLogger("tiergate.test"), "test: a loop")
    with caplog.at_level(logging.INFO, logger="tiergate"):
        for _ in range(3):
            outage.failed(redis.ConnectionError("refused"))
            outage.failed(sqlite3.OperationalError("database is locked"))
        outage.answered()
        outage.answered()
        for _ in range(2):
            outage.failed(sqlite3.OperationalError("no such column: x"))
            outage.failed(KeyError("a bug"))
    lines = [(r.levelname, r.getMessage(), r.exc_info is not None) for r in caplog.records]
    assert lines[:2] == [("WARNING", "test: a loop: the store does not answer (ConnectionError: refused); trying again "
                                     "until it does", False),
                         ("WARNING", "test: a loop: the store answers again, after 0 s", False)]
    assert lines[2:] == [("ERROR", "test: a loop failed", True)] * 4
