"""Where the Batch API keeps its files, batches and backlog: one :class:`Store` interface, two
implementations.

* :class:`SQLiteStore` (the default): one file in WAL mode; processes on one machine may share it.
* :class:`RedisStore` (``store: redis://...``): processes on many machines share the work through
  one stream with a consumer group.

Both give the same guarantees, which the runner in ``gateway.batches`` relies on:

* A batch's runnable lines enter the backlog in the same atomic step that moves the batch from
  ``validating`` to ``in_progress`` (:meth:`Store.start`), so a crash leaves either no lines or all.
* :meth:`Store.claim` hands each backlog entry to one consumer. An entry that its consumer has not
  touched (:meth:`Store.touch`) for ``reclaim_after_s`` is handed to another: a dead process's
  lines are run again, elsewhere or after a restart.
* :meth:`Store.record` writes a line's outcome at most once (the first write wins), counts it, and
  removes the entry from the backlog, all in one atomic step. A line run twice (its first consumer
  was only slow) is therefore recorded once; a crash before the write loses only that attempt.
* :meth:`Store.set_status` is a compare-and-set, so two processes racing to finish (or cancel) a
  batch cannot both win; reaching a terminal status also deletes the batch's working data.

Outcomes are keyed by line index, which is one-to-one with ``custom_id`` for runnable lines (a
duplicate ``custom_id`` is an invalid line); invalid lines, which may have no ``custom_id``, get a
key too. Times are Unix seconds.
"""

from __future__ import annotations

import abc
import asyncio
import json
import sqlite3
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, TypeVar

T = TypeVar("T")

TERMINAL = frozenset({"failed", "completed", "expired", "cancelled"})
# Batch fields that change after creation (besides status and counts); every store keeps them as JSON.
MUTABLE = ("errors", "output_file_id", "error_file_id", "in_progress_at", "finalizing_at", "completed_at",
           "failed_at", "expired_at", "cancelling_at", "cancelled_at")


@dataclass(frozen=True)
class FileInfo:
    id: str
    owner: str  # key_id of the key that uploaded it (or of the batch's owner, for outputs)
    purpose: str  # "batch" (uploaded) | "batch_output" (written by a batch)
    filename: str
    bytes: int
    created_at: int

    def public(self) -> dict[str, Any]:
        return {"id": self.id, "object": "file", "bytes": self.bytes, "created_at": self.created_at,
                "filename": self.filename, "purpose": self.purpose, "status": "processed",
                "expires_at": None, "status_details": None}


@dataclass
class BatchInfo:
    id: str
    owner: str
    endpoint: str
    input_file_id: str
    completion_window: str
    created_at: int
    expires_at: int
    metadata: dict[str, str] | None = None
    status: str = "validating"
    total: int = 0
    completed: int = 0
    failed: int = 0
    fields: dict[str, Any] = field(default_factory=dict)  # the MUTABLE ones that are set

    @property
    def done(self) -> int:
        return self.completed + self.failed

    def static(self) -> dict[str, Any]:
        doc = asdict(self)
        for k in ("status", "total", "completed", "failed", "fields"):
            doc.pop(k)
        return doc

    def public(self) -> dict[str, Any]:
        out = {"id": self.id, "object": "batch", "endpoint": self.endpoint, "errors": None,
               "input_file_id": self.input_file_id, "completion_window": self.completion_window,
               "status": self.status, "output_file_id": None, "error_file_id": None,
               "created_at": self.created_at, "in_progress_at": None, "expires_at": self.expires_at,
               "finalizing_at": None, "completed_at": None, "failed_at": None, "expired_at": None,
               "cancelling_at": None, "cancelled_at": None,
               "request_counts": {"total": self.total, "completed": self.completed, "failed": self.failed},
               "metadata": self.metadata}
        out.update(self.fields)
        return out


@dataclass(frozen=True)
class Line:
    """A runnable request line of a batch's input file."""

    index: int  # 0-based position in the input file
    custom_id: str
    body: dict[str, Any]


@dataclass(frozen=True)
class Outcome:
    """What became of one line: ``line`` is its output (ok) or error file object."""

    index: int
    ok: bool
    line: dict[str, Any]


