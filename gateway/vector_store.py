"""Where vector stores (``/v1/vector_stores``) are kept: on the batch store's backend
(``batch.store`` in tiers.yaml), as conversations are.

* ``sqlite`` (the default): ``vector_stores``, ``vector_store_files`` and ``vector_store_batches``
  tables in the batch store's SQLite file; a file's chunks (their texts, and their vectors as one
  float32 matrix) in its row.
* ``redis://...``: ``tg:vs:{id}`` holds a vector store, ``tg:vs-files:{id}`` (a hash by file id) its
  files, ``tg:vs-texts:{id}`` and ``tg:vs-vectors:{id}`` (hashes by file id) their chunks,
  ``tg:vs-owned:{owner}`` (a set) a key's stores, ``tg:vs-batches:{id}`` (a hash by batch id) its
  file batches, ``tg:vs-version:{id}`` a counter of its files' changes, ``tg:vs-order:{id}`` (a
  sorted set, by the counter ``tg:vs-seq``) the order its files were added in, and ``tg:vs-pending`` (a sorted set, by
  lease end) the files waiting to be read (``gateway.vector_store_redis``).

A vector store belongs to the key that made it (another key finds nothing). A file in it is
``in_progress`` until a process has read, cut and embedded it (``gateway.vector_stores.Indexer``),
then ``completed`` with its chunks, or ``failed`` with the reason. A process takes a waiting file
with a lease (``claim``) and renews it while it works (``hold``); a file whose lease ran out (its
process died) is taken again by the next ``claim``, anywhere, so an accepted file is never lost.
Each addition of a file has its own ``token``: the work on an earlier addition of the same file
(added again, or removed meanwhile) cannot finish it.
"""

from __future__ import annotations

import abc
import json
import re
import sqlite3
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from gateway.service import Services
from storage import on_backend
from storage.records import JsonRecord
from storage.redis import RedisKeys
from storage.sqlite import SQLiteFile

_SCHEMA = """CREATE TABLE IF NOT EXISTS vector_stores (
    id TEXT PRIMARY KEY, owner TEXT NOT NULL, doc TEXT NOT NULL, version INTEGER NOT NULL DEFAULT 0);
CREATE TABLE IF NOT EXISTS vector_store_files (
    vector_store_id TEXT NOT NULL, file_id TEXT NOT NULL, status TEXT NOT NULL, lease_until REAL NOT NULL,
    doc TEXT NOT NULL, texts TEXT, vectors BLOB, UNIQUE (vector_store_id, file_id));
CREATE INDEX IF NOT EXISTS vector_store_files_waiting ON vector_store_files (status, lease_until);
CREATE INDEX IF NOT EXISTS vector_store_files_by_file ON vector_store_files (file_id);
CREATE TABLE IF NOT EXISTS vector_store_batches (
    vector_store_id TEXT NOT NULL, id TEXT NOT NULL, doc TEXT NOT NULL, PRIMARY KEY (vector_store_id, id));"""


@dataclass(frozen=True)
class VectorStore(JsonRecord):
    id: str
    owner: str
    created_at: int
    name: str
    model: str  # the embedding model its chunks and queries are embedded with
    metadata: dict[str, str] = field(default_factory=dict)
    description: str | None = None
    expires_days: int | None = None  # expires this many days after it was last active
    last_active_at: int = 0

    @property
    def expires_at(self) -> int | None:
        return None if self.expires_days is None else self.last_active_at + self.expires_days * 86400

    def expired(self, now: float) -> bool:
        return self.expires_at is not None and now >= self.expires_at

    def public(self, files: list["StoreFile"], now: float) -> dict[str, Any]:
        counts = {s: sum(f.status == s for f in files) for s in ("in_progress", "completed", "failed", "cancelled")}
        status = "expired" if self.expired(now) else "in_progress" if counts["in_progress"] else "completed"
        return {"id": self.id, "object": "vector_store", "created_at": self.created_at, "name": self.name,
                "description": self.description, "usage_bytes": sum(f.usage_bytes for f in files),
                "file_counts": {**counts, "total": len(files)}, "status": status,
                "expires_after": None if self.expires_days is None else {"anchor": "last_active_at", "days": self.expires_days},
                "expires_at": self.expires_at, "last_active_at": self.last_active_at, "metadata": self.metadata,
                "model": self.model}



