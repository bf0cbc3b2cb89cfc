"""Managed keys, usage and the limit buckets in Redis (``redis://...``), shared by every process
that points at it: see ``accounts.store`` and ``accounts.rates``.

Keys (prefix ``tg:acct:``): ``key:{id}`` (hash: doc = the record as JSON, version), ``hash:{sha256}``
(-> id), ``keys`` (sorted set of ids scored by version), ``version`` (the change counter);
``u:{day}|{key}|{model}|{tier}`` (hash of usage counters) listed in ``u`` (a sorted set whose
members are those names, so a day range is a lexical range); ``gpu:{day}:{key}`` (GPU-seconds
that day, read by the admission script); ``m:{metering id}`` (a batch line's usage was counted:
set NX by the script that adds the usage, which adds nothing when it was set already; it expires
after ``METERED_KEEP_S``, two days); ``rl:{key}:{bucket}`` (a bucket's GCRA time), ``cc:{key}``
(requests in flight: a sorted set of request ids scored by when their claim lapses) and ``gh:{key}``
(what the key's requests in flight hold of its daily GPU budget: a sorted set of
``<request id> <GPU-seconds>`` scored the same way).
"""

from __future__ import annotations

import json
import time
from typing import Any

from accounts.config import Limits
from accounts.keys import KeyRecord
from accounts.rates import (Ask, Bucket, Limiter, Verdict, budget_held, bucket_after, over_budget, rates, refusal,
                            too_many_at_once, utc_day)
from accounts.store import METERED_KEEP_S, AccountStore
from accounts.usage import COUNTERS, INTEGER_COUNTERS, Usage, UsageRow
from storage.redis import RedisKeys

INFLIGHT_TTL_S = 900  # a request in flight on a process that died stops counting after this

# KEYS key, hash, keys, version; ARGV id, doc -> version, or -1 if the hash exists
_CREATE = """
if redis.call('EXISTS', KEYS[2]) == 1 then return -1 end
local v = redis.call('INCR', KEYS[4])
redis.call('HSET', KEYS[1], 'doc', ARGV[2], 'version', v)
redis.call('SET', KEYS[2], ARGV[1])
redis.call('ZADD', KEYS[3], v, ARGV[1])
return v
"""

# KEYS key, keys, version; ARGV id, the doc read, the new doc -> version, 0 if it changed meanwhile, -1 if gone
_UPDATE = """
local cur = redis.call('HGET', KEYS[1], 'doc')
if not cur then return -1 end
if cur ~= ARGV[2] then return 0 end
local v = redis.call('INCR', KEYS[3])
redis.call('HSET', KEYS[1], 'doc', ARGV[3], 'version', v)
redis.call('ZADD', KEYS[2], v, ARGV[1])
return v
"""

# KEYS row, index, gpu day[, metering id]; ARGV member, gpu seconds, (field, amount)* -> 1, or 0 when
# the metering id was counted already
_RECORD = f"""
if KEYS[4] and not redis.call('SET', KEYS[4], '1', 'NX', 'EX', {METERED_KEEP_S}) then return 0 end
for i = 3, #ARGV, 2 do redis.call('HINCRBYFLOAT', KEYS[1], ARGV[i], ARGV[i + 1]) end
redis.call('ZADD', KEYS[2], 0, ARGV[1])
redis.call('INCRBYFLOAT', KEYS[3], ARGV[2])
redis.call('EXPIRE', KEYS[3], 172800)
return 1
"""

_NOW = "local t = redis.call('TIME')\nlocal now = tonumber(t[1]) + tonumber(t[2]) / 1e6\n"

# KEYS the n buckets' times, in flight, gpu day, gpu held; ARGV n, concurrent (-1: none), budget (-1),
# request id, ttl, the GPU-seconds it holds, (limit, cost)*
# -> {'ok', now, tat...} | {'quota', spent, now} | {'held', spent, held} | {'concurrent'} | {'rate', i, wait}
_ADMIT = _NOW + """
local n = tonumber(ARGV[1])
local conc, budget = tonumber(ARGV[2]), tonumber(ARGV[3])
local held_as = ARGV[4] .. ' ' .. ARGV[6]
if budget >= 0 then
  local spent = tonumber(redis.call('GET', KEYS[n + 2]) or '0')
  if spent >= budget then return {'quota', string.format('%.17g', spent), string.format('%.17g', now)} end
  redis.call('ZREMRANGEBYSCORE', KEYS[n + 3], '-inf', now)
  local held = 0
  for _, m in ipairs(redis.call('ZRANGE', KEYS[n + 3], 0, -1)) do held = held + tonumber(string.match(m, ' (%S+)$')) end
  if spent + held >= budget then return {'held', string.format('%.17g', spent), string.format('%.17g', held)} end
end
if conc >= 0 then
  redis.call('ZREMRANGEBYSCORE', KEYS[n + 1], '-inf', now)
  if redis.call('ZCARD', KEYS[n + 1]) >= conc then return {'concurrent'} end
end
local tats = {}
for i = 1, n do
  local limit, cost = tonumber(ARGV[5 + 2 * i]), tonumber(ARGV[6 + 2 * i])
  local tat = tonumber(redis.call('GET', KEYS[i]) or '0')
  if tat < now then tat = now end
  tat = tat + cost * 60 / limit
  if tat - now > 60 + 1e-9 then return {'rate', tostring(i), string.format('%.17g', tat - 60 - now)} end
  tats[i] = tat
end
local out = {'ok', string.format('%.17g', now)}
for i = 1, n do
  redis.call('SET', KEYS[i], string.format('%.17g', tats[i]), 'PX', math.ceil((tats[i] - now) * 1000) + 1000)
  out[#out + 1] = string.format('%.17g', tats[i])
end
if conc >= 0 then redis.call('ZADD', KEYS[n + 1], now + tonumber(ARGV[5]), ARGV[4]) end
if budget >= 0 then
  redis.call('ZADD', KEYS[n + 3], now + tonumber(ARGV[5]), held_as)
  redis.call('EXPIRE', KEYS[n + 3], tonumber(ARGV[5]))
end
return out
"""

