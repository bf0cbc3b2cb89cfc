"""Where fine-tuning jobs (``/v1/fine_tuning/jobs``) are kept: on the batch store's backend
(``batch.store`` in tiers.yaml), as vector stores are.

* ``sqlite`` (the default): the ``fine_tuning_jobs`` table in the batch store's SQLite file (a job's
  doc, with its owner, status and lease beside it for the queries; its rowid is the order the jobs
  were made in), ``fine_tuning_events`` and ``fine_tuning_checkpoints`` (a job's events and
  checkpoints, in the order added).
* ``redis://...``: ``tg:ft:{id}`` holds a job's doc, ``tg:ft-order`` (a sorted set, by the counter
  ``tg:ft-seq``) every job in the order made, ``tg:ft-owned:{owner}`` (the same, by the same number)
  a key's jobs, ``tg:ft-waiting`` (the same) the jobs not yet finished (``queued`` or ``running``),
  and ``tg:ft-events:{id}`` and ``tg:ft-ckpts:{id}`` (lists) a job's events and checkpoints.

A job belongs to the key that made it (another key finds nothing; no key, the admin's, finds any).
It waits ``queued`` until a process takes it (``claim``: the oldest job waiting) and runs it
``running`` under a lease, which it renews while it trains (``hold``); a job whose lease ran out
(its process died) is taken again by the next ``claim``, anywhere, so an accepted job is never
lost. Each take counts one more ``attempt``: every write names the attempt it comes from
(``change``, ``hold``), and one from an earlier attempt (a process that lost its lease, or that
the job was cancelled under) is refused, so a job ends once, as the last taker or a cancel left it.
"""

from __future__ import annotations

import abc
import json
import sqlite3
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Collection

from storage import on_backend
from storage.records import JsonRecord
from storage.redis import RedisKeys
from storage.sqlite import SQLiteFile

WAITING = ("queued", "running")  # the statuses of a job not yet finished
OPEN = (*WAITING, "paused")  # those that count towards a key's ``max_jobs_per_key``


class TooManyJobs(Exception):
    """``create`` refused a job: its owner has ``count`` open jobs, the most it may have."""

    def __init__(self, count: int) -> None:
        super().__init__(f"{count} open fine-tuning jobs")
        self.count = count

_SCHEMA = """CREATE TABLE IF NOT EXISTS fine_tuning_jobs (
    id TEXT PRIMARY KEY, owner TEXT NOT NULL, status TEXT NOT NULL, lease_until REAL NOT NULL, doc TEXT NOT NULL);
CREATE INDEX IF NOT EXISTS fine_tuning_jobs_waiting ON fine_tuning_jobs (status, lease_until);
CREATE INDEX IF NOT EXISTS fine_tuning_jobs_owned ON fine_tuning_jobs (owner);
CREATE TABLE IF NOT EXISTS fine_tuning_events (job_id TEXT NOT NULL, id TEXT NOT NULL, doc TEXT NOT NULL);
CREATE INDEX IF NOT EXISTS fine_tuning_events_of ON fine_tuning_events (job_id);
CREATE TABLE IF NOT EXISTS fine_tuning_checkpoints (job_id TEXT NOT NULL, id TEXT NOT NULL, doc TEXT NOT NULL);
CREATE INDEX IF NOT EXISTS fine_tuning_checkpoints_of ON fine_tuning_checkpoints (job_id);"""

# the oldest job a claim at ``now`` may take (through fine_tuning_jobs_waiting, both halves of the OR)
_CLAIMABLE = ("SELECT doc FROM fine_tuning_jobs WHERE status = 'queued' OR (status = 'running' AND lease_until <= ?) "
              "ORDER BY rowid LIMIT 1")


