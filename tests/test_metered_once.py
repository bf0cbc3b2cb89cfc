"""A batch line is metered once, whatever runs it (issue #16: "nothing runs twice").

A line's usage is written when its serving block ends, before the runner records its outcome in
the batch store (another file, or other Redis keys): a process that dies between the two leaves a
metered line without an outcome, which another runner reclaims and runs again. Each of a batch
line's usage writes therefore carries a metering id, the same in every attempt and delivery, and
the usage store counts an id once. Here: both stores recording the same usage twice, and the real
batch runner on the real chat model, killed between metering its lines and recording them.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid

import pytest

from accounts.redis_store import RedisAccounts
from accounts.sqlite_store import SQLiteAccounts
from accounts.store import METERED_KEEP_S
from accounts.usage import Usage
from batch.endpoints import ENDPOINTS
from batch.runner import Runner, open_store
from batch.store import BatchInfo, FileInfo
from gateway.app import build_services
from gateway.auth import KeyRing
from gateway.config import load_config
from tests.helpers import TIERS, shared_store, write_config
from tests.test_batches import chat_line, jsonl

DAY = "2025-01-01"


@pytest.fixture(params=["sqlite", "redis"])
def usage_store(request, tmp_path):
    """A usage store on a fresh file or a fresh prefix of the test Redis (both, parametrized)."""
    return shared_store(request, tmp_path, SQLiteAccounts, RedisAccounts)()


async def requests_of(store, key: str = "k") -> tuple[int, int]:
    """The key's requests and output tokens, all rows summed."""
    rows = await store.usage(key, None, None, None)
    return sum(r.usage.requests for r in rows), sum(r.usage.output_tokens for r in rows)


def one(tokens: int) -> Usage:
    return Usage(requests=1, output_tokens=tokens, gpu_seconds=0.5)


# -- the usage stores ------------------------------------------------------------------------------

def test_a_usage_recorded_twice_with_one_id_counts_once(usage_store):
    async def go():
        await usage_store.open()
        try:
            await usage_store.record(DAY, "k", "m", "batch", one(5), "batch_a:0:0")
            await usage_store.record(DAY, "k", "m", "batch", one(7), "batch_a:0:0")  # the line run again
            assert await requests_of(usage_store) == (1, 5)  # the first delivery's usage is the one kept
            assert await usage_store.gpu_spent("k", DAY) == pytest.approx(0.5)
            if isinstance(usage_store, RedisAccounts):  # the id outlives the batch's 24-hour window
                assert 86400 < await usage_store._r.ttl(usage_store.k("m", "batch_a:0:0")) <= METERED_KEEP_S
        finally:
            await usage_store.close()

    asyncio.run(go())


def test_different_ids_count_apart_and_no_id_counts_every_time(usage_store):
    async def go():
        await usage_store.open()
        try:
            await usage_store.record(DAY, "k", "m", "batch", one(5), "batch_a:0:0")
            await usage_store.record(DAY, "k", "m", "batch", one(5), "batch_a:1:0")
            await usage_store.record(DAY, "k", "m", "batch", one(5), "batch_b:0:0")
            assert await requests_of(usage_store) == (3, 15)
            for _ in range(3):  # HTTP requests carry no id: each counts
                await usage_store.record(DAY, "h", "m", "paid", one(2))
            assert await requests_of(usage_store, "h") == (3, 6)
        finally:
            await usage_store.close()

    asyncio.run(go())


