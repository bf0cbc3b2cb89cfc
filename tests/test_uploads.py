"""The Uploads API (a file sent in parts; here a batch input): the openai SDK's ``upload_file_chunked`` to
a batch that runs from the file it made, every refusal over HTTP, and the store's contract on
SQLite and Redis (parts never past the declared bytes, even sent at once; one end only)."""

from __future__ import annotations

import asyncio
import hashlib
import io
import json
import time
import uuid

import httpx
import openai
import pytest

from batch.uploads import PartRefused, RedisUploads, SQLiteUploads, UploadInfo
from tests.helpers import start_server, write_config, shared_store
from tests.test_batches import chat_line, jsonl, sdk, wait


@pytest.fixture(scope="module")
def server(tiny_chat, tmp_path_factory):
    srv = start_server(write_config(tmp_path_factory.mktemp("uploads"), {"tiny-chat": ("chat", tiny_chat)},
                                    "batch:\n  max_file_bytes: 64KiB\n  max_lines: 50\n"))
    yield srv
    srv.stop()


def parts_of(c: openai.OpenAI, upload_id: str, *chunks: bytes) -> list[str]:
    return [c.uploads.parts.create(upload_id=upload_id, data=chunk).id for chunk in chunks]


def refusal(call) -> dict:
    with pytest.raises(openai.APIStatusError) as e:
        call()
    assert e.value.status_code in (400, 404, 413), e.value
    return {**e.value.body, "status": e.value.status_code}


def test_a_file_uploaded_in_parts_runs_as_a_batch(server, tmp_path):
    c = sdk(server)
    content = jsonl([chat_line(i) for i in range(6)])
    path = tmp_path / "in.jsonl"
    path.write_bytes(content)
    upload = c.uploads.upload_file_chunked(file=path, mime_type="application/jsonl", purpose="batch", part_size=100,
                                           md5=hashlib.md5(content).hexdigest())
    assert len(content) > 300  # so at least four parts
    assert upload.status == "completed" and upload.bytes == len(content) and upload.filename == "in.jsonl"
    assert upload.file.id.startswith("file-") and upload.file.bytes == len(content) and upload.file.filename == "in.jsonl"
    assert c.files.content(upload.file.id).content == content  # the parts in their order
    batch = c.batches.create(input_file_id=upload.file.id, endpoint="/v1/chat/completions", completion_window="24h")
    done = wait(c, batch.id)
    assert (done.status, done.request_counts.completed) == ("completed", 6)
    again = c.uploads.complete(upload_id=upload.id, part_ids=[])  # completed: returned as it is
    assert (again.status, again.file.id) == ("completed", upload.file.id)


def test_parts_left_out_are_dropped_and_the_order_is_the_clients(server):
    c = sdk(server)
    upload = c.uploads.create(bytes=8, filename="x.jsonl", mime_type="text/jsonl", purpose="batch",
                              expires_after={"anchor": "created_at", "seconds": 7200})
    assert upload.status == "pending" and upload.expires_at - upload.created_at == 3600 and upload.file is None
    a, b = parts_of(c, upload.id, b"{}\n", b"[]\n")
    with pytest.raises(openai.BadRequestError) as e:  # 6 of 8 bytes
        c.uploads.complete(upload_id=upload.id, part_ids=[b, a])
    assert e.value.body["code"] == "bytes_mismatch"
    (d,) = parts_of(c, upload.id, b"1\n")
    made = c.uploads.complete(upload_id=upload.id, part_ids=[b, d, a])
    assert c.files.content(made.file.id).content == b"[]\n1\n{}\n"
    assert made.file.expires_at == made.file.created_at + 7200


