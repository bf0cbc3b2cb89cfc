"""Managed keys and usage in one SQLite file (the default): see ``accounts.store``.

Metering ids live in ``metered`` (id, when): a usage with an id is inserted there (INSERT OR
IGNORE) in the transaction that adds it to its row, and added only if the insert took; ids older
than ``METERED_KEEP_S`` are deleted by the transactions that insert new ones."""

from __future__ import annotations

import asyncio
import json
import logging
import operator
import sqlite3
import time
from pathlib import Path
from dataclasses import dataclass
from typing import Any

from accounts.keys import KeyRecord
from accounts.store import METERED_KEEP_S, AccountStore
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
CREATE TABLE IF NOT EXISTS metered (id TEXT PRIMARY KEY, at REAL NOT NULL) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS metered_by_time ON metered (at);
"""
log = logging.getLogger("tiergate.accounts")
_COUNTS = operator.attrgetter(*COUNTERS)  # a Usage's counters as a tuple, in COUNTERS' order
_UPSERT = (f"INSERT INTO usage (day, key, model, tier, {', '.join(COUNTERS)}) "
           f"VALUES (?, ?, ?, ?, {', '.join('?' for _ in COUNTERS)}) ON CONFLICT (day, key, model, tier) DO UPDATE SET "
           + ", ".join(f"{c} = {c} + excluded.{c}" for c in COUNTERS))
_METER = "INSERT OR IGNORE INTO metered (id, at) VALUES (?, ?)"


class SQLiteAccounts(SQLiteFile, AccountStore):
    """One file in WAL mode; one thread owns the connection; each change is one transaction.

    A request's usage row (no metering id) is committed **on the event loop** when it can be
    without waiting: a second connection, used only there, has no busy timeout and never
    checkpoints, so its transaction is a few page writes into the WAL (~20 us of CPU here), where
    handing the row to the thread and waking the loop back cost ~240 us and two threads more
    contending for the interpreter lock (docs/BENCHMARKS.md, "Gateway overhead"). The loop never
    waits for a lock there: when another connection holds the write lock, the row goes to the
    thread. What it does wait for is the kernel taking those pages into its cache (no fsync: in
    WAL mode with ``synchronous=NORMAL`` only checkpoints sync, and they run on the thread).

    There, usage rows are group-committed: ``record`` adds its row to the next group and gives
    back the future that is done once the transaction that holds the group has committed. One
    group commits at a time; while it runs, the rows that arrive join the next group (not the
    loop's connection, which would find the lock taken), so many concurrent requests cost one
    commit, one thread hop and one wake-up of the event loop. Batch lines' rows (with metering
    ids) always go this way. The thread checkpoints the WAL after every ``CHECKPOINT_EVERY``
    commits made on the loop (passive: it never waits for readers; its fsync stays off the loop).
    Meanwhile rows go to the thread too, behind the checkpoint: a commit made during it would
    leave frames it did not copy, and the WAL would grow instead of starting over."""

    CHECKPOINT_EVERY = 256

    def __init__(self, path: Path) -> None:
        super().__init__(path, _SCHEMA, thread_name="tiergate-accounts")
        self._next_group: _Group | None = None  # rows waiting for the group in flight to commit
        self._in_flight: _Group | None = None
        self._drained: asyncio.Future[None] | None = None  # done when no group is left (close)
        self._loop_db: sqlite3.Connection | None = None  # the event loop's connection (usage rows)
        self._loop_commits = 0  # since the last checkpoint was asked for
        self._checkpointing = False

    async def open(self) -> None:
        await super().open()
        self._loop_db = await self._call(self._connect_for_loop)

    def _connect_for_loop(self) -> sqlite3.Connection:
        db = sqlite3.connect(self.path, isolation_level=None, timeout=0, check_same_thread=False)
        db.execute("PRAGMA synchronous=NORMAL")
        db.execute("PRAGMA wal_autocheckpoint=0")  # checkpoints (and their fsync) stay on the thread
        return db

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
    def record(self, day: str, key: str, model: str, tier: str, usage: Usage,
               metering_id: str | None = None) -> asyncio.Future[None]:
        """Commit the row, here if no one holds the write lock, else queue it for the thread; the
        future is done (or failed) once its transaction has committed."""
        committed = asyncio.get_running_loop().create_future()
        row = (day, key, model, tier, *_COUNTS(usage))
        if metering_id is None and self._in_flight is None and not self._checkpointing and self._loop_db is not None:
            try:
                self._commit_on_loop(row)
            except sqlite3.Error as exc:  # busy: the thread's group waits for the lock; else the row's error
                if (getattr(exc, "sqlite_errorcode", None) or 0) & 0xFF not in (sqlite3.SQLITE_BUSY, sqlite3.SQLITE_LOCKED):
                    committed.set_exception(exc)
                    return committed
            else:
                committed.set_result(None)
                return committed
        group = self._next_group
        if group is None:
            group = self._next_group = _Group([], [], {})
        if metering_id is not None:
            group.metered[len(group.rows)] = metering_id
        group.rows.append(row)
        group.waiters.append(committed)
        if self._in_flight is None:
            self._commit_next()
        return committed

    def _commit_on_loop(self, row: tuple) -> None:
        """One row in one transaction on the loop's connection; SQLITE_BUSY at once (and nothing
        written) when another connection holds the write lock."""
        db = self._loop_db
        db.execute("BEGIN IMMEDIATE")
        try:
            db.execute(_UPSERT, row)
            db.execute("COMMIT")
        except BaseException:
            if db.in_transaction:
                db.execute("ROLLBACK")
            raise
        self._loop_commits += 1
        if self._loop_commits >= self.CHECKPOINT_EVERY and not self._checkpointing:
            self._loop_commits, self._checkpointing = 0, True
            self._pool.submit(self._checkpoint)

    def _checkpoint(self) -> None:  # on the connection's thread
        try:
            self._db.execute("PRAGMA wal_checkpoint(PASSIVE)")
        except sqlite3.Error as exc:  # the next one tries again; a WAL that grows meanwhile is no loss
            log.warning("checkpointing %s failed: %r", self.path, exc)
        finally:
            self._checkpointing = False

    def _commit_next(self) -> None:
        """Send the next group to the connection's thread; its end wakes the loop once."""
        group, self._next_group = self._next_group, None
        self._in_flight = group
        if group is None:
            if self._drained is not None and not self._drained.done():
                self._drained.set_result(None)
            return
        assert self._pool is not None, "the store is not open"
        loop = group.waiters[0].get_loop()

        def upsert(db: sqlite3.Connection) -> None:
            db.executemany(_UPSERT, _first_time(db, group) if group.metered else group.rows)

        def commit() -> None:  # on the connection's thread; its end wakes the loop once
            try:
                self._tx(upsert)
            except BaseException as exc:  # noqa: BLE001 - handed to the waiting requests
                loop.call_soon_threadsafe(self._committed, group, exc)
            else:
                loop.call_soon_threadsafe(self._committed, group, None)

        self._pool.submit(commit)

    def _committed(self, group: _Group, exc: BaseException | None) -> None:
        """Each waiting request gets the commit, or its error (or is cancelled)."""
        for committed in group.waiters:
            if committed.done():
                continue
            if exc is None:
                committed.set_result(None)
            elif isinstance(exc, Exception):
                committed.set_exception(exc)
            else:
                committed.cancel()
        self._commit_next()

    async def close(self) -> None:
        if self._in_flight is not None:  # the rows queued before closing are written
            self._drained = asyncio.get_running_loop().create_future()
            await self._drained
        if self._loop_db is not None:
            self._loop_db.close()
            self._loop_db = None
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


def _first_time(db: sqlite3.Connection, group: _Group) -> list[tuple]:
    """The group's rows to add: those without a metering id, and those whose id is new (checked
    row by row, so an id twice in one group counts once). Forgets ids past their time."""
    now = time.time()
    db.execute("DELETE FROM metered WHERE at < ?", (now - METERED_KEEP_S,))
    return [row for i, row in enumerate(group.rows)
            if i not in group.metered or db.execute(_METER, (group.metered[i], now)).rowcount == 1]


def _usage(values: tuple) -> Usage:
    u = Usage()
    for name, value in zip(COUNTERS, values):
        setattr(u, name, int(value) if isinstance(getattr(u, name), int) else float(value))
    return u


@dataclass
class _Group:
    """Usage rows committed in one transaction, and the future their requests await."""

    rows: list[tuple]
    waiters: list[asyncio.Future[None]]  # one per row, so that a cancelled request cancels only its own
    metered: dict[int, str]  # a row's position -> its metering id (batch lines only)
