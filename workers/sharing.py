"""Runs that concurrent requests share: one padded forward pass, or one ``generate``, over pieces
of several requests' work, led by whichever request's caller finds no run going.

No thread of its own. A request's caller adds its job to a lane; when no run is going there,
it takes the next run's pieces (the worker's ``take`` says whose and how many), runs it on its
own thread and hands on; the others wait for their jobs to be done. So a request alone costs no
hand-over, and the requests that come while a run goes share the next. Each waiting caller waits
on its own job's event, and a run's end wakes only the callers it concerns (those it finished,
the one that leads next, the cancelled): never every waiter, which with 64 callers behind a pass
of milliseconds cost more wake-ups than passes. Batch-tier work (a
pause gate: it may yield between runs) shares in a lane of its own, so that no interactive
request waits behind a run paused for it. The embedding and moderation encoders
(``workers.embed``) and speech-to-text (``workers.stt``) run on it.
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Generic, Iterator, TypeVar

from workers.base import Cancelled, StepContext

_CANCEL_POLL_S = 0.05  # a job waiting behind a run sees its cancellation this soon (the pause gate's poll)


@dataclass(eq=False)
class SharedJob:
    """One request's part in shared runs: its pieces no run has taken yet (``pending``), how
    many runs hold some of them now, and what ended it."""

    ctx: StepContext
    pending: list = field(default_factory=list)
    running: int = 0
    error: BaseException | None = None
    done: threading.Event = field(default_factory=threading.Event)
    gpu_s: float = 0.0  # its share of the runs it was in
    wake: threading.Event = field(default_factory=threading.Event)  # its waiting caller looks again


J = TypeVar("J", bound=SharedJob)


@dataclass(eq=False)
class Lane(Generic[J]):
    """Jobs that share runs (each until all its pieces have run), and whether a caller is
    running one."""

    jobs: list[J] = field(default_factory=list)
    leading: bool = False

    def queued(self) -> list[J]:
        """The jobs with pieces no run has taken yet."""
        return [job for job in self.jobs if job.pending]


class SharedRuns(Generic[J]):
    """The lanes of one worker and the hand-over between their callers.

    ``take(jobs)`` (called under the lock, with the lane's jobs that have pending pieces and no
    error, oldest first) pops the next run's pieces off their jobs and returns the run and the
    job of each piece taken (a job once per piece); ``run(work)`` runs it off the lock, setting
    a job's ``error`` where it leaves the run (cancelled at its step boundary). An exception out
    of ``run`` ends every job in the run."""

    def __init__(self, take: Callable[[list[J]], tuple[Any, list[J]]], run: Callable[[Any], None],
                 long_runs: bool = False) -> None:
        self._take, self._run = take, run
        # how long an interactive job waits before it looks at its cancellation again: with
        # ``long_runs`` (seconds: a decode) the poll's, else until the run going ends (a pass of
        # milliseconds; many waiters polling would spend CPU). Batch jobs always poll: a run
        # ahead of them may be paused for long.
        self._interactive_poll_s = _CANCEL_POLL_S if long_runs else None
        self._turn = threading.Condition()  # guards both lanes; ``held`` waits on it for runs to end
        self.interactive: Lane[J] = Lane()
        self.batch: Lane[J] = Lane()  # work that may be paused between runs

    def join(self, job: J, pieces: list) -> None:
        """Wait until ``pieces`` of ``job`` have run, in runs shared with the jobs waiting then,
        leading them when no other caller in the lane is. Raises what ended the job
        (``Cancelled`` at a step boundary), never while a run still holds its pieces."""
        pausable = job.ctx.pause_gate is not None or job.ctx.pause_check is not None
        lane = self.batch if pausable else self.interactive
        poll = _CANCEL_POLL_S if lane is self.batch else self._interactive_poll_s
        with self._turn:
            job.pending = list(pieces)
            job.done.clear()
            lane.jobs.append(job)
            while not job.done.is_set():
                if lane.leading:
                    if lane is self.batch:
                        job.ctx.must_pause()  # batch work waiting behind a paused run is paused too
                    job.wake.clear()  # under the lock: a wake set after this is not lost
                    self._turn.release()
                    try:
                        job.wake.wait(poll)
                    finally:
                        self._turn.acquire()
                    if job.ctx.cancelled and not job.running and not job.done.is_set():
                        job.error = job.error or Cancelled()  # in no run: leave now, not after it
                        self._settle(lane)
                        if not lane.leading:
                            self._wake_next(lane)  # it may have been woken to lead: another leads
                    continue
                work, held = self._take([j for j in lane.jobs if j.pending and j.error is None])
                if not held:
                    self._settle(lane)
                    continue
                for other in held:
                    other.running += 1
                lane.leading = True
                self._turn.release()
                try:
                    self._run(work)
                except BaseException as exc:  # noqa: BLE001 - delivered to every job of the run
                    for other in held:
                        other.error = other.error or exc
                finally:
                    self._turn.acquire()
                    for other in held:
                        other.running -= 1
                    lane.leading = False
                    self._settle(lane)
                    self._wake_next(lane)
                    self._turn.notify_all()  # ``held`` waiting for the runs to end (no job waits on it)
        if job.error is not None:
            raise job.error

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        """No run starts in either lane until the block ends: callers queue, as behind runs
        going in both (how tests line requests up), and the first one then leads. It waits for
        the runs going to end first, so that letting go never starts a second run beside one."""
        with self._turn:
            while self.interactive.leading or self.batch.leading:
                self._turn.wait()
            self.interactive.leading = self.batch.leading = True
        try:
            yield
        finally:
            with self._turn:
                self.interactive.leading = self.batch.leading = False
                self._wake_next(self.interactive)
                self._wake_next(self.batch)
                self._turn.notify_all()

    @staticmethod
    def _settle(lane: Lane[J]) -> None:
        """(under the lock) Let go the jobs whose pieces have all run, or that failed."""
        for job in list(lane.jobs):
            if not job.running and (job.error is not None or not job.pending):
                job.pending.clear()
                lane.jobs.remove(job)
                job.done.set()
                job.wake.set()

    @staticmethod
    def _wake_next(lane: Lane[J]) -> None:
        """(under the lock, no run going in ``lane``) Wake the caller of the oldest job with pieces
        to run, to lead the next run, and the callers of cancelled jobs, to leave."""
        leader = next((job for job in lane.jobs if job.pending and job.error is None and not job.ctx.cancelled), None)
        if leader is not None:
            leader.wake.set()
        for job in lane.jobs:
            if job.ctx.cancelled and not job.running:
                job.wake.set()
