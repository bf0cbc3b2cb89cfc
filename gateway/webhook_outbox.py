"""Where webhook deliveries wait until their endpoint takes them (``gateway.webhooks``), on the
batch store's backend (``batch.store`` in tiers.yaml), so that an event outlives the process that
made it: a restart, a crash, or another process sharing the store delivers what is left.

A delivery is one event for one endpoint (its URL). It is *available* from a time on: when it is
due (made now, or its next retry) or, once a process claims it, when that claim runs out. A
process claims the available deliveries of the endpoints it knows, tries each once, and then
removes it (delivered, or its retries spent) or sets its next try; both only while the claim is
still its own, so a process that stalled past its claim changes nothing that another took over.

* ``sqlite`` (the default): a ``webhook_deliveries`` table in the batch store's SQLite file.
* ``redis://...``: ``tg:webhook-delivery:{id}`` (a hash) holds each, expiring with its retry
  window, and ``tg:webhook-due:{url}`` (a sorted set scored by the time it is available) lists an
  endpoint's.
"""

from __future__ import annotations

import abc
import sqlite3
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from storage import Along, on_backend
from storage.redis import RedisKeys
from storage.sqlite import SQLiteFile


@dataclass(frozen=True)
class Delivery:
    id: str  # whd_...: this event for this endpoint
    url: str  # the endpoint's
    event_id: str  # evt_...: the webhook-id header, the same on every try and for every endpoint
    body: str  # the event, exactly as signed and sent
    created_at: float  # when the event was made (epoch seconds): its retry window counts from it
    attempt: int = 0  # tries made so far


class Outbox(abc.ABC):
    @abc.abstractmethod
    async def open(self) -> None: ...

    @abc.abstractmethod
    async def close(self) -> None: ...

    @abc.abstractmethod
    async def add(self, deliveries: list[Delivery], now: float) -> None:
        """Store new deliveries, available at ``now``; one already stored (a write tried again
        after it had landed) is left as it is."""

    @abc.abstractmethod
    def along(self, deliveries: list[Delivery], now: float) -> Along:
        """New deliveries (as ``add``'s) as writes for another store on this backend to make in
        the same atomic step as its change (``storage.Along``): the end of a batch or response
        and its event are stored together, or neither."""

    @abc.abstractmethod
    async def claim(self, rooms: dict[str, int], runner: str, now: float, until: float,
                    made_after: float) -> list[Delivery]:
        """Up to ``rooms[url]`` deliveries to each endpoint of ``rooms`` available at ``now`` (its
        soonest first; each endpoint's apart, so that one's backlog never takes another's room),
        claimed for ``runner`` until ``until``. Deliveries made before ``made_after`` (their retry
        window over) are deleted instead of returned."""

    @abc.abstractmethod
    async def pending(self, urls: list[str]) -> dict[str, int]:
        """How many deliveries to each of ``urls`` wait (due, claimed or waiting to retry)."""

    @abc.abstractmethod
    async def finish(self, delivery: Delivery, runner: str) -> bool:
        """Delete ``delivery`` (delivered, or given up) if ``runner`` still holds it."""

    @abc.abstractmethod
    async def reschedule(self, delivery: Delivery, runner: str, attempt: int, at: float) -> bool:
        """Release ``delivery`` (if ``runner`` still holds it) with ``attempt`` tries made,
        available again at ``at``."""


_SCHEMA = """CREATE TABLE IF NOT EXISTS webhook_deliveries (
    id TEXT PRIMARY KEY, url TEXT NOT NULL, event_id TEXT NOT NULL, body TEXT NOT NULL,
    created_at REAL NOT NULL, attempt INTEGER NOT NULL, available_at REAL NOT NULL, runner TEXT);
CREATE INDEX IF NOT EXISTS webhook_deliveries_available ON webhook_deliveries (url, available_at);
CREATE INDEX IF NOT EXISTS webhook_deliveries_created_at ON webhook_deliveries (created_at);"""


class SQLiteOutbox(SQLiteFile, Outbox):
    def __init__(self, path: Path) -> None:
        super().__init__(path, _SCHEMA, "tiergate-webhooks")

    async def add(self, deliveries: list[Delivery], now: float) -> None:
        await self._call(self._tx, self.along(deliveries, now).run_sqlite)

    def along(self, deliveries: list[Delivery], now: float) -> Along:
        rows = [(d.id, d.url, d.event_id, d.body, d.created_at, d.attempt, now) for d in deliveries]
        return Along(sqlite=lambda db: db.executemany(
            "INSERT OR IGNORE INTO webhook_deliveries (id, url, event_id, body, created_at, attempt, available_at) "
            "VALUES (?, ?, ?, ?, ?, ?, ?)", rows))

    async def claim(self, rooms: dict[str, int], runner: str, now: float, until: float,
                    made_after: float) -> list[Delivery]:
        def take(db: sqlite3.Connection) -> list[Delivery]:
            db.execute("DELETE FROM webhook_deliveries WHERE created_at < ?", (made_after,))
            rows = [row for url, limit in rooms.items() for row in db.execute(
                "SELECT id, url, event_id, body, created_at, attempt FROM webhook_deliveries "
                "WHERE url = ? AND available_at <= ? ORDER BY available_at LIMIT ?", (url, now, limit))]
            db.executemany("UPDATE webhook_deliveries SET runner = ?, available_at = ? WHERE id = ?",
                           [(runner, until, r[0]) for r in rows])
            return [Delivery(*r) for r in rows]

        return await self._call(self._tx, take) if rooms else []

    async def pending(self, urls: list[str]) -> dict[str, int]:
        marks = ",".join("?" * len(urls))
        rows = await self._call(lambda: self._db.execute(
            f"SELECT url, COUNT(*) FROM webhook_deliveries WHERE url IN ({marks}) GROUP BY url", urls).fetchall())
        return {url: 0 for url in urls} | dict(rows)

    async def finish(self, delivery: Delivery, runner: str) -> bool:
        return await self._call(lambda: self._db.execute(
            "DELETE FROM webhook_deliveries WHERE id = ? AND runner = ?", (delivery.id, runner)).rowcount == 1)

    async def reschedule(self, delivery: Delivery, runner: str, attempt: int, at: float) -> bool:
        return await self._call(lambda: self._db.execute(
            "UPDATE webhook_deliveries SET attempt = ?, available_at = ?, runner = NULL WHERE id = ? AND runner = ?",
            (attempt, at, delivery.id, runner)).rowcount == 1)


