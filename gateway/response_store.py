"""Where ``/v1/responses`` keeps stored responses (``store: true``, the default): the durable store
beside the Batch API's, on the same backend (``batch.store`` in tiers.yaml).

* ``sqlite`` (the default): a ``responses`` table in the batch store's SQLite file.
* ``redis://...``: one key per response, ``tg:response:{id}``, on the batch store's Redis.

A record is the response object as the API returns it and its input items as the API lists them
(``input_items``): a later request continues it with ``previous_response_id`` from those items and
its output, its files read again (a record from before input items were kept has the chat
messages its prompt was built from instead, ``conversation``, which it continues from). A record is visible only to the key that made it: ``get`` and ``delete`` by
another key find nothing, so the API answers 404, as it does for files and batches.

A background response (``background: true``) is stored when it is accepted, ``queued``, and
rewritten as it runs by ``update_running``, which replaces a record only while its stored status
is still ``queued`` or ``in_progress``: so a cancel written by another process, or a delete, is
never undone by the process running it, whose next write finds it and stops the work. Each
write carries ``beat``, the time it was made; the running process writes at least every
``HEARTBEAT_S`` (gateway/response_runs.py), so a record whose beat is old had its process die. A
process that cancels or deletes a running record also announces it (``announce_stop``); on Redis
every process hears it at once (``stops``, a pub/sub channel, ``tg:response-stops``) and the one
running it stops then, not at its next write. On SQLite (processes of one machine) there is no
channel: the next write finds it.

A background response made with ``stream: true`` also keeps its events (the SSE text of each,
numbered by its ``sequence_number`` from 0), appended as they are made (``add_events``), so that a
client in any process can follow it again from any event (``events``): on SQLite a
``response_events`` table, on Redis a list ``tg:response-events:{id}``. Events are added only
while their record exists, deleted with it, and kept for the same retention.

Retention (``responses.retention_days`` in tiers.yaml, 30 by default, as OpenAI keeps them): a
record older than that is not returned, and is deleted: on SQLite by a sweep when the store opens
and every ``sweep_s`` after; on Redis by the key's own expiry, set when it is written (keys
written before there was a retention get theirs from a scan when the store opens).
"""

from __future__ import annotations

import abc
import asyncio
import json
import logging
import sqlite3
from dataclasses import dataclass
from pathlib import Path
from typing import Any, AsyncIterator

from redis.exceptions import RedisError

from gateway.service import Services
from storage import Along, along_json, on_backend
from storage.outage import Outage
from storage.redis import ALONG_LUA, honour_cancel
from storage.retention import Retained
from storage.sqlite import SweptFile

_RUNNING_SQL = "json_extract(doc, '$.response.status') IN ('queued', 'in_progress')"  # (the partial index's term)
_SCHEMA = """CREATE TABLE IF NOT EXISTS responses (
    id TEXT PRIMARY KEY, owner TEXT NOT NULL, doc TEXT NOT NULL, created_at INTEGER);
CREATE TABLE IF NOT EXISTS response_events (
    response_id TEXT NOT NULL, seq INTEGER NOT NULL, event TEXT NOT NULL, created_at INTEGER NOT NULL,
    PRIMARY KEY (response_id, seq)) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS response_events_created_at ON response_events (created_at);"""
log = logging.getLogger("tiergate.responses")
DAY_S = 86400
STOPS_RETRY_S = 1.0
STOPS_POLL_S = 1.0  # how long one wait for an announced stop lasts (a swallowed cancel is seen after it)


