"""Stored chat completions (``store: true``) through the openai SDK against a real server, and
the store under them on both backends (SQLite, Redis)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import sqlite3
import time

import httpx
import openai
import pytest

from gateway.completion_store import RedisCompletions, SQLiteCompletions, StoredCompletion
from tests.helpers import start_server, stream_and_leave, write_config
from tests.test_batch_store import redis_server


@pytest.fixture(scope="module")
def server(tiny_chat, tmp_path_factory):
    s = start_server(write_config(tmp_path_factory.mktemp("stored-chat"), {"tiny-chat": ("chat", tiny_chat)}))
    yield s
    s.stop()


def client(server, tier="paid") -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key=server.keys[tier], max_retries=0, timeout=120)


def ask(c, text: str, **kw):
    kw.setdefault("max_tokens", 4)
    return c.chat.completions.create(model="tiny-chat", messages=[{"role": "user", "content": text}], temperature=0, **kw)


def test_a_stored_completion_is_read_listed_updated_and_deleted(server):
    c = client(server)
    made = ask(c, "Hello", store=True, metadata={"topic": "greeting", "run": "1"})
    got = c.chat.completions.retrieve(made.id)
    assert got.model_dump(exclude={"metadata"}) == made.model_dump(exclude={"metadata"})
    assert got.metadata == {"topic": "greeting", "run": "1"}
    (message,) = c.chat.completions.messages.list(made.id).data
    assert (message.id, message.role, message.content, message.content_parts) == (f"{made.id}-0", "user", "Hello", None)

    assert c.chat.completions.update(made.id, metadata={"topic": "done"}).metadata == {"topic": "done"}
    assert c.chat.completions.retrieve(made.id).metadata == {"topic": "done"}
    assert c.chat.completions.update(made.id, metadata=None).metadata == {}

    with pytest.raises(openai.NotFoundError):  # another key's is not found
        client(server, "free").chat.completions.retrieve(made.id)
    assert made.id not in [x.id for x in client(server, "free").chat.completions.list()]
    assert c.chat.completions.delete(made.id).deleted
    for call in (c.chat.completions.retrieve, c.chat.completions.delete, c.chat.completions.messages.list):
        with pytest.raises(openai.NotFoundError):
            call(made.id)
    not_kept = ask(c, "Hello")  # store is false unless asked
    with pytest.raises(openai.NotFoundError):
        c.chat.completions.retrieve(not_kept.id)


def test_a_streamed_completion_is_stored_whole_once_it_finished(server):
    c = client(server)
    chunks = list(c.chat.completions.create(model="tiny-chat", messages=[{"role": "user", "content": "Tell me"}],
                                            max_tokens=6, n=2, temperature=0, stream=True, store=True))
    got = c.chat.completions.retrieve(chunks[0].id)
    texts = {i: "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices and ch.choices[0].index == i)
             for i in (0, 1)}
    assert {ch.index: ch.message.content for ch in got.choices} == texts
    finish = {ch.choices[0].index: ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason}
    assert {ch.index: ch.finish_reason for ch in got.choices} == finish and len(finish) == 2
    assert got.usage.prompt_tokens > 0 and got.usage.completion_tokens >= 2
    assert got.created == chunks[0].created and got.service_tier == chunks[0].service_tier and got.metadata == {}


def test_a_stream_its_client_left_is_not_stored(server):
    before = {x.id for x in client(server).chat.completions.list(limit=100)}
    stream_and_leave(f"{server.base_url}/chat/completions", {"Authorization": f"Bearer {server.keys['paid']}"},
                     {"model": "tiny-chat", "messages": [{"role": "user", "content": "Count"}], "max_tokens": 200, "temperature": 0,
                      "stream": True, "store": True}, chunks=2)
    time.sleep(0.5)
    assert {x.id for x in client(server).chat.completions.list(limit=100)} == before


def test_the_list_filters_orders_and_pages(tiny_chat, tmp_path):
    s = start_server(write_config(tmp_path, {"tiny-chat": ("chat", tiny_chat)}))
    try:
        c = client(s)
        made = [ask(c, f"Q{i}", store=True, metadata={"group": "ab"[i % 2], "i": str(i)}).id for i in range(5)]
        assert [x.id for x in c.chat.completions.list()] == made  # oldest first
        assert [x.id for x in c.chat.completions.list(order="desc")] == made[::-1]
        assert [x.id for x in c.chat.completions.list(metadata={"group": "a"})] == made[0::2]
        assert [x.id for x in c.chat.completions.list(metadata={"group": "a", "i": "2"})] == [made[2]]
        assert [x.id for x in c.chat.completions.list(model="tiny-chat", metadata={"group": "b"})] == made[1::2]
        assert c.chat.completions.list(model="other").data == []
        first = c.chat.completions.list(limit=2)
        assert [x.id for x in first.data] == made[:2] and first.has_more
        assert [x.id for x in c.chat.completions.list(limit=2, after=made[1]).data] == made[2:4]
        assert [x.id for x in c.chat.completions.list(limit=2, after=made[1], order="desc").data] == [made[0]]
        assert [x.id for x in c.chat.completions.list(limit=2)] == made  # the SDK's pager follows has_more
        last = c.chat.completions.list(limit=3, after=made[1])
        assert [x.id for x in last.data] == made[2:] and not last.has_more
    finally:
        s.stop()


def test_messages_are_listed_with_their_parts(server):
    c = client(server)
    messages = [{"role": "system", "content": "Be brief"},
                {"role": "user", "content": [{"type": "text", "text": "Hi "}, {"type": "text", "text": "there"}]},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "ok"},
                {"role": "user", "content": "Go on", "name": "ann"}]
    made = c.chat.completions.create(model="tiny-chat", messages=messages, max_tokens=2, store=True)
    listed = c.chat.completions.messages.list(made.id).data
    assert [m.id for m in listed] == [f"{made.id}-{i}" for i in range(5)]
    assert listed[1].content == "Hi there" and [p.text for p in listed[1].content_parts] == ["Hi ", "there"]
    assert listed[2].tool_calls[0].function.name == "f" and listed[3].model_extra["tool_call_id"] == "call_1"
    assert listed[4].model_extra["name"] == "ann"
    page = c.chat.completions.messages.list(made.id, limit=2, after=f"{made.id}-1", order="desc")
    assert [m.id for m in page.data] == [f"{made.id}-0"] and not page.has_more


@pytest.mark.parametrize("method, path, body, param", [
    ("GET", "/chat/completions?limit=0", None, "limit"),
    ("GET", "/chat/completions?limit=101", None, "limit"),
    ("GET", "/chat/completions?order=newest", None, "order"),
    ("GET", "/chat/completions?after=chatcmpl-nope", None, "after"),
    ("GET", "/chat/completions/{id}/messages?after={id}-9", None, "after"),
    ("POST", "/chat/completions/{id}", {"metadata": {f"k{i}": "v" for i in range(17)}}, "metadata"),
    ("POST", "/chat/completions/{id}", {"metadata": {"k": "v" * 513}}, "metadata"),
    ("POST", "/chat/completions/{id}", {"metadata": {"k": "v"}, "model": "x"}, "model"),
    ("POST", "/chat/completions/{id}", {}, "metadata"),
    ("POST", "/chat/completions", {"model": "tiny-chat", "messages": [{"role": "user", "content": "x"}],
                                   "store": True, "metadata": {"k" * 65: "v"}}, "metadata"),
])
def test_bad_requests_are_400s_naming_the_param(server, method, path, body, param):
    made = ask(client(server), "x", store=True)
    r = httpx.request(method, f"{server.base_url}{path.format(id=made.id)}", json=body, timeout=60,
                      headers={"Authorization": f"Bearer {server.keys['paid']}"})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    assert client(server).chat.completions.retrieve(made.id).metadata == {}  # a refused update changed nothing


def test_unknown_ids_are_404s(server):
    c = client(server)
    for call in (c.chat.completions.retrieve, c.chat.completions.delete, c.chat.completions.messages.list,
                 lambda i: c.chat.completions.update(i, metadata={})):
        with pytest.raises(openai.NotFoundError) as e:
            call("chatcmpl-nope")
        assert e.value.body["param"] == "completion_id"


# -- the store, on both backends ----------------------------------------------------------------------


def rec(i: int, owner: str = "k", model: str = "m", metadata: dict | None = None, age_s: float = 0) -> StoredCompletion:
    made = int(time.time() - age_s)
    return StoredCompletion(f"c{i}", owner, {"id": f"c{i}", "created": made, "model": model, "choices": [],
                                             "metadata": metadata or {}}, [{"id": f"c{i}-0", "role": "user"}])


async def _contract(store) -> None:
    await store.open()
    try:
        for i in range(6):
            await store.put(rec(i, model="m" if i < 4 else "n", metadata={"g": "ab"[i % 2]}))
        await store.put(rec(9, owner="other"))
        assert await store.get("c1", "k") == rec(1, metadata={"g": "b"}) and await store.get("c1", "other") is None

        async def ids(**kw) -> tuple[list[str], bool]:
            args = {"after": None, "limit": 10, "ascending": True, "model": None, "metadata": {}, **kw}
            found, more = await store.page("k", args["after"], args["limit"], args["ascending"], args["model"],
                                           args["metadata"])
            return [r.id for r in found], more

        assert await ids() == (["c0", "c1", "c2", "c3", "c4", "c5"], False)
        assert await ids(ascending=False, limit=2) == (["c5", "c4"], True)
        assert await ids(after="c1", limit=2) == (["c2", "c3"], True)
        assert await ids(after="c3", ascending=False) == (["c2", "c1", "c0"], False)
        assert await ids(model="n") == (["c4", "c5"], False)
        assert await ids(metadata={"g": "a"}, limit=2) == (["c0", "c2"], True)
        assert await ids(metadata={"g": "a"}, model="n") == (["c4"], False)
        assert await ids(metadata={"g": "a", "h": "x"}) == ([], False)
        with pytest.raises(KeyError):
            await ids(after="c9")  # another key's

        assert (await store.set_metadata("c1", "k", {"g": "z"})).completion["metadata"] == {"g": "z"}
        assert (await store.get("c1", "k")).completion["metadata"] == {"g": "z"}
        assert await store.set_metadata("c1", "other", {}) is None and await store.set_metadata("c7", "k", {}) is None
        assert not await store.delete("c1", "other") and await store.delete("c1", "k")
        assert await store.get("c1", "k") is None and not await store.delete("c1", "k")
        assert await ids(metadata={"g": "b"}) == (["c3", "c5"], False)
    finally:
        await store.close()


def test_sqlite_store(tmp_path):
    asyncio.run(_contract(SQLiteCompletions(tmp_path / "batches.sqlite3")))


def test_redis_store(tmp_path):
    with redis_server(tmp_path) as url:
        asyncio.run(_contract(RedisCompletions(url)))


@pytest.mark.parametrize("backend", ["sqlite", "redis"])
def test_pages_list_each_completion_once_while_others_come_and_go(backend, tmp_path, request):
    """A client pages through a key's stored completions (``after``: the last one's id) while
    another process stores and deletes others of the key's, older and newer: each is listed once, in
    order. (On Redis a page was read from the cursor's rank, in a call of its own: the completions
    stored or deleted between the two moved it, and the pages repeated some and skipped others.)"""
    def make():
        if backend == "sqlite":
            return SQLiteCompletions(tmp_path / "batches.sqlite3")
        return RedisCompletions(request.getfixturevalue("redis_url"), prefix=f"t{time.time_ns()}:")

    async def go() -> list[list[str]]:
        store, other = make(), None
        await store.open()
        other = store if backend == "sqlite" else RedisCompletions(store.url, prefix=store.prefix)
        await other.open()
        for i in range(30):  # older ones, deleted while the client pages
            await store.put(rec(100 + i, metadata={"g": "noise"}))
        kept = [rec(i, metadata={"g": "kept"}) for i in range(10)]
        for record in kept:
            await store.put(record)
        done = asyncio.Event()

        async def churn(n: int) -> None:
            i = 0
            while not done.is_set():
                await other.put(rec(1000 * (n + 1) + i, metadata={"g": "noise"}))
                await other.delete(f"c{1000 * (n + 1) + i - 1}", "k")
                await other.delete(f"c{100 + 10 * n + i % 10}", "k")
                i += 1

        churners = [asyncio.create_task(churn(n)) for n in range(3)]
        wrong = []
        for _ in range(5):
            for ascending in (False, True):
                listed, after, more = [], None, True
                while more:
                    page, more = await store.page("k", after, 2, ascending, None, {"g": "kept"})
                    listed += [r.id for r in page]
                    after = listed[-1]
                if listed != [r.id for r in (kept if ascending else kept[::-1])]:
                    wrong.append(listed)
        done.set()
        await asyncio.gather(*churners)
        await store.close()
        if other is not store:
            await other.close()
        return wrong

    assert asyncio.run(go()) == []


DAY = 86400


def test_retention_on_sqlite(tmp_path):
    """A record past the retention is not read, listed, changed or deleted, and the sweep (at
    open and every sweep_s) deletes it."""
    path = tmp_path / "batches.sqlite3"

    async def main() -> None:
        store = SQLiteCompletions(path, retention_s=DAY, sweep_s=0.05)
        await store.open()
        try:
            await store.put(rec(0, age_s=2 * DAY))
            await store.put(rec(1))
            assert await store.get("c0", "k") is None and await store.set_metadata("c0", "k", {}) is None
            assert [r.id for r in (await store.page("k", None, 10, True, None, {}))[0]] == ["c1"]
            for _ in range(100):
                with contextlib.closing(sqlite3.connect(path)) as db:
                    if [r[0] for r in db.execute("SELECT id FROM chat_completions")] == ["c1"]:
                        return
                await asyncio.sleep(0.02)
            raise AssertionError("the sweep did not delete the old record")
        finally:
            await store.close()

    asyncio.run(main())


def test_retention_on_redis(tmp_path):
    """Each record's key expires at the end of its retention; the list drops it when read."""
    import redis

    async def main(url: str) -> None:
        store = RedisCompletions(url, retention_s=30 * DAY)
        await store.open()
        try:
            await store.put(rec(0, age_s=31 * DAY))  # expired when written
            await store.put(rec(1))
            assert await store.get("c0", "k") is None
            assert [r.id for r in (await store.page("k", None, 10, True, None, {}))[0]] == ["c1"]
        finally:
            await store.close()

    with redis_server(tmp_path) as url:
        asyncio.run(main(url))
        r = redis.Redis.from_url(url)
        try:
            assert r.exists("tg:chat-completion:c0") == 0
            assert 30 * DAY - 60 < r.ttl("tg:chat-completion:c1") <= 30 * DAY + 1
            assert [m.decode() for m in r.zrange("tg:chat-completions:k", 0, -1)] == ["c1"]
        finally:
            r.close()


