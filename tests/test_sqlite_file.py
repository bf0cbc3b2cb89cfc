"""storage/sqlite.py: processes (here: threads, each with its own connection) that open one new
file at the same moment all get it, in WAL mode."""

from __future__ import annotations

import asyncio
import contextlib
import sqlite3
import time

from storage.sqlite import SQLiteFile

SCHEMA = "CREATE TABLE IF NOT EXISTS jobs (id TEXT PRIMARY KEY); CREATE INDEX IF NOT EXISTS jobs_id ON jobs (id);"


async def _open_together(path, n: int) -> list[SQLiteFile]:
    files = [SQLiteFile(path, SCHEMA, f"t{i}") for i in range(n)]
    await asyncio.gather(*(f.open() for f in files))
    return files


def test_stores_opening_one_new_file_at_once_all_open_it(tmp_path):
    # Without the retry around the WAL switch about one round in 25 fails with "database is
    # locked" on this machine, so 150 rounds of 4 fail with near certainty (measured: 12 of 300).
    async def rounds() -> None:
        for i in range(150):
            files = await _open_together(tmp_path / f"{i}.sqlite3", 4)
            for f in files:
                await f.close()

    asyncio.run(rounds())
    with sqlite3.connect(tmp_path / "149.sqlite3") as db:
        assert db.execute("PRAGMA journal_mode").fetchone() == ("wal",)
        assert db.execute("SELECT name FROM sqlite_master WHERE type='table'").fetchall() == [("jobs",)]


class Migrating(SQLiteFile):
    """A store whose newer version adds a column: it looks, waits a moment, then adds it."""

    def _migrate(self, db: sqlite3.Connection) -> None:
        if "owner" not in {row[1] for row in db.execute("PRAGMA table_info(jobs)")}:
            time.sleep(0.05)  # another process opening the file now would look too
            db.execute("ALTER TABLE jobs ADD COLUMN owner TEXT")


def test_processes_opening_an_old_file_at_once_migrate_it_one_at_a_time(tmp_path):
    """The schema and ``_migrate`` run in one write transaction: of stores opening a file from an
    older version together, the first migrates it and the others find it done (without the
    transaction each sees the column missing and all but one fail with "duplicate column name")."""
    path = tmp_path / "old.sqlite3"
    with contextlib.closing(sqlite3.connect(path)) as db, db:
        db.executescript(SCHEMA)
        db.execute("INSERT INTO jobs VALUES ('kept')")

    async def together() -> None:
        files = [Migrating(path, SCHEMA, f"m{i}") for i in range(4)]
        await asyncio.gather(*(f.open() for f in files))
        for f in files:
            await f.close()

    asyncio.run(together())
    with contextlib.closing(sqlite3.connect(path)) as db:
        assert [r[1] for r in db.execute("PRAGMA table_info(jobs)")] == ["id", "owner"]
        assert db.execute("SELECT id, owner FROM jobs").fetchall() == [("kept", None)]