# KEYS the n buckets' times, in flight, gpu held; ARGV n, request id, (limit, used - asked)*, what it held
_SETTLE = _NOW + """
local n = tonumber(ARGV[1])
redis.call('ZREM', KEYS[n + 1], ARGV[2])
redis.call('ZREM', KEYS[n + 2], ARGV[2] .. ' ' .. ARGV[3 + 2 * n])
for i = 1, n do
  local limit, delta = tonumber(ARGV[1 + 2 * i]), tonumber(ARGV[2 + 2 * i])
  local tat = tonumber(redis.call('GET', KEYS[i]) or '0')
  if delta ~= 0 and tat > 0 then
    tat = math.max(tat + delta * 60 / limit, now)
    redis.call('SET', KEYS[i], string.format('%.17g', tat), 'PX', math.ceil((tat - now) * 1000) + 1000)
  end
end
return 1
"""

# KEYS the n buckets' times -> {now, tat...}
_PEEK = _NOW + """
local out = {string.format('%.17g', now)}
for i = 1, #KEYS do out[#out + 1] = redis.call('GET', KEYS[i]) or '0' end
return out
"""


class RedisAccounts(RedisKeys, AccountStore):
    def __init__(self, url: str, prefix: str = "tg:acct:") -> None:
        super().__init__(url, prefix)

    async def open(self) -> None:
        await super().open()
        self._create = self._r.register_script(_CREATE)
        self._update = self._r.register_script(_UPDATE)
        self._record = self._r.register_script(_RECORD)
        self.admit_script = self._r.register_script(_ADMIT)
        self.settle_script = self._r.register_script(_SETTLE)
        self.peek_script = self._r.register_script(_PEEK)

    def limiter(self) -> Limiter:
        return RedisLimiter(self)

    @property
    def shares_limits(self) -> bool:
        return True

    # -- keys
    async def create_key(self, record: KeyRecord) -> KeyRecord:
        doc = json.dumps(record.doc())
        version = await self._create(keys=[self.k("key", record.id), self.k("hash", record.hash), self.k("keys"),
                                           self.k("version")], args=[record.id, doc])
        if version < 0:
            raise ValueError("a key with this secret exists")
        return KeyRecord.of(record.doc(), int(version))

    async def _read(self, key_id: str) -> tuple[str, int] | None:
        doc, version = await self._r.hmget(self.k("key", key_id), ["doc", "version"])
        return (doc.decode(), int(version)) if doc else None

    async def get_key(self, key_id: str) -> KeyRecord | None:
        found = await self._read(key_id)
        return KeyRecord.of(json.loads(found[0]), found[1]) if found else None

    async def _many(self, ids: list[bytes]) -> list[KeyRecord]:
        async with self._r.pipeline(transaction=False) as p:
            for key_id in ids:
                p.hmget(self.k("key", key_id.decode()), ["doc", "version"])
            rows = await p.execute()
        return [KeyRecord.of(json.loads(doc), int(v)) for doc, v in rows if doc]

    async def list_keys(self) -> list[KeyRecord]:
        records = await self._many(await self._r.zrange(self.k("keys"), 0, -1))
        return sorted(records, key=lambda r: (r.created_at, r.id))

    async def update_key(self, key_id: str, **changes: Any) -> KeyRecord | None:
        while True:  # compare-and-set on the doc: a concurrent change makes us read again
            found = await self._read(key_id)
            if found is None:
                return None
            doc = json.loads(found[0])
            if doc.get("revoked_at") is not None:
                changes.pop("revoked_at", None)
            doc.update({k: (list(v) if isinstance(v, tuple) else v) for k, v in changes.items()})
            version = await self._update(keys=[self.k("key", key_id), self.k("keys"), self.k("version")],
                                         args=[key_id, found[0], json.dumps(doc)])
            if version < 0:
                return None
            if version > 0:
                return KeyRecord.of(doc, int(version))

    async def keys_since(self, version: int) -> tuple[list[KeyRecord], int]:
        latest = int(await self._r.get(self.k("version")) or 0)
        if latest <= version:  # lower when Redis went back (restarted empty or from an older snapshot)
            return [], latest
        ids = await self._r.zrangebyscore(self.k("keys"), f"({version}", latest)
        records = [r for r in await self._many(ids) if r.version > version]
        return records, max([version] + [r.version for r in records])

    # -- usage
    async def record(self, day: str, key: str, model: str, tier: str, usage: Usage,
                     metering_id: str | None = None) -> None:
        member = f"{day}|{key}|{model}|{tier}"
        args: list[Any] = [member, repr(float(usage.gpu_seconds))]
        for name in COUNTERS:
            value = getattr(usage, name)
            if value:
                args += [name, repr(float(value))]
        keys = [self.k("u", member), self.k("u"), self.k("gpu", day, key)]
        if metering_id is not None:
            keys.append(self.k("m", metering_id))
        await self._record(keys=keys, args=args)

    async def usage(self, key: str | None, model: str | None, since: str | None, until: str | None) -> list[UsageRow]:
        low = f"[{since}" if since else "-"
        high = f"[{until}|\xff" if until else "+"
        members = [m.decode() for m in await self._r.zrangebylex(self.k("u"), low, high)]
        chosen = []
        for m in members:
            day, k, mod, tier = m.split("|")
            if (key is None or k == key) and (model is None or mod == model):
                chosen.append((m, day, k, mod, tier))
        async with self._r.pipeline(transaction=False) as p:
            for m, *_ in chosen:
                p.hgetall(self.k("u", m))
            hashes = await p.execute()
        rows = []
        for (m, day, k, mod, tier), h in zip(chosen, hashes):
            u = Usage()
            for name, value in h.items():
                name = name.decode()
                if name in COUNTERS:
                    setattr(u, name, int(round(float(value))) if name in INTEGER_COUNTERS else float(value))
            rows.append(UsageRow(day, k, mod, tier, u))
        return rows

    async def gpu_spent(self, key: str, day: str) -> float:
        return float(await self._r.get(self.k("gpu", day, key)) or 0.0)


