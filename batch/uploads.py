"""Uploads (OpenAI's Uploads API, ``batch.api``): a file sent in parts, each its own request, and
made a file when the client completes it, as ``client.uploads.upload_file_chunked`` does. The
upload and its parts are kept on the batch store's backend (``batch.store``), so the parts of
one upload may arrive at different processes sharing the store.

* ``sqlite`` (the default): ``uploads`` and ``upload_parts`` tables in the batch store's file.
* ``redis://...``: ``tg:upload:{id}`` (a hash: the record and the bytes received so far),
  ``tg:upload-part:{part id}`` (a part's bytes) and ``tg:upload-parts:{id}`` (its parts' ids).

An upload takes parts for ``TTL_S`` (an hour, as OpenAI's) after it was made; then it reads
``expired`` and its parts are deleted (SQLite: by the sweep every ``SWEEP_S``; Redis: each key
expires). The parts received never add up to more than the upload's declared ``bytes``: the part
that would pass it is refused, checked and added in one step, so parts sent at once cannot pass
it together. Completing or cancelling deletes the parts; the record is kept a day after it was
made, then deleted.
"""

from __future__ import annotations

import abc
import json
import sqlite3
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from storage import on_backend
from storage.redis import RedisKeys
from storage.sqlite import SweptFile

TTL_S = 3600  # an upload takes parts this long after it was made
KEPT_S = 86400  # its record is kept this long after it was made
SWEEP_S = 600.0
MAX_PART_BYTES = 64 * 1024 * 1024  # OpenAI's limit on one part


