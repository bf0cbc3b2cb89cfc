"""Webhooks: signed events when background responses and batches end, checked by the openai SDK's
own ``webhooks.unwrap`` at a receiver on 127.0.0.1; retries, filters, and the secret's config."""

from __future__ import annotations

import asyncio
import base64
import http.server
import io
import json
import os
import queue
import socketserver
import threading
import time
import uuid
from dataclasses import replace

import httpx
import openai
import pytest

from gateway.auth import key_id
from gateway.config import ConfigError, load_config
from gateway.webhook_outbox import Delivery, RedisOutbox, SQLiteOutbox
from gateway.webhooks import endpoints_of, sign
from tests.helpers import shared_store, start_server, write_config

SECRET = "whsec_" + base64.b64encode(b"a test secret of 32 bytes length").decode()
SDK = openai.OpenAI(api_key="unused", base_url="http://127.0.0.1:9")  # only its webhooks.unwrap is used


class Receiver:
    """An HTTP endpoint that records what it is sent and answers each with the next scripted
    status (200 once the script is empty)."""

    def __init__(self) -> None:
        self.got: queue.Queue[tuple[bytes, dict[str, str]]] = queue.Queue()
        self.statuses: list[int] = []
        self.delay_s = 0.0  # before each answer: a slow endpoint
        receiver = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - the http.server name
                body = self.rfile.read(int(self.headers["content-length"]))
                receiver.got.put((body, {k.lower(): v for k, v in self.headers.items()}))
                time.sleep(receiver.delay_s)
                try:
                    self.send_response(receiver.statuses.pop(0) if receiver.statuses else 200)
                    self.send_header("content-length", "0")
                    self.end_headers()
                except OSError:  # the sender left meanwhile
                    pass

            def log_message(self, *args) -> None:
                pass

        self.http = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.http.server_address[1]
        threading.Thread(target=self.http.serve_forever, daemon=True).start()

    def next(self, timeout: float = 30.0) -> tuple[bytes, dict[str, str]]:
        """The next request's body and headers, as ``webhooks.unwrap`` takes them."""
        return self.got.get(timeout=timeout)

    def nothing(self, wait_s: float = 0.5) -> bool:
        try:
            self.got.get(timeout=wait_s)
        except queue.Empty:
            return True
        return False


@pytest.fixture(scope="module")
def hooked(tiny_chat, tmp_path_factory):
    """A server with two endpoints: ``every`` gets every event; ``batches`` only batch.completed
    of the free key's."""
    every, batches = Receiver(), Receiver()
    os.environ["TG_TEST_WEBHOOK_SECRET"] = SECRET
    folder = tmp_path_factory.mktemp("webhooks")
    free_id = key_id("key-free-2")  # tests.helpers.start_server's key of the free tier
    extra = (f"webhooks:\n  - url: http://127.0.0.1:{every.port}/hook\n    secret_env: TG_TEST_WEBHOOK_SECRET\n"
             f"  - url: http://127.0.0.1:{batches.port}/hook\n    secret_env: TG_TEST_WEBHOOK_SECRET\n"
             f"    events: [batch.completed]\n    keys: [{free_id}]\n")
    s = start_server(write_config(folder, {"tiny-chat": ("chat", tiny_chat)}, extra))
    assert s.keys["free"] == "key-free-2"
    yield s, every, batches
    s.stop()
    every.http.shutdown()
    batches.http.shutdown()
    del os.environ["TG_TEST_WEBHOOK_SECRET"]


def client(server, tier="paid") -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key=server.keys[tier], max_retries=0, timeout=120)


def test_a_background_response_that_ends_is_announced_signed(hooked):
    s, every, batches = hooked
    made = client(s).responses.create(model="tiny-chat", input="hi", max_output_tokens=4, background=True)
    body, headers = every.next()
    event = SDK.webhooks.unwrap(body, headers, secret=SECRET)  # raises unless the signature holds
    assert event.type in ("response.completed", "response.incomplete") and event.data.id == made.id
    assert event.id == headers["webhook-id"] and event.id.startswith("evt_") and abs(event.created_at - time.time()) < 60
    assert client(s).responses.retrieve(made.id).status == event.type.removeprefix("response.")
    with pytest.raises(openai.InvalidWebhookSignatureError):
        SDK.webhooks.unwrap(body, headers, secret="whsec_" + base64.b64encode(b"another secret").decode())
    assert batches.nothing()  # not an event it asked for


