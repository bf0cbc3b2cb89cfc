"""One task per process that takes work other processes share, under a lease, one piece at a time:
the vector stores' indexer (``gateway.vector_indexer``) and fine-tuning's runner (``tuning.runner``).

``start`` runs the loop; it claims a piece (``_claim``: a new one, or one whose process died and
whose lease ran out), works on it (``_work``), and when there was none sleeps until ``wake`` (work
added in this process) or ``POLL_S`` (work other processes added or left). A claim or a piece that
fails is logged and the loop goes on: its lease ends, and it is taken again. A store that does
not answer is logged once, and once when it is back (``storage.outage``). ``stop`` cancels it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Generic, TypeVar

from storage.outage import Outage
from storage.redis import honour_cancel

T = TypeVar("T")
POLL_S = 2.0  # how often an idle loop looks for work other processes added or left


class ClaimLoop(Generic[T]):
    log: logging.Logger
    work = "claiming or working on a piece"  # what the log's lines name when it fails

    def __init__(self) -> None:
        self._outage = Outage(self.log, self.work)
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None

    async def _claim(self) -> T | None:
        raise NotImplementedError

    async def _work(self, piece: T) -> None:
        raise NotImplementedError

    async def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    def wake(self) -> None:
        self._wake.set()

    async def _run(self) -> None:
        while True:
            self._wake.clear()
            piece = None
            try:
                piece = await self._claim()
                self._outage.answered()
                if piece is not None:
                    await self._work(piece)
            except Exception as exc:  # noqa: BLE001 - the store is down: the piece's lease ends, and it is taken again
                self._outage.failed(exc)
            honour_cancel()
            if piece is None:
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(POLL_S):
                        await self._wake.wait()
