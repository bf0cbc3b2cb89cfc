"""The admission gate: bounded in-flight slots handed to the best waiting request.

Waiters are ordered by tier, then arrival (one FIFO per tier: its lane). Every waiter has its own
future; when a slot frees, the gate marks the best eligible waiter as admitted *before* waking it,
so the slot is handed over directly: no broadcast wake-up, no polling, and no newcomer can barge
in. A waiter that leaves (client gone) stops counting at once and is skipped when it reaches the
front of its lane; if a slot had already been handed to it, the slot passes on to the next waiter.

A request is refused at once (:class:`Rejected`, HTTP 429) when its tier's queue is full, or when
its predicted wait exceeds its tier's latency target. The prediction uses :class:`CostModel`, a
per-model linear fit ``seconds = a + b * units`` over a sliding window of measured service times
(units: requested tokens for chat, pixels x steps for images, and so on), updated as requests
finish. Batch-tier requests are admitted only while no other tier is waiting or running.

The other tiers' demand (``others_busy``, which pauses batch work) starts at the door: a
non-batch request that passed :meth:`Gate.refuse_if_full` counts as an :class:`Arrival` while its
body is read, parsed and tokenized, until it reaches :meth:`Gate.acquire` or ``DOOR_WINDOW_S``
passes. Batch work in flight so stops while the request is still on its way, and that way is not
slowed by the batch's steps.

The SLO guard (``gateway/slo_guard.py``, a pure function) shrinks lower tiers' effective
``max_inflight`` while a higher tier's recent latency drifts toward its target, and lets it grow
back when that tier recovers; the endpoints report latencies with :meth:`Gate.observe_latency`.
The gate decides when a latency is reported and, while some tier is lowered, also on a timer at
the time the guard names (``next_decision_at``), so limits grow back after a slow spell even with
no traffic; with every tier at its limit no timer is set.

The gate is plain asyncio and single-threaded: all state changes happen on the event loop. It
reports its refusals and the guard's limit changes to the event stream (``arbiter.events``) and
keeps each tier's recent figures for the dashboard (``stats``, a :class:`TierStats`: the gate
records its refusals there; admissions and latencies are recorded by ``Services.hold``, per request,
off the gate's hot path). A request is counted admitted (``admitted``, the stats) once it holds its
model too (:meth:`Gate.holds_its_model`); one the arbiter refuses after the gate let it through
(``model_protected``, ``model_unavailable``) is counted refused instead (:meth:`Gate.turned_back`),
as the gate's own refusals are.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

from arbiter.events import EventLog
from gateway.deadlines import Deadline, Deadlines
from gateway.slo_guard import GuardSettings, TierWindow, next_decision_at, next_limits
from gateway.tier_stats import TierStats

MAX_RETRY_AFTER_S = 120
# why a tier's requests were refused: at the gate (queue_full, latency_target), or by the arbiter past it
# (key_limit: a 429 of the key's own limits, docs/ACCOUNTS.md, counted by ``key_refused``)
REFUSALS = ("queue_full", "latency_target", "model_protected", "model_unavailable", "key_limit")
DOOR_WINDOW_S = 0.05  # an arrival counts as demand at most this long before it reaches ``acquire``


@dataclass(frozen=True)
class TierPolicy:
    name: str
    rank: int  # 0 is the highest tier
    max_inflight: int
    max_queued: int
    latency_target_s: float
    is_batch: bool = False
    token_latency_target_s: float | None = None  # text replies: seconds per token after the first (the SLO guard's)


class Rejected(Exception):
    """Refused at the door; ``retry_after`` is in seconds (1..120)."""

    def __init__(self, tier: str, reason: str, retry_after: float, message: str) -> None:
        super().__init__(message)
        self.tier = tier
        self.reason = reason  # "queue_full" | "latency_target"
        self.retry_after = retry_after


class CostModel:
    """Per-model service time as a linear function of request size, fitted by least squares over
    the last ``window`` measurements. Until a model has two distinct sizes measured it predicts
    the mean of what it has seen (or ``prior_s`` before anything). Each observation updates the
    fit in O(1) from running sums (:class:`_Window`)."""

    def __init__(self, window: int = 64, prior_s: float = 1.0) -> None:
        self.window = window
        self.prior_s = prior_s
        self._obs: dict[str, _Window] = {}

    def observe(self, model: str, units: float, seconds: float) -> None:
        obs = self._obs.get(model)
        if obs is None:
            obs = self._obs[model] = _Window(self.window)
        obs.add(units, seconds)

    def predict(self, model: str, units: float) -> float:
        obs = self._obs.get(model)
        if obs is None:
            return self.prior_s
        seconds = obs.a + obs.b * units
        return seconds if seconds > 0.0 else 0.0


class _Window:
    """The last ``size`` (units, seconds) pairs, the sums a least-squares line needs, and the line
    itself (``seconds = a + b * units``), kept up to date as pairs enter and leave. Sums are taken
    about an origin (the oldest pair's values when they were last recomputed: a shift that leaves
    the slope unchanged and keeps the sums small), and recomputed from the pairs every ``size``
    additions so that floating-point drift from subtracting cannot build up. It is on every
    release's path, so :meth:`add` works in local variables."""

    __slots__ = ("pairs", "size", "a", "b", "_since_exact", "_u0", "_s0", "_su", "_ss", "_suu", "_sus")

    def __init__(self, size: int) -> None:
        self.pairs: deque[tuple[float, float]] = deque()
        self.size = size
        self.a = self.b = 0.0
        self._since_exact = 0
        self._u0 = self._s0 = 0.0
        self._su = self._ss = self._suu = self._sus = 0.0

    def add(self, units: float, seconds: float) -> None:
        """Take one pair in (and the oldest out, past ``size``) and refit."""
        pairs = self.pairs
        if not pairs:
            self._u0 = float(units)
            self._s0 = float(seconds)
        pairs.append((units, seconds))
        u0 = self._u0
        s0 = self._s0
        u = units - u0
        s = seconds - s0
        su = self._su + u
        ss = self._ss + s
        suu = self._suu + u * u
        sus = self._sus + u * s
        if len(pairs) > self.size:  # the oldest pair leaves as this one enters
            u, s = pairs.popleft()
            u -= u0
            s -= s0
            su -= u
            ss -= s
            suu -= u * u
            sus -= u * s
        self._since_exact += 1
        if self._since_exact >= self.size:
            u0, s0, su, ss, suu, sus = self._exact()
        self._su = su
        self._ss = ss
        self._suu = suu
        self._sus = sus
        n = len(pairs)
        mu = su / n
        ms = ss / n
        var = suu - mu * su  # n x the variance of the units
        cov = sus - mu * ss
        if var <= 1e-12 * suu or cov <= 0.0:  # one size only, or bigger is not slower: the mean
            self.a = ms + s0
            self.b = 0.0
        else:
            self.b = b = cov / var
            self.a = ms + s0 - b * (mu + u0)

    def _exact(self) -> tuple[float, float, float, float, float, float]:
        """A new origin (the oldest pair) and the sums recomputed about it."""
        self._since_exact = 0
        units, seconds = self.pairs[0]
        u0 = self._u0 = float(units)
        s0 = self._s0 = float(seconds)
        su = ss = suu = sus = 0.0
        for units, seconds in self.pairs:
            u = units - u0
            s = seconds - s0
            su += u
            ss += s
            suu += u * u
            sus += u * s
        return u0, s0, su, ss, suu, sus


