"""Documents in a Responses request (gateway/input_files.py): an ``input_file`` part, by an
uploaded file's id or inline as base64, is read as its text (gateway/documents.py), headed by its
name. Each case is checked against the same request with that text sent as an ``input_text``
part: the same reply, the same prompt tokens."""

from __future__ import annotations

import base64
import io
import json

import openai
import pytest

from gateway.documents import document_text
from gateway.input_files import FILE_HEAD
from tests.helpers import FileServer, run_batch, start_server, tiny_pdf, write_config

GOLD = ["The gold is under the palm tree.", "The map is in the captain's boot."]
QUESTION = {"type": "input_text", "text": "Where is the gold?"}


@pytest.fixture(scope="module")
def documents():
    files = FileServer({"/reports/treasure%20map.pdf": tiny_pdf(GOLD), "/big.pdf": tiny_pdf(GOLD * 2000)})
    yield files
    files.httpd.shutdown()


@pytest.fixture(scope="module")
def server(tiny_chat, tmp_path_factory):
    extra = "server:\n  file_url_hosts: ['127.0.0.1']\nlimits:\n  file_fetch_timeout_s: 1\n  file_fetch_max_bytes: 64KiB\n"
    running = start_server(write_config(tmp_path_factory.mktemp("input-files"), {"tiny-chat": ("chat", tiny_chat)}, extra))
    yield running
    running.stop()


def client(server, tier="paid") -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key=server.keys[tier], max_retries=0, timeout=120)


def ask(c: openai.OpenAI, part: dict, **kw):
    return c.responses.create(model="tiny-chat", max_output_tokens=6, temperature=0, **kw,
                              input=[{"role": "user", "content": [part, QUESTION]}])


def as_text(content: bytes, name: str) -> dict:
    return {"type": "input_text", "text": FILE_HEAD.format(name=name) + document_text(content, name)}


def same(got, want) -> None:
    assert (got.output_text, got.usage.input_tokens) == (want.output_text, want.usage.input_tokens)


