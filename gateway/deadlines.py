"""Deadlines of one fixed length, many in flight: a FIFO instead of the event loop's timer heap.

The gateway sets a few deadlines per request, each of a constant length (the body read's, the
door window's, the disconnect watcher's start) and cancels most of them well before they fall
due. ``loop.call_later`` would make a ``TimerHandle`` for each, push it on the loop's heap (a
Python-level comparison per step, more steps with more requests in flight) and leave it there
once cancelled. Deadlines of one length fall due in the order they were set, so one queue keeps
them in order and one loop timer, armed for the front one, serves them all: setting and
cancelling are O(1) and make no loop timer; a cancelled deadline stays in the queue, marked,
until it reaches the front (or the queue is mostly cancelled ones and is compacted).

A deadline fires when its own time comes, as a ``call_later`` of the same length would. Its
callback runs on the loop outside any request's context (a fresh ``contextvars.Context``), and
an exception from it goes to the loop's exception handler, as from any loop callback.
"""

from __future__ import annotations

import asyncio
import contextvars
import time
import weakref
from collections import deque
from typing import Any, Callable


class Deadline:
    """One pending call; :meth:`cancel` it to call nothing (idempotent, also once fired)."""

    __slots__ = ("when", "callback", "args", "queue")

    def __init__(self, when: float, callback: Callable[..., object], args: tuple[Any, ...], queue: _Queue) -> None:
        self.when = when  # loop time
        self.callback: Callable[..., object] | None = callback  # None once cancelled or fired
        self.args = args
        self.queue = queue

    def cancel(self) -> None:
        if self.callback is None:
            return
        self.callback = self.args = None
        queue = self.queue
        queue.live -= 1
        items = queue.items
        if items[0] is self:  # the common case: requests end in the order they came
            items.popleft()
            while items and items[0].callback is None:
                items.popleft()
        elif len(items) > 2 * queue.live + 16:  # a long-lived front with mostly cancelled ones behind
            live = [d for d in items if d.callback is not None]
            items.clear()  # in place: a firing queue may be walking it
            items.extend(live)


class Deadlines:
    """``after(callback, *args)``: call ``callback(*args)`` ``seconds`` from now on the running
    loop, unless the returned :class:`Deadline` is cancelled first. One instance serves every
    loop that uses it (each has its own queue): tests run apps on a new loop each."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self._queues: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _Queue] = weakref.WeakKeyDictionary()
        self._last: tuple[asyncio.AbstractEventLoop | None, _Queue | None] = (None, None)

    def after(self, callback: Callable[..., object], *args: Any) -> Deadline:
        loop = asyncio.get_running_loop()
        last_loop, queue = self._last  # one read: safe if loops in other threads swap it
        if last_loop is not loop:
            queue = self._queues.get(loop)
            if queue is None:
                queue = self._queues[loop] = _Queue(loop)
            self._last = (loop, queue)
        deadline = Deadline(queue.clock() + self.seconds, callback, args, queue)
        queue.items.append(deadline)
        queue.live += 1
        if queue.timer is None:
            queue.arm()
        return deadline

    def pending(self) -> int:
        """Deadlines set on the running loop and neither fired nor cancelled."""
        queue = self._queues.get(asyncio.get_running_loop())
        return 0 if queue is None else queue.live


class _Queue:
    """The deadlines of one length on one loop, in the order they fall due."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        # the loop's clock: asyncio's own loops read time.monotonic, called here directly
        self.clock = time.monotonic if type(loop).time is asyncio.BaseEventLoop.time else loop.time
        self.items: deque[Deadline] = deque()  # live and cancelled, by time
        self.live = 0  # items not cancelled
        self.timer: asyncio.TimerHandle | None = None  # armed no later than the front item's time
        self.armed_at = 0.0
        self.context = contextvars.Context()  # callbacks run outside any request's context

    def arm(self) -> None:
        """Arm the loop timer for the front item, unless it is already armed no later."""
        when = self.items[0].when
        if self.timer is not None:
            if self.armed_at <= when:
                return
            self.timer.cancel()
        self.timer = self.loop.call_at(when, self._fire, context=self.context)
        self.armed_at = when

    def _fire(self) -> None:
        self.timer = None
        # The loop runs a timer up to its clock's resolution early: what it ran is due.
        due = max(self.clock(), self.armed_at)
        items = self.items
        try:
            while items and items[0].when <= due:
                deadline = items.popleft()
                callback, args = deadline.callback, deadline.args
                if callback is None:
                    continue
                deadline.callback = deadline.args = None
                self.live -= 1
                self._run(callback, args)
        finally:
            while items and items[0].callback is None:
                items.popleft()
            if items:
                self.arm()

    def _run(self, callback: Callable[..., object], args: tuple[Any, ...]) -> None:
        try:
            callback(*args)
        except (SystemExit, KeyboardInterrupt):
            raise
        except BaseException as exc:
            self.loop.call_exception_handler({"message": f"Exception in deadline callback {callback!r}", "exception": exc})