@dataclass(eq=False, slots=True)
class Ticket:
    """A request's place at the gate: waiting for a slot, then holding one until released."""

    tier: TierPolicy
    model: str
    units: float
    cost: float  # predicted service seconds when admitted
    lane: _Lane = field(repr=False)  # its tier's place at the gate
    queued_s: float = 0.0
    started: float = 0.0  # when it was admitted (while it waits: when it arrived)
    released: bool = False
    waiter: asyncio.Future | None = field(default=None, repr=False)  # set while it counts as queued


@dataclass(eq=False, slots=True)
class Arrival:
    """A non-batch request between the door and :meth:`Gate.acquire`: demand that pauses batch
    work. It ends when the request reaches ``acquire`` (as a ticket it counts on), when it fails
    on the way, or after ``DOOR_WINDOW_S`` (a slow body read: the pause then waits for ``acquire``)."""

    window: Deadline | None = None  # DOOR_WINDOW_S from its arrival
    ended: bool = False


@dataclass(eq=False, slots=True)
class _Lane:
    """One tier at the gate: its FIFO of waiting tickets and its counts. A ticket that leaves the
    queue (client gone) stops counting at once and is skipped when it reaches the front."""

    policy: TierPolicy
    limit: int  # effective max_inflight (the SLO guard's)
    is_batch: bool
    queue: deque[Ticket] = field(default_factory=deque)
    waiting: int = 0  # tickets in ``queue`` that have not left
    queued_cost: float = 0.0  # their predicted costs
    inflight: int = 0
    running_cost: float = 0.0  # the predicted costs of its admitted tickets
    running_started: float = 0.0  # the sum of their start times
    admitted: int = 0
    above: list[_Lane] = field(default_factory=list)  # this lane and the lanes of higher tiers


