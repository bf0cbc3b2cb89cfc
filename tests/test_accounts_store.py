"""Both account stores (SQLite, Redis) against one contract: keys stored by hash only, the change
counter that keeps processes current, usage added atomically per key / model / tier / day; and
both limiters (in-process, Redis's Lua script) against the same GCRA arithmetic."""

from __future__ import annotations

import asyncio
import uuid

import pytest

from accounts.config import Limits, Price, resolved_price
from accounts.keys import PREFIX, make_key, secret_hash
from accounts.rates import Ask, LocalLimiter
from accounts.redis_store import RedisAccounts
from accounts.sqlite_store import SQLiteAccounts
from accounts.usage import Usage, group, to_csv
from tests.test_batch_store import redis_server


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory):
    with redis_server(tmp_path_factory.mktemp("redis")) as url:
        yield url


@pytest.fixture(params=["sqlite", "redis"])
def store_factory(request, tmp_path):
    if request.param == "sqlite":
        return lambda: SQLiteAccounts(tmp_path / "accounts.sqlite3")
    url, prefix = request.getfixturevalue("redis_url"), f"t{uuid.uuid4().hex[:8]}:"
    return lambda: RedisAccounts(url, prefix)


def run(coro):
    return asyncio.run(coro)


def test_keys_round_trip_by_hash_and_changes_are_versioned(store_factory):
    async def go():
        a, b = store_factory(), store_factory()  # two processes' views of one store
        await a.open()
        await b.open()
        try:
            record, secret = make_key("ci", "free", {"requests_per_min": 3}, ("tiny-chat",))
            assert secret.startswith(PREFIX) and len(secret) == len(PREFIX) + 43
            created = await a.create_key(record)
            seen, v1 = await b.keys_since(0)
            assert [r.id for r in seen] == [record.id] and v1 == created.version
            found = await b.find_key(secret_hash(secret))
            assert found.id == record.id and found.limits == {"requests_per_min": 3} and found.models == ("tiny-chat",)
            assert await b.find_key(secret_hash(secret + "x")) is None
            other, _ = make_key("other", "paid")
            await b.create_key(other)
            revoked = await a.update_key(record.id, revoked_at=123)
            assert revoked.revoked_at == 123 and not revoked.active
            again = await a.update_key(record.id, revoked_at=None, name="renamed")
            assert again.revoked_at == 123 and again.name == "renamed"  # a revoke is final
            changed, v2 = await b.keys_since(v1)
            assert {r.id for r in changed} == {record.id, other.id} and v2 > v1
            assert (await b.keys_since(v2))[0] == []
            assert {r.id for r in await b.list_keys()} == {record.id, other.id}
            assert await a.update_key("key_nope", name="x") is None
        finally:
            await a.close()
            await b.close()

    run(go())


def test_usage_adds_up_per_row_and_filters(store_factory):
    async def go():
        s = store_factory()
        await s.open()
        try:
            for day, key, model, tier in [("2025-01-01", "k1", "m1", "paid"), ("2025-01-01", "k1", "m1", "paid"),
                                          ("2025-01-02", "k1", "m2", "batch"), ("2025-01-02", "k2", "m1", "free")]:
                await s.record(day, key, model, tier, Usage(requests=1, input_tokens=10, output_tokens=5,
                                                            gpu_seconds=0.25, swap_seconds=0.5))
            rows = await s.usage("k1", None, None, None)
            by = {(r.day, r.model, r.tier): r.usage for r in rows}
            assert by[("2025-01-01", "m1", "paid")] == Usage(2, 20, 10, 0, 0, 0, 0.0, 0.0, 0.5, 1.0)
            assert by[("2025-01-02", "m2", "batch")].requests == 1 and len(rows) == 2
            assert len(await s.usage(None, "m1", None, None)) == 2
            assert sorted(r.key for r in await s.usage(None, None, "2025-01-02", "2025-01-02")) == ["k1", "k2"]
            assert await s.usage(None, None, "2025-01-03", None) == []
            assert await s.gpu_spent("k1", "2025-01-01") == pytest.approx(0.5)
            assert await s.gpu_spent("k1", "2025-01-05") == 0.0
        finally:
            await s.close()

    run(go())