@dataclass(frozen=True)
class StoreFile(JsonRecord):
    """A file in a vector store: which addition of it (``token``), who added it at which tier (its
    chunks are embedded as that key's requests), how it is cut, and how far it got."""

    vector_store_id: str
    id: str  # the file's id in /v1/files
    token: str  # this addition of the file
    owner: str
    tier: str
    created_at: int
    filename: str
    chunk_tokens: int
    overlap_tokens: int
    attributes: dict[str, str | float | bool] = field(default_factory=dict)
    status: str = "in_progress"  # in_progress, completed, failed, cancelled
    usage_bytes: int = 0
    chunks: int = 0
    last_error: dict[str, str] | None = None
    lease_until: float = 0.0  # in_progress: a process works on it until then
    batch_id: str | None = None  # the file batch it was added in

    def public(self) -> dict[str, Any]:
        return {"id": self.id, "object": "vector_store.file", "created_at": self.created_at,
                "vector_store_id": self.vector_store_id, "status": self.status, "usage_bytes": self.usage_bytes,
                "last_error": self.last_error, "attributes": self.attributes,
                "chunking_strategy": {"type": "static", "static": {"max_chunk_size_tokens": self.chunk_tokens,
                                                                   "chunk_overlap_tokens": self.overlap_tokens}}}



@dataclass(frozen=True)
class FileBatch(JsonRecord):
    """A file batch: the files added in it, kept with it (their rows are replaced when a file is
    added again, and go when it is removed), and once it ended the counts it ended with."""

    id: str
    vector_store_id: str
    created_at: int
    file_ids: list[str]
    counts: dict[str, int] | None = None  # in_progress, completed, failed, cancelled: set once it ended


@dataclass(frozen=True)
class Chunks:
    """A completed file's chunks: their texts, and their vectors (one float32 row each)."""

    file: StoreFile
    texts: list[str]
    vectors: np.ndarray


def _vectors(raw: bytes, rows: int) -> np.ndarray:
    return np.frombuffer(raw, dtype="<f4").reshape(rows, -1) if rows else np.zeros((0, 0), np.float32)


class VectorStoreStore(abc.ABC):
    @abc.abstractmethod
    async def open(self) -> None: ...

    @abc.abstractmethod
    async def close(self) -> None: ...

    @abc.abstractmethod
    async def create(self, store: VectorStore) -> None:
        """Store a new vector store (without files)."""

    @abc.abstractmethod
    async def get(self, store_id: str, owner: str) -> VectorStore | None:
        """The store, or None when there is none or another key made it."""

    @abc.abstractmethod
    async def list(self, owner: str) -> list[VectorStore]:
        """The key's stores, oldest first."""

    @abc.abstractmethod
    async def update(self, store: VectorStore) -> bool:
        """Replace the stored fields of ``store`` (same id and owner); False when it is gone."""

    @abc.abstractmethod
    async def touch(self, store_id: str, owner: str, at: int) -> None:
        """Its ``last_active_at`` set to ``at`` where that is later, and nothing else: a search
        that read the store does not write back the rest (an update made meanwhile stays)."""

    @abc.abstractmethod
    async def delete(self, store_id: str, owner: str) -> bool:
        """Delete the store with its files and chunks; False when there is none (or not the owner's)."""

    @abc.abstractmethod
    async def put_batch(self, batch: FileBatch) -> bool:
        """Keep (or replace) a file batch while its store exists; False when it is gone."""

    @abc.abstractmethod
    async def batch(self, store_id: str, batch_id: str) -> FileBatch | None:
        """The file batch, or None."""

    @abc.abstractmethod
    async def add_file(self, file: StoreFile) -> bool:
        """Add ``file`` (``in_progress``, no lease) to its store, replacing an earlier addition of the
        same file and its chunks; False when the store is gone."""

    @abc.abstractmethod
    async def files(self, store_id: str) -> list[StoreFile]:
        """The store's files, in the order they were (last) added."""

    @abc.abstractmethod
    async def file(self, store_id: str, file_id: str) -> StoreFile | None: ...

    @abc.abstractmethod
    async def set_attributes(self, store_id: str, file_id: str, attributes: dict[str, Any]) -> StoreFile | None:
        """The file with its attributes replaced; None when it is not in the store."""

    @abc.abstractmethod
    async def delete_file(self, store_id: str, file_id: str) -> bool:
        """Remove the file and its chunks from the store; False when it is not there."""

    @abc.abstractmethod
    async def holding(self, file_ids: Sequence[str]) -> list[tuple[str, str]]:
        """(store id, file id) for each of ``file_ids`` in each store (of any owner) it is in, sorted."""

    async def remove_everywhere(self, file_ids: Sequence[str]) -> list[tuple[str, str]]:
        """Remove the files and their chunks from every store they are in (the files themselves
        are deleted or expired: nothing of their text may stay searchable); the (store id, file id)
        pairs removed."""
        return [pair for pair in await self.holding(file_ids) if await self.delete_file(*pair)]

    @abc.abstractmethod
    async def claim(self, now: float, lease_s: float, limit: int) -> list[StoreFile]:
        """Up to ``limit`` ``in_progress`` files, of any store, whose lease ended before ``now``,
        each now leased until ``now + lease_s`` (returned with that lease)."""

    @abc.abstractmethod
    async def hold(self, file: StoreFile, until: float) -> bool:
        """Extend the lease of this addition of the file; False when it is no longer waiting
        (removed, added again, or its store deleted): the work on it should stop."""

    @abc.abstractmethod
    async def finish(self, file: StoreFile, texts: list[str], vectors: np.ndarray) -> bool:
        """``completed``, with its chunks (``vectors``: one float32 row per text), if this addition of
        the file is still waiting; False (nothing written) otherwise."""

    @abc.abstractmethod
    async def fail(self, file: StoreFile, code: str, message: str) -> bool:
        """``failed`` with ``last_error`` if this addition of the file is still waiting."""

    @abc.abstractmethod
    async def cancel(self, file: StoreFile) -> bool:
        """``cancelled`` if this addition of the file is still waiting: it will not be read."""

    @abc.abstractmethod
    async def version(self, store_id: str) -> int | None:
        """A number that changes whenever the store's files do (added, changed, read, removed);
        None when the store is gone. A search's copy of the store is current while it holds."""

    @abc.abstractmethod
    async def chunks(self, store_id: str) -> list[Chunks]:
        """Every completed file's chunks, in the order of ``files``."""

    @abc.abstractmethod
    async def file_texts(self, store_id: str, file_id: str) -> list[str] | None:
        """A completed file's chunk texts; None when the file is not in the store."""