def test_a_duplicate_inside_one_group_commit_counts_once(usage_store):
    """Concurrent records (SQLite commits the metered ones that arrive while a commit is in flight
    as one group, in one transaction): the check is per record, so an id twice in the group counts once,
    an id committed before counts not at all, and the rows beside them all count."""
    async def go():
        await usage_store.open()
        try:
            await usage_store.record(DAY, "k", "m", "batch", one(1), "batch_a:9:0")
            # SQLite: a metered row goes to the connection's thread and commits alone; the four
            # metered rows after it wait (the HTTP row goes to the usage journal at once)
            in_flight = usage_store.record(DAY, "k", "m", "batch", one(2), "batch_a:2:0")
            group = [usage_store.record(DAY, "k", "m", "batch", one(10), "batch_a:0:0"),
                     usage_store.record(DAY, "k", "m", "paid", one(100)),
                     usage_store.record(DAY, "k", "m", "batch", one(1000), "batch_a:0:0"),
                     usage_store.record(DAY, "k", "m", "batch", one(10_000), "batch_a:1:0"),
                     usage_store.record(DAY, "k", "m", "batch", one(100_000), "batch_a:9:0")]
            sqlite = isinstance(usage_store, SQLiteAccounts)
            if sqlite:  # the four wait for one transaction
                assert len(usage_store._next_group.rows) == 4 and group[1].done()
            await asyncio.gather(in_flight, *group)
            # batch_a:0:0 counts once, 10 or 1000: on Redis the concurrent records reach the server
            # in no fixed order (SQLite's group keeps the first)
            count, total = await requests_of(usage_store)
            assert count == 5 and total - (1 + 2 + 100 + 10_000) in ((10,) if sqlite else (10, 1000))
        finally:
            await usage_store.close()

    asyncio.run(go())


# -- the batch runner -------------------------------------------------------------------------------

@pytest.mark.parametrize("spec", ["sqlite", "redis"])
def test_a_line_metered_by_a_runner_that_died_before_recording_it_is_metered_once(spec, tiny_chat, tmp_path, request):
    """Runner A runs every line of a batch on the real chat model (each line's usage is written
    by the serving core) and dies before it records any outcome: its store's ``record`` never
    returns and its claims are not handed back, as after ``kill -9``. Runner B reclaims the lines
    once the claims lapse, runs each again and records it: the batch completes with every line's
    output, and each line is metered once. Line 0 asks for two choices, which are two serving
    blocks and one request of usage, written once under one metering id: metered once, not lost."""
    n = 3
    store = request.getfixturevalue("redis_url") if spec == "redis" else "sqlite"
    config = load_config(write_config(tmp_path, {"tiny-chat": ("chat", tiny_chat)},
                                      f"batch:\n  reclaim_after_s: 0.3\n  store: {store}\n"))
    data_dir = tmp_path / "tiergate-data"

    async def go():
        svc = build_services(config, KeyRing({t: [f"k-{t}"] for t in TIERS}))
        await svc.accounts.start()
        dying = open_store(store, data_dir)
        metered: list[int] = []

        async def dies_before_recording(job, outcome):
            metered.append(job.line.index)
            await asyncio.Event().wait()  # the process is gone: this never returns

        async def nothing_handed_back(name, jobs):
            pass

        dying.record, dying.release = dies_before_recording, nothing_handed_back
        a = Runner(svc, dying)
        await a.start()
        rows = [chat_line(i, max_tokens=4, temperature=0, n=2 if i == 0 else 1) for i in range(n)]
        f = FileInfo("file-in", "owner", "batch", "in.jsonl", 1, int(time.time()))
        await a.store.put_file(f, jsonl(rows))
        batch = BatchInfo(f"batch_{uuid.uuid4().hex[:12]}", "owner", "/v1/chat/completions", f.id, "24h",
                          int(time.time()), int(time.time()) + 3600)
        await a.store.create_batch(batch)
        a.soon("validate", batch.id)
        await until(lambda: len(metered) == n, "runner A ran every line")
        first = await requests_of(svc.accounts.store, "owner")
        assert first[0] == n and first[1] > 0  # every line was metered before its outcome was lost
        await a.stop()  # "killed": its lines stay claimed until reclaim_after_s

        calls: list[int] = []

        async def chat(svc_, caller, body):
            calls.append(1)
            return await ENDPOINTS["/v1/chat/completions"](svc_, caller, body)

        b = Runner(svc, open_store(store, data_dir), {"/v1/chat/completions": chat})
        final, output = await finished_by(b, svc, batch.id)
        assert len(calls) == n and b.recorded == n  # B did run every line again
        assert final.completed == n and final.failed == 0
        assert sorted(o["custom_id"] for o in output) == [f"req-{i}" for i in range(n)]
        assert all(o["response"]["status_code"] == 200 and o["response"]["body"]["choices"] for o in output)
        return first

    first = asyncio.run(go())

    assert metered(store, data_dir, "owner") == first  # each line once (line 0: two choices), as A metered it