@dataclass(frozen=True)
class Job(JsonRecord):
    id: str  # "ftjob-..."
    owner: str  # the API key id that created it
    created_at: int
    model: str  # the base model
    training_file: str
    validation_file: str | None
    hyperparameters: dict  # {"n_epochs": int, "batch_size": int, "learning_rate_multiplier": float[, "beta": float]}
    seed: int
    suffix: str | None = None
    metadata: dict[str, str] = field(default_factory=dict)
    method: str = "supervised"  # or "dpo": the training file is preferences
    start: str | None = None  # the fine-tuned model (an adapter of ``model``) it goes on from, as named
    status: str = "queued"  # queued, running, paused, succeeded, failed, cancelled
    fine_tuned_model: str | None = None
    finished_at: int | None = None
    trained_tokens: int | None = None
    error: dict | None = None  # {"code", "message", "param"}
    result_files: list[str] = field(default_factory=list)
    estimated_finish: int | None = None
    attempt: int = 0  # how many times a process took it (claim); a write by an older attempt is refused
    lease_until: float = 0.0  # running: a process works on it until then

    def claimable(self, now: float) -> bool:
        """Waiting to be taken: ``queued``, or ``running`` under a lease that ran out."""
        return self.status == "queued" or (self.status == "running" and self.lease_until <= now)

    def taken(self, now: float, lease_s: float) -> Job:
        """The job as ``claim`` takes it: running, one more attempt, leased until ``now + lease_s``."""
        return replace(self, status="running", attempt=self.attempt + 1, lease_until=now + lease_s)


def _newest_first(items: list[dict], after: str | None, limit: int) -> list[dict]:
    """``items`` (oldest first) newest first, only those added before the one with id ``after`` (none
    when there is no such item), at most ``limit``."""
    newest = items[::-1]
    if after is not None:
        at = next((i for i, item in enumerate(newest) if item.get("id") == after), None)
        newest = [] if at is None else newest[at + 1:]
    return newest[:max(limit, 0)]


class FineTuningStore(abc.ABC):
    @abc.abstractmethod
    async def open(self) -> None: ...

    @abc.abstractmethod
    async def close(self) -> None: ...

    @abc.abstractmethod
    async def create(self, job: Job, most: int | None = None) -> None:
        """Store a new job, last in the order made; a ValueError when its id is taken. With ``most``,
        ``TooManyJobs`` (nothing stored) when its owner has that many ``OPEN`` jobs already: the
        count and the write are one step, so creates at once (in any process) never exceed it."""

    @abc.abstractmethod
    async def get(self, job_id: str, owner: str | None) -> Job | None:
        """The job, or None when there is none or ``owner`` is given and another key made it."""

    @abc.abstractmethod
    async def list(self, owner: str | None, after: str | None, limit: int) -> list[Job]:
        """At most ``limit`` of ``owner``'s jobs (None: everyone's), newest first; with ``after`` (a
        job id: the last of the previous page) only those made before it (none when it is unknown)."""

    @abc.abstractmethod
    async def change(self, job: Job, expect: Collection[str], **changes: Any) -> Job | None:
        """Compare-and-set: when the stored job's status is in ``expect`` and it is still at
        ``job.attempt``, the stored job with ``changes`` (its fields) made, now stored; None (nothing
        written) otherwise, or when the job is gone."""

    @abc.abstractmethod
    async def claim(self, now: float, lease_s: float) -> Job | None:
        """Take the oldest job waiting (``queued``, or ``running`` with ``lease_until <= now``: its
        process died): now ``running``, one more ``attempt``, leased until ``now + lease_s``, and
        returned so. None when no job waits. Two processes never take the same attempt."""

    @abc.abstractmethod
    async def hold(self, job: Job, until: float) -> bool:
        """Extend the lease of this attempt to ``until``; False when the job is no longer ``running``
        at ``job.attempt`` (cancelled, finished, or taken again): the work on it should stop."""

    @abc.abstractmethod
    async def add_event(self, job_id: str, event: dict) -> None:
        """Keep ``event`` (a dict with an ``"id"`` unique within the job) last among the job's events."""

    @abc.abstractmethod
    async def events(self, job_id: str, after: str | None, limit: int) -> list[dict]:
        """At most ``limit`` of the job's events, newest first; with ``after`` (an event id) only
        those added before it (none when it is unknown)."""

    @abc.abstractmethod
    async def add_checkpoint(self, job_id: str, checkpoint: dict) -> None:
        """Keep ``checkpoint`` (a dict with an ``"id"`` unique within the job) last among the job's."""

    @abc.abstractmethod
    async def checkpoints(self, job_id: str, after: str | None, limit: int) -> list[dict]:
        """As ``events``, for the job's checkpoints."""


