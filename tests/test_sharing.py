"""``workers.sharing.SharedRuns`` on plain pieces (no model): the hand-over the encoders and
speech-to-text share. The workers' own tests run it on real models (test_embeddings,
test_workers_media)."""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future

import pytest

from workers.base import Cancelled, StepContext
from workers.sharing import SharedJob, SharedRuns


class Recorder:
    """Runs that take one piece from each queued job in turn (up to ``width``), as STT does, and
    record what each run held."""

    def __init__(self, width: int = 8, fail_on: str | None = None, hold_from: int | None = None) -> None:
        self.width, self.fail_on = width, fail_on
        self.runs: list[list[str]] = []
        self.running = threading.Event()
        self.release = threading.Event()  # every run waits for it
        self.release.set()
        self.hold_from = hold_from  # the runs from this one on wait for ``later`` too
        self.later = threading.Event()

    def take(self, jobs: list[SharedJob]) -> tuple[list[str], list[SharedJob]]:
        taken: list[tuple[str, SharedJob]] = []
        while len(taken) < self.width and any(job.pending for job in jobs):
            for job in jobs:
                if job.pending and len(taken) < self.width:
                    taken.append((job.pending.pop(0), job))
        return [piece for piece, _ in taken], [job for _, job in taken]

    def run(self, pieces: list[str]) -> None:
        self.running.set()
        assert self.release.wait(10)
        if self.hold_from is not None and len(self.runs) >= self.hold_from:
            assert self.later.wait(10)
        self.runs.append(pieces)
        if self.fail_on in pieces:
            raise RuntimeError(f"run of {pieces} failed")


def start(fn, *args) -> Future:
    """``fn(*args)`` on a daemon thread: a test that fails with a job stuck does not hang the run."""
    future: Future = Future()

    def run() -> None:
        try:
            future.set_result(fn(*args))
        except BaseException as exc:  # noqa: BLE001 - the test reads it
            future.set_exception(exc)

    threading.Thread(target=run, daemon=True).start()
    return future


def queued(shared: SharedRuns, n: int) -> None:
    deadline = time.monotonic() + 10
    while len(shared.interactive.queued()) + len(shared.batch.queued()) < n:
        assert time.monotonic() < deadline, "the jobs did not queue"
        time.sleep(0.005)


def test_jobs_queued_together_share_runs_a_piece_each_in_turn_and_leave_when_theirs_are_done():
    """A job of three pieces and two of one, queued behind ``held``: the first run takes a piece
    of each, oldest first (width 2 leaves the third job's for the next), and the short jobs return while the
    long one still has pieces to run."""
    rec = Recorder(width=2, hold_from=1)
    shared = SharedRuns(rec.take, rec.run)
    jobs = [SharedJob(StepContext()) for _ in range(3)]
    pieces = [["a0", "a1", "a2"], ["b0"], ["c0"]]
    with shared.held():
        futures = [start(shared.join, job, p) for job, p in zip(jobs, pieces)]
        queued(shared, 3)
    assert futures[1].result(10) is None  # b is done after the first run, the second still held
    assert len(rec.runs) == 1 and not futures[0].done() and not futures[2].done()
    rec.later.set()
    for f in futures:
        assert f.result(10) is None
    assert rec.runs == [["a0", "b0"], ["a1", "c0"], ["a2"]]  # the oldest first in each turn
    assert all(job.done.is_set() and job.running == 0 and not job.pending for job in jobs)
    assert shared.interactive.jobs == [] and not shared.interactive.leading


def test_a_job_alone_runs_on_its_callers_thread_without_a_hand_over():
    callers = []
    shared = SharedRuns(lambda jobs: (jobs[0].pending.pop(0), jobs[:1]), lambda piece: callers.append(
        (piece, threading.get_ident())))
    shared.join(SharedJob(StepContext()), ["x", "y"])
    assert callers == [("x", threading.get_ident()), ("y", threading.get_ident())]


def test_an_exception_ends_every_job_in_the_run_and_no_other():
    """The run holding ``b0`` raises: its jobs (a and b) get the error; c, whose piece ran in
    the next run, is served."""
    rec = Recorder(width=2, fail_on="b0")
    shared = SharedRuns(rec.take, rec.run)
    jobs = [SharedJob(StepContext()) for _ in range(3)]
    with shared.held():
        futures = [start(shared.join, job, p) for job, p in zip(jobs, [["a0", "a1"], ["b0"], ["c0"]])]
        queued(shared, 3)
    for f in futures[:2]:
        with pytest.raises(RuntimeError, match="failed"):
            f.result(10)
    assert futures[2].result(10) is None
    assert rec.runs == [["a0", "b0"], ["c0"]]  # a's second piece is not run after its error


@pytest.mark.parametrize("long_runs", [True, False])
def test_a_queued_job_cancelled_leaves_at_once_where_runs_are_long_else_when_the_run_ends(long_runs):
    """While a run holds a's first piece, b (queued) is cancelled. With ``long_runs`` (a decode)
    b leaves at once (``Cancelled``, within the poll); without (a pass of milliseconds: no waiter
    polls) it leaves when that run ends, never in a later one. a's runs go on either way."""
    rec = Recorder(width=1)
    rec.release.clear()
    shared = SharedRuns(rec.take, rec.run, long_runs=long_runs)
    a, b = SharedJob(StepContext()), SharedJob(StepContext())
    first = start(shared.join, a, ["a0", "a1"])
    assert rec.running.wait(10)
    second = start(shared.join, b, ["b0"])
    queued(shared, 1)
    b.ctx.cancel()
    started = time.monotonic()
    if long_runs:
        with pytest.raises(Cancelled):
            second.result(5)
        assert time.monotonic() - started < 1
    else:
        time.sleep(0.3)
        assert not second.done()
    assert not first.done()
    rec.release.set()
    with pytest.raises(Cancelled):
        second.result(10)
    assert first.result(10) is None
    assert rec.runs == [["a0"], ["a1"]]