def test_refusals(server, monkeypatch):
    c = sdk(server)

    def create(**kw):
        return c.uploads.create(**{"bytes": 10, "filename": "x.jsonl", "mime_type": "application/jsonl",
                                   "purpose": "batch", **kw})

    assert refusal(lambda: create(purpose="nope"))["param"] == "purpose"
    assert refusal(lambda: create(mime_type="image/png"))["code"] == "unsupported_mime_type"  # batch lines
    assert refusal(lambda: create(purpose="vision", mime_type="application/jsonl"))["code"] == "unsupported_mime_type"
    picture = create(purpose="vision", mime_type="image/png")  # what it holds is checked when it is completed
    not_png = refusal(lambda: c.uploads.complete(upload_id=picture.id, part_ids=parts_of(c, picture.id, b"0123456789")))
    assert (not_png["code"], not_png["param"]) == ("invalid_file", "part_ids")
    assert refusal(lambda: create(bytes=65 * 1024))["code"] == "file_too_large"  # max_file_bytes: 64KiB
    assert refusal(lambda: create(bytes=-1))["param"] == "bytes"
    upload = create()
    (first,) = parts_of(c, upload.id, b"12345678")
    too_many = refusal(lambda: parts_of(c, upload.id, b"abc"))  # 11 of 10 bytes
    assert too_many["code"] == "upload_too_large" and too_many["status"] == 400
    assert refusal(lambda: c.uploads.complete(upload_id=upload.id, part_ids=[first, first]))["param"] == "part_ids"
    assert refusal(lambda: c.uploads.complete(upload_id=upload.id, part_ids=["part_nope"]))["code"] == "part_not_found"
    assert refusal(lambda: sdk(server, "free").uploads.parts.create(upload_id=upload.id, data=b"9"))["status"] == 404
    assert refusal(lambda: sdk(server, "free").uploads.cancel(upload.id))["code"] == "upload_not_found"
    (second,) = parts_of(c, upload.id, b"\xff\n")  # not UTF-8
    bad = refusal(lambda: c.uploads.complete(upload_id=upload.id, part_ids=[first, second]))
    assert bad["code"] == "invalid_file" and bad["param"] == "part_ids"
    wrong = refusal(lambda: c.uploads.complete(upload_id=upload.id, part_ids=[first, second], md5="0" * 32))
    assert wrong["code"] == "md5_mismatch"
    cancelled = c.uploads.cancel(upload.id)  # still pending after the refused completes: cancelled
    assert cancelled.status == "cancelled" and c.uploads.cancel(upload.id).status == "cancelled"
    assert refusal(lambda: parts_of(c, upload.id, b"1"))["code"] == "upload_not_pending"
    assert refusal(lambda: c.uploads.complete(upload_id=upload.id, part_ids=[first]))["code"] == "upload_not_pending"
    assert refusal(lambda: c.uploads.cancel("upload_nope"))["status"] == 404
    with httpx.Client(base_url=server.base_url, headers={"authorization": f"Bearer {server.keys['paid']}"}) as h:
        r = h.post(f"/uploads/{create().id}/parts", json={"data": "x"})  # not multipart
        assert r.status_code == 415 and r.json()["error"]["code"] == "unsupported_media_type"
        r = h.post(f"/uploads/{create().id}/parts", files={"other": ("a", io.BytesIO(b"1"))})
        assert r.status_code == 400 and r.json()["error"]["param"] == "data"
        r = h.post("/uploads", json={"bytes": 1, "filename": "x", "mime_type": "text/plain", "purpose": "batch", "x": 1})
        assert r.status_code == 400 and r.json()["error"]["code"] == "unknown_parameter"
    import batch.api

    monkeypatch.setattr(batch.api, "UPLOAD_TTL_S", 0)  # made expired
    late = create()
    assert late.status == "expired"
    assert refusal(lambda: parts_of(c, late.id, b"1"))["code"] == "upload_not_pending"


@pytest.fixture(params=["sqlite", "redis"])
def stores(request, tmp_path):
    """A factory of upload stores that share one backing store, as processes do."""
    return shared_store(request, tmp_path, SQLiteUploads, RedisUploads)


def _upload(n: int, created_at: int | None = None) -> UploadInfo:
    now = int(time.time()) if created_at is None else created_at
    return UploadInfo(f"upload_{uuid.uuid4().hex}", "owner", "x.jsonl", "batch", n, "text/plain", now, now + 3600, None)


