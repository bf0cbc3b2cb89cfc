"""A Redis client from a URL (``redis://...``) whose keys all start with one prefix: the base of
the stores that processes on many machines share. redis.asyncio is imported when it opens.

The client can lose a cancel: redis-py sends every command through ``asyncio.wait_for`` (its
``socket_timeout``, 5 s by default), and on Python 3.11 ``wait_for`` swallows a cancellation
that lands just as the send finishes (gh-86296, fixed in 3.12): the command returns, the task
goes on. A loop that calls the store would then ignore its stop and hang whoever awaits it, so
every such loop calls ``honour_cancel()`` at each turn.
"""

from __future__ import annotations

import asyncio
from typing import Any


def honour_cancel() -> None:
    """Raise ``CancelledError`` when this task was cancelled and the cancel never reached it (a
    library swallowed it; see the module's doc). Call it once per turn of a loop, after its store
    calls and before it waits again."""
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError


class RedisKeys:
    def __init__(self, url: str, prefix: str) -> None:
        self.url = url
        self.prefix = prefix
        self._r: Any = None

    def k(self, *parts: str) -> str:
        """The key named by ``parts`` under this store's prefix."""
        return self.prefix + ":".join(parts)

    async def open(self) -> None:
        import redis.asyncio as aioredis

        self._r = aioredis.Redis.from_url(self.url)

    async def close(self) -> None:
        if self._r is not None:
            await self._r.aclose()
            self._r = None