def _finished(file: StoreFile, texts: list[str]) -> StoreFile:
    return replace(file, status="completed", chunks=len(texts), lease_until=0.0,
                   usage_bytes=sum(len(t.encode()) for t in texts))


class SQLiteVectorStores(SQLiteFile, VectorStoreStore):
    """Three tables in the batch store's SQLite file (WAL; ``storage.sqlite``), every call on the
    thread that owns the connection."""

    def __init__(self, path: Path) -> None:
        super().__init__(path, _SCHEMA, "tiergate-vector-stores")

    def _migrate(self, db: sqlite3.Connection) -> None:
        if "version" not in {row[1] for row in db.execute("PRAGMA table_info(vector_stores)")}:
            db.execute("ALTER TABLE vector_stores ADD COLUMN version INTEGER NOT NULL DEFAULT 0")  # a file from before it

    def _get(self, store_id: str, owner: str) -> VectorStore | None:
        row = self._db.execute("SELECT doc FROM vector_stores WHERE id = ? AND owner = ?", (store_id, owner)).fetchone()
        return VectorStore.of(row[0]) if row else None

    def _file(self, store_id: str, file_id: str) -> StoreFile | None:
        row = self._db.execute("SELECT doc FROM vector_store_files WHERE vector_store_id = ? AND file_id = ?",
                               (store_id, file_id)).fetchone()
        return StoreFile.of(row[0]) if row else None

    def _waiting(self, file: StoreFile) -> bool:
        now = self._file(file.vector_store_id, file.id)
        return now is not None and now.token == file.token and now.status == "in_progress"

    async def create(self, store: VectorStore) -> None:
        await self._call(self._tx, lambda db: db.execute(
            "INSERT INTO vector_stores (id, owner, doc) VALUES (?, ?, ?)", (store.id, store.owner, store.doc())))

    async def get(self, store_id: str, owner: str) -> VectorStore | None:
        return await self._call(self._get, store_id, owner)

    async def list(self, owner: str) -> list[VectorStore]:
        def read() -> list[VectorStore]:
            rows = self._db.execute("SELECT doc FROM vector_stores WHERE owner = ? ORDER BY rowid", (owner,)).fetchall()
            return [VectorStore.of(row[0]) for row in rows]

        return await self._call(read)

    async def update(self, store: VectorStore) -> bool:
        return await self._call(self._tx, lambda db: db.execute(
            "UPDATE vector_stores SET doc = ? WHERE id = ? AND owner = ?", (store.doc(), store.id, store.owner)).rowcount == 1)

    async def touch(self, store_id: str, owner: str, at: int) -> None:
        await self._call(self._tx, lambda db: db.execute(
            "UPDATE vector_stores SET doc = json_set(doc, '$.last_active_at', ?) WHERE id = ? AND owner = ? "
            "AND json_extract(doc, '$.last_active_at') < ?", (at, store_id, owner, at)))

    async def delete(self, store_id: str, owner: str) -> bool:
        def write(db: sqlite3.Connection) -> bool:
            if db.execute("DELETE FROM vector_stores WHERE id = ? AND owner = ?", (store_id, owner)).rowcount != 1:
                return False
            db.execute("DELETE FROM vector_store_files WHERE vector_store_id = ?", (store_id,))
            db.execute("DELETE FROM vector_store_batches WHERE vector_store_id = ?", (store_id,))
            return True

        return await self._call(self._tx, write)

    async def put_batch(self, batch: FileBatch) -> bool:
        def write(db: sqlite3.Connection) -> bool:
            if db.execute("SELECT 1 FROM vector_stores WHERE id = ?", (batch.vector_store_id,)).fetchone() is None:
                return False
            db.execute("INSERT OR REPLACE INTO vector_store_batches (vector_store_id, id, doc) VALUES (?, ?, ?)",
                       (batch.vector_store_id, batch.id, batch.doc()))
            return True

        return await self._call(self._tx, write)

    async def batch(self, store_id: str, batch_id: str) -> FileBatch | None:
        def read() -> FileBatch | None:
            row = self._db.execute("SELECT doc FROM vector_store_batches WHERE vector_store_id = ? AND id = ?",
                                   (store_id, batch_id)).fetchone()
            return FileBatch.of(row[0]) if row else None

        return await self._call(read)

    async def add_file(self, file: StoreFile) -> bool:
        def write(db: sqlite3.Connection) -> bool:
            if db.execute("SELECT 1 FROM vector_stores WHERE id = ?", (file.vector_store_id,)).fetchone() is None:
                return False
            db.execute("DELETE FROM vector_store_files WHERE vector_store_id = ? AND file_id = ?",
                       (file.vector_store_id, file.id))  # then a new rowid: the files' order is the order added
            db.execute("INSERT INTO vector_store_files (vector_store_id, file_id, status, lease_until, doc) "
                       "VALUES (?, ?, ?, ?, ?)", (file.vector_store_id, file.id, file.status, file.lease_until, file.doc()))
            self._changed(db, file.vector_store_id)
            return True

        return await self._call(self._tx, write)

    async def files(self, store_id: str) -> list[StoreFile]:
        def read() -> list[StoreFile]:
            rows = self._db.execute("SELECT doc FROM vector_store_files WHERE vector_store_id = ? ORDER BY rowid",
                                    (store_id,)).fetchall()
            return [StoreFile.of(row[0]) for row in rows]

        return await self._call(read)

    async def file(self, store_id: str, file_id: str) -> StoreFile | None:
        return await self._call(self._file, store_id, file_id)

    def _put(self, db: sqlite3.Connection, file: StoreFile, *chunks: Any) -> None:
        sets = ", texts = ?, vectors = ?" if chunks else ""
        db.execute(f"UPDATE vector_store_files SET status = ?, lease_until = ?, doc = ?{sets} "
                   "WHERE vector_store_id = ? AND file_id = ?",
                   (file.status, file.lease_until, file.doc(), *chunks, file.vector_store_id, file.id))
        self._changed(db, file.vector_store_id)

    @staticmethod
    def _changed(db: sqlite3.Connection, store_id: str) -> None:
        db.execute("UPDATE vector_stores SET version = version + 1 WHERE id = ?", (store_id,))

    async def version(self, store_id: str) -> int | None:
        def read() -> int | None:
            row = self._db.execute("SELECT version FROM vector_stores WHERE id = ?", (store_id,)).fetchone()
            return row[0] if row else None

        return await self._call(read)

    async def set_attributes(self, store_id: str, file_id: str, attributes: dict[str, Any]) -> StoreFile | None:
        def write(db: sqlite3.Connection) -> StoreFile | None:
            found = self._file(store_id, file_id)
            if found is None:
                return None
            changed = replace(found, attributes=attributes)
            self._put(db, changed)
            return changed

        return await self._call(self._tx, write)

    async def delete_file(self, store_id: str, file_id: str) -> bool:
        def write(db: sqlite3.Connection) -> bool:
            if db.execute("DELETE FROM vector_store_files WHERE vector_store_id = ? AND file_id = ?",
                          (store_id, file_id)).rowcount != 1:
                return False
            self._changed(db, store_id)
            return True

        return await self._call(self._tx, write)

    async def holding(self, file_ids: Sequence[str]) -> list[tuple[str, str]]:
        def read() -> list[tuple[str, str]]:
            pairs: list[tuple[str, str]] = []
            ids = list(dict.fromkeys(file_ids))
            for start in range(0, len(ids), 500):  # under SQLite's limit on bound values
                part = ids[start:start + 500]
                pairs += self._db.execute("SELECT vector_store_id, file_id FROM vector_store_files WHERE file_id IN "
                                          f"({', '.join('?' * len(part))})", part).fetchall()
            return sorted(pairs)

        return await self._call(read) if file_ids else []

    async def claim(self, now: float, lease_s: float, limit: int) -> list[StoreFile]:
        def write(db: sqlite3.Connection) -> list[StoreFile]:
            rows = db.execute("SELECT doc FROM vector_store_files WHERE status = 'in_progress' AND lease_until < ? "
                              "ORDER BY rowid LIMIT ?", (now, limit)).fetchall()
            taken = [replace(StoreFile.of(row[0]), lease_until=now + lease_s) for row in rows]
            for file in taken:
                self._put(db, file)
            return taken

        return await self._call(self._tx, write)

    async def hold(self, file: StoreFile, until: float) -> bool:
        def write(db: sqlite3.Connection) -> bool:
            if not self._waiting(file):
                return False
            self._put(db, replace(self._file(file.vector_store_id, file.id), lease_until=until))
            return True

        return await self._call(self._tx, write)

    async def finish(self, file: StoreFile, texts: list[str], vectors: np.ndarray) -> bool:
        def write(db: sqlite3.Connection) -> bool:
            if not self._waiting(file):
                return False
            done = _finished(self._file(file.vector_store_id, file.id), texts)
            self._put(db, done, json.dumps(texts), np.ascontiguousarray(vectors, dtype="<f4").tobytes())
            return True

        return await self._call(self._tx, write)

    async def fail(self, file: StoreFile, code: str, message: str) -> bool:
        def write(db: sqlite3.Connection) -> bool:
            if not self._waiting(file):
                return False
            self._put(db, replace(self._file(file.vector_store_id, file.id), status="failed", lease_until=0.0,
                                  last_error={"code": code, "message": message}))
            return True

        return await self._call(self._tx, write)

    async def cancel(self, file: StoreFile) -> bool:
        def write(db: sqlite3.Connection) -> bool:
            if not self._waiting(file):
                return False
            self._put(db, replace(self._file(file.vector_store_id, file.id), status="cancelled", lease_until=0.0))
            return True

        return await self._call(self._tx, write)

    async def chunks(self, store_id: str) -> list[Chunks]:
        def read() -> list[Chunks]:
            rows = self._db.execute("SELECT doc, texts, vectors FROM vector_store_files WHERE vector_store_id = ? "
                                    "AND status = 'completed' ORDER BY rowid", (store_id,)).fetchall()
            out = []
            for doc, texts, vectors in rows:
                listed = json.loads(texts)
                out.append(Chunks(StoreFile.of(doc), listed, _vectors(vectors, len(listed))))
            return out

        return await self._call(read)

    async def file_texts(self, store_id: str, file_id: str) -> list[str] | None:
        def read() -> list[str] | None:
            row = self._db.execute("SELECT texts FROM vector_store_files WHERE vector_store_id = ? AND file_id = ?",
                                   (store_id, file_id)).fetchone()
            return None if row is None else json.loads(row[0]) if row[0] else []

        return await self._call(read)