# KEYS the endpoint's due set; ARGV now, until, limit, runner, the deliveries' key prefix, made_after
_CLAIM = """
local ids = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', ARGV[1], 'LIMIT', 0, tonumber(ARGV[3]))
local out = {}
for _, id in ipairs(ids) do
  local key = ARGV[5] .. id
  local made = redis.call('HGET', key, 'created_at')
  if not made or tonumber(made) < tonumber(ARGV[6]) then
    redis.call('DEL', key)
    redis.call('ZREM', KEYS[1], id)
  else
    redis.call('HSET', key, 'runner', ARGV[4])
    redis.call('ZADD', KEYS[1], ARGV[2], id)
    table.insert(out, redis.call('HGETALL', key))
  end
end
return out
"""

# KEYS the delivery, the endpoint's due set; ARGV runner, id: delete it if runner holds it
_FINISH = """
if redis.call('HGET', KEYS[1], 'runner') ~= ARGV[1] then return 0 end
redis.call('ZREM', KEYS[2], ARGV[2])
return redis.call('DEL', KEYS[1])
"""

# KEYS the delivery, the endpoint's due set; ARGV runner, id, attempt, at: release it if runner holds it
_RESCHEDULE = """
if redis.call('HGET', KEYS[1], 'runner') ~= ARGV[1] then return 0 end
redis.call('HSET', KEYS[1], 'attempt', ARGV[3], 'runner', '')
redis.call('ZADD', KEYS[2], ARGV[4], ARGV[2])
return 1
"""


class RedisOutbox(RedisKeys, Outbox):
    def __init__(self, url: str, window_s: float, prefix: str = "tg:") -> None:
        super().__init__(url, prefix)
        self.window_s = window_s  # a delivery's hash expires this long after its event was made

    async def open(self) -> None:
        await super().open()
        self._claim = self._r.register_script(_CLAIM)
        self._finish = self._r.register_script(_FINISH)
        self._reschedule = self._r.register_script(_RESCHEDULE)

    async def add(self, deliveries: list[Delivery], now: float) -> None:
        async with self._r.pipeline(transaction=True) as tx:
            for command in self.along(deliveries, now).redis:
                tx.execute_command(*command)
            await tx.execute()

    def along(self, deliveries: list[Delivery], now: float) -> Along:
        commands: list[tuple[str, ...]] = []
        for d in deliveries:
            key = self.k("webhook-delivery", d.id)
            commands += [("HSET", key, "id", d.id, "url", d.url, "event_id", d.event_id, "body", d.body,
                          "created_at", repr(d.created_at), "attempt", str(d.attempt), "runner", ""),
                         ("EXPIREAT", key, str(int(d.created_at + self.window_s) + 1)),
                         # written again: its due time kept
                         ("ZADD", self.k("webhook-due", d.url), "NX", repr(now), d.id)]
        return Along(redis=tuple(commands))

    async def claim(self, rooms: dict[str, int], runner: str, now: float, until: float,
                    made_after: float) -> list[Delivery]:
        out: list[Delivery] = []
        for url, limit in rooms.items():
            rows = await self._claim(keys=[self.k("webhook-due", url)],
                                     args=[repr(now), repr(until), limit, runner,
                                           self.k("webhook-delivery", ""), repr(made_after)])
            for flat in rows:
                f: dict[str, Any] = {flat[i].decode(): flat[i + 1].decode() for i in range(0, len(flat), 2)}
                out.append(Delivery(f["id"], f["url"], f["event_id"], f["body"], float(f["created_at"]), int(f["attempt"])))
        return out

    async def pending(self, urls: list[str]) -> dict[str, int]:
        async with self._r.pipeline(transaction=False) as p:
            for url in urls:
                p.zcard(self.k("webhook-due", url))
            return dict(zip(urls, await p.execute()))

    async def finish(self, delivery: Delivery, runner: str) -> bool:
        return bool(await self._finish(keys=[self.k("webhook-delivery", delivery.id), self.k("webhook-due", delivery.url)],
                                       args=[runner, delivery.id]))

    async def reschedule(self, delivery: Delivery, runner: str, attempt: int, at: float) -> bool:
        return bool(await self._reschedule(
            keys=[self.k("webhook-delivery", delivery.id), self.k("webhook-due", delivery.url)],
            args=[runner, delivery.id, attempt, repr(at)]))


def open_outbox(spec: str, data_dir: Path, window_s: float) -> Outbox:
    """The webhook outbox on ``spec``'s backend (``storage.on_backend``): the batch store's SQLite file in
    ``data_dir``, or Redis at that URL."""
    return on_backend(spec, lambda: SQLiteOutbox(data_dir / "batches.sqlite3"), lambda url: RedisOutbox(url, window_s))
