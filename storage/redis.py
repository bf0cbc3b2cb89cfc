"""A Redis client from a URL (``redis://...``) whose keys all start with one prefix: the base of
the stores that processes on many machines share. redis.asyncio is imported when it opens."""

from __future__ import annotations

from typing import Any


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
