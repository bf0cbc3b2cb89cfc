"""Both account stores (SQLite, Redis) against one contract: keys stored by hash only, the change
counter that keeps processes current, usage added atomically per key / model / tier / day; and
both limiters (in-process, Redis's Lua script) against the same GCRA arithmetic."""

from __future__ import annotations

import asyncio
import sqlite3
import uuid

import pytest

from accounts.config import Limits, Price, resolved_price
from accounts.keys import PREFIX, make_key, secret_hash
from accounts.rates import Ask, LocalLimiter
from accounts.redis_store import RedisAccounts
from accounts.sqlite_store import SQLiteAccounts
from accounts.usage import Usage, group, to_csv
from tests.helpers import shared_store


@pytest.fixture(params=["sqlite", "redis"])
def store_factory(request, tmp_path):
    return shared_store(request, tmp_path, lambda path: SQLiteAccounts(path.with_name("accounts.sqlite3")), RedisAccounts)  # the tests read that file


def run(coro):
    return asyncio.run(coro)


def test_keys_round_trip_and_changes_are_versioned(store_factory):
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
            found = seen[0]
            assert found.hash == secret_hash(secret) and found.limits == {"requests_per_min": 3}
            assert found.models == ("tiny-chat",) and await b.get_key(record.id) == found
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


def test_a_process_follows_a_store_whose_key_changes_went_back(store_factory, tmp_path):
    """A Redis restarted empty (or from an older snapshot), or a file restored from a backup,
    counts its key changes from a lower value again: a process that had seen more never learned
    the keys made after (401 on every process but the one that made it) and went on serving the
    keys the store no longer had (which no list showed and no revoke reached)."""
    from gateway.accounts import Accounts
    from gateway.config import load_config
    from tests.helpers import write_config

    async def go():
        admin = store_factory()
        accounts = Accounts(load_config(write_config(tmp_path, {"m": ("chat", tmp_path)})), store_factory())
        await admin.open()
        await accounts.store.open()
        try:
            made = [make_key(f"old{i}", "free") for i in range(3)]
            for record, _ in made:
                await admin.create_key(record)
            await accounts.refresh()
            old = made[0][1]
            assert accounts.lookup(old) is not None
            if isinstance(admin, RedisAccounts):  # restarted empty: this test's keys are gone
                await admin._r.delete(*[k async for k in admin._r.scan_iter(match=admin.prefix + "*")])
            else:
                with sqlite3.connect(tmp_path / "accounts.sqlite3") as db:
                    db.execute("DELETE FROM keys")
            record, new = make_key("new", "free")
            await admin.create_key(record)
            await accounts.refresh()
            assert accounts.lookup(new) is not None, "a key made after the store went back was never learned"
            assert accounts.lookup(old) is None and accounts.current(made[0][0].id) is None
            another, newer = make_key("newer", "free")
            await admin.create_key(another)
            await accounts.refresh()  # and it goes on following the store from there
            assert accounts.lookup(newer) is not None and accounts.lookup(new) is not None
        finally:
            await admin.close()
            await accounts.store.close()

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
        raw = b"".join(p.read_bytes() for p in [*tmp_path.glob("accounts.sqlite3*"), *tmp_path.glob("accounts.sqlite3.usage/*")]
                       if p.is_file())  # the usage journal too
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
        tiny = Limits(gpu_seconds_per_day=0.001)  # a small budget's figures are not rounded to 0.00
        over = await lim.admit("k", tiny, Ask(), 0.0042, "r7")
        assert "(0.0042 used today)" in over.message, over.message
        assert (await lim.admit("k", tiny, Ask(gpu_seconds=0.0009), 0.0002, "r8")).ok
        held = await lim.admit("k", tiny, Ask(), 0.0002, "r9")
        assert "(0.0002 used today, 0.0009 held by requests in flight)" in held.message, held.message

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


