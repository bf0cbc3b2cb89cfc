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


# a script's helper: run the commands of a ``storage.Along`` (its argument, ``storage.along_json``)
ALONG_LUA = """
local function along(commands)
  for _, c in ipairs(cjson.decode(commands)) do redis.call(unpack(c)) end
end
"""


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


async def keyset_page(r: Any, key: str, after: tuple[float, bytes] | None, count: int,
                      descending: bool) -> list[tuple[bytes, float]]:
    """Up to ``count`` members of the sorted set ``key`` with their scores, in its order (by score,
    then member; ``descending`` reverses both), from the start or past ``after`` (a score and a
    member): a keyset page, as SQL's ``WHERE (score, member) > (?, ?)``. The bound is a value, not a
    rank, so members added or removed meanwhile move no other member in or out of the page, and
    ``after`` need not be listed still (deleted since the last page)."""
    if after is None:
        return await r.zrange(key, 0, count - 1, desc=descending, withscores=True)
    score, member = after
    beyond = f"({score!r}"
    async with r.pipeline(transaction=True) as p:  # one snapshot of the cursor's ties and what follows them
        p.zrangebyscore(key, score, score)  # the cursor's ties, by member
        if descending:
            p.zrevrangebyscore(key, beyond, "-inf", start=0, num=count, withscores=True)
        else:
            p.zrangebyscore(key, beyond, "+inf", start=0, num=count, withscores=True)
        tied, rest = await p.execute()
    # (bytes compare as Redis orders members)
    tied = [m for m in reversed(tied) if m < member] if descending else [m for m in tied if m > member]
    return ([(m, score) for m in tied] + rest)[:count]
