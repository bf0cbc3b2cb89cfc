"""Where chat completions made with ``store: true`` are kept, for the stored-completions API
(``gateway.stored_chat``): on the batch store's backend (``batch.store`` in tiers.yaml), as the
stored responses are.

* ``sqlite`` (the default): a ``chat_completions`` table in the batch store's SQLite file; a key's
  completions are listed in the order they were stored (the table's rowid).
* ``redis://...``: ``tg:chat-completion:{id}`` holds each one, and ``tg:chat-completions:{key id}``
  (a sorted set scored by the time it was stored, in microseconds) lists a key's.

A record is the completion object as the API shows it (with its ``metadata``) and the messages
of the request that made it. Only the key that made it sees it: every call takes the owner, and
another key's record is not found (a 404, as for files, batches and responses).

Retention (``stored_completions.retention_days``, 30 by default, as OpenAI keeps them): a record
older than that is not returned, and is deleted: on SQLite by a sweep when the store opens and
every hour, on Redis by its key's expiry (and its place in the key's list when that is next read).
"""

from __future__ import annotations

import abc
import json
import sqlite3
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gateway.service import Services
from storage import on_backend
from storage.redis import keyset_page
from storage.retention import Retained
from storage.sqlite import SweptFile

_SCHEMA = """CREATE TABLE IF NOT EXISTS chat_completions (
    id TEXT PRIMARY KEY, owner TEXT NOT NULL, model TEXT NOT NULL, created_at INTEGER NOT NULL, doc TEXT NOT NULL);
CREATE INDEX IF NOT EXISTS chat_completions_owner ON chat_completions (owner);
CREATE INDEX IF NOT EXISTS chat_completions_created_at ON chat_completions (created_at);"""
DAY_S = 86400
_UPDATE_TRIES = 8  # Redis: a metadata update raced by another this many times gives up


@dataclass(frozen=True)
class StoredCompletion:
    id: str
    owner: str  # key_id of the key that made it
    completion: dict[str, Any]  # the chat.completion object, with ``metadata``
    messages: list[dict[str, Any]]  # the request's messages, each as the messages list shows it

    @property
    def created(self) -> int:
        return self.completion["created"]

    def doc(self) -> str:
        return json.dumps({"owner": self.owner, "completion": self.completion, "messages": self.messages},
                          separators=(",", ":"))

    @classmethod
    def of(cls, completion_id: str, doc: str | bytes) -> "StoredCompletion":
        d = json.loads(doc)
        return cls(completion_id, d["owner"], d["completion"], d["messages"])

    def matches(self, model: str | None, metadata: dict[str, str]) -> bool:
        """Whether a list filtered by ``model`` (None: any) and ``metadata`` (every pair) shows it."""
        mine = self.completion.get("metadata") or {}
        return (model is None or self.completion["model"] == model) and all(mine.get(k) == v for k, v in metadata.items())


class CompletionStore(Retained, abc.ABC):
    @abc.abstractmethod
    async def open(self) -> None: ...

    @abc.abstractmethod
    async def close(self) -> None: ...

    @abc.abstractmethod
    async def put(self, record: StoredCompletion) -> None:
        """Store ``record`` (a new id)."""

    @abc.abstractmethod
    async def get(self, completion_id: str, owner: str) -> StoredCompletion | None:
        """The record, or None when there is none (or past its retention) or another key made it."""

    @abc.abstractmethod
    async def set_metadata(self, completion_id: str, owner: str, metadata: dict[str, str]) -> StoredCompletion | None:
        """Replace the record's ``metadata``; the record after, or None when ``get`` finds none."""

    @abc.abstractmethod
    async def delete(self, completion_id: str, owner: str) -> bool:
        """Delete the record; False when there is none or another key made it."""

    @abc.abstractmethod
    async def page(self, owner: str, after: str | None, limit: int, ascending: bool, model: str | None,
                   metadata: dict[str, str]) -> tuple[list[StoredCompletion], bool]:
        """``owner``'s records that match (``StoredCompletion.matches``) in the order they were
        stored (``ascending``) or the reverse, those after the record ``after`` (KeyError when it is
        not one of the owner's), ``limit`` at most; and whether more follow."""