def test_while_the_store_is_down_a_stored_completion_is_refused_before_its_work_or_answered_unstored(tiny_chat,
                                                                                                      tmp_path):
    """Redis stops: the first ``store: true`` completion (the server did not know yet) is answered
    all the same, its work done and metered: a streamed one ends as it would, with no error, and
    a whole one carries ``x-tiergate-stored: false``. Once the server knows, one is refused with
    503 ``store_unavailable`` before any work (no usage), while ``store: false`` is served; with
    Redis back, completions are stored again."""
    from tests.helpers import spare_port

    def unwritten() -> float:  # usage kept in memory while the store is down: a row per request metered
        line = next(ln for ln in httpx.get(f"{s.url}/metrics", timeout=30).text.splitlines()
                    if ln.startswith("tiergate_usage_unwritten "))
        return float(line.split()[1])

    def stream() -> list[str]:
        with httpx.stream("POST", f"{s.base_url}/chat/completions", timeout=60,
                          headers={"Authorization": f"Bearer {s.keys['paid']}"},
                          json={"model": "tiny-chat", "messages": [{"role": "user", "content": "Hi"}],
                                "max_tokens": 4, "store": True, "stream": True}) as answer:
            assert answer.status_code == 200
            return [ln for ln in answer.iter_lines() if ln.startswith("data: ")]

    port = spare_port()
    (tmp_path / "redis").mkdir()
    with redis_server(tmp_path / "redis", port) as url:
        s = start_server(write_config(tmp_path, {"tiny-chat": ("chat", tiny_chat)}, f"batch:\n  store: {url}\n"))
    try:
        c = client(s)
        lines = stream()
        assert lines[-1] == "data: [DONE]" and not any('"error"' in ln for ln in lines), lines
        assert json.loads(lines[-2][6:])["choices"][0]["finish_reason"] in ("length", "stop")
        metered = unwritten()
        with pytest.raises(openai.APIStatusError) as refused:
            ask(c, "Hi", store=True)
        assert refused.value.status_code == 503 and refused.value.code == "store_unavailable"
        assert refused.value.response.headers["retry-after"] == "1"
        ask(c, "Hi")  # store false: served
        assert unwritten() == metered + 1  # the store: false one only
        with redis_server(tmp_path / "redis", port):
            for _ in range(5):  # a pooled connection to the stopped Redis fails its first command
                if httpx.get(f"{s.url}/readyz", timeout=30).status_code == 200:
                    break
            kept = ask(c, "Hi", store=True)
            assert c.chat.completions.retrieve(kept.id).id == kept.id
        raw = c.chat.completions.with_raw_response.create(
            model="tiny-chat", messages=[{"role": "user", "content": "Hi"}], max_tokens=4, store=True)
        assert raw.status_code == 200 and raw.headers["x-tiergate-stored"] == "false"
        assert raw.parse().choices[0].finish_reason in ("length", "stop")
    finally:
        s.stop()
