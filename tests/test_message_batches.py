"""Anthropic's Message Batches API (``batch.message_batches``) with the ``anthropic`` SDK: requests
run as a batch's lines at the batch tier and come back in Anthropic's shapes; listing, cancelling,
expiry and deleting; on the real chat model, or a stand-in endpoint where timing matters."""

from __future__ import annotations

import asyncio
import time

import anthropic
import httpx
import openai
import pytest

from batch import api
from tests.helpers import stand_in_batch_server, start_server, write_config
from tests.test_batches import BATCH_CONFIG as CONFIG

GREEDY = {"temperature": 0}


def params(text: str, **kw) -> dict:
    return {"model": "tiny-chat", "max_tokens": 4, "messages": [{"role": "user", "content": text}], **GREEDY, **kw}


def claude(server, tier: str = "paid") -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key=server.keys[tier], max_retries=0, timeout=60)


def wait(c: anthropic.Anthropic, batch_id: str, timeout: float = 60):
    deadline = time.time() + timeout
    while True:
        b = c.messages.batches.retrieve(batch_id)
        assert sum(b.request_counts.to_dict().values()) > 0
        if b.processing_status == "ended":
            return b
        assert b.request_counts.processing == sum(b.request_counts.to_dict().values())  # counted at the end only
        if time.time() > deadline:
            raise AssertionError(f"message batch {batch_id} stuck: {b.processing_status} {b.request_counts}")
        time.sleep(0.05)


@pytest.fixture(scope="module")
def server(tiny_chat, tmp_path_factory):
    srv = start_server(write_config(tmp_path_factory.mktemp("message-batches"), {"tiny-chat": ("chat", tiny_chat)},
                                    CONFIG))
    yield srv
    srv.stop()


@pytest.fixture
def fake_server(tiny_chat, tmp_path):
    """A server whose message batch lines go to a stand-in endpoint (set ``srv.fake``)."""
    srv = stand_in_batch_server(tmp_path, tiny_chat, CONFIG, "/v1/messages")
    yield srv
    srv.stop()


def test_a_batch_runs_each_request_as_the_live_endpoint_answers_it(server):
    """Requests (good ones, one on an unknown model, one that asks to stream) run at the batch
    tier; the batch ends with each counted, and its results, in the requests' order, are the
    messages the live endpoint gives (greedy) or the errors it gives, as the SDK types them."""
    c = claude(server)
    requests = [{"custom_id": "bad_model", "params": params("hi", model="nope")},
                {"custom_id": "a", "params": params("hello")},
                {"custom_id": "streamed", "params": params("hi", stream=True)},
                {"custom_id": "b-1", "params": params("how are you")}]
    made = c.messages.batches.create(requests=requests)
    assert made.id.startswith("msgbatch_") and made.type == "message_batch"
    assert made.processing_status == "in_progress" and made.request_counts.processing == 4 and made.results_url is None
    assert (made.expires_at - made.created_at).total_seconds() == 24 * 3600
    done = wait(c, made.id)
    counts = done.request_counts
    assert (counts.processing, counts.succeeded, counts.errored, counts.canceled, counts.expired) == (0, 2, 2, 0, 0)
    assert done.ended_at >= done.created_at and done.cancel_initiated_at is None
    assert done.results_url.endswith(f"/v1/messages/batches/{made.id}/results")
    results = list(c.messages.batches.results(made.id))
    assert [r.custom_id for r in results] == ["bad_model", "a", "streamed", "b-1"]
    for r, text in zip(results[1::2], ("hello", "how are you")):
        live = c.messages.create(**{k: v for k, v in params(text).items() if k not in GREEDY}, extra_body=GREEDY)
        assert r.result.type == "succeeded" and r.result.message.content == live.content
        assert r.result.message.usage.input_tokens == live.usage.input_tokens
    bad_model, streamed = results[0].result, results[2].result
    assert bad_model.type == streamed.type == "errored" and bad_model.error.type == "error"
    assert bad_model.error.error.model_extra["param"] == "model" and "nope" in bad_model.error.error.message
    assert streamed.error.error.model_extra["param"] == "stream"
    # the same batch on the OpenAI routes: its lines called /v1/messages
    assert openai.OpenAI(base_url=server.base_url, api_key=server.keys["paid"]).batches.retrieve(
        "batch_" + made.id.removeprefix("msgbatch_")).endpoint == "/v1/messages"


