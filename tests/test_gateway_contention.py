"""The gate behind real HTTP: tier order under contention, 429 headers, leaving the queue."""

from __future__ import annotations

import asyncio
import time

import httpx
import openai
import pytest

from tests.helpers import start_server, write_config


@pytest.fixture(scope="module")
def one_slot_server(tiny_chat, tmp_path_factory):
    folder = tmp_path_factory.mktemp("one-slot")
    config = write_config(folder, {"tiny-chat": ("chat", tiny_chat)}, "gate:\n  slots: 1\n")
    # free may queue only 20; subscriber none at all
    text = config.read_text().replace(
        "  - name: subscriber\n    keys_env: TEST_KEYS_SUBSCRIBER\n    max_inflight: 4\n    max_queued: 64",
        "  - name: subscriber\n    keys_env: TEST_KEYS_SUBSCRIBER\n    max_inflight: 4\n    max_queued: 0")
    config.write_text(text.replace("    max_queued: 64\n    latency_target_s: 600\n  - name: batch",
                                   "    max_queued: 20\n    latency_target_s: 600\n  - name: batch"))
    server = start_server(config)
    yield server
    server.stop()


def gate_state(server):
    g = server.services.gate
    return server.call(lambda: ({t: g.queued(t) for t in g.tiers}, dict(g.inflight)))


def wait_until(pred, timeout=30):
    end = time.time() + timeout
    while time.time() < end:
        if pred():
            return True
        time.sleep(0.02)
    return False


async def hold_the_slot(s, key="free"):
    """A long request that holds the only slot until the caller cancels it (client goes away)."""
    client = openai.AsyncOpenAI(base_url=s.base_url, api_key=s.keys[key], max_retries=0)
    task = asyncio.create_task(client.chat.completions.create(
        model="tiny-chat", messages=[{"role": "user", "content": "hold"}], max_tokens=480, temperature=0))
    while gate_state(s)[1][key] == 0:
        assert not task.done(), task.result()
        await asyncio.sleep(0.01)
    return task


async def let_go(task):
    task.cancel()
    try:
        await task
    except (asyncio.CancelledError, openai.APIError):
        pass


def test_paid_overtakes_queued_free_requests(one_slot_server):
    s = one_slot_server
    done: list[str] = []

    async def main():
        free = openai.AsyncOpenAI(base_url=s.base_url, api_key=s.keys["free"], max_retries=0)
        paid = openai.AsyncOpenAI(base_url=s.base_url, api_key=s.keys["paid"], max_retries=0)

        async def ask(c, tag):
            await c.chat.completions.create(model="tiny-chat", messages=[{"role": "user", "content": tag}],
                                            max_tokens=8, temperature=0)
            done.append(tag)

        holder = await hold_the_slot(s)
        frees = []
        for i in range(7):
            frees.append(asyncio.create_task(ask(free, f"free-{i}")))
            while gate_state(s)[0]["free"] < i + 1:  # queued in this order
                await asyncio.sleep(0.01)
        paid_task = asyncio.create_task(ask(paid, "paid"))
        while gate_state(s)[0]["paid"] == 0:
            await asyncio.sleep(0.01)
        await let_go(holder)
        await asyncio.gather(paid_task, *frees)

    asyncio.run(main())
    assert done == ["paid"] + [f"free-{i}" for i in range(7)], done


def test_queue_limit_gives_429_with_headers(one_slot_server):
    s = one_slot_server

    async def main():
        holder = await hold_the_slot(s)
        async with httpx.AsyncClient() as c:
            r = await c.post(f"{s.base_url}/chat/completions", headers={"Authorization": f"Bearer {s.keys['subscriber']}"},
                             json={"model": "tiny-chat", "messages": [{"role": "user", "content": "x"}], "max_tokens": 2})
        await let_go(holder)
        return r

    r = asyncio.run(main())
    assert r.status_code == 429
    err = r.json()["error"]
    assert err["code"] == "queue_full" and err["type"] == "rate_limit_error"
    retry = int(r.headers["retry-after"])
    assert 1 <= retry <= 120
    assert int(r.headers["retry-after-ms"]) == retry * 1000
    assert r.headers["x-ratelimit-limit-requests"] == "4"
    assert r.headers["x-ratelimit-remaining-requests"] == "0"  # refused: no room until the reset
    assert r.headers["x-ratelimit-reset-requests"] == f"{retry}s"