async def finished_by(b: Runner, svc, batch_id: str) -> tuple[BatchInfo, list[dict]]:
    """Start runner ``b``, wait until the batch completes, and return it with its output lines;
    then stop ``b`` and the services."""
    await b.start()
    try:
        async def ended() -> bool:
            return (await b.store.get_batch(batch_id)).status == "completed"

        await until(ended, "runner B completed the batch")
        final = await b.store.get_batch(batch_id)
        return final, [json.loads(x) for x in (await b.store.file_content(final.fields["output_file_id"])).splitlines()]
    finally:
        await b.stop()
        await svc.accounts.stop()
        await svc.arbiter.stop()


def config_store(spec: str, data_dir):
    return RedisAccounts(spec) if spec.startswith("redis") else SQLiteAccounts(data_dir / "accounts.sqlite3")


def metered(spec: str, data_dir, owner: str) -> tuple[int, int]:
    """``owner``'s requests and output tokens in the config's usage store, read anew (after the
    runners stopped: every write has landed)."""
    async def read() -> tuple[int, int]:
        store = config_store(spec, data_dir)
        await store.open()
        try:
            return await requests_of(store, owner)
        finally:
            await store.close()

    return asyncio.run(read())


async def until(check, what: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while True:
        done = check()
        if asyncio.iscoroutine(done):
            done = await done
        if done:
            return
        assert time.monotonic() < deadline, f"timed out: {what}"
        await asyncio.sleep(0.05)


@pytest.mark.parametrize("spec", ["sqlite", "redis"])
def test_a_line_handed_back_mid_reply_is_metered_by_the_attempt_that_ends(spec, tiny_chat, tmp_path, request):
    """Runner A is stopped (a drain's hand-back) while both lines of a batch are half-way through
    long replies; runner B runs them again to their end. The cut attempt is not metered, so the
    line's metering id carries the attempt that ended: the batch owner is metered exactly the
    tokens of the replies in the output file. (Metering the cut attempt under that id would keep
    its partial tokens and drop the whole reply's as a duplicate.)"""
    from transformers import AutoTokenizer

    store = request.getfixturevalue("redis_url") if spec == "redis" else "sqlite"
    config = load_config(write_config(tmp_path, {"tiny-chat": ("chat", tiny_chat)},
                                      f"batch:\n  reclaim_after_s: 0.3\n  store: {store}\n"))
    data_dir = tmp_path / "tiergate-data"
    eos = AutoTokenizer.from_pretrained(str(tiny_chat)).eos_token_id
    rows = [chat_line(i, max_tokens=200, temperature=0, logit_bias={str(eos): -100}) for i in range(2)]
    owner = f"owner-{uuid.uuid4().hex[:8]}"  # the Redis is the session's: a key of its own

    async def go():
        svc = build_services(config, KeyRing({t: [f"k-{t}"] for t in TIERS}))
        await svc.accounts.start()
        a = Runner(svc, open_store(store, data_dir))
        await a.start()
        f = FileInfo("file-in", owner, "batch", "in.jsonl", 1, int(time.time()))
        await a.store.put_file(f, jsonl(rows))
        batch = BatchInfo(f"batch_{uuid.uuid4().hex[:12]}", owner, "/v1/chat/completions", f.id, "24h",
                          int(time.time()), int(time.time()) + 3600)
        await a.store.create_batch(batch)
        a.soon("validate", batch.id)
        await until(lambda: len(a._running) == 2, "runner A runs both lines")
        workers = svc.arbiter.workers
        await until(lambda: "tiny-chat" in workers and workers["tiny-chat"].steps >= 20,
                    "tokens into both replies")  # of 200 each
        handed = await a.hand_back()
        await a.store.close()
        assert handed.startswith("2 batch lines handed back") and a.recorded == 0
        b = Runner(svc, open_store(store, data_dir))
        final, output = await finished_by(b, svc, batch.id)
        assert final.completed == 2 and b.recorded == 2
        return sum(o["response"]["body"]["usage"]["completion_tokens"] for o in output)

    replied = asyncio.run(go())
    assert replied == 400

    assert metered(store, data_dir, owner) == (2, replied)


@pytest.mark.parametrize("spec", ["sqlite", "redis"])
def test_lines_that_end_as_their_batch_is_cancelled_keep_their_outcome_and_are_metered_once(
        spec, tiny_chat, tmp_path, request):
    """A batch of 6 lines is cancelled while 4 of them are on the real chat model (the batch
    tier's width) and 2 wait in the backlog; the 4 end right after the cancel, before a heartbeat
    could cut them (none comes in the test's time). A line that ended was metered, so it keeps its
    outcome: the finisher waits for the lines running before it fills the rest, and the 2 that
    waited are never run. The batch ends ``cancelled`` with 4 responses and 2 ``batch_cancelled``
    lines, and the owner is metered for exactly the output file's responses. (Filling every line
    at once with ``batch_cancelled`` metered answers the owner never got.)"""
    store = request.getfixturevalue("redis_url") if spec == "redis" else "sqlite"
    config = load_config(write_config(tmp_path, {"tiny-chat": ("chat", tiny_chat)},
                                      f"batch:\n  reclaim_after_s: 30\n  store: {store}\n"))
    data_dir = tmp_path / "tiergate-data"
    owner = f"owner-{uuid.uuid4().hex[:8]}"  # the Redis is the session's: a key of its own

    async def go():
        svc = build_services(config, KeyRing({t: [f"k-{t}"] for t in TIERS}))
        await svc.accounts.start()
        go_on, ran = asyncio.Event(), []

        async def chat(svc_, caller, body):
            await go_on.wait()
            ran.append(body["messages"][0]["content"])
            return await ENDPOINTS["/v1/chat/completions"](svc_, caller, body)

        runner = Runner(svc, open_store(store, data_dir), {"/v1/chat/completions": chat})
        runner.tick_s = 300.0  # no heartbeat cuts the lines running: they end first
        await runner.start()
        f = FileInfo("file-in", owner, "batch", "in.jsonl", 1, int(time.time()))
        await runner.store.put_file(f, jsonl([chat_line(i, max_tokens=4, temperature=0) for i in range(6)]))
        batch = BatchInfo(f"batch_{uuid.uuid4().hex[:12]}", owner, "/v1/chat/completions", f.id, "24h",
                          int(time.time()), int(time.time()) + 3600)
        await runner.store.create_batch(batch)
        runner.soon("validate", batch.id)
        await until(lambda: len(runner._running) == 4, "4 lines run, 2 wait")
        assert await runner.store.set_status(batch.id, ["in_progress"], "cancelling", cancelling_at=int(time.time()))
        runner.soon("finish", batch.id)  # as POST /v1/batches/{id}/cancel does
        await asyncio.sleep(0.3)  # the finisher at work
        go_on.set()

        async def ended() -> bool:
            return (await runner.store.get_batch(batch.id)).status == "cancelled"

        try:
            await until(ended, "the batch is cancelled")
            final = await runner.store.get_batch(batch.id)
            files = [await runner.store.file_content(final.fields[k]) if final.fields.get(k) else None
                     for k in ("output_file_id", "error_file_id")]
        finally:
            await runner.stop()
            await svc.accounts.stop()
            await svc.arbiter.stop()
        return final, [[json.loads(x) for x in (content or b"").splitlines()] for content in files], ran

    final, (output, errors), ran = asyncio.run(go())
    assert (final.completed, final.failed) == (4, 2) and len(ran) == 4
    assert {e["error"]["code"] for e in errors} == {"batch_cancelled"}
    replied = sum(o["response"]["body"]["usage"]["completion_tokens"] for o in output)
    assert final.fields["usage"]["output_tokens"] == replied > 0

    assert metered(store, data_dir, owner) == (4, replied)