def test_concurrent_usage_is_durable_when_each_record_returns_and_adds_up(store_factory):
    """Many requests recording at once (SQLite group-commits them): each row is visible to another
    process's view of the store as soon as its own ``record`` returns, and none is lost."""
    async def go():
        a, b = store_factory(), store_factory()
        await a.open()
        await b.open()

        async def one(i: int) -> None:
            await a.record("2025-01-01", f"k{i % 3}", "m1", "paid", Usage(requests=1, input_tokens=i))
            rows = await b.usage(f"k{i % 3}", None, None, None)
            assert rows and rows[0].usage.requests >= 1

        try:
            await asyncio.gather(*(one(i) for i in range(60)))
            rows = await b.usage(None, None, None, None)
            assert sorted((r.key, r.usage.requests) for r in rows) == [("k0", 20), ("k1", 20), ("k2", 20)]
            assert sum(r.usage.input_tokens for r in rows) == sum(range(60))
        finally:
            await a.close()
            await b.close()

    run(go())


def test_secrets_are_never_stored_in_clear(store_factory, tmp_path, redis_url):
    async def go():
        s = store_factory()
        await s.open()
        record, secret = make_key("mine", "paid")
        await s.create_key(record)
        await s.update_key(record.id, limits={"requests_per_min": 9})
        await s.close()
        return s, secret

    s, secret = run(go())
    body = secret.removeprefix(PREFIX)
    if isinstance(s, SQLiteAccounts):
        raw = b"".join(p.read_bytes() for p in tmp_path.glob("accounts.sqlite3*"))
        assert raw and secret_hash(secret).encode() in raw  # the file holds the hash ...
    else:
        import redis

        r = redis.Redis.from_url(redis_url)
        raw = b""
        for k in r.scan_iter(f"{s.prefix}*"):
            raw += k + (r.dump(k) or b"")
        r.close()
        assert secret_hash(secret).encode() in raw
    assert body.encode() not in raw and body[:16].encode() not in raw  # ... never the secret


def test_gcra_local_limiter_counts_exactly_and_corrects():
    now = [1000.0]
    lim = LocalLimiter(clock=lambda: now[0])
    limits = Limits(requests_per_min=3, tokens_per_min=100, concurrent=2)

    async def go():
        v = [await lim.admit("k", limits, Ask(tokens=10), 0.0, f"r{i}") for i in range(2)]
        assert [x.ok for x in v] == [True, True]
        assert v[1].buckets["requests"].remaining == 1 and v[1].buckets["tokens"].remaining == 80
        refused = await lim.admit("k", limits, Ask(tokens=10), 0.0, "r2")
        assert not refused.ok and "in flight" in refused.message  # concurrency 2
        await lim.settle("k", limits, Ask(tokens=10), Ask(tokens=30), "r0")  # used more than asked
        third = await lim.admit("k", limits, Ask(tokens=10), 0.0, "r3")
        assert third.ok and third.buckets["requests"].remaining == 0 and third.buckets["tokens"].remaining == 50
        await lim.settle("k", limits, Ask(tokens=10), Ask(tokens=10), "r1")
        fourth = await lim.admit("k", limits, Ask(tokens=10), 0.0, "r4")
        assert not fourth.ok and fourth.code == "rate_limit_exceeded" and fourth.retry_after_s == pytest.approx(20)
        now[0] += 20  # one request's worth comes back every 60/3 s
        assert (await lim.admit("k", limits, Ask(tokens=10), 0.0, "r5")).ok
        over = await lim.admit("k", Limits(gpu_seconds_per_day=5), Ask(), 5.0, "r6")
        assert not over.ok and over.code == "insufficient_quota"

    asyncio.run(go())


