"""The Batch API's store in one SQLite file (the default): see ``batch.store`` for the guarantees."""

from __future__ import annotations

import json
import sqlite3
import time
from pathlib import Path
from typing import Any, Callable, Iterable

from batch.store import (TERMINAL, BatchInfo, FileInfo, Job, Line, Outcome, Recorded, Store, check_fields,
                         dumps, line_json, line_of, outcome_json, outcome_of)
from storage import Along
from storage.sqlite import SQLiteFile

_SCHEMA = """
CREATE TABLE IF NOT EXISTS files (
    id TEXT PRIMARY KEY, owner TEXT NOT NULL, purpose TEXT NOT NULL, filename TEXT NOT NULL,
    bytes INTEGER NOT NULL, created_at INTEGER NOT NULL, content BLOB NOT NULL, expires_at INTEGER);
CREATE INDEX IF NOT EXISTS files_by_owner ON files (owner, created_at, id);
CREATE INDEX IF NOT EXISTS files_by_time ON files (created_at, id);
CREATE TABLE IF NOT EXISTS batches (
    id TEXT PRIMARY KEY, owner TEXT NOT NULL, status TEXT NOT NULL, doc TEXT NOT NULL,
    total INTEGER NOT NULL DEFAULT 0, completed INTEGER NOT NULL DEFAULT 0, failed INTEGER NOT NULL DEFAULT 0,
    fields TEXT NOT NULL DEFAULT '{}', locked_by TEXT, locked_until REAL);
CREATE INDEX IF NOT EXISTS batches_by_owner ON batches (owner, id);
CREATE INDEX IF NOT EXISTS batches_by_status ON batches (status);
CREATE TABLE IF NOT EXISTS lines (
    batch_id TEXT NOT NULL, idx INTEGER NOT NULL, line TEXT NOT NULL, PRIMARY KEY (batch_id, idx)) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS outcomes (
    batch_id TEXT NOT NULL, idx INTEGER NOT NULL, ok INTEGER NOT NULL, line TEXT NOT NULL,
    PRIMARY KEY (batch_id, idx)) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS backlog (
    seq INTEGER PRIMARY KEY AUTOINCREMENT, batch_id TEXT NOT NULL, idx INTEGER NOT NULL,
    claimed_by TEXT, claimed_at REAL, deliveries INTEGER NOT NULL DEFAULT 0, shape TEXT NOT NULL DEFAULT '');
"""
# a file written before backlog entries had shapes gets the column; then the index on it
_SHAPES = ("ALTER TABLE backlog ADD COLUMN shape TEXT NOT NULL DEFAULT ''",
           "CREATE INDEX IF NOT EXISTS backlog_by_shape ON backlog (shape, seq)")
# likewise, one written before files could expire
_EXPIRY = ("ALTER TABLE files ADD COLUMN expires_at INTEGER",
           "CREATE INDEX IF NOT EXISTS files_by_expiry ON files (expires_at) WHERE expires_at IS NOT NULL")
_FILE_COLUMNS = "id, owner, purpose, filename, bytes, created_at, expires_at"
_LIVE = "(expires_at IS NULL OR expires_at > ?)"


