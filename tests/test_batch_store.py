"""Both batch stores (SQLite, Redis) against the same contract: files, batches, the backlog's
claim / reclaim / touch / release, outcomes written once, compare-and-set statuses, the finishing
lock, survival across a reopen, and many consumers racing with some of them dying."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import random
import sqlite3
import time
import uuid

import pytest

from batch.redis_store import RedisStore
from batch.sqlite_store import SQLiteStore
from batch.store import BatchInfo, FileInfo, Line, Outcome, Store
from tests.helpers import opened, redis_server, shared_store, spare_port  # noqa: F401 - redis_server: where other modules import it from


@pytest.fixture(params=["sqlite", "redis"])
def make_store(request, tmp_path):
    """A factory of opened store instances that share one backing store (like processes do); each
    test runs in its own event loop and closes the stores it opened."""
    return opened(shared_store(request, tmp_path, SQLiteStore, RedisStore))


def run(coro):
    return asyncio.run(coro)


def batch(i: int = 0, owner: str = "owner-a") -> BatchInfo:
    now = int(time.time())
    return BatchInfo(id=f"batch_{time.time_ns():016x}{i:04d}", owner=owner, endpoint="/v1/chat/completions",
                     input_file_id="file-x", completion_window="24h", created_at=now, expires_at=now + 86400,
                     metadata={"k": "v"})


def lines(n: int) -> list[Line]:
    return [Line(i, f"req-{i}", {"model": "m", "n": i}) for i in range(n)]


def ok(job_or_line, text: str = "fine") -> Outcome:
    line = getattr(job_or_line, "line", job_or_line)
    return Outcome(line.index, True, {"custom_id": line.custom_id, "response": {"status_code": 200, "body": text}})


def failed(line: Line, code: str = "batch_cancelled") -> Outcome:
    return Outcome(line.index, False, {"custom_id": line.custom_id, "response": None, "error": {"code": code}})


async def _closing(*stores: Store) -> None:
    for s in stores:
        await s.close()


def test_files_round_trip(make_store):
    async def go():
        s = await make_store()
        info = FileInfo("file-1", "owner-a", "batch", "in.jsonl", 5, 123)
        await s.put_file(info, b"a\nb\n\x00")
        assert await s.get_file("file-1") == info
        assert await s.file_content("file-1") == b"a\nb\n\x00"
        assert await s.get_file("file-2") is None and await s.file_content("file-2") is None
        assert await s.delete_file("file-1") is True
        assert await s.delete_file("file-1") is False
        assert await s.get_file("file-1") is None and await s.file_content("file-1") is None
        await _closing(s)

    run(go())


def test_a_file_is_gone_from_its_expires_at(make_store):
    """A file with ``expires_at`` is found until then and not from then on, and is deleted: by the
    store's own expiry (Redis) or by ``delete_expired_files`` (SQLite, which the runner's sweep
    calls). One without stays."""
    async def go():
        s = await make_store()
        now = int(time.time())
        soon = FileInfo("file-soon", "owner-a", "batch_output", "out.jsonl", 1, now, now + 2)
        later = FileInfo("file-later", "owner-a", "batch_output", "out.jsonl", 1, now, now + 3600)
        kept = FileInfo("file-kept", "owner-a", "batch", "in.jsonl", 1, now)
        for info in (soon, later, kept):
            await s.put_file(info, b"x")
        assert await s.get_file("file-soon") == soon and await s.file_content("file-soon") == b"x"
        assert soon.public()["expires_at"] == now + 2
        await asyncio.sleep(max(0.0, now + 2 - time.time()) + 0.05)
        assert await s.get_file("file-soon") is None and await s.file_content("file-soon") is None
        assert await s.delete_file("file-soon") is False  # already gone for the API
        await s.delete_expired_files(time.time())
        assert await s.get_file("file-later") == later and await s.get_file("file-kept") == kept
        await _closing(s)
        return s

    s = run(go())
    if isinstance(s, SQLiteStore):  # the row itself is deleted, not only hidden
        with contextlib.closing(sqlite3.connect(s.path)) as db:
            assert {r[0] for r in db.execute("SELECT id FROM files")} == {"file-later", "file-kept"}


def test_a_sqlite_file_from_before_expiry_is_migrated(tmp_path):
    """A batch store written before files could expire (no expires_at column) opens, keeps its
    files (they never expire) and takes new ones that do."""
    path = tmp_path / "batches.sqlite3"
    with contextlib.closing(sqlite3.connect(path)) as db, db:
        db.execute("CREATE TABLE files (id TEXT PRIMARY KEY, owner TEXT NOT NULL, purpose TEXT NOT NULL, "
                   "filename TEXT NOT NULL, bytes INTEGER NOT NULL, created_at INTEGER NOT NULL, content BLOB NOT NULL)")
        db.execute("INSERT INTO files VALUES ('file-old', 'o', 'batch', 'in.jsonl', 1, 5, x'61')")

    async def go():
        s = SQLiteStore(path)
        await s.open()
        assert await s.get_file("file-old") == FileInfo("file-old", "o", "batch", "in.jsonl", 1, 5)
        await s.put_file(FileInfo("file-new", "o", "batch", "in.jsonl", 1, 5, 6), b"b")
        assert await s.get_file("file-new") is None and await s.delete_expired_files(time.time()) == ["file-new"]
        assert await s.file_content("file-old") == b"a"
        await s.close()

    run(go())


def test_files_list_by_owner_purpose_and_time_in_either_order_with_cursor(make_store):
    """Files list by ``(created_at, id)``: files made in the same second go by id, in both
    orders; pages joined give the whole list; a cursor that names no live file of the owner's
    gives None; deleted and expired files are not listed, and the sweep unlists expired ones."""
    async def go():
        s = await make_store()
        now = int(time.time())
        made = [FileInfo(f"file-{i}", "a" if i != 3 else "b", "batch" if i % 2 == 0 else "batch_output",
                         "x.jsonl", 1, now - 10 + (i // 2)) for i in range(6)]  # pairs share a second
        for info in made:
            await s.put_file(info, b"x")
        a = [f for f in made if f.owner == "a"]
        newest = sorted(a, key=lambda f: (f.created_at, f.id), reverse=True)
        assert await s.list_files("a", None, None, 10, False) == newest
        assert await s.list_files("a", None, None, 10, True) == newest[::-1]
        assert await s.list_files(None, None, None, 10, False) == sorted(made, key=lambda f: (f.created_at, f.id),
                                                                        reverse=True)
        assert await s.list_files("a", "batch_output", None, 10, False) == [f for f in newest if f.purpose == "batch_output"]
        for ascending in (False, True):
            pages, after = [], None
            while True:
                page = await s.list_files("a", None, after, 2, ascending)
                if not page:
                    break
                pages += page
                after = page[-1].id
            assert pages == (newest[::-1] if ascending else newest)
        assert await s.list_files("a", None, "file-3", 10, False) is None  # b's
        assert await s.list_files("a", None, "file-nope", 10, False) is None
        await s.delete_file("file-0")
        assert "file-0" not in [f.id for f in await s.list_files("a", None, None, 10, False)]
        assert await s.list_files("a", None, "file-0", 10, False) is None
        soon = FileInfo("file-soon", "a", "batch", "x.jsonl", 1, now, now + 1)
        await s.put_file(soon, b"x")
        assert (await s.list_files("a", None, None, 1, False)) == [soon]
        await asyncio.sleep(max(0.0, now + 1 - time.time()) + 0.05)
        assert "file-soon" not in [f.id for f in await s.list_files("a", None, None, 10, False)]
        assert await s.delete_expired_files(time.time()) == ["file-soon"]
        assert await s.delete_expired_files(time.time()) == []
        if isinstance(s, RedisStore):  # unlisted everywhere, not only hidden
            for index in (s.k("files"), s.k("files", "a")):
                assert await s._r.zscore(index, "file-soon") is None
            assert await s._r.zcard(s.k("files", "expiry")) == 0
        await _closing(s)

    run(go())


def test_files_pages_list_each_file_once_while_other_files_come_and_go(make_store):
    """A client pages through an owner's files (``after``: the last one's id) while another process
    adds and deletes other files of the owner, newer and older: each file is listed once, in order.
    (On Redis a page was read from the cursor's rank, in a call of its own: the files listed or
    unlisted between the two moved it, and the pages repeated some files and skipped others.)"""
    async def go():
        s, other = await make_store(), await make_store()
        now = int(time.time())
        kept = [FileInfo(f"file-k{i:02d}", "a", "batch", "x.jsonl", 1, now - 100 + i // 3) for i in range(24)]
        for info in kept:
            await s.put_file(info, b"x")
        newest = sorted(kept, key=lambda f: (f.created_at, f.id), reverse=True)
        done = asyncio.Event()

        async def churn(n: int) -> None:  # files above and below the cursor, in both orders
            i = 0
            while not done.is_set():
                made = FileInfo(f"file-c{n}-{i}", "a", "user_data", "x.txt", 1, now - 200 if i % 2 else now)
                await other.put_file(made, b"x")
                await other.delete_file(f"file-c{n}-{i - 1}")
                i += 1

        churners = [asyncio.create_task(churn(n)) for n in range(3)]
        wrong = []
        for _ in range(5):
            for ascending in (False, True):
                listed, after = [], None
                while page := await s.list_files("a", "batch", after, 3, ascending):
                    listed += [f.id for f in page]
                    after = listed[-1]
                if listed != [f.id for f in (newest[::-1] if ascending else newest)]:
                    wrong.append(listed)
        done.set()
        await asyncio.gather(*churners)
        await _closing(s, other)
        assert wrong == []

    run(go())


def test_redis_files_from_before_the_listings_are_listed(redis_url):
    """Files written to Redis before there were listings (their two keys only) are listed once a
    store opens; the pass runs once per Redis."""
    prefix = f"t{uuid.uuid4().hex[:8]}:"
    old = FileInfo("file-old", "a", "batch", "in.jsonl", 1, 5)

    async def go():
        import redis.asyncio as aioredis

        r = aioredis.Redis.from_url(redis_url)
        await r.set(f"{prefix}file:file-old", json.dumps(dataclasses.asdict(old)))
        await r.set(f"{prefix}file:file-old:content", b"x")
        s = RedisStore(redis_url, prefix)
        await s.open()
        for _ in range(100):
            if await s.list_files("a", None, None, 10, False):
                break
            await asyncio.sleep(0.05)
        assert await s.list_files("a", None, None, 10, False) == [old]
        assert await s.list_files(None, "batch", None, 10, False) == [old]
        assert await r.exists(f"{prefix}files:indexed")
        assert await s.index_old_files() == 0  # done once
        await s.close()
        await r.aclose()

    run(go())


def test_batches_list_newest_first_by_owner_with_cursor(make_store):
    async def go():
        s = await make_store()
        made = [batch(i, owner="a" if i % 2 == 0 else "b") for i in range(5)]
        for b in made:
            await s.create_batch(b)
        got = await s.get_batch(made[0].id)
        assert got.public()["metadata"] == {"k": "v"} and got.status == "validating" and got.owner == "a"
        all_ids = [b.id for b in await s.list_batches(None, None, 10)]
        assert all_ids == [b.id for b in reversed(made)]
        a_ids = [b.id for b in await s.list_batches("a", None, 10)]
        assert a_ids == [made[4].id, made[2].id, made[0].id]
        page = await s.list_batches("a", a_ids[0], 1)
        assert [b.id for b in page] == [made[2].id]
        assert sorted(await s.open_batches()) == sorted(b.id for b in made)
        await _closing(s)

    run(go())


def test_start_is_atomic_and_happens_once(make_store):
    async def go():
        s = await make_store()
        b = batch()
        await s.create_batch(b)
        bad = Outcome(3, False, {"custom_id": None, "error": {"code": "invalid_json"}})
        assert await s.start(b.id, lines(3), [bad], now=111) is True
        assert await s.start(b.id, lines(3), [bad], now=222) is False
        got = await s.get_batch(b.id)
        assert (got.status, got.total, got.completed, got.failed) == ("in_progress", 4, 0, 1)
        assert got.public()["in_progress_at"] == 111
        jobs = await s.claim("c1", 10, 60)
        assert sorted(j.line.custom_id for j in jobs) == ["req-0", "req-1", "req-2"]  # queued once
        assert [o.index for o in await s.outcomes(b.id)] == [3]
        await _closing(s)

    run(go())


def test_claims_are_exclusive_and_reclaimed_when_idle_unless_touched(make_store):
    async def go():
        s1, s2 = await make_store(), await make_store()
        b = batch()
        await s1.create_batch(b)
        await s1.start(b.id, lines(6), [], now=1)
        a = await s1.claim("alive", 2, 0.3)
        d = await s2.claim("dead", 2, 0.3)
        assert {j.line.index for j in a}.isdisjoint({j.line.index for j in d})
        assert all(j.deliveries == 1 for j in a + d)
        await asyncio.sleep(0.4)
        await s1.touch("alive", a)  # alive keeps its claims; dead's are up for grabs
        taken = await s2.claim("heir", 10, 0.3)
        stale = [j for j in taken if j.line.index in {x.line.index for x in d}]
        assert {j.line.index for j in stale} == {j.line.index for j in d}
        assert all(j.deliveries == 2 for j in stale)
        assert not {j.line.index for j in taken} & {j.line.index for j in a}
        assert len(taken) == 4  # dead's two + the two never claimed
        await _closing(s1, s2)

    run(go())


def test_claims_by_shape_take_only_that_shape_and_shapes_list_the_oldest_first(make_store):
    async def go():
        s1, s2 = await make_store(), await make_store()
        b1, b2 = batch(1), batch(2)
        shapes = ["m", "m+a*1", "n", "m+a*1", "m", "n+b*0.5"]
        for b in (b1, b2):
            await s1.create_batch(b)
        await s1.start(b1.id, [Line(i, f"req-{i}", {"i": i}, shape) for i, shape in enumerate(shapes)], [], now=1)
        await s1.start(b2.id, [Line(0, "late", {}, "m+a*1"), Line(1, "other", {}, "p")], [], now=2)
        assert await s1.shapes(60) == ["m", "m+a*1", "n", "n+b*0.5", "p"]
        got = await s1.claim("c1", 10, 60, "m+a*1")
        assert sorted((j.batch_id == b1.id, j.line.index) for j in got) == [(False, 0), (True, 1), (True, 3)]
        assert {j.line.shape for j in got} == {"m+a*1"}
        assert await s2.claim("c2", 10, 60, "m+a*1") == []  # claimed by a live consumer
        two = await s2.claim("c2", 2, 60)  # any shape: the oldest entries
        assert [(j.line.index, j.line.shape) for j in two] in ([(0, "m"), (4, "m")], [(0, "m"), (2, "n")])
        for j in got + two:
            await s1.record(j, ok(j))
        assert "m+a*1" not in await s2.shapes(60)  # every entry of it ran
        rest = await s2.claim("c2", 10, 0.01, "n")
        assert [j.line.custom_id for j in rest] == [f"req-{i}" for i, sh in enumerate(shapes) if sh == "n"
                                                    and i not in {j.line.index for j in two}]
        await _closing(s1, s2)

    run(go())


def test_release_hands_back_at_once(make_store):
    async def go():
        s = await make_store()
        b = batch()
        await s.create_batch(b)
        await s.start(b.id, lines(2), [], now=1)
        jobs = await s.claim("c1", 2, 60)
        assert await s.claim("c2", 2, 60) == []
        await s.release("c1", jobs)
        again = await s.claim("c2", 2, 60)
        assert sorted(j.line.index for j in again) == [0, 1]
        assert [j.deliveries for j in again] == [1, 1]  # a clean hand-back is not a failed delivery
        await _closing(s)

    run(go())


def test_record_writes_once_and_counts(make_store):
    async def go():
        s = await make_store()
        b = batch()
        await s.create_batch(b)
        await s.start(b.id, lines(2), [], now=1)
        j0, j1 = sorted(await s.claim("c", 2, 60), key=lambda j: j.line.index)
        first = await s.record(j0, ok(j0, "first"))
        second = await s.record(j0, ok(j0, "second"))  # the same line run again elsewhere
        assert (first.new, first.done, first.total) == (True, 1, 2)
        assert (second.new, second.done) == (False, 1)
        last = await s.record(j1, failed(j1.line, "boom"))
        assert (last.new, last.done, last.total) == (True, 2, 2)
        got = await s.get_batch(b.id)
        assert (got.completed, got.failed) == (1, 1)
        outs = await s.outcomes(b.id)
        assert [o.line["response"]["body"] if o.ok else o.line["error"]["code"] for o in outs] == ["first", "boom"]
        assert await s.claim("c", 2, 0) == []  # recorded entries left the backlog
        await _closing(s)

    run(go())


def test_set_status_is_compare_and_set_and_terminal_drops_the_work(make_store):
    async def go():
        s = await make_store()
        b = batch()
        await s.create_batch(b)
        await s.start(b.id, lines(4), [], now=1)
        jobs = await s.claim("c", 1, 60)
        assert await s.set_status(b.id, ["validating"], "failed") is False
        assert await s.set_status(b.id, ["in_progress"], "cancelling", cancelling_at=5) is True
        assert await s.set_status(b.id, ["in_progress"], "finalizing") is False  # lost the race
        filled = await s.fill(b.id, failed)
        assert filled == 4
        assert await s.fill(b.id, failed) == 0
        assert await s.set_status(b.id, ["cancelling"], "cancelled", cancelled_at=6, error_file_id="file-e") is True
        got = await s.get_batch(b.id)
        assert got.status == "cancelled" and got.public()["cancelled_at"] == 6 and got.failed == 4
        assert got.public()["error_file_id"] == "file-e" and got.public()["cancelling_at"] == 5
        assert b.id not in await s.open_batches()
        late = await s.record(jobs[0], ok(jobs[0]))  # a line that finishes after the end is dropped
        assert late.new is False
        assert await s.outcomes(b.id) == []
        assert await s.claim("c2", 10, 0) == []  # the rest of its backlog is dropped too
        with pytest.raises(ValueError):
            await s.set_status(b.id, ["cancelled"], "completed", owner="someone-else")
        await _closing(s)

    run(go())


@pytest.mark.parametrize("end", ["cancelled", "expired"])
def test_an_ended_batch_takes_its_lines_out_of_the_backlog_so_later_batches_run_next(make_store, end):
    """A batch that ends with lines it never ran (cancelled, expired) takes them out of the backlog in
    the step that ends it: its shape is no longer listed, and a later batch's line of that shape, from
    another key, is the very next claim rather than waiting behind them. A consumer (another process)
    that still held one of its lines finds it gone: touching, recording and releasing it do nothing."""
    async def go():
        s1, s2 = await make_store(), await make_store()
        big, later = batch(1), batch(2, owner="owner-b")
        for b in (big, later):
            await s1.create_batch(b)
        await s1.start(big.id, [dataclasses.replace(ln, shape="m") for ln in lines(300)], [], now=1)
        held = await s2.claim("elsewhere", 2, 60)
        assert await s1.set_status(big.id, ["in_progress"], end) is True
        assert await s1.shapes(60) == []  # nothing of it left to claim
        await s2.touch("elsewhere", held)
        assert (await s2.record(held[0], ok(held[0]))).new is False
        await s2.release("elsewhere", held[1:])
        assert await s1.claim("c", 10, 0) == []
        await s1.start(later.id, [Line(0, "only", {"model": "m"}, "m")], [], now=2)
        got = await s1.claim("c", 1, 60, "m")
        assert [(j.batch_id, j.line.custom_id) for j in got] == [(later.id, "only")]
        await _closing(s1, s2)

    run(go())


def test_only_an_ended_batch_is_deleted_and_it_leaves_every_listing(make_store):
    async def go():
        s = await make_store()
        running, ended, other = batch(0), batch(1), batch(2, owner="b")
        for b in (running, ended, other):
            await s.create_batch(b)
        await s.start(running.id, lines(2), [], now=1)
        assert await s.delete_batch(running.id) is False  # in progress: cancel it first
        assert await s.delete_batch(ended.id) is False  # validating
        assert await s.set_status(ended.id, ["validating"], "failed") is True
        assert await s.delete_batch(ended.id) is True
        assert await s.delete_batch(ended.id) is False  # gone already
        assert await s.delete_batch("batch_nope") is False
        assert await s.get_batch(ended.id) is None and (await s.get_batch(running.id)).status == "in_progress"
        assert [b.id for b in await s.list_batches(None, None, 10)] == [other.id, running.id]
        assert [b.id for b in await s.list_batches("owner-a", None, 10)] == [running.id]
        assert ended.id not in await s.open_batches()
        await _closing(s)

    run(go())


def test_lock_is_exclusive_renewable_and_lapses(make_store):
    async def go():
        s1, s2 = await make_store(), await make_store()
        b = batch()
        await s1.create_batch(b)
        assert await s1.lock(b.id, "p1", 0.3) is True
        assert await s2.lock(b.id, "p2", 0.3) is False
        assert await s1.lock(b.id, "p1", 0.3) is True  # renewed
        await asyncio.sleep(0.4)
        assert await s2.lock(b.id, "p2", 5) is True
        await s2.unlock(b.id, "p1")  # not the holder: no effect
        assert await s1.lock(b.id, "p1", 5) is False
        await s2.unlock(b.id, "p2")
        assert await s1.lock(b.id, "p1", 5) is True
        await _closing(s1, s2)

    run(go())


def test_state_survives_a_reopen(make_store):
    async def go():
        s = await make_store()
        b = batch()
        await s.create_batch(b)
        await s.start(b.id, lines(3), [], now=1)
        j = (await s.claim("gone", 3, 60))[:2]
        await s.record(j[0], ok(j[0]))
        await s.close()  # j[1] and one more were claimed by a "process" that is gone
        s2 = await make_store()
        got = await s2.get_batch(b.id)
        assert (got.status, got.done, got.total) == ("in_progress", 1, 3)
        await asyncio.sleep(0.25)
        again = await s2.claim("new", 10, 0.2)
        assert sorted(x.line.index for x in again) == [1, 2]
        await _closing(s2)

    run(go())


def test_racing_consumers_some_dying_give_every_line_exactly_one_outcome(make_store):
    """Six consumers on separate connections; some claim lines and vanish without recording
    (a crash), some record the same line twice (a slow consumer reclaimed). Every line ends
    with exactly one outcome and the counts match."""
    n_lines = 120

    async def go():
        stores = [await make_store() for _ in range(6)]
        b = batch()
        await stores[0].create_batch(b)
        await stores[0].start(b.id, lines(n_lines), [], now=1)
        rng = random.Random(7)
        recorded_by: dict[int, list[str]] = {}

        async def consumer(k: int, s: Store) -> None:
            name = f"c{k}"
            while True:
                jobs = await s.claim(name, 3, 0.15)
                if not jobs:
                    got = await s.get_batch(b.id)
                    if got.done == got.total:
                        return
                    await asyncio.sleep(0.05)
                    continue
                for job in jobs:
                    roll = rng.random()
                    if roll < 0.1:
                        continue  # crashed holding it: someone reclaims it later
                    r = await s.record(job, ok(job, name))
                    if r.new:
                        recorded_by.setdefault(job.line.index, []).append(name)
                    if roll > 0.9:  # a duplicate delivery of the same line
                        assert (await s.record(job, ok(job, "dup"))).new is False

        await asyncio.wait_for(asyncio.gather(*(consumer(k, s) for k, s in enumerate(stores))), 60)
        outs = await stores[0].outcomes(b.id)
        assert [o.index for o in outs] == list(range(n_lines))
        assert all(len(v) == 1 for v in recorded_by.values()) and len(recorded_by) == n_lines
        assert all(o.line["response"]["body"] == recorded_by[o.index][0] for o in outs)
        got = await stores[0].get_batch(b.id)
        assert (got.completed, got.failed, got.total) == (n_lines, 0, n_lines)
        await _closing(*stores)

    run(go())


def test_fill_leaves_the_lines_a_live_consumer_holds_and_a_claim_drops_the_filled(make_store):
    """A stopped batch's fill (``held_s``: the runner's reclaim timeout) gives an outcome to every
    line but those claimed by a consumer that touched them since: they still run, and record their
    own outcome. Lines filled are never handed out again, and a later fill takes what was given up."""
    async def go():
        s = await make_store()
        b = batch()
        await s.create_batch(b)
        await s.start(b.id, lines(5), [], now=1)
        live, gone = await s.claim("live", 2, 60), await s.claim("gone", 1, 60)
        await asyncio.sleep(0.3)
        await s.touch("live", live)  # "gone" stopped touching its claim
        assert await s.set_status(b.id, ["in_progress"], "cancelling", cancelling_at=5)
        assert await s.fill(b.id, failed, held_s=0.2) == 3  # 2 waiting, and the silent consumer's
        assert await s.claim("other", 10, 0.2) == []  # the waiting and the silent one: filled, so dropped
        first = await s.record(live[0], ok(live[0], "ran"))
        assert (first.new, first.done, first.total) == (True, 4, 5)
        late = await s.record(gone[0], ok(gone[0]))
        assert late.new is False  # filled already: its consumer went silent
        await s.ack(live[1])  # cut and given up
        assert await s.fill(b.id, failed, held_s=0.2) == 1
        outs = await s.outcomes(b.id)
        assert [o.ok for o in outs] == [o.index == live[0].line.index for o in outs]
        await _closing(s)

    run(go())