def test_the_store_never_takes_parts_past_the_bytes_and_ends_once(stores):
    async def go():
        a, b = stores(), stores()
        await a.open()
        await b.open()
        try:
            upload = _upload(10)
            await a.create(upload)
            assert (await b.get(upload.id)) == upload
            results = await asyncio.gather(*(s.add_part(upload.id, f"part_{i}", b"xxxx", time.time())
                                             for i, s in enumerate([a, b, a, b])), return_exceptions=True)
            taken = [r for r in results if isinstance(r, int)]
            assert sorted(taken) == [4, 8]  # two of the four parts fit in 10 bytes, whoever sent them
            assert all(isinstance(r, PartRefused) and r.reason == "too_many_bytes" for r in results if not isinstance(r, int))
            assert await a.add_part(upload.id, "part_last", b"zz", time.time()) == 10
            kept = [f"part_{i}" for i, r in enumerate(results) if isinstance(r, int)]
            assert await b.parts(upload.id, [*kept, "part_last", "part_nope"]) == [b"xxxx", b"xxxx", b"zz", None]
            other = _upload(4)
            await a.create(other)
            assert await a.parts(other.id, kept) == [None, None]  # another upload's parts are not its
            ends = await asyncio.gather(a.end(upload.id, "completed", "file-1", time.time()),
                                        b.end(upload.id, "cancelled", None, time.time()))
            assert sorted(e is None for e in ends) == [False, True]  # one end only
            ended = await a.get(upload.id)
            assert ended.status in ("completed", "cancelled") and ended == next(e for e in ends if e)
            assert await b.parts(upload.id, kept) == [None, None]  # its parts deleted
            with pytest.raises(PartRefused) as refused:
                await a.add_part(upload.id, "part_more", b"1", time.time())
            assert refused.value.reason == "not_pending"
            with pytest.raises(PartRefused):  # past its expiry
                await a.add_part(other.id, "part_late", b"1", other.expires_at + 1)
            assert await a.end(other.id, "cancelled", None, other.expires_at + 1) is None
        finally:
            await a.close()
            await b.close()

    asyncio.run(go())


def test_the_sqlite_sweep_deletes_expired_parts_and_day_old_uploads(tmp_path):
    async def go():
        s = SQLiteUploads(tmp_path / "batches.sqlite3")
        await s.open()
        try:
            expired, old, live = _upload(4, int(time.time()) - 7200), _upload(4, int(time.time()) - 90000), _upload(4)
            for u in (expired, old, live):
                await s.create(u)
                await s._call(lambda u=u: s._db.execute("INSERT INTO upload_parts (id, upload_id, data) VALUES (?, ?, ?)",
                                                        (f"part_{u.id}", u.id, b"1234")))
            assert await s.sweep() == 3  # the expired one's part, the old one's part and the old one
            assert await s.get(old.id) is None and (await s.get(expired.id)).status_at(time.time()) == "expired"
            assert await s.parts(expired.id, [f"part_{expired.id}"]) == [None]
            assert await s.parts(live.id, [f"part_{live.id}"]) == [b"1234"]
        finally:
            await s.close()

    asyncio.run(go())


def test_a_lines_file_made_by_an_upload_is_the_same_file_the_files_api_makes(server):
    """The file an upload makes is checked as ``POST /v1/files`` checks one: too many lines refused."""
    c = sdk(server)
    content = "".join(json.dumps(chat_line(i)) + "\n" for i in range(51)).encode()  # max_lines: 50
    upload = c.uploads.create(bytes=len(content), filename="x.jsonl", mime_type="application/jsonl", purpose="batch")
    ids = parts_of(c, upload.id, content[:1000], content[1000:])
    assert refusal(lambda: c.uploads.complete(upload_id=upload.id, part_ids=ids))["code"] == "too_many_lines"
    with pytest.raises(openai.BadRequestError) as e:
        c.files.create(file=("x.jsonl", io.BytesIO(content)), purpose="batch")
    assert e.value.body["code"] == "too_many_lines"
