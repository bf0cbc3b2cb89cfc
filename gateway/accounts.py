"""Accounts in the gateway: managed keys beside the environment's, per-key limits at admission,
and usage metered per request (see docs/ACCOUNTS.md).

:class:`Accounts` keeps a copy of every managed key in this process, refreshed from the store
every ``accounts.refresh_s`` (0.5 s by default) by asking only for what changed since the last
refresh, so a key is looked up without I/O and a revoke or a change reaches every process within
a second. The store is the one the Batch API uses (``batch.store``): SQLite beside its file, or
the same Redis.

Every model request, HTTP or batch line, runs in ``gateway.serving.Serving``, which calls
:meth:`Accounts.admit` before it takes a slot and :meth:`Accounts.finish` when it ends, before its
last byte is sent: the model allow-list (404, as if the model did not exist), the key's limits
(429, from the limiter, atomic across processes on Redis), then the usage record, written and
durable before the response ends. Batch lines are metered at the batch tier but not limited:
their key's limits were applied when the batch was created, and batch work only runs on an idle
GPU anyway. A batch line's caller carries its metering ids (``gateway.auth.Metering``), which the
usage write passes on, so the store counts a line once however often it runs: the first
delivery's usage is the one kept. HTTP requests have none.

A usage write the store fails (Redis down, a full disk under the journal) is kept in this process
(:class:`Unwritten`) under a metering id of its own, and so is every row after it until the store
takes them back: the refresh loop writes them again once the store answers, before any usage read
and at shutdown. The id makes a kept row count once however often it is written again; an HTTP
request's first write has none, so one that Redis ran before its answer was lost (a timeout) counts
twice. Past ``UNWRITTEN_MAX`` rows the newest are dropped and counted
(``tiergate_usage_dropped_total``), as is what is still kept when the process stops.

A request's settle the store fails (its slot of ``concurrent`` and what it held of the daily
budget stay in Redis for ``INFLIGHT_TTL_S`` else) is kept too, and its holds are given back by the
refresh loop once the store answers and the kept usage is written (not the buckets' correction by
what the request used: a settle that timed out may have run).
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import json
import logging
import math
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from accounts.config import Limits, Price, resolved_price
from accounts.keys import PREFIX, KeyRecord, make_key, secret_hash
from accounts.rates import Ask, Bucket, Limiter, Verdict, too_large, utc_day
from accounts.redis_store import RedisAccounts
from accounts.sqlite_store import SQLiteAccounts
from accounts.store import STORE_ERRORS, AccountStore
from accounts.usage import Usage
from gateway.auth import Caller, RateState
from gateway.config import Config
from gateway.errors import APIError, store_unavailable
from storage.outage import Outage
from storage.redis import honour_cancel

log = logging.getLogger("tiergate.accounts")
UNWRITTEN_MAX = 100_000  # usage rows kept while the store fails (a few hundred bytes each); more are dropped
WRITE_AGAIN_CHUNK = 256  # kept rows written at once
STOP_WRITE_S = 5.0  # at shutdown, the last try to write the kept rows
KEEP_ERRORS = (*STORE_ERRORS, OSError)  # a store that failed a write (OSError: the SQLite journal's file; timeouts)
UNSETTLED_MAX = 10_000  # settles kept while the store fails; past it the oldest go (their holds run out alone)


def store_for(config: Config) -> AccountStore:
    """The account store beside the Batch API's (same ``batch.store``, same data folder)."""
    cfg = config.batch
    if cfg.store.startswith(("redis://", "rediss://")):
        return RedisAccounts(cfg.store)
    data_dir = config.data_dir()
    return SQLiteAccounts(data_dir / "accounts.sqlite3")


def estimate_tokens(messages: list[dict]) -> int:
    """A prompt's tokens before it is encoded, as OpenAI estimates them for its limits: about four
    characters a token. The bucket is corrected with the true count when the request ends."""
    return math.ceil(len(json.dumps(messages, ensure_ascii=False)) / 4)