# KEYS store, owned; ARGV store id, doc: only a new store
_CREATE = """
if not redis.call('SET', KEYS[1], ARGV[2], 'NX') then return 0 end
redis.call('SADD', KEYS[2], ARGV[1])
return 1
"""

# KEYS store; ARGV owner, doc: replace the owner's store
_UPDATE = """
local doc = redis.call('GET', KEYS[1])
if not doc or cjson.decode(doc)['owner'] ~= ARGV[1] then return 0 end
redis.call('SET', KEYS[1], ARGV[2])
return 1
"""

# KEYS store; ARGV owner, time: the owner's store last active then, where that is later
_TOUCH = """
local doc = redis.call('GET', KEYS[1])
if not doc then return 0 end
local d = cjson.decode(doc)
if d['owner'] ~= ARGV[1] or d['last_active_at'] >= tonumber(ARGV[2]) then return 0 end
d['last_active_at'] = tonumber(ARGV[2])
redis.call('SET', KEYS[1], cjson.encode(d))
return 1
"""

# KEYS store, owned, files, texts, vectors, order, pending, version, batches; ARGV owner, store id: the
# owner's store with its files, chunks, waiting files and file batches
_DELETE = """
local doc = redis.call('GET', KEYS[1])
if not doc or cjson.decode(doc)['owner'] ~= ARGV[1] then return 0 end
for _, file_id in ipairs(redis.call('HKEYS', KEYS[3])) do redis.call('ZREM', KEYS[7], ARGV[2] .. '\\n' .. file_id) end
redis.call('DEL', KEYS[1], KEYS[3], KEYS[4], KEYS[5], KEYS[6], KEYS[8], KEYS[9])
redis.call('SREM', KEYS[2], ARGV[2])
return 1
"""