@pytest.mark.parametrize("kind", ["local", "redis"])
def test_requests_in_flight_hold_their_estimate_of_the_gpu_budget(kind, request):
    """Each request admitted against a daily GPU budget holds its estimated GPU-seconds until it
    ends: one more is admitted only while today's usage plus what those in flight hold is under
    the budget, else 429 ``rate_limit_exceeded`` to try again in a second (not the day's
    ``insufficient_quota``); what a request held comes back when it settles. On Redis the
    decision is one script, so two processes' limiters see each other's requests in flight."""
    budget = Limits(gpu_seconds_per_day=4.0)

    async def go(limiters):
        assert (await limiters[0].admit("g", budget, Ask(gpu_seconds=3.0), 1.0, "a")).ok  # 1 used + 0 held
        held = await limiters[1].admit("g", budget, Ask(gpu_seconds=3.0), 1.0, "b")  # 1 used + 3 held: all of it
        assert not held.ok and held.code == "rate_limit_exceeded" and held.retry_after_s == 1.0
        assert "3.00 held by requests in flight" in held.message
        await limiters[0].settle("g", budget, Ask(gpu_seconds=3.0), Ask(), "a")
        assert (await limiters[1].admit("g", budget, Ask(gpu_seconds=3.0), 1.0, "b")).ok
        assert not (await limiters[0].admit("g", budget, Ask(gpu_seconds=0.5), 1.0, "c")).ok
        assert (await limiters[0].admit("other", budget, Ask(gpu_seconds=3.0), 1.0, "d")).ok  # per key

    async def on_redis():
        url = request.getfixturevalue("redis_url")
        stores = [RedisAccounts(url, f"t{uuid.uuid4().hex[:6]}:")]
        stores.append(RedisAccounts(url, stores[0].prefix))
        for s in stores:
            await s.open()
        try:
            day = __import__("accounts.rates", fromlist=["utc_day"]).utc_day(__import__("time").time())
            await stores[0].record(day, "g", "m", "paid", Usage(gpu_seconds=1.0))  # the script reads its own
            await go([s.limiter() for s in stores])
        finally:
            for s in stores:
                await s.close()

    if kind == "local":
        lim = LocalLimiter()
        asyncio.run(go([lim, lim]))
    else:
        asyncio.run(on_redis())


@pytest.mark.parametrize("kind", ["local", "redis"])
def test_a_request_admitted_without_a_concurrent_limit_is_not_counted_in_flight(kind, request):
    """Only requests admitted under a ``concurrent`` limit count against it, as Redis's script
    counts them: a reply's speech is admitted with the limit left out (``Accounts.admit``,
    ``within``), a step of the reply's own request. (The in-process limiter counted every request,
    so a key with ``concurrent: 2`` had its other request refused while a phrase was said.)"""
    conc = Limits(concurrent=1)

    async def go(lim):
        assert (await lim.admit("k", Limits(), Ask(), 0.0, "speech")).ok
        assert (await lim.admit("k", conc, Ask(), 0.0, "chat")).ok
        assert not (await lim.admit("k", conc, Ask(), 0.0, "other")).ok
        await lim.settle("k", Limits(), Ask(), Ask(), "speech")  # gives back nothing of the chat's
        assert not (await lim.admit("k", conc, Ask(), 0.0, "other")).ok
        await lim.settle("k", conc, Ask(), Ask(), "chat")
        assert (await lim.admit("k", conc, Ask(), 0.0, "other")).ok

    async def on_redis():
        store = RedisAccounts(request.getfixturevalue("redis_url"), f"t{uuid.uuid4().hex[:6]}:")
        await store.open()
        try:
            await go(store.limiter())
        finally:
            await store.close()

    asyncio.run(go(LocalLimiter()) if kind == "local" else on_redis())


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


def _journal_files(path) -> list[str]:
    folder = path.with_name(path.name + ".usage")
    return sorted(p.name for p in folder.iterdir()) if folder.exists() else []


def test_sqlite_usage_is_in_the_journal_when_record_returns_and_folded_once(tmp_path):
    """A request's row is written to the journal before ``record`` returns (its future already
    done, no transaction on the thread), a reader folds it into the database, and folding again
    (the store's own folds, another reader's) adds nothing."""
    async def go():
        path = tmp_path / "accounts.sqlite3"
        s = SQLiteAccounts(path)
        s.FOLD_EVERY_S = 3600  # only the readers fold here
        await s.open()
        try:
            for i in range(3):
                committed = s.record("2025-01-01", "k", "m1", "paid", Usage(requests=1, input_tokens=i))
                assert committed.done() and committed.exception() is None and s._in_flight is None
            assert _raw_rows(path) == []  # in the journal, not yet in the database
            [segment] = [n for n in _journal_files(path) if n.endswith(".rows")]
            assert (path.with_name(path.name + ".usage") / segment).read_bytes().count(b"\n") == 3
            for _ in range(2):
                [row] = await s.usage("k", None, None, None)
                assert (row.usage.requests, row.usage.input_tokens) == (3, 3)
            await s._call(s._fold_own)
            assert _raw_rows(path) == [("k", 3, 3)]
        finally:
            await s.close()
        assert _raw_rows(path) == [("k", 3, 3)] and _journal_files(path) == []  # closing folds and removes it

    run(go())