def test_a_cancelled_one_is_announced_cancelled_and_a_live_one_not_at_all(hooked):
    s, every, _ = hooked
    c = client(s)
    c.responses.create(model="tiny-chat", input="hi", max_output_tokens=2)  # not background: no event
    gate = s.services.gate
    tickets = [s.wait(gate.acquire("paid", "tiny-chat")) for _ in range(gate.limits["paid"])]
    try:
        made = c.responses.create(model="tiny-chat", input="hi", max_output_tokens=4, background=True)
        c.responses.cancel(made.id)
    finally:
        for ticket in tickets:
            s.call(gate.release, ticket)
    body, headers = every.next()
    event = SDK.webhooks.unwrap(body, headers, secret=SECRET)
    assert (event.type, event.data.id) == ("response.cancelled", made.id)
    assert every.nothing()


def test_a_background_response_whose_process_dies_as_it_ends_still_has_its_event(hooked, monkeypatch):
    """The write that ends a background response carries its event: the process dying just after
    that write (here its task cut there) leaves the event in the outbox, sent all the same. It
    used to be written after the record, by a task of its own: the response never had one."""
    s, every, _ = hooked
    store, died = s.app.state.responses, []
    update_running = store.update_running

    async def dying_update(record, along=None):
        kept = await update_running(record, along)
        if kept and not died and record.response["status"] not in ("queued", "in_progress"):
            died.append(record.id)
            raise asyncio.CancelledError  # its process dies here: nothing more runs
        return kept

    monkeypatch.setattr(store, "update_running", dying_update)
    made = client(s).responses.create(model="tiny-chat", input="hi", max_output_tokens=2, background=True)
    event = SDK.webhooks.unwrap(*every.next(timeout=10), secret=SECRET)
    assert died == [made.id] and event.data.id == made.id
    assert event.type == f"response.{client(s).responses.retrieve(made.id).status}"
    assert every.nothing()


@pytest.mark.parametrize("spec", ["sqlite", "redis"])
def test_an_ending_write_carries_its_event_only_when_it_ends_the_response(spec, tmp_path, request):
    """On both stores: the record that ends a response and its deliveries are written together;
    a write refused (the response was cancelled meanwhile, or another process took it over)
    writes neither."""
    from gateway.response_store import RedisResponses, SQLiteResponses, StoredResponse

    url, prefix = f"http://127.0.0.1:9/hook-{uuid.uuid4().hex[:8]}", f"t{uuid.uuid4().hex[:8]}:"
    if spec == "sqlite":
        store, outbox = SQLiteResponses(tmp_path / "batches.sqlite3"), SQLiteOutbox(tmp_path / "batches.sqlite3")
    else:
        redis_url = request.getfixturevalue("redis_url")
        store, outbox = RedisResponses(redis_url, prefix), RedisOutbox(redis_url, 3600.0, prefix)

    def record(status: str, runner: str = "r1") -> StoredResponse:
        return StoredResponse("resp_e", "key-a", 1, {"id": "resp_e", "status": status, "background": True}, [], [],
                              time.time(), None, runner)

    def event(n: int):
        return outbox.along([Delivery(f"whd_{n}", url, f"evt_{n}", "{}", time.time())], time.time())

    async def go():
        await store.open()
        await outbox.open()
        try:
            await store.put(record("in_progress"))
            assert not await store.update_running(record("completed", runner="r2"), event(1))  # not its runner
            assert await outbox.pending([url]) == {url: 0}
            assert await store.update_running(record("completed"), event(2))
            assert not await store.update_running(record("cancelled"), event(3))  # it ended already
            now = time.time()
            assert [d.id for d in await outbox.claim({url: 10}, "A", now, now + 30, now - 60)] == ["whd_2"]
        finally:
            await outbox.close()
            await store.close()

    asyncio.run(go())


def test_a_batch_that_ends_is_announced_to_both_endpoints_for_the_free_key(hooked):
    s, every, batches = hooked
    for tier in ("paid", "free"):
        c = client(s, tier)
        line = {"custom_id": "1", "method": "POST", "url": "/v1/chat/completions",
                "body": {"model": "tiny-chat", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}}
        upload = c.files.create(file=("in.jsonl", io.BytesIO((json.dumps(line) + "\n").encode())), purpose="batch")
        batch = c.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h")
        event = SDK.webhooks.unwrap(*every.next(), secret=SECRET)
        assert (event.type, event.data.id) == ("batch.completed", batch.id)
        assert c.batches.retrieve(batch.id).status == "completed"
    event = SDK.webhooks.unwrap(*batches.next(), secret=SECRET)  # the free key's only
    assert event.type == "batch.completed" and event.data.id == batch.id and batches.nothing()


