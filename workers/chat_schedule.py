"""The transformers chat engine's scheduling decisions, as a pure function of a snapshot.

Before every step the engine thread (the owner, ``workers.chat.ChatWorker``) hands
:func:`plan_step` an :class:`EngineView`: the rows in the running batch, the rows waiting (new
ones, and paused ones keeping their tokens), the adapter stack merged into the weights now and
``max_num_seqs``. It returns a :class:`StepPlan`; it reads no clock, does no I/O, touches no
tensor and changes nothing, like ``arbiter.policy``. The owner carries the plan out in this order:
forget, pause, switch, admit; then it decodes one step for the batch.

Rules
    * Order. Rows are served by rank: the tier's priority (lower first), then arrival.
    * Cancelled waiting rows are forgotten. (A running row that is cancelled is not sampled again
      and leaves in the decode step: a cancel may arrive during the forward pass.)
    * Pause. A running row whose context asks to pause (batch work yielding to another tier)
      leaves the batch keeping its tokens and waits; a paused waiting row is not admitted. Once
      its pause lifts it is admitted like any other row, re-prefilling prompt + generated tokens.
    * Resuming in chunks. At most ``resume_chunk`` rows holding tokens (paused ones) are admitted
      per step, so a batch of hundreds resuming at once decodes between its re-prefills instead of
      prefilling them all before the next step, and a paid row that arrives meanwhile waits for at
      most one chunk (the owner also checks each row's pause flag right before its prefill, below).
      Each paused row is re-prefilled once per pause: a row the plan admits either joins the batch
      or, paused again before its prefill, stays waiting with its tokens, never prefilled.
    * One stack per batch. Rows of one forward pass share the weights, so every running row
      wants the merged stack. While the batch runs, only rows wanting that stack join it, and
      only those ranked ahead of every ready row that wants another stack: a stream of
      same-stack arrivals cannot starve other stacks.
    * Switching. Only when the batch has drained (after this plan's pauses) does the stack
      change: to that of the best ready row. Every ready row wanting that stack is then admitted
      in rank order, so queued requests with the same stack share one merge. A stack stays
      merged until a row wants another one.
    * Capacity. The batch never holds more than ``max_num_seqs`` rows.

The plan is a snapshot: the owner checks a row's pause flag again right before its prefill, so
a pause ordered while earlier rows prefill (a paid arrival while paused batch rows resume) holds
the rows not yet prefilled.

Prefills together (:func:`prefill_passes`). The admitted rows are prefilled in the plan's order,
and consecutive *plain* rows (a prompt of text alone, either new, with no prediction to check and
no prompt log probabilities to score, or resuming after a pause) share one forward pass,
left-padded to the longest, as a decode step's rows do: a burst of short requests, or a chunk of
batch rows resuming, costs about one pass, not one each. A pass holds at most ``PREFILL_TOKENS``
places (rows times the longest prompt) and is at most half padding; a row that would break either
starts the next pass. Every other row is a pass of its own, since its prefill does something for
that row alone (checks its prediction, scores its prompt, reads its images). A pass of rows that
all may pause (batch work) stops between two layers at a pause order, as a decode step of such
rows does; one with any row that may not pause runs to its end.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from workers.base import StackKey


@dataclass(frozen=True)
class Row:
    """One sequence as the scheduler sees it. ``arrival`` is unique per engine: its identity."""

    arrival: int
    priority: int = 0  # the tier's rank: 0 is the highest
    stack: StackKey = ()
    paused: bool = False  # its context asks it to pause now
    cancelled: bool = False
    resumes: bool = False  # it holds generated tokens: admitting it re-prefills prompt + tokens

    @property
    def rank(self) -> tuple[int, int]:
        """Lower is served first: the tier's priority, then arrival."""
        return (self.priority, self.arrival)


@dataclass(frozen=True)
class EngineView:
    stack: StackKey  # merged into the weights now
    running: tuple[Row, ...] = ()  # in the batch
    waiting: tuple[Row, ...] = ()  # new rows and paused ones
    max_num_seqs: int = 8
    resume_chunk: int = 4  # rows holding tokens admitted per step


PREFILL_TOKENS = 2048  # places (rows x the longest prompt) in one prefill pass of several rows


@dataclass(frozen=True)
class StepPlan:
    """What the owner does before the next decode step (rows named by ``arrival``)."""

    forget: tuple[int, ...] = ()  # waiting rows that were cancelled: drop them
    pause: tuple[int, ...] = ()  # running rows that leave the batch, keeping their tokens, to wait
    switch_to: StackKey | None = None  # merge this stack (restore for ()) before admitting
    admit: tuple[int, ...] = ()  # waiting rows to prefill into the batch, in this order


def plan_step(view: EngineView) -> StepPlan:
    forget = tuple(r.arrival for r in view.waiting if r.cancelled)
    pause = tuple(r.arrival for r in view.running if r.paused and not r.cancelled)
    staying = len(view.running) - len(pause)
    ready = sorted((r for r in view.waiting if not r.cancelled and not r.paused), key=lambda r: r.rank)
    if not ready:
        return StepPlan(forget, pause)
    stack, switch_to = view.stack, None
    if staying == 0 and ready[0].stack != view.stack:
        stack = switch_to = ready[0].stack
    # while a batch runs, a row of its stack may not overtake a ready row of another stack
    first_other = min((r.rank for r in ready if r.stack != stack), default=None)
    admit: list[int] = []
    resumed = 0
    for row in ready:
        if staying + len(admit) >= view.max_num_seqs:
            break
        if row.stack != stack or (staying and first_other is not None and row.rank > first_other):
            continue
        if row.resumes:
            if resumed >= view.resume_chunk:
                continue
            resumed += 1
        admit.append(row.arrival)
    return StepPlan(forget, pause, switch_to, tuple(admit))


@dataclass(frozen=True)
class Prefill:
    """An admitted row as its prefill sees it: ``length`` its prompt's tokens, ``plain`` whether it
    may share a pass (module docstring)."""

    arrival: int
    length: int
    plain: bool


def prefill_passes(rows: Sequence[Prefill], budget: int = PREFILL_TOKENS) -> list[tuple[int, ...]]:
    """The forward passes that prefill ``rows``, in their order: runs of plain rows together while
    the pass stays within ``budget`` places and at most half padding, every other row alone."""
    passes: list[tuple[int, ...]] = []
    run: list[Prefill] = []

    def close() -> None:
        if run:
            passes.append(tuple(r.arrival for r in run))
            run.clear()

    for row in rows:
        if not row.plain:
            close()
            passes.append((row.arrival,))
            continue
        if run:
            longest = max(row.length, *(r.length for r in run))
            places = longest * (len(run) + 1)
            if places > budget or places > 2 * (row.length + sum(r.length for r in run)):
                close()
        run.append(row)
    close()
    return passes