def test_a_document_uploaded_in_parts_is_read_as_one_sent_whole(server, tmp_path):
    """The Uploads API makes a file of any purpose the Files API takes: a PDF sent in parts
    (``upload_file_chunked``, as a client sends one too large for one request) is a user_data
    file that reads as the same text."""
    c = client(server)
    pdf = tiny_pdf(GOLD * 3)  # ~1 KiB: three parts, and a prompt within the model's context
    path = tmp_path / "treasure.pdf"
    path.write_bytes(pdf)
    upload = c.uploads.upload_file_chunked(file=path, mime_type="application/pdf", purpose="user_data",
                                           part_size=len(pdf) // 3 + 1)
    assert (upload.status, upload.file.purpose, upload.file.bytes) == ("completed", "user_data", len(pdf))
    assert c.files.content(upload.file.id).content == pdf
    same(ask(c, {"type": "input_file", "file_id": upload.file.id}), ask(c, as_text(pdf, "treasure.pdf")))


def test_a_document_is_read_as_its_text_by_file_id_or_inline(server):
    c = client(server)
    pdf = tiny_pdf(GOLD)
    upload = c.files.create(file=("treasure.pdf", io.BytesIO(pdf)), purpose="user_data")
    want = ask(c, as_text(pdf, "treasure.pdf"))
    assert "palm tree" in as_text(pdf, "treasure.pdf")["text"]  # the pages' text, not the PDF's bytes
    by_id = ask(c, {"type": "input_file", "file_id": upload.id})
    same(by_id, want)
    b64 = base64.b64encode(pdf).decode()
    same(ask(c, {"type": "input_file", "filename": "treasure.pdf", "file_data": f"data:application/pdf;base64,{b64}"}),
         want)
    same(ask(c, {"type": "input_file", "filename": "treasure.pdf", "file_data": b64}), want)
    # the input items keep the file as it was named, not its text
    (item,) = c.responses.input_items.list(by_id.id).data
    assert item.content[0].type == "input_file" and item.content[0].file_id == upload.id
    # read again by a response that continues it, and counted the same by input_tokens
    later = c.responses.create(model="tiny-chat", previous_response_id=by_id.id, input="And the map?", max_output_tokens=1)
    again = c.responses.create(model="tiny-chat", previous_response_id=want.id, input="And the map?", max_output_tokens=1)
    assert later.usage.input_tokens == again.usage.input_tokens
    counted = c.responses.input_tokens.count(model="tiny-chat", input=[
        {"role": "user", "content": [{"type": "input_file", "file_id": upload.id}, QUESTION]}])
    assert counted.input_tokens == by_id.usage.input_tokens
    # a Markdown file (assistants purpose) is its text as it is; a name given with a file_id heads it
    notes = b"# Notes\n\nThe parrot knows the way."
    md = c.files.create(file=("notes.md", io.BytesIO(notes)), purpose="assistants")
    same(ask(c, {"type": "input_file", "file_id": md.id, "filename": "parrot.md"}), ask(c, as_text(notes, "parrot.md")))


def test_a_conversation_may_hold_a_document(server):
    c = client(server)
    pdf = tiny_pdf(GOLD)
    upload = c.files.create(file=("treasure.pdf", io.BytesIO(pdf)), purpose="user_data")

    def in_conversation(part: dict):
        conversation = c.conversations.create(items=[{"type": "message", "role": "user", "content": [part, QUESTION]}])
        return c.responses.create(model="tiny-chat", conversation=conversation.id, input="Say it.", max_output_tokens=4,
                                  temperature=0)

    same(in_conversation({"type": "input_file", "file_id": upload.id}), in_conversation(as_text(pdf, "treasure.pdf")))


def test_a_continued_response_reads_its_documents_again(server):
    """A response that continues one by ``previous_response_id`` reads its files again, as a
    conversation does: a file deleted since is a 404 naming its place among the items it continues
    (the response's input items, then its output), not a copy the stored response kept."""
    c = client(server)
    upload = c.files.create(file=("gold.txt", io.BytesIO(GOLD[0].encode())), purpose="user_data")
    first = ask(c, {"type": "input_file", "file_id": upload.id}, store=True)
    kept = c.responses.create(model="tiny-chat", previous_response_id=first.id, input="And the map?",
                              max_output_tokens=1)
    assert kept.usage.input_tokens > first.usage.input_tokens
    assert c.files.delete(upload.id).deleted
    with pytest.raises(openai.NotFoundError) as caught:
        c.responses.create(model="tiny-chat", previous_response_id=first.id, input="And the map?", max_output_tokens=1)
    assert (caught.value.body["param"], caught.value.body["code"]) == \
        ("previous_response_id[0].content[0].file_id", "file_not_found")
    with pytest.raises(openai.NotFoundError):  # counted as it would run
        c.responses.input_tokens.count(model="tiny-chat", previous_response_id=first.id, input="And the map?")


def test_what_cannot_be_read_is_refused_naming_the_part(server):
    c = client(server)
    pdf = tiny_pdf(GOLD)
    mine = c.files.create(file=("treasure.pdf", io.BytesIO(pdf)), purpose="user_data")
    batch = c.files.create(file=("b.jsonl", io.BytesIO(b"{}\n")), purpose="batch")
    picture = c.files.create(file=("p.png", io.BytesIO(b"\x89PNG\r\n\x1a\n" + bytes(64))), purpose="user_data")
    b64 = base64.b64encode(pdf).decode()
    part = "input[0].content[0]"
    for key, given, error, param, code in [
        ("free", {"file_id": mine.id}, openai.NotFoundError, f"{part}.file_id", "file_not_found"),  # another key's
        ("paid", {"file_id": "file-nope"}, openai.NotFoundError, f"{part}.file_id", "file_not_found"),
        ("paid", {"file_id": batch.id}, openai.BadRequestError, f"{part}.file_id", "invalid_file_purpose"),
        ("paid", {"file_id": picture.id}, openai.BadRequestError, f"{part}.file_id", "unsupported_file"),
        ("paid", {"file_url": "https://example.com/a.pdf"}, openai.BadRequestError, f"{part}.file_url",
         "file_url_not_fetched"),  # a host tiers.yaml does not list
        ("paid", {}, openai.BadRequestError, f"{part}.file_id", "missing_required_parameter"),
        ("paid", {"file_id": mine.id, "file_data": b64, "filename": "a.pdf"}, openai.BadRequestError,
         f"{part}.file_data", "invalid_value"),
        ("paid", {"file_data": b64}, openai.BadRequestError, f"{part}.filename", "missing_required_parameter"),
        ("paid", {"file_data": "not base64!", "filename": "a.pdf"}, openai.BadRequestError, f"{part}.file_data",
         "invalid_value"),
        ("paid", {"file_data": base64.b64encode(b"%PDF-1.4 broken").decode(), "filename": "a.pdf"},
         openai.BadRequestError, f"{part}.file_data", "invalid_file"),
        ("paid", {"file_data": base64.b64encode(b"   ").decode(), "filename": "a.txt"}, openai.BadRequestError,
         f"{part}.file_data", "invalid_file"),
        ("paid", {"file_id": mine.id, "pages": 1}, openai.BadRequestError, f"{part}.pages", "unknown_parameter"),
    ]:
        with pytest.raises(error) as caught:
            ask(client(server, key), {"type": "input_file", **given})
        assert (caught.value.body["param"], caught.value.body["code"]) == (param, code), given
    with pytest.raises(openai.NotFoundError) as caught:  # a conversation's items are checked when they are added
        client(server, "free").conversations.create(items=[{"type": "message", "role": "user", "content": [
            {"type": "input_file", "file_id": mine.id}]}])
    assert caught.value.body["param"] == "items[0].content[0].file_id"


def test_chat_completions_read_a_file_part_as_its_text(server):
    """Chat Completions' ``{"type": "file", "file": {...}}`` part: the same document, as a text
    part; in a Batch API line too."""
    c = client(server)
    pdf = tiny_pdf(GOLD)
    upload = c.files.create(file=("treasure.pdf", io.BytesIO(pdf)), purpose="user_data")
    text = FILE_HEAD.format(name="treasure.pdf") + document_text(pdf, "treasure.pdf")

    def chat(part: dict, key=c):
        return key.chat.completions.create(model="tiny-chat", max_tokens=6, temperature=0, messages=[
            {"role": "user", "content": [part, {"type": "text", "text": QUESTION["text"]}]}])

    want = chat({"type": "text", "text": text})
    for file in ({"file_id": upload.id},
                 {"filename": "treasure.pdf", "file_data": "data:application/pdf;base64," + base64.b64encode(pdf).decode()}):
        got = chat({"type": "file", "file": file})
        assert (got.choices[0].message.content, got.usage.prompt_tokens) == \
            (want.choices[0].message.content, want.usage.prompt_tokens)
    body = {"model": "tiny-chat", "max_tokens": 6, "temperature": 0, "messages": [
        {"role": "user", "content": [{"type": "file", "file": {"file_id": upload.id}}, {"type": "text", "text": QUESTION["text"]}]}]}
    batch = run_batch(c, "/v1/chat/completions", [{"custom_id": "a", "method": "POST", "url": "/v1/chat/completions",
                                                   "body": body}])
    assert batch.status == "completed" and batch.request_counts.completed == 1
    line = json.loads(c.files.content(batch.output_file_id).text)
    assert line["response"]["body"]["choices"][0]["message"]["content"] == want.choices[0].message.content
    for key, part, error, param, code in [
        ("free", {"type": "file", "file": {"file_id": upload.id}}, openai.NotFoundError,
         "messages[0].content[0].file.file_id", "file_not_found"),
        ("paid", {"type": "file", "file": "nope"}, openai.BadRequestError, "messages[0].content[0].file", "invalid_value"),
        ("paid", {"type": "file", "file": {"file_data": "eA=="}}, openai.BadRequestError,
         "messages[0].content[0].file.filename", "missing_required_parameter"),
    ]:
        with pytest.raises(error) as caught:
            chat(part, client(server, key))
        assert (caught.value.body["param"], caught.value.body["code"]) == (param, code), part


def test_a_document_is_read_once_and_kept(server, monkeypatch):
    """A conversation over a report reads its text once: by the upload's id (uploads do not
    change), or inline by the bytes' digest; another name may read it otherwise (HTML by its
    name), so it is read again. A text larger than the whole cache is read each time, not kept."""
    import gateway.input_files as input_files
    from cachetools import LRUCache

    reads: list[str] = []

    def counted(content: bytes, filename: str = "") -> str:
        reads.append(filename)
        return document_text(content, filename)

    monkeypatch.setattr(input_files, "document_text", counted)
    monkeypatch.setattr(input_files, "_TEXTS", LRUCache(maxsize=input_files.TEXT_CACHE_CHARS, getsizeof=len))
    c = client(server)
    pdf = tiny_pdf(GOLD)
    upload = c.files.create(file=("treasure.pdf", io.BytesIO(pdf)), purpose="user_data")
    first = ask(c, {"type": "input_file", "file_id": upload.id})
    later = c.responses.create(model="tiny-chat", previous_response_id=first.id, input="And the map?", max_output_tokens=1)
    assert later.status in ("completed", "incomplete") and reads == ["treasure.pdf"]
    ask(c, {"type": "input_file", "file_id": upload.id, "filename": "report.pdf"})
    assert reads == ["treasure.pdf", "report.pdf"]
    inline = {"type": "input_file", "filename": "treasure.pdf", "file_data": base64.b64encode(pdf).decode()}
    same(ask(c, inline), ask(c, inline))
    assert reads == ["treasure.pdf", "report.pdf", "treasure.pdf"]
    monkeypatch.setattr(input_files, "_TEXTS", LRUCache(maxsize=8, getsizeof=len))
    ask(c, inline), ask(c, inline)
    assert reads[3:] == ["treasure.pdf", "treasure.pdf"]


def test_a_document_url_on_a_listed_host_is_fetched_and_read_as_the_same_bytes_inline(server, documents):
    """``file_url`` on a host of ``server.file_url_hosts``: fetched (no redirect followed, within
    ``limits.file_fetch_timeout_s`` and ``file_fetch_max_bytes``), named by the URL's last segment,
    and read as the same file sent inline; another host, or a fetch that fails, a 400."""
    c = client(server)
    pdf = documents.files["/reports/treasure%20map.pdf"]
    inline = {"type": "input_file", "filename": "treasure map.pdf", "file_data": base64.b64encode(pdf).decode()}
    same(ask(c, {"type": "input_file", "file_url": f"{documents.url}/reports/treasure%20map.pdf"}), ask(c, inline))
    part = "input[0].content[0].file_url"
    for url, code in [(f"{documents.url}/moved", "file_url_fetch_failed"), (f"{documents.url}/slow", "file_url_fetch_failed"),
                      (f"{documents.url}/missing.pdf", "file_url_fetch_failed"), (f"{documents.url}/big.pdf", "file_too_large"),
                      (documents.url.replace("127.0.0.1", "localhost") + "/big.pdf", "file_url_not_fetched"),
                      ("ftp://127.0.0.1/a.pdf", "invalid_value")]:
        with pytest.raises(openai.BadRequestError) as caught:
            ask(c, {"type": "input_file", "file_url": url})
        assert (caught.value.body["param"], caught.value.body["code"]) == (part, code), url


def test_a_large_uploaded_image_is_encoded_off_the_event_loop(monkeypatch):
    """An input_image's file_id past INLINE_ENCODE bytes becomes its data: URL on a thread (an
    upload may be up to batch.max_file_bytes: its base64 took the event loop from every other
    request); a small one stays on the loop. Both are the file's data: URL."""
    import asyncio
    from types import SimpleNamespace

    from PIL import Image
    from PIL.PngImagePlugin import PngInfo

    import gateway.input_files as input_files
    from batch.store import FileInfo

    def png(padding: int) -> bytes:
        info = PngInfo()
        info.add_text("pad", "x" * padding)
        out = io.BytesIO()
        Image.new("RGB", (8, 8), (1, 2, 3)).save(out, "PNG", pnginfo=info)
        return out.getvalue()

    files = {"file-small": png(0), "file-large": png(input_files.INLINE_ENCODE)}

    async def get_file(file_id):
        return FileInfo(file_id, "k", "vision", "a.png", len(files[file_id]), 0)

    async def file_content(file_id):
        return files[file_id]

    where, encode = [], input_files._data_url

    def watched(media: str, data: bytes) -> str:
        try:
            asyncio.get_running_loop()
            where.append("loop")
        except RuntimeError:
            where.append("thread")
        return encode(media, data)

    monkeypatch.setattr(input_files, "_data_url", watched)
    svc = SimpleNamespace(files=SimpleNamespace(get_file=get_file, file_content=file_content))
    caller = SimpleNamespace(admin=False, key_id="k")
    items = [{"role": "user", "content": [{"type": "input_image", "file_id": f}]} for f in files]
    got = asyncio.run(input_files.read_files(svc, caller, items))
    assert where == ["loop", "thread"]
    assert [item["content"][0]["image_url"] for item in got] == \
        [f"data:image/png;base64,{base64.b64encode(data).decode()}" for data in files.values()]
