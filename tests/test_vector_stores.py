"""Vector stores through the openai SDK against a real server on tiny-embed: files read, cut and
embedded in the background, searched (scores checked against /v1/embeddings' own vectors),
filtered, refused with OpenAI-shaped errors; a file a dead process left half read is read again;
and the pure parts (windows, chunk sizes, filters, ranking) over tables."""

from __future__ import annotations

import asyncio
import json
import sqlite3
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import httpx
import numpy as np
import openai
import pytest
from transformers import AutoTokenizer

from gateway.errors import APIError
from gateway.vector_store import Chunks, SQLiteVectorStores, StoreFile, VectorStore
from gateway import vector_search
from gateway.vector_search import Matrix, Shelf, Words, check_filter, matches, rank
from gateway.vector_stores import ChunkingStrategy, chunk_sizes
from tests.helpers import start_server, tiny_pdf, write_config
from workers.embed import windows

LEASE = 4.5  # the dead process's lease, in seconds
DOC_A = ("Tiergate serves chat, images, speech and transcription from one shared GPU. "
         "Paid requests come first; batch work yields at the next step boundary. ") * 6
DOC_B = "The quick brown fox jumps over the lazy dog. Foxes are quick and dogs are lazy. " * 10


@pytest.fixture(scope="module")
def server(tiny_embed, tiny_chat, tmp_path_factory):
    folder = tmp_path_factory.mktemp("vector_stores")
    path = write_config(folder, {"tiny-embed": ("embed", tiny_embed), "tiny-chat": ("chat", tiny_chat),
                                 "tiny-chat-queries": ("chat", tiny_chat)})
    # the same weights, asked to write its own search queries (engine.search_queries: model)
    text = path.read_text()
    entry = f"  - name: tiny-chat-queries\n    kind: chat\n    path: {tiny_chat}\n    engine: transformers\n"
    assert entry in text
    path.write_text(text.replace(entry, entry.replace("engine: transformers",
                                                      "engine: {name: transformers, search_queries: model}")))
    s = start_server(path)
    yield s
    s.stop()


def client(server, tier="paid") -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key=server.keys[tier], max_retries=0, timeout=120)


def upload(c, name: str, content: bytes | str, purpose="assistants") -> str:
    data = content.encode() if isinstance(content, str) else content
    return c.files.create(file=(name, data), purpose=purpose).id


def poll(c, store_id: str, file_id: str):
    deadline = time.time() + 60
    while True:
        f = c.vector_stores.files.retrieve(file_id, vector_store_id=store_id)
        if f.status != "in_progress" or time.time() > deadline:
            return f
        time.sleep(0.1)