@pytest.mark.parametrize("spec", ["sqlite", "redis"])
def test_a_batch_whose_finish_is_cut_short_after_it_ended_still_has_its_event(spec, tiny_chat, tmp_path, request):
    """A batch's end and its event are written in one step (the compare-and-set): a finish cut
    short just after that step (a shutdown's cancel landing as the store's thread committed it, or
    the process killed there) leaves the event in the outbox, for this or the next process to send.
    It used to be written after the set, by a task of its own: the ended batch never had one."""
    import gateway.webhooks as webhooks
    from batch.lines import error_line
    from batch.runner import Runner, open_store
    from batch.store import BatchInfo
    from gateway.app import build_services
    from gateway.auth import KeyRing
    from tests.helpers import TIERS

    url = f"http://127.0.0.1:9/hook-{uuid.uuid4().hex[:8]}"  # its own (a shared Redis)

    async def go():
        config = load_config(write_config(tmp_path, {"tiny-chat": ("chat", tiny_chat)}))
        svc = build_services(config, KeyRing({t: [f"k-{t}"] for t in TIERS}))
        store = request.getfixturevalue("redis_url") if spec == "redis" else "sqlite"
        svc.webhooks = hooks = webhooks.Webhooks([webhooks.Endpoint(url, b"secret", None, None)],
                                                 webhooks.open_outbox(store, tmp_path, webhooks.RETRY_WINDOW_S))
        runner = Runner(svc, open_store(store, tmp_path))  # its loops not started
        await hooks.outbox.open()  # (as the app's start does, before the runner's)
        await runner.store.open()
        batch_id = f"batch_cut{uuid.uuid4().hex[:8]}"
        try:
            await runner.store.create_batch(BatchInfo(batch_id, "me", "/v1/chat/completions", "file-x", "24h", 0,
                                                      int(time.time()) + 600))
            await runner.store.start(batch_id, [], [error_line(0, "1", "invalid_request", "bad")], int(time.time()))
            real = runner.store.set_status

            async def cut_after_the_end(batch_id, allowed, status, *args, **fields):
                changed = await real(batch_id, allowed, status, *args, **fields)
                if changed and status == "completed":
                    raise asyncio.CancelledError  # the stop's cancel, as the store answers
                return changed

            runner.store.set_status = cut_after_the_end
            with pytest.raises(asyncio.CancelledError):
                await runner._finish(batch_id)
            assert (await runner.store.get_batch(batch_id)).status == "completed"
            assert await hooks.outbox.pending([url]) == {url: 1}
            assert not await real(batch_id, ["finalizing"], "completed", hooks.along("batch.completed", batch_id, "me"))
            assert await hooks.outbox.pending([url]) == {url: 1}  # a set that lost writes no event
            now = time.time()
            sent, = await hooks.outbox.claim({url: 10}, "next", now, now + 30, now - 3600)
            event = json.loads(sent.body)
            assert (event["type"], event["data"]["id"]) == ("batch.completed", batch_id)
        finally:
            await runner.store.close()
            await hooks.outbox.close()
            await svc.arbiter.stop()

    asyncio.run(go())


def test_a_failed_delivery_is_tried_again_with_the_same_id(hooked, monkeypatch):
    import gateway.webhooks as webhooks

    monkeypatch.setattr(webhooks, "FIRST_RETRY_S", 0.05)
    s, every, _ = hooked
    every.statuses = [500, 503]
    made = client(s).responses.create(model="tiny-chat", input="hi", max_output_tokens=2, background=True)
    attempts = [every.next() for _ in range(3)]
    assert len({h["webhook-id"] for _, h in attempts}) == 1 and {b for b, _ in attempts} == {attempts[0][0]}
    assert SDK.webhooks.unwrap(*attempts[-1], secret=SECRET).data.id == made.id
    assert every.nothing()
    scraped = httpx.get(f"{s.url}/metrics", timeout=30).text
    # named by scheme, host and place in webhooks:, never the path or query a receiver's token may be in
    assert f'tiergate_webhook_deliveries_total{{outcome="retried",url="http://127.0.0.1:{every.port} #0"}} 2.0' \
        in scraped and "/hook" not in scraped