@dataclass(frozen=True)
class Job:
    """A backlog entry claimed by one consumer; ``token`` names it to the store."""

    batch_id: str
    line: Line
    token: str
    deliveries: int = 1  # how many times it has been handed out, this time included


@dataclass(frozen=True)
class Recorded:
    new: bool  # False if the line already had an outcome, or the batch has ended
    done: int  # lines of the batch with an outcome
    total: int


class Store(abc.ABC):
    @abc.abstractmethod
    async def open(self) -> None: ...

    @abc.abstractmethod
    async def close(self) -> None: ...

    # -- files --------------------------------------------------------------------------------
    @abc.abstractmethod
    async def put_file(self, info: FileInfo, content: bytes) -> None:
        """Store (or overwrite, with the same content: outputs are rewritten on a retried finish)."""

    @abc.abstractmethod
    async def get_file(self, file_id: str) -> FileInfo | None: ...

    @abc.abstractmethod
    async def file_content(self, file_id: str) -> bytes | None: ...

    @abc.abstractmethod
    async def delete_file(self, file_id: str) -> bool: ...

    # -- batches ------------------------------------------------------------------------------
    @abc.abstractmethod
    async def create_batch(self, batch: BatchInfo) -> None:
        """Store a new batch (status ``validating``) and list it among the open ones."""

    @abc.abstractmethod
    async def get_batch(self, batch_id: str) -> BatchInfo | None: ...

    @abc.abstractmethod
    async def list_batches(self, owner: str | None, after: str | None, limit: int) -> list[BatchInfo]:
        """Newest first; ``owner`` None lists everyone's; ``after`` is the last id already seen."""

    @abc.abstractmethod
    async def open_batches(self) -> list[str]:
        """Ids of batches not yet in a terminal status."""

    @abc.abstractmethod
    async def start(self, batch_id: str, lines: list[Line], invalid: list[Outcome], now: int) -> bool:
        """``validating`` -> ``in_progress`` with ``lines`` queued and ``invalid`` recorded as
        failed, atomically; False (and nothing written) if the batch was not validating."""

    @abc.abstractmethod
    async def set_status(self, batch_id: str, allowed: Iterable[str], status: str, **fields: Any) -> bool:
        """Compare-and-set: move to ``status`` (setting MUTABLE ``fields``) only from an
        ``allowed`` status. A terminal status also drops the batch's lines and outcomes."""

    @abc.abstractmethod
    async def lock(self, batch_id: str, holder: str, ttl_s: float) -> bool:
        """Take (or renew) the batch's finishing lock; it lapses after ``ttl_s``."""

    @abc.abstractmethod
    async def unlock(self, batch_id: str, holder: str) -> None: ...

    # -- backlog and outcomes -----------------------------------------------------------------
    @abc.abstractmethod
    async def claim(self, consumer: str, count: int, reclaim_after_s: float) -> list[Job]:
        """Up to ``count`` entries: first those idle longer than ``reclaim_after_s`` (their
        consumer went silent), then new ones. Entries of finished batches are dropped here."""

    @abc.abstractmethod
    async def touch(self, consumer: str, jobs: Iterable[Job]) -> None:
        """Keep ``jobs`` claimed: reset their idle time."""

    @abc.abstractmethod
    async def release(self, consumer: str, jobs: Iterable[Job]) -> None:
        """Give ``jobs`` back unfinished, for anyone to claim at once (a clean shutdown); the
        hand-out does not count as a delivery."""

    @abc.abstractmethod
    async def ack(self, job: Job) -> None:
        """Drop ``job`` from the backlog without an outcome (its batch has stopped)."""

    @abc.abstractmethod
    async def record(self, job: Job, outcome: Outcome) -> Recorded:
        """Write ``job``'s outcome unless it has one, count it, and drop the entry: atomically."""

    @abc.abstractmethod
    async def fill(self, batch_id: str, make: Callable[[Line], Outcome]) -> int:
        """Record ``make(line)`` for every line that has no outcome yet (cancel, expiry)."""

    @abc.abstractmethod
    async def outcomes(self, batch_id: str) -> list[Outcome]:
        """Every outcome of the batch, in input order."""