@dataclass(frozen=True)
class UploadInfo:
    id: str
    owner: str  # key_id of the key that made it
    filename: str
    purpose: str
    bytes: int  # what the parts must add up to
    mime_type: str
    created_at: int
    expires_at: int  # parts are taken until then
    file_expires_after_s: int | None  # the file's expiry once made (None: kept until deleted)
    status: str = "pending"  # pending, completed, cancelled
    file_id: str | None = None  # once completed

    def status_at(self, now: float) -> str:
        return "expired" if self.status == "pending" and now >= self.expires_at else self.status

    def public(self, file: dict[str, Any] | None = None) -> dict[str, Any]:
        return {"id": self.id, "object": "upload", "bytes": self.bytes, "created_at": self.created_at,
                "expires_at": self.expires_at, "filename": self.filename, "purpose": self.purpose,
                "status": self.status_at(time.time()), "file": file}

    def doc(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"))

    @classmethod
    def of(cls, doc: str | bytes) -> "UploadInfo":
        return cls(**json.loads(doc))


class PartRefused(Exception):
    """A part the upload cannot take: ``reason`` is ``not_pending`` (completed, cancelled or
    expired) or ``too_many_bytes`` (the parts would pass the upload's ``bytes``)."""

    def __init__(self, reason: str, received: int = 0) -> None:
        super().__init__(reason)
        self.reason, self.received = reason, received


class UploadStore(abc.ABC):
    @abc.abstractmethod
    async def open(self) -> None: ...

    @abc.abstractmethod
    async def close(self) -> None: ...

    @abc.abstractmethod
    async def create(self, upload: UploadInfo) -> None: ...

    @abc.abstractmethod
    async def get(self, upload_id: str) -> UploadInfo | None:
        """The upload (of any key: the caller checks the owner), or None."""

    @abc.abstractmethod
    async def add_part(self, upload_id: str, part_id: str, data: bytes, now: float) -> int:
        """Keep ``data`` as a part of the pending upload; the bytes received after it, or
        PartRefused."""

    @abc.abstractmethod
    async def parts(self, upload_id: str, part_ids: list[str]) -> list[bytes | None]:
        """The bytes of each of ``part_ids`` (None for one the upload does not have)."""

    @abc.abstractmethod
    async def end(self, upload_id: str, status: str, file_id: str | None, now: float) -> UploadInfo | None:
        """Set a pending, unexpired upload ``completed`` (with ``file_id``) or ``cancelled`` and
        delete its parts; the upload after, or None when it was not pending (another call ended
        it, or it expired)."""


_SCHEMA = """CREATE TABLE IF NOT EXISTS uploads (
    id TEXT PRIMARY KEY, created_at INTEGER NOT NULL, received INTEGER NOT NULL DEFAULT 0, doc TEXT NOT NULL);
CREATE INDEX IF NOT EXISTS uploads_created_at ON uploads (created_at);
CREATE TABLE IF NOT EXISTS upload_parts (
    id TEXT PRIMARY KEY, upload_id TEXT NOT NULL, data BLOB NOT NULL);
CREATE INDEX IF NOT EXISTS upload_parts_upload ON upload_parts (upload_id);"""


class SQLiteUploads(SweptFile, UploadStore):
    def __init__(self, path: Path) -> None:
        super().__init__(path, _SCHEMA, "tiergate-uploads", KEPT_S, SWEEP_S)

    def _sweep(self, cutoff: float) -> int:
        gone = self._db.execute("DELETE FROM upload_parts WHERE upload_id IN (SELECT id FROM uploads WHERE created_at < ?)",
                                (time.time() - TTL_S,)).rowcount
        return gone + self._db.execute("DELETE FROM uploads WHERE created_at < ?", (cutoff,)).rowcount

    async def create(self, upload: UploadInfo) -> None:
        await self._call(lambda: self._db.execute("INSERT INTO uploads (id, created_at, doc) VALUES (?, ?, ?)",
                                                  (upload.id, upload.created_at, upload.doc())))

    def _get(self, upload_id: str) -> tuple[UploadInfo, int] | None:
        row = self._db.execute("SELECT doc, received FROM uploads WHERE id = ? AND created_at >= ?",
                               (upload_id, time.time() - KEPT_S)).fetchone()
        return (UploadInfo.of(row[0]), row[1]) if row else None

    async def get(self, upload_id: str) -> UploadInfo | None:
        found = await self._call(self._get, upload_id)
        return found[0] if found else None

    async def add_part(self, upload_id: str, part_id: str, data: bytes, now: float) -> int:
        def add(db: sqlite3.Connection) -> int:
            found = self._get(upload_id)
            if found is None or found[0].status_at(now) != "pending":
                raise PartRefused("not_pending")
            upload, received = found
            if received + len(data) > upload.bytes:
                raise PartRefused("too_many_bytes", received)
            db.execute("INSERT INTO upload_parts (id, upload_id, data) VALUES (?, ?, ?)", (part_id, upload_id, data))
            db.execute("UPDATE uploads SET received = ? WHERE id = ?", (received + len(data), upload_id))
            return received + len(data)

        return await self._call(self._tx, add)

    async def parts(self, upload_id: str, part_ids: list[str]) -> list[bytes | None]:
        def read() -> list[bytes | None]:
            out = []
            for part_id in part_ids:
                row = self._db.execute("SELECT data FROM upload_parts WHERE id = ? AND upload_id = ?",
                                       (part_id, upload_id)).fetchone()
                out.append(row[0] if row else None)
            return out

        return await self._call(read)

    async def end(self, upload_id: str, status: str, file_id: str | None, now: float) -> UploadInfo | None:
        def finish(db: sqlite3.Connection) -> UploadInfo | None:
            found = self._get(upload_id)
            if found is None or found[0].status_at(now) != "pending":
                return None
            upload = replace(found[0], status=status, file_id=file_id)
            db.execute("UPDATE uploads SET doc = ? WHERE id = ?", (upload.doc(), upload_id))
            db.execute("DELETE FROM upload_parts WHERE upload_id = ?", (upload_id,))
            return upload

        return await self._call(self._tx, finish)


# KEYS upload, part, parts set; ARGV part id, data, now: add the part if the upload is pending and has room
_ADD_PART = """
local doc = redis.call('HGET', KEYS[1], 'doc')
if not doc then return {-1, 0} end
local upload = cjson.decode(doc)
if upload['status'] ~= 'pending' or tonumber(ARGV[3]) >= upload['expires_at'] then return {-1, 0} end
local received = tonumber(redis.call('HGET', KEYS[1], 'received'))
if received + string.len(ARGV[2]) > upload['bytes'] then return {-2, received} end
redis.call('SET', KEYS[2], ARGV[2], 'EXAT', upload['expires_at'] + 60)
redis.call('SADD', KEYS[3], ARGV[1])
redis.call('EXPIREAT', KEYS[3], upload['expires_at'] + 60)
return {0, redis.call('HINCRBY', KEYS[1], 'received', string.len(ARGV[2]))}
"""

# KEYS upload, parts set; ARGV now, the new doc, the part key prefix: end a pending upload, its parts deleted
_END = """
local doc = redis.call('HGET', KEYS[1], 'doc')
if not doc then return 0 end
local upload = cjson.decode(doc)
if upload['status'] ~= 'pending' or tonumber(ARGV[1]) >= upload['expires_at'] then return 0 end
redis.call('HSET', KEYS[1], 'doc', ARGV[2])
for _, part in ipairs(redis.call('SMEMBERS', KEYS[2])) do redis.call('DEL', ARGV[3] .. part) end
redis.call('DEL', KEYS[2])
return 1
"""


class RedisUploads(RedisKeys, UploadStore):
    async def open(self) -> None:
        await super().open()
        self._add_part = self._r.register_script(_ADD_PART)
        self._end = self._r.register_script(_END)

    async def create(self, upload: UploadInfo) -> None:
        key = self.k("upload", upload.id)
        async with self._r.pipeline(transaction=True) as tx:
            tx.hset(key, mapping={"doc": upload.doc(), "received": 0})
            tx.expireat(key, upload.created_at + KEPT_S)
            await tx.execute()

    async def get(self, upload_id: str) -> UploadInfo | None:
        doc = await self._r.hget(self.k("upload", upload_id), "doc")
        return UploadInfo.of(doc) if doc else None

    async def add_part(self, upload_id: str, part_id: str, data: bytes, now: float) -> int:
        code, received = await self._add_part(
            keys=[self.k("upload", upload_id), self.k("upload-part", part_id), self.k("upload-parts", upload_id)],
            args=[part_id, data, repr(now)])
        if code == -1:
            raise PartRefused("not_pending")
        if code == -2:
            raise PartRefused("too_many_bytes", received)
        return received

    async def parts(self, upload_id: str, part_ids: list[str]) -> list[bytes | None]:
        if not part_ids:
            return []
        mine = await self._r.smembers(self.k("upload-parts", upload_id))
        held = await self._r.mget([self.k("upload-part", p) for p in part_ids])
        return [data if p.encode() in mine else None for p, data in zip(part_ids, held)]

    async def end(self, upload_id: str, status: str, file_id: str | None, now: float) -> UploadInfo | None:
        upload = await self.get(upload_id)
        if upload is None:
            return None
        upload = replace(upload, status=status, file_id=file_id)
        ended = await self._end(keys=[self.k("upload", upload_id), self.k("upload-parts", upload_id)],
                                args=[repr(now), upload.doc(), self.k("upload-part", "")])
        return upload if ended else None


def open_uploads(spec: str, data_dir: Path) -> UploadStore:
    """The uploads on ``spec``'s backend (``storage.on_backend``): the batch store's SQLite file in
    ``data_dir``, or Redis at that URL."""
    return on_backend(spec, lambda: SQLiteUploads(data_dir / "batches.sqlite3"), lambda url: RedisUploads(url, "tg:"))


def uploads_for(svc: Any) -> UploadStore:
    """The process's upload store on the batch store's backend, opened and closed with the app."""
    return svc.keep_open(open_uploads(svc.config.batch.store, svc.config.data_dir()))