def test_redis_limiter_is_one_bucket_for_every_process(redis_url):
    limits = Limits(requests_per_min=4, tokens_per_min=1000)

    async def go():
        stores = [RedisAccounts(redis_url, f"t{uuid.uuid4().hex[:6]}:")]
        stores.append(RedisAccounts(redis_url, stores[0].prefix))
        for s in stores:
            await s.open()
        try:
            limiters = [s.limiter() for s in stores]
            verdicts = await asyncio.gather(*(limiters[i % 2].admit("k", limits, Ask(tokens=50), 0.0, f"r{i}")
                                              for i in range(6)))
            assert sum(v.ok for v in verdicts) == 4
            assert sorted(v.buckets["requests"].remaining for v in verdicts if v.ok) == [0, 1, 2, 3]
            assert {v.code for v in verdicts if not v.ok} == {"rate_limit_exceeded"}
            peek = await limiters[1].peek("k", limits)
            assert peek["requests"].remaining == 0 and peek["tokens"].remaining == 800
            await limiters[0].settle("k", limits, Ask(tokens=50), Ask(tokens=250), "r0")
            assert (await limiters[1].peek("k", limits))["tokens"].remaining == 600
            conc = Limits(concurrent=1)
            assert (await limiters[0].admit("c", conc, Ask(), 0.0, "a")).ok
            assert not (await limiters[1].admit("c", conc, Ask(), 0.0, "b")).ok
            await limiters[0].settle("c", conc, Ask(), Ask(), "a")
            assert (await limiters[1].admit("c", conc, Ask(), 0.0, "b")).ok
            await stores[0].record("2025-01-01", "g", "m", "paid", Usage(gpu_seconds=3.0))
            from accounts import rates

            day = rates.utc_day(__import__("time").time())
            await stores[0].record(day, "g", "m", "paid", Usage(gpu_seconds=3.0))
            budget = Limits(gpu_seconds_per_day=3.0)
            refused = await limiters[1].admit("g", budget, Ask(), 0.0, "x")
            assert not refused.ok and refused.code == "insufficient_quota" and refused.retry_after_s <= 86400
            assert (await limiters[1].admit("g", Limits(gpu_seconds_per_day=3.5), Ask(), 0.0, "y")).ok
        finally:
            for s in stores:
                await s.close()

    asyncio.run(go())


def test_grouping_prices_each_row_at_its_tier_and_writes_csv():
    from accounts.usage import UsageRow

    prices = {"paid": Price(input_tokens_per_1m=1.0, output_tokens_per_1m=2.0),
              "batch": Price(like="paid", factor=0.5)}
    resolved = {t: resolved_price(prices, t) for t in ("paid", "batch", "free")}
    rows = [UsageRow("2025-01-01", "k", "m", "paid", Usage(requests=1, input_tokens=1_000_000, output_tokens=1_000_000)),
            UsageRow("2025-01-01", "k", "m", "batch", Usage(requests=1, input_tokens=1_000_000, output_tokens=1_000_000)),
            UsageRow("2025-01-02", "k", "m", "free", Usage(requests=1))]
    by_day = group(rows, "day", resolved)
    assert [(d["day"], d["requests"], d["cost_usd"]) for d in by_day] == [("2025-01-01", 2, 4.5), ("2025-01-02", 1, 0.0)]
    text = to_csv(by_day)
    assert text.splitlines()[0].startswith("day,requests,input_tokens") and text.splitlines()[1].endswith(",4.5")


# -- SQLite: a request's usage row commits on the event loop when no one else is writing -------------


def _raw_rows(path) -> list[tuple]:
    import sqlite3

    with sqlite3.connect(path) as db:
        return db.execute("SELECT key, requests, input_tokens FROM usage ORDER BY key").fetchall()


