"""The Batch API's store in Redis (``store: redis://...``): processes on many machines share the
work through one stream per line shape, each with a consumer group. See ``batch.store`` for the
guarantees."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import asdict
from typing import Any, Callable, Iterable

from batch.store import (MUTABLE, TERMINAL, BatchInfo, FileInfo, Job, Line, Outcome, Recorded, Store, check_fields,
                         dumps, line_json, line_of, outcome_json, outcome_of)
from storage import Along, along_json
from storage.redis import ALONG_LUA, RedisKeys, honour_cancel, keyset_page

log = logging.getLogger("tiergate.batch")

# Keys (prefix "tg:"): file:{id} (its metadata as JSON), file:{id}:content (both expire at the
# file's expires_at, if it has one); files and files:{owner} (sorted sets of ids by created_at, the
# listing's order: score, then id); files:expiry (sorted set of "{id} {owner}" by expires_at: the
# sweep drops expired files from the two listings); files:indexed (set once the files from before
# the listings are in them); batch:{id} (hash: doc =
# the static fields as JSON, status, total, completed, failed, and each MUTABLE field as JSON);
# batch:{id}:lines and batch:{id}:outcomes (hashes by line index); batch:{id}:lock; batches and
# batches:{owner} (sorted sets of ids, which sort by time); open (set of ids); backlog:{shape} (a
# stream per line shape, entries {b: batch id, i: line index}, consumer group "runners");
# batch:{id}:spans (hash: shape -> "first last", the ids of the batch's first and last entries in
# that shape's stream: one script adds them all, so no other entry lies between);
# shapes (sorted set of the shapes whose stream has entries, by when the shape first got work:
# the counter shapes:seq). A job's token is "{entry id} {shape}".

_TERMINAL_LUA = "local terminal = {failed=true, completed=true, expired=true, cancelled=true}\n"

# KEYS batch, lines, outcomes, shapes, shapes:seq, spans; ARGV now, batch id, backlog key prefix, the lines
# as one JSON array of [idx, shape, line], the invalid ones' outcomes as one of [idx, outcome] (two values,
# not three per line: a 50,000-line batch's arguments would take the event loop a third of a second to pack)
_START = """
if redis.call('HGET', KEYS[1], 'status') ~= 'validating' then return 0 end
local lines, bad = cjson.decode(ARGV[4]), cjson.decode(ARGV[5])
local first, last = {}, {}
for _, line in ipairs(lines) do
  local idx, shape = line[1], line[2]
  local stream = ARGV[3] .. shape
  redis.call('HSET', KEYS[2], idx, line[3])
  if redis.call('ZSCORE', KEYS[4], shape) == false then
    redis.pcall('XGROUP', 'CREATE', stream, 'runners', '0', 'MKSTREAM')
    redis.call('ZADD', KEYS[4], redis.call('INCR', KEYS[5]), shape)
  end
  last[shape] = redis.call('XADD', stream, '*', 'b', ARGV[2], 'i', idx)
  first[shape] = first[shape] or last[shape]