@dataclass(frozen=True)
class StoredResponse:
    id: str
    owner: str  # key_id of the key that made it
    created_at: int
    response: dict[str, Any]  # the public response object
    # a record from before input items were kept: chat messages, its input (no instructions), then its reply;
    # None since (an inline image would be kept twice a record, and a file already read stay read)
    conversation: list[dict[str, Any]] | None
    # its input as the Responses API's items (``input_items``): None in a record from before they were kept
    input_items: list[dict[str, Any]] | None = None
    beat: float | None = None  # a background response's last write (epoch seconds); None for the others
    # a background response's request, to run it again elsewhere: {"body", "tier" (its key's), "attempts"}
    request: dict[str, Any] | None = None
    runner: str | None = None  # the process running it (Background.runner); only it rewrites the record

    def doc(self) -> str:
        return json.dumps({"owner": self.owner, "created_at": self.created_at, "response": self.response,
                           "conversation": self.conversation, "input_items": self.input_items, "beat": self.beat,
                           "request": self.request, "runner": self.runner}, separators=(",", ":"))

    @classmethod
    def of(cls, response_id: str, doc: str | bytes) -> "StoredResponse":
        d = json.loads(doc)
        return cls(response_id, d["owner"], d["created_at"], d["response"], d.get("conversation"), d.get("input_items"),
                   d.get("beat"), d.get("request"), d.get("runner"))


class ResponseStore(Retained, abc.ABC):
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

    @abc.abstractmethod
    async def update_running(self, record: StoredResponse, along: Along | None = None) -> bool:
        """Replace the stored record of ``record.id`` (made by ``record.owner``) with ``record``, only
        while the stored one's status is ``queued`` or ``in_progress`` and its ``runner`` is
        ``record.runner``; False when not (it ended, was cancelled or deleted, or another process
        took it over), and then nothing changes. ``along``'s writes (the webhook event of the end
        ``record`` says) are made in the same atomic step, only if the record was replaced."""

    @abc.abstractmethod
    async def running(self) -> list[tuple[str, str]]:
        """Every record still ``queued`` or ``in_progress``, as ``(id, doc)``: the stored text, for
        ``claim``."""

    @abc.abstractmethod
    async def claim(self, response_id: str, doc: str, record: StoredResponse) -> bool:
        """Replace the record with ``record`` only if it is still exactly ``doc`` (as ``running``
        read it): one process wins a record left by a dead one."""

    async def announce_stop(self, response_id: str) -> None:
        """Tell the other processes that ``response_id`` was cancelled or deleted (nothing by default)."""

    async def stops(self) -> AsyncIterator[str]:
        """The ids other processes announce, as they come; none by default (this waits for ever)."""
        await asyncio.Event().wait()
        yield ""  # pragma: no cover - never reached

    @abc.abstractmethod
    async def add_events(self, response_id: str, created_at: int, first: int, events: list[str]) -> None:
        """Append the events numbered ``first``, ``first + 1``... of the response ``response_id``
        (made at ``created_at``); events already stored are not written again, and none are written
        when the record is gone (deleted)."""

    @abc.abstractmethod
    async def events(self, response_id: str, after: int) -> list[str]:
        """The stored events of ``response_id`` numbered above ``after``, in order. (No owner: the
        caller has read the record with the key's own id first.)"""


