"""The vector store store (``gateway.vector_store``) on both backends, SQLite and a real Redis
server: one contract, run against each."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import numpy as np

from gateway.vector_store import (FileBatch, RedisVectorStores, SQLiteVectorStores, StoreFile, VectorStore,
                                  VectorStoreStore)
from tests.helpers import redis_server


def _file(store_id: str, file_id: str, token: str, owner: str = "k", **kw) -> StoreFile:
    return StoreFile(store_id, file_id, token, owner, "paid", 100, f"{file_id}.txt", 80, 40, **kw)


async def _contract(store: VectorStoreStore) -> None:
    await store.open()
    try:
        a = VectorStore("vs_a", "k", 10, "a", "tiny-embed", {"m": "1"}, "about a", 7, 10)
        b = VectorStore("vs_b", "k", 11, "b", "tiny-embed")
        await store.create(a)
        await store.create(b)
        await store.create(VectorStore("vs_c", "other", 12, "c", "tiny-embed"))
        assert await store.get("vs_a", "k") == a
        assert await store.get("vs_a", "other") is None and await store.get("vs_x", "k") is None
        assert [s.id for s in await store.list("k")] == ["vs_a", "vs_b"]
        renamed = VectorStore("vs_a", "k", 10, "a2", "tiny-embed", {}, None, None, 50)
        assert await store.update(renamed) and await store.get("vs_a", "k") == renamed
        assert not await store.update(VectorStore("vs_a", "other", 10, "x", "tiny-embed"))  # not the owner's
        await store.touch("vs_a", "k", 70)  # last active: that field only, and only later
        await store.touch("vs_a", "k", 60)
        await store.touch("vs_a", "other", 90)
        assert await store.get("vs_a", "k") == replace(renamed, last_active_at=70)
        assert await store.update(renamed)

        # files: added, listed in order, a second addition replaces the first
        f1, f2 = _file("vs_a", "file-1", "t1", attributes={"lang": "en"}), _file("vs_a", "file-2", "t2")
        v0 = await store.version("vs_a")
        assert v0 is not None and await store.version("vs_x") is None
        assert await store.add_file(f1) and await store.add_file(f2)
        v1 = await store.version("vs_a")
        assert v1 != v0 and await store.version("vs_b") == await store.version("vs_b")
        assert not await store.add_file(_file("vs_gone", "file-1", "t9"))
        assert [f.id for f in await store.files("vs_a")] == ["file-1", "file-2"]
        assert await store.file("vs_a", "file-1") == f1 and await store.file("vs_b", "file-1") is None

        # claims: each waiting file once per lease, taken again once its lease ends
        taken = await store.claim(1000.0, 30.0, 10)
        assert [(f.id, f.lease_until) for f in taken] == [("file-1", 1030.0), ("file-2", 1030.0)]
        assert await store.claim(1010.0, 30.0, 10) == []
        assert await store.hold(taken[0], 1100.0)
        assert [f.id for f in await store.claim(1040.0, 30.0, 10)] == ["file-2"]  # file-1 held
        assert (await store.claim(1200.0, 30.0, 1))[0].id == "file-1"  # the limit, in order

        # finishing: chunks and counts; only the addition that was claimed
        vectors = np.arange(6, dtype=np.float32).reshape(2, 3)
        before = await store.version("vs_a")
        assert await store.finish(taken[0], ["hello", "wörld"], vectors)
        assert await store.version("vs_a") != before
        unchanged = await store.version("vs_a")
        assert await store.update(VectorStore("vs_a", "k", 10, "a2", "tiny-embed", {}, None, None, 60))
        assert await store.version("vs_a") == unchanged  # the store's own fields are not its files'
        assert not await store.finish(taken[0], ["again"], vectors[:1]) and await store.version("vs_a") == unchanged
        done = await store.file("vs_a", "file-1")
        assert (done.status, done.chunks, done.usage_bytes, done.lease_until) == ("completed", 2, 11, 0.0)
        assert done.attributes == {"lang": "en"}
        assert not await store.finish(taken[0], ["again"], vectors[:1])  # no longer waiting
        assert not await store.hold(taken[0], 2000.0)
        assert await store.file_texts("vs_a", "file-1") == ["hello", "wörld"]
        assert await store.file_texts("vs_a", "file-2") == [] and await store.file_texts("vs_a", "nope") is None
        [chunks] = await store.chunks("vs_a")
        assert chunks.file.id == "file-1" and chunks.texts == ["hello", "wörld"]
        assert chunks.vectors.dtype == np.float32 and np.array_equal(chunks.vectors, vectors)

        # attributes change without touching chunks or status
        before = await store.version("vs_a")
        changed = await store.set_attributes("vs_a", "file-1", {"lang": "de", "n": 2})
        assert await store.version("vs_a") != before
        assert changed.attributes == {"lang": "de", "n": 2} and changed.status == "completed"
        assert (await store.chunks("vs_a"))[0].file.attributes == {"lang": "de", "n": 2}
        assert await store.set_attributes("vs_a", "nope", {}) is None

        # an addition replaced meanwhile: the old claim finishes nothing; the new one waits
        old = (await store.claim(2000.0, 30.0, 10))[0]
        assert old.id == "file-2"
        again = _file("vs_a", "file-2", "t3")
        assert await store.add_file(again)
        assert [f.id for f in await store.files("vs_a")] == ["file-1", "file-2"]
        assert not await store.finish(old, ["x"], vectors[:1]) and not await store.fail(old, "server_error", "x")
        [new] = await store.claim(2000.0, 30.0, 10)
        assert new.token == "t3"
        assert await store.fail(new, "unsupported_file", "not text")
        failed = await store.file("vs_a", "file-2")
        assert failed.status == "failed" and failed.last_error == {"code": "unsupported_file", "message": "not text"}
        assert await store.claim(5000.0, 30.0, 10) == []

        # a cancelled file is not waiting any more: no claim, hold or finish
        third = _file("vs_a", "file-3", "t6", batch_id="vsfb_1")
        assert await store.add_file(third) and (await store.file("vs_a", "file-3")).batch_id == "vsfb_1"
        [held] = await store.claim(5000.0, 30.0, 10)
        assert await store.cancel(held) and not await store.cancel(held)
        assert (await store.file("vs_a", "file-3")).status == "cancelled"
        assert not await store.hold(held, 6000.0) and not await store.finish(held, ["x"], vectors[:1])
        assert await store.claim(9000.0, 30.0, 10) == [] and await store.delete_file("vs_a", "file-3")

        # adding a completed file again drops its chunks until it is read again
        assert await store.add_file(_file("vs_a", "file-1", "t4"))
        assert await store.chunks("vs_a") == []
        [re] = await store.claim(6000.0, 30.0, 10)
        assert await store.finish(re, ["only"], vectors[:1])

        # deleting a file, then the store: chunks and waiting files go with them
        before = await store.version("vs_a")
        assert await store.delete_file("vs_a", "file-2") and not await store.delete_file("vs_a", "file-2")
        assert await store.version("vs_a") != before
        assert [f.id for f in await store.files("vs_a")] == ["file-1"]
        assert await store.add_file(_file("vs_b", "file-9", "t5"))
        # file batches: kept with their files, replaced (with the counts they ended with), gone with the store
        made = FileBatch("vsfb_2", "vs_b", 100, ["file-9"])
        assert await store.put_batch(made) and await store.batch("vs_b", "vsfb_2") == made
        ended = replace(made, counts={"in_progress": 0, "completed": 1, "failed": 0, "cancelled": 0})
        assert await store.put_batch(ended) and await store.batch("vs_b", "vsfb_2") == ended
        assert await store.batch("vs_a", "vsfb_2") is None
        assert not await store.put_batch(replace(made, vector_store_id="vs_x"))
        assert not await store.delete("vs_b", "other")
        assert await store.delete("vs_b", "k") and not await store.delete("vs_b", "k")
        assert await store.batch("vs_b", "vsfb_2") is None
        assert await store.version("vs_b") is None
        assert await store.files("vs_b") == [] and await store.claim(9000.0, 30.0, 10) == []
        assert [s.id for s in await store.list("k")] == ["vs_a"]
        assert [c.texts for c in await store.chunks("vs_a")] == [["only"]]

        # a file deleted from /v1/files leaves every store it is in, of any owner, with its chunks
        assert await store.add_file(_file("vs_c", "file-1", "t7", owner="other"))
        assert await store.add_file(_file("vs_c", "file-5", "t8", owner="other"))
        assert await store.holding(["file-1"]) == [("vs_a", "file-1"), ("vs_c", "file-1")]
        assert await store.holding(["nope"]) == [] and await store.holding([]) == []
        before = await store.version("vs_a")
        assert await store.remove_everywhere(["nope", "file-1"]) == [("vs_a", "file-1"), ("vs_c", "file-1")]
        assert await store.holding(["file-1", "file-5"]) == [("vs_c", "file-5")] and await store.chunks("vs_a") == []
        assert await store.version("vs_a") != before
        assert [f.id for f in await store.files("vs_c")] == ["file-5"]  # the other files stay
        assert await store.remove_everywhere(["file-1"]) == []
        assert await store.delete("vs_c", "other") and await store.holding(["file-5"]) == []
    finally:
        await store.close()


async def _backlog(store: VectorStoreStore) -> None:
    """A backlog past Redis's claim window: claimed one at a time, every file once, none twice."""
    await store.open()
    try:
        await store.create(VectorStore("vs_big", "k", 0, "big", "tiny-embed"))
        for i in range(150):
            assert await store.add_file(_file("vs_big", f"file-{i:04d}", f"t{i}"))
        taken = []
        for _ in range(160):
            taken += [f.id for f in await store.claim(100.0, 30.0, 1)]
        assert sorted(taken) == [f"file-{i:04d}" for i in range(150)]
        assert taken[:3] == ["file-0000", "file-0001", "file-0002"]  # the earliest added first
    finally:
        await store.close()