def open_store(spec: str, data_dir: Path) -> Store:
    """``"sqlite"`` -> a file in ``data_dir``; ``redis://...`` -> Redis at that URL."""
    if spec == "sqlite":
        return SQLiteStore(data_dir / "batches.sqlite3")
    if spec.startswith(("redis://", "rediss://")):
        return RedisStore(spec)
    raise ValueError(f"unknown batch store {spec!r}: use 'sqlite' or a redis:// URL")


def _dumps(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"))


def _outcome(index: int, raw: str | bytes) -> Outcome:
    doc = json.loads(raw)
    return Outcome(index, doc["ok"], doc["line"])


def _outcome_json(o: Outcome) -> str:
    return _dumps({"ok": o.ok, "line": o.line})


def _line_json(line: Line) -> str:
    return _dumps({"custom_id": line.custom_id, "body": line.body})


def _line(index: int, raw: str | bytes) -> Line:
    doc = json.loads(raw)
    return Line(index, doc["custom_id"], doc["body"])


# -- SQLite ------------------------------------------------------------------------------------

_SCHEMA = """
CREATE TABLE IF NOT EXISTS files (
    id TEXT PRIMARY KEY, owner TEXT NOT NULL, purpose TEXT NOT NULL, filename TEXT NOT NULL,
    bytes INTEGER NOT NULL, created_at INTEGER NOT NULL, content BLOB NOT NULL);
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
    claimed_by TEXT, claimed_at REAL, deliveries INTEGER NOT NULL DEFAULT 0);
"""


class SQLiteStore(Store):
    """One SQLite file in WAL mode. Every call runs on one thread that owns the connection; each
    change is one ``BEGIN IMMEDIATE`` transaction, so processes sharing the file serialise."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
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
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="tiergate-sqlite")

        def connect() -> None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            db = sqlite3.connect(self.path, isolation_level=None, timeout=30, check_same_thread=False)
            db.execute("PRAGMA journal_mode=WAL")
            db.execute("PRAGMA synchronous=NORMAL")  # WAL: a process crash loses nothing committed
            db.executescript(_SCHEMA)
            self._db = db

        await self._call(connect)

    async def close(self) -> None:
        if self._pool is None:
            return
        if self._db is not None:
            await self._call(self._db.close)
        self._pool.shutdown(wait=True)
        self._pool = self._db = None

    # -- files
    async def put_file(self, info: FileInfo, content: bytes) -> None:
        def put(db: sqlite3.Connection) -> None:
            db.execute("INSERT OR REPLACE INTO files VALUES (?, ?, ?, ?, ?, ?, ?)",
                       (info.id, info.owner, info.purpose, info.filename, info.bytes, info.created_at, content))

        await self._call(self._tx, put)

    async def get_file(self, file_id: str) -> FileInfo | None:
        def get() -> FileInfo | None:
            row = self._db.execute("SELECT id, owner, purpose, filename, bytes, created_at FROM files WHERE id = ?",
                                   (file_id,)).fetchone()
            return FileInfo(*row) if row else None

        return await self._call(get)

    async def file_content(self, file_id: str) -> bytes | None:
        def get() -> bytes | None:
            row = self._db.execute("SELECT content FROM files WHERE id = ?", (file_id,)).fetchone()
            return bytes(row[0]) if row else None

        return await self._call(get)

    async def delete_file(self, file_id: str) -> bool:
        return await self._call(self._tx, lambda db: db.execute("DELETE FROM files WHERE id = ?", (file_id,)).rowcount > 0)

    # -- batches
    async def create_batch(self, batch: BatchInfo) -> None:
        def put(db: sqlite3.Connection) -> None:
            db.execute("INSERT INTO batches (id, owner, status, doc, fields) VALUES (?, ?, ?, ?, ?)",
                       (batch.id, batch.owner, batch.status, _dumps(batch.static()), _dumps(batch.fields)))

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
            db.executemany("INSERT INTO lines VALUES (?, ?, ?)", [(batch_id, ln.index, _line_json(ln)) for ln in lines])
            db.executemany("INSERT INTO backlog (batch_id, idx) VALUES (?, ?)", [(batch_id, ln.index) for ln in lines])
            db.executemany("INSERT OR IGNORE INTO outcomes VALUES (?, ?, 0, ?)",
                           [(batch_id, o.index, _outcome_json(o)) for o in invalid])
            fields = {**json.loads(row[1]), "in_progress_at": now}
            db.execute("UPDATE batches SET status = 'in_progress', total = ?, failed = ?, fields = ? WHERE id = ?",
                       (len(lines) + len(invalid), len(invalid), _dumps(fields), batch_id))
            return True

        return await self._call(self._tx, start)

    async def set_status(self, batch_id: str, allowed: Iterable[str], status: str, **fields: Any) -> bool:
        allowed = set(allowed)
        _check_fields(fields)

        def cas(db: sqlite3.Connection) -> bool:
            row = db.execute("SELECT status, fields FROM batches WHERE id = ?", (batch_id,)).fetchone()
            if row is None or row[0] not in allowed:
                return False
            merged = {**json.loads(row[1]), **fields}
            db.execute("UPDATE batches SET status = ?, fields = ? WHERE id = ?", (status, _dumps(merged), batch_id))
            if status in TERMINAL:
                for table in ("lines", "outcomes", "backlog"):
                    db.execute(f"DELETE FROM {table} WHERE batch_id = ?", (batch_id,))
                db.execute("UPDATE batches SET locked_by = NULL, locked_until = NULL WHERE id = ?", (batch_id,))
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
    async def claim(self, consumer: str, count: int, reclaim_after_s: float) -> list[Job]:
        def claim(db: sqlite3.Connection) -> list[Job]:
            now = time.time()
            rows = db.execute(
                "SELECT b.seq, b.batch_id, b.idx, b.deliveries, l.line FROM backlog b "
                "LEFT JOIN lines l ON l.batch_id = b.batch_id AND l.idx = b.idx "
                "WHERE b.claimed_by IS NULL OR b.claimed_at < ? ORDER BY b.seq LIMIT ?",
                (now - reclaim_after_s, count)).fetchall()
            jobs = []
            for seq, batch_id, idx, deliveries, line in rows:
                if line is None:  # its batch has ended
                    db.execute("DELETE FROM backlog WHERE seq = ?", (seq,))
                    continue
                db.execute("UPDATE backlog SET claimed_by = ?, claimed_at = ?, deliveries = deliveries + 1 "
                           "WHERE seq = ?", (consumer, now, seq))
                jobs.append(Job(batch_id, _line(idx, line), str(seq), deliveries + 1))
            return jobs

        return await self._call(self._tx, claim)

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
                             (batch_id, o.index, int(o.ok), _outcome_json(o)))
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

    async def fill(self, batch_id: str, make: Callable[[Line], Outcome]) -> int:
        def fill(db: sqlite3.Connection) -> int:
            rows = db.execute("SELECT l.idx, l.line FROM lines l LEFT JOIN outcomes o "
                              "ON o.batch_id = l.batch_id AND o.idx = l.idx "
                              "WHERE l.batch_id = ? AND o.idx IS NULL", (batch_id,)).fetchall()
            return self._add_outcomes(db, batch_id, [make(_line(idx, line)) for idx, line in rows])

        return await self._call(self._tx, fill)

    async def outcomes(self, batch_id: str) -> list[Outcome]:
        def get() -> list[Outcome]:
            rows = self._db.execute("SELECT idx, line FROM outcomes WHERE batch_id = ? ORDER BY idx", (batch_id,))
            return [_outcome(idx, line) for idx, line in rows]

        return await self._call(get)


def _check_fields(fields: dict[str, Any]) -> None:
    unknown = set(fields) - set(MUTABLE)
    if unknown:
        raise ValueError(f"not a mutable batch field: {sorted(unknown)}")


# -- Redis -------------------------------------------------------------------------------------
#
# Keys (prefix "tg:"): file:{id} (hash of metadata), file:{id}:content; batch:{id} (hash: doc =
# the static fields as JSON, status, total, completed, failed, and each MUTABLE field as JSON);
# batch:{id}:lines and batch:{id}:outcomes (hashes by line index); batch:{id}:lock; batches and
# batches:{owner} (sorted sets of ids, which sort by time); open (set of ids); backlog (the
# stream, entries {b: batch id, i: line index}, consumer group "runners").

_TERMINAL_LUA = "local terminal = {failed=true, completed=true, expired=true, cancelled=true}\n"

# KEYS batch, lines, outcomes, backlog; ARGV now, batch id, n lines, n*(idx, line), then (idx, outcome)*
_START = """
if redis.call('HGET', KEYS[1], 'status') ~= 'validating' then return 0 end
local n = tonumber(ARGV[3])
for i = 0, n - 1 do
  redis.call('HSET', KEYS[2], ARGV[4 + 2 * i], ARGV[5 + 2 * i])
  redis.call('XADD', KEYS[4], '*', 'b', ARGV[2], 'i', ARGV[4 + 2 * i])
end
local bad = 0
for j = 4 + 2 * n, #ARGV, 2 do
  redis.call('HSET', KEYS[3], ARGV[j], ARGV[j + 1])
  bad = bad + 1
end
redis.call('HSET', KEYS[1], 'status', 'in_progress', 'in_progress_at', ARGV[1], 'total', n + bad, 'failed', bad)
return 1
"""

# KEYS batch, lines, outcomes, open, lock; ARGV batch id, new status, n allowed, allowed..., (field, json)*
_SET_STATUS = _TERMINAL_LUA + """
local status = redis.call('HGET', KEYS[1], 'status')
if not status then return 0 end
local n = tonumber(ARGV[3])
local ok = false
for i = 4, 3 + n do if ARGV[i] == status then ok = true end end
if not ok then return 0 end
redis.call('HSET', KEYS[1], 'status', ARGV[2])
for j = 4 + n, #ARGV, 2 do redis.call('HSET', KEYS[1], ARGV[j], ARGV[j + 1]) end
if terminal[ARGV[2]] then
  redis.call('DEL', KEYS[2], KEYS[3], KEYS[5])
  redis.call('SREM', KEYS[4], ARGV[1])
end
return 1
"""

# KEYS batch, outcomes, backlog; ARGV group, entry id ('' for none), then (idx, ok 1|0, outcome)*
# -> {added, done, total}
_RECORD = _TERMINAL_LUA + """
if ARGV[2] ~= '' then
  redis.call('XACK', KEYS[3], ARGV[1], ARGV[2])
  redis.call('XDEL', KEYS[3], ARGV[2])
end
local status = redis.call('HGET', KEYS[1], 'status')
if (not status) or terminal[status] then return {0, 0, 0} end
local added = 0
for j = 3, #ARGV, 3 do
  if redis.call('HSETNX', KEYS[2], ARGV[j], ARGV[j + 2]) == 1 then
    added = added + 1
    redis.call('HINCRBY', KEYS[1], ARGV[j + 1] == '1' and 'completed' or 'failed', 1)
  end
end
local c = redis.call('HMGET', KEYS[1], 'completed', 'failed', 'total')
return {added, tonumber(c[1] or '0') + tonumber(c[2] or '0'), tonumber(c[3] or '0')}
"""

# KEYS lock; ARGV holder
_UNLOCK = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""

GROUP = "runners"
_FAR_PAST_MS = 10 ** 12  # an idle time that any reclaim threshold passes


class RedisStore(Store):
    def __init__(self, url: str, prefix: str = "tg:") -> None:
        self.url = url
        self.prefix = prefix
        self._r = None
        self.backlog = f"{prefix}backlog"

    def _k(self, *parts: str) -> str:
        return self.prefix + ":".join(parts)

    async def open(self) -> None:
        import redis.asyncio as aioredis
        from redis.exceptions import ResponseError

        self._r = aioredis.Redis.from_url(self.url)
        try:
            await self._r.xgroup_create(self.backlog, GROUP, id="0", mkstream=True)
        except ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise
        self._start = self._r.register_script(_START)
        self._set_status = self._r.register_script(_SET_STATUS)
        self._record = self._r.register_script(_RECORD)
        self._unlock = self._r.register_script(_UNLOCK)

    async def close(self) -> None:
        if self._r is not None:
            await self._r.aclose()
            self._r = None

    # -- files
    async def put_file(self, info: FileInfo, content: bytes) -> None:
        async with self._r.pipeline(transaction=True) as p:
            p.set(self._k("file", info.id), _dumps(asdict(info)))
            p.set(self._k("file", info.id, "content"), content)
            await p.execute()

    async def get_file(self, file_id: str) -> FileInfo | None:
        raw = await self._r.get(self._k("file", file_id))
        return FileInfo(**json.loads(raw)) if raw else None

    async def file_content(self, file_id: str) -> bytes | None:
        return await self._r.get(self._k("file", file_id, "content"))

    async def delete_file(self, file_id: str) -> bool:
        return await self._r.delete(self._k("file", file_id), self._k("file", file_id, "content")) > 0

    # -- batches
    def _batch_keys(self, batch_id: str) -> list[str]:
        return [self._k("batch", batch_id), self._k("batch", batch_id, "lines"), self._k("batch", batch_id, "outcomes")]

    async def create_batch(self, batch: BatchInfo) -> None:
        mapping = {"doc": _dumps(batch.static()), "status": batch.status, "total": batch.total,
                   "completed": batch.completed, "failed": batch.failed}
        mapping.update({k: _dumps(v) for k, v in batch.fields.items()})
        async with self._r.pipeline(transaction=True) as p:
            p.hset(self._k("batch", batch.id), mapping=mapping)
            p.zadd(self._k("batches"), {batch.id: 0})
            p.zadd(self._k("batches", batch.owner), {batch.id: 0})
            p.sadd(self._k("open"), batch.id)
            await p.execute()

    @staticmethod
    def _batch(raw: dict[bytes, bytes]) -> BatchInfo | None:
        if not raw:
            return None
        h = {k.decode(): v.decode() for k, v in raw.items()}
        fields = {k: json.loads(h[k]) for k in MUTABLE if k in h}
        return BatchInfo(**json.loads(h["doc"]), status=h["status"], total=int(h["total"]),
                         completed=int(h["completed"]), failed=int(h["failed"]), fields=fields)

    async def get_batch(self, batch_id: str) -> BatchInfo | None:
        return self._batch(await self._r.hgetall(self._k("batch", batch_id)))

    async def list_batches(self, owner: str | None, after: str | None, limit: int) -> list[BatchInfo]:
        index = self._k("batches", owner) if owner is not None else self._k("batches")
        ids = await self._r.zrevrangebylex(index, f"({after}" if after else "+", "-", start=0, num=limit)
        async with self._r.pipeline(transaction=False) as p:
            for i in ids:
                p.hgetall(self._k("batch", i.decode()))
            rows = await p.execute()
        return [b for b in map(self._batch, rows) if b is not None]

    async def open_batches(self) -> list[str]:
        return sorted(i.decode() for i in await self._r.smembers(self._k("open")))

    async def start(self, batch_id: str, lines: list[Line], invalid: list[Outcome], now: int) -> bool:
        args: list[Any] = [now, batch_id, len(lines)]
        for ln in lines:
            args += [ln.index, _line_json(ln)]
        for o in invalid:
            args += [o.index, _outcome_json(o)]
        return bool(await self._start(keys=[*self._batch_keys(batch_id), self.backlog], args=args))

    async def set_status(self, batch_id: str, allowed: Iterable[str], status: str, **fields: Any) -> bool:
        _check_fields(fields)
        allowed = list(allowed)
        args: list[Any] = [batch_id, status, len(allowed), *allowed]
        for k, v in fields.items():
            args += [k, _dumps(v)]
        keys = [*self._batch_keys(batch_id), self._k("open"), self._k("batch", batch_id, "lock")]
        return bool(await self._set_status(keys=keys, args=args))

    async def lock(self, batch_id: str, holder: str, ttl_s: float) -> bool:
        key = self._k("batch", batch_id, "lock")
        if await self._r.set(key, holder, nx=True, px=int(ttl_s * 1000)):
            return True
        if (await self._r.get(key) or b"").decode() == holder:  # ours: renew
            return bool(await self._r.set(key, holder, xx=True, px=int(ttl_s * 1000)))
        return False

    async def unlock(self, batch_id: str, holder: str) -> None:
        await self._unlock(keys=[self._k("batch", batch_id, "lock")], args=[holder])

    # -- backlog and outcomes
    async def claim(self, consumer: str, count: int, reclaim_after_s: float) -> list[Job]:
        # Entries whose consumer went silent first, with how often each has been handed out.
        _, stale, _ = await self._r.xautoclaim(self.backlog, GROUP, consumer, int(reclaim_after_s * 1000),
                                               start_id="0-0", count=count)
        deliveries = {}
        for entry_id, _ in stale:
            info = await self._r.xpending_range(self.backlog, GROUP, entry_id, entry_id, 1)
            deliveries[entry_id] = info[0]["times_delivered"] if info else 1
        entries = list(stale)
        if len(entries) < count:
            fresh = await self._r.xreadgroup(GROUP, consumer, {self.backlog: ">"}, count=count - len(entries))
            for _, got in fresh or []:
                entries += got
        jobs = []
        for entry_id, data in entries:
            if not data:  # deleted while pending
                await self._drop(entry_id)
                continue
            batch_id, idx = data[b"b"].decode(), int(data[b"i"])
            raw = await self._r.hget(self._k("batch", batch_id, "lines"), idx)
            if raw is None:  # its batch has ended
                await self._drop(entry_id)
                continue
            jobs.append(Job(batch_id, _line(idx, raw), entry_id.decode(), deliveries.get(entry_id, 1)))
        return jobs

    async def _drop(self, entry_id: bytes | str) -> None:
        async with self._r.pipeline(transaction=True) as p:
            p.xack(self.backlog, GROUP, entry_id)
            p.xdel(self.backlog, entry_id)
            await p.execute()

    async def touch(self, consumer: str, jobs: Iterable[Job]) -> None:
        ids = [j.token for j in jobs]
        if ids:
            await self._r.xclaim(self.backlog, GROUP, consumer, 0, ids, justid=True)

    async def release(self, consumer: str, jobs: Iterable[Job]) -> None:
        for j in jobs:  # idle "forever": the next claim takes it; this delivery does not count
            await self._r.xclaim(self.backlog, GROUP, consumer, 0, [j.token], idle=_FAR_PAST_MS,
                                 retrycount=max(j.deliveries - 1, 0), justid=True)

    async def ack(self, job: Job) -> None:
        await self._drop(job.token)

    async def _add(self, batch_id: str, token: str, outcomes: list[Outcome]) -> list[int]:
        args: list[Any] = [GROUP, token]
        for o in outcomes:
            args += [o.index, int(o.ok), _outcome_json(o)]
        keys = [self._k("batch", batch_id), self._k("batch", batch_id, "outcomes"), self.backlog]
        return await self._record(keys=keys, args=args)

    async def record(self, job: Job, outcome: Outcome) -> Recorded:
        added, done, total = await self._add(job.batch_id, job.token, [outcome])
        return Recorded(bool(added), done, total)

    async def fill(self, batch_id: str, make: Callable[[Line], Outcome]) -> int:
        lines = await self._r.hgetall(self._k("batch", batch_id, "lines"))
        have = set(await self._r.hkeys(self._k("batch", batch_id, "outcomes")))
        missing = [make(_line(int(i), raw)) for i, raw in lines.items() if i not in have]
        if not missing:
            return 0
        added, _, _ = await self._add(batch_id, "", missing)
        return added

    async def outcomes(self, batch_id: str) -> list[Outcome]:
        raw = await self._r.hgetall(self._k("batch", batch_id, "outcomes"))
        return sorted((_outcome(int(i), v) for i, v in raw.items()), key=lambda o: o.index)