class RedisLimiter(Limiter):
    """The decision of ``accounts.rates`` as one Lua script on the shared Redis, timed by Redis's
    own clock: atomic across every process that uses it."""

    def __init__(self, store: RedisAccounts) -> None:
        self.store = store

    def _bucket_keys(self, key: str, dims: list[str]) -> list[str]:
        return [self.store.k("rl", key, dim) for dim in dims]

    async def admit(self, key: str, limits: Limits, ask: Ask, spent_gpu_s: float, request_id: str) -> Verdict:

        per_min = rates(limits)
        dims = list(per_min)
        keys = self._bucket_keys(key, dims) + [self.store.k("cc", key), self.store.k("gpu", utc_day(time.time()), key),
                                               self.store.k("gh", key)]
        args: list[Any] = [len(dims), _or_none(limits.concurrent), _or_none(limits.gpu_seconds_per_day), request_id,
                           INFLIGHT_TTL_S, repr(float(ask.gpu_seconds))]
        for dim in dims:
            args += [repr(per_min[dim]), repr(float(ask.of(dim)))]
        out = [x.decode() if isinstance(x, bytes) else x for x in await self.store.admit_script(keys=keys, args=args)]
        if out[0] == "quota":
            return over_budget(float(out[1]), limits.gpu_seconds_per_day, float(out[2]))
        if out[0] == "held":
            return budget_held(float(out[1]), float(out[2]), limits.gpu_seconds_per_day)
        if out[0] == "concurrent":
            return too_many_at_once(limits.concurrent)
        if out[0] == "rate":
            dim = dims[int(out[1]) - 1]
            return refusal(dim, per_min[dim], ask.of(dim), float(out[2]))
        now = float(out[1])
        return Verdict(True, {dim: bucket_after(float(t), now, per_min[dim]) for dim, t in zip(dims, out[2:])})

    async def settle(self, key: str, limits: Limits, asked: Ask, used: Ask, request_id: str) -> None:
        per_min = rates(limits)
        dims = list(per_min)
        args: list[Any] = [len(dims), request_id]
        for dim in dims:
            args += [repr(per_min[dim]), repr(float(used.of(dim) - asked.of(dim)))]
        args.append(repr(float(asked.gpu_seconds)))  # its member of gh, as admit wrote it
        await self.store.settle_script(keys=self._bucket_keys(key, dims) + [self.store.k("cc", key),
                                                                            self.store.k("gh", key)], args=args)

    async def peek(self, key: str, limits: Limits) -> dict[str, Bucket]:
        per_min = rates(limits)
        if not per_min:
            return {}
        dims = list(per_min)
        out = await self.store.peek_script(keys=self._bucket_keys(key, dims), args=[])
        now = float(out[0])
        return {dim: bucket_after(max(float(t), now), now, per_min[dim]) for dim, t in zip(dims, out[1:])}


def _or_none(value: float | None) -> str:
    return "-1" if value is None else repr(float(value))