def cosine(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(a @ b / np.linalg.norm(a) / np.linalg.norm(b))


def test_files_are_read_and_search_ranks_their_chunks(server, tiny_embed):
    c = client(server)
    a, b = upload(c, "a.md", DOC_A), upload(c, "b.txt", DOC_B)
    store = c.vector_stores.create(name="docs", file_ids=[a], metadata={"team": "x"})
    assert store.object == "vector_store" and store.name == "docs" and store.metadata == {"team": "x"}
    assert store.file_counts.total == 1
    fb = c.vector_stores.files.create_and_poll(file_id=b, vector_store_id=store.id, attributes={"kind": "animals"},
                                              chunking_strategy={"type": "static", "static": {
                                                  "max_chunk_size_tokens": 100, "chunk_overlap_tokens": 20}})
    fa = poll(c, store.id, a)
    assert (fa.status, fb.status) == ("completed", "completed"), (fa.last_error, fb.last_error)
    assert fb.chunking_strategy.static.max_chunk_size_tokens == 100 and fb.attributes == {"kind": "animals"}
    assert fa.chunking_strategy.static.max_chunk_size_tokens == 126  # auto: the model's room (128 - [CLS], [SEP])
    assert fa.chunking_strategy.static.chunk_overlap_tokens == 63

    # the chunks are the windows of the tokenizer's tokens, each the text as written
    tok = AutoTokenizer.from_pretrained(tiny_embed)
    for doc, fid, size, overlap in ((DOC_A, a, 126, 63), (DOC_B, b, 100, 20)):
        texts = [p.text for p in c.vector_stores.files.content(fid, vector_store_id=store.id)]
        n = len(tok(doc, add_special_tokens=False)["input_ids"])
        assert len(texts) == len(windows(n, size, overlap)) > 1
        assert doc.startswith(texts[0]) and doc.rstrip().endswith(texts[-1]) and all(t in doc for t in texts)

    got = c.vector_stores.retrieve(store.id)
    assert got.status == "completed" and got.file_counts.completed == 2 and got.file_counts.total == 2
    assert got.usage_bytes > 0

    # search: scores are (1 + cosine) / 2 of the model's own vectors of each window's ids, best first
    query = "a lazy dog and a quick fox"
    page = c.vector_stores.search(store.id, query=query, max_num_results=50)
    rows = []
    for doc, size, overlap in ((DOC_A, 126, 63), (DOC_B, 100, 20)):
        ids = tok(doc, add_special_tokens=False)["input_ids"]
        rows += [[tok.cls_token_id, *ids[s:e], tok.sep_token_id] for s, e in windows(len(ids), size, overlap)]
    vectors = [d.embedding for d in c.embeddings.create(model="tiny-embed", input=rows).data]
    q = c.embeddings.create(model="tiny-embed", input=query).data[0].embedding
    want = sorted(((1 + cosine(q, v)) / 2 for v in vectors), reverse=True)
    assert len(page.data) == len(rows)
    assert [hit.score for hit in page.data] == pytest.approx(want, abs=1e-5)
    top = page.data[0]
    assert top.filename in ("a.md", "b.txt") and top.content[0].type == "text"

    # a chunk's own text finds it first, at a score of 1
    target = c.vector_stores.files.content(b, vector_store_id=store.id).data[0].text
    hit = c.vector_stores.search(store.id, query=target, max_num_results=1).data[0]
    assert hit.content[0].text == target and hit.file_id == b and hit.score == pytest.approx(1.0, abs=1e-5)
    assert hit.attributes == {"kind": "animals"}

    # filters on attributes, a threshold, several queries (each chunk scored by its best)
    only_a = c.vector_stores.search(store.id, query=query, filters={"type": "ne", "key": "kind", "value": "animals"})
    assert only_a.data == []  # a has no attributes: 'ne' on a missing key is false
    c.vector_stores.files.update(a, vector_store_id=store.id, attributes={"kind": "product", "year": 2026})
    years = c.vector_stores.search(store.id, query=query, filters={"type": "and", "filters": [
        {"type": "gte", "key": "year", "value": 2025}, {"type": "in", "key": "kind", "value": ["product", "x"]}]})
    assert years.data and {h.file_id for h in years.data} == {a}
    k = next(k for k in range(1, len(want)) if want[k - 1] - want[k] > 1e-4)  # a gap: no float32 rounding at the edge
    high = c.vector_stores.search(store.id, query=query, ranking_options={"score_threshold": (want[k - 1] + want[k]) / 2})
    assert [h.score for h in high.data] == pytest.approx(want[:k], abs=1e-5)
    two = c.vector_stores.search(store.id, query=[query, target], max_num_results=1)
    assert two.data[0].content[0].text == target
    # by words alone (hybrid_search, text weight only): a chunk with the query's words first
    worded = c.vector_stores.search(store.id, query="foxes", max_num_results=3, ranking_options={
        "hybrid_search": {"embedding_weight": 0, "text_weight": 1}})
    assert worded.data[0].score == 1.0 and "Foxes" in worded.data[0].content[0].text

    # listed, filtered by status, deleted
    assert [f.id for f in c.vector_stores.files.list(store.id, order="asc")] == [a, b]
    assert [f.id for f in c.vector_stores.files.list(store.id, filter="failed")] == []
    assert c.vector_stores.files.delete(b, vector_store_id=store.id).deleted
    assert {h.file_id for h in c.vector_stores.search(store.id, query=target).data} == {a}
    assert store.id in [s.id for s in c.vector_stores.list()]
    renamed = c.vector_stores.update(store.id, name="renamed")
    assert renamed.name == "renamed" and renamed.metadata == {"team": "x"}  # what is not sent is kept
    assert c.vector_stores.update(store.id, metadata={"team": "y"}).model_dump(include={"name", "metadata"}) == \
        {"name": "renamed", "metadata": {"team": "y"}}
    assert c.vector_stores.delete(store.id).deleted
    with pytest.raises(openai.NotFoundError):
        c.vector_stores.search(store.id, query=query)


def test_what_cannot_be_read_fails_with_its_reason(server):
    c = client(server)
    store = c.vector_stores.create(name="bad")
    binary = upload(c, "x.png", b"\x89PNG\r\n\x1a\n\xff\xfe\x00\x01binary")
    empty = upload(c, "empty.txt", "   \n")
    broken = upload(c, "broken.pdf", b"%PDF-1.7\n\xff\xfe\x00\x01 not a PDF after all")
    gone = upload(c, "gone.txt", "soon deleted")
    locked = upload(c, "locked.pdf", _encrypted_pdf())
    cut_short = upload(c, "short.pdf", tiny_pdf(["a page"])[:-60])
    for fid in (binary, empty, broken, locked, cut_short):
        c.vector_stores.files.create(vector_store_id=store.id, file_id=fid)
    assert poll(c, store.id, locked).last_error.code == "unsupported_file"
    short = poll(c, store.id, cut_short)  # pypdf may mend a lost trailer; if not, it is the file's fault
    assert short.status == "completed" or short.last_error.code == "invalid_file", short.last_error
    f = poll(c, store.id, binary)
    assert f.status == "failed" and f.last_error.code == "unsupported_file"
    assert poll(c, store.id, empty).last_error.code == "invalid_file"
    assert poll(c, store.id, broken).last_error.code == "invalid_file"
    c.files.delete(gone)
    with pytest.raises(openai.NotFoundError) as e:
        c.vector_stores.files.create(vector_store_id=store.id, file_id=gone)
    assert e.value.body["param"] == "file_id"
    counts = c.vector_stores.retrieve(store.id).file_counts
    assert (counts.failed, counts.total) == (4 + (short.status == "failed"), 5)
    metrics = httpx.get(f"{server.url}/metrics", timeout=30).text
    failed = next(line for line in metrics.splitlines() if line.startswith('tiergate_vector_store_files_read_total{outcome="failed"}'))
    assert float(failed.split()[-1]) >= 3 and "tiergate_vector_store_chunks_total" in metrics
    assert [x.id for x in c.vector_stores.files.list(store.id, filter="failed", order="asc")][:4] == \
        [binary, empty, broken, locked]


def _encrypted_pdf() -> bytes:
    import io

    from pypdf import PdfWriter

    writer = PdfWriter()
    writer.add_blank_page(72, 72)
    writer.encrypt("secret", algorithm="RC4-128")
    out = io.BytesIO()
    writer.write(out)
    return out.getvalue()


def test_a_pdf_is_read_as_its_pages_text(server):
    c = client(server)
    pages = ["The gateway admits paid requests first.", "Batch work yields to everyone else."]
    doc = upload(c, "guide.pdf", tiny_pdf(pages))
    store = c.vector_stores.create(name="pdf", file_ids=[doc])
    f = poll(c, store.id, doc)
    assert f.status == "completed", f.last_error
    assert [p.text for p in c.vector_stores.files.content(doc, vector_store_id=store.id)] == ["\n\n".join(pages)]
    hit = c.vector_stores.search(store.id, query="Batch work yields").data[0]
    assert hit.filename == "guide.pdf" and "paid requests" in hit.content[0].text


def test_word_powerpoint_and_html_files_are_read_as_their_text(server):
    """Through the SDK, as an app uploads them: each file's chunks are gateway.documents' text of it
    (the units' tests check that text), and a search finds them by it."""
    from tests.test_documents import PAGE, slides_file, word_file

    c = client(server)
    files = {upload(c, name, content): name for name, content in
             (("policy.docx", word_file()), ("deck.pptx", slides_file()), ("refunds.html", PAGE))}
    store = c.vector_stores.create(name="office", file_ids=list(files))
    texts = {}
    for fid, name in files.items():
        f = poll(c, store.id, fid)
        assert f.status == "completed", (name, f.last_error)
        texts[name] = "".join(p.text for p in c.vector_stores.files.content(fid, vector_store_id=store.id))
    assert texts["policy.docx"].startswith("# Refund policy") and "paid | yes | 30" in texts["policy.docx"]
    assert "Notes: Say it slowly." in texts["deck.pptx"] and "<" not in texts["refunds.html"]
    assert "never read" not in texts["refunds.html"] and "naïve" in texts["refunds.html"]
    hits = c.vector_stores.search(store.id, query="Refund policy", max_num_results=10).data
    assert {h.filename for h in hits} == set(files.values())


def _error(r: httpx.Response) -> dict:
    body = r.json()["error"]
    assert set(body) == {"message", "type", "param", "code"} and (body["code"] is None or isinstance(body["code"], str))
    return body


@pytest.mark.parametrize("path, body, status, param", [
    ("", {"chunking_strategy": {"type": "static", "static": {"max_chunk_size_tokens": 500, "chunk_overlap_tokens": 0}}},
     400, "chunking_strategy.static.max_chunk_size_tokens"),
    ("", {"chunking_strategy": {"type": "static", "static": {"max_chunk_size_tokens": 100, "chunk_overlap_tokens": 60}}},
     400, "chunking_strategy.static.chunk_overlap_tokens"),
    ("", {"chunking_strategy": {"type": "static"}}, 400, "chunking_strategy.static"),
    ("", {"model": "tiny-chat"}, 400, "model"),
    ("", {"model": "nope"}, 404, "model"),
    ("", {"file_ids": ["file-nope"]}, 404, "file_ids[0]"),
    ("", {"expires_after": {"anchor": "created_at", "days": 1}}, 400, "expires_after.anchor"),
    ("/search", {"query": ""}, 400, "query"),
    ("/search", {"query": ["ok", " "]}, 400, "query[1]"),
    ("/search", {"query": "x", "max_num_results": 51}, 400, "max_num_results"),
    ("/search", {"query": "x", "filters": {"type": "eq", "key": "k"}}, 400, "filters"),
    ("/search", {"query": "x", "filters": {"type": "or", "filters": [{"type": "like", "key": "k", "value": 1}]}},
     400, "filters.filters[0].type"),
    ("/search", {"query": "x", "filters": {"type": "in", "key": "k", "value": 3}}, 400, "filters.value"),
    ("/search", {"query": "x", "rewrite_query": True}, 400, "rewrite_query"),
    ("/search", {"query": "word " * 200}, 400, "query"),
    ("/files", {"file_id": "file-nope"}, 404, "file_id"),
    ("/files", {"file_id": "x", "attributes": {"k" * 65: 1}}, 400, "attributes"),
    ("/files", {"file_id": "x", "attributes": {"n": 2**63}}, 400, "attributes"),  # integers fit in 64 bits
    ("/file_batches", {"files": [{"file_id": "x", "attributes": {"n": -(10**30)}}]}, 400, "files[0].attributes"),
    ("/search", {"query": "x", "filters": {"type": "eq", "key": "n", "value": 10**40}}, 400, "filters.value"),
    ("/search", {"query": "x", "filters": {"type": "in", "key": "n", "value": [1, 2**64]}}, 400, "filters.value"),
])
def test_bad_requests_are_openai_errors_naming_the_field(server, path, body, status, param):
    c = client(server)
    store = c.vector_stores.create(name="errors")
    url = server.base_url + ("/vector_stores" if not path else f"/vector_stores/{store.id}{path}")
    r = httpx.post(url, json=body, headers={"Authorization": f"Bearer {server.keys['paid']}"}, timeout=60)
    assert r.status_code == status, r.text
    assert _error(r)["param"] == param


def test_only_documents_and_only_the_owner(server):
    c, other = client(server), client(server, "free")
    batch_file = upload(c, "in.jsonl", "", purpose="batch")
    store = c.vector_stores.create(name="mine")
    with pytest.raises(openai.BadRequestError) as e:
        c.vector_stores.files.create(vector_store_id=store.id, file_id=batch_file)
    assert e.value.body["code"] == "invalid_file_purpose"
    doc = upload(other, "theirs.txt", "another key's text")
    with pytest.raises(openai.NotFoundError):  # another key's file
        c.vector_stores.files.create(vector_store_id=store.id, file_id=doc)
    for call in (lambda: other.vector_stores.retrieve(store.id), lambda: other.vector_stores.search(store.id, query="x"),
                 lambda: other.vector_stores.delete(store.id)):
        with pytest.raises(openai.NotFoundError):
            call()
    assert store.id not in [s.id for s in other.vector_stores.list()]
    with pytest.raises(openai.BadRequestError):
        c.files.create(file=("x.txt", b"x"), purpose="vision")


def test_listing_stores_pages_them_and_reads_only_the_pages_files(server, monkeypatch):
    c = client(server, "subscriber")
    made = [c.vector_stores.create(name=f"s{i}").id for i in range(5)]
    store = server.app.state.vector_stores
    read: list[str] = []
    real = store.files

    async def files(store_id):
        read.append(store_id)
        return await real(store_id)

    monkeypatch.setattr(store, "files", files)
    page = c.vector_stores.list(limit=2, order="asc")
    assert [s.id for s in page.data] == made[:2] and page.has_more and sorted(read) == sorted(made[:2])
    after = c.vector_stores.list(limit=2, order="asc", after=made[1])
    assert [s.id for s in after.data] == made[2:4] and after.data[0].file_counts.total == 0
    assert [s.id for s in c.vector_stores.list(order="desc")] == made[::-1]  # the SDK follows the pages
    # before: the page just before that store (in the order asked), has_more when there are earlier ones
    back = c.vector_stores.list(limit=2, order="desc", before=made[0])
    assert [s.id for s in back.data] == [made[2], made[1]] and back.has_more
    back = c.vector_stores.list(limit=2, order="desc", before=back.first_id)
    assert [s.id for s in back.data] == [made[4], made[3]] and not back.has_more
    with pytest.raises(openai.BadRequestError):
        c.vector_stores.list(after="vs_nobody")


def test_deleting_a_file_takes_its_text_out_of_every_store(server):
    c = client(server)
    secret, kept = upload(c, "secret.txt", "The vault code is swordfish. " * 8), upload(c, "kept.txt", DOC_B)
    one = c.vector_stores.create(name="one", file_ids=[secret, kept])
    two = c.vector_stores.create(name="two", file_ids=[secret])
    assert {poll(c, s.id, f).status for s, f in ((one, secret), (one, kept), (two, secret))} == {"completed"}
    assert secret in {h.file_id for h in c.vector_stores.search(two.id, query="vault code").data}

    assert c.files.delete(secret).deleted
    assert [f.id for f in c.vector_stores.files.list(one.id)] == [kept]
    assert list(c.vector_stores.files.list(two.id)) == []
    for store in (one, two):
        assert secret not in {h.file_id for h in c.vector_stores.search(store.id, query="vault code", max_num_results=50).data}
    assert c.vector_stores.retrieve(two.id).file_counts.total == 0
    with pytest.raises(openai.NotFoundError):
        c.vector_stores.files.content(secret, vector_store_id=one.id)


def test_an_expired_document_leaves_every_store(server):
    c = client(server)
    doc = c.files.create(file=("soon.txt", b"The launch code is tangerine. " * 8), purpose="assistants",
                         expires_after={"anchor": "created_at", "seconds": 3600}).id
    store = c.vector_stores.create(name="expiring", file_ids=[doc])
    assert poll(c, store.id, doc).status == "completed"
    db = sqlite3.connect(server.services.config.data_dir() / "batches.sqlite3")
    with db:  # an hour on: the runner's sweep (every few seconds) deletes the file
        db.execute("UPDATE files SET expires_at = ? WHERE id = ?", (int(time.time()) - 1, doc))
    db.close()
    deadline = time.time() + 30
    while list(c.vector_stores.files.list(store.id)) and time.time() < deadline:
        time.sleep(0.2)
    assert list(c.vector_stores.files.list(store.id)) == []
    assert c.vector_stores.search(store.id, query="launch code").data == []


def test_file_batches_are_added_followed_and_cancelled_together(server):
    c = client(server)
    store = c.vector_stores.create(name="batches")
    batch = c.vector_stores.file_batches.upload_and_poll(
        store.id, files=[("one.txt", DOC_A.encode()), ("two.md", DOC_B.encode())], poll_interval_ms=100)
    assert batch.object == "vector_store.files_batch" and batch.status == "completed"
    assert (batch.file_counts.completed, batch.file_counts.total) == (2, 2)
    listed = c.vector_stores.file_batches.list_files(batch.id, vector_store_id=store.id, order="asc")
    assert [f.status for f in listed] == ["completed", "completed"]
    assert {h.file_id for h in c.vector_stores.search(store.id, query="fox", max_num_results=50).data} == \
        {f.id for f in listed}

    # files with their own attributes; the indexer stopped, so the cancel finds them all waiting
    a, b = upload(c, "a.txt", DOC_A), upload(c, "b.txt", DOC_B)
    indexer = server.app.state.indexer
    server.wait(indexer.stop())
    try:
        second = c.vector_stores.file_batches.create(store.id, files=[
            {"file_id": a, "attributes": {"n": 1}},
            {"file_id": b, "chunking_strategy": {"type": "static", "static": {"max_chunk_size_tokens": 100,
                                                                              "chunk_overlap_tokens": 0}}}])
        assert second.status == "in_progress" and second.file_counts.in_progress == 2
        cancelled = c.vector_stores.file_batches.cancel(second.id, vector_store_id=store.id)
        assert cancelled.status == "cancelled" and cancelled.file_counts.cancelled == 2
    finally:
        server.wait(indexer.start())
    time.sleep(2.5)  # more than a poll: a cancelled file is never read
    got = c.vector_stores.file_batches.retrieve(second.id, vector_store_id=store.id)
    assert got.status == "cancelled" and got.file_counts.cancelled == 2
    assert c.vector_stores.files.retrieve(a, vector_store_id=store.id).attributes == {"n": 1}
    assert c.vector_stores.files.content(a, vector_store_id=store.id).data == []

    # added again on its own, the file is read
    assert c.vector_stores.files.create_and_poll(file_id=a, vector_store_id=store.id).status == "completed"
    with pytest.raises(openai.NotFoundError) as e:
        c.vector_stores.file_batches.retrieve("vsfb_nope", vector_store_id=store.id)
    assert e.value.body["param"] == "batch_id"


def test_a_file_batch_is_kept_as_it_ended_when_its_files_are_added_again_or_removed(server):
    """A file batch is kept with its files: adding them again (another batch over the same files,
    a re-sync) or taking one out of the store later leaves it found, with the counts it ended
    with; its files list shows those still in the store."""
    c = client(server)
    store = c.vector_stores.create(name="kept batches")
    x, y = upload(c, "x.txt", DOC_A), upload(c, "y.txt", DOC_B)
    first = c.vector_stores.file_batches.create_and_poll(store.id, file_ids=[x, y], poll_interval_ms=100)
    assert first.status == "completed" and (first.file_counts.completed, first.file_counts.total) == (2, 2)
    second = c.vector_stores.file_batches.create_and_poll(store.id, file_ids=[x], poll_interval_ms=100)
    assert second.status == "completed" and second.file_counts.total == 1
    c.vector_stores.files.delete(y, vector_store_id=store.id)
    for batch, total in ((first, 2), (second, 1)):
        again = c.vector_stores.file_batches.retrieve(batch.id, vector_store_id=store.id)
        assert again.status == "completed" and (again.file_counts.completed, again.file_counts.total) == (total, total)
        assert again.created_at == batch.created_at
    assert [f.id for f in c.vector_stores.file_batches.list_files(first.id, vector_store_id=store.id)] == [x]


@pytest.mark.parametrize("body, param", [
    ({}, "file_ids"),
    ({"file_ids": ["x"], "files": [{"file_id": "x"}]}, "file_ids"),
    ({"files": [{"file_id": "x"}], "attributes": {"a": 1}}, "files"),
    ({"file_ids": []}, "file_ids"),
    ({"files": [{"file_id": "x", "chunking_strategy": {"type": "static", "static": {
        "max_chunk_size_tokens": 4000, "chunk_overlap_tokens": 0}}}]}, "files[0].chunking_strategy.static.max_chunk_size_tokens"),
])
def test_bad_file_batches_are_400s(server, body, param):
    c = client(server)
    store = c.vector_stores.create(name="bad batches")
    r = httpx.post(f"{server.base_url}/vector_stores/{store.id}/file_batches", json=body,
                   headers={"Authorization": f"Bearer {server.keys['paid']}"}, timeout=60)
    assert r.status_code == 400 and _error(r)["param"] == param, r.text


def test_a_batch_adds_nothing_unless_every_file_can_be_added(server):
    c = client(server)
    store = c.vector_stores.create(name="all or nothing")
    good = upload(c, "good.txt", DOC_A)
    for file_ids, param in (([good, "file-missing"], "file_ids[1]"), ([good, good], "file_ids[1]")):
        with pytest.raises(openai.APIStatusError) as e:
            c.vector_stores.file_batches.create(store.id, file_ids=file_ids)
        assert e.value.body["param"] == param
    assert c.vector_stores.retrieve(store.id).file_counts.total == 0


def test_a_managed_key_makes_stores_with_the_embedding_models_it_may_use(server):
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {server.keys['admin']}"}, timeout=30) as a:
        chat_only = a.post("/admin/keys", json={"name": "chat only", "tier": "paid", "models": ["tiny-chat"]}).json()
        embedder = a.post("/admin/keys", json={"name": "embedder", "tier": "paid", "models": ["tiny-embed"]}).json()
    limited = openai.OpenAI(base_url=server.base_url, api_key=chat_only["value"], max_retries=0, timeout=60)
    with pytest.raises(openai.BadRequestError) as e:
        limited.vector_stores.create(name="x")
    assert e.value.body["code"] == "no_embedding_model"
    with pytest.raises(openai.NotFoundError) as e:
        limited.vector_stores.create(name="x", extra_body={"model": "tiny-embed"})
    assert e.value.body["param"] == "model"
    allowed = openai.OpenAI(base_url=server.base_url, api_key=embedder["value"], max_retries=0, timeout=60)
    store = allowed.vector_stores.create(name="ok", file_ids=[upload(allowed, "k.txt", DOC_B)])
    assert store.model_extra["model"] == "tiny-embed"
    assert poll(allowed, store.id, allowed.vector_stores.files.list(store.id).data[0].id).status == "completed"


def test_an_expired_store_is_shown_expired_and_refuses_search_and_files(server):
    c = client(server)
    made = c.vector_stores.create(name="short", expires_after={"anchor": "last_active_at", "days": 1})
    assert made.expires_after.days == 1 and made.expires_at == made.last_active_at + 86400
    owner = server.services.keys.lookup(server.keys["paid"]).key_id
    stores = server.app.state.vector_stores
    stored = server.wait(stores.get(made.id, owner))
    server.wait(stores.update(replace(stored, last_active_at=stored.last_active_at - 3600)))  # idle an hour
    c.vector_stores.search(made.id, query="x")  # a search makes it active: its expiry counts from now
    active = c.vector_stores.retrieve(made.id)
    assert active.last_active_at >= time.time() - 5 and active.status == "completed"
    c.vector_stores.search(made.id, query="y")  # again within the minute: not written again
    assert c.vector_stores.retrieve(made.id).last_active_at == active.last_active_at
    stored = server.wait(stores.get(made.id, owner))
    server.wait(server.app.state.vector_stores.update(replace(stored, last_active_at=stored.last_active_at - 2 * 86400)))
    assert c.vector_stores.retrieve(made.id).status == "expired"
    for call in (lambda: c.vector_stores.search(made.id, query="x"),
                 lambda: c.vector_stores.files.create(vector_store_id=made.id, file_id=upload(c, "e.txt", DOC_B)),
                 lambda: c.vector_stores.file_batches.create(made.id, file_ids=[upload(c, "f.txt", DOC_B)])):
        with pytest.raises(openai.BadRequestError) as e:
            call()
        assert e.value.body["code"] == "vector_store_expired"
    with pytest.raises(openai.BadRequestError) as e:
        respond(c, made.id)
    assert e.value.body["param"] == "tools[0].vector_store_ids[0]"
    assert c.vector_stores.update(made.id, expires_after=None).status == "completed"  # no expiry any more
    assert c.vector_stores.search(made.id, query="x").data == []


def test_a_search_does_not_undo_an_update_made_while_it_ran(server, monkeypatch):
    """A search makes its store active by writing its ``last_active_at`` alone, not the store as
    the search read it: a ``vector_stores.update`` made while the search waited (at the gate,
    embedding its query) keeps its name, metadata and expiry."""
    c = client(server)
    made = c.vector_stores.create(name="before", metadata={"v": "old"},
                                  expires_after={"anchor": "last_active_at", "days": 7})
    owner = server.services.keys.lookup(server.keys["paid"]).key_id
    stores = server.app.state.vector_stores
    stored = server.wait(stores.get(made.id, owner))
    server.wait(stores.update(replace(stored, last_active_at=stored.last_active_at - 3600)))  # idle: a search writes it
    reached, go_on = threading.Event(), threading.Event()
    embed = vector_search.serve_embeddings

    async def waiting(*args):
        reached.set()
        await asyncio.to_thread(go_on.wait, 30)
        return await embed(*args)

    monkeypatch.setattr(vector_search, "serve_embeddings", waiting)
    with ThreadPoolExecutor(1) as pool:
        searched = pool.submit(c.vector_stores.search, made.id, query="x")
        assert reached.wait(30)
        c.vector_stores.update(made.id, name="after", metadata={"v": "new"},
                               expires_after={"anchor": "last_active_at", "days": 30})
        go_on.set()
        searched.result(60)
    now = c.vector_stores.retrieve(made.id)
    assert (now.name, now.metadata, now.expires_after.days) == ("after", {"v": "new"}, 30)
    assert now.last_active_at >= time.time() - 5  # made active by the search all the same


def test_a_store_whose_model_left_tiers_yaml_is_a_clean_503(server):
    c = client(server)
    owner = server.services.keys.lookup(server.keys["paid"]).key_id
    orphan = VectorStore("vs_orphan", owner, int(time.time()), "orphan", "gone-embed")
    server.wait(server.app.state.vector_stores.create(orphan))
    with pytest.raises(openai.InternalServerError) as e:
        c.vector_stores.search(orphan.id, query="x")
    assert e.value.status_code == 503 and e.value.body["code"] == "model_unavailable"
    with pytest.raises(openai.InternalServerError):  # its chunk sizes cannot be worked out either
        c.vector_stores.files.create(vector_store_id=orphan.id, file_id=upload(c, "o.txt", DOC_B))
    assert c.vector_stores.retrieve(orphan.id).file_counts.total == 0


def test_the_indexer_outlives_a_store_that_fails(server):
    """A claim that raises (the store down) is logged and tried again at the next turn."""
    store = server.app.state.vector_stores
    real, failures = store.claim, []

    async def failing(*args):
        if len(failures) < 2:
            failures.append(args)
            raise OSError("the store is down")
        return await real(*args)

    store.claim = failing
    try:
        c = client(server)
        doc = upload(c, "after.txt", DOC_B)
        vs = c.vector_stores.create(name="outlived", file_ids=[doc])
        assert poll(c, vs.id, doc).status == "completed" and len(failures) == 2
    finally:
        del store.claim


def test_a_file_half_read_at_shutdown_is_the_next_claimers_at_once(tmp_path):
    """An indexer stopped (a shutdown) while it reads a file gives the file up: the next process
    to look claims it at once, where a crash leaves it to wait out its lease (it waited the whole
    60 s after a quick restart). The read is a stand-in that waits, so the stop lands inside it."""
    from gateway.vector_indexer import LEASE_S, Indexer

    async def go() -> tuple[list[StoreFile], list[StoreFile]]:
        store = SQLiteVectorStores(tmp_path / "vs.sqlite3")
        await store.open()
        try:
            await store.create(VectorStore("vs_a", "k", 10, "a", "tiny-embed"))
            await store.add_file(StoreFile("vs_a", "file-1", "t1", "k", "paid", 100, "a.txt", 80, 40))
            indexer, reading = Indexer(None, store, None), asyncio.Event()

            async def read(file):
                reading.set()
                await asyncio.Event().wait()

            indexer._read = read
            [file] = await store.claim(time.time(), LEASE_S, 1)
            work = asyncio.create_task(indexer._index(file))
            await reading.wait()
            held = await store.claim(time.time(), LEASE_S, 1)  # while it reads: its own
            work.cancel()
            await asyncio.gather(work, return_exceptions=True)
            return held, await store.claim(time.time() + 0.01, LEASE_S, 1)
        finally:
            await store.close()

    held, after = asyncio.run(go())
    assert held == [] and [f.id for f in after] == ["file-1"]


def test_a_files_lease_is_renewed_while_its_document_is_parsed(tmp_path, monkeypatch):
    """A parse in a thread that outlasts the lease (a large PDF: minutes) renews it meanwhile, so no
    other process takes the file and parses it again (it did after 60 s on a shared store)."""
    import gateway.vector_indexer as vector_indexer
    from gateway.documents import Unreadable
    from gateway.vector_indexer import Indexer

    monkeypatch.setattr(vector_indexer, "LEASE_S", 2.0)

    def slow_parse(content: bytes, filename: str) -> str:
        time.sleep(5.0)  # two and a half leases long
        raise Unreadable("invalid_file", "stand-in")

    monkeypatch.setattr(vector_indexer, "document_text", slow_parse)

    class Files:
        async def file_content(self, file_id: str) -> bytes:
            return b"text"

    async def go() -> list[StoreFile]:
        store = SQLiteVectorStores(tmp_path / "vs.sqlite3")
        await store.open()
        try:
            await store.create(VectorStore("vs_a", "k", 10, "a", "tiny-embed"))
            await store.add_file(StoreFile("vs_a", "file-1", "t1", "k", "paid", 100, "a.txt", 80, 40))
            [file] = await store.claim(time.time(), 2.0, 1)
            reading = asyncio.create_task(Indexer(None, store, Files())._read(file))
            await asyncio.sleep(3.5)  # past the lease it was claimed with (renewals every 0.67 s meanwhile)
            taken = await store.claim(time.time(), 2.0, 1)
            with pytest.raises(Unreadable):
                await reading
            return taken
        finally:
            await store.close()

    assert asyncio.run(go()) == []


def test_a_file_a_dead_process_held_is_read_again(server):
    """Another process claimed the file and died: once its lease ends, this server's indexer takes
    the file and reads it (nothing accepted is lost), not before (the lease outlasts two of the
    indexer's polls)."""
    c = client(server)
    doc = upload(c, "late.txt", DOC_B)
    store = c.vector_stores.create(name="resumed")

    async def add_and_claim_as_a_dead_process() -> float | None:
        other = SQLiteVectorStores(server.services.config.data_dir() / "batches.sqlite3")
        await other.open()
        try:
            owner = (await other.list(server.services.keys.lookup(server.keys["paid"]).key_id))[0].owner
            await other.add_file(StoreFile(store.id, doc, "dead", owner, "paid", int(time.time()), "late.txt", 100, 20))
            now = time.time()
            taken = await other.claim(now, LEASE, 10)
            return now + LEASE if [t.id for t in taken] == [doc] else None  # None: this server's indexer was first
        finally:
            await other.close()

    until = None
    for _ in range(5):  # the server's indexer polls every 2 s: claiming first almost always wins
        until = asyncio.run(add_and_claim_as_a_dead_process())
        if until is not None:
            break
    assert until is not None
    assert c.vector_stores.files.retrieve(doc, vector_store_id=store.id).status == "in_progress"
    f = poll(c, store.id, doc)
    assert f.status == "completed" and time.time() >= until
    assert len(c.vector_stores.files.content(doc, vector_store_id=store.id).data) > 1


def test_two_processes_on_redis_share_the_stores(tiny_embed, tmp_path, redis_url):
    """Two servers on one Redis: a store made and filled through one is read by either indexer,
    once, and searched through the other (its own copy loaded from Redis, then again once a file
    is added through the first)."""
    config = write_config(tmp_path, {"tiny-embed": ("embed", tiny_embed)}, f"batch:\n  store: {redis_url}\n")
    a, b = start_server(config), start_server(config)
    try:
        ca, cb = client(a), client(b)
        first = upload(ca, "first.txt", DOC_B)
        store = ca.vector_stores.create(name="shared", file_ids=[first])
        assert poll(cb, store.id, first).status == "completed"
        hit = cb.vector_stores.search(store.id, query="lazy dog").data[0]
        assert hit.file_id == first
        second = upload(ca, "second.md", DOC_A)
        cb.vector_stores.files.create(vector_store_id=store.id, file_id=second)  # the file is a's key's: same key
        assert poll(ca, store.id, second).status == "completed"
        target = ca.vector_stores.files.content(second, vector_store_id=store.id).data[0].text
        assert cb.vector_stores.search(store.id, query=target, max_num_results=1).data[0].file_id == second
        read = [a.app.state.indexer.ended["completed"], b.app.state.indexer.ended["completed"]]
        assert sum(read) == 2  # each file read once, by one of them
    finally:
        a.stop()
        b.stop()


# -- the pure parts ------------------------------------------------------------------------------------


@pytest.mark.parametrize("n, size, overlap, want", [
    (0, 4, 2, []), (3, 4, 2, [(0, 3)]), (4, 4, 0, [(0, 4)]), (8, 4, 0, [(0, 4), (4, 8)]),
    (10, 4, 2, [(0, 4), (2, 6), (4, 8), (6, 10)]), (9, 4, 1, [(0, 4), (3, 7), (6, 9)]),
])
def test_windows(n, size, overlap, want):
    assert windows(n, size, overlap) == want


def _cut_whole(tok, text: str, size: int, overlap: int) -> list[tuple[str, list[int]]]:
    """The reference: the whole text tokenized at once, then windowed."""
    enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
    ids, offsets = enc["input_ids"], enc["offset_mapping"]
    return [(text[offsets[s][0]:offsets[e - 1][1]], [tok.cls_token_id, *ids[s:e], tok.sep_token_id])
            for s, e in windows(len(ids), size, overlap)]


@pytest.mark.parametrize("text", [
    DOC_A, DOC_B * 3, "  leading and trailing spaces  ", "ünïcödé wörds, and\ttabs\nand newlines " * 40,
    "nowhitespaceatallinthisverylongrunofletters" * 30 + " then words " * 20, "", "   ", "one",
    '[{"key":"alpha","n":12},{"key":"béta","n":3.5}]' * 12])
@pytest.mark.parametrize("size, overlap", [(8, 3), (126, 63), (100, 0), (5, 2)])
def test_cutting_piece_by_piece_is_cutting_the_whole(tiny_embed, text, size, overlap):
    """A long text is tokenized in pieces (to bound memory): the chunks are the whole text's."""
    from workers.base import ModelSpec
    from workers.embed import EmbedWorker

    encoder = EmbedWorker.reader(ModelSpec("tiny-embed", "embed", tiny_embed))
    want = _cut_whole(AutoTokenizer.from_pretrained(tiny_embed), text, size, overlap)
    for piece in (16, 37, 1 << 16):
        assert list(encoder.cut(text, size, overlap, segment=piece)) == want, piece


def test_a_text_without_whitespace_is_still_read_in_pieces():
    """Compact JSON (or minified code) has no whitespace to cut before: it is cut where a word ends
    (before its punctuation), and a run of word characters at ``longest``, so no piece is the whole
    file (3 MB of it held ~2 GiB of tokens at once)."""
    from workers.embed import _pieces

    text = json.dumps([{"k": i, "v": "x"} for i in range(2000)], separators=(",", ":"))
    pieces = list(_pieces(text, 64))
    assert pieces[0][0] == 0 and pieces[-1][1] == len(text) and all(a[1] == b[0] for a, b in zip(pieces, pieces[1:]))
    assert max(end - start for start, end in pieces) <= 128
    assert all(text[end] in ',:}"]' for _, end in pieces[:-1])  # each ends where a word does
    assert [end - start for start, end in _pieces("ab" * 1000, 64, longest=500)] == [500] * 4


def test_cutting_stops_past_the_token_limit(tiny_embed):
    from workers.base import ModelSpec
    from workers.embed import EmbedWorker, InputError

    encoder = EmbedWorker.reader(ModelSpec("tiny-embed", "embed", tiny_embed))
    assert len(list(encoder.cut(DOC_B, 8, 0, max_tokens=10_000))) > 1
    with pytest.raises(InputError):
        list(encoder.cut(DOC_B * 10, 8, 0, max_tokens=100, segment=64))


def test_a_file_past_the_token_limit_fails(server, monkeypatch):
    import gateway.vector_indexer

    monkeypatch.setattr(gateway.vector_indexer, "MAX_FILE_TOKENS", 50)
    c = client(server)
    doc = upload(c, "long.txt", DOC_A)
    store = c.vector_stores.create(name="long", file_ids=[doc])
    f = poll(c, store.id, doc)
    assert f.status == "failed" and f.last_error.code == "invalid_file" and "50" in f.last_error.message


@pytest.mark.parametrize("strategy, room, want", [
    (None, 510, (510, 255)), (None, 8190, (800, 400)), ({"type": "auto"}, 126, (126, 63)),
    ({"type": "static", "static": {"max_chunk_size_tokens": 100, "chunk_overlap_tokens": 50}}, 126, (100, 50)),
])
def test_chunk_sizes(strategy, room, want):
    assert chunk_sizes(ChunkingStrategy(**strategy) if strategy else None, room, "c") == want


def test_chunk_sizes_refuse_what_the_model_cannot_read():
    big = ChunkingStrategy(**{"type": "static", "static": {"max_chunk_size_tokens": 200, "chunk_overlap_tokens": 0}})
    with pytest.raises(APIError) as e:
        chunk_sizes(big, 126, "c")
    assert e.value.param == "c.static.max_chunk_size_tokens" and e.value.code == "chunk_too_large"


ATTRS = {"lang": "en", "year": 2024, "score": 0.5, "draft": False}


@pytest.mark.parametrize("f, want", [
    ({"type": "eq", "key": "lang", "value": "en"}, True),
    ({"type": "eq", "key": "lang", "value": "de"}, False),
    ({"type": "ne", "key": "lang", "value": "de"}, True),
    ({"type": "ne", "key": "missing", "value": "de"}, False),
    ({"type": "gt", "key": "year", "value": 2023}, True),
    ({"type": "gt", "key": "year", "value": 2024}, False),
    ({"type": "gte", "key": "year", "value": 2024}, True),
    ({"type": "lt", "key": "score", "value": 0.75}, True),
    ({"type": "lte", "key": "score", "value": 0.25}, False),
    ({"type": "gt", "key": "lang", "value": 3}, False),  # a string against a number
    ({"type": "eq", "key": "draft", "value": False}, True),
    ({"type": "eq", "key": "draft", "value": 0}, False),  # a boolean is not a number
    ({"type": "in", "key": "lang", "value": ["de", "en"]}, True),
    ({"type": "nin", "key": "lang", "value": ["de", "en"]}, False),
    ({"type": "nin", "key": "lang", "value": ["de"]}, True),
    ({"type": "and", "filters": [{"type": "eq", "key": "lang", "value": "en"},
                                 {"type": "lt", "key": "year", "value": 2000}]}, False),
    ({"type": "or", "filters": [{"type": "eq", "key": "lang", "value": "fr"},
                                {"type": "and", "filters": [{"type": "gte", "key": "year", "value": 2024},
                                                            {"type": "eq", "key": "draft", "value": False}]}]}, True),
])
def test_filters(f, want):
    check_filter(f)
    assert matches(f, ATTRS) is want


def _chunks(file_id: str, texts: list[str], vectors: list[list[float]], **attrs) -> Chunks:
    f = StoreFile("vs", file_id, "t", "k", "paid", 0, f"{file_id}.txt", 100, 0, attributes=attrs)
    return Chunks(f, texts, np.array(vectors, np.float32))


def test_rank_orders_by_the_best_query_and_filters_and_cuts():
    chunks = [_chunks("f1", ["east", "north"], [[1, 0], [0, 2]], lang="en"),
              _chunks("f2", ["west", "south"], [[-3, 0], [0, -1]], lang="de"), _chunks("f3", [], [])]
    m, files = Matrix.of(chunks), {c.file.id: c.file for c in chunks}

    def texts(queries, filters=None, limit=10, threshold=0.0, files=files):
        return [(t, s) for s, _, t in rank(m, files, np.array(queries, np.float32), filters, limit, threshold)]

    assert texts([[1, 0]]) == [("east", 1.0), ("north", 0.5), ("south", 0.5), ("west", 0.0)]
    assert [t for t, _ in texts([[1, 0], [0, -1]], limit=2)] == ["east", "south"]  # each by its best query; cut to 2
    assert [t for t, _ in texts([[1, 0]], {"type": "eq", "key": "lang", "value": "de"})] == ["south", "west"]
    assert [t for t, _ in texts([[1, 0]], threshold=0.6)] == ["east"]
    assert [t for t, _ in texts([[1, 0]], files={"f2": files["f2"]})] == ["south", "west"]  # f1 removed since loaded
    changed = {**files, "f1": replace(files["f1"], attributes={"lang": "de"})}  # the attributes now, not as loaded
    assert [t for t, _ in texts([[1, 0]], {"type": "eq", "key": "lang", "value": "de"}, files=changed)] == \
        ["east", "north", "south", "west"]
    assert rank(Matrix.of([]), {}, np.array([[1, 0]], np.float32), None, 10, 0.0) == []


def _bm25(texts: list[str], query: str, k1=1.2, b=0.75) -> list[float]:
    """BM25 written out plainly (Robertson's idf with +1, as Lucene's)."""
    import math
    import re

    docs = [re.findall(r"\w+", t.lower()) for t in texts]
    mean = max(sum(map(len, docs)) / len(docs), 1.0)
    out = []
    for d in docs:
        score = 0.0
        for word in set(re.findall(r"\w+", query.lower())):
            df = sum(word in other for other in docs)
            if df:
                tf = d.count(word)
                score += math.log(1 + (len(docs) - df + 0.5) / (df + 0.5)) * tf * (k1 + 1) / (
                    tf + k1 * (1 - b + b * len(d) / mean))
        out.append(score)
    return out


@pytest.mark.parametrize("query", ["fox", "the lazy Dog", "Über naïve", "absent words", "dog dog fox"])
def test_words_score_as_bm25(query):
    texts = ["The quick brown fox", "the lazy dog sleeps; the DOG dreams", "über naïve café", "", "fox and dog, fox"]
    assert Words.of(texts).scores(query).tolist() == pytest.approx(_bm25(texts, query), rel=1e-5)


def test_hybrid_rank_fuses_both_rankings():
    chunks = [_chunks("f1", ["apple pie", "banana split"], [[1, 0], [0.9, 0.1]]),
              _chunks("f2", ["cherry apple", "durian"], [[0, 1], [0.5, 0.5]])]
    m, files = Matrix.of(chunks), {c.file.id: c.file for c in chunks}
    q = np.array([[1, 0]], np.float32)

    def order(weights, threshold=0.0):
        return [(t, round(s, 6)) for s, _, t in rank(m, files, q, None, 10, threshold, weights, ["apple"])]

    by_meaning = [t for t, _ in order(None)]
    assert by_meaning == ["apple pie", "banana split", "durian", "cherry apple"]
    assert [t for t, _ in order((1, 0))] == by_meaning  # text weight 0: the semantic order
    top = order((1, 1))
    assert top[0] == ("apple pie", 1.0)  # first in both rankings
    # cherry apple: last by meaning (4th) but a word match (2nd): above the two without the word
    assert [t for t, _ in top] == ["apple pie", "cherry apple", "banana split", "durian"]
    k = 60
    assert dict(top)["cherry apple"] == pytest.approx((1 / (k + 4) + 1 / (k + 2)) / (2 / (k + 1)), abs=1e-6)
    assert [t for t, _ in order((0, 1))][:2] == ["apple pie", "cherry apple"]
    assert [t for t, _ in order((0, 1), threshold=0.01)] == ["apple pie", "cherry apple"]  # no word, no text score
    two = rank(m, files, np.array([[1, 0], [0, 1]], np.float32), None, 10, 0.01, (0, 1), ["apple", "durian"])
    assert {t for _, _, t in two} == {"apple pie", "cherry apple", "durian"}  # each chunk by its best query


def test_the_shelf_loads_a_store_again_only_when_its_files_changed(tmp_path):
    async def run():
        store = SQLiteVectorStores(tmp_path / "x.sqlite3")
        await store.open()
        loads, reads = [], []
        real_chunks, real_files = store.chunks, store.files

        async def counted(store_id):
            loads.append(store_id)
            return await real_chunks(store_id)

        async def read(store_id):
            reads.append(store_id)
            return await real_files(store_id)

        store.chunks, store.files = counted, read
        try:
            await store.create(VectorStore("vs", "k", 0, "n", "m"))
            for fid in ("f1", "f2"):
                await store.add_file(StoreFile("vs", fid, "t", "k", "paid", 0, "x", 100, 0))
            f1, f2 = await store.claim(1.0, 60, 10)
            await store.finish(f1, ["a", "b"], np.eye(2, dtype=np.float32))
            shelf = Shelf(1 << 20)
            m, files = await shelf.load(store, "vs")
            assert m.ids == ["f1"] and set(files) == {"f1"} and len(loads) == 1
            assert (await shelf.load(store, "vs"))[0] is m and (len(loads), len(reads)) == (1, 1)  # one version read
            await store.set_attributes("vs", "f1", {"x": 1})  # attributes come fresh, the matrix stays
            m2, files = await shelf.load(store, "vs")
            assert m2 is m and files["f1"].attributes == {"x": 1} and (len(loads), len(reads)) == (1, 2)
            await store.update(VectorStore("vs", "k", 0, "renamed", "m", last_active_at=5))  # not its files
            assert (await shelf.load(store, "vs"))[0] is m and (len(loads), len(reads)) == (1, 2)
            await store.finish(f2, ["c"], np.ones((1, 2), np.float32))  # a file read: loaded again
            m3, _ = await shelf.load(store, "vs")
            assert m3.ids == ["f1", "f2"] and len(loads) == 2
            assert np.allclose(np.linalg.norm(m3.vectors, axis=1), 1.0)
            await store.create(VectorStore("vs2", "k", 0, "n", "m"))
            await store.add_file(StoreFile("vs2", "g", "t", "k", "paid", 0, "x", 100, 0))
            [g] = await store.claim(2.0, 60, 10)
            await store.finish(g, ["d"] * 100, np.ones((100, 2), np.float32))
            small = Shelf(m3.vectors.nbytes + 10)  # room for one store: the least recent goes
            await small.load(store, "vs")
            await small.load(store, "vs2")
            assert [k[1] for k in small._kept] == ["vs2"]
        finally:
            await store.close()

    asyncio.run(run())


# -- file_search in the Responses API ------------------------------------------------------------------


@pytest.fixture(scope="module")
def searchable(server):
    """A vector store with DOC_A and DOC_B, both read."""
    c = client(server)
    store = c.vector_stores.create(name="for responses", file_ids=[upload(c, "a.md", DOC_A), upload(c, "b.txt", DOC_B)])
    deadline = time.time() + 60
    while c.vector_stores.retrieve(store.id).file_counts.completed < 2:
        assert time.time() < deadline
        time.sleep(0.1)
    return store.id


QUESTION = "Where does the lazy dog sleep?"


def respond(c, store_id, **kw):
    kw.setdefault("tools", [{"type": "file_search", "vector_store_ids": [store_id], "max_num_results": 3}])
    kw.setdefault("input", QUESTION)
    kw.setdefault("model", "tiny-chat")
    return c.responses.create(max_output_tokens=6, temperature=0, **kw)


def test_file_search_runs_before_the_model_which_reads_what_it_found(server, searchable, tiny_chat):
    from gateway.responses import _results_text

    c = client(server)
    # every chunk of the store asked for: together they are longer than half the context whichever
    # rank first (with 3, the repeated text's near-equal chunks once ranked a short tail chunk in,
    # and all three fitted)
    tools = [{"type": "file_search", "vector_store_ids": [searchable], "max_num_results": 10}]
    r = respond(c, searchable, include=["file_search_call.results"], tools=tools)
    search, message = r.output
    assert search.type == "file_search_call" and search.status == "completed" and search.queries == [QUESTION]
    assert message.type == "message" and r.status in ("completed", "incomplete")
    # the store's own search's best hits, in order, as many as fit in half the chat model's context
    want = c.vector_stores.search(searchable, query=QUESTION, max_num_results=10).data
    tok = AutoTokenizer.from_pretrained(tiny_chat)
    sizes = [len(tok(w.content[0].text, add_special_tokens=False)["input_ids"]) for w in want]
    fit = next(k for k in range(len(sizes), -1, -1) if sum(sizes[:k]) <= 512 // 2)  # tiny-chat: 512 positions
    assert 1 <= fit < len(want) and len(search.results) == fit
    assert [(h.file_id, h.text) for h in search.results] == [(w.file_id, w.content[0].text) for w in want][:fit]
    assert [h.score for h in search.results] == pytest.approx([w.score for w in want][:fit], abs=1e-6)
    assert {h.filename for h in search.results} <= {"a.md", "b.txt"}

    # what the model read: exactly the chat it would read with the excerpts after the question
    results = [h.model_dump() for h in search.results]
    chat = c.chat.completions.create(model="tiny-chat", temperature=0, max_tokens=6, messages=[
        {"role": "user", "content": f"{QUESTION}\n\n{_results_text(results)}"}])
    assert r.usage.input_tokens == chat.usage.prompt_tokens
    assert message.content[0].text == chat.choices[0].message.content
    plain = c.responses.create(model="tiny-chat", input=QUESTION, max_output_tokens=6, temperature=0)
    assert r.usage.input_tokens > plain.usage.input_tokens + 50  # the excerpts, read
    counted = c.responses.input_tokens.count(model="tiny-chat", input=QUESTION, tools=tools)
    assert counted.input_tokens == r.usage.input_tokens  # input_tokens searches too

    # the excerpts are read with this turn only: a continued response reads the conversation as it was
    nxt = c.responses.input_tokens.count(model="tiny-chat", input="And then?", previous_response_id=r.id)
    again = c.chat.completions.create(model="tiny-chat", temperature=0, max_tokens=1, messages=[
        {"role": "user", "content": QUESTION}, {"role": "assistant", "content": message.content[0].text},
        {"role": "user", "content": "And then?"}])
    assert nxt.input_tokens == again.usage.prompt_tokens
    # instructions stay the system message's; text parts get the excerpts as one more part
    parts = respond(c, searchable, instructions="Be brief.", input=[
        {"role": "user", "content": [{"type": "input_text", "text": QUESTION}]}])
    assert parts.usage.input_tokens > plain.usage.input_tokens + 50

    # without include the results are not shown; tool_choice none does not search
    assert respond(c, searchable).output[0].results is None
    assert [i.type for i in respond(c, searchable, tool_choice="none").output] == ["message"]
    forced = respond(c, searchable, tool_choice={"type": "file_search"})
    assert forced.output[0].type == "file_search_call" and forced.tool_choice.type == "file_search"
    hybrid = respond(c, searchable, include=["file_search_call.results"], tools=[
        {"type": "file_search", "vector_store_ids": [searchable], "max_num_results": 1,
         "ranking_options": {"hybrid_search": {"embedding_weight": 0, "text_weight": 1}}}])
    assert hybrid.output[0].results[0].score == 1.0 and "lazy dog" in hybrid.output[0].results[0].text


def test_a_store_named_twice_is_searched_once(server, searchable):
    """Its hits were each found, shown and read by the model twice."""
    c = client(server)
    tools = [{"type": "file_search", "vector_store_ids": [searchable, searchable], "max_num_results": 10}]
    twice = respond(c, searchable, include=["file_search_call.results"], tools=tools).output[0].results
    alone = [{**tools[0], "vector_store_ids": [searchable]}]
    once = respond(c, searchable, include=["file_search_call.results"], tools=alone)
    assert [(h.file_id, h.text) for h in twice] == [(h.file_id, h.text) for h in once.output[0].results]
    assert len({(h.file_id, h.text) for h in twice}) == len(twice) > 1


def test_file_search_queries_written_by_the_model(server, searchable):
    """``engine.search_queries: model``: the model writes the queries in a turn of its own (a
    forced call of a ``file_search`` function, greedy), they are what is searched for, and the
    response's usage counts both turns. Checked against the same two turns asked by hand."""
    from gateway.responses import MAX_QUERIES, QUERY_CHARS, QUERY_TOKENS, SEARCH_DESCRIPTION, _results_text

    c = client(server)
    instructions = "Answer from the files."
    r = respond(c, searchable, model="tiny-chat-queries", instructions=instructions, include=["file_search_call.results"],
                tool_choice={"type": "file_search"})
    search, message = r.output
    assert search.type == "file_search_call" and 1 <= len(search.queries) <= MAX_QUERIES
    assert all(q.strip() and len(q) <= QUERY_CHARS for q in search.queries) and search.queries != [QUESTION]

    messages = [{"role": "system", "content": instructions}, {"role": "user", "content": QUESTION}]
    queries_schema = {"type": "object", "additionalProperties": False, "required": ["queries"], "properties": {
        "queries": {"type": "array", "minItems": 1, "maxItems": MAX_QUERIES,
                    "items": {"type": "string", "minLength": 1, "maxLength": QUERY_CHARS}}}}
    by_hand = c.chat.completions.create(
        model="tiny-chat-queries", messages=messages, temperature=0, max_tokens=QUERY_TOKENS,
        tools=[{"type": "function", "function": {"name": "file_search", "description": SEARCH_DESCRIPTION,
                                                 "parameters": queries_schema}}],
        tool_choice={"type": "function", "function": {"name": "file_search"}})
    (call,) = by_hand.choices[0].message.tool_calls
    written = json.loads(call.function.arguments)["queries"]  # strict JSON (workers.grammar mends bounded strings)
    assert search.queries == list(dict.fromkeys(q.strip() for q in written if q.strip()))
    # what they found, as the server's own search finds it for them (each cut to the embedding model's
    # context: a random model's queries run long, which the search endpoint would refuse)
    from gateway.auth import Caller, key_id
    from gateway.vector_search import search_stores
    owner = key_id(server.keys["paid"])
    store = server.wait(server.services.vector_stores.get(searchable, owner))
    want = server.wait(search_stores(server.services, server.services.vector_stores, Caller("paid", owner), [store],
                                     search.queries, None, 3, 0.0, cut=True))
    assert search.results and [(h.file_id, h.text) for h in search.results] == [(f.id, t) for _, f, t in want][:len(search.results)]
    answer = c.chat.completions.create(model="tiny-chat-queries", temperature=0, max_tokens=6, messages=[
        messages[0], {"role": "user", "content": f"{QUESTION}\n\n{_results_text([h.model_dump() for h in search.results])}"}])
    assert message.content[0].text == answer.choices[0].message.content
    assert r.usage.input_tokens == by_hand.usage.prompt_tokens + answer.usage.prompt_tokens
    assert r.usage.output_tokens == by_hand.usage.completion_tokens + answer.usage.completion_tokens

    # counting input tokens runs no model (no prompt tokens metered): it searches for the message's text
    def prompt_tokens() -> float:
        text = httpx.get(f"{server.url}/metrics", timeout=30).text
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith("tiergate_tokens_total")
                   and 'model="tiny-chat-queries"' in line and 'type="prompt"' in line)

    before = prompt_tokens()
    counted = c.responses.input_tokens.count(model="tiny-chat-queries", input=QUESTION, tools=[
        {"type": "file_search", "vector_store_ids": [searchable], "max_num_results": 3}])
    assert prompt_tokens() == before > 0
    plain = respond(c, searchable, model="tiny-chat", include=["file_search_call.results"])
    assert counted.input_tokens == plain.usage.input_tokens and plain.output[0].queries == [QUESTION]


def test_a_background_response_is_queued_before_the_model_writes_its_queries(server, searchable, monkeypatch):
    """A background response is answered ``queued`` at once: the turn in which the model writes
    its search queries runs in the response's run, not in the request (here held until the
    response is answered). What cannot be searched is still refused when it is asked."""
    import threading

    import gateway.responses

    c = client(server)
    release, started = threading.Event(), threading.Event()
    written = gateway.responses.written_queries

    async def held(*args, **kwargs):
        started.set()
        await asyncio.to_thread(release.wait, 60)
        return await written(*args, **kwargs)

    monkeypatch.setattr(gateway.responses, "written_queries", held)
    try:
        r = respond(c.with_options(timeout=20), searchable, model="tiny-chat-queries", background=True,
                    instructions="Answer from the files.", tool_choice={"type": "file_search"})
        assert r.status == "queued" and not release.is_set()
    finally:
        release.set()
    assert started.wait(30)  # its run did write them
    deadline = time.time() + 60
    while r.status in ("queued", "in_progress"):
        assert time.time() < deadline
        time.sleep(0.1)
        r = c.responses.retrieve(r.id)
    search = r.output[0]
    assert r.status in ("completed", "incomplete") and search.type == "file_search_call" and search.queries != [QUESTION]
    with pytest.raises(openai.NotFoundError) as err:  # checked when asked, as a response in the foreground is
        respond(c, "vs_nope", model="tiny-chat-queries", background=True)
    assert err.value.body["param"] == "tools[0].vector_store_ids[0]"


def test_a_query_over_the_embedding_models_context_is_refused_or_cut(server, searchable):
    """``POST /v1/vector_stores/{id}/search`` refuses a query the embedding model cannot read
    whole (400 naming it); the queries a chat model wrote for a ``file_search`` are cut to fit."""
    from gateway.auth import Caller, key_id
    from gateway.errors import APIError
    from gateway.vector_search import search_stores

    c = client(server)
    long = "fox " * 200  # tiny-embed reads 128 tokens
    with pytest.raises(openai.BadRequestError) as err:
        c.vector_stores.search(searchable, query=long)
    assert err.value.body["code"] == "context_length_exceeded"
    owner = key_id(server.keys["paid"])
    store = server.wait(server.services.vector_stores.get(searchable, owner))
    args = (server.services, server.services.vector_stores, Caller("paid", owner), [store], [long], None, 3, 0.0)
    with pytest.raises(APIError):
        server.wait(search_stores(*args))
    cut = server.wait(search_stores(*args, cut=True))
    # the same as searching for the foxes that fit: the query cut to the model's context, as text
    from gateway.vector_search import encoder_of
    encoder = server.wait(encoder_of(server.services, store.model))
    kept = encoder.tokenizer(long, truncation=True, max_length=encoder.config.context_length)["input_ids"]
    fitting = encoder.tokenizer.decode(kept, skip_special_tokens=True)
    assert 0 < fitting.count("fox") < 200
    whole = server.wait(search_stores(*args[:4], [fitting], *args[5:]))
    assert [(f.id, t) for _, f, t in cut] == [(f.id, t) for _, f, t in whole]
    assert [score for score, _, _ in cut] == pytest.approx([score for score, _, _ in whole], abs=1e-6)


def test_file_search_streams_its_events_first(server, searchable):
    c = client(server)
    events = list(respond(c, searchable, stream=True, include=["file_search_call.results"]))
    kinds = [e.type for e in events]
    start = kinds.index("response.file_search_call.in_progress")
    assert kinds[start - 1] == "response.output_item.added" and events[start - 1].item.type == "file_search_call"
    assert kinds[start:start + 4] == ["response.file_search_call.in_progress", "response.file_search_call.searching",
                                      "response.file_search_call.completed", "response.output_item.done"]
    assert events[start - 1].output_index == 0 and events[start + 3].item.results
    added = [e for e in events if e.type == "response.output_item.added"]
    assert [(e.output_index, e.item.type) for e in added] == [(0, "file_search_call"), (1, "message")]
    done = events[-1].response
    assert [i.type for i in done.output] == ["file_search_call", "message"]
    assert [e.sequence_number for e in events] == list(range(len(events)))

    # in the background too, after response.in_progress
    kinds = [e.type for e in respond(c, searchable, stream=True, background=True)]
    assert kinds.index("response.in_progress") < kinds.index("response.file_search_call.completed") \
        < kinds.index("response.output_text.done")


def test_file_search_in_background_and_continued(server, searchable):
    c = client(server)
    r = respond(c, searchable, background=True)
    deadline = time.time() + 60
    while r.status in ("queued", "in_progress"):
        assert time.time() < deadline
        time.sleep(0.1)
        r = c.responses.retrieve(r.id)
    assert r.status in ("completed", "incomplete") and [i.type for i in r.output] == ["file_search_call", "message"]
    # continued by id, and with its output sent back as input items (as the Agents SDK does)
    later = respond(c, searchable, previous_response_id=r.id)
    assert later.output[0].type == "file_search_call"
    back = c.responses.create(model="tiny-chat", max_output_tokens=4, temperature=0, input=[
        {"role": "user", "content": QUESTION}, *[i.model_dump(exclude_none=True) for i in r.output],
        {"role": "user", "content": "And the fox?"}],
        tools=[{"type": "file_search", "vector_store_ids": [searchable]}])
    assert back.output[0].queries == ["And the fox?"]
    items = c.responses.input_items.list(back.id, order="asc").data
    assert [i.type for i in items] == ["message", "file_search_call", "message", "message"]


def test_file_search_in_a_batch_line(server, searchable):
    """A /v1/responses line of the Batch API searches too (at the batch tier, as the line runs)."""
    import io
    import json

    c = client(server)
    line = {"custom_id": "q1", "method": "POST", "url": "/v1/responses",
            "body": {"model": "tiny-chat", "input": QUESTION, "max_output_tokens": 3, "temperature": 0,
                     "include": ["file_search_call.results"],
                     "tools": [{"type": "file_search", "vector_store_ids": [searchable], "max_num_results": 1}]}}
    f = c.files.create(file=("in.jsonl", io.BytesIO((json.dumps(line) + "\n").encode())), purpose="batch")
    batch = c.batches.create(input_file_id=f.id, endpoint="/v1/responses", completion_window="24h")
    deadline = time.time() + 60
    while (batch := c.batches.retrieve(batch.id)).status not in ("completed", "failed", "expired", "cancelled"):
        assert time.time() < deadline
        time.sleep(0.2)
    assert batch.status == "completed" and batch.request_counts.completed == 1
    out = json.loads(c.files.content(batch.output_file_id).text)
    search = out["response"]["body"]["output"][0]
    assert search["type"] == "file_search_call" and search["queries"] == [QUESTION] and search["results"]


def test_the_demo_script_runs_end_to_end(server, tmp_path):
    """scripts/file_search_demo.py (the README's way to try it) against a real server, on a text
    file and a PDF."""
    import re
    import subprocess
    import sys
    from pathlib import Path

    (tmp_path / "animals.txt").write_text(DOC_B)
    (tmp_path / "guide.pdf").write_bytes(tiny_pdf(["The gateway admits paid requests first."]))
    script = Path(__file__).resolve().parent.parent / "scripts" / "file_search_demo.py"
    run = subprocess.run([sys.executable, str(script), "--base-url", server.base_url, "--api-key", server.keys["paid"],
                          "--question", "Where is the lazy dog?", str(tmp_path / "animals.txt"),
                          str(tmp_path / "guide.pdf")], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert "read 2 of 2 files" in run.stdout and "search: Where is the lazy dog?" in run.stdout
    assert "animals.txt:" in run.stdout and re.search(r"tiny-chat read [1-3] excerpts and answered", run.stdout), run.stdout
    store_id = run.stdout.split()[2]
    with pytest.raises(openai.NotFoundError):  # deleted at the end
        client(server).vector_stores.retrieve(store_id)


def test_langchain_binds_the_file_search_tool(server, searchable):
    """LangChain's ChatOpenAI on the Responses API with the built-in tool bound, as its docs show."""
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(model="tiny-chat", base_url=server.base_url, api_key=server.keys["paid"], max_tokens=6,
                     temperature=0, use_responses_api=True, max_retries=0, timeout=60)
    bound = llm.bind_tools([{"type": "file_search", "vector_store_ids": [searchable], "max_num_results": 2}])
    reply = bound.invoke(QUESTION)
    search, text = reply.content  # LangChain's content blocks: the search, then the answer
    assert search["type"] == "file_search_call" and search["queries"] == [QUESTION], reply
    assert text["type"] == "text" and reply.text == text["text"]


SOURCES = (("file-1", "handbook.md"), ("file-2", "FAQ (v2).pdf"), ("file-3", "notes.txt"))


@pytest.mark.parametrize("text, want", [
    ("See handbook.md.", [("file-1", 15)]),
    ("Per the HANDBOOK.MD and faq (v2).pdf: yes", [("file-1", 19), ("file-2", 36)]),
    ("faq (v2).pdf first, then handbook.md, then handbook.md again", [("file-2", 12), ("file-1", 36)]),
    ("No file named here (handbook without its extension)", []),
    ("", []),
])
def test_citations_are_the_files_the_answer_names(text, want):
    from gateway.responses import citations

    got = citations(text, SOURCES)
    assert [(a["file_id"], a["index"]) for a in got] == want
    assert all(a["type"] == "file_citation" and text[:a["index"]].lower().endswith(a["filename"].lower()) for a in got)


def test_an_answer_naming_a_file_carries_its_citation_whole_and_streamed():
    """whole_output and the streamed events put the same annotations on the message (no model: a
    reply that names a file the search found, and one it did not)."""
    import json

    from gateway.chat import Reply
    from gateway.responses import Draft, ResponseEvents, ResponseJob, ResponsesRequest, whole_output

    job = ResponseJob(None, [], ResponsesRequest(model="tiny-chat", input="q"), [], sources=SOURCES)
    whole = Draft("resp_x", job, "default", reply=Reply(0, content=["Read ", "notes.txt and other.md"],
                                                        finish_reason="stop"))
    [message] = whole_output(whole)
    assert message["content"][0]["annotations"] == [
        {"type": "file_citation", "index": 14, "file_id": "file-3", "filename": "notes.txt"}]

    streamed = Draft("resp_y", job, "default")
    s = ResponseEvents(streamed)
    events = s.add_text("Read notes", None) + s.add_text(".txt and other.md", None) + s.close()
    kinds = [json.loads(e.split("data: ", 1)[1]) for e in events]
    added = [k for k in kinds if k["type"] == "response.output_text.annotation.added"]
    assert [a["annotation"] for a in added] == message["content"][0]["annotations"]
    assert added[0]["annotation_index"] == 0 and kinds.index(added[0]) < [k["type"] for k in kinds].index(
        "response.output_text.done")
    assert streamed.output[0]["content"][0]["annotations"] == message["content"][0]["annotations"]


@pytest.mark.parametrize("tools, param, status", [
    ([{"type": "file_search", "vector_store_ids": ["vs_nope"]}], "tools[0].vector_store_ids[0]", 404),
    ([{"type": "file_search", "vector_store_ids": []}], "tools[0].vector_store_ids", 400),
    ([{"type": "file_search", "vector_store_ids": ["STORE"], "filters": {"type": "eq"}}], "tools[0].filters", 400),
    ([{"type": "file_search", "vector_store_ids": ["STORE"], "max_num_results": 0}], "tools[0].max_num_results", 400),
    ([{"type": "file_search", "vector_store_ids": ["STORE"], "bogus": 1}], "tools[0].bogus", 400),
    ([{"type": "file_search", "vector_store_ids": ["STORE"], "ranking_options": {"hybrid_search": {
        "embedding_weight": 0, "text_weight": 0}}}], "tools[0].ranking_options.hybrid_search", 400),
    ([{"type": "function", "name": "f"}, {"type": "file_search", "vector_store_ids": ["STORE"]},
      {"type": "file_search", "vector_store_ids": ["STORE"]}], "tools[2]", 400),
])
def test_bad_file_search_tools_are_named(server, searchable, tools, param, status):
    tools = [{**t, "vector_store_ids": [searchable if v == "STORE" else v for v in t["vector_store_ids"]]}
             if "vector_store_ids" in t else t for t in tools]
    r = httpx.post(f"{server.base_url}/responses", json={"model": "tiny-chat", "input": "hi", "tools": tools},
                   headers={"Authorization": f"Bearer {server.keys['paid']}"}, timeout=60)
    assert r.status_code == status and _error(r)["param"] == param, r.text


@pytest.mark.parametrize("body", [{"tool_choice": "required"}, {"tool_choice": {"type": "file_search"}},
                                  {"tool_choice": {"type": "file_search"}, "tools": [{"type": "function", "name": "f"}]}])
def test_a_file_search_choice_without_the_tool_is_a_400(server, body):
    r = httpx.post(f"{server.base_url}/responses", json={"model": "tiny-chat", "input": "hi", **body},
                   headers={"Authorization": f"Bearer {server.keys['paid']}"}, timeout=60)
    assert r.status_code == 400 and _error(r)["param"] == "tool_choice", r.text


def test_another_keys_store_cannot_be_searched(server, searchable):
    with pytest.raises(openai.NotFoundError) as e:
        respond(client(server, "free"), searchable)
    assert e.value.body["param"] == "tools[0].vector_store_ids[0]"