class SQLiteFineTuning(SQLiteFile, FineTuningStore):
    """Three tables in the batch store's SQLite file (WAL; ``storage.sqlite``), every call on the
    thread that owns the connection; each compare-and-set one transaction."""

    def __init__(self, path: Path) -> None:
        super().__init__(path, _SCHEMA, "tiergate-fine-tuning")

    def _get(self, job_id: str) -> Job | None:
        row = self._db.execute("SELECT doc FROM fine_tuning_jobs WHERE id = ?", (job_id,)).fetchone()
        return Job.of(row[0]) if row else None

    @staticmethod
    def _put(db: sqlite3.Connection, job: Job) -> None:
        db.execute("UPDATE fine_tuning_jobs SET status = ?, lease_until = ?, doc = ? WHERE id = ?",
                   (job.status, job.lease_until, job.doc(), job.id))

    def _swap(self, db: sqlite3.Connection, job_id: str, change: Callable[[Job], Job | None]) -> Job | None:
        """(in a transaction) The stored job replaced by ``change(job)``; None when it is gone or
        ``change`` returns None."""
        found = self._get(job_id)
        changed = change(found) if found is not None else None
        if changed is not None:
            self._put(db, changed)
        return changed

    async def create(self, job: Job, most: int | None = None) -> None:
        def write(db: sqlite3.Connection) -> None:  # BEGIN IMMEDIATE: another process's create waits
            if most is not None:
                count = db.execute(f"SELECT COUNT(*) FROM fine_tuning_jobs WHERE owner = ? AND status IN "
                                   f"({', '.join('?' * len(OPEN))})", (job.owner, *OPEN)).fetchone()[0]
                if count >= most:
                    raise TooManyJobs(count)
            try:
                db.execute("INSERT INTO fine_tuning_jobs (id, owner, status, lease_until, doc) VALUES (?, ?, ?, ?, ?)",
                           (job.id, job.owner, job.status, job.lease_until, job.doc()))
            except sqlite3.IntegrityError:
                raise ValueError(f"fine-tuning job {job.id!r} exists already") from None

        await self._call(self._tx, write)

    async def get(self, job_id: str, owner: str | None) -> Job | None:
        job = await self._call(self._get, job_id)
        return job if job is not None and owner in (None, job.owner) else None

    async def list(self, owner: str | None, after: str | None, limit: int) -> list[Job]:
        where: dict[str, str] = {}  # condition: its value
        if owner is not None:
            where["owner = ?"] = owner
        if after is not None:
            where["rowid < (SELECT rowid FROM fine_tuning_jobs WHERE id = ?)"] = after

        def read() -> list[Job]:
            rows = self._db.execute(f"SELECT doc FROM fine_tuning_jobs WHERE {' AND '.join(where) or '1'} "
                                    "ORDER BY rowid DESC LIMIT ?", (*where.values(), max(limit, 0))).fetchall()
            return [Job.of(row[0]) for row in rows]

        return await self._call(read)

    async def change(self, job: Job, expect: Collection[str], **changes: Any) -> Job | None:
        def guarded(now: Job) -> Job | None:
            return replace(now, **changes) if now.status in expect and now.attempt == job.attempt else None

        return await self._call(self._tx, lambda db: self._swap(db, job.id, guarded))

    async def claim(self, now: float, lease_s: float) -> Job | None:
        def write(db: sqlite3.Connection) -> Job | None:
            row = db.execute(_CLAIMABLE, (now,)).fetchone()
            if row is None:
                return None
            taken = Job.of(row[0]).taken(now, lease_s)
            self._put(db, taken)
            return taken

        return await self._call(self._tx, write)

    async def hold(self, job: Job, until: float) -> bool:
        def guarded(now: Job) -> Job | None:
            return replace(now, lease_until=until) if now.status == "running" and now.attempt == job.attempt else None

        return await self._call(self._tx, lambda db: self._swap(db, job.id, guarded)) is not None

    async def _add(self, table: str, job_id: str, item: dict) -> None:
        await self._call(self._tx, lambda db: db.execute(
            f"INSERT INTO {table} (job_id, id, doc) VALUES (?, ?, ?)", (job_id, str(item["id"]), json.dumps(item))))

    async def _newest(self, table: str, job_id: str, after: str | None, limit: int) -> list[dict]:
        before = "" if after is None else f" AND rowid < (SELECT rowid FROM {table} WHERE job_id = ? AND id = ?)"
        args = (job_id,) if after is None else (job_id, job_id, after)

        def read() -> list[dict]:
            rows = self._db.execute(f"SELECT doc FROM {table} WHERE job_id = ?{before} ORDER BY rowid DESC LIMIT ?",
                                    (*args, max(limit, 0))).fetchall()
            return [json.loads(row[0]) for row in rows]

        return await self._call(read)

    async def add_event(self, job_id: str, event: dict) -> None:
        await self._add("fine_tuning_events", job_id, event)

    async def events(self, job_id: str, after: str | None, limit: int) -> list[dict]:
        return await self._newest("fine_tuning_events", job_id, after, limit)

    async def add_checkpoint(self, job_id: str, checkpoint: dict) -> None:
        await self._add("fine_tuning_checkpoints", job_id, checkpoint)

    async def checkpoints(self, job_id: str, after: str | None, limit: int) -> list[dict]:
        return await self._newest("fine_tuning_checkpoints", job_id, after, limit)


