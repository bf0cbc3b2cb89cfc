"""Where managed keys and usage live: one :class:`AccountStore` interface, two implementations
beside the Batch API's (and chosen by the same ``batch.store`` setting):

* ``accounts.sqlite_store.SQLiteAccounts`` (the default): one SQLite file in WAL mode next to
  batch's; processes on one machine share it; limits are kept per process (``LocalLimiter``).
* ``accounts.redis_store.RedisAccounts`` (``redis://...``): processes on many machines share keys,
  usage and one set of limit buckets (``RedisLimiter``).

Guarantees both keep:

* Secrets are never stored, only their SHA-256 (``accounts.keys``).
* Every change to a key (create, change, revoke) takes the next value of one change counter, so a
  process stays current by asking for what changed since the last value it saw
  (:meth:`AccountStore.keys_since`).
* :meth:`AccountStore.record` adds one request's usage to its row in one atomic write, which is on
  disk (SQLite WAL) or in Redis when it returns: a request is counted once, and a process killed
  after it answered has lost nothing.
* A usage recorded with a metering id (a batch line's, which runs again when the process that ran
  it died before recording its outcome) is counted at most once: the id is kept, in the same
  atomic write as the counters, for ``METERED_KEEP_S``, and a later usage with the same id adds
  nothing. The first delivery's usage is the one kept. HTTP requests carry no id and write
  nothing more.
"""

from __future__ import annotations

import abc
import sqlite3
from typing import Any

from redis.exceptions import RedisError

from accounts.keys import KeyRecord
from accounts.rates import Limiter, LocalLimiter
from accounts.usage import Usage, UsageRow

# How long a metering id is remembered: a batch's 24-hour completion window plus a day, so a line
# that runs again late (its batch ended late because every process was down for a while) still
# finds the id of its first delivery. Batch lines run only inside their batch's window.
METERED_KEEP_S = 2 * 86400


# What a store raises when it does not answer (Redis down or timing out: redis-py wraps the
# socket's errors in its own; a locked or unreadable SQLite file): a request that needs it then gets
# 503 store_unavailable, not a 500. Only the stores' own exception types, so that an error of
# anything else (a bad upload that PIL reads as an OSError) is never taken for one.
STORE_ERRORS: tuple[type[Exception], ...] = (sqlite3.Error, RedisError)


class AccountStore(abc.ABC):
    @abc.abstractmethod
    async def open(self) -> None: ...

    @abc.abstractmethod
    async def close(self) -> None: ...

    # -- keys
    @abc.abstractmethod
    async def create_key(self, record: KeyRecord) -> KeyRecord:
        """Store a new key; returns it with its version."""

    @abc.abstractmethod
    async def get_key(self, key_id: str) -> KeyRecord | None: ...

    @abc.abstractmethod
    async def list_keys(self) -> list[KeyRecord]:
        """Every key, oldest first."""

    @abc.abstractmethod
    async def update_key(self, key_id: str, **changes: Any) -> KeyRecord | None:
        """Change ``name``, ``tier``, ``limits``, ``models`` or ``revoked_at``; None if no such key.
        A revoked key stays revoked."""

    @abc.abstractmethod
    async def keys_since(self, version: int) -> tuple[list[KeyRecord], int]:
        """Keys changed after ``version``, and the latest version: the store's own, lower than
        ``version`` when the store went back (a Redis restarted empty or from an older snapshot)."""

    # -- usage
    @abc.abstractmethod
    async def record(self, day: str, key: str, model: str, tier: str, usage: Usage,
                     metering_id: str | None = None) -> None:
        """Add ``usage`` to its row, atomically and durably; with ``metering_id``, only if no usage
        was recorded under that id before (in the last ``METERED_KEEP_S``)."""

    @abc.abstractmethod
    async def usage(self, key: str | None, model: str | None, since: str | None, until: str | None) -> list[UsageRow]:
        """Rows filtered by key, model and day range (``since`` and ``until`` inclusive, YYYY-MM-DD)."""

    @abc.abstractmethod
    async def gpu_spent(self, key: str, day: str) -> float:
        """GPU-seconds the key used on ``day``, all models and tiers."""

    def limiter(self) -> Limiter:
        """The limiter that goes with this store (in-process unless the store is shared)."""
        return LocalLimiter()

    @property
    def shares_limits(self) -> bool:
        """True when the limiter reads today's GPU-seconds itself (no ``gpu_spent`` call needed)."""
        return False