class SQLiteResponses(SweptFile, ResponseStore):
    """A table in one SQLite file (WAL; ``storage.sqlite``), every call on one thread that owns the
    connection."""

    def __init__(self, path: Path, retention_s: float | None = None, sweep_s: float = 3600.0) -> None:
        super().__init__(path, _SCHEMA, "tiergate-responses", retention_s, sweep_s)

    def _migrate(self, db: sqlite3.Connection) -> None:
        if "created_at" not in {row[1] for row in db.execute("PRAGMA table_info(responses)")}:
            db.execute("ALTER TABLE responses ADD COLUMN created_at INTEGER")  # a table from before retention
            db.execute("UPDATE responses SET created_at = json_extract(doc, '$.created_at')")
        db.execute("CREATE INDEX IF NOT EXISTS responses_created_at ON responses (created_at)")
        db.execute(f"CREATE INDEX IF NOT EXISTS responses_running ON responses (id) WHERE {_RUNNING_SQL}")

    def _changed(self, sql: str, args: tuple) -> int:
        """(on the connection's thread) Rows that ``sql`` changed (one statement: its own transaction)."""
        return self._db.execute(sql, args).rowcount

    def _sweep(self, cutoff: float) -> int:
        gone = self._changed("DELETE FROM responses WHERE created_at < ?", (cutoff,))
        self._changed("DELETE FROM response_events WHERE created_at < ?", (cutoff,))
        return gone

    async def put(self, record: StoredResponse) -> None:
        await self._call(self._changed, "INSERT INTO responses (id, owner, doc, created_at) VALUES (?, ?, ?, ?)",
                         (record.id, record.owner, record.doc(), record.created_at))

    async def get(self, response_id: str, owner: str) -> StoredResponse | None:
        cutoff = self._cutoff()
        row = await self._call(lambda: self._db.execute(
            "SELECT doc FROM responses WHERE id = ? AND owner = ? AND (? IS NULL OR created_at >= ?)",
            (response_id, owner, cutoff, cutoff)).fetchone())
        return StoredResponse.of(response_id, row[0]) if row else None

    async def delete(self, response_id: str, owner: str) -> bool:
        cutoff = self._cutoff()  # one past the retention is gone already (GET says 404), as the sweep will make it
        return await self._call(self._tx, lambda db: self._delete(db, response_id, owner, cutoff))

    @staticmethod
    def _delete(db: sqlite3.Connection, response_id: str, owner: str, cutoff: float | None = None) -> bool:
        if db.execute("DELETE FROM responses WHERE id = ? AND owner = ? AND (? IS NULL OR created_at >= ?)",
                      (response_id, owner, cutoff, cutoff)).rowcount != 1:
            return False
        db.execute("DELETE FROM response_events WHERE response_id = ?", (response_id,))
        return True

    async def update_running(self, record: StoredResponse, along: Along | None = None) -> bool:
        def update(db: sqlite3.Connection) -> bool:
            changed = db.execute(f"UPDATE responses SET doc = ? WHERE id = ? AND owner = ? AND {_RUNNING_SQL} "
                                 "AND coalesce(json_extract(doc, '$.runner'), '') = ?",
                                 (record.doc(), record.id, record.owner, record.runner or "")).rowcount == 1
            if changed and along is not None:
                along.run_sqlite(db)
            return changed

        return await self._call(self._tx, update)

    async def running(self) -> list[tuple[str, str]]:
        return await self._call(lambda: self._db.execute(f"SELECT id, doc FROM responses WHERE {_RUNNING_SQL}").fetchall())

    async def claim(self, response_id: str, doc: str, record: StoredResponse) -> bool:
        return await self._call(self._changed, "UPDATE responses SET doc = ? WHERE id = ? AND doc = ?",
                                (record.doc(), response_id, doc)) == 1

    async def add_events(self, response_id: str, created_at: int, first: int, events: list[str]) -> None:
        rows = [(response_id, first + k, event, created_at, response_id) for k, event in enumerate(events)]
        await self._call(self._tx, lambda db: db.executemany(
            "INSERT OR IGNORE INTO response_events (response_id, seq, event, created_at) "
            "SELECT ?, ?, ?, ? WHERE EXISTS (SELECT 1 FROM responses WHERE id = ?)", rows))

    async def events(self, response_id: str, after: int) -> list[str]:
        rows = await self._call(lambda: self._db.execute(
            "SELECT event FROM response_events WHERE response_id = ? AND seq > ? ORDER BY seq",
            (response_id, after)).fetchall())
        return [row[0] for row in rows]


# KEYS response, its events; ARGV owner: delete only the owner's record (and its events)
_DELETE = """
local doc = redis.call('GET', KEYS[1])
if not doc then return 0 end
if cjson.decode(doc)['owner'] ~= ARGV[1] then return 0 end
redis.call('DEL', KEYS[2])
return redis.call('DEL', KEYS[1])
"""


# KEYS events, response; ARGV first, expiry ('' for none), events...: append those not yet there,
# while the record exists (the list's index is the event's number)
_ADD_EVENTS = """
if redis.call('EXISTS', KEYS[2]) == 0 then return 0 end
local from = 3 + redis.call('LLEN', KEYS[1]) - tonumber(ARGV[1])
if from < 3 then return redis.error_reply('events missing before ' .. ARGV[1]) end
for i = from, #ARGV do redis.call('RPUSH', KEYS[1], ARGV[i]) end
if ARGV[2] ~= '' then redis.call('EXPIREAT', KEYS[1], ARGV[2]) end
return 1
"""


