"""The admission gate: bounded in-flight slots handed to the best waiting request.

Waiters are ordered by tier, then arrival (one FIFO per tier). Every waiter has its own future;
when a slot frees, the gate marks the best eligible waiter as admitted *before* waking it, so the
slot is handed over directly: no broadcast wake-up, no polling, and no newcomer can barge in. A
waiter that leaves (client gone) is removed from its queue; if a slot had already been handed to
it, the slot passes on to the next waiter.

A request is refused at once (:class:`Rejected`, HTTP 429) when its tier's queue is full, or when
its predicted wait exceeds its tier's latency target. The prediction uses :class:`CostModel`, a
per-model linear fit ``seconds = a + b * units`` over a sliding window of measured service times
(units: requested tokens for chat, pixels x steps for images, and so on), updated as requests
finish. Batch-tier requests are admitted only while no other tier is waiting or running.

The SLO guard (``gateway/slo_guard.py``, a pure function) shrinks lower tiers' effective
``max_inflight`` while a higher tier's recent latency drifts toward its target, and lets it grow
back when that tier recovers; the endpoints report latencies with :meth:`Gate.observe_latency`.

The gate is plain asyncio and single-threaded: all state changes happen on the event loop.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Callable

from gateway.slo_guard import GuardSettings, TierWindow, next_limits

MAX_RETRY_AFTER_S = 120


@dataclass(frozen=True)
class TierPolicy:
    name: str
    rank: int  # 0 is the highest tier
    max_inflight: int
    max_queued: int
    latency_target_s: float
    is_batch: bool = False


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
        self._fit: dict[str, tuple[float, float]] = {}

    def observe(self, model: str, units: float, seconds: float) -> None:
        obs = self._obs.get(model)
        if obs is None:
            obs = self._obs[model] = _Window(self.window)
        self._fit[model] = obs.add(float(units), float(seconds))

    def predict(self, model: str, units: float) -> float:
        a, b = self._fit.get(model, (self.prior_s, 0.0))
        return max(a + b * units, 0.0)


class _Window:
    """The last ``size`` (units, seconds) pairs and the sums a least-squares line needs, kept up
    to date as pairs enter and leave. Sums are taken about the first pair's values (a shift
    that leaves the slope unchanged and keeps the sums small), and recomputed from the pairs
    every ``size`` additions so that floating-point drift from subtracting cannot build up."""

    def __init__(self, size: int) -> None:
        self.pairs: deque[tuple[float, float]] = deque()
        self.size = size
        self._since_exact = 0
        self._u0 = self._s0 = 0.0
        self._su = self._ss = self._suu = self._sus = 0.0

    def add(self, units: float, seconds: float) -> tuple[float, float]:
        """Take one pair in (and the oldest out, past ``size``); returns the new fit."""
        pairs = self.pairs
        if not pairs:
            self._u0, self._s0 = units, seconds
        pairs.append((units, seconds))
        u, s = units - self._u0, seconds - self._s0
        if len(pairs) > self.size:  # the oldest pair leaves as this one enters
            old_u, old_s = pairs.popleft()
            old_u -= self._u0
            old_s -= self._s0
            self._su += u - old_u
            self._ss += s - old_s
            self._suu += u * u - old_u * old_u
            self._sus += u * s - old_u * old_s
        else:
            self._shift(u, s, 1.0)
        self._since_exact += 1
        if self._since_exact >= self.size:
            self._exact()
        return self.fit()

    def fit(self) -> tuple[float, float]:
        n = len(self.pairs)
        mu, ms = self._su / n, self._ss / n
        var = self._suu - n * mu * mu
        cov = self._sus - n * mu * ms
        if var <= 1e-12 * max(self._suu, 1e-300):
            return ms + self._s0, 0.0
        b = max(cov / var, 0.0)  # bigger requests never predicted faster
        return ms + self._s0 - b * (mu + self._u0), b

    def _shift(self, u: float, s: float, sign: float) -> None:
        """Add (sign 1) or take away (-1) one pair, already shifted by (u0, s0)."""
        self._su += sign * u
        self._ss += sign * s
        self._suu += sign * u * u
        self._sus += sign * u * s

    def _exact(self) -> None:
        self._since_exact = 0
        self._u0, self._s0 = self.pairs[0]
        self._su = self._ss = self._suu = self._sus = 0.0
        for u, s in self.pairs:
            self._shift(u - self._u0, s - self._s0, 1.0)


@dataclass(eq=False, slots=True)
class Ticket:
    """An admitted request's hold on one slot."""

    tier: TierPolicy
    model: str
    units: float
    cost: float  # predicted service seconds when admitted
    queued_s: float = 0.0
    started: float = 0.0
    released: bool = False


@dataclass(eq=False, slots=True)
class _Waiter:
    ticket: Ticket
    future: asyncio.Future = field(repr=False)
    arrived: float = 0.0