# KEYS job, seq, order, owned, waiting; ARGV job id, doc, '1' when it waits, how many jobs the owner had when its
# open ones were counted ('' when not counted): only a new job, last in the order, and only when the owner has
# made none since (-1)
_CREATE = """
if ARGV[4] ~= '' and redis.call('ZCARD', KEYS[4]) ~= tonumber(ARGV[4]) then return -1 end
if not redis.call('SET', KEYS[1], ARGV[2], 'NX') then return 0 end
local seq = redis.call('INCR', KEYS[2])
redis.call('ZADD', KEYS[3], seq, ARGV[1])
redis.call('ZADD', KEYS[4], seq, ARGV[1])
if ARGV[3] == '1' then redis.call('ZADD', KEYS[5], seq, ARGV[1]) end
return 1
"""

# KEYS job, waiting, order; ARGV job id, the doc read, the new doc, '1' when it waits: the new doc if
# the doc is still the one read, the job in the waiting set while it waits
_SWAP = """
if redis.call('GET', KEYS[1]) ~= ARGV[2] then return 0 end
redis.call('SET', KEYS[1], ARGV[3])
local seq = redis.call('ZSCORE', KEYS[3], ARGV[1])
if ARGV[4] == '1' and seq then redis.call('ZADD', KEYS[2], seq, ARGV[1]) else redis.call('ZREM', KEYS[2], ARGV[1]) end
return 1
"""

CLAIM_PAGE = 64  # the waiting jobs a Redis claim reads at a time, oldest first


