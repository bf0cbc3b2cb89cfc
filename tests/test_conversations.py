"""The Conversations API and responses made in a conversation, through the openai SDK against a
real server; the store under them on both backends (SQLite, Redis)."""

from __future__ import annotations

import asyncio
import sqlite3
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from gateway.conversation_store import Conversation, DuplicateItem, RedisConversations, SQLiteConversations
from tests.helpers import start_server, write_config
from tests.test_batch_store import redis_server


@pytest.fixture(scope="module")
def server(tiny_chat, tmp_path_factory):
    s = start_server(write_config(tmp_path_factory.mktemp("conversations"), {"tiny-chat": ("chat", tiny_chat)}))
    yield s
    s.stop()


def client(server, tier="paid") -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key=server.keys[tier], max_retries=0, timeout=120)


def respond(c, input, **kw):
    kw.setdefault("max_output_tokens", 6)
    return c.responses.create(model="tiny-chat", input=input, temperature=0, **kw)


def ids(page) -> list[str]:
    return [item.id for item in page.data]


def test_a_conversation_and_its_items(server):
    c = client(server)
    conv = c.conversations.create(items=[{"type": "message", "role": "system", "content": "Be brief"},
                                         {"type": "message", "role": "user", "content": "Hi", "id": "msg_mine"}],
                                  metadata={"topic": "t"})
    assert conv.id.startswith("conv_") and conv.object == "conversation" and conv.metadata == {"topic": "t"}
    assert c.conversations.retrieve(conv.id).model_dump() == conv.model_dump()
    assert c.conversations.update(conv.id, metadata={"topic": "u"}).metadata == {"topic": "u"}

    first = c.conversations.items.list(conv.id, order="asc")
    assert ids(first)[1] == "msg_mine" and first.data[1].content[0].text == "Hi"
    assert first.data[0].role == "system" and first.data[0].status == "completed"
    added = c.conversations.items.create(conv.id, items=[
        {"type": "message", "role": "assistant", "content": "Hello"},
        {"type": "function_call", "call_id": "call_1", "name": "f", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "call_1", "output": "ok"}])
    assert [i.type for i in added.data] == ["message", "function_call", "function_call_output"] and not added.has_more
    every = ids(first) + ids(added)
    assert ids(c.conversations.items.list(conv.id)) == every[::-1]  # newest first by default
    page = c.conversations.items.list(conv.id, limit=2, after=every[1], order="asc")
    assert ids(page) == every[2:4] and page.has_more
    assert c.conversations.items.retrieve(every[3], conversation_id=conv.id).model_dump()["name"] == "f"

    assert c.conversations.items.delete("msg_mine", conversation_id=conv.id).id == conv.id
    assert "msg_mine" not in ids(c.conversations.items.list(conv.id))
    with pytest.raises(openai.NotFoundError) as e:
        c.conversations.items.retrieve("msg_mine", conversation_id=conv.id)
    assert e.value.body["param"] == "item_id"

    with pytest.raises(openai.NotFoundError):  # another key's
        client(server, "free").conversations.retrieve(conv.id)
    assert c.conversations.delete(conv.id).deleted
    for call in (lambda: c.conversations.retrieve(conv.id), lambda: c.conversations.items.list(conv.id),
                 lambda: c.conversations.delete(conv.id)):
        with pytest.raises(openai.NotFoundError):
            call()