def test_sqlite_usage_journal_rotates_and_every_segment_counts_once(tmp_path, monkeypatch):
    """Segments are retired at their size and a new one started; each is folded, then deleted
    with its offset, and every row counts exactly once across them."""
    import accounts.journal as journal

    monkeypatch.setattr(journal, "SEGMENT_BYTES", 600)

    async def go():
        path = tmp_path / "accounts.sqlite3"
        s = SQLiteAccounts(path)
        s.FOLD_EVERY_S = 0.01
        await s.open()
        try:
            for i in range(200):
                await s.record("2025-01-01", f"k{i % 4}", "m1", "paid", Usage(requests=1, input_tokens=1))
                if i % 50 == 0:
                    await asyncio.sleep(0.05)  # the store's own folds run meanwhile
            assert s._journal._seq >= 10  # ~60 bytes a row: a new segment every ~10 rows
            rows = await s.usage(None, None, None, None)
            assert sorted((r.key, r.usage.requests, r.usage.input_tokens) for r in rows) == \
                [(f"k{i}", 50, 50) for i in range(4)]
            await s._call(s._fold_own)
            segments = [n for n in _journal_files(path) if n.endswith(".rows")]
            assert len(segments) <= 1  # the retired ones are gone; the one being written (if any) stays
            import sqlite3
            with sqlite3.connect(path) as db:
                assert set(r[0] for r in db.execute("SELECT segment FROM journal")) <= set(segments)  # the rest forgotten
        finally:
            await s.close()

    run(go())


_WRITE_AND_DIE = """
import asyncio, os, sys
sys.path.insert(0, {root!r})
from accounts.sqlite_store import SQLiteAccounts
from accounts.usage import Usage

async def main():
    s = SQLiteAccounts({path!r})
    s.FOLD_EVERY_S = 3600
    await s.open()
    for i in range(5):
        await s.record("2025-01-01", "dead", "m1", "paid", Usage(requests=1, output_tokens=2))
    os.write(s._journal._fd, b'["2025-01-01","dead","m1"')  # a line cut by the kill: not a row
    print("written", flush=True)
    os.kill(os.getpid(), 9)

asyncio.run(main())
"""


def test_sqlite_usage_of_a_killed_process_is_folded_by_the_next_one_once(tmp_path):
    """A process killed with rows in its journal: a live store reads them at once (it folds every
    process's segments before reading) without deleting them, the next store to open folds and
    removes the dead process's files, and nothing counts twice; a cut last line is not a row."""
    import subprocess
    import sys
    from pathlib import Path

    path = tmp_path / "accounts.sqlite3"
    root = str(Path(__file__).resolve().parents[1])

    async def go():
        live = SQLiteAccounts(path)
        await live.open()
        try:
            done = subprocess.run([sys.executable, "-c", _WRITE_AND_DIE.format(root=root, path=str(path))],
                                  capture_output=True, text=True, timeout=120)
            assert done.returncode == -9 and "written" in done.stdout, done.stderr
            dead = [n for n in _journal_files(path) if not n.startswith(live._journal.instance)]
            assert len(dead) == 2  # its lock file and its segment, left behind
            [row] = await live.usage("dead", None, None, None)
            assert (row.usage.requests, row.usage.output_tokens) == (5, 10)
            assert [n for n in _journal_files(path) if not n.startswith(live._journal.instance)] == dead
            later = SQLiteAccounts(path)
            await later.open()  # finds the dead process's lock free: folds (nothing new) and removes
            try:
                assert [n for n in _journal_files(path)
                        if not n.startswith((live._journal.instance, later._journal.instance))] == []
                [row] = await later.usage("dead", None, None, None)
                assert (row.usage.requests, row.usage.output_tokens) == (5, 10)
            finally:
                await later.close()
        finally:
            await live.close()

    run(go())


def test_sqlite_usage_journal_leaves_no_piece_of_a_row_it_could_not_write(tmp_path, monkeypatch):
    """A short write (a full disk) fails that row's future and cuts the piece off again, so the
    rows before and after it are whole lines and each counts."""
    import accounts.journal as journal

    async def go():
        path = tmp_path / "accounts.sqlite3"
        s = SQLiteAccounts(path)
        await s.open()
        try:
            assert s.record("2025-01-01", "k", "m1", "paid", Usage(requests=1)).result() is None
            real_write = journal.os.write
            monkeypatch.setattr(journal.os, "write", lambda fd, data: real_write(fd, data[:7]))
            failed = s.record("2025-01-01", "k", "m1", "paid", Usage(requests=1))
            assert failed.done() and isinstance(failed.exception(), OSError)
            monkeypatch.setattr(journal.os, "write", real_write)
            assert s.record("2025-01-01", "k", "m1", "paid", Usage(requests=1)).result() is None
            assert [(r.key, r.usage.requests) for r in await s.usage(None, None, None, None)] == [("k", 2)]
        finally:
            await s.close()

    run(go())


