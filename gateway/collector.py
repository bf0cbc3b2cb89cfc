"""The garbage collector in a long-running server: what lives as long as the process is frozen
out of its sight.

CPython's full collection walks every object the collector tracks. Once torch, transformers and
the app are imported that is about 600,000 objects, and vLLM's first load adds about 500,000 more;
one full collection then takes 0.3-0.6 s of CPU on the event loop, during which no request of any
tier moves. With many requests in flight, enough of their objects outlive the young collections
that full collections come every few seconds (bench_overhead's ``gc`` column: several per run at
64 clients, none at 1).

So :class:`Collector` moves what is alive at two moments into the permanent generation
(``gc.freeze``), each time right after a full collection so that no garbage is frozen: when the
server has started, and after the first load of each worker class (the libraries that class
imports on its first load: vLLM's engine, diffusers' pipelines). Later full collections walk only
what requests and later loads made.

The price: an object that was alive at a freeze and later becomes garbage in a reference cycle is
never reclaimed (garbage without cycles is freed by its reference count as always). Freezes
happen a bounded number of times (once at startup, once per worker class), so that is bounded
too: the in-flight requests' objects at those moments. A model's weights are freed by reference
count when its worker drops them, frozen or not (checked in tests/test_collector.py).

While it runs it also collects the young generation less often: every ``YOUNG_THRESHOLD``
allocations (net of deallocations) of tracked objects instead of CPython's 700. With 64 requests
in flight for a few hundred milliseconds each, a young collection every 700 allocations walks the
in-flight requests' objects again and again and promotes them towards full collections. Measured
with bench_overhead (chat, 64 clients; docs/BENCHMARKS.md, "Gateway overhead"): the server's
collections 0.15-0.17 -> 0.05 ms of CPU per request, and no full collection in a run where there
were two. Garbage in reference cycles lives a little longer; everything else is freed by its
reference count as always. ``stop`` puts the thresholds back.

``tiergate serve`` and each ``tiergate cluster`` replica run it (tests/test_operations.py reads its
log lines on a real serve, tests/test_cluster_ray.py asks the replicas); the suite's
in-process apps do not (each test's app would stay frozen).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import threading
import time

from arbiter.events import EventLog, Lagged, Subscription

log = logging.getLogger("tiergate.collector")

YOUNG_THRESHOLD = 10_000


def freeze(wait_s: float = 5.0) -> int:
    """Collect, then move every object the collector tracks to the permanent generation; the
    number of objects frozen so far.

    CPython runs one collection at a time: while another thread's is running (its finalizers
    may let this thread run), ``gc.collect()`` returns at once without collecting, and freezing
    then would freeze that moment's garbage for good. So this thread collects again until its
    own full collection has run (seen through ``gc.callbacks``), for ``wait_s`` at most. The
    :class:`Collector` calls it on the event loop, which that wait holds as long as the other
    thread's collection lasts (milliseconds in practice; it happens only when two meet)."""
    me = threading.get_ident()
    ran: list[bool] = []

    def seen(phase: str, info: dict) -> None:
        if phase == "stop" and info["generation"] == 2 and threading.get_ident() == me:
            ran.append(True)

    gc.callbacks.append(seen)
    try:
        deadline = time.monotonic() + wait_s
        gc.collect()
        while not ran and time.monotonic() < deadline:
            time.sleep(0.005)
            gc.collect()
    finally:
        gc.callbacks.remove(seen)
    gc.freeze()
    return gc.get_freeze_count()


class Collector:
    """Freezes at startup and after each worker class's first load (``load_finished`` events);
    ``workers`` maps a model to its worker while loaded (the arbiter's ``workers``)."""

    def __init__(self, events: EventLog, workers: dict[str, object]) -> None:
        self._events = events
        self._workers = workers
        self._loaded: set[type] = set()  # worker classes loaded once (their imports frozen)
        self._task: asyncio.Task[None] | None = None
        self._thresholds: tuple[int, ...] | None = None  # the interpreter's, put back at stop
        self.freezes = 0

    async def start(self) -> None:
        self._thresholds = gc.get_threshold()
        gc.set_threshold(YOUNG_THRESHOLD, *self._thresholds[1:])
        self._loaded.update(type(w) for w in self._workers.values())
        self._freeze("startup")
        events = self._events.subscribe()  # now, not in the task: no load between the two is missed
        self._task = asyncio.get_running_loop().create_task(self._follow_loads(events))

    async def stop(self) -> None:
        """Stop following loads and unfreeze, so that the interpreter's exit collects as it always
        does (frozen objects are never finalized, and nanobind, the binding library under one of
        the loaded libraries, then reports its instances as leaked on stderr at exit)."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        gc.unfreeze()
        if self._thresholds is not None:
            gc.set_threshold(*self._thresholds)

    def _freeze(self, why: str) -> None:
        log.info("garbage collector: %d objects frozen out of its walks (%s)", freeze(), why)
        self.freezes += 1

    async def _follow_loads(self, events: Subscription) -> None:
        while True:
            with events, contextlib.suppress(Lagged):
                while True:
                    event = await events.next(timeout=3600)
                    if event is not None and event.kind == "load_finished":
                        self._after_loads()
            self._after_loads()  # fell behind and dropped: whatever loaded meanwhile, then subscribe again
            events = self._events.subscribe()

    def _after_loads(self) -> None:
        new = {type(w) for w in list(self._workers.values())} - self._loaded
        if new:
            self._loaded |= new
            self._freeze("first load of " + ", ".join(sorted(c.__name__ for c in new)))


def attach(services) -> Collector:
    """The collector as ``tiergate serve`` runs it on ``services`` (a ``gateway.service.Services``):
    started last, once every feature has started, and stopped first."""
    collector = Collector(services.arbiter.events, services.arbiter.workers)
    services.on_startup.append(collector.start)
    services.on_shutdown.append(collector.stop)  # the shutdown runs in reverse order
    return collector