def test_a_response_in_a_conversation_reads_it_and_adds_to_it(server):
    c = client(server)
    conv = c.conversations.create()
    r1 = respond(c, "Tell me a story", conversation=conv.id)
    assert r1.conversation.id == conv.id
    after_one = c.conversations.items.list(conv.id, order="asc").data
    assert [i.type for i in after_one] == ["message", "message"]
    assert after_one[0].content[0].text == "Tell me a story" and after_one[1].id == r1.output[0].id
    assert after_one[1].content[0].text == r1.output_text

    # the conversation's items start the prompt: the same reply as continuing the stored response
    r2 = respond(c, "And then?", conversation={"id": conv.id})
    same = respond(c, "And then?", previous_response_id=r1.id)
    assert r2.output_text == same.output_text
    assert [i.type for i in c.responses.input_items.list(r2.id, order="asc").data] == ["message"] * 3
    # streamed and in the background, each adds its items once it ended
    events = list(c.responses.create(model="tiny-chat", input="More", max_output_tokens=4, temperature=0,
                                     conversation=conv.id, stream=True))
    assert events[-1].response.conversation.id == conv.id
    background = c.responses.create(model="tiny-chat", input="Again", max_output_tokens=4, conversation=conv.id,
                                    background=True)
    deadline = time.monotonic() + 60
    while c.responses.retrieve(background.id).status in ("queued", "in_progress"):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    texts = [i.content[0].text for i in c.conversations.items.list(conv.id, order="asc").data]
    assert texts[::2] == ["Tell me a story", "And then?", "More", "Again"] and len(texts) == 8


def test_a_response_that_fails_adds_nothing_and_bad_references_are_refused(server):
    c = client(server)
    conv = c.conversations.create(items=[{"type": "message", "role": "user", "content": "Hi"}])
    with pytest.raises(openai.BadRequestError) as e:
        respond(c, "word " * 600, conversation=conv.id)  # past the context: refused before any work
    assert e.value.body["param"] == "input"
    assert len(c.conversations.items.list(conv.id).data) == 1
    r = respond(c, "x", max_output_tokens=2)
    with pytest.raises(openai.BadRequestError) as e:
        respond(c, "x", conversation=conv.id, previous_response_id=r.id)
    assert e.value.body["param"] == "conversation"
    for other in ("conv_nope", c.conversations.create().id):
        with pytest.raises(openai.NotFoundError) as e:
            respond(client(server, "free") if other != "conv_nope" else c, "x", conversation=other)
        assert e.value.body["param"] == "conversation"
    with pytest.raises(openai.BadRequestError) as e:  # an id already in the conversation
        respond(c, [{"type": "message", "role": "user", "content": "x",
                     "id": c.conversations.items.list(conv.id).data[0].id}], conversation=conv.id)
    assert e.value.body["code"] == "duplicate_item_id"


def _race(calls) -> list:
    """What each of ``calls`` answered (or raised), all made at once."""
    def outcome(call):
        try:
            return call()
        except openai.APIStatusError as exc:
            return exc

    with ThreadPoolExecutor(len(calls)) as pool:
        return list(pool.map(outcome, calls))


def _settled(c, conv_id, count) -> list[str]:
    """The conversation's item ids, oldest first, once it has ``count`` (a background response adds
    its items when it ends)."""
    deadline = time.monotonic() + 60
    while len(c.conversations.items.list(conv_id).data) < count and time.monotonic() < deadline:
        time.sleep(0.05)
    return ids(c.conversations.items.list(conv_id, order="asc"))


@pytest.mark.parametrize("how", [{}, {"stream": True}, {"background": True}])
def test_racing_responses_with_one_item_id_refuse_all_but_one_before_any_work(server, how):
    """Responses made at once in one conversation whose inputs have the same item id: the first one
    holds the id while it runs, and the others are refused as they would be once it had added
    it, with a 400 ``duplicate_item_id`` naming the item, before their model runs (not a 503
    store_unavailable after it ran, nor a crashed background run); the conversation holds the
    first one's items only; once it ended the id is held no more."""
    c = client(server)
    conv = c.conversations.create()
    item = [{"type": "message", "role": "user", "content": "hi", "id": "msg_race"}]
    generated = server.services.metrics.tokens
    before = generated[("tiny-chat", "paid", "completion")]
    outcomes = _race([lambda: respond(c, item, conversation=conv.id, **how)] * 4)
    refused = [o for o in outcomes if isinstance(o, openai.APIStatusError)]
    assert len(refused) == 3, outcomes
    assert {(e.status_code, e.body["code"], e.body["param"]) for e in refused} == {
        (400, "duplicate_item_id", "input[0].id")}
    winner = next(o for o in outcomes if not isinstance(o, openai.APIStatusError))
    if how.get("stream"):
        events = list(winner)
        assert events[-1].type in ("response.completed", "response.incomplete")
        winner = events[-1].response
    assert _settled(c, conv.id, 2)[0] == "msg_race" and len(_settled(c, conv.id, 2)) == 2
    usage = c.responses.retrieve(winner.id).usage
    assert generated[("tiny-chat", "paid", "completion")] - before == usage.output_tokens  # only the first one ran
    c.conversations.items.delete("msg_race", conversation_id=conv.id)  # its id, free again once it ended
    assert respond(c, item, conversation=conv.id).conversation.id == conv.id