class Gate:
    def __init__(
        self,
        tiers: list[TierPolicy],
        slots: int,
        costs: CostModel | None = None,
        clock: Callable[[], float] = time.monotonic,
        guard: GuardSettings | None = None,
    ) -> None:
        self.tiers = {t.name: t for t in tiers}
        self._order = sorted(tiers, key=lambda t: t.rank)
        self.slots = slots
        self.costs = costs or CostModel()
        self.clock = clock
        self._queues: dict[str, OrderedDict[_Waiter, None]] = {t.name: OrderedDict() for t in tiers}
        self._queued_cost = {t.name: 0.0 for t in tiers}
        self._at_or_above = {t.name: [u.name for u in self._order if u.rank <= t.rank] for t in tiers}
        self.inflight = {t.name: 0 for t in tiers}
        self.total_inflight = 0
        self._nonbatch_running = 0  # admitted non-batch tickets
        self._nonbatch_queued = 0  # waiting non-batch requests
        self._waiting = 0  # waiting requests, all tiers
        self._running_cost = 0.0  # sum of predicted costs of admitted non-batch tickets
        self._running_started = 0.0  # sum of their start times
        self.admitted = {t.name: 0 for t in tiers}
        # Told whenever ``others_busy()`` flips (the arbiter pauses or resumes batch work then).
        self.on_change: Callable[[], None] | None = None
        self._told_busy = False  # what on_change was last told
        self.rejected = {(t.name, r): 0 for t in tiers for r in ("queue_full", "latency_target")}
        self.guard = guard or GuardSettings(enabled=False)
        self.limits = {t.name: t.max_inflight for t in tiers}  # effective max_inflight (the SLO guard's)
        self._latencies: dict[str, deque[tuple[float, float]]] = {t.name: deque() for t in tiers}
        self._guarded_at = -math.inf

    # -- public ------------------------------------------------------------------------------
    def queued(self, tier: str) -> int:
        return len(self._queues[tier])

    def others_busy(self) -> bool:
        """True while any non-batch tier has work admitted or queued."""
        return self._nonbatch_running > 0 or self._nonbatch_queued > 0

    def refuse_if_full(self, tier: str) -> None:
        """Refuse (``Rejected``, queue_full) a request that could neither start nor queue now,
        before anything is spent on it (reading and parsing its body): under a flood this is
        most requests, and the work saved is the other tiers' latency."""
        policy = self.tiers[tier]
        if not self._can_start(policy) and len(self._queues[tier]) >= policy.max_queued:
            self._reject_tier(policy, "queue_full", self.predict_wait(policy),
                              f"the {tier} tier's queue is full ({policy.max_queued} waiting)")

    async def acquire(self, tier: str, model: str, units: float = 1.0) -> Ticket:
        policy = self.tiers[tier]
        ticket = Ticket(policy, model, units, self.costs.predict(model, units))
        now = self.clock()
        if self._can_start(policy):
            self._start(ticket, now)
            return ticket
        queue = self._queues[tier]
        wait = self._wait_behind(policy, now)
        if len(queue) >= policy.max_queued:
            self._reject(ticket, "queue_full", wait, f"the {tier} tier's queue is full ({policy.max_queued} waiting)")
        if not policy.is_batch and wait > policy.latency_target_s:
            self._reject(
                ticket, "latency_target", wait - policy.latency_target_s,
                f"predicted wait {wait:.1f}s exceeds the {tier} tier's latency target of "
                f"{policy.latency_target_s:g}s",
            )
        waiter = _Waiter(ticket, asyncio.get_running_loop().create_future(), now)
        queue[waiter] = None
        self._queued_cost[tier] += ticket.cost
        self._waiting += 1
        if not policy.is_batch:
            self._nonbatch_queued += 1
            if not self._told_busy:
                self._changed()
        try:
            await waiter.future
        except asyncio.CancelledError:
            if waiter.future.done() and not waiter.future.cancelled():
                self.release(ticket)  # handed over just as we left: pass it on
            else:
                self._leave(waiter)
            raise
        return ticket

    def release(self, ticket: Ticket, measured_s: float | None = None) -> None:
        """Give the slot back; ``measured_s`` (service time) feeds the cost model."""
        if ticket.released:
            return
        ticket.released = True
        self.inflight[ticket.tier.name] -= 1
        self.total_inflight -= 1
        if not ticket.tier.is_batch:
            self._nonbatch_running -= 1
            self._running_cost -= ticket.cost
            self._running_started -= ticket.started
        if measured_s is not None:
            self.costs.observe(ticket.model, ticket.units, measured_s)
        if self._waiting:
            self._dispatch()
        if self._told_busy and not (self._nonbatch_running or self._nonbatch_queued):
            self._changed()

    def observe_latency(self, tier: str, seconds: float) -> None:
        """A finished (or first-token) latency of ``tier``, for the SLO guard's window. Every
        request reports one, so the guard also decides here when no higher tier is busy."""
        if self.guard.enabled:
            self._latencies[tier].append((self.clock(), seconds))
            self._retune()

    def _retune(self) -> None:
        """At most once per ``interval_s``: drop latencies older than the window and let the
        guard set every tier's effective ``max_inflight``; grown limits hand out slots at once."""
        now = self.clock()
        if now - self._guarded_at < self.guard.interval_s:
            return
        self._guarded_at = now
        horizon = now - self.guard.window_s
        windows = []
        for t in self._order:
            recent = self._latencies[t.name]
            while recent and recent[0][0] < horizon:
                recent.popleft()
            windows.append(TierWindow(t.name, t.rank, t.latency_target_s, t.max_inflight, t.is_batch,
                                      [seconds for _, seconds in recent]))
        before = self.limits
        self.limits = next_limits(windows, before, self.guard)
        if any(self.limits[n] > before[n] for n in before):
            self._dispatch()

    def predict_wait(self, policy: TierPolicy) -> float:
        """Seconds until a request of ``policy``'s tier arriving now would start: the remaining
        work of everything running plus everything queued at its tier or above, over the slots."""
        if self._can_start(policy):
            return 0.0
        return self._wait_behind(policy, self.clock())

    def _wait_behind(self, policy: TierPolicy, now: float) -> float:
        """``predict_wait`` for a request that cannot start now."""
        running_left = self._running_cost - (self._nonbatch_running * now - self._running_started)
        ahead = 0.0
        for name in self._at_or_above[policy.name]:
            ahead += self._queued_cost[name]
        return ((running_left if running_left > 0.0 else 0.0) + ahead) / self.slots

    def rate_headers(self, tier: str, refused_for: float | None = None) -> dict[str, str]:
        """OpenAI's ``x-ratelimit-*-requests`` for ``tier``: its requests at once (``max_inflight +
        max_queued``) and how many of them are free now. On a refusal (the gate's, or the
        arbiter's for a protected model: ``refused_for`` is its Retry-After) none is: remaining
        0, and the reset is that Retry-After."""
        policy = self.tiers[tier]
        limit = policy.max_inflight + policy.max_queued
        if refused_for is not None:
            remaining, reset = 0, int(refused_for)  # as Retry-After is written
        else:
            remaining, reset = max(limit - self.inflight[tier] - len(self._queues[tier]), 0), 0
        return {
            "x-ratelimit-limit-requests": str(limit),
            "x-ratelimit-remaining-requests": str(remaining),
            "x-ratelimit-reset-requests": f"{reset}s",
        }

    # -- internals -----------------------------------------------------------------------------
    def _can_start(self, policy: TierPolicy) -> bool:
        """Batch work yields at its next step when others arrive, so its slots do not count
        against the other tiers; batch itself starts only while the others are idle."""
        if self.inflight[policy.name] >= self.limits[policy.name]:
            return False
        if policy.is_batch:
            return not (self._nonbatch_running or self._nonbatch_queued) and self.total_inflight < self.slots
        return self._nonbatch_running < self.slots

    def _start(self, ticket: Ticket, now: float) -> None:
        ticket.started = now
        name = ticket.tier.name
        self.inflight[name] += 1
        self.admitted[name] += 1
        self.total_inflight += 1
        if not ticket.tier.is_batch:
            self._nonbatch_running += 1
            self._running_cost += ticket.cost
            self._running_started += now
            if not self._told_busy:
                self._changed()

    def _dispatch(self) -> None:
        """Hand free slots to the best waiters: highest tier first, FIFO within a tier."""
        for policy in self._order:
            queue = self._queues[policy.name]
            while queue:
                if self._nonbatch_running >= self.slots:
                    return  # no slot for anyone (batch needs total < slots too)
                if not self._can_start(policy):
                    break
                waiter, _ = queue.popitem(last=False)
                self._dequeued(waiter)
                if waiter.future.done():  # cancelled, its task not yet run: it has left
                    continue
                now = self.clock()
                waiter.ticket.queued_s = now - waiter.arrived
                self._start(waiter.ticket, now)
                waiter.future.set_result(None)

    def _leave(self, waiter: _Waiter) -> None:
        name = waiter.ticket.tier.name
        queue = self._queues[name]
        if waiter in queue:
            del queue[waiter]
            self._dequeued(waiter)
        self._dispatch()  # a lower tier (batch) may have been waiting on this one
        self._changed()

    def _dequeued(self, waiter: _Waiter) -> None:
        policy = waiter.ticket.tier
        self._queued_cost[policy.name] -= waiter.ticket.cost
        self._waiting -= 1
        if not policy.is_batch:
            self._nonbatch_queued -= 1

    def _changed(self) -> None:
        """Tell ``on_change`` when the other tiers' demand flips between busy and idle."""
        busy = self._nonbatch_running > 0 or self._nonbatch_queued > 0
        if busy != self._told_busy:
            self._told_busy = busy
            if self.on_change is not None:
                self.on_change()

    def _reject(self, ticket: Ticket, reason: str, retry_after: float, message: str) -> None:
        self._reject_tier(ticket.tier, reason, retry_after, message)

    def _reject_tier(self, policy: TierPolicy, reason: str, retry_after: float, message: str) -> None:
        self.rejected[(policy.name, reason)] += 1
        seconds = min(max(math.ceil(retry_after), 1), MAX_RETRY_AFTER_S)
        raise Rejected(policy.name, reason, seconds, message)