@dataclass
class Admission:
    """One request's hold on its key's limits: what it asked, to correct when it ends."""

    key: str
    limits: Limits
    ask: Ask
    request_id: str = field(default_factory=lambda: uuid.uuid4().hex)


@dataclass(frozen=True)
class KeptRow:
    """A usage write the store failed, kept to write again under ``metering_id``."""

    day: str
    key: str
    model: str
    tier: str
    usage: Usage
    metering_id: str


class Accounts:
    def __init__(self, config: Config, store: AccountStore) -> None:
        self.tier_limits = config.accounts.limits
        self.tiers = config.tier_names
        self.prices: dict[str, Price | None] = {t: resolved_price(config.prices, t) for t in self.tiers}
        self.refresh_s = config.accounts.refresh_s
        self.store = store
        self.limiter: Limiter = store.limiter()
        self._by_hash: dict[str, KeyRecord] = {}
        self._by_id: dict[str, KeyRecord] = {}
        self._limits: dict[str, tuple[KeyRecord, Limits]] = {}  # a managed key's limits, while its record is current
        self._version = 0
        self._loop: asyncio.Task | None = None
        self.record_s: collections.deque[float] = collections.deque(maxlen=1000)  # recent usage writes' times
        self.unwritten: collections.deque[KeptRow] = collections.deque()  # oldest first, written again in order
        self.dropped = 0  # rows past UNWRITTEN_MAX, lost
        self._writing_again: asyncio.Task | None = None
        self.unsettled: collections.deque[Admission] = collections.deque(maxlen=UNSETTLED_MAX)

    @classmethod
    def from_config(cls, config: Config) -> "Accounts":
        return cls(config, store_for(config))

    async def start(self) -> None:
        await self.store.open()
        await self.refresh()
        self._loop = asyncio.create_task(self._refresh_loop(), name="accounts-refresh")

    async def stop(self) -> None:
        if self._loop is not None:
            self._loop.cancel()
            await asyncio.gather(self._loop, return_exceptions=True)
        if self.unwritten:  # a last try; what the store still refuses is lost, and the log says whose
            try:
                async with asyncio.timeout(STOP_WRITE_S):
                    await self.write_again()
            except TimeoutError:
                assert self._writing_again is not None
                self._writing_again.cancel()
                await asyncio.gather(self._writing_again, return_exceptions=True)
            self._lose_unwritten()
        await self.limiter.close()
        await self.store.close()

    async def refresh(self) -> None:
        records, version = await self.store.keys_since(self._version)
        if version < self._version:
            # the store's change counter went back: it lost changes this process saw (a Redis
            # restarted empty or from an older snapshot, a file restored from a backup), and the
            # keys made since have versions this process thinks it has seen. What the store holds
            # is all there is: read every key again, and forget those it no longer has (no list
            # shows them and no revoke reaches them)
            log.warning("accounts: the store's key changes went back from %d to %d (a store restarted empty or "
                        "restored): reading every managed key again", self._version, version)
            records, version = await self.store.keys_since(0)
            self._by_id, self._by_hash, self._limits = {}, {}, {}
        self._version = version
        for r in records:
            self._learn(r)

    def _learn(self, record: KeyRecord) -> None:
        old = self._by_id.get(record.id)
        if old is not None and old.version > record.version:
            return
        self._by_id[record.id] = record
        self._by_hash[record.hash] = record

    async def _refresh_loop(self) -> None:
        outage = Outage(log, "accounts: refreshing managed keys")  # a store down: one line, not one per turn
        while True:
            honour_cancel()  # a cancel the store's client swallowed (storage.redis)
            await asyncio.sleep(self.refresh_s)
            try:
                await self.refresh()
            except Exception as exc:  # noqa: BLE001 - the store is down: keep what we know, try again
                outage.failed(exc)
            else:
                outage.answered()
                if self.unwritten:  # it answers again: the usage kept meanwhile goes in
                    await self.write_again()
                if self.unsettled and not self.unwritten:  # then the holds go (no moment counts neither)
                    await self._settle_again()

    # -- usage kept while the store fails
    async def _record(self, day: str, key: str, model: str, tier: str, usage: Usage, metering_id: str | None) -> None:
        """A request's usage into the store, durable on return; kept in this process instead when
        the store fails it, or while rows kept before it still wait (so no request waits on a
        store that is down, and the rows go in in order)."""
        if self.unwritten:
            self._keep(KeptRow(day, key, model, tier, usage, metering_id or _kept_id()))
            return
        try:
            await self.store.record(day, key, model, tier, usage, metering_id)
        except KEEP_ERRORS as exc:  # the store failed it: kept, written again when it answers
            log.error("usage of a request on %s could not be written, kept to write again: %r", model, exc)
            self._keep(KeptRow(day, key, model, tier, usage, metering_id or _kept_id()))
        except asyncio.CancelledError:  # this task's own cancel (a shutdown cutting it: it ends right after)
            # or a group commit the store cancelled. A row with a metering id is kept (it counts
            # once however often it lands); one without most likely landed (Redis runs a script in
            # well under a millisecond; on SQLite it was in the journal before the await), and is
            # not kept, so it does not count twice
            if metering_id is not None:
                self._keep(KeptRow(day, key, model, tier, usage, metering_id))
            else:
                log.error("usage of a request on %s was cut while it was written", model)
        except Exception as exc:  # noqa: BLE001 - not the store's failure: writing it again would fail again
            log.error("usage of a request on %s could not be written: %r", model, exc)

    def _keep(self, row: KeptRow) -> None:
        if len(self.unwritten) >= UNWRITTEN_MAX:
            self.dropped += 1
            if self.dropped in (1, 10, 100) or self.dropped % 1000 == 0:
                log.error("usage kept while the store fails is over %d rows: %d dropped so far", UNWRITTEN_MAX,
                          self.dropped)
            return
        self.unwritten.append(row)

    async def write_again(self) -> None:
        """Write the usage kept while the store failed, oldest first, each under its metering id
        (a row that lands twice counts once); rows the store still fails stay kept, in order.
        Concurrent callers share one pass."""
        if self._writing_again is None or self._writing_again.done():
            self._writing_again = asyncio.create_task(self._write_kept(), name="accounts-write-again")
        await asyncio.shield(self._writing_again)

    async def _write_kept(self) -> None:
        written = 0
        while self.unwritten:
            chunk = [self.unwritten.popleft() for _ in range(min(WRITE_AGAIN_CHUNK, len(self.unwritten)))]
            try:
                results = await asyncio.gather(*(self.store.record(r.day, r.key, r.model, r.tier, r.usage,
                                                                   r.metering_id) for r in chunk), return_exceptions=True)
            except asyncio.CancelledError:  # stop's time ran out: the chunk is kept again, in order
                self.unwritten.extendleft(reversed(chunk))
                raise
            again = (*KEEP_ERRORS, asyncio.CancelledError)  # (a group commit the store cancelled: kept too)
            failed = [r for r, result in zip(chunk, results) if isinstance(result, again)]
            for r, result in zip(chunk, results):
                if isinstance(result, BaseException) and not isinstance(result, again):  # not the store's
                    self.dropped += 1  # failure: trying again would fail again, and hold up every row after it
                    log.error("usage of a request on %s could not be written: %r", r.model, result)
            written += sum(not isinstance(result, BaseException) for result in results)
            if failed:
                self.unwritten.extendleft(reversed(failed))
                log.warning("usage kept while the store failed: %d rows written, %d still wait (%r)", written,
                            len(self.unwritten), next(r for r in results if isinstance(r, again)))
                return
        log.info("usage kept while the store failed: %d rows written", written)

    async def _settle_again(self) -> None:
        """Settle the requests whose settle the store failed, oldest first; those it still fails
        wait for the next pass. Only their holds go (the slot of ``concurrent``, the budget held):
        the buckets' correction by ``used - asked`` is left out, since a settle that timed out may
        have run, and a second correction would give the key back twice what it did not use (left
        out, it is charged what it asked for, for at most the bucket's minute)."""
        while self.unsettled:
            held = self.unsettled.popleft()
            try:
                await self.limiter.settle(held.key, held.limits, held.ask, held.ask, held.request_id)
            except KEEP_ERRORS:
                self.unsettled.appendleft(held)
                return
            except Exception as exc:  # noqa: BLE001 - not the store's failure: it would fail again
                log.error("the limits of key %s could not be settled: %r", held.key, exc)

    def _lose_unwritten(self) -> None:
        """At shutdown, with the store still failing: the kept usage is lost; the log keeps its sums
        per key, model, tier and day, to bill by hand."""
        if not self.unwritten:
            return
        sums: dict[tuple[str, str, str, str], Usage] = {}
        for r in self.unwritten:
            sums.setdefault((r.day, r.key, r.model, r.tier), Usage()).add(r.usage)
        log.error("usage of %d requests could not be written before shutdown and is lost: %s", len(self.unwritten),
                  json.dumps([{"day": d, "key": k, "model": m, "tier": t, **{n: v for n, v in vars(u).items() if v}}
                              for (d, k, m, t), u in sorted(sums.items())]))
        self.dropped += len(self.unwritten)
        self.unwritten.clear()

    def collect(self):
        """The metrics registry's view: usage kept in this process, and usage lost."""
        yield GaugeMetricFamily("tiergate_usage_unwritten",
                                "Usage rows kept in this process while the store fails, to write again",
                                value=len(self.unwritten))
        yield CounterMetricFamily("tiergate_usage_dropped", "Usage rows lost: past the kept rows' cap, or at "
                                  "shutdown with the store still failing", value=self.dropped)

    # -- keys
    def lookup(self, token: str) -> Caller | None:
        """The caller of a managed key's secret, or None (unknown or revoked)."""
        if not token.startswith(PREFIX):
            return None
        record = self._by_hash.get(secret_hash(token))
        if record is None or not record.active:
            return None
        return Caller(tier=record.tier, key_id=record.id)

    def current(self, key_id: str) -> Caller | None:
        """The caller of the managed key ``key_id`` as its record stands now (its tier), or None
        (unknown or revoked)."""
        record = self._by_id.get(key_id)
        return Caller(tier=record.tier, key_id=record.id) if record is not None and record.active else None

    def for_http(self, caller: Caller) -> Caller:
        """The caller of one HTTP request, with the holder its rate-limit headers go in. A key
        without a requests or tokens minute limit has no such headers: its holder starts empty, so
        its response does not look them up."""
        limits = self.limits(caller.key_id, caller.tier)
        headers = None if limits.requests_per_min or limits.tokens_per_min else {}
        return Caller(caller.tier, caller.key_id, caller.admin, RateState(headers))

    def limits(self, key_id: str, tier: str) -> Limits:
        """A key's limits: its tier's defaults with the key's own on top (worked out once per
        version of a managed key's record)."""
        record = self._by_id.get(key_id)
        if record is None:
            return self.tier_limits.get(tier, _NO_LIMITS)
        known = self._limits.get(key_id)
        if known is not None and known[0] is record:
            return known[1]
        limits = self.tier_limits.get(record.tier, Limits()).over(record.limits)
        if record.models is not None:
            limits = limits.model_copy(update={"models": record.models})
        if record.adapters is not None:
            limits = limits.model_copy(update={"adapters": record.adapters})
        self._limits[key_id] = (record, limits)
        return limits

    def allows(self, caller: Caller, model: str) -> bool:
        allowed = self.limits(caller.key_id, caller.tier).models
        return allowed is None or model in allowed

    def allows_adapter(self, caller: Caller, adapter: str) -> bool:
        return self.limits(caller.key_id, caller.tier).allows_adapter(adapter)

    async def create_key(self, name: str, tier: str, limits: dict[str, Any], models: tuple[str, ...] | None,
                         adapters: tuple[str, ...] | None = None) -> tuple[KeyRecord, str]:
        record, secret = make_key(name, tier, limits, models, adapters)
        record = await self.store.create_key(record)
        self._learn(record)
        return record, secret

    async def update_key(self, key_id: str, **changes: Any) -> KeyRecord | None:
        record = await self.store.update_key(key_id, **changes)
        if record is not None:
            self._learn(record)
        return record

    # -- requests
    async def admit(self, caller: Caller, model: str, ask: Ask, adapters: tuple[str, ...] = (),
                    own_adapter: bool = False, gpu_s: Callable[[], float] = lambda: 0.0,
                    within: bool = False) -> Admission | None:
        """Before a request takes a slot: 404 for a model, or an adapter of its stack, outside the
        key's allow-lists (as for one that does not exist); for HTTP requests, 429 over a limit.
        ``gpu_s``: the request's GPU-seconds as estimated now, which it holds of a daily budget
        while in flight. ``within``: a step of a request already admitted (a reply's speech, said
        while the reply is written), which its ``concurrent`` count covers: neither refused by
        that limit nor counted against it (its other limits as any request's). Returns the hold
        to give back in ``finish`` (None: nothing held)."""
        limits = self.limits(caller.key_id, caller.tier)
        if within and limits.concurrent is not None:
            limits = limits.over({"concurrent": None})
        if limits.models is not None and model not in limits.models:
            raise APIError(404, f"the model '{model}' does not exist", "model_not_found", "model")
        for i, adapter in enumerate(adapters):  # refused as the registry refuses one that does not exist
            if not limits.allows_adapter(adapter):
                if i == 0 and own_adapter:
                    raise APIError(404, f"the model '{adapter}' does not exist", "model_not_found", "model")
                raise APIError(404, f"the adapter '{adapter}' does not exist", "adapter_not_found", "adapters")
        if caller.rate is None or not limits.limited:
            return None
        spent = 0.0
        if limits.gpu_seconds_per_day is not None:
            ask = dataclasses.replace(ask, gpu_seconds=gpu_s())
        held = Admission(caller.key_id, limits, ask)
        if (too_big := too_large(limits, ask)) is not None:  # whatever the buckets hold: asks the store nothing
            raise refused(too_big)
        try:
            if limits.gpu_seconds_per_day is not None and not self.store.shares_limits:
                spent = await self._gpu_spent(caller.key_id)
            verdict = await self.limiter.admit(caller.key_id, limits, ask, spent, held.request_id)
            if not verdict.ok:
                caller.rate.headers = rate_headers(await self.limiter.peek(caller.key_id, limits))
        except STORE_ERRORS as exc:  # its limits cannot be checked: refused, nothing spent
            log.warning("the limits of key %s could not be checked: %r", caller.key_id, exc)
            raise store_unavailable() from exc
        if not verdict.ok:
            raise refused(verdict)
        caller.rate.headers = rate_headers(verdict.buckets)
        return held

    async def _gpu_spent(self, key: str) -> float:
        """Today's GPU-seconds of ``key`` as the store has them, for this process's limiter; plus
        what its requests that ended while the store was read held: their usage may have been
        written just after the read, and they no longer hold anything (counted twice at worst)."""
        before = self.limiter.held_gpu(key)
        spent = await self.store.gpu_spent(key, utc_day(time.time()))
        now = self.limiter.held_gpu(key)
        return spent + sum(gpu_s for request_id, gpu_s in before.items() if request_id not in now)

    async def finish(self, caller: Caller, model: str, held: Admission | None, usage: Usage | None) -> None:
        """After a request: correct its key's buckets by what it used (``usage`` None: it never
        ran, and only the request itself still counts) and write its usage, durable on return
        (a batch line's under its next metering id, counted once)."""
        start = time.perf_counter()
        metering_id = caller.metering.next_id() if caller.metering is not None and usage is not None else None
        if held is None:  # the common case (a key without limits): the row alone, no task for gather
            if usage is not None:
                await self._record(utc_day(time.time()), caller.key_id, model, caller.tier, usage, metering_id)
        else:
            writes = []
            if usage is not None:
                writes.append(self._record(utc_day(time.time()), caller.key_id, model, caller.tier, usage,
                                           metering_id))
            used = Ask() if usage is None else Ask(
                1.0, usage.input_tokens + usage.output_tokens + usage.embedding_tokens, usage.images,
                usage.audio_in_seconds + usage.audio_out_seconds)
            settle = self.limiter.settle(held.key, held.limits, held.ask, used, held.request_id)
            if held.limits.gpu_seconds_per_day is not None and writes:
                # what it holds of the budget goes only once its usage is written: no moment counts neither
                results = [*await asyncio.gather(*writes, return_exceptions=True),
                           *await asyncio.gather(settle, return_exceptions=True)]
            else:
                results = await asyncio.gather(*writes, settle, return_exceptions=True)
            *written, settled = results
            for result in written:
                if isinstance(result, BaseException):
                    log.error("usage of a request on %s could not be written: %r", model, result)
            if isinstance(settled, KEEP_ERRORS):  # else its slot and holds stay in the store for INFLIGHT_TTL_S
                log.warning("the limits of key %s could not be settled, settled again when the store answers: %r",
                            held.key, settled)
                self.unsettled.append(held)
            elif isinstance(settled, BaseException):
                log.error("the limits of key %s could not be settled: %r", held.key, settled)
        self.record_s.append(time.perf_counter() - start)

    async def headers(self, caller: Caller) -> dict[str, str]:
        """The key's rate-limit headers as they stand now (for responses that spent nothing; none
        while the store does not answer)."""
        return rate_headers(await self.buckets(caller))

    async def buckets(self, caller: Caller) -> dict[str, Bucket]:
        """The key's ``requests`` and ``tokens`` per-minute buckets as they stand now, those it has
        (none while the store does not answer): what its ``x-ratelimit-*`` headers say."""
        limits = self.limits(caller.key_id, caller.tier)
        if not (limits.requests_per_min or limits.tokens_per_min):
            return {}
        try:
            buckets = await self.limiter.peek(caller.key_id, limits)
        except STORE_ERRORS:  # what asked is decided already: it goes without them
            return {}
        return {dim: buckets[dim] for dim in ("requests", "tokens") if dim in buckets}