def _added_meanwhile(monkeypatch, server, item) -> None:
    """The server's conversation store, made to get ``item`` (as from another process, whose
    running responses this one does not see) just before each append."""
    store = server.app.state.conversations
    real = store.add_items

    async def add_items(conversation_id, owner, items):
        await real(conversation_id, owner, [item])
        return await real(conversation_id, owner, items)

    monkeypatch.setattr(store, "add_items", add_items)


def test_an_item_id_added_while_a_response_runs_is_refused_by_the_append(server, monkeypatch):
    """An input item id that the conversation gets while the response runs (another process's
    response added it) is refused by the store's append itself, all of the items or none: a
    whole response is a 400 ``duplicate_item_id`` naming it, a streamed one ends with an
    ``error`` event with that code, neither is stored; a background one is ``failed`` with that
    error (its run does not crash). The conversation holds only the item added meanwhile."""
    c = client(server)
    _added_meanwhile(monkeypatch, server, {"id": "msg_twice", "type": "message", "role": "user", "status": "completed",
                                           "content": [{"type": "input_text", "text": "x"}]})
    item = [{"type": "message", "role": "user", "content": "hi", "id": "msg_twice"}]
    conv = c.conversations.create()
    with pytest.raises(openai.BadRequestError) as e:
        respond(c, item, conversation=conv.id)
    assert (e.value.body["code"], e.value.body["param"]) == ("duplicate_item_id", "input[0].id")
    assert _settled(c, conv.id, 1) == ["msg_twice"]

    conv = c.conversations.create()
    events = list(respond(c, item, conversation=conv.id, stream=True))
    assert (events[-1].type, events[-1].code) == ("error", "duplicate_item_id"), events[-1]
    with pytest.raises(openai.NotFoundError):
        c.responses.retrieve(events[0].response.id)
    assert _settled(c, conv.id, 1) == ["msg_twice"]

    conv = c.conversations.create()
    queued = respond(c, item, conversation=conv.id, background=True)
    deadline = time.monotonic() + 60
    while (ended := c.responses.retrieve(queued.id)).status in ("queued", "in_progress"):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert ended.status == "failed" and ended.error.code == "duplicate_item_id", ended
    assert _settled(c, conv.id, 1) == ["msg_twice"]


def test_a_constraint_the_store_refuses_is_a_500_not_store_unavailable(server, monkeypatch):
    """A constraint SQLite refused is no outage that trying again shortly would get past: a 500
    ``internal_error``, not the 503 ``store_unavailable`` of a store that did not answer."""
    async def refused(*args):
        raise sqlite3.IntegrityError("UNIQUE constraint failed: conversation_items.conversation_id")

    conv = client(server).conversations.create()
    monkeypatch.setattr(server.app.state.conversations, "add_items", refused)
    r = httpx.post(f"{server.base_url}/conversations/{conv.id}/items", timeout=60,
                   json={"items": [{"role": "user", "content": "x"}]},
                   headers={"Authorization": f"Bearer {server.keys['paid']}"})
    assert r.status_code == 500 and r.json()["error"]["code"] == "internal_error", r.text