def test_sqlite_usage_commits_on_the_loop_when_the_write_lock_is_free(tmp_path):
    """The common case: the row is committed before ``record`` returns (its future already done),
    without a group on the connection's thread, and another connection reads it at once."""
    async def go():
        s = SQLiteAccounts(tmp_path / "accounts.sqlite3")
        await s.open()
        try:
            for i in range(3):
                committed = s.record("2025-01-01", "k", "m1", "paid", Usage(requests=1, input_tokens=i))
                assert committed.done() and committed.exception() is None and s._in_flight is None
                assert _raw_rows(tmp_path / "accounts.sqlite3") == [("k", 1 + i, sum(range(i + 1)))]
        finally:
            await s.close()

    run(go())


def test_sqlite_usage_goes_to_the_thread_while_another_connection_writes(tmp_path):
    """Another process holding the write lock: the loop does not wait on it (every row goes to the
    thread's group, none is done yet), the rows commit once the lock is free, each exactly once."""
    import sqlite3

    async def go():
        path = tmp_path / "accounts.sqlite3"
        s = SQLiteAccounts(path)
        await s.open()
        other = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
        try:
            other.execute("BEGIN IMMEDIATE")
            pending = [s.record("2025-01-01", f"k{i % 2}", "m1", "paid", Usage(requests=1, input_tokens=1))
                       for i in range(20)]
            await asyncio.sleep(0.2)  # the loop runs on meanwhile; the thread's group waits for the lock
            assert not any(f.done() for f in pending)
            other.execute("COMMIT")
            await asyncio.wait_for(asyncio.gather(*pending), 30)
            assert _raw_rows(path) == [("k0", 10, 10), ("k1", 10, 10)]
            s.record("2025-01-01", "k0", "m1", "paid", Usage(requests=1)).result()  # the loop again
            assert _raw_rows(path)[0] == ("k0", 11, 10)
        finally:
            other.close()
            await s.close()

    run(go())


def test_sqlite_usage_that_fails_on_the_loop_fails_its_own_future_and_leaves_no_transaction(tmp_path):
    """An error other than a busy lock (here the table is gone) is the row's, as it is on the
    thread: its future fails (``Accounts.finish`` logs it and the response goes out), ``record``
    does not raise, and the loop's connection is left outside any transaction for the next row."""
    import sqlite3

    async def go():
        path = tmp_path / "accounts.sqlite3"
        s = SQLiteAccounts(path)
        await s.open()
        try:
            with sqlite3.connect(path) as other:
                other.execute("ALTER TABLE usage RENAME TO usage_away")
            failed = s.record("2025-01-01", "k", "m1", "paid", Usage(requests=1))
            assert failed.done() and isinstance(failed.exception(), sqlite3.OperationalError)
            assert not s._loop_db.in_transaction
            with sqlite3.connect(path) as other:
                other.execute("ALTER TABLE usage_away RENAME TO usage")
            assert s.record("2025-01-01", "k", "m1", "paid", Usage(requests=1)).result() is None
            assert _raw_rows(path) == [("k", 1, 0)]
        finally:
            await s.close()

    run(go())


def test_sqlite_usage_on_the_loop_keeps_the_wal_from_growing(tmp_path):
    """Commits on the loop never checkpoint; the thread does, every ``CHECKPOINT_EVERY`` of them,
    and the WAL starts over instead of growing by a page or so per request."""
    async def go():
        path = tmp_path / "accounts.sqlite3"
        s = SQLiteAccounts(path)
        s.CHECKPOINT_EVERY = 64
        await s.open()
        try:
            for i in range(2000):
                await s.record("2025-01-01", f"k{i % 50}", "m1", "paid", Usage(requests=1))
            wal = (tmp_path / "accounts.sqlite3-wal").stat().st_size
            assert wal < 2 * 2**20, f"the WAL grew to {wal} bytes over 2,000 commits (~8 MB without checkpoints)"
            assert sum(r[1] for r in _raw_rows(path)) == 2000
        finally:
            await s.close()

    run(go())