_NO_LIMITS = Limits()


def _kept_id() -> str:
    """The metering id of an HTTP request's usage kept to write again (its first write had none)."""
    return f"kept:{uuid.uuid4().hex}"


def refused(verdict: Verdict) -> APIError:
    if verdict.never:  # no wait helps: no Retry-After to honour, and the SDKs must not retry it
        return APIError(429, verdict.message, "rate_limit_exceeded", headers={"x-should-retry": "false"},
                        type="rate_limit_error")
    seconds = max(1, math.ceil(verdict.retry_after_s))  # a budget's wait (until 00:00 UTC) may be hours
    headers = {"retry-after": str(seconds), "retry-after-ms": str(int(verdict.retry_after_s * 1000))}
    if verdict.code == "insufficient_quota":  # waiting a little does not help: the SDK must not retry
        headers["x-should-retry"] = "false"
        return APIError(429, verdict.message, "insufficient_quota", headers=headers, type="insufficient_quota")
    return APIError(429, verdict.message, "rate_limit_exceeded", headers=headers, type="rate_limit_error")


def rate_headers(buckets: dict[str, Bucket]) -> dict[str, str]:
    """OpenAI's ``x-ratelimit-{limit,remaining,reset}-{requests,tokens}`` for the buckets set."""
    out = {}
    for dim in ("requests", "tokens"):
        b = buckets.get(dim)
        if b is not None:
            out[f"x-ratelimit-limit-{dim}"] = str(int(b.limit))
            out[f"x-ratelimit-remaining-{dim}"] = str(int(b.remaining))
            out[f"x-ratelimit-reset-{dim}"] = duration(b.reset_s)
    return out


def duration(seconds: float) -> str:
    """Seconds as OpenAI writes a reset time: ``20ms``, ``1.5s``, ``6m0s``."""
    if seconds < 1:
        return f"{int(seconds * 1000)}ms"
    minutes, rest = divmod(seconds, 60)
    if minutes:
        return f"{int(minutes)}m{int(rest)}s"
    return f"{round(rest, 3):g}s"
