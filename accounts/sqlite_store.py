"""Managed keys and usage in one SQLite file (the default): see ``accounts.store``."""

from __future__ import annotations

import asyncio
import json
import sqlite3
from pathlib import Path
from typing import Any

from accounts.keys import KeyRecord
from accounts.store import AccountStore
from accounts.usage import COUNTERS, Usage, UsageRow
from storage.sqlite import SQLiteFile

_SCHEMA = f"""
CREATE TABLE IF NOT EXISTS keys (
    id TEXT PRIMARY KEY, hash TEXT NOT NULL UNIQUE, doc TEXT NOT NULL, version INTEGER NOT NULL);
CREATE INDEX IF NOT EXISTS keys_by_version ON keys (version);
CREATE TABLE IF NOT EXISTS usage (
    day TEXT NOT NULL, key TEXT NOT NULL, model TEXT NOT NULL, tier TEXT NOT NULL,
    {", ".join(f"{c} REAL NOT NULL DEFAULT 0" for c in COUNTERS)},
    PRIMARY KEY (day, key, model, tier)) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS usage_by_key ON usage (key, day);
"""
_UPSERT = (f"INSERT INTO usage (day, key, model, tier, {', '.join(COUNTERS)}) "
           f"VALUES (?, ?, ?, ?, {', '.join('?' for _ in COUNTERS)}) ON CONFLICT (day, key, model, tier) DO UPDATE SET "
           + ", ".join(f"{c} = {c} + excluded.{c}" for c in COUNTERS))


class SQLiteAccounts(SQLiteFile, AccountStore):
    """One file in WAL mode; one thread owns the connection; each change is one transaction.

    Usage rows are group-committed: ``record`` queues its row and returns once the transaction
    that holds it has committed; while one such transaction runs, the rows that arrive queue up
    and go in the next one, so many concurrent requests cost one commit and one thread hop."""

    def __init__(self, path: Path) -> None:
        super().__init__(path, _SCHEMA, thread_name="tiergate-accounts")
        self._usage_rows: list[tuple[tuple, asyncio.Future[None]]] = []
        self._usage_writer: asyncio.Task[None] | None = None

    # -- keys
    @staticmethod
    def _next_version(db: sqlite3.Connection) -> int:
        return db.execute("SELECT COALESCE(MAX(version), 0) + 1 FROM keys").fetchone()[0]

    async def create_key(self, record: KeyRecord) -> KeyRecord:
        def run(db: sqlite3.Connection) -> int:
            version = self._next_version(db)
            db.execute("INSERT INTO keys (id, hash, doc, version) VALUES (?, ?, ?, ?)",
                       (record.id, record.hash, json.dumps(record.doc()), version))
            return version

        version = await self._call(self._tx, run)
        return KeyRecord.of(record.doc(), version)

    def _one(self, sql: str, arg: str) -> KeyRecord | None:
        row = self._db.execute(sql, (arg,)).fetchone()
        return KeyRecord.of(json.loads(row[0]), row[1]) if row else None

    async def get_key(self, key_id: str) -> KeyRecord | None:
        return await self._call(self._one, "SELECT doc, version FROM keys WHERE id = ?", key_id)

    async def find_key(self, hash_hex: str) -> KeyRecord | None:
        return await self._call(self._one, "SELECT doc, version FROM keys WHERE hash = ?", hash_hex)

    async def list_keys(self) -> list[KeyRecord]:
        def run() -> list[KeyRecord]:
            rows = self._db.execute("SELECT doc, version FROM keys").fetchall()
            return sorted((KeyRecord.of(json.loads(d), v) for d, v in rows), key=lambda r: (r.created_at, r.id))

        return await self._call(run)

    async def update_key(self, key_id: str, **changes: Any) -> KeyRecord | None:
        def run(db: sqlite3.Connection) -> KeyRecord | None:
            row = db.execute("SELECT doc FROM keys WHERE id = ?", (key_id,)).fetchone()
            if row is None:
                return None
            doc = json.loads(row[0])
            if doc.get("revoked_at") is not None:
                changes.pop("revoked_at", None)
            doc.update({k: (list(v) if isinstance(v, tuple) else v) for k, v in changes.items()})
            version = self._next_version(db)
            db.execute("UPDATE keys SET doc = ?, version = ? WHERE id = ?", (json.dumps(doc), version, key_id))
            return KeyRecord.of(doc, version)

        return await self._call(self._tx, run)

    async def keys_since(self, version: int) -> tuple[list[KeyRecord], int]:
        def run() -> tuple[list[KeyRecord], int]:
            rows = self._db.execute("SELECT doc, version FROM keys WHERE version > ? ORDER BY version",
                                    (version,)).fetchall()
            records = [KeyRecord.of(json.loads(d), v) for d, v in rows]
            return records, max([version] + [r.version for r in records])

        return await self._call(run)

    # -- usage
    async def record(self, day: str, key: str, model: str, tier: str, usage: Usage) -> None:
        committed = asyncio.get_running_loop().create_future()
        self._usage_rows.append(((day, key, model, tier, *(getattr(usage, c) for c in COUNTERS)), committed))
        if self._usage_writer is None:
            self._usage_writer = asyncio.ensure_future(self._write_usage())
        await committed

    async def _write_usage(self) -> None:
        """Commit the queued usage rows, one transaction per batch, until none are left."""
        try:
            while self._usage_rows:
                batch, self._usage_rows = self._usage_rows, []
                rows = [values for values, _ in batch]
                try:
                    await self._call(self._tx, lambda db: db.executemany(_UPSERT, rows))
                except BaseException as exc:  # each waiting request gets the error (or is cancelled)
                    for _, committed in batch:
                        if not committed.done():
                            committed.set_exception(exc) if isinstance(exc, Exception) else committed.cancel()
                    if not isinstance(exc, Exception):
                        raise
                else:
                    for _, committed in batch:
                        if not committed.done():
                            committed.set_result(None)
        finally:
            self._usage_writer = None

    async def close(self) -> None:
        if self._usage_writer is not None:  # the rows queued before closing are written
            await asyncio.shield(self._usage_writer)
        await super().close()

    async def usage(self, key: str | None, model: str | None, since: str | None, until: str | None) -> list[UsageRow]:
        where, args = [], []
        for column, op, value in (("key", "=", key), ("model", "=", model), ("day", ">=", since), ("day", "<=", until)):
            if value is not None:
                where.append(f"{column} {op} ?")
                args.append(value)
        sql = f"SELECT day, key, model, tier, {', '.join(COUNTERS)} FROM usage"
        if where:
            sql += " WHERE " + " AND ".join(where)

        def run() -> list[UsageRow]:
            return [UsageRow(r[0], r[1], r[2], r[3], _usage(r[4:])) for r in self._db.execute(sql + " ORDER BY day", args)]

        return await self._call(run)

    async def gpu_spent(self, key: str, day: str) -> float:
        def run() -> float:
            return self._db.execute("SELECT COALESCE(SUM(gpu_seconds), 0) FROM usage WHERE key = ? AND day = ?",
                                    (key, day)).fetchone()[0]

        return await self._call(run)


def _usage(values: tuple) -> Usage:
    u = Usage()
    for name, value in zip(COUNTERS, values):
        setattr(u, name, int(value) if isinstance(getattr(u, name), int) else float(value))
    return u