# KEYS response, the running set; ARGV the new record, owner, runner ('' for none), the new status, id, the writes
# that go with it (``storage.Along``): replace only the owner's record while it runs under that runner; one
# that ends leaves the set
_UPDATE_RUNNING = ALONG_LUA + """
local doc = redis.call('GET', KEYS[1])
if not doc then return 0 end
local d = cjson.decode(doc)
if d['owner'] ~= ARGV[2] then return 0 end
local status = d['response']['status']
if status ~= 'queued' and status ~= 'in_progress' then return 0 end
local runner = d['runner']
if runner == nil or runner == cjson.null then runner = '' end
if runner ~= ARGV[3] then return 0 end
redis.call('SET', KEYS[1], ARGV[1], 'KEEPTTL')
if ARGV[4] ~= 'queued' and ARGV[4] ~= 'in_progress' then redis.call('SREM', KEYS[2], ARGV[5]) end
along(ARGV[6])
return 1
"""

# KEYS response; ARGV the doc read, the new doc: replace it only if no one changed it meanwhile
_CLAIM = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
redis.call('SET', KEYS[1], ARGV[2], 'KEEPTTL')
return 1
"""


class RedisResponses(ResponseStore):
    """One key per response, ``{prefix}response:{id}``, holding the record as JSON, expiring at
    the end of its retention."""

    def __init__(self, url: str, prefix: str = "tg:", retention_s: float | None = None) -> None:
        self.url, self.prefix, self.retention_s = url, prefix, retention_s
        self._r = None
        self._expirer: asyncio.Task | None = None

    def _key(self, response_id: str) -> str:
        return f"{self.prefix}response:{response_id}"

    def _events_key(self, response_id: str) -> str:  # (not under response:*, which the expiry scan reads)
        return f"{self.prefix}response-events:{response_id}"

    async def open(self) -> None:
        import redis.asyncio as aioredis

        self._r = aioredis.Redis.from_url(self.url)
        self._delete = self._r.register_script(_DELETE)
        self._update_running = self._r.register_script(_UPDATE_RUNNING)
        self._add_events = self._r.register_script(_ADD_EVENTS)
        self._claim = self._r.register_script(_CLAIM)
        if self.retention_s is not None:
            self._expirer = asyncio.create_task(self._expire_in_background())

    async def close(self) -> None:
        if self._expirer is not None:
            self._expirer.cancel()
            await asyncio.gather(self._expirer, return_exceptions=True)
            self._expirer = None
        if self._r is not None:
            await self._r.aclose()
            self._r = None

    def _running_key(self) -> str:
        return f"{self.prefix}responses-running"

    async def put(self, record: StoredResponse) -> None:
        # one transaction: a process that died between the record and its place in the running set left
        # a queued record that no reclaim finds, queued until its retention (hunt CC, finding 4)
        async with self._r.pipeline(transaction=True) as p:
            # (an expiry already past deletes the key at once, as Redis does for any EXAT)
            p.set(self._key(record.id), record.doc(), nx=True, exat=self._expires_at(record.created_at))
            if record.response.get("status") in ("queued", "in_progress"):
                p.sadd(self._running_key(), record.id)
            await p.execute()

    async def get(self, response_id: str, owner: str) -> StoredResponse | None:
        raw = await self._r.get(self._key(response_id))
        record = StoredResponse.of(response_id, raw) if raw else None
        if record is None or record.owner != owner:
            return None
        cutoff = self._cutoff()
        return record if cutoff is None or record.created_at >= cutoff else None

    async def _expire_in_background(self) -> None:
        try:
            given = await self.expire_unexpiring()
        except Exception as exc:  # noqa: BLE001 - Redis down: the next start tries again; get() hides them meanwhile
            log.warning("stored responses: giving old records their expiry failed: %s", exc)
        else:
            if given:
                log.info("stored responses: %d records from before the retention now expire", given)

    async def expire_unexpiring(self) -> int:
        """Give the records written without an expiry (before there was a retention) theirs; how
        many. One pass of SCAN over this prefix's keys, run in the background when the store opens."""
        given = 0
        async for key in self._r.scan_iter(match=f"{self.prefix}response:*", count=500):
            honour_cancel()
            if await self._r.ttl(key) != -1:  # has one (-1: none; -2: gone meanwhile)
                continue
            try:
                created_at = json.loads(await self._r.get(key) or "null")["created_at"]
            except (ValueError, TypeError, KeyError):  # gone meanwhile, or not a record of ours: left as it is
                continue
            await self._r.expireat(key, self._expires_at(created_at))
            given += 1
        return given

    async def delete(self, response_id: str, owner: str) -> bool:
        if await self.get(response_id, owner) is None:  # none, another key's, or past the retention (GET's 404)
            return False
        return bool(await self._delete(keys=[self._key(response_id), self._events_key(response_id)], args=[owner]))

    async def update_running(self, record: StoredResponse, along: Along | None = None) -> bool:
        return bool(await self._update_running(keys=[self._key(record.id), self._running_key()],
                                               args=[record.doc(), record.owner, record.runner or "",
                                                     record.response.get("status", ""), record.id, along_json(along)]))

    async def running(self) -> list[tuple[str, str]]:
        ids = [i.decode() for i in await self._r.smembers(self._running_key())]
        out = []
        for response_id, raw in zip(ids, await self._r.mget([self._key(i) for i in ids]) if ids else []):
            status = json.loads(raw)["response"].get("status") if raw else None
            if status in ("queued", "in_progress"):
                out.append((response_id, raw.decode()))
            else:  # ended by a cancel written elsewhere, deleted or expired: no longer running
                await self._r.srem(self._running_key(), response_id)
        return out

    async def claim(self, response_id: str, doc: str, record: StoredResponse) -> bool:
        return bool(await self._claim(keys=[self._key(response_id)], args=[doc, record.doc()]))

    async def add_events(self, response_id: str, created_at: int, first: int, events: list[str]) -> None:
        expires = self._expires_at(created_at)
        await self._add_events(keys=[self._events_key(response_id), self._key(response_id)],
                               args=[first, "" if expires is None else expires, *events])

    async def events(self, response_id: str, after: int) -> list[str]:
        return [e.decode() for e in await self._r.lrange(self._events_key(response_id), after + 1, -1)]

    def _stops_channel(self) -> str:
        return f"{self.prefix}response-stops"

    async def announce_stop(self, response_id: str) -> None:
        await self._r.publish(self._stops_channel(), response_id)

    async def stops(self) -> AsyncIterator[str]:
        """Subscribed again after a lost connection, STOPS_RETRY_S later (what was announced
        meanwhile is found by the running process's next write, as on SQLite); a Redis that does
        not answer is one warning when it goes and one when it is back (``storage.outage``)."""
        outage = Outage(log, "stored responses: the stops channel")
        while True:
            pubsub = self._r.pubsub(ignore_subscribe_messages=True)
            try:
                await pubsub.subscribe(self._stops_channel())
                outage.answered()
                while True:  # not ``listen()``, which waits for ever: a cancel its client swallowed is seen each turn
                    honour_cancel()  # (a cancel landing on the subscribe is: the app's shutdown then never ended)
                    message = await pubsub.get_message(timeout=STOPS_POLL_S)
                    if message is not None and message["type"] == "message":
                        yield message["data"].decode()
            except (OSError, RedisError) as exc:
                outage.failed(exc)
            finally:
                await pubsub.aclose()
            await asyncio.sleep(STOPS_RETRY_S)


def open_responses(spec: str, data_dir: Path, retention_s: float | None = None) -> ResponseStore:
    """The stored responses on ``spec``'s backend (``storage.on_backend``): the batch store's SQLite file in
    ``data_dir``, or Redis at that URL."""
    return on_backend(spec, lambda: SQLiteResponses(data_dir / "batches.sqlite3", retention_s), lambda url: RedisResponses(url, retention_s=retention_s))


def responses_for(svc: Services) -> ResponseStore:
    """The process's response store on the configured backend, opened and closed with the app."""
    days = svc.config.responses.retention_days
    return svc.keep_open(open_responses(svc.config.batch.store, svc.config.data_dir(),
                                        None if days is None else days * DAY_S))