def test_the_signature_is_the_one_the_sdk_checks():
    body = '{"id":"evt_1","type":"batch.completed"}'
    now = int(time.time())
    for secret, key in ((SECRET, base64.b64decode(SECRET[6:])), ("plain", b"plain")):
        headers = {"webhook-id": "evt_1", "webhook-timestamp": str(now), "webhook-signature": sign(key, "evt_1", now, body)}
        SDK.webhooks.verify_signature(body, headers, secret=secret)
        with pytest.raises(openai.InvalidWebhookSignatureError):
            SDK.webhooks.verify_signature(body.replace("1", "2"), headers, secret=secret)


def test_an_endpoint_whose_secret_is_not_set_is_a_config_error(tmp_path, monkeypatch):
    monkeypatch.delenv("TG_UNSET_SECRET", raising=False)
    config = load_config(write_config(tmp_path, {"m": ("chat", tmp_path / "m")},
                                      "webhooks:\n  - {url: 'http://127.0.0.1:1/h', secret_env: TG_UNSET_SECRET}\n"),
                         check_paths=False)
    with pytest.raises(ConfigError, match=r"webhooks\[0\].*TG_UNSET_SECRET"):
        endpoints_of(config)
    monkeypatch.setenv("TG_UNSET_SECRET", "whsec_not base64!")
    with pytest.raises(ConfigError, match="base64"):
        endpoints_of(config)
    monkeypatch.setenv("TG_UNSET_SECRET", SECRET)
    twice = load_config(write_config(tmp_path, {"m": ("chat", tmp_path / "m")},
                                     "webhooks:\n  - {url: 'http://127.0.0.1:1/h', secret_env: TG_UNSET_SECRET}\n"
                                     "  - {url: 'http://127.0.0.1:1/h', secret_env: TG_UNSET_SECRET, events: [batch.completed]}\n"),
                        check_paths=False)
    with pytest.raises(ConfigError, match=r"webhooks\[1\].*listed twice"):
        endpoints_of(twice)


def test_a_delivery_whose_retry_window_ends_is_dropped(hooked, monkeypatch):
    """Tries 1, 2, 3 fail; the wait before a 4th (0.2 * 2**2 s) would end past the window: dropped."""
    import gateway.webhooks as webhooks

    monkeypatch.setattr(webhooks, "FIRST_RETRY_S", 0.2)
    monkeypatch.setattr(webhooks, "RETRY_WINDOW_S", 1.2)
    s, every, _ = hooked
    every.statuses = [500] * 10
    try:
        client(s).responses.create(model="tiny-chat", input="hi", max_output_tokens=2, background=True)
        ids = {every.next()[1]["webhook-id"] for _ in range(3)}
        assert len(ids) == 1 and every.nothing(1.5)
    finally:
        every.statuses = []
    scraped = httpx.get(f"{s.url}/metrics", timeout=30).text
    assert f'tiergate_webhook_deliveries_total{{outcome="dropped",url="http://127.0.0.1:{every.port} #0"}} 1.0' in scraped


@pytest.fixture(params=["sqlite", "redis"])
def outbox_factory(request, tmp_path):
    """Outboxes that share one store, as the processes on one store do."""
    return shared_store(request, tmp_path, SQLiteOutbox, lambda url, prefix: RedisOutbox(url, 3600.0, prefix))


def test_the_outbox_gives_a_delivery_to_one_claimant_at_a_time(outbox_factory):
    x, y = "http://127.0.0.1:1/x", "http://127.0.0.1:1/y"

    async def go():
        a, b = outbox_factory(), outbox_factory()  # two processes
        await a.open()
        await b.open()
        try:
            now = time.time()
            early = now - 100
            dx = Delivery("whd_x", x, "evt_1", '{"id":"evt_1"}', now)
            dy = Delivery("whd_y", y, "evt_1", '{"id":"evt_1"}', now)
            await a.add([dx, dy], now)
            assert await b.pending([x, y, "http://127.0.0.1:1/z"]) == {x: 1, y: 1, "http://127.0.0.1:1/z": 0}
            await b.add([dx], now + 50)  # written again (its first write's answer was lost): left as it was
            assert await b.pending([x, y]) == {x: 1, y: 1}
            assert await a.claim({x: 10}, "A", now, now + 30, early) == [dx]  # only its endpoints'
            assert await b.claim({x: 10}, "B", now + 29, now + 59, early) == []  # A holds it
            assert not await b.finish(dx, "B") and not await b.reschedule(dx, "B", 1, now)  # not B's to change
            assert await b.claim({x: 10}, "B", now + 30, now + 60, early) == [dx]  # A's claim ran out
            assert not await a.finish(dx, "A") and not await a.reschedule(dx, "A", 1, now)  # A, late, changes nothing
            assert await b.reschedule(dx, "B", 1, now + 40)  # B's try failed: the next at +40
            assert await a.claim({x: 10}, "A", now + 39, now + 69, early) == []
            again = await a.claim({x: 10}, "A", now + 40, now + 70, early)
            assert again == [replace(dx, attempt=1)]
            assert await a.finish(again[0], "A")  # delivered: gone
            assert await b.pending([x, y]) == {x: 0, y: 1}
            assert await a.claim({x: 10}, "A", now + 1000, now + 1030, early) == []
            assert await b.claim({x: 10, y: 10}, "B", now + 1000, now + 1030, early) == [dy]
            assert await b.reschedule(dy, "B", 1, now + 1000)
            assert await b.claim({y: 10}, "B", now + 1000, now + 1030, now + 1) == []  # its window is over
            assert await b.claim({y: 10}, "B", now + 1000, now + 1030, early) == []  # and it was deleted
        finally:
            await a.close()
            await b.close()

    asyncio.run(go())