class SQLiteStore(SQLiteFile, Store):
    """One SQLite file in WAL mode (``storage.sqlite``): every call runs on one thread that owns the
    connection; each change is one ``BEGIN IMMEDIATE`` transaction, so processes sharing the file
    serialise."""

    def __init__(self, path: Path) -> None:
        super().__init__(path, _SCHEMA, thread_name="tiergate-sqlite")

    def _migrate(self, db: sqlite3.Connection) -> None:
        if "shape" not in {row[1] for row in db.execute("PRAGMA table_info(backlog)")}:
            db.execute(_SHAPES[0])
        db.execute(_SHAPES[1])
        if "expires_at" not in {row[1] for row in db.execute("PRAGMA table_info(files)")}:
            db.execute(_EXPIRY[0])
        db.execute(_EXPIRY[1])

    # -- files
    async def put_file(self, info: FileInfo, content: bytes) -> None:
        def put(db: sqlite3.Connection) -> None:
            db.execute(f"INSERT OR REPLACE INTO files ({_FILE_COLUMNS}, content) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                       (info.id, info.owner, info.purpose, info.filename, info.bytes, info.created_at,
                        info.expires_at, content))

        await self._call(self._tx, put)

    async def get_file(self, file_id: str) -> FileInfo | None:
        def get() -> FileInfo | None:
            row = self._db.execute(f"SELECT {_FILE_COLUMNS} FROM files WHERE id = ? AND {_LIVE}",
                                   (file_id, time.time())).fetchone()
            return FileInfo(*row) if row else None

        return await self._call(get)

    async def file_content(self, file_id: str) -> bytes | None:
        def get() -> bytes | None:
            row = self._db.execute(f"SELECT content FROM files WHERE id = ? AND {_LIVE}", (file_id, time.time())).fetchone()
            return bytes(row[0]) if row else None

        return await self._call(get)

    async def delete_file(self, file_id: str) -> bool:
        return await self._call(self._tx, lambda db: db.execute(
            f"DELETE FROM files WHERE id = ? AND {_LIVE}", (file_id, time.time())).rowcount > 0)

    async def list_files(self, owner: str | None, purpose: str | None, after: str | None, limit: int,
                         ascending: bool) -> list[FileInfo] | None:
        def get() -> list[FileInfo] | None:
            now = time.time()
            where, args = [_LIVE], [now]
            if owner is not None:
                where.append("owner = ?")
                args.append(owner)
            if after is not None:
                row = self._db.execute(f"SELECT created_at FROM files WHERE id = ? AND {' AND '.join(where)}",
                                       (after, *args)).fetchone()
                if row is None:
                    return None
                where.append(f"(created_at, id) {'>' if ascending else '<'} (?, ?)")
                args += [row[0], after]
            if purpose is not None:
                where.append("purpose = ?")
                args.append(purpose)
            order = "ASC" if ascending else "DESC"
            rows = self._db.execute(f"SELECT {_FILE_COLUMNS} FROM files WHERE {' AND '.join(where)} "
                                    f"ORDER BY created_at {order}, id {order} LIMIT ?", (*args, limit)).fetchall()
            return [FileInfo(*r) for r in rows]

        return await self._call(get)

    async def delete_expired_files(self, now: float) -> list[str]:
        def due() -> bool:  # a read first: the sweep runs every few seconds, the write lock only when one is due
            return self._db.execute("SELECT 1 FROM files WHERE expires_at <= ? LIMIT 1", (now,)).fetchone() is not None

        if not await self._call(due):
            return []
        return await self._call(self._tx, lambda db: [row[0] for row in db.execute(
            "DELETE FROM files WHERE expires_at <= ? RETURNING id", (now,))])

    # -- batches
    async def create_batch(self, batch: BatchInfo) -> None:
        def put(db: sqlite3.Connection) -> None:
            db.execute("INSERT INTO batches (id, owner, status, doc, fields) VALUES (?, ?, ?, ?, ?)",
                       (batch.id, batch.owner, batch.status, dumps(batch.static()), dumps(batch.fields)))

        await self._call(self._tx, put)

    _BATCH_COLUMNS = "status, doc, total, completed, failed, fields"

    @staticmethod
    def _batch(row: tuple) -> BatchInfo:
        status, doc, total, completed, failed, fields = row
        return BatchInfo(**json.loads(doc), status=status, total=total, completed=completed, failed=failed,
                         fields=json.loads(fields))

    async def get_batch(self, batch_id: str) -> BatchInfo | None:
        def get() -> BatchInfo | None:
            row = self._db.execute(f"SELECT {self._BATCH_COLUMNS} FROM batches WHERE id = ?", (batch_id,)).fetchone()
            return self._batch(row) if row else None

        return await self._call(get)

    async def list_batches(self, owner: str | None, after: str | None, limit: int) -> list[BatchInfo]:
        def get() -> list[BatchInfo]:
            where, args = ["id < ?"], [after or "\uffff"]
            if owner is not None:
                where.append("owner = ?")
                args.append(owner)
            rows = self._db.execute(f"SELECT {self._BATCH_COLUMNS} FROM batches WHERE {' AND '.join(where)} "
                                    "ORDER BY id DESC LIMIT ?", (*args, limit)).fetchall()
            return [self._batch(r) for r in rows]

        return await self._call(get)

    async def delete_batch(self, batch_id: str) -> bool:
        ended = ", ".join("?" * len(TERMINAL))
        return await self._call(self._tx, lambda db: db.execute(
            f"DELETE FROM batches WHERE id = ? AND status IN ({ended})", (batch_id, *sorted(TERMINAL))).rowcount > 0)

    async def open_batches(self) -> list[str]:
        def get() -> list[str]:
            marks = ",".join("?" * len(TERMINAL))
            rows = self._db.execute(f"SELECT id FROM batches WHERE status NOT IN ({marks})", tuple(TERMINAL))
            return [r[0] for r in rows]

        return await self._call(get)

    async def start(self, batch_id: str, lines: list[Line], invalid: list[Outcome], now: int) -> bool:
        def start(db: sqlite3.Connection) -> bool:
            row = db.execute("SELECT status, fields FROM batches WHERE id = ?", (batch_id,)).fetchone()
            if row is None or row[0] != "validating":
                return False
            db.executemany("INSERT INTO lines VALUES (?, ?, ?)", [(batch_id, ln.index, line_json(ln)) for ln in lines])
            db.executemany("INSERT INTO backlog (batch_id, idx, shape) VALUES (?, ?, ?)",
                           [(batch_id, ln.index, ln.shape) for ln in lines])
            db.executemany("INSERT OR IGNORE INTO outcomes VALUES (?, ?, 0, ?)",
                           [(batch_id, o.index, outcome_json(o)) for o in invalid])
            fields = {**json.loads(row[1]), "in_progress_at": now}
            db.execute("UPDATE batches SET status = 'in_progress', total = ?, failed = ?, fields = ? WHERE id = ?",
                       (len(lines) + len(invalid), len(invalid), dumps(fields), batch_id))
            return True

        return await self._call(self._tx, start)

    async def set_status(self, batch_id: str, allowed: Iterable[str], status: str, along: Along | None = None,
                         **fields: Any) -> bool:
        allowed = set(allowed)
        check_fields(fields)

        def cas(db: sqlite3.Connection) -> bool:
            row = db.execute("SELECT status, fields FROM batches WHERE id = ?", (batch_id,)).fetchone()
            if row is None or row[0] not in allowed:
                return False
            merged = {**json.loads(row[1]), **fields}
            db.execute("UPDATE batches SET status = ?, fields = ? WHERE id = ?", (status, dumps(merged), batch_id))
            if status in TERMINAL:
                for table in ("lines", "outcomes", "backlog"):
                    db.execute(f"DELETE FROM {table} WHERE batch_id = ?", (batch_id,))
                db.execute("UPDATE batches SET locked_by = NULL, locked_until = NULL WHERE id = ?", (batch_id,))
            if along is not None:
                along.run_sqlite(db)
            return True

        return await self._call(self._tx, cas)

    async def lock(self, batch_id: str, holder: str, ttl_s: float) -> bool:
        def lock(db: sqlite3.Connection) -> bool:
            now = time.time()
            cur = db.execute("UPDATE batches SET locked_by = ?, locked_until = ? WHERE id = ? AND "
                             "(locked_until IS NULL OR locked_until < ? OR locked_by = ?)",
                             (holder, now + ttl_s, batch_id, now, holder))
            return cur.rowcount > 0

        return await self._call(self._tx, lock)

    async def unlock(self, batch_id: str, holder: str) -> None:
        await self._call(self._tx, lambda db: db.execute(
            "UPDATE batches SET locked_by = NULL, locked_until = NULL WHERE id = ? AND locked_by = ?", (batch_id, holder)))

    # -- backlog and outcomes
    async def claim(self, consumer: str, count: int, reclaim_after_s: float, shape: str | None = None) -> list[Job]:
        def claim(db: sqlite3.Connection) -> list[Job]:
            now = time.time()
            of_shape, args = ("AND b.shape = ? ", (shape,)) if shape is not None else ("", ())
            rows = db.execute(
                "SELECT b.seq, b.batch_id, b.idx, b.deliveries, b.shape, l.line, o.idx FROM backlog b "
                "LEFT JOIN lines l ON l.batch_id = b.batch_id AND l.idx = b.idx "
                "LEFT JOIN outcomes o ON o.batch_id = b.batch_id AND o.idx = b.idx "
                f"WHERE (b.claimed_by IS NULL OR b.claimed_at < ?) {of_shape}ORDER BY b.seq LIMIT ?",
                (now - reclaim_after_s, *args, count)).fetchall()
            jobs = []
            for seq, batch_id, idx, deliveries, line_shape, line, done in rows:
                if line is None or done is not None:  # its batch has ended, or it was filled (cancel, expiry)
                    db.execute("DELETE FROM backlog WHERE seq = ?", (seq,))
                    continue
                db.execute("UPDATE backlog SET claimed_by = ?, claimed_at = ?, deliveries = deliveries + 1 "
                           "WHERE seq = ?", (consumer, now, seq))
                jobs.append(Job(batch_id, line_of(idx, line, line_shape), str(seq), deliveries + 1))
            return jobs

        return await self._call(self._tx, claim)

    async def shapes(self, reclaim_after_s: float) -> list[str]:
        def get() -> list[str]:
            rows = self._db.execute("SELECT shape FROM backlog WHERE claimed_by IS NULL OR claimed_at < ? "
                                    "GROUP BY shape ORDER BY MIN(seq)", (time.time() - reclaim_after_s,))
            return [r[0] for r in rows]

        return await self._call(get)

    async def touch(self, consumer: str, jobs: Iterable[Job]) -> None:
        seqs = [(time.time(), int(j.token), consumer) for j in jobs]
        if seqs:
            await self._call(self._tx, lambda db: db.executemany(
                "UPDATE backlog SET claimed_at = ? WHERE seq = ? AND claimed_by = ?", seqs))

    async def release(self, consumer: str, jobs: Iterable[Job]) -> None:
        seqs = [(int(j.token), consumer) for j in jobs]
        if seqs:
            await self._call(self._tx, lambda db: db.executemany(
                "UPDATE backlog SET claimed_by = NULL, claimed_at = NULL, deliveries = MAX(deliveries - 1, 0) "
                "WHERE seq = ? AND claimed_by = ?", seqs))

    async def ack(self, job: Job) -> None:
        await self._call(self._tx, lambda db: db.execute("DELETE FROM backlog WHERE seq = ?", (int(job.token),)))

    def _add_outcomes(self, db: sqlite3.Connection, batch_id: str, outcomes: list[Outcome]) -> int:
        """Insert the outcomes that are new and count them; 0 if the batch has ended."""
        row = db.execute("SELECT status FROM batches WHERE id = ?", (batch_id,)).fetchone()
        if row is None or row[0] in TERMINAL:
            return 0
        added = 0
        for o in outcomes:
            cur = db.execute("INSERT OR IGNORE INTO outcomes VALUES (?, ?, ?, ?)",
                             (batch_id, o.index, int(o.ok), outcome_json(o)))
            if cur.rowcount:
                added += 1
                column = "completed" if o.ok else "failed"
                db.execute(f"UPDATE batches SET {column} = {column} + 1 WHERE id = ?", (batch_id,))
        return added

    async def record(self, job: Job, outcome: Outcome) -> Recorded:
        def record(db: sqlite3.Connection) -> Recorded:
            new = self._add_outcomes(db, job.batch_id, [outcome]) > 0
            db.execute("DELETE FROM backlog WHERE seq = ?", (int(job.token),))
            row = db.execute("SELECT completed + failed, total FROM batches WHERE id = ?", (job.batch_id,)).fetchone()
            return Recorded(new, *(row or (0, 0)))

        return await self._call(self._tx, record)

    async def fill(self, batch_id: str, make: Callable[[Line], Outcome], held_s: float = 0.0) -> int:
        def fill(db: sqlite3.Connection) -> int:
            held = {idx for idx, in db.execute(
                "SELECT idx FROM backlog WHERE batch_id = ? AND claimed_by IS NOT NULL AND claimed_at >= ?",
                (batch_id, time.time() - held_s))} if held_s > 0 else set()
            rows = db.execute("SELECT l.idx, l.line FROM lines l LEFT JOIN outcomes o "
                              "ON o.batch_id = l.batch_id AND o.idx = l.idx "
                              "WHERE l.batch_id = ? AND o.idx IS NULL", (batch_id,)).fetchall()
            return self._add_outcomes(db, batch_id, [make(line_of(idx, line)) for idx, line in rows if idx not in held])

        return await self._call(self._tx, fill)

    async def outcomes(self, batch_id: str) -> list[Outcome]:
        def get() -> list[Outcome]:
            rows = self._db.execute("SELECT idx, line FROM outcomes WHERE batch_id = ? ORDER BY idx", (batch_id,))
            return [outcome_of(idx, line) for idx, line in rows]

        return await self._call(get)


