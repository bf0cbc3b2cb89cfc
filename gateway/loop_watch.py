"""The event loop's stalls: how late it runs what is due, and where it was while it ran late.

Every request of every tier waits on one event loop. Work that holds it (a large file parsed in
a handler, a full garbage collection, a lock taken on the loop) delays every other request by as
long, and nothing in a request's own timings says which code did it. So :class:`LoopWatch`:

* **measures** the loop's lag: a timer on the loop every ``period_s`` notes how late it ran
  (``tiergate_event_loop_lag_seconds``, a histogram; the loop's own turn is well under a
  millisecond when nothing holds it);
* **samples** where the loop is while it is late: a watchdog thread, woken every ``period_s``,
  reads the loop thread's stack (``sys._current_frames``) once a timer is overdue by half the
  threshold, while the stall is still under way;
* **reports** each time the loop runs a timer ``threshold_s`` late or later: a ``loop_stall`` event
  in the dashboard's stream, a warning in the log, and ``tiergate_event_loop_stalls_total``. The
  event has ``lag_s``, ``cause`` and, for code, ``where`` (the innermost frame of tiergate's own
  code and the library frame it called) and ``stack`` (the innermost frames). ``cause`` is one of:

  - ``gc``: full garbage collections (``gc_s``, on any thread: one holds the interpreter lock
    throughout) took half the lag or more;
  - ``code``: the loop was running the code ``where`` names;
  - ``waiting``: the loop was in its own machinery (its wait for I/O: the sample found no callback
    running), so it was waiting for the interpreter lock or for a CPU, held by another thread of
    this process or by other processes;
  - ``not_sampled``: the watchdog got no turn at the interpreter lock until the stall had ended, so
    C code held the lock throughout (one long call, on the loop or on another thread).

A stall is measured from the last timer that ran on time, so the lag it reports is at least the
stall's length less one period (``period_s`` is half the threshold). Code that holds the
interpreter lock in one long C call (one huge ``json.loads``, a full garbage collection) cannot be
sampled until it returns: its stall is ``not_sampled`` unless the sample, taken as soon as the
watchdog gets the lock back, still finds the loop late in the function that made that call.

The cost: a timer on the loop and a thread's wake-up each ``period_s`` (20 of each a second at
the default threshold of 0.1 s), whatever the traffic, and a call per garbage collection. ``server.loop_stall_s`` sets the threshold;
0 turns the watch off.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import sys
import threading
import time
import re
import traceback
from pathlib import Path

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

from arbiter.events import EventLog
from gateway.metrics import Histogram

log = logging.getLogger("tiergate.loop")

ROOT = Path(__file__).resolve().parents[1]
STACK_FRAMES = 8  # the innermost frames an event carries
_STDLIB = re.compile(r"^.*/lib/python3\.\d+/")  # the standard library's files, from their package
LAG_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)


def frame_label(frame: traceback.FrameSummary, root: Path = ROOT) -> str:
    """``path:line function``, the path relative to the project for its own code and to the
    packages' folder for a library's."""
    path = frame.filename
    if _own(path, root):
        path = str(Path(path).relative_to(root))
    elif "site-packages/" in path:
        path = path.rsplit("site-packages/", 1)[1]
    else:
        path = _STDLIB.sub("", path)
    return f"{path}:{frame.lineno} {frame.name}"


def _own(path: str, root: Path) -> bool:
    return path.startswith(str(root) + "/") and "site-packages/" not in path


def where(stack: traceback.StackSummary | list[traceback.FrameSummary], root: Path = ROOT) -> str | None:
    """Where a stack (outermost first) was: its innermost frame of the project's own code, and the
    innermost frame after it when that is a library's (``batch/lines.py:88 check_lines >
    json/decoder.py:353 raw_decode``); the innermost frame alone when no frame is the project's;
    None for an empty stack."""
    if not stack:
        return None
    own = next((i for i in range(len(stack) - 1, -1, -1) if _own(stack[i].filename, root)), None)
    if own is None:
        return frame_label(stack[-1], root)
    label = frame_label(stack[own], root)
    return label if own == len(stack) - 1 else f"{label} > {frame_label(stack[-1], root)}"


def loop_frames(stack: traceback.StackSummary | list[traceback.FrameSummary]) -> list[tuple[str, str]]:
    """The frames a callback the loop runs sits on (its own stack, without its frame, taken in
    it): the loop's, whatever it runs. asyncio's ``Handle._run`` is the callback's, not the loop's."""
    frames = [(f.filename, f.name) for f in stack]
    if frames and frames[-1][0].endswith("asyncio/events.py") and frames[-1][1] == "_run":
        frames.pop()
    return frames


def waiting(stack: traceback.StackSummary | list[traceback.FrameSummary], loop: list[tuple[str, str]]) -> bool:
    """Whether a sample of the loop's thread found it in its own machinery: the loop's frames and
    at most the selector's wait after them (asyncio's; uvloop waits in C), no callback running."""
    return [(f.filename, f.name) for f in stack[:len(loop)]] == loop and \
        all(f.filename.endswith("/selectors.py") for f in stack[len(loop):])


class _StallCounter(Collector):
    def __init__(self, watch: "LoopWatch") -> None:
        self.watch = watch

    def collect(self):
        family = CounterMetricFamily("tiergate_event_loop_stalls", "Times the event loop ran a timer "
                                     "server.loop_stall_s late or later (the loop_stall events)")
        family.add_metric([], self.watch.stalls)
        yield family


_CAUSES = {"gc": "during full garbage collections ({gc_s:.3f} s)",
           "waiting": "waiting for the interpreter lock or a CPU (another thread or process had them)",
           "not_sampled": "(not sampled: C code held the interpreter lock throughout)"}


class LoopWatch:
    """Started on the loop it watches (``start``), stopped there (``stop``)."""

    def __init__(self, threshold_s: float, events: EventLog, registry: CollectorRegistry) -> None:
        self.threshold_s = threshold_s
        self.period_s = threshold_s / 2
        self.events = events
        self.stalls = 0
        self.lag = Histogram("tiergate_event_loop_lag_seconds", "How late the event loop ran a timer due "
                             "every server.loop_stall_s / 2", [], LAG_BUCKETS, registry)
        registry.register(_StallCounter(self))
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread = 0
        self._due = 0.0  # when the next timer is due (time.monotonic)
        self._sample: tuple[float, traceback.StackSummary] | None = None  # (the due it was taken for, stack)
        self._loop_frames: list[tuple[str, str]] | None = None  # the loop's own (``loop_frames``), at the first timer
        self._gc_s = 0.0  # seconds of full collections since the last timer ran
        self._gc_since = 0.0  # when the full collection under way started (0: none is)
        self._handle: asyncio.TimerHandle | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._loop_thread = threading.get_ident()
        self._schedule(time.monotonic())
        self._stop.clear()
        gc.callbacks.append(self._collected)
        self._thread = threading.Thread(target=self._watchdog, name="tiergate-loop-watch", daemon=True)
        self._thread.start()

    async def stop(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
        self._stop.set()
        if self._collected in gc.callbacks:
            gc.callbacks.remove(self._collected)
        if self._thread is not None:
            self._thread.join(1.0)  # it waits on _stop: it ends at once
            self._thread = None

    def _schedule(self, now: float) -> None:
        self._due = now + self.period_s  # on the watchdog's clock (a loop's may differ: uvloop's)
        self._handle = self._loop.call_later(self.period_s, self._tick)

    def _tick(self) -> None:
        now = time.monotonic()
        if self._loop_frames is None:
            self._loop_frames = loop_frames(traceback.extract_stack()[:-1])
        lag = max(0.0, now - self._due)
        self.lag.observe(lag)
        sample, self._sample = self._sample, None
        gc_s, self._gc_s = self._gc_s, 0.0
        if lag >= self.threshold_s:
            stack = sample[1] if sample is not None and sample[0] == self._due else None
            self._report(lag, stack, gc_s)
        self._schedule(now)

    def _collected(self, phase: str, info: dict) -> None:
        """``gc.callbacks``: full collections timed (in whichever thread runs them; one at a time)."""
        if info["generation"] != 2:
            return
        if phase == "start":
            self._gc_since = time.monotonic()
        elif self._gc_since:
            self._gc_s += time.monotonic() - self._gc_since
            self._gc_since = 0.0

    def _report(self, lag: float, stack: traceback.StackSummary | None, gc_s: float = 0.0) -> None:
        self.stalls += 1
        if gc_s >= lag / 2:
            cause, place, frames = "gc", None, []
        elif not stack:
            cause, place, frames = "not_sampled", None, []
        elif waiting(stack, self._loop_frames or []):
            cause, place, frames = "waiting", None, []
        else:
            cause, place, frames = "code", where(stack), [frame_label(f) for f in stack[-STACK_FRAMES:]]
        event = self.events.emit("loop_stall", lag_s=round(lag, 4), cause=cause, where=place, stack=frames,
                                 gc_s=round(gc_s, 4))
        log.warning("the event loop ran %.3f s late %s", lag, f"in {place}" if place else _CAUSES[cause].format(gc_s=gc_s),
                    extra={"loop_stall": event.public()})  # the event, for a handler that keeps it whole

    def _watchdog(self) -> None:
        while not self._stop.wait(self.period_s):
            due = self._due
            if self._sample is not None and self._sample[0] == due:
                continue  # this stall is sampled already
            if time.monotonic() - due < self.period_s:  # overdue by half the threshold or more: a stall
                continue
            frame = sys._current_frames().get(self._loop_thread)
            if frame is not None and due == self._due:  # the loop is still late for that timer
                self._sample = (due, traceback.extract_stack(frame))
            del frame
