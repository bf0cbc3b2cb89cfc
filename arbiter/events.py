"""The one event stream the arbiter and the admission gate produce into, and the dashboard reads.

An :class:`EventLog` keeps the last ``capacity`` events in a ring, each with an id that only grows
and a wall-clock time (Unix seconds), and feeds every subscriber without ever blocking the
producer. Producers are the owners of the state that changed (the arbiter's and the gate's plain
methods, on the event loop), so ``emit`` is a plain synchronous call: it appends to the ring and
puts the event in each subscriber's bounded queue. A subscriber that falls ``queue_size`` events
behind is dropped; it still reads what it has, then :meth:`Subscription.next` raises
:class:`Lagged`, and the reader takes a fresh snapshot and subscribes again.

Kinds and their fields (besides ``id``, ``at`` and ``kind``), as in docs/DASHBOARD.md:

``load_started``  model, from_place (the place it is loaded from), tier (whose request started it)
``load_finished`` model, from_place, seconds, footprint_bytes
``load_failed``   model, reason
``engine_failed`` model, reason (its resident worker's engine died: dropped, loaded again on demand)
``eviction``      model (the victim), from_place, to_place (``warm`` or ``cold``), reason (``make_room``,
                  ``oom``, ``admin``, ``host_cache``), by_model and by_tier (whose request caused
                  it; null for an admin unload)
``batch_paused``, ``batch_resumed``  model
``refusal``       tier, reason (``queue_full``, ``latency_target``, ``model_protected``,
                  ``model_unavailable``), model (null when refused before the body was read),
                  retry_after_s
``oom_relief``    model (whose step ran out of memory, or whose load did), victim, tier
``limits_changed`` limits (tier -> effective max_inflight, from the SLO guard), before
``loop_stall``     lag_s, where, stack (the gateway's event loop ran late: gateway/loop_watch.py)
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable


@dataclass(frozen=True, slots=True)
class Event:
    id: int
    at: float  # Unix seconds
    kind: str
    data: dict[str, Any]

    def public(self) -> dict[str, Any]:
        return {"id": self.id, "at": self.at, "kind": self.kind, **self.data}


class Lagged(Exception):
    """The subscriber fell too far behind and was dropped: take a fresh snapshot."""


@dataclass(eq=False)
class Subscription:
    """One reader's bounded queue of events, fed by :meth:`EventLog.emit`."""

    queue: asyncio.Queue[Event]
    log: "EventLog" = field(repr=False)
    lagged: bool = False

    async def next(self, timeout: float) -> Event | None:
        """The next event, or None when none arrives within ``timeout`` seconds."""
        if self.lagged and self.queue.empty():
            raise Lagged()
        try:  # asyncio.timeout, not wait_for: on 3.11 wait_for can swallow a cancellation that
            async with asyncio.timeout(timeout):  # lands as the get completes, and the reader never stops
                return await self.queue.get()
        except TimeoutError:
            return None

    def close(self) -> None:
        self.log._subscribers.discard(self)

    def __enter__(self) -> "Subscription":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class EventLog:
    def __init__(self, capacity: int = 500, queue_size: int = 1000,
                 clock: Callable[[], float] = time.time) -> None:
        self.recent: deque[Event] = deque(maxlen=capacity)
        self.queue_size = queue_size
        self.clock = clock
        self.started_at = clock()  # a new log (a new process): its ids start at 1 again
        self._ids = itertools.count(1)
        self._subscribers: set[Subscription] = set()

    @property
    def last_id(self) -> int:
        return self.recent[-1].id if self.recent else 0

    def emit(self, kind: str, **data: Any) -> Event:
        event = Event(next(self._ids), self.clock(), kind, data)
        self.recent.append(event)
        for sub in list(self._subscribers):
            if sub.queue.full():
                sub.lagged = True
                self._subscribers.discard(sub)
            else:
                sub.queue.put_nowait(event)
        return event

    def subscribe(self) -> Subscription:
        """A new reader of every event emitted from now on (use as a context manager)."""
        sub = Subscription(asyncio.Queue(self.queue_size), self)
        self._subscribers.add(sub)
        return sub

    def since(self, last_id: int, limit: int | None = None) -> list[Event]:
        """The ring's events after ``last_id``, oldest first (the last ``limit`` of them)."""
        events = [e for e in self.recent if e.id > last_id]
        return events[-limit:] if limit else events