def test_a_sqlite_file_from_before_versions_is_brought_up_to_date(tmp_path):
    import sqlite3

    path = tmp_path / "old.sqlite3"
    db = sqlite3.connect(path)
    db.execute("CREATE TABLE vector_stores (id TEXT PRIMARY KEY, owner TEXT NOT NULL, doc TEXT NOT NULL)")
    db.execute("INSERT INTO vector_stores VALUES ('vs_old', 'k', ?)", (VectorStore("vs_old", "k", 1, "old", "m").doc(),))
    db.commit()
    db.close()

    async def run() -> None:
        store = SQLiteVectorStores(path)
        await store.open()
        try:
            assert await store.version("vs_old") == 0 and (await store.get("vs_old", "k")).name == "old"
            assert await store.add_file(_file("vs_old", "file-1", "t1"))
            assert await store.version("vs_old") == 1
        finally:
            await store.close()

    asyncio.run(run())


def test_sqlite_store(tmp_path):
    asyncio.run(_contract(SQLiteVectorStores(tmp_path / "batches.sqlite3")))
    asyncio.run(_backlog(SQLiteVectorStores(tmp_path / "backlog.sqlite3")))


def test_redis_store(tmp_path):
    with redis_server(tmp_path) as url:
        asyncio.run(_contract(RedisVectorStores(url)))
        asyncio.run(_backlog(RedisVectorStores(url)))