def test_the_outbox_gives_each_endpoint_its_own_room(outbox_factory):
    """A claim takes up to each endpoint's own room, the soonest first: a backlog at one endpoint
    (listed first, and due first) does not take the room of another."""
    x, y = "http://127.0.0.1:1/x", "http://127.0.0.1:1/y"

    async def go():
        outbox = outbox_factory()
        await outbox.open()
        try:
            now = time.time()
            xs = [Delivery(f"whd_x{i}", x, f"evt_{i}", "{}", now) for i in range(5)]
            ys = [Delivery(f"whd_y{i}", y, f"evt_{i}", "{}", now) for i in range(5)]
            for i, (dx, dy) in enumerate(zip(xs, ys)):
                await outbox.add([dx], now - 10 + i)
                await outbox.add([dy], now - 5 + i)
            got = await outbox.claim({x: 2, y: 3}, "A", now, now + 30, now - 100)
            assert sorted(d.id for d in got) == ["whd_x0", "whd_x1", "whd_y0", "whd_y1", "whd_y2"]
        finally:
            await outbox.close()

    asyncio.run(go())


class Trickler:
    """An endpoint that sends ``head`` at once, then ``tail`` a byte every 0.1 s: an answer that
    never ends while each read gets something."""

    def __init__(self, head: bytes, tail: bytes) -> None:
        self.tries = 0
        trickler = self

        class Handler(socketserver.BaseRequestHandler):
            def handle(self) -> None:
                trickler.tries += 1
                try:
                    self.request.sendall(head)
                    for byte in tail:
                        time.sleep(0.1)
                        self.request.sendall(bytes([byte]))
                except OSError:  # the sender gave up
                    pass

        self.server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/hook"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


def test_a_try_ends_at_its_deadline_however_slowly_the_endpoint_answers(tmp_path, monkeypatch):
    """An endpoint whose status line and headers come a byte at a time fails its try at the
    deadline (a timeout per read never fires) and is tried again; one that answers 200 and then
    trickles its body is delivered: the status is the answer, the body is not waited for."""
    import gateway.webhooks as webhooks

    monkeypatch.setattr(webhooks, "TIMEOUT_S", 1.0)
    monkeypatch.setattr(webhooks, "FIRST_RETRY_S", 0.05)
    slow_head = Trickler(b"HTTP/1.1 200 OK\r\n", b"x-padding: " + b"." * 600)
    slow_body = Trickler(b"HTTP/1.1 200 OK\r\ncontent-length: 600\r\n\r\n", b"." * 600)

    async def go():
        hooks = webhooks.Webhooks([webhooks.Endpoint(t.url, b"secret", None, None) for t in (slow_head, slow_body)],
                                  SQLiteOutbox(tmp_path / "batches.sqlite3"))
        await hooks.start()
        try:
            await hooks.outbox.add(hooks.deliveries("batch.completed", "batch_1", "key"), time.time())
            hooks.written()
            await asyncio.sleep(3.0)
            return dict(hooks.outcomes)
        finally:
            await hooks.stop()

    try:
        outcomes = asyncio.run(go())
        assert outcomes.get((slow_body.url, "delivered")) == 1 and slow_body.tries == 1
        assert outcomes.get((slow_head.url, "retried"), 0) >= 2 and slow_head.tries >= 2
    finally:
        slow_head.server.shutdown()
        slow_body.server.shutdown()


