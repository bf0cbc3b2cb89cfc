"""Where ``/v1/responses`` keeps stored responses (``store: true``, the default): the durable store
beside the Batch API's, on the same backend (``batch.store`` in tiers.yaml).

* ``sqlite`` (the default): a ``responses`` table in the batch store's SQLite file.
* ``redis://...``: one key per response, ``tg:response:{id}``, on the batch store's Redis.

A record is the response object as the API returns it and the conversation behind it (the
messages its prompt was built from, without ``instructions``, followed by its own reply), which a
later request continues with ``previous_response_id``. A record is visible only to the key that
made it: ``get`` and ``delete`` by another key find nothing, so the API answers 404, as it does
for files and batches.
"""

from __future__ import annotations

import abc
import asyncio
import json
import sqlite3
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, TypeVar

from gateway.service import Services

T = TypeVar("T")


@dataclass(frozen=True)
class StoredResponse:
    id: str
    owner: str  # key_id of the key that made it
    created_at: int
    response: dict[str, Any]  # the public response object
    conversation: list[dict[str, Any]]  # chat messages: its input (no instructions), then its reply

    def doc(self) -> str:
        return json.dumps({"owner": self.owner, "created_at": self.created_at, "response": self.response,
                           "conversation": self.conversation}, separators=(",", ":"))

    @classmethod
    def of(cls, response_id: str, doc: str | bytes) -> "StoredResponse":
        d = json.loads(doc)
        return cls(response_id, d["owner"], d["created_at"], d["response"], d["conversation"])


class ResponseStore(abc.ABC):
    @abc.abstractmethod
    async def open(self) -> None: ...

    @abc.abstractmethod
    async def close(self) -> None: ...

    @abc.abstractmethod
    async def put(self, record: StoredResponse) -> None:
        """Store ``record`` (a new id)."""

    @abc.abstractmethod
    async def get(self, response_id: str, owner: str) -> StoredResponse | None:
        """The record, or None when there is none or another key made it."""

    @abc.abstractmethod
    async def delete(self, response_id: str, owner: str) -> bool:
        """Delete the record; False when there is none or another key made it."""


class SQLiteResponses(ResponseStore):
    """A table in one SQLite file (WAL), every call on one thread that owns the connection."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self._pool: ThreadPoolExecutor | None = None
        self._db: sqlite3.Connection | None = None

    async def _call(self, fn: Callable[[sqlite3.Connection], T]) -> T:
        assert self._pool is not None and self._db is not None, "the store is not open"
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, self._db)

    async def open(self) -> None:
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="tiergate-responses")

        def connect() -> sqlite3.Connection:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            db = sqlite3.connect(self.path, isolation_level=None, timeout=30, check_same_thread=False)
            db.execute("PRAGMA journal_mode=WAL")
            db.execute("CREATE TABLE IF NOT EXISTS responses "
                       "(id TEXT PRIMARY KEY, owner TEXT NOT NULL, doc TEXT NOT NULL)")
            return db

        self._db = await asyncio.get_running_loop().run_in_executor(self._pool, connect)

    async def close(self) -> None:
        if self._pool is None:
            return
        if self._db is not None:
            await self._call(lambda db: db.close())
        self._pool.shutdown()
        self._pool, self._db = None, None

    async def put(self, record: StoredResponse) -> None:
        await self._call(lambda db: db.execute("INSERT INTO responses (id, owner, doc) VALUES (?, ?, ?)",
                                               (record.id, record.owner, record.doc())))

    async def get(self, response_id: str, owner: str) -> StoredResponse | None:
        row = await self._call(lambda db: db.execute("SELECT doc FROM responses WHERE id = ? AND owner = ?",
                                                     (response_id, owner)).fetchone())
        return StoredResponse.of(response_id, row[0]) if row else None

    async def delete(self, response_id: str, owner: str) -> bool:
        cur = await self._call(lambda db: db.execute("DELETE FROM responses WHERE id = ? AND owner = ?",
                                                     (response_id, owner)))
        return cur.rowcount == 1


# KEYS response; ARGV owner: delete only the owner's record
_DELETE = """
local doc = redis.call('GET', KEYS[1])
if not doc then return 0 end
if cjson.decode(doc)['owner'] ~= ARGV[1] then return 0 end
return redis.call('DEL', KEYS[1])
"""


class RedisResponses(ResponseStore):
    """One key per response, ``{prefix}response:{id}``, holding the record as JSON."""

    def __init__(self, url: str, prefix: str = "tg:") -> None:
        self.url, self.prefix = url, prefix
        self._r = None

    def _key(self, response_id: str) -> str:
        return f"{self.prefix}response:{response_id}"

    async def open(self) -> None:
        import redis.asyncio as aioredis

        self._r = aioredis.Redis.from_url(self.url)
        self._delete = self._r.register_script(_DELETE)

    async def close(self) -> None:
        if self._r is not None:
            await self._r.aclose()
            self._r = None

    async def put(self, record: StoredResponse) -> None:
        await self._r.set(self._key(record.id), record.doc(), nx=True)

    async def get(self, response_id: str, owner: str) -> StoredResponse | None:
        raw = await self._r.get(self._key(response_id))
        record = StoredResponse.of(response_id, raw) if raw else None
        return record if record is not None and record.owner == owner else None

    async def delete(self, response_id: str, owner: str) -> bool:
        return bool(await self._delete(keys=[self._key(response_id)], args=[owner]))


def open_responses(spec: str, data_dir: Path) -> ResponseStore:
    """``"sqlite"`` -> the batch store's file in ``data_dir``; ``redis://...`` -> Redis at that URL."""
    if spec == "sqlite":
        return SQLiteResponses(data_dir / "batches.sqlite3")
    if spec.startswith(("redis://", "rediss://")):
        return RedisResponses(spec)
    raise ValueError(f"unknown store {spec!r}: use 'sqlite' or a redis:// URL")


def responses_for(svc: Services) -> ResponseStore:
    """The process's response store on the configured backend, opened and closed with the app."""
    cfg = svc.config.batch
    data_dir = cfg.data_dir if cfg.data_dir.is_absolute() else svc.config.source.parent / cfg.data_dir
    store = open_responses(cfg.store, data_dir)
    svc.on_startup.append(store.open)
    svc.on_shutdown.append(store.close)
    return store