def test_client_that_leaves_the_queue_is_removed(one_slot_server):
    s = one_slot_server

    async def main():
        holder = await hold_the_slot(s)
        free = openai.AsyncOpenAI(base_url=s.base_url, api_key=s.keys["free"], max_retries=0)
        leaver = asyncio.create_task(free.chat.completions.create(
            model="tiny-chat", messages=[{"role": "user", "content": "leave"}], max_tokens=2))
        while gate_state(s)[0]["free"] == 0:
            await asyncio.sleep(0.01)
        leaver.cancel()  # the client goes away while queued
        left = await asyncio.to_thread(wait_until, lambda: gate_state(s)[0]["free"] == 0, 10)
        still_holding = gate_state(s)[1]["free"] == 1
        await let_go(holder)
        return left, still_holding

    left, still_holding = asyncio.run(main())
    assert left and still_holding  # it left the queue by itself, not because the slot freed
    zero = {"paid": 0, "subscriber": 0, "free": 0, "batch": 0}
    assert wait_until(lambda: gate_state(s) == (zero, zero))


def test_streaming_client_that_disconnects_frees_its_slot(one_slot_server):
    s = one_slot_server
    worker = None
    with httpx.stream("POST", f"{s.base_url}/chat/completions", headers={"Authorization": f"Bearer {s.keys['paid']}"},
                      json={"model": "tiny-chat", "messages": [{"role": "user", "content": "long"}],
                            "max_tokens": 400, "stream": True}) as r:
        lines = r.iter_lines()
        for _ in range(4):
            next(lines)
        worker = s.services.arbiter.workers["tiny-chat"]
        steps_at_close = worker.steps
    assert wait_until(lambda: gate_state(s)[1]["paid"] == 0, 10)
    time.sleep(0.3)
    settled = worker.steps
    time.sleep(0.3)
    assert worker.steps == settled  # no more decode steps: the row left the batch
    assert settled - steps_at_close < 100


def test_demand_starts_at_the_door_and_ends_with_the_request(one_slot_server, monkeypatch):
    """A paid request counts as demand (batch work pauses) from the moment its key passes the
    door, while its body is still on the wire; a body that turns out bad ends that demand with
    its 400 (not when the door window passes), and a served request hands it to its ticket."""
    import gateway.admission as admission

    monkeypatch.setattr(admission, "DOOR_WINDOW_S", 60.0)  # only the request's own end may end it
    s = one_slot_server
    gate, arbiter = s.services.gate, s.services.arbiter

    def demand():
        return s.call(lambda: (gate.others_busy(), arbiter._others_busy))

    async def main():
        seen_before_body = []

        async def body(payload: bytes):
            assert wait_until(lambda: demand() == (True, True), timeout=10)
            seen_before_body.append(demand())
            yield payload

        headers = {"authorization": f"Bearer {s.keys['paid']}", "content-type": "application/json"}
        async with httpx.AsyncClient(base_url=s.base_url, timeout=30) as client:
            bad = await client.post("/chat/completions", headers=headers, content=body(b'{"model": "tiny-chat", '))
            assert bad.status_code == 400, bad.text
            after_bad = demand()
            good = await client.post("/chat/completions", headers=headers, content=body(
                b'{"model": "tiny-chat", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}'))
            assert good.status_code == 200, good.text
        return seen_before_body, after_bad, demand()

    seen_before_body, after_bad, after_good = asyncio.run(main())
    assert seen_before_body == [(True, True), (True, True)]
    assert after_bad == (False, False)
    assert after_good == (False, False)