def test_an_endpoint_that_never_answers_leaves_room_for_the_others(outbox_factory, monkeypatch):
    """``stuck`` (listed first) holds each try until the 10 s timeout; its tries in flight are
    capped per endpoint, so ``ok`` gets every event waiting for it at once, on either store."""
    import gateway.webhooks as webhooks

    monkeypatch.setattr(webhooks, "MAX_TRYING", 4)
    monkeypatch.setattr(webhooks, "MAX_TRYING_EACH", 2)
    monkeypatch.setattr(webhooks, "STOP_WAIT_S", 0.2)
    stuck, ok = Receiver(), Receiver()
    stuck.delay_s = 15.0
    urls = [f"http://127.0.0.1:{r.port}/hook" for r in (stuck, ok)]

    async def go():
        made = outbox_factory()  # the events, made before the loop's first turn: it has 16 to choose from
        await made.open()
        body = [json.dumps({"data": {"id": f"batch_{i}"}}) for i in range(8)]
        await made.add([Delivery(f"whd_{i}_{j}", url, f"evt_{i}", body[i], time.time())
                        for i in range(8) for j, url in enumerate(urls)], time.time())
        await made.close()
        hooks = webhooks.Webhooks([webhooks.Endpoint(url, b"secret", None, None) for url in urls], outbox_factory())
        await hooks.start()
        try:
            got = [json.loads((await asyncio.to_thread(ok.next, 3))[0])["data"]["id"] for _ in range(8)]
            assert sorted(got) == sorted(f"batch_{i}" for i in range(8))
            assert hooks.trying[urls[0]] == 2
        finally:
            await hooks.stop()

    try:
        asyncio.run(go())
    finally:
        stuck.http.shutdown()
        ok.http.shutdown()


def test_an_event_whose_try_was_cut_by_a_shutdown_is_sent_by_the_next_start(tiny_chat, tmp_path, monkeypatch):
    """The endpoint is slow; the server stops while its first try is in flight: the try is
    released to the outbox, and the server started again on the same store sends the same event
    (its webhook-id and body) at once."""
    import gateway.webhooks as webhooks

    monkeypatch.setattr(webhooks, "STOP_WAIT_S", 0.2)
    monkeypatch.setenv("TG_TEST_WEBHOOK_SECRET", SECRET)
    slow = Receiver()
    slow.delay_s = 5.0
    config = write_config(tmp_path, {"tiny-chat": ("chat", tiny_chat)},
                          f"webhooks:\n  - url: http://127.0.0.1:{slow.port}/hook\n    secret_env: TG_TEST_WEBHOOK_SECRET\n")
    try:
        s = start_server(config)
        try:
            made = client(s).responses.create(model="tiny-chat", input="hi", max_output_tokens=2, background=True)
            first = slow.next()
            pending = f'tiergate_webhook_pending{{url="http://127.0.0.1:{slow.port} #0"}}'
            deadline = time.time() + 4  # the gauge is read at each turn of the delivery loop (every 2 s)
            while f"{pending} 1.0" not in httpx.get(f"{s.url}/metrics", timeout=30).text:
                assert time.time() < deadline, "the pending delivery never showed in /metrics"
                time.sleep(0.1)
        finally:
            s.stop()
        slow.delay_s = 0.0
        s = start_server(config)
        try:
            second = slow.next(timeout=10)
            assert second[1]["webhook-id"] == first[1]["webhook-id"] and second[0] == first[0]
            assert SDK.webhooks.unwrap(*second, secret=SECRET).data.id == made.id
            assert slow.nothing(2.5)  # delivered: not again
            assert f"{pending} 0.0" in httpx.get(f"{s.url}/metrics", timeout=30).text  # counted since
        finally:
            s.stop()
    finally:
        slow.http.shutdown()


@pytest.mark.parametrize("url,shown", [
    ("https://hooks.example.com/services/T000/B000/SECRET", "https://hooks.example.com"),
    ("http://user:pw@127.0.0.1:9000/hook?token=SECRET", "http://127.0.0.1:9000"),
    ("http://[::1]:8080/x", "http://[::1]:8080"),
])
def test_metrics_name_an_endpoint_by_its_host_never_its_path_or_query(url, shown):
    """/metrics may be open to anyone who can reach the port, and receivers often carry a token in
    their URL's path or query (or user info): an endpoint is named by scheme, host and port, and
    its place in ``webhooks:``."""
    from gateway.webhooks import shown_url

    assert shown_url(url, 3) == f"{shown} #3" and "SECRET" not in shown_url(url) and "pw" not in shown_url(url)