def test_batches_list_newest_first_in_pages_either_way(server):
    """Only the caller's message batches (not its OpenAI batches, not another key's), newest
    first; the SDK pages through them with ``after_id``, and back with ``before_id``."""
    c = claude(server)
    before = [b.id for b in c.messages.batches.list(limit=1000)]
    made = [c.messages.batches.create(requests=[{"custom_id": "x", "params": params("hi")}]).id for _ in range(5)]
    oa = openai.OpenAI(base_url=server.base_url, api_key=server.keys["paid"])
    f = oa.files.create(file=("in.jsonl", b'{"custom_id": "y", "method": "POST", "url": "/v1/chat/completions", '
                                          b'"body": {"model": "tiny-chat", "messages": [], "max_tokens": 1}}\n'),
                        purpose="batch")
    oa.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
    claude(server, "free").messages.batches.create(requests=[{"custom_id": "z", "params": params("hi")}])
    newest = list(reversed(made))
    assert [b.id for b in c.messages.batches.list(limit=2)] == newest + before  # the SDK pages on
    page = c.messages.batches.list(limit=2)
    assert [b.id for b in page.data] == newest[:2] and page.has_more and page.last_id == newest[1]
    back = c.messages.batches.list(limit=2, before_id=newest[4])
    assert [b.id for b in back.data] == newest[2:4] and back.has_more and back.first_id == newest[2]
    assert [b.id for b in back.get_next_page().data] == newest[:2]
    for batch_id in made:
        wait(c, batch_id)


def test_cancel_ends_the_batch_with_the_rest_canceled(fake_server):
    started = []

    async def fake(svc, caller, body):
        started.append(body["messages"][0]["content"])
        await asyncio.sleep(0.1)
        return {"id": "msg_x", "type": "message", "role": "assistant", "model": "tiny-chat", "content": [],
                "stop_reason": "end_turn", "stop_sequence": None, "usage": {"input_tokens": 1, "output_tokens": 0}}

    fake_server.fake = fake
    c = claude(fake_server)
    b = c.messages.batches.create(requests=[{"custom_id": f"r{i}", "params": params(str(i))} for i in range(100)])
    oa = openai.OpenAI(base_url=fake_server.base_url, api_key=fake_server.keys["paid"])
    while oa.batches.retrieve("batch_" + b.id.removeprefix("msgbatch_")).request_counts.completed < 8:
        time.sleep(0.02)  # (its progress shows on the OpenAI route: Anthropic's counts come at the end)
    with pytest.raises(anthropic.APIStatusError) as running:  # deleting a running batch: cancel it first
        c.messages.batches.delete(b.id)
    assert running.value.status_code == 409
    canceling = c.messages.batches.cancel(b.id)
    assert canceling.processing_status in ("canceling", "ended") and canceling.cancel_initiated_at is not None
    done = wait(c, b.id, timeout=15)
    counts = done.request_counts
    assert counts.succeeded + counts.canceled == 100 and counts.succeeded >= 8 and counts.canceled >= 40
    kinds = [r.result.type for r in c.messages.batches.results(b.id)]
    assert kinds.count("succeeded") == counts.succeeded and kinds.count("canceled") == counts.canceled
    assert c.messages.batches.cancel(b.id).processing_status == "ended"  # cancelling a cancelled batch: harmless
    assert len(started) < 60