# KEYS store, batches; ARGV batch id, doc: the batch, while the store exists
_PUT_BATCH = """
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
redis.call('HSET', KEYS[2], ARGV[1], ARGV[2])
return 1
"""

# KEYS store, files, texts, vectors, order, pending, seq, version; ARGV file id, doc, pending member,
# lease ('' when not waiting): the file, last in the store's order, without chunks, while the store exists
_ADD_FILE = """
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
redis.call('INCR', KEYS[8])
redis.call('HSET', KEYS[2], ARGV[1], ARGV[2])
redis.call('HDEL', KEYS[3], ARGV[1])
redis.call('HDEL', KEYS[4], ARGV[1])
redis.call('ZADD', KEYS[5], redis.call('INCR', KEYS[7]), ARGV[1])
if ARGV[4] == '' then redis.call('ZREM', KEYS[6], ARGV[3]) else redis.call('ZADD', KEYS[6], ARGV[4], ARGV[3]) end
return 1
"""

# KEYS files, texts, vectors, order, pending, version; ARGV file id, pending member
_DELETE_FILE = """
if redis.call('HDEL', KEYS[1], ARGV[1]) == 0 then return 0 end
redis.call('INCR', KEYS[6])
redis.call('HDEL', KEYS[2], ARGV[1])
redis.call('HDEL', KEYS[3], ARGV[1])
redis.call('ZREM', KEYS[4], ARGV[1])
redis.call('ZREM', KEYS[5], ARGV[2])
return 1
"""