class RedisFineTuning(RedisKeys, FineTuningStore):
    """Per job a JSON doc; sorted sets of job ids by a global creation counter give the order made
    (all, a key's, the waiting ones); a job's events and checkpoints are lists. Every change of a
    doc is a compare-and-set of the whole doc (a Lua script): one read, then written only if no
    other write landed between, else read again."""

    def __init__(self, url: str, prefix: str = "tg:") -> None:
        super().__init__(url, prefix)

    async def open(self) -> None:
        await super().open()
        self._create = self._r.register_script(_CREATE)
        self._swap_doc = self._r.register_script(_SWAP)

    @staticmethod
    def _waits(job: Job) -> str:
        return "1" if job.status in WAITING else "0"

    async def _swap(self, raw: bytes, job: Job) -> bool:
        """Store ``job`` if its doc is still ``raw``."""
        keys = [self.k("ft", job.id), self.k("ft-waiting"), self.k("ft-order")]
        return bool(await self._swap_doc(keys=keys, args=[job.id, raw, job.doc(), self._waits(job)]))

    async def _change(self, job_id: str, change: Callable[[Job], Job | None]) -> Job | None:
        """The job's doc replaced by ``change(job)``; None when it is gone or ``change`` returns None.
        When another write lands between the read and the write, it is read and changed again."""
        while True:
            raw = await self._r.get(self.k("ft", job_id))
            changed = change(Job.of(raw)) if raw else None
            if changed is None or await self._swap(raw, changed):
                return changed

    async def create(self, job: Job, most: int | None = None) -> None:
        """With ``most``, a compare-and-set on the owner's jobs: their open ones are counted outside
        the script (reading every doc would hold Redis up), and the script writes only if the owner
        has made no job since. A key's jobs are never removed and only a create opens one, so a job
        that ended meanwhile can only make the count too high, never too low."""
        keys = [self.k("ft", job.id), self.k("ft-seq"), self.k("ft-order"), self.k("ft-owned", job.owner),
                self.k("ft-waiting")]
        while True:
            made = ""
            if most is not None:
                count, made = await self._open_of(job.owner)
                if count >= most:
                    raise TooManyJobs(count)
            done = await self._create(keys=keys, args=[job.id, job.doc(), self._waits(job), made])
            if done == 0:
                raise ValueError(f"fine-tuning job {job.id!r} exists already")
            if done == 1:
                return

    async def _open_of(self, owner: str) -> tuple[int, str]:
        """How many of ``owner``'s jobs are ``OPEN``, and how many jobs it had when they were read."""
        ids = await self._r.zrange(self.k("ft-owned", owner), 0, -1)
        count = 0
        for start in range(0, len(ids), CLAIM_PAGE):
            docs = await self._r.mget([self.k("ft", i.decode()) for i in ids[start:start + CLAIM_PAGE]])
            count += sum(1 for raw in docs if raw and Job.of(raw).status in OPEN)
        return count, str(len(ids))

    async def get(self, job_id: str, owner: str | None) -> Job | None:
        raw = await self._r.get(self.k("ft", job_id))
        job = Job.of(raw) if raw else None
        return job if job is not None and owner in (None, job.owner) else None

    async def list(self, owner: str | None, after: str | None, limit: int) -> list[Job]:
        if limit <= 0:
            return []
        order = self.k("ft-order") if owner is None else self.k("ft-owned", owner)
        if after is None:
            ids = await self._r.zrevrange(order, 0, limit - 1)
        else:
            seq = await self._r.zscore(self.k("ft-order"), after)
            if seq is None:
                return []
            ids = await self._r.zrevrangebyscore(order, f"({seq!r}", "-inf", start=0, num=limit)
        docs = await self._r.mget([self.k("ft", i.decode()) for i in ids]) if ids else []
        return [Job.of(doc) for doc in docs if doc]

    async def change(self, job: Job, expect: Collection[str], **changes: Any) -> Job | None:
        def guarded(now: Job) -> Job | None:
            return replace(now, **changes) if now.status in expect and now.attempt == job.attempt else None

        return await self._change(job.id, guarded)

    async def _oldest_claimable(self, now: float) -> tuple[bytes, Job] | None:
        """The oldest waiting job that ``claim`` may take, with its doc as read."""
        waiting, start = self.k("ft-waiting"), 0
        while ids := await self._r.zrange(waiting, start, start + CLAIM_PAGE - 1):
            docs = await self._r.mget([self.k("ft", i.decode()) for i in ids])
            for raw in docs:
                if raw and (job := Job.of(raw)).claimable(now):
                    return raw, job
            start += CLAIM_PAGE
        return None

    async def claim(self, now: float, lease_s: float) -> Job | None:
        """The oldest claimable job, taken by a compare-and-set of its doc: of two processes that read
        it, one writes, the other reads again and finds the next."""
        while (found := await self._oldest_claimable(now)) is not None:
            raw, job = found
            taken = job.taken(now, lease_s)
            if await self._swap(raw, taken):
                return taken
        return None

    async def hold(self, job: Job, until: float) -> bool:
        def guarded(now: Job) -> Job | None:
            return replace(now, lease_until=until) if now.status == "running" and now.attempt == job.attempt else None

        return await self._change(job.id, guarded) is not None

    async def _listed(self, key: str, after: str | None, limit: int) -> list[dict]:
        return _newest_first([json.loads(item) for item in await self._r.lrange(key, 0, -1)], after, limit)

    async def add_event(self, job_id: str, event: dict) -> None:
        await self._r.rpush(self.k("ft-events", job_id), json.dumps(event))

    async def events(self, job_id: str, after: str | None, limit: int) -> list[dict]:
        return await self._listed(self.k("ft-events", job_id), after, limit)

    async def add_checkpoint(self, job_id: str, checkpoint: dict) -> None:
        await self._r.rpush(self.k("ft-ckpts", job_id), json.dumps(checkpoint))

    async def checkpoints(self, job_id: str, after: str | None, limit: int) -> list[dict]:
        return await self._listed(self.k("ft-ckpts", job_id), after, limit)


def open_fine_tuning_store(spec: str, data_dir: Path) -> FineTuningStore:
    """The fine-tuning jobs on ``spec``'s backend (``storage.on_backend``): the batch store's SQLite
    file in ``data_dir``, or Redis at that URL."""
    return on_backend(spec, lambda: SQLiteFineTuning(data_dir / "batches.sqlite3"), RedisFineTuning)