end
for shape, id in pairs(first) do redis.call('HSET', KEYS[6], shape, id .. ' ' .. last[shape]) end
for _, o in ipairs(bad) do redis.call('HSET', KEYS[3], o[1], o[2]) end
redis.call('HSET', KEYS[1], 'status', 'in_progress', 'in_progress_at', ARGV[1], 'total', #lines + #bad, 'failed', #bad)
return 1
"""

# KEYS batch, lines, outcomes, open, lock, spans; ARGV batch id, new status, backlog key prefix, group, the writes
# that go with it (``storage.Along``), n allowed, allowed..., (field, json)*. A terminal status also takes the
# batch's entries out of the backlog (its spans), so the lines it never ran cost later batches of their shapes
# nothing; a consumer still holding one finds it gone (its record and ack do nothing, and a fill no longer runs).
_SET_STATUS = _TERMINAL_LUA + ALONG_LUA + """
local status = redis.call('HGET', KEYS[1], 'status')
if not status then return 0 end
local n = tonumber(ARGV[6])
local ok = false
for i = 7, 6 + n do if ARGV[i] == status then ok = true end end
if not ok then return 0 end
redis.call('HSET', KEYS[1], 'status', ARGV[2])
for j = 7 + n, #ARGV, 2 do redis.call('HSET', KEYS[1], ARGV[j], ARGV[j + 1]) end
along(ARGV[5])
if terminal[ARGV[2]] then
  local spans = redis.call('HGETALL', KEYS[6])
  for s = 1, #spans, 2 do
    local stream, first, last = ARGV[3] .. spans[s], string.match(spans[s + 1], '(%S+) (%S+)')
    local ids = {}
    for _, entry in ipairs(redis.call('XRANGE', stream, first, last)) do table.insert(ids, entry[1]) end
    for k = 1, #ids, 1000 do  -- (unpack has a limit on its arguments)
      redis.pcall('XACK', stream, ARGV[4], unpack(ids, k, math.min(k + 999, #ids)))
      redis.call('XDEL', stream, unpack(ids, k, math.min(k + 999, #ids)))
    end
  end
  redis.call('DEL', KEYS[2], KEYS[3], KEYS[5], KEYS[6])
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

# KEYS batch, outcomes, shapes; ARGV group, backlog key prefix, batch id, held ms, then (idx, ok 1|0, outcome)*
# -> added. The lines left are those held: an entry of the batch pending in a shape's stream with an idle
# time under held ms (a live consumer runs it). In one script, so no claim slips in between the look and the
# write: a line claimed before is left, one claimed after has its outcome (and the claim drops it).
_FILL = _TERMINAL_LUA + """
local status = redis.call('HGET', KEYS[1], 'status')
if (not status) or terminal[status] then return 0 end
local held, held_ms = {}, tonumber(ARGV[4])
if held_ms > 0 then
  for _, shape in ipairs(redis.call('ZRANGE', KEYS[3], 0, -1)) do
    local stream = ARGV[2] .. shape
    local pending = redis.pcall('XPENDING', stream, ARGV[1], '-', '+', 1000000)
    if type(pending) == 'table' and not pending.err then
      for _, p in ipairs(pending) do
        local entry = tonumber(p[3]) < held_ms and redis.call('XRANGE', stream, p[1], p[1])[1]
        if entry then
          local f = {}
          for k = 1, #entry[2], 2 do f[entry[2][k]] = entry[2][k + 1] end
          if f.b == ARGV[3] and f.i then held[f.i] = true end
        end
      end
    end
  end
end
local added = 0
for j = 5, #ARGV, 3 do
  if not held[ARGV[j]] and redis.call('HSETNX', KEYS[2], ARGV[j], ARGV[j + 2]) == 1 then
    added = added + 1
    redis.call('HINCRBY', KEYS[1], ARGV[j + 1] == '1' and 'completed' or 'failed', 1)
  end
end
return added
"""

# KEYS lines, outcomes; ARGV cursor, count -> {next cursor, idx, line, ...}: one HSCAN page of the lines,
# those that have no outcome (a big batch's are read a page at a time, so no reply holds the event loop)
_MISSING = """
local page, out = redis.call('HSCAN', KEYS[1], ARGV[1], 'COUNT', ARGV[2]), {}
out[1] = page[1]
for k = 1, #page[2], 2 do
  if redis.call('HEXISTS', KEYS[2], page[2][k]) == 0 then
    table.insert(out, page[2][k])
    table.insert(out, page[2][k + 1])
  end
end
return out
"""

# KEYS shapes; ARGV backlog key prefix -> the shapes whose stream has entries, oldest first (the
# others leave the set, in the same step that checks them, so a start cannot slip in between)
_SHAPES = """
local out = {}
for _, shape in ipairs(redis.call('ZRANGE', KEYS[1], 0, -1)) do
  if redis.call('XLEN', ARGV[1] .. shape) > 0 then table.insert(out, shape)
  else redis.call('ZREM', KEYS[1], shape) end
end
return out
"""

# KEYS lock; ARGV holder
_UNLOCK = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""

GROUP = "runners"
PAGE = 1000  # lines or outcomes read (and filled) per call: each a short turn of the event loop
_FAR_PAST_MS = 10 ** 12  # an idle time that any reclaim threshold passes


class RedisStore(RedisKeys, Store):
    def __init__(self, url: str, prefix: str = "tg:") -> None:
        super().__init__(url, prefix)
        self.backlog = f"{prefix}backlog:"  # + shape: that shape's stream

    async def open(self) -> None:
        await super().open()
        self._shapes = self._r.register_script(_SHAPES)
        self._start = self._r.register_script(_START)
        self._set_status = self._r.register_script(_SET_STATUS)
        self._record = self._r.register_script(_RECORD)
        self._fill = self._r.register_script(_FILL)
        self._missing = self._r.register_script(_MISSING)
        self._unlock = self._r.register_script(_UNLOCK)
        self._indexer = asyncio.create_task(self._index_in_background())

    async def close(self) -> None:
        indexer, self._indexer = getattr(self, "_indexer", None), None
        if indexer is not None:
            indexer.cancel()
            await asyncio.gather(indexer, return_exceptions=True)
        await super().close()

    # -- files
    async def put_file(self, info: FileInfo, content: bytes) -> None:
        async with self._r.pipeline(transaction=True) as p:  # both keys expire with the file (EXAT)
            p.set(self.k("file", info.id), dumps(asdict(info)), exat=info.expires_at)
            p.set(self.k("file", info.id, "content"), content, exat=info.expires_at)
            self._list_file(p, info)
            await p.execute()

    def _list_file(self, p, info: FileInfo) -> None:
        p.zadd(self.k("files"), {info.id: info.created_at})
        p.zadd(self.k("files", info.owner), {info.id: info.created_at})
        if info.expires_at is not None:
            p.zadd(self.k("files", "expiry"), {f"{info.id} {info.owner}": info.expires_at})

    def _unlist_file(self, p, file_id: str, owner: str) -> None:
        p.zrem(self.k("files"), file_id)
        p.zrem(self.k("files", owner), file_id)
        p.zrem(self.k("files", "expiry"), f"{file_id} {owner}")

    async def get_file(self, file_id: str) -> FileInfo | None:
        raw = await self._r.get(self.k("file", file_id))
        info = FileInfo(**json.loads(raw)) if raw else None
        return None if info is None or info.expired(time.time()) else info

    async def file_content(self, file_id: str) -> bytes | None:
        return None if await self.get_file(file_id) is None else await self._r.get(self.k("file", file_id, "content"))

    async def delete_file(self, file_id: str) -> bool:
        raw = await self._r.get(self.k("file", file_id))
        async with self._r.pipeline(transaction=True) as p:
            p.delete(self.k("file", file_id), self.k("file", file_id, "content"))
            if raw:
                self._unlist_file(p, file_id, json.loads(raw)["owner"])
            deleted, *_ = await p.execute()
        return deleted > 0

    async def list_files(self, owner: str | None, purpose: str | None, after: str | None, limit: int,
                         ascending: bool) -> list[FileInfo] | None:
        index = self.k("files", owner) if owner is not None else self.k("files")
        cursor = None
        if after is not None:
            score = await self._r.zscore(index, after)
            if score is None or await self.get_file(after) is None:
                return None
            cursor = (score, after.encode())
        found: list[FileInfo] = []
        gone: list[bytes] = []
        now = time.time()
        while len(found) < limit:
            # past the last one read, by (created_at, id) as SQLite orders them: not by rank, which the
            # files listed or unlisted meanwhile move (the page then repeated some and skipped others)
            page = await keyset_page(self._r, index, cursor, max(limit - len(found), 100), not ascending)
            if not page:
                break
            ids = [file_id for file_id, _ in page]
            for file_id, raw in zip(ids, await self._r.mget([self.k("file", i.decode()) for i in ids])):
                info = FileInfo(**json.loads(raw)) if raw else None
                if info is None:
                    gone.append(file_id)  # expired (Redis deleted its keys) or deleted mid-listing
                elif not info.expired(now) and purpose in (None, info.purpose):
                    found.append(info)
            last, score = page[-1]
            cursor = (score, last)
        if gone:
            await self._r.zrem(index, *gone)
        return found[:limit]

    async def delete_expired_files(self, now: float) -> list[str]:
        """Redis deletes each file's keys at its ``expires_at``; this drops them from the listings."""
        due = await self._r.zrangebyscore(self.k("files", "expiry"), "-inf", now)
        if not due:
            return []
        gone = []
        async with self._r.pipeline(transaction=True) as p:
            for member in due:
                file_id, owner = member.decode().split(" ", 1)
                self._unlist_file(p, file_id, owner)
                gone.append(file_id)
            await p.execute()
        return gone

    async def _index_in_background(self) -> None:
        try:
            listed = await self.index_old_files()
        except Exception as exc:  # noqa: BLE001 - Redis down: the next start tries again
            log.warning("batch store: listing the files from before the listings failed: %s", exc)
        else:
            if listed:
                log.info("batch store: %d files from before the listings are now listed", listed)

    async def index_old_files(self) -> int:
        """Put the files written before there were listings in them; how many. One pass of SCAN
        over this prefix's files, once per Redis (``files:indexed`` marks it done)."""
        if await self._r.exists(self.k("files", "indexed")):
            return 0
        listed = 0
        async for key in self._r.scan_iter(match=self.k("file", "*"), count=500):
            honour_cancel()
            if key.endswith(b":content"):
                continue
            raw = await self._r.get(key)
            if not raw:  # deleted or expired meanwhile
                continue
            info = FileInfo(**json.loads(raw))
            async with self._r.pipeline(transaction=True) as p:
                self._list_file(p, info)
                await p.execute()
            listed += 1
        await self._r.set(self.k("files", "indexed"), 1)
        return listed

    # -- batches
    def _batch_keys(self, batch_id: str) -> list[str]:
        return [self.k("batch", batch_id), self.k("batch", batch_id, "lines"), self.k("batch", batch_id, "outcomes")]

    async def create_batch(self, batch: BatchInfo) -> None:
        mapping = {"doc": dumps(batch.static()), "status": batch.status, "total": batch.total,
                   "completed": batch.completed, "failed": batch.failed}
        mapping.update({k: dumps(v) for k, v in batch.fields.items()})
        async with self._r.pipeline(transaction=True) as p:
            p.hset(self.k("batch", batch.id), mapping=mapping)
            p.zadd(self.k("batches"), {batch.id: 0})
            p.zadd(self.k("batches", batch.owner), {batch.id: 0})
            p.sadd(self.k("open"), batch.id)
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
        return self._batch(await self._r.hgetall(self.k("batch", batch_id)))

    async def list_batches(self, owner: str | None, after: str | None, limit: int) -> list[BatchInfo]:
        index = self.k("batches", owner) if owner is not None else self.k("batches")
        ids = await self._r.zrevrangebylex(index, f"({after}" if after else "+", "-", start=0, num=limit)
        async with self._r.pipeline(transaction=False) as p:
            for i in ids:
                p.hgetall(self.k("batch", i.decode()))
            rows = await p.execute()
        return [b for b in map(self._batch, rows) if b is not None]

    async def delete_batch(self, batch_id: str) -> bool:
        batch = await self.get_batch(batch_id)
        if batch is None or batch.status not in TERMINAL:  # (an ended batch never changes again)
            return False
        async with self._r.pipeline(transaction=True) as p:
            p.delete(*self._batch_keys(batch_id))
            p.zrem(self.k("batches"), batch_id)
            p.zrem(self.k("batches", batch.owner), batch_id)
            p.srem(self.k("open"), batch_id)
            deleted, *_ = await p.execute()
        return deleted > 0

    async def open_batches(self) -> list[str]:
        return sorted(i.decode() for i in await self._r.smembers(self.k("open")))

    async def start(self, batch_id: str, lines: list[Line], invalid: list[Outcome], now: int) -> bool:
        queued, failed = await asyncio.to_thread(_start_args, lines, invalid)  # (a big batch's: seconds of JSON)
        keys = [*self._batch_keys(batch_id), self.k("shapes"), self.k("shapes", "seq"),
                self.k("batch", batch_id, "spans")]
        return bool(await self._start(keys=keys, args=[now, batch_id, self.backlog, queued, failed]))

    async def set_status(self, batch_id: str, allowed: Iterable[str], status: str, along: Along | None = None,
                         **fields: Any) -> bool:
        check_fields(fields)
        allowed = list(allowed)
        args: list[Any] = [batch_id, status, self.backlog, GROUP, along_json(along), len(allowed), *allowed]
        for k, v in fields.items():
            args += [k, dumps(v)]
        keys = [*self._batch_keys(batch_id), self.k("open"), self.k("batch", batch_id, "lock"),
                self.k("batch", batch_id, "spans")]
        return bool(await self._set_status(keys=keys, args=args))

    async def lock(self, batch_id: str, holder: str, ttl_s: float) -> bool:
        key = self.k("batch", batch_id, "lock")
        if await self._r.set(key, holder, nx=True, px=int(ttl_s * 1000)):
            return True
        if (await self._r.get(key) or b"").decode() == holder:  # ours: renew
            return bool(await self._r.set(key, holder, xx=True, px=int(ttl_s * 1000)))
        return False

    async def unlock(self, batch_id: str, holder: str) -> None:
        await self._unlock(keys=[self.k("batch", batch_id, "lock")], args=[holder])

    # -- backlog and outcomes
    async def claim(self, consumer: str, count: int, reclaim_after_s: float, shape: str | None = None) -> list[Job]:
        jobs: list[Job] = []
        for one in [shape] if shape is not None else await self.shapes(reclaim_after_s):
            if len(jobs) >= count:
                break
            jobs += await self._claim_shape(consumer, count - len(jobs), reclaim_after_s, one)
        return jobs

    async def shapes(self, reclaim_after_s: float) -> list[str]:
        return [s.decode() for s in await self._shapes(keys=[self.k("shapes")], args=[self.backlog])]

    async def _claim_shape(self, consumer: str, count: int, reclaim_after_s: float, shape: str) -> list[Job]:
        jobs: list[Job] = []
        while len(jobs) < count:  # entries dropped make room for the next ones, rather than a poll's wait
            got, dropped = await self._claim_some(consumer, count - len(jobs), reclaim_after_s, shape)
            jobs += got
            if not dropped:
                break
        return jobs

    async def _claim_some(self, consumer: str, count: int, reclaim_after_s: float,
                          shape: str) -> tuple[list[Job], int]:
        """Up to ``count`` jobs of ``shape``, and how many entries were dropped instead."""
        from redis.exceptions import ResponseError

        stream = self.backlog + shape
        try:  # entries whose consumer went silent first, with how often each has been handed out
            _, stale, _ = await self._r.xautoclaim(stream, GROUP, consumer, int(reclaim_after_s * 1000),
                                                   start_id="0-0", count=count)
        except ResponseError as exc:
            if "NOGROUP" in str(exc):  # no work of this shape was ever started
                return [], 0
            raise
        deliveries = {}
        for entry_id, _ in stale:
            info = await self._r.xpending_range(stream, GROUP, entry_id, entry_id, 1)
            deliveries[entry_id] = info[0]["times_delivered"] if info else 1
        entries = list(stale)
        if len(entries) < count:
            fresh = await self._r.xreadgroup(GROUP, consumer, {stream: ">"}, count=count - len(entries))
            for _, got in fresh or []:
                entries += got
        jobs, dropped = [], 0
        for entry_id, data in entries:
            token = f"{entry_id.decode()} {shape}"
            if not data:  # deleted while pending
                await self._drop(token)
                dropped += 1
                continue
            batch_id, idx = data[b"b"].decode(), int(data[b"i"])
            async with self._r.pipeline(transaction=False) as p:
                p.hget(self.k("batch", batch_id, "lines"), idx)
                p.hexists(self.k("batch", batch_id, "outcomes"), idx)
                raw, done = await p.execute()
            if raw is None or done:  # its batch has ended, or it was filled (cancel, expiry)
                await self._drop(token)
                dropped += 1
                continue
            jobs.append(Job(batch_id, line_of(idx, raw, shape), token, deliveries.get(entry_id, 1)))
        return jobs, dropped

    def _entry(self, token: str) -> tuple[str, str]:
        """(stream, entry id) of a job's token."""
        entry_id, shape = token.split(" ", 1)
        return self.backlog + shape, entry_id

    async def _drop(self, token: str) -> None:
        stream, entry_id = self._entry(token)
        async with self._r.pipeline(transaction=True) as p:
            p.xack(stream, GROUP, entry_id)
            p.xdel(stream, entry_id)
            await p.execute()

    async def touch(self, consumer: str, jobs: Iterable[Job]) -> None:
        by_stream: dict[str, list[str]] = {}
        for j in jobs:
            stream, entry_id = self._entry(j.token)
            by_stream.setdefault(stream, []).append(entry_id)
        for stream, ids in by_stream.items():
            await self._r.xclaim(stream, GROUP, consumer, 0, ids, justid=True)

    async def release(self, consumer: str, jobs: Iterable[Job]) -> None:
        for j in jobs:  # idle "forever": the next claim takes it; this delivery does not count
            stream, entry_id = self._entry(j.token)
            await self._r.xclaim(stream, GROUP, consumer, 0, [entry_id], idle=_FAR_PAST_MS,
                                 retrycount=max(j.deliveries - 1, 0), justid=True)

    async def ack(self, job: Job) -> None:
        await self._drop(job.token)

    async def _add(self, batch_id: str, token: str, outcomes: list[Outcome]) -> list[int]:
        stream, entry_id = self._entry(token) if token else (self.backlog, "")
        args: list[Any] = [GROUP, entry_id]
        for o in outcomes:
            args += [o.index, int(o.ok), outcome_json(o)]
        keys = [self.k("batch", batch_id), self.k("batch", batch_id, "outcomes"), stream]
        return await self._record(keys=keys, args=args)

    async def record(self, job: Job, outcome: Outcome) -> Recorded:
        added, done, total = await self._add(job.batch_id, job.token, [outcome])
        return Recorded(bool(added), done, total)

    async def fill(self, batch_id: str, make: Callable[[Line], Outcome], held_s: float = 0.0) -> int:
        """A page of lines at a time (atomic per line, which is what ``claim`` needs), each page's
        outcomes made in a thread: a big batch's fill, repeated while lines are held, never holds
        the event loop for long."""
        keys = [self.k("batch", batch_id), self.k("batch", batch_id, "outcomes"), self.k("shapes")]
        scanned = [self.k("batch", batch_id, "lines"), self.k("batch", batch_id, "outcomes")]
        added, cursor = 0, 0
        while True:
            cursor, *found = await self._missing(keys=scanned, args=[cursor, PAGE])
            if found:
                outcomes = await asyncio.to_thread(_fill_args, found, make)
                args = [GROUP, self.backlog, batch_id, int(held_s * 1000), *outcomes]
                added += await self._fill(keys=keys, args=args)
            if int(cursor) == 0:
                return added

    async def outcomes(self, batch_id: str) -> list[Outcome]:
        key, raw, cursor = self.k("batch", batch_id, "outcomes"), {}, 0
        while True:  # a page at a time: one reply of a big batch's outcomes would hold the event loop
            cursor, page = await self._r.hscan(key, cursor, count=PAGE)
            raw.update(page)  # (a scan may return a field twice)
            if cursor == 0:
                break
        return await asyncio.to_thread(  # (a big batch's: parsed off the event loop)
            lambda: sorted((outcome_of(int(i), v) for i, v in raw.items()), key=lambda o: o.index))


def _start_args(lines: list[Line], invalid: list[Outcome]) -> tuple[bytes, bytes]:
    """The start script's lines ([idx, shape, line]) and invalid outcomes ([idx, outcome]), as JSON."""
    def blob(rows: Iterable[list[str]]) -> bytes:  # a row at a time: one dumps of them all would hold the GIL
        return ("[" + ",".join(json.dumps(row, ensure_ascii=False, separators=(",", ":")) for row in rows)
                + "]").encode()

    return (blob([str(ln.index), ln.shape, line_json(ln)] for ln in lines),
            blob([str(o.index), outcome_json(o)] for o in invalid))


def _fill_args(found: list[bytes], make: Callable[[Line], Outcome]) -> list[Any]:
    """The fill script's (idx, ok, outcome) for ``found``'s lines (idx, line, ...) that have no outcome."""
    args: list[Any] = []
    for k in range(0, len(found), 2):
        o = make(line_of(int(found[k]), found[k + 1]))
        args += [o.index, int(o.ok), outcome_json(o)]
    return args