@pytest.mark.parametrize("path, body, param", [
    ("/conversations", {"items": [{"type": "message", "role": "user", "content": "x"}] * 21}, "items"),
    ("/conversations", {"items": [{"type": "message", "role": "robot", "content": "x"}]}, "items[0].role"),
    ("/conversations", {"items": [{"type": "web_search_call"}]}, "items[0].type"),
    ("/conversations", {"items": [{"role": "user", "content": "x", "id": "a"}, {"role": "user", "content": "y", "id": "a"}]},
     "items[1].id"),
    ("/conversations", {"metadata": {"k": "v" * 513}}, "metadata"),
    ("/conversations", {"frobnicate": 1}, "frobnicate"),
    ("/conversations/{id}", {}, "metadata"),
    ("/conversations/{id}/items", {"items": []}, "items"),
    ("/conversations/{id}/items", {"items": [{"type": "function_call", "name": "f", "arguments": "{}"}]},
     "items[0].call_id"),
    ("/conversations/{id}/items", {"items": [{"role": "user", "content": "x", "id": "msg_first"}]}, "items[0].id"),
])
def test_bad_bodies_are_400s_naming_the_field(server, path, body, param):
    conv = client(server).conversations.create(items=[{"role": "user", "content": "x", "id": "msg_first"}])
    r = httpx.post(f"{server.base_url}{path.format(id=conv.id)}", json=body, timeout=60,
                   headers={"Authorization": f"Bearer {server.keys['paid']}"})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    assert len(client(server).conversations.items.list(conv.id).data) == 1  # nothing was added


@pytest.mark.parametrize("query, param", [("limit=0", "limit"), ("order=up", "order"), ("after=nope", "after")])
def test_bad_item_lists_are_400s(server, query, param):
    conv = client(server).conversations.create(items=[{"role": "user", "content": "x"}])
    r = httpx.get(f"{server.base_url}/conversations/{conv.id}/items?{query}", timeout=60,
                  headers={"Authorization": f"Bearer {server.keys['paid']}"})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


# -- the store, on both backends ----------------------------------------------------------------------


async def _contract(store) -> None:
    await store.open()
    try:
        conv = Conversation("conv_a", "k", 7, {"m": "1"})
        await store.create(conv, [{"id": "i0", "n": 0}, {"id": "i1", "n": 1}])
        await store.create(Conversation("conv_b", "k", 8, {}), [])
        assert await store.get("conv_a", "k") == conv and await store.get("conv_a", "other") is None
        assert await store.items("conv_a", "k") == [{"id": "i0", "n": 0}, {"id": "i1", "n": 1}]
        assert await store.items("conv_b", "k") == [] and await store.items("conv_a", "other") is None
        assert await store.add_items("conv_a", "k", [{"id": "i2", "n": [], "e": {}}])  # (empty lists stay lists)
        assert not await store.add_items("conv_a", "other", [{"id": "x"}])
        with pytest.raises(DuplicateItem) as e:  # an id it has: none of the items is added
            await store.add_items("conv_a", "k", [{"id": "i3"}, {"id": "i1"}])
        assert e.value.item_id == "i1" and [i["id"] for i in await store.items("conv_a", "k")] == ["i0", "i1", "i2"]
        assert [i["id"] for i in await store.items("conv_a", "k")] == ["i0", "i1", "i2"]
        assert (await store.items("conv_a", "k"))[2] == {"id": "i2", "n": [], "e": {}}
        assert not await store.delete_item("conv_a", "other", "i1") and not await store.delete_item("conv_a", "k", "i9")
        assert await store.delete_item("conv_a", "k", "i1")
        assert [i["id"] for i in await store.items("conv_a", "k")] == ["i0", "i2"]
        assert (await store.set_metadata("conv_a", "k", {"m": "2"})).metadata == {"m": "2"}
        assert await store.set_metadata("conv_a", "other", {}) is None
        assert (await store.get("conv_a", "k")).metadata == {"m": "2"}
        assert not await store.delete("conv_a", "other") and await store.delete("conv_a", "k")
        assert await store.get("conv_a", "k") is None and await store.items("conv_a", "k") is None
        assert not await store.add_items("conv_a", "k", [{"id": "late"}])
        assert await store.get("conv_b", "k") is not None
    finally:
        await store.close()


def test_sqlite_store(tmp_path):
    asyncio.run(_contract(SQLiteConversations(tmp_path / "batches.sqlite3")))


def test_redis_store(tmp_path):
    with redis_server(tmp_path) as url:
        asyncio.run(_contract(RedisConversations(url)))
