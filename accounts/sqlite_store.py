"""Managed keys and usage in one SQLite file (the default): see ``accounts.store``.

Metering ids live in ``metered`` (id, when): a usage with an id is inserted there (INSERT OR
IGNORE) in the transaction that adds it to its row, and added only if the insert took; ids older
than ``METERED_KEEP_S`` are deleted by the transactions that insert new ones. The usage journal's
segments and how far each is folded live in ``journal`` (see ``accounts.journal``)."""

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

from accounts.journal import Journal, read_whole_lines
from accounts.keys import KeyRecord
from accounts.store import METERED_KEEP_S, AccountStore
from accounts.usage import COUNTERS, FIRST_COUNTERS, Usage, UsageRow
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
CREATE TABLE IF NOT EXISTS journal (segment TEXT PRIMARY KEY, folded INTEGER NOT NULL) WITHOUT ROWID;
"""
log = logging.getLogger("tiergate.accounts")
_COUNTS = operator.attrgetter(*COUNTERS)  # a Usage's counters as a tuple, in COUNTERS' order
_UPSERT = (f"INSERT INTO usage (day, key, model, tier, {', '.join(COUNTERS)}) "
           f"VALUES (?, ?, ?, ?, {', '.join('?' for _ in COUNTERS)}) ON CONFLICT (day, key, model, tier) DO UPDATE SET "
           + ", ".join(f"{c} = {c} + excluded.{c}" for c in COUNTERS))
_METER = "INSERT OR IGNORE INTO metered (id, at) VALUES (?, ?)"


class SQLiteAccounts(SQLiteFile, AccountStore):
    """One file in WAL mode; one thread owns the connection; each change is one transaction.

    A request's usage row (no metering id) is appended to this process's **usage journal**
    (``accounts.journal``) on the event loop: one ``write`` to a file, durable against the
    process's death once ``record`` returns, where a SQLite commit there cost ~150 us of CPU cold
    and through the thread ~240 us (docs/BENCHMARKS.md, "Gateway overhead"). The thread folds
    the journal into the database every ``FOLD_EVERY_S`` while rows arrive, and before every read
    of usage it folds every process's segments, so a read sees each row whose ``record`` returned,
    in any process, exactly once.

    Batch lines' rows (with metering ids) are group-committed on the thread: ``record`` adds the
    row to the next group and gives back the future that is done once the transaction holding the
    group has committed (the id checked in it). One group commits at a time; rows that arrive
    meanwhile join the next."""

    FOLD_EVERY_S = 0.1

    def __init__(self, path: Path) -> None:
        super().__init__(path, _SCHEMA, thread_name="tiergate-accounts")
        self._next_group: _Group | None = None  # rows waiting for the group in flight to commit
        self._in_flight: _Group | None = None
        self._drained: asyncio.Future[None] | None = None  # done when no group is left (close)
        self._journal = Journal(self.path.with_name(self.path.name + ".usage"))
        self._folding: asyncio.Task | None = None

    def _migrate(self, db: sqlite3.Connection) -> None:
        """A usage table from before a counter existed gets its column (0 for the rows it has)."""
        have = {row[1] for row in db.execute("PRAGMA table_info(usage)")}
        for counter in COUNTERS:
            if counter not in have:
                db.execute(f"ALTER TABLE usage ADD COLUMN {counter} REAL NOT NULL DEFAULT 0")

    async def open(self) -> None:
        await super().open()
        await self._call(self._open_journal)
        self._folding = asyncio.create_task(self._fold_while_open(), name="usage-journal")

    def _open_journal(self) -> None:  # on the connection's thread
        self._journal.open()
        for instance, fd in self._journal.lock_gone():  # processes gone: their rows, then their files
            for segment in self._journal.segments(instance):
                self._fold(segment)
                self._forget(segment)
            self._journal.bury(instance, fd)
        for (name,) in self._db.execute("SELECT segment FROM journal").fetchall():
            if not (self._journal.folder / name).exists():  # deleted before its offset was forgotten
                self._db.execute("DELETE FROM journal WHERE segment = ?", (name,))

    async def _fold_while_open(self) -> None:
        folded = 0
        while True:
            await asyncio.sleep(self.FOLD_EVERY_S)
            appended = self._journal.appended
            if appended == folded and not self._journal.retired:
                continue
            try:
                await self._call(self._fold_own)
                folded = appended
            except Exception:  # noqa: BLE001 - the rows stay in the journal: the next fold takes them
                log.warning("folding the usage journal into %s failed", self.path, exc_info=True)

    def _fold_own(self) -> None:  # on the connection's thread
        journal = self._journal
        for segment in list(journal.retired):
            self._fold(segment)
            self._forget(segment)
            journal.retired.remove(segment)
        if journal.segment is not None:
            self._fold(journal.segment)

    def _fold_all(self) -> None:  # on the connection's thread: before usage is read
        for segment in self._journal.segments():
            self._fold(segment)

    def _fold(self, segment: Path) -> None:
        """Add ``segment``'s whole lines past its folded offset to their rows, in one transaction
        with the new offset (read inside it: a fold by another process is seen, not repeated)."""
        name = segment.name
        known = self._db.execute("SELECT folded FROM journal WHERE segment = ?", (name,)).fetchone()
        try:
            if segment.stat().st_size <= (known[0] if known else 0):
                return
        except FileNotFoundError:  # folded and deleted by its instance meanwhile
            return

        def run(db: sqlite3.Connection) -> None:
            row = db.execute("SELECT folded FROM journal WHERE segment = ?", (name,)).fetchone()
            start = row[0] if row else 0
            try:
                rows, taken, bad = read_whole_lines(segment, start, len(COUNTERS), FIRST_COUNTERS)
            except FileNotFoundError:  # deleted after its last fold (which then stored its offset)
                return
            if bad:
                log.error("usage journal %s: %d lines past byte %d are not usage rows; skipped", segment, bad, start)
            if taken:
                db.executemany(_UPSERT, rows)
                db.execute("INSERT INTO journal (segment, folded) VALUES (?, ?) "
                           "ON CONFLICT (segment) DO UPDATE SET folded = excluded.folded", (name, start + taken))

        self._tx(run)

    def _forget(self, segment: Path) -> None:
        """A segment written whole and folded: the file goes, then its offset (in that order, so
        that a fold that finds no offset finds no file either)."""
        segment.unlink(missing_ok=True)
        self._db.execute("DELETE FROM journal WHERE segment = ?", (segment.name,))

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
            if not records:  # the latest, lower than ``version`` if the file went back (restored from a backup)
                return [], self._db.execute("SELECT COALESCE(MAX(version), 0) FROM keys").fetchone()[0]
            return records, records[-1].version

        return await self._call(run)

    # -- usage
    def record(self, day: str, key: str, model: str, tier: str, usage: Usage,
               metering_id: str | None = None) -> asyncio.Future[None]:
        """A request's row into the journal at once; a batch line's into the thread's next group.
        The future is done (or failed) once the row is durable."""
        committed = asyncio.get_running_loop().create_future()
        row = (day, key, model, tier, *_COUNTS(usage))
        if metering_id is None:
            try:
                self._journal.append(row)
            except OSError as exc:
                committed.set_exception(exc)
            else:
                committed.set_result(None)
            return committed
        group = self._next_group
        if group is None:
            group = self._next_group = _Group([], [], {})
        group.metered[len(group.rows)] = metering_id
        group.rows.append(row)
        group.waiters.append(committed)
        if self._in_flight is None:
            self._commit_next()
        return committed

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
            db.executemany(_UPSERT, _first_time(db, group))

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
        if self._folding is not None:
            self._folding.cancel()
            await asyncio.gather(self._folding, return_exceptions=True)
            self._folding = None
        if self._in_flight is not None:  # the rows queued before closing are written
            self._drained = asyncio.get_running_loop().create_future()
            await self._drained
        if self._pool is not None:
            self._journal.retire()
            try:
                await self._call(self._fold_own)  # every row of this process into the file, then its journal goes
            except Exception:  # noqa: BLE001 - the rows stay in the journal, its lock file with them
                log.error("folding the usage journal into %s at close failed; the next process to open it "
                          "folds it", self.path, exc_info=True)
                self._journal.abandon()
            else:
                self._journal.release()
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
            self._fold_all()
            return [UsageRow(r[0], r[1], r[2], r[3], _usage(r[4:])) for r in self._db.execute(sql + " ORDER BY day", args)]

        return await self._call(run)

    async def gpu_spent(self, key: str, day: str) -> float:
        def run() -> float:
            self._fold_all()
            return self._db.execute("SELECT COALESCE(SUM(gpu_seconds), 0) FROM usage WHERE key = ? AND day = ?",
                                    (key, day)).fetchone()[0]

        return await self._call(run)


def _first_time(db: sqlite3.Connection, group: _Group) -> list[tuple]:
    """The group's rows whose metering id is new (checked row by row, so an id twice in one group
    counts once). Forgets ids past their time."""
    now = time.time()
    db.execute("DELETE FROM metered WHERE at < ?", (now - METERED_KEEP_S,))
    return [row for i, row in enumerate(group.rows) if db.execute(_METER, (group.metered[i], now)).rowcount == 1]


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
    metered: dict[int, str]  # a row's position -> its metering id