class SQLiteCompletions(SweptFile, CompletionStore):
    """A table in one SQLite file (WAL; ``storage.sqlite``), every call on the thread that owns
    the connection."""

    def __init__(self, path: Path, retention_s: float | None = None, sweep_s: float = 3600.0) -> None:
        super().__init__(path, _SCHEMA, "tiergate-completions", retention_s, sweep_s)

    def _sweep(self, cutoff: float) -> int:
        return self._db.execute("DELETE FROM chat_completions WHERE created_at < ?", (cutoff,)).rowcount

    def _alive(self) -> float:
        cutoff = self._cutoff()
        return -1.0 if cutoff is None else cutoff

    async def put(self, record: StoredCompletion) -> None:
        await self._call(lambda: self._db.execute(
            "INSERT INTO chat_completions (id, owner, model, created_at, doc) VALUES (?, ?, ?, ?, ?)",
            (record.id, record.owner, record.completion["model"], record.created, record.doc())))

    def _get(self, completion_id: str, owner: str) -> StoredCompletion | None:
        row = self._db.execute("SELECT doc FROM chat_completions WHERE id = ? AND owner = ? AND created_at >= ?",
                               (completion_id, owner, self._alive())).fetchone()
        return StoredCompletion.of(completion_id, row[0]) if row else None

    async def get(self, completion_id: str, owner: str) -> StoredCompletion | None:
        return await self._call(self._get, completion_id, owner)

    async def set_metadata(self, completion_id: str, owner: str, metadata: dict[str, str]) -> StoredCompletion | None:
        def update(db: sqlite3.Connection) -> StoredCompletion | None:
            record = self._get(completion_id, owner)
            if record is None:
                return None
            record = StoredCompletion(record.id, owner, {**record.completion, "metadata": metadata}, record.messages)
            db.execute("UPDATE chat_completions SET doc = ? WHERE id = ?", (record.doc(), completion_id))
            return record

        return await self._call(self._tx, update)

    async def delete(self, completion_id: str, owner: str) -> bool:
        return await self._call(lambda: self._db.execute(
            "DELETE FROM chat_completions WHERE id = ? AND owner = ? AND created_at >= ?",
            (completion_id, owner, self._alive())).rowcount == 1)

    async def page(self, owner: str, after: str | None, limit: int, ascending: bool, model: str | None,
                   metadata: dict[str, str]) -> tuple[list[StoredCompletion], bool]:
        def read() -> tuple[list[StoredCompletion], bool]:
            sql = ["SELECT id, doc FROM chat_completions WHERE owner = ? AND created_at >= ?"]
            args: list[Any] = [owner, self._alive()]
            if after is not None:
                row = self._db.execute("SELECT rowid FROM chat_completions WHERE id = ? AND owner = ?",
                                       (after, owner)).fetchone()
                if row is None:
                    raise KeyError(after)
                sql.append("AND rowid > ?" if ascending else "AND rowid < ?")
                args.append(row[0])
            if model is not None:
                sql.append("AND model = ?")
                args.append(model)
            for key, value in metadata.items():
                sql.append("AND EXISTS (SELECT 1 FROM json_each(doc, '$.completion.metadata') WHERE key = ? AND value = ?)")
                args += [key, value]
            sql.append(f"ORDER BY rowid {'ASC' if ascending else 'DESC'} LIMIT ?")
            rows = self._db.execute(" ".join(sql), (*args, limit + 1)).fetchall()
            return [StoredCompletion.of(i, doc) for i, doc in rows[:limit]], len(rows) > limit

        return await self._call(read)


# KEYS record, owner's list; ARGV owner, id: delete only the owner's record
_DELETE = """
local doc = redis.call('GET', KEYS[1])
if not doc or cjson.decode(doc)['owner'] ~= ARGV[1] then return 0 end
redis.call('ZREM', KEYS[2], ARGV[2])
return redis.call('DEL', KEYS[1])
"""

