"""One SQLite file that the processes of one machine share: WAL mode, one thread that owns the
connection, each change one ``BEGIN IMMEDIATE`` transaction, so processes sharing the file
serialise and a process killed after a change returned has lost nothing committed."""

from __future__ import annotations

import asyncio
import logging
import sqlite3
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, TypeVar

from storage.retention import Retained

T = TypeVar("T")
log = logging.getLogger("tiergate.storage")


_BUSY_S = 30.0


def _switch_to_wal(db: sqlite3.Connection) -> None:
    """``PRAGMA journal_mode=WAL``, retried while another connection holds the file.

    Switching a new file to WAL takes its exclusive lock from a shared one. When two processes
    open the same new file at once, each can hold the shared lock the other waits on, and SQLite
    then answers "database is locked" at once instead of calling the busy handler (it would
    deadlock). One of them backs off, the other switches, and the retry finds WAL already set."""
    deadline = time.monotonic() + _BUSY_S
    pause = 0.001
    while True:
        try:
            db.execute("PRAGMA journal_mode=WAL")
            return
        except sqlite3.OperationalError as e:
            if "locked" not in str(e) or time.monotonic() > deadline:
                raise
        time.sleep(pause)
        pause = min(pause * 2, 0.05)


class SQLiteFile:
    """A store's base: ``open`` creates ``schema`` (then ``_migrate``), ``_call`` runs a function on
    the connection's thread, ``_tx`` (called there) runs one in a transaction."""

    def __init__(self, path: Path, schema: str, thread_name: str) -> None:
        self.path = Path(path)
        self._schema = schema
        self._thread_name = thread_name
        self._pool: ThreadPoolExecutor | None = None
        self._db: sqlite3.Connection | None = None

    async def _call(self, fn: Callable[..., T], *args: Any) -> T:
        assert self._pool is not None, "the store is not open"
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    def _tx(self, fn: Callable[[sqlite3.Connection], T]) -> T:
        db = self._db
        db.execute("BEGIN IMMEDIATE")
        try:
            out = fn(db)
        except BaseException:
            db.execute("ROLLBACK")
            raise
        db.execute("COMMIT")
        return out

    async def open(self) -> None:
        self._pool = ThreadPoolExecutor(1, thread_name_prefix=self._thread_name)
        await self._call(self._connect)

    def _connect(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        db = sqlite3.connect(self.path, isolation_level=None, timeout=_BUSY_S, check_same_thread=False)
        _switch_to_wal(db)
        db.execute("PRAGMA synchronous=NORMAL")  # WAL: a process crash loses nothing committed
        # schema and migration in one write transaction: processes opening one file from an older
        # version migrate it one at a time (the second finds the column the first added)
        db.executescript("BEGIN IMMEDIATE;\n" + self._schema)
        try:
            self._migrate(db)
        except BaseException:
            db.execute("ROLLBACK")
            raise
        db.execute("COMMIT")
        self._db = db

    def _migrate(self, db: sqlite3.Connection) -> None:
        """Bring a file written by an older version up to date (inside the opening transaction);
        nothing by default."""

    async def close(self) -> None:
        if self._pool is None:
            return
        if self._db is not None:
            await self._call(self._db.close)
        self._pool.shutdown()
        self._pool, self._db = None, None


class SweptFile(SQLiteFile, Retained):
    """A store whose rows expire ``retention_s`` after they were made (None: never): ``_sweep``
    (on the connection's thread) deletes those made before a cutoff; it runs when the store opens
    and every ``sweep_s`` after, a failed sweep tried again at the next."""

    def __init__(self, path: Path, schema: str, thread_name: str, retention_s: float | None,
                 sweep_s: float = 3600.0) -> None:
        super().__init__(path, schema, thread_name)
        self.retention_s, self.sweep_s = retention_s, sweep_s
        self._sweeper: asyncio.Task | None = None

    def _sweep(self, cutoff: float) -> int:
        """(on the connection's thread) Delete what was made before ``cutoff``; how many went."""
        raise NotImplementedError

    async def sweep(self) -> int:
        cutoff = self._cutoff()
        return 0 if cutoff is None else await self._call(self._sweep, cutoff)

    async def open(self) -> None:
        await super().open()
        if self.retention_s is not None:
            await self.sweep()
            self._sweeper = asyncio.create_task(self._sweep_loop())

    async def close(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
            await asyncio.gather(self._sweeper, return_exceptions=True)
            self._sweeper = None
        await super().close()

    async def _sweep_loop(self) -> None:
        while True:
            await asyncio.sleep(self.sweep_s)
            try:
                await self.sweep()
            except sqlite3.Error as exc:  # a busy or full disk: the next sweep tries again
                log.warning("%s: the retention sweep failed: %s", self.path.name, exc)