# KEYS files, pending, texts, vectors, version; ARGV file id, the doc read, the new doc, pending member,
# lease ('' when not waiting)[, texts, vectors]: the new doc (and chunks) if the doc is still the one read
_SWAP = """
if redis.call('HGET', KEYS[1], ARGV[1]) ~= ARGV[2] then return 0 end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[3])
redis.call('INCR', KEYS[5])
if ARGV[5] == '' then redis.call('ZREM', KEYS[2], ARGV[4]) else redis.call('ZADD', KEYS[2], ARGV[5], ARGV[4]) end
if #ARGV > 5 then
  redis.call('HSET', KEYS[3], ARGV[1], ARGV[6])
  redis.call('HSET', KEYS[4], ARGV[1], ARGV[7])
end
return 1
"""


CLAIM_WINDOW = 64  # the due files a Redis claim reads to find the earliest added


class RedisVectorStores(RedisKeys, VectorStoreStore):
    """Per store a JSON doc and hashes (by file id) of its files' docs, chunk texts and vectors; a
    sorted set of its file ids by a global addition counter gives the files' order, and one sorted
    set of the waiting (``in_progress``) files by lease end is what ``claim`` takes from."""

    def __init__(self, url: str, prefix: str = "tg:") -> None:
        super().__init__(url, prefix)

    async def open(self) -> None:
        await super().open()
        self._create = self._r.register_script(_CREATE)
        self._update = self._r.register_script(_UPDATE)
        self._touch = self._r.register_script(_TOUCH)
        self._delete = self._r.register_script(_DELETE)
        self._put_batch = self._r.register_script(_PUT_BATCH)
        self._add_file = self._r.register_script(_ADD_FILE)
        self._delete_file = self._r.register_script(_DELETE_FILE)
        self._swap = self._r.register_script(_SWAP)

    def _of(self, store_id: str, *kinds: str) -> list[str]:
        return [self.k(kind, store_id) for kind in kinds]

    @property
    def _pending(self) -> str:
        return self.k("vs-pending")

    @staticmethod
    def _member(store_id: str, file_id: str) -> str:
        return f"{store_id}\n{file_id}"

    @staticmethod
    def _lease(file: StoreFile) -> str:
        return repr(float(file.lease_until)) if file.status == "in_progress" else ""

    async def create(self, store: VectorStore) -> None:
        if not await self._create(keys=[self.k("vs", store.id), self.k("vs-owned", store.owner)], args=[store.id, store.doc()]):
            raise ValueError(f"vector store {store.id!r} exists already")

    async def get(self, store_id: str, owner: str) -> VectorStore | None:
        raw = await self._r.get(self.k("vs", store_id))
        store = VectorStore.of(raw) if raw else None
        return store if store is not None and store.owner == owner else None

    async def list(self, owner: str) -> list[VectorStore]:
        ids = [i.decode() for i in await self._r.smembers(self.k("vs-owned", owner))]
        docs = await self._r.mget([self.k("vs", i) for i in ids]) if ids else []
        stores = [VectorStore.of(doc) for doc in docs if doc]
        return sorted((s for s in stores if s.owner == owner), key=lambda s: (s.created_at, s.id))

    async def update(self, store: VectorStore) -> bool:
        return bool(await self._update(keys=[self.k("vs", store.id)], args=[store.owner, store.doc()]))

    async def touch(self, store_id: str, owner: str, at: int) -> None:
        await self._touch(keys=[self.k("vs", store_id)], args=[owner, at])

    async def delete(self, store_id: str, owner: str) -> bool:
        keys = [self.k("vs", store_id), self.k("vs-owned", owner),
                *self._of(store_id, "vs-files", "vs-texts", "vs-vectors", "vs-order"), self._pending,
                self.k("vs-version", store_id), self.k("vs-batches", store_id)]
        return bool(await self._delete(keys=keys, args=[owner, store_id]))

    async def put_batch(self, batch: FileBatch) -> bool:
        keys = self._of(batch.vector_store_id, "vs", "vs-batches")
        return bool(await self._put_batch(keys=keys, args=[batch.id, batch.doc()]))

    async def batch(self, store_id: str, batch_id: str) -> FileBatch | None:
        raw = await self._r.hget(self.k("vs-batches", store_id), batch_id)
        return FileBatch.of(raw) if raw else None

    async def add_file(self, file: StoreFile) -> bool:
        s = file.vector_store_id
        keys = [*self._of(s, "vs", "vs-files", "vs-texts", "vs-vectors", "vs-order"), self._pending, self.k("vs-seq"),
                self.k("vs-version", s)]
        return bool(await self._add_file(keys=keys, args=[file.id, file.doc(), self._member(s, file.id), self._lease(file)]))

    async def files(self, store_id: str) -> list[StoreFile]:
        async with self._r.pipeline(transaction=True) as tx:
            tx.zrange(self.k("vs-order", store_id), 0, -1)
            tx.hgetall(self.k("vs-files", store_id))
            order, docs = await tx.execute()
        return [StoreFile.of(docs[i]) for i in order if i in docs]

    async def file(self, store_id: str, file_id: str) -> StoreFile | None:
        raw = await self._r.hget(self.k("vs-files", store_id), file_id)
        return StoreFile.of(raw) if raw else None

    async def _change(self, store_id: str, file_id: str, change: Callable[[StoreFile], StoreFile | None],
                      *chunks: bytes | str) -> StoreFile | None:
        """The file's doc replaced by ``change(doc)`` (with ``chunks``: its texts and vectors); None
        when the file is not there or ``change`` returns None. When another write lands between the
        read and the write, it is read and changed again: each lost round is another call's write."""
        keys = [self.k("vs-files", store_id), self._pending, *self._of(store_id, "vs-texts", "vs-vectors", "vs-version")]
        while True:
            raw = await self._r.hget(keys[0], file_id)
            changed = change(StoreFile.of(raw)) if raw else None
            if changed is None:
                return None
            args = [file_id, raw, changed.doc(), self._member(store_id, file_id), self._lease(changed), *chunks]
            if await self._swap(keys=keys, args=args):
                return changed

    async def _change_waiting(self, file: StoreFile, change: Callable[[StoreFile], StoreFile], *chunks: bytes | str) -> bool:
        """``_change`` on this addition of the file while it is ``in_progress``."""
        def guarded(now: StoreFile) -> StoreFile | None:
            return change(now) if now.token == file.token and now.status == "in_progress" else None

        return await self._change(file.vector_store_id, file.id, guarded, *chunks) is not None

    async def set_attributes(self, store_id: str, file_id: str, attributes: dict[str, Any]) -> StoreFile | None:
        return await self._change(store_id, file_id, lambda f: replace(f, attributes=attributes))

    async def delete_file(self, store_id: str, file_id: str) -> bool:
        keys = [*self._of(store_id, "vs-files", "vs-texts", "vs-vectors", "vs-order"), self._pending,
                self.k("vs-version", store_id)]
        return bool(await self._delete_file(keys=keys, args=[file_id, self._member(store_id, file_id)]))

    async def holding(self, file_ids: Sequence[str]) -> list[tuple[str, str]]:
        """One scan of the stores' file hashes (files are deleted rarely; no reverse index to keep)."""
        ids = list(dict.fromkeys(file_ids))
        if not ids:
            return []
        files_of = self.k("vs-files", "")
        pattern = re.sub(r"([*?\[\]\\])", r"\\\1", files_of) + "*"  # the prefix matched as written
        stores = sorted([key.decode().removeprefix(files_of) async for key in self._r.scan_iter(match=pattern, count=1000)])
        async with self._r.pipeline(transaction=False) as p:
            for store_id in stores:
                p.hmget(self.k("vs-files", store_id), ids)
            found = await p.execute() if stores else []
        return [(store_id, file_id) for store_id, docs in zip(stores, found) for file_id, doc in zip(ids, docs) if doc]

    async def version(self, store_id: str) -> int | None:
        async with self._r.pipeline(transaction=True) as tx:
            tx.exists(self.k("vs", store_id))
            tx.get(self.k("vs-version", store_id))
            there, version = await tx.execute()
        return int(version or 0) if there else None

    async def claim(self, now: float, lease_s: float, limit: int) -> list[StoreFile]:
        """The due files in the order added, among the first ``CLAIM_WINDOW`` (or ``limit``, if more)
        by lease end: a backlog of thousands costs a claim no more than that."""
        window = max(limit, CLAIM_WINDOW)
        due = [m.decode().split("\n", 1)
               for m in await self._r.zrangebyscore(self._pending, "-inf", f"({float(now)!r}", start=0, num=window)]
        async with self._r.pipeline(transaction=False) as p:
            for store_id, file_id in due:
                p.zscore(self.k("vs-order", store_id), file_id)
            added = await p.execute()
        taken: list[StoreFile] = []

        def take(file: StoreFile) -> StoreFile | None:
            return replace(file, lease_until=now + lease_s) if file.status == "in_progress" and file.lease_until < now else None

        for _, (store_id, file_id) in sorted((seq, d) for seq, d in zip(added, due) if seq is not None):
            if len(taken) == limit:
                break
            file = await self._change(store_id, file_id, take)
            if file is not None:
                taken.append(file)
        return taken

    async def hold(self, file: StoreFile, until: float) -> bool:
        return await self._change_waiting(file, lambda f: replace(f, lease_until=until))

    async def finish(self, file: StoreFile, texts: list[str], vectors: np.ndarray) -> bool:
        return await self._change_waiting(file, lambda f: _finished(f, texts), json.dumps(texts),
                                          np.ascontiguousarray(vectors, dtype="<f4").tobytes())

    async def fail(self, file: StoreFile, code: str, message: str) -> bool:
        return await self._change_waiting(file, lambda f: replace(f, status="failed", lease_until=0.0,
                                                                  last_error={"code": code, "message": message}))

    async def cancel(self, file: StoreFile) -> bool:
        return await self._change_waiting(file, lambda f: replace(f, status="cancelled", lease_until=0.0))

    async def chunks(self, store_id: str) -> list[Chunks]:
        async with self._r.pipeline(transaction=True) as tx:
            tx.zrange(self.k("vs-order", store_id), 0, -1)
            tx.hgetall(self.k("vs-files", store_id))
            tx.hgetall(self.k("vs-texts", store_id))
            tx.hgetall(self.k("vs-vectors", store_id))
            order, docs, texts, vectors = await tx.execute()
        out = []
        for file_id in order:
            file = StoreFile.of(docs[file_id]) if file_id in docs else None
            if file is not None and file.status == "completed" and file_id in texts:
                listed = json.loads(texts[file_id])
                out.append(Chunks(file, listed, _vectors(vectors[file_id], len(listed))))
        return out

    async def file_texts(self, store_id: str, file_id: str) -> list[str] | None:
        async with self._r.pipeline(transaction=True) as tx:
            tx.hexists(self.k("vs-files", store_id), file_id)
            tx.hget(self.k("vs-texts", store_id), file_id)
            there, texts = await tx.execute()
        return None if not there else json.loads(texts) if texts else []


def open_vector_stores(spec: str, data_dir: Path) -> VectorStoreStore:
    """The vector stores on ``spec``'s backend (``storage.on_backend``): the batch store's SQLite file in
    ``data_dir``, or Redis at that URL."""
    return on_backend(spec, lambda: SQLiteVectorStores(data_dir / "batches.sqlite3"), RedisVectorStores)


def vector_stores_for(svc: Services) -> VectorStoreStore:
    """The process's vector store store on the configured backend, opened and closed with the app
    (``svc.vector_stores``: the Responses API's file search reads it)."""
    svc.vector_stores = svc.keep_open(open_vector_stores(svc.config.batch.store, svc.config.data_dir()))
    return svc.vector_stores