def test_batch_tier_work_shares_runs_in_a_lane_of_its_own():
    """A job with a pause gate queues in the batch lane: an interactive run going does not hold
    it, and it runs beside it."""
    rec = Recorder()
    rec.release.clear()
    shared = SharedRuns(rec.take, rec.run)
    interactive = start(shared.join, SharedJob(StepContext()), ["i0"])
    assert rec.running.wait(10)
    batch_ctx = StepContext(pause_gate=lambda ctx: None, pause_check=lambda: False)
    batch = SharedJob(batch_ctx)
    other = start(shared.join, batch, ["b0"])
    deadline = time.monotonic() + 10
    while not shared.batch.leading:  # it leads its own lane while the interactive run is held
        assert time.monotonic() < deadline
        time.sleep(0.005)
    rec.release.set()
    assert interactive.result(10) is None and other.result(10) is None
    assert sorted(map(tuple, rec.runs)) == [("b0",), ("i0",)]


def test_held_waits_for_the_run_going_then_holds_the_next():
    """``held`` entered while a's run is going waits for it to end (leaving then would start a
    second run beside it); while held, b queues and runs only once the block ends."""
    rec = Recorder()
    rec.release.clear()
    shared = SharedRuns(rec.take, rec.run)
    first = start(shared.join, SharedJob(StepContext()), ["a0"])
    assert rec.running.wait(10)
    entered, leave = threading.Event(), threading.Event()

    def hold() -> None:
        with shared.held():
            entered.set()
            assert leave.wait(10)

    holder = start(hold)
    time.sleep(0.2)
    assert not entered.is_set()  # a's run is still going
    rec.release.set()
    assert first.result(10) is None and entered.wait(10)
    second = start(shared.join, SharedJob(StepContext()), ["b0"])
    queued(shared, 1)
    time.sleep(0.1)
    assert rec.runs == [["a0"]] and not second.done()
    leave.set()
    assert holder.result(10) is None and second.result(10) is None
    assert rec.runs == [["a0"], ["b0"]]


class CountedEvent(threading.Event):
    """A job's ``done`` event that counts how often its caller looked at it: once per wake-up."""

    def __init__(self) -> None:
        super().__init__()
        self.looks = 0

    def is_set(self) -> bool:
        self.looks += 1
        return super().is_set()


def test_a_run_s_end_wakes_only_the_callers_it_concerns():
    """Sixteen one-piece jobs behind ``held``, two a run: each run's end wakes the two callers
    it finished and the one that leads next, not every waiting caller (which the condition's
    notify_all did: the caller of the job run last woke at every one of the eight runs' ends).
    Counted as each caller's looks at its ``done``: 2-3 each (40 in all), against 3-10 with
    notify_all (104)."""
    rec = Recorder(width=2)

    def run(pieces: list[str]) -> None:  # a pass of a few ms, as the encoders' are: waiters get the CPU meanwhile
        time.sleep(0.005)
        rec.run(pieces)

    shared = SharedRuns(rec.take, run)
    jobs = [SharedJob(StepContext(), done=CountedEvent()) for _ in range(16)]
    with shared.held():
        futures = [start(shared.join, job, [f"p{i}"]) for i, job in enumerate(jobs)]
        queued(shared, 16)
    for f in futures:
        assert f.result(10) is None
    assert len(rec.runs) == 8 and sorted(p for run in rec.runs for p in run) == sorted(f"p{i}" for i in range(16))
    looks = [job.done.looks for job in jobs]
    assert sum(looks) <= 4 * len(jobs), looks


class CancelledAsItWakes(threading.Event):
    """A job's ``wake`` whose job is cancelled just as its caller wakes: the caller woken to lead
    the next run leaves instead."""

    def __init__(self, ctx: StepContext) -> None:
        super().__init__()
        self.ctx = ctx

    def wait(self, timeout: float | None = None) -> bool:
        woke = super().wait(timeout)
        if woke:
            self.ctx.cancel()
        return woke


def test_a_caller_woken_to_lead_that_leaves_cancelled_wakes_the_next():
    """Where nothing polls (runs of milliseconds), a's run ends and wakes b, the oldest waiting,
    to lead; b is cancelled as it wakes and leaves, and must wake c to lead in its place, or c
    waits for ever."""
    rec = Recorder(width=1)
    rec.release.clear()
    shared = SharedRuns(rec.take, rec.run)
    b_ctx = StepContext()
    a, b, c = SharedJob(StepContext()), SharedJob(b_ctx, wake=CancelledAsItWakes(b_ctx)), SharedJob(StepContext())
    first = start(shared.join, a, ["a0"])
    assert rec.running.wait(10)
    second = start(shared.join, b, ["b0"])
    queued(shared, 1)
    third = start(shared.join, c, ["c0"])
    queued(shared, 2)
    rec.release.set()
    assert first.result(10) is None
    with pytest.raises(Cancelled):
        second.result(10)
    assert third.result(10) is None
    assert rec.runs == [["a0"], ["c0"]]
