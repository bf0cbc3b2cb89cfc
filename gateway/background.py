"""Work that outlives its HTTP request: the Responses API's ``background: true``.

:class:`Background` holds this process's running background work by id, each a task with its
stop signal (a :class:`~gateway.serving.Gone`, the signal a client's disconnect sets for a live
request: the wait for a slot ends, and the model work stops at its next step boundary). While a
piece runs it counts as an API request in flight for the drain, so a SIGTERM lets it finish, for
at most ``server.drain_timeout_s``; at shutdown what still runs is stopped with ``stopping`` set,
so that it can record why it ended, and its stop signal handed back (``Gone.hand_back``): the cut
attempt writes no usage, as it runs again. ``/metrics`` shows how many run here
(``tiergate_background_responses``, :meth:`Background.collect`).

A piece made with ``stream: true`` has an :class:`EventLog` while it runs here: its events as they
are made, which any number of clients of this process follow (the one that made it, and those that
come back with ``GET /v1/responses/{id}?stream=true``); each follower waits on an event of its own.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from typing import AsyncIterator, Awaitable, Callable

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from gateway.drain import Drain
from gateway.serving import Gone
from storage.outage import Outage
from storage.redis import honour_cancel

log = logging.getLogger("tiergate.background")
STOP_WAIT_S = 5.0  # at shutdown, how long the stopped work gets to record how it ended


class EventLog:
    """The events of one streamed piece of work, in order (an event's index is its number), and
    whether the last has been added."""

    def __init__(self) -> None:
        self.events: list[str] = []
        self.ended = False
        self._followers: set[asyncio.Event] = set()

    def add(self, events: list[str]) -> None:
        self.events += events
        self._wake()

    def end(self) -> None:
        self.ended = True
        self._wake()

    def _wake(self) -> None:
        for follower in self._followers:
            follower.set()

    async def follow(self, after: int) -> AsyncIterator[str]:
        """The events numbered above ``after``: those there now, then each as it is added, until
        the last."""
        n = after + 1
        woken = asyncio.Event()
        self._followers.add(woken)
        try:
            while True:
                while n < len(self.events):
                    n += 1
                    yield self.events[n - 1]
                if self.ended:
                    return
                woken.clear()
                await woken.wait()
        finally:
            self._followers.discard(woken)


class Background(Collector):
    def __init__(self, drain: Drain) -> None:
        self.drain = drain
        self.running: dict[str, tuple[asyncio.Task, Gone]] = {}
        self.logs: dict[str, EventLog] = {}  # the streamed ones' events, while they run
        self.stopping = False
        self._listener: asyncio.Task | None = None
        self._loops: list[asyncio.Task] = []
        self.runner = uuid.uuid4().hex  # this process's name on the records it runs

    def start(self, key: str, work: Callable[[Gone], Awaitable[None]], log: EventLog | None = None) -> None:
        """Run ``work(gone)`` in a task of its own under ``key`` (with ``log``, its events, for
        followers to find until it ends)."""
        gone = Gone()
        self.drain.inflight += 1
        task = asyncio.get_running_loop().create_task(self._run(key, work, gone))
        self.running[key] = (task, gone)
        if log is not None:
            self.logs[key] = log

    async def _run(self, key: str, work: Callable[[Gone], Awaitable[None]], gone: Gone) -> None:
        try:
            await work(gone)
        finally:
            self.drain.inflight -= 1
            self.running.pop(key, None)
            log = self.logs.pop(key, None)
            if log is not None:
                log.end()  # (the work ends it; this is for work that failed before it could)

    async def cancel(self, key: str, wait_s: float) -> bool:
        """Stop the work ``key`` and wait for it to end (at most ``wait_s``); False when this
        process does not run it."""
        entry = self.running.get(key)
        if entry is None:
            return False
        task, gone = entry
        gone.set()
        if wait_s > 0:
            await asyncio.wait({task}, timeout=wait_s)
        return True

    def follow_stops(self, stops: AsyncIterator[str]) -> None:
        """Stop the work whose id ``stops`` yields (other processes' cancels and deletes), as it
        comes, until ``stop``."""
        async def listen() -> None:
            async for key in stops:
                await self.cancel(key, 0)

        self._listener = asyncio.get_running_loop().create_task(listen())

    def every(self, period_s: float, fn: Callable[[], Awaitable[object]], what: str = "a periodic task") -> None:
        """Run ``fn()`` every ``period_s`` until ``stop`` (a failed run is logged, a store that does not
        answer once; the next tries again)."""
        outage = Outage(log, f"background: {what}")

        async def loop() -> None:
            while True:
                honour_cancel()  # a cancel the store's client swallowed (storage.redis): ``stop`` waits for this loop
                await asyncio.sleep(period_s)
                try:
                    await fn()
                except Exception as exc:  # noqa: BLE001 - the store was down, say: the next turn tries again
                    outage.failed(exc)
                else:
                    outage.answered()

        self._loops.append(asyncio.get_running_loop().create_task(loop()))

    async def stop(self) -> None:
        """At shutdown: stop what still runs and let each record how it ended."""
        for task in [self._listener, *self._loops]:
            if task is not None:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        self.stopping = True
        tasks = [task for task, _ in self.running.values()]
        for _, gone in list(self.running.values()):
            gone.hand_back()  # its attempt is not metered: it runs again (or ends failed, unanswered)
        if tasks:
            await asyncio.wait(tasks, timeout=STOP_WAIT_S)

    def collect(self):
        """The metrics registry's view: how many run in this process now (queued at the gate or
        generating; each also counts as its tier's request)."""
        yield GaugeMetricFamily("tiergate_background_responses", "Background responses this process runs now",
                                value=len(self.running))
