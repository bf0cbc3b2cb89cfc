"""How a loop that calls a store every turn (the batch runner's, the vector stores' indexer,
fine-tuning's runner, the background's periodic tasks) logs its failures: a store that does not
answer (Redis down, restarting or frozen; a SQLite file locked past its wait) is one warning when
the loop first meets it and one when the store answers again, not a traceback per turn (a 10 s
Redis outage wrote 118); any other failure, a bug, keeps its traceback every time.
"""

from __future__ import annotations

import logging
import sqlite3
import time

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError


def unanswered(exc: BaseException) -> bool:
    """Whether ``exc`` says the store did not answer (and a later try may), not that a call was wrong."""
    return isinstance(exc, (RedisConnectionError, RedisTimeoutError)) or (
        isinstance(exc, sqlite3.OperationalError) and "locked" in str(exc))


class Outage:
    """One loop's view of its store: ``failed`` in its ``except``, ``answered`` after a turn that
    reached the store."""

    def __init__(self, log: logging.Logger, what: str) -> None:
        self.log, self.what = log, what  # what: the loop's work, as its lines name it ("batch: claiming lines")
        self.since: float | None = None  # when the store stopped answering (None: it answers)

    def failed(self, exc: BaseException) -> None:
        if not unanswered(exc):
            self.log.error("%s failed", self.what, exc_info=exc)
        elif self.since is None:
            self.since = time.monotonic()
            self.log.warning("%s: the store does not answer (%s: %s); trying again until it does",
                             self.what, type(exc).__name__, exc)

    def answered(self) -> None:
        if self.since is not None:
            self.log.warning("%s: the store answers again, after %.0f s", self.what, time.monotonic() - self.since)
            self.since = None