def test_sqlite_usage_journal_that_cannot_be_folded_at_close_is_folded_by_the_next_store(tmp_path):
    """A fold that fails at close (here the usage table is away) neither raises nor loses the rows:
    the journal and its lock file stay, unlocked, and the next store to open folds them once."""
    import sqlite3

    async def go():
        path = tmp_path / "accounts.sqlite3"
        s = SQLiteAccounts(path)
        s.FOLD_EVERY_S = 3600
        await s.open()
        for i in range(3):
            await s.record("2025-01-01", "k", "m1", "paid", Usage(requests=1, input_tokens=i))
        with sqlite3.connect(path) as other:
            other.execute("ALTER TABLE usage RENAME TO usage_away")
        await s.close()
        left = _journal_files(path)
        assert len(left) == 2 and all(n.startswith(s._journal.instance) for n in left)  # lock file and segment
        with sqlite3.connect(path) as other:
            other.execute("ALTER TABLE usage_away RENAME TO usage")
        later = SQLiteAccounts(path)
        await later.open()
        try:
            assert _raw_rows(path) == [("k", 3, 3)]
            assert all(n.startswith(later._journal.instance) for n in _journal_files(path))
        finally:
            await later.close()
        assert _raw_rows(path) == [("k", 3, 3)] and _journal_files(path) == []

    run(go())


def test_cached_input_is_priced_at_its_own_rate_or_as_input():
    """``cached_input_tokens`` (of ``input_tokens``, what a prefix cache served) at
    ``cached_input_tokens_per_1m``; without that price, as input; ``like``'s factor applies to it."""
    used = Usage(requests=1, input_tokens=1_000_000, cached_input_tokens=400_000, output_tokens=0)
    assert used.cost(Price(input_tokens_per_1m=2.0, cached_input_tokens_per_1m=0.5)) == pytest.approx(0.6 * 2 + 0.4 * 0.5)
    assert used.cost(Price(input_tokens_per_1m=2.0)) == pytest.approx(2.0)
    prices = {"paid": Price(input_tokens_per_1m=2.0, cached_input_tokens_per_1m=0.5), "batch": Price(like="paid", factor=0.5),
              "free": Price(input_tokens_per_1m=1.0)}
    assert resolved_price(prices, "batch").cached_input_tokens_per_1m == 0.25
    assert used.cost(resolved_price(prices, "batch")) == pytest.approx(0.6 + 0.1)


def test_sqlite_usage_from_before_cached_input_tokens_is_read_with_it_at_0(tmp_path):
    """An upgrade: a database whose usage table has no ``cached_input_tokens`` column gets it (its
    rows at 0), and a journal line an older process wrote (one counter fewer) is folded with it at 0
    where a line of another width is skipped."""
    import json
    import sqlite3

    from accounts.usage import COUNTERS, FIRST_COUNTERS

    old = COUNTERS[:FIRST_COUNTERS]
    assert "cached_input_tokens" not in old and COUNTERS[FIRST_COUNTERS:] == ("cached_input_tokens", "trained_tokens")
    path = tmp_path / "accounts.sqlite3"
    with sqlite3.connect(path) as db:  # the first version's table, with a row
        db.execute(f"CREATE TABLE usage (day TEXT NOT NULL, key TEXT NOT NULL, model TEXT NOT NULL, tier TEXT NOT NULL, "
                   f"{', '.join(f'{c} REAL NOT NULL DEFAULT 0' for c in old)}, PRIMARY KEY (day, key, model, tier)) WITHOUT ROWID")
        db.execute("INSERT INTO usage (day, key, model, tier, requests, input_tokens) VALUES ('2025-01-01', 'k', 'm', 'paid', 2, 20)")
    journal = path.with_name(path.name + ".usage")
    journal.mkdir()
    lines = [["2025-01-01", "k", "m", "paid", 1, 5] + [0] * (FIRST_COUNTERS - 2),  # an older process's row
             ["2025-01-01", "k", "m", "paid", 1, 7] + [0] * (FIRST_COUNTERS - 3)]  # too short: skipped
    (journal / "0123456789abcdef-000000.rows").write_text("".join(json.dumps(x) + "\n" for x in lines))

    async def go():
        s = SQLiteAccounts(path)
        await s.open()
        try:
            s.record("2025-01-01", "k", "m", "paid", Usage(requests=1, input_tokens=9, cached_input_tokens=4))
            [row] = await s.usage("k", None, None, None)
            assert (row.usage.requests, row.usage.input_tokens, row.usage.cached_input_tokens) == (4, 34, 4)
        finally:
            await s.close()

    run(go())