# KEYS record; ARGV the doc read, the new doc: replace it only if no one changed it meanwhile
_REPLACE = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
redis.call('SET', KEYS[1], ARGV[2], 'KEEPTTL')
return 1
"""


class RedisCompletions(CompletionStore):
    """One key per completion, expiring at the end of its retention, and per key a sorted set of
    its completions' ids by the time each was stored."""

    def __init__(self, url: str, prefix: str = "tg:", retention_s: float | None = None) -> None:
        self.url, self.prefix, self.retention_s = url, prefix, retention_s
        self._r = None

    def _key(self, completion_id: str) -> str:
        return f"{self.prefix}chat-completion:{completion_id}"

    def _list(self, owner: str) -> str:
        return f"{self.prefix}chat-completions:{owner}"

    async def open(self) -> None:
        import redis.asyncio as aioredis

        self._r = aioredis.Redis.from_url(self.url)
        self._delete = self._r.register_script(_DELETE)
        self._replace = self._r.register_script(_REPLACE)

    async def close(self) -> None:
        if self._r is not None:
            await self._r.aclose()
            self._r = None

    async def put(self, record: StoredCompletion) -> None:
        expires = self._expires_at(record.created)
        async with self._r.pipeline(transaction=True) as tx:
            tx.set(self._key(record.id), record.doc(), nx=True, exat=expires)
            tx.zadd(self._list(record.owner), {record.id: time.time_ns() // 1000})
            await tx.execute()

    def _mine(self, completion_id: str, raw: bytes | None, owner: str) -> StoredCompletion | None:
        record = StoredCompletion.of(completion_id, raw) if raw else None
        if record is None or record.owner != owner:
            return None
        cutoff = self._cutoff()
        return record if cutoff is None or record.created >= cutoff else None

    async def get(self, completion_id: str, owner: str) -> StoredCompletion | None:
        return self._mine(completion_id, await self._r.get(self._key(completion_id)), owner)

    async def set_metadata(self, completion_id: str, owner: str, metadata: dict[str, str]) -> StoredCompletion | None:
        for _ in range(_UPDATE_TRIES):
            raw = await self._r.get(self._key(completion_id))
            record = self._mine(completion_id, raw, owner)
            if record is None:
                return None
            record = StoredCompletion(record.id, owner, {**record.completion, "metadata": metadata}, record.messages)
            if await self._replace(keys=[self._key(completion_id)], args=[raw, record.doc()]):
                return record
        raise RuntimeError(f"the stored completion {completion_id} kept changing while its metadata was set")

    async def delete(self, completion_id: str, owner: str) -> bool:
        return bool(await self._delete(keys=[self._key(completion_id), self._list(owner)], args=[owner, completion_id]))

    async def page(self, owner: str, after: str | None, limit: int, ascending: bool, model: str | None,
                   metadata: dict[str, str]) -> tuple[list[StoredCompletion], bool]:
        listed = self._list(owner)
        cutoff = self._cutoff()
        if cutoff is not None:  # (their keys expired already)
            await self._r.zremrangebyscore(listed, "-inf", f"({int(cutoff * 1e6)}")
        cursor = None
        if after is not None:
            score = await self._r.zscore(listed, after)
            if score is None:
                raise KeyError(after)
            cursor = (score, after.encode())
        found: list[StoredCompletion] = []
        while len(found) <= limit:
            # past the last one read, by (stored at, id): not by rank, which the completions stored or
            # deleted meanwhile move (the page then repeated some and skipped others)
            page = await keyset_page(self._r, listed, cursor, 100, not ascending)
            if not page:
                break
            last, score = page[-1]
            cursor = (score, last)
            names = [i.decode() for i, _ in page]
            for name, raw in zip(names, await self._r.mget([self._key(n) for n in names])):
                record = self._mine(name, raw, owner)
                if record is None:
                    if raw is None:  # expired or deleted: no longer listed
                        await self._r.zrem(listed, name)
                    continue
                if record.matches(model, metadata):
                    found.append(record)
        return found[:limit], len(found) > limit


def open_completions(spec: str, data_dir: Path, retention_s: float | None = None) -> CompletionStore:
    """The stored chat completions on ``spec``'s backend (``storage.on_backend``): the batch store's SQLite file in
    ``data_dir``, or Redis at that URL."""
    return on_backend(spec, lambda: SQLiteCompletions(data_dir / "batches.sqlite3", retention_s), lambda url: RedisCompletions(url, retention_s=retention_s))


def completions_for(svc: Services) -> CompletionStore:
    """The process's completion store on the configured backend, opened and closed with the app."""
    days = svc.config.stored_completions.retention_days
    return svc.keep_open(open_completions(svc.config.batch.store, svc.config.data_dir(),
                                          None if days is None else days * DAY_S))