class Gate:
    def __init__(
        self,
        tiers: list[TierPolicy],
        slots: int,
        costs: CostModel | None = None,
        clock: Callable[[], float] = time.monotonic,
        guard: GuardSettings | None = None,
        events: EventLog | None = None,
    ) -> None:
        self.tiers = {t.name: t for t in tiers}
        self.slots = slots
        self.costs = costs or CostModel()
        self.clock = clock
        self._order = [_Lane(t, t.max_inflight, t.is_batch) for t in sorted(tiers, key=lambda t: t.rank)]
        self._lanes = {lane.policy.name: lane for lane in self._order}
        for lane in self._order:
            lane.above = [u for u in self._order if u.policy.rank <= lane.policy.rank]
        self.total_inflight = 0
        self._nonbatch_running = 0  # admitted non-batch tickets
        self._nonbatch_queued = 0  # waiting non-batch requests
        self._arriving = 0  # non-batch requests past the door, not yet at ``acquire`` (Arrival)
        self._waiting = 0  # waiting requests, all tiers
        self._running_cost = 0.0  # sum of predicted costs of admitted non-batch tickets
        self._running_started = 0.0  # sum of their start times
        # Told whenever ``others_busy()`` flips (the arbiter pauses or resumes batch work then).
        self.on_change: Callable[[], None] | None = None
        self._told_busy = False  # what on_change was last told
        self.rejected = {(t.name, r): 0 for t in tiers for r in REFUSALS}
        self.guard = guard or GuardSettings(enabled=False)
        self._latencies: dict[str, deque[tuple[float, float]]] = {t.name: deque() for t in tiers}
        self._token_latencies: dict[str, deque[tuple[float, float]]] = {t.name: deque() for t in tiers}
        self._guarded_at = -math.inf
        self._guard_timer: asyncio.TimerHandle | None = None  # the next decision, while some tier is lowered
        self._loop: asyncio.AbstractEventLoop | None = None
        self._door_windows = Deadlines(DOOR_WINDOW_S)
        self.events = events or EventLog()
        self.stats = TierStats(list(self.tiers), clock)  # admitted, refused, latency; recent

    # -- public ------------------------------------------------------------------------------
    @property
    def inflight(self) -> dict[str, int]:
        return {name: lane.inflight for name, lane in self._lanes.items()}

    @property
    def admitted(self) -> dict[str, int]:
        return {name: lane.admitted for name, lane in self._lanes.items()}

    @property
    def limits(self) -> dict[str, int]:
        """Each tier's effective max_inflight (the SLO guard's)."""
        return {name: lane.limit for name, lane in self._lanes.items()}

    def queued(self, tier: str) -> int:
        return self._lanes[tier].waiting

    def others_busy(self) -> bool:
        """True while any non-batch tier has work admitted, queued or on its way from the door."""
        return self._nonbatch_running > 0 or self._nonbatch_queued > 0 or self._arriving > 0

    def refuse_if_full(self, tier: str) -> None:
        """Refuse (``Rejected``, queue_full) a request that could neither start nor queue now,
        before anything is spent on it (reading and parsing its body): under a flood this is
        most requests, and the work saved is the other tiers' latency."""
        lane = self._lanes[tier]
        policy = lane.policy
        if not self._can_start(lane) and lane.waiting >= policy.max_queued:
            self._reject_tier(policy, None, "queue_full", self.predict_wait(policy),
                              f"the {tier} tier's queue is full ({policy.max_queued} waiting)")

    def arrive(self, tier: str) -> Arrival | None:
        """A request of ``tier`` passed the door (``refuse_if_full``): a non-batch one counts as
        demand from now on (batch work pauses) until :meth:`acquire` takes its ``Arrival``, or
        :meth:`left` ends it, or ``DOOR_WINDOW_S`` passes."""
        if self._lanes[tier].is_batch:
            return None
        arrival = Arrival()
        self._arriving += 1
        if not self._told_busy:
            self._changed()
        windows = self._door_windows
        if windows.seconds != DOOR_WINDOW_S:  # changed since (tests)
            windows = self._door_windows = Deadlines(DOOR_WINDOW_S)
        arrival.window = windows.after(self.left, arrival)
        return arrival

    def left(self, arrival: Arrival | None) -> None:
        """``arrival`` stops counting as demand (idempotent)."""
        if arrival is None or arrival.ended:
            return
        arrival.ended = True
        arrival.window.cancel()
        self._arriving -= 1
        if self._told_busy and not self.others_busy():
            if self._waiting:
                self._dispatch()  # batch may have been waiting on it
            self._changed()

    async def acquire(self, tier: str, model: str, units: float = 1.0, arrival: Arrival | None = None) -> Ticket:
        """Wait for a slot (or be refused); ``arrival``, the request's from :meth:`arrive`,
        ends once the ticket counts as demand in its place."""
        lane = self._lanes[tier]
        policy = lane.policy
        ticket = Ticket(policy, model, units, self.costs.predict(model, units), lane)
        now = self.clock()
        if self._can_start(lane):
            self._start(ticket, lane, now)
            self.left(arrival)
            return ticket
        wait = self._wait_behind(lane, now)
        if lane.waiting >= policy.max_queued:
            self.left(arrival)
            self._reject(ticket, "queue_full", wait, f"the {tier} tier's queue is full ({policy.max_queued} waiting)")
        if not lane.is_batch and wait > policy.latency_target_s:
            self.left(arrival)
            self._reject(
                ticket, "latency_target", wait - policy.latency_target_s,
                f"predicted wait {wait:.1f}s exceeds the {tier} tier's latency target of "
                f"{policy.latency_target_s:g}s",
            )
        future = ticket.waiter = self._event_loop().create_future()
        ticket.started = now
        lane.queue.append(ticket)
        lane.waiting += 1
        lane.queued_cost += ticket.cost
        self._waiting += 1
        if not lane.is_batch:
            self._nonbatch_queued += 1
            if not self._told_busy:
                self._changed()
        self.left(arrival)
        try:
            await future
        except asyncio.CancelledError:
            if future.done() and not future.cancelled():
                self.release(ticket)  # handed over just as we left: pass it on
            else:
                self._leave(ticket, lane)
            raise
        return ticket

    def holds_its_model(self, tier: str) -> None:
        """A request the gate let through holds its model too: admitted, for ``/metrics`` and the
        dashboard (counted here, not as the gate lets it through, so that one the arbiter then
        refuses counts once, as refused, and the counter never goes back)."""
        self._lanes[tier].admitted += 1
        self.stats.admitted(tier)

    def turned_back(self, ticket: Ticket, reason: str) -> None:
        """The arbiter refused the model of a request the gate let through (``model_protected``,
        ``model_unavailable``; it reported the refusal to the event stream): its slot given back,
        counted refused with the gate's own refusals."""
        self.release(ticket)
        tier = ticket.tier.name
        self.rejected[(tier, reason)] += 1
        self.stats.refused(tier, reason)

    def key_refused(self, tier: str) -> None:
        """A request of ``tier`` refused (429) by its key's own limits before it asked for a slot:
        counted refused (``key_limit``) beside the gate's refusals, so that an operator sees why a
        tier's callers get 429s (no event: one key over its limit may be refused many times a second)."""
        self.rejected[(tier, "key_limit")] += 1
        self.stats.refused(tier, "key_limit")

    def release(self, ticket: Ticket, measured_s: float | None = None) -> None:
        """Give the slot back; ``measured_s`` (service time) feeds the cost model."""
        if ticket.released:
            return
        ticket.released = True
        lane = ticket.lane
        lane.inflight -= 1
        lane.running_cost -= ticket.cost
        lane.running_started -= ticket.started
        self.total_inflight -= 1
        if not lane.is_batch:
            self._nonbatch_running -= 1
            self._running_cost -= ticket.cost
            self._running_started -= ticket.started
        if measured_s is not None:
            self.costs.observe(ticket.model, ticket.units, measured_s)
        if self._waiting:
            self._dispatch()
        if self._told_busy and not (self._nonbatch_running or self._nonbatch_queued or self._arriving):
            self._changed()

    def observe_latency(self, tier: str, seconds: float) -> None:
        """A finished (or first-token) latency of ``tier``, for the SLO guard's window. Every
        request reports one, so the guard also decides here when no higher tier is busy."""
        if self.guard.enabled:
            self._latencies[tier].append((self.clock(), seconds))
            self._retune()

    def observe_token_latency(self, tier: str, seconds: float) -> None:
        """A finished text reply's mean time per token after its first, for the SLO guard's
        token-latency window (judged only where the tier has ``token_latency_target_s``)."""
        if self.guard.enabled:
            self._token_latencies[tier].append((self.clock(), seconds))
            self._retune()

    def _retune(self, due: bool = False) -> None:
        """At most once per ``interval_s`` (``due``: the guard's timer, set no earlier than that):
        drop latencies older than the window, let the guard set every tier's effective
        ``max_inflight`` (grown limits hand out slots at once) and set the timer for the next
        decision should no latency come first (none while every tier is at its limit)."""
        now = self.clock()
        if not due and now - self._guarded_at < self.guard.interval_s:
            return
        self._guarded_at = now
        guard = self.guard
        windows = []
        for lane in self._order:
            t = lane.policy
            recent, tokens = self._latencies[t.name], self._token_latencies[t.name]
            for window in (recent, tokens):
                while window and window[0][0] + guard.window_s <= now:  # aged out (slo_guard.in_window)
                    window.popleft()
            windows.append(TierWindow(t.name, t.rank, t.latency_target_s, t.max_inflight, t.is_batch,
                                      recent, t.token_latency_target_s, tokens))
        before = self.limits
        limits = next_limits(windows, before, guard, now)
        for name, limit in limits.items():
            self._lanes[name].limit = limit
        if limits != before:
            self.events.emit("limits_changed", limits=dict(limits), before=dict(before))
        if any(limits[n] > before[n] for n in before):
            self._dispatch()
        self._set_guard_timer(next_decision_at(windows, limits, guard, now), now)

    def _set_guard_timer(self, at: float | None, now: float) -> None:
        """Decide again at ``at`` (the gate's clock; None: only when a latency is reported)."""
        if self._guard_timer is not None:
            self._guard_timer.cancel()
            self._guard_timer = None
        if at is None:
            return
        try:
            loop = self._event_loop()
        except RuntimeError:  # told outside a running loop (tests): the next reported latency decides
            return
        self._guard_timer = loop.call_later(max(0.0, at - now), self._guard_due)

    def _guard_due(self) -> None:
        self._guard_timer = None
        self._retune(due=True)

    async def stop(self) -> None:
        """The server's shutdown: no more decisions on the guard's timer."""
        self._set_guard_timer(None, 0.0)

    def predict_wait(self, policy: TierPolicy) -> float:
        """Seconds until a request of ``policy``'s tier arriving now would start: the remaining
        work of everything running plus everything queued at its tier or above, over the slots;
        for a tier at its own (effective) ``max_inflight``, its own remaining and queued work over
        that limit where that is longer (its requests pass through that many slots, not all)."""
        lane = self._lanes[policy.name]
        if self._can_start(lane):
            return 0.0
        return self._wait_behind(lane, self.clock())

    def _wait_behind(self, lane: _Lane, now: float) -> float:
        """``predict_wait`` for a request that cannot start now."""
        running_left = self._running_cost - (self._nonbatch_running * now - self._running_started)
        ahead = 0.0
        for other in lane.above:
            ahead += other.queued_cost
        wait = ((running_left if running_left > 0.0 else 0.0) + ahead) / self.slots
        if lane.inflight >= lane.limit:  # held at its own limit: its work passes through lane.limit slots
            own_left = lane.running_cost - (lane.inflight * now - lane.running_started)
            own = ((own_left if own_left > 0.0 else 0.0) + lane.queued_cost) / lane.limit
            if own > wait:
                return own
        return wait

    def rate_headers(self, tier: str, refused_for: float | None = None) -> dict[str, str]:
        """OpenAI's ``x-ratelimit-*-requests`` for ``tier``: its requests at once (``max_inflight +
        max_queued``) and how many of them are free now. On a refusal (the gate's, or the
        arbiter's for a protected model: ``refused_for`` is its Retry-After) none is: remaining
        0, and the reset is that Retry-After."""
        lane = self._lanes[tier]
        limit = lane.policy.max_inflight + lane.policy.max_queued
        if refused_for is not None:
            remaining, reset = 0, int(refused_for)  # as Retry-After is written
        else:
            remaining, reset = max(limit - lane.inflight - lane.waiting, 0), 0
        return {
            "x-ratelimit-limit-requests": str(limit),
            "x-ratelimit-remaining-requests": str(remaining),
            "x-ratelimit-reset-requests": f"{reset}s",
        }

    # -- internals -----------------------------------------------------------------------------
    def _can_start(self, lane: _Lane) -> bool:
        """Batch work yields at its next step when others arrive, so its slots do not count
        against the other tiers, nor ``slots`` against it (an idle engine takes as many batch rows
        as it is wide: the batch tier's ``max_inflight`` is its limit); batch itself starts only
        while the others are idle."""
        if lane.inflight >= lane.limit:
            return False
        if lane.is_batch:
            return not (self._nonbatch_running or self._nonbatch_queued or self._arriving)
        return self._nonbatch_running < self.slots

    def _start(self, ticket: Ticket, lane: _Lane, now: float) -> None:
        ticket.started = now
        lane.inflight += 1
        lane.running_cost += ticket.cost
        lane.running_started += now
        self.total_inflight += 1
        if not lane.is_batch:
            self._nonbatch_running += 1
            self._running_cost += ticket.cost
            self._running_started += now
            if not self._told_busy:
                self._changed()

    def _event_loop(self) -> asyncio.AbstractEventLoop:
        """The loop the gate runs on, looked up once: ``asyncio.get_running_loop()`` costs a
        system call (``getpid``) each time, and the gate is single-threaded on one loop."""
        loop = self._loop
        if loop is None or not loop.is_running():  # first use, or a new loop (tests)
            loop = self._loop = asyncio.get_running_loop()
        return loop

    def _dispatch(self) -> None:
        """Hand free slots to the best waiters: highest tier first, FIFO within a tier. Each is
        admitted (counted, its future resolved) before it runs again, so nobody can barge in."""
        now = None
        for lane in self._order:
            queue = lane.queue
            while queue and self._can_start(lane):
                ticket = queue.popleft()
                future = ticket.waiter
                if future is None:  # it left while queued
                    continue
                self._dequeued(ticket, lane)
                if future.done():  # cancelled, its task not yet run: it has left
                    continue
                if now is None:
                    now = self.clock()
                ticket.queued_s = now - ticket.started
                self._start(ticket, lane, now)
                future.set_result(None)
            if self._nonbatch_running >= self.slots:
                return  # no slot for anyone below (nor for batch, which waits for the others to be idle)

    def _leave(self, ticket: Ticket, lane: _Lane) -> None:
        if ticket.waiter is not None:  # still counted in its queue: stop counting it
            self._dequeued(ticket, lane)
            if len(lane.queue) > 2 * lane.waiting + 16:  # drop the tickets that left
                kept = [t for t in lane.queue if t.waiter is not None]
                lane.queue.clear()
                lane.queue.extend(kept)
        self._dispatch()  # a lower tier (batch) may have been waiting on this one
        self._changed()

    def _dequeued(self, ticket: Ticket, lane: _Lane) -> None:
        ticket.waiter = None
        lane.waiting -= 1
        lane.queued_cost -= ticket.cost
        self._waiting -= 1
        if not lane.is_batch:
            self._nonbatch_queued -= 1

    def _changed(self) -> None:
        """Tell ``on_change`` when the other tiers' demand flips between busy and idle."""
        busy = self._nonbatch_running > 0 or self._nonbatch_queued > 0 or self._arriving > 0
        if busy != self._told_busy:
            self._told_busy = busy
            if self.on_change is not None:
                self.on_change()

    def _reject(self, ticket: Ticket, reason: str, retry_after: float, message: str) -> None:
        self._reject_tier(ticket.tier, ticket.model, reason, retry_after, message)

    def _reject_tier(self, policy: TierPolicy, model: str | None, reason: str, retry_after: float,
                     message: str) -> None:
        self.rejected[(policy.name, reason)] += 1
        seconds = min(max(math.ceil(retry_after), 1), MAX_RETRY_AFTER_S)
        self.stats.refused(policy.name, reason)
        self.events.emit("refusal", tier=policy.name, model=model, reason=reason, retry_after_s=seconds)
        raise Rejected(policy.name, reason, seconds, message)