def test_a_batch_out_of_time_ends_with_the_rest_expired(fake_server, monkeypatch):
    async def fake(svc, caller, body):
        if body["messages"][0]["content"] != "0":
            await asyncio.sleep(3600)  # never in time
        return {"id": "msg_x", "type": "message", "role": "assistant", "model": "tiny-chat", "content": [],
                "stop_reason": "end_turn", "stop_sequence": None, "usage": {"input_tokens": 1, "output_tokens": 0}}

    fake_server.fake = fake
    monkeypatch.setattr(api, "WINDOW_S", 2)
    c = claude(fake_server)
    b = c.messages.batches.create(requests=[{"custom_id": f"r{i}", "params": params(str(i))} for i in range(4)])
    done = wait(c, b.id, timeout=15)
    assert (done.request_counts.succeeded, done.request_counts.expired) == (1, 3)
    assert [r.result.type for r in c.messages.batches.results(b.id)] == ["succeeded", "expired", "expired", "expired"]
    with pytest.raises(anthropic.APIStatusError) as ended:
        c.messages.batches.cancel(b.id)
    assert ended.value.status_code == 409


def test_deleting_an_ended_batch_deletes_its_files_too(server):
    c = claude(server)
    b = wait(c, c.messages.batches.create(requests=[{"custom_id": "x", "params": params("hi")}]).id)
    internal = "batch_" + b.id.removeprefix("msgbatch_")
    oa = openai.OpenAI(base_url=server.base_url, api_key=server.keys["paid"])
    files = [oa.batches.retrieve(internal).input_file_id, oa.batches.retrieve(internal).output_file_id]
    assert c.messages.batches.delete(b.id).type == "message_batch_deleted"
    with pytest.raises(anthropic.NotFoundError):
        c.messages.batches.retrieve(b.id)
    for file_id in files:
        with pytest.raises(openai.NotFoundError):
            oa.files.retrieve(file_id)
    with pytest.raises(anthropic.NotFoundError):
        c.messages.batches.delete(b.id)


@pytest.mark.parametrize("body, param", [
    ({"requests": []}, "requests"),
    ({"requests": [{"custom_id": "a b", "params": {}}]}, "requests[0].custom_id"),
    ({"requests": [{"custom_id": "x" * 65, "params": {}}]}, "requests[0].custom_id"),
    ({"requests": [{"custom_id": "a", "params": {}}, {"custom_id": "a", "params": {}}]}, "requests[1].custom_id"),
    ({"requests": [{"custom_id": "a", "params": []}]}, "requests[0].params"),
    ({"requests": [{"custom_id": "a", "params": {}}], "model": "tiny-chat"}, "model"),
])
def test_bad_creates_are_400s_naming_the_field_both_sdks_read(server, body, param):
    r = httpx.post(f"{server.url}/v1/messages/batches", json=body, headers={"x-api-key": server.keys["paid"]})
    assert r.status_code == 400, r.text
    assert r.json()["type"] == "error" and r.json()["error"]["param"] == param


def test_another_keys_batch_and_an_openai_batch_are_not_found(server):
    c = claude(server)
    b = c.messages.batches.create(requests=[{"custom_id": "x", "params": params("hi")}])
    other = claude(server, "free")
    for call in (lambda: other.messages.batches.retrieve(b.id), lambda: other.messages.batches.cancel(b.id),
                 lambda: list(other.messages.batches.results(b.id)), lambda: other.messages.batches.delete(b.id),
                 lambda: c.messages.batches.retrieve("batch_" + b.id.removeprefix("msgbatch_")),
                 lambda: c.messages.batches.retrieve("msgbatch_nope")):
        with pytest.raises(anthropic.NotFoundError):
            call()
    oa = openai.OpenAI(base_url=server.base_url, api_key=server.keys["paid"])
    f = oa.files.create(file=("in.jsonl", b'{"custom_id": "y", "method": "POST", "url": "/v1/chat/completions", '
                                          b'"body": {"model": "tiny-chat", "messages": [], "max_tokens": 1}}\n'),
                        purpose="batch")
    plain = oa.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
    with pytest.raises(anthropic.NotFoundError):
        c.messages.batches.retrieve("msgbatch_" + plain.id.removeprefix("batch_"))
    wait(c, b.id)
