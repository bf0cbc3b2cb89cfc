"""The limit arithmetic: what a request asks for, the decision on it, and GCRA buckets.

Each per-minute limit ``L`` is a GCRA bucket (the generic cell rate algorithm, a token bucket
kept as one number): the bucket's *theoretical arrival time* ``tat`` moves ``cost * 60 / L``
seconds forward for every admitted request, and a request is admitted when the new ``tat`` is at
most 60 s ahead of now. A full minute's allowance can therefore be spent at once, and it comes
back evenly, one unit every ``60 / L`` seconds. What is left, when the bucket is full again, and
how long a refused request must wait all follow from ``tat`` alone (``Bucket``).

Concurrency is a count of requests in flight; the daily GPU-seconds budget compares what the key
has spent today (from the usage store) with its budget, before the request: the request that
crosses the budget completes, the next one is refused with ``insufficient_quota`` until 00:00 UTC.
A request in flight has spent nothing yet, so each holds an estimate of its GPU-seconds
(``Ask.gpu_seconds``) until it ends and its true usage is written: a request is admitted only
while today's usage plus what the key's requests in flight hold is under the budget (else a 429
``rate_limit_exceeded`` to try again in a second, since what they hold comes back as they end).
Without it, every request that arrives while others run would see the budget unspent.

:class:`LocalLimiter` keeps the buckets in this process (the SQLite store's mode);
``accounts.redis_store.RedisLimiter`` runs the same decision as one Lua script on Redis, so every
process sharing that Redis sees one bucket per key.
"""

from __future__ import annotations

import abc
import math
import time
from dataclasses import dataclass, field

from accounts.config import Limits

WINDOW_S = 60.0
# bucket name -> the Limits field that sets it, and the Ask field that spends it
DIMENSIONS = {"requests": "requests_per_min", "tokens": "tokens_per_min", "images": "images_per_min",
              "audio_seconds": "audio_seconds_per_min"}


@dataclass(frozen=True)
class Ask:
    """What one request spends of its key's minute buckets (estimates at admission)."""

    requests: float = 1.0
    tokens: float = 0.0
    images: float = 0.0
    audio_seconds: float = 0.0
    gpu_seconds: float = 0.0  # of the daily budget, held while it is in flight (an estimate; not a bucket)

    def of(self, dimension: str) -> float:
        return getattr(self, dimension)


@dataclass(frozen=True)
class Bucket:
    """One limit's state for the headers: the limit, what is left, seconds until full again."""

    limit: float
    remaining: float
    reset_s: float


@dataclass
class Verdict:
    ok: bool
    buckets: dict[str, Bucket] = field(default_factory=dict)  # after this request, when admitted
    code: str = ""  # "rate_limit_exceeded" | "insufficient_quota" when refused
    message: str = ""
    retry_after_s: float = 0.0
    never: bool = False  # refused however long it waits (its cost alone is over a limit): no Retry-After


def rates(limits: Limits) -> dict[str, float]:
    """The minute limits that are set: bucket name -> units per minute."""
    out = {}
    for dim, name in DIMENSIONS.items():
        value = getattr(limits, name)
        if value is not None:
            out[dim] = float(value)
    return out


def seconds_to_utc_midnight(now: float) -> float:
    return 86400.0 - (now % 86400.0)


def utc_day(now: float) -> str:
    return time.strftime("%Y-%m-%d", time.gmtime(now))


def bucket_after(tat: float, now: float, limit: float) -> Bucket:
    t = WINDOW_S / limit
    ahead = max(tat - now, 0.0)
    return Bucket(limit, max(math.floor((WINDOW_S - ahead) / t + 1e-9), 0), ahead)


# what a caller can change to bring a request that never fits under a minute limit
SMALLER = {"requests": "", "tokens": ": reduce its input or max_tokens", "images": ": ask for fewer images",
           "audio_seconds": ": send shorter audio or ask for shorter speech"}


def too_large(limits: Limits, ask: Ask) -> Verdict | None:
    """The refusal of a request whose cost alone is over one of its key's minute limits, or None.
    Decided before the buckets, so such a request is never told to wait for one of them first."""
    for dim, limit in rates(limits).items():
        if ask.of(dim) > limit:
            return never_fits(dim, limit, ask.of(dim))
    return None


def never_fits(dim: str, limit: float, cost: float) -> Verdict:
    """The 429 for a request that needs more of a minute bucket than the bucket ever holds: as
    OpenAI's "Request too large ... on tokens per min", but final (``never``), since no wait helps."""
    unit = dim.replace("_", " ")
    return Verdict(False, code="rate_limit_exceeded", never=True,
                   message=f"this request needs {cost:g} {unit}, more than this key's limit of {limit:g} {unit} "
                           f"per min, so it can never be admitted{SMALLER[dim]}")


def refusal(dim: str, limit: float, cost: float, need_s: float) -> Verdict:
    """The 429 for a minute bucket that cannot take ``cost`` now."""
    per = f"{limit:g} {dim.replace('_', ' ')} per min"
    if cost > limit:
        return never_fits(dim, limit, cost)
    return Verdict(False, code="rate_limit_exceeded", retry_after_s=need_s,
                   message=f"rate limit reached for this key: {per}; try again in {need_s:.1f}s")


def gpu_figure(seconds: float) -> str:
    """GPU-seconds in a refusal's message: to the hundredth from 1 up, else to two significant
    digits, so that a small budget's figures do not read as 0.00."""
    return f"{seconds:.2f}" if seconds >= 1 else f"{seconds:.2g}"


def over_budget(spent: float, budget: float, now: float) -> Verdict:
    return Verdict(False, code="insufficient_quota", retry_after_s=seconds_to_utc_midnight(now),
                   message=f"this key has used its daily budget of {budget:g} GPU-seconds "
                           f"({gpu_figure(spent)} used today); it renews at 00:00 UTC")


def budget_held(spent: float, held: float, budget: float) -> Verdict:
    """The 429 for a budget that the key's requests in flight may spend: what they hold comes
    back as they end, so the SDK may try again soon."""
    return Verdict(False, code="rate_limit_exceeded", retry_after_s=1.0,
                   message=f"this key's requests in flight may use the rest of its daily budget of {budget:g} "
                           f"GPU-seconds ({gpu_figure(spent)} used today, {gpu_figure(held)} held by requests in "
                           "flight); "
                           "try again when one ends")


def too_many_at_once(limit: int) -> Verdict:
    return Verdict(False, code="rate_limit_exceeded", retry_after_s=1.0,
                   message=f"this key already has {limit} requests in flight, its limit")


class Limiter(abc.ABC):
    """Decides on a key's request against its limits, atomically; then corrects it when it ends."""

    @abc.abstractmethod
    async def admit(self, key: str, limits: Limits, ask: Ask, spent_gpu_s: float, request_id: str) -> Verdict:
        """Admit (spending ``ask``, a concurrency slot and holding ``ask.gpu_seconds`` of the daily
        budget) or refuse, all limits at once. ``spent_gpu_s`` is today's GPU-seconds so far (the
        Redis limiter reads its own)."""

    @abc.abstractmethod
    async def settle(self, key: str, limits: Limits, asked: Ask, used: Ask, request_id: str) -> None:
        """The request ended (its usage written): free its concurrency slot and what it held of the
        budget, and correct the buckets by ``used - asked``."""

    def held_gpu(self, key: str) -> dict[str, float]:
        """Request id -> GPU-seconds each request of ``key`` in flight holds, where this process
        keeps them (the in-process limiter's; the Redis limiter's script reads its own)."""
        return {}

    @abc.abstractmethod
    async def peek(self, key: str, limits: Limits) -> dict[str, Bucket]:
        """The buckets as they are now, spending nothing."""

    async def close(self) -> None:
        return None


class LocalLimiter(Limiter):
    """The buckets of this process (no I/O; the event loop is the only caller)."""

    def __init__(self, clock=time.time) -> None:
        self.clock = clock
        self._tat: dict[tuple[str, str], float] = {}
        self._inflight: dict[str, int] = {}
        self._held: dict[str, dict[str, float]] = {}  # key -> request id -> GPU-seconds it holds of the budget

    def held_gpu(self, key: str) -> dict[str, float]:
        return dict(self._held.get(key, {}))

    async def admit(self, key: str, limits: Limits, ask: Ask, spent_gpu_s: float, request_id: str) -> Verdict:
        now = self.clock()
        budget = limits.gpu_seconds_per_day
        if budget is not None:
            if spent_gpu_s >= budget:
                return over_budget(spent_gpu_s, budget, now)
            held = sum(self._held.get(key, {}).values())
            if spent_gpu_s + held >= budget:
                return budget_held(spent_gpu_s, held, budget)
        if limits.concurrent is not None and self._inflight.get(key, 0) >= limits.concurrent:
            return too_many_at_once(limits.concurrent)
        new_tat = {}
        for dim, limit in rates(limits).items():
            cost = ask.of(dim)
            tat = max(self._tat.get((key, dim), now), now) + cost * WINDOW_S / limit
            if tat - now > WINDOW_S + 1e-9:
                return refusal(dim, limit, cost, tat - WINDOW_S - now)
            new_tat[dim] = tat
        for dim, tat in new_tat.items():
            self._tat[(key, dim)] = tat
        if limits.concurrent is not None:  # (as Redis counts: only under a limit; settle gets the same limits)
            self._inflight[key] = self._inflight.get(key, 0) + 1
        if budget is not None:
            self._held.setdefault(key, {})[request_id] = ask.gpu_seconds
        return Verdict(True, {dim: bucket_after(tat, now, rates(limits)[dim]) for dim, tat in new_tat.items()})

    async def settle(self, key: str, limits: Limits, asked: Ask, used: Ask, request_id: str) -> None:
        if limits.concurrent is not None:  # (counted only then: ``admit``)
            left = self._inflight.get(key, 0) - 1
            if left > 0:
                self._inflight[key] = left
            else:
                self._inflight.pop(key, None)
        held = self._held.get(key)
        if held is not None:
            held.pop(request_id, None)
            if not held:
                del self._held[key]
        now = self.clock()
        for dim, limit in rates(limits).items():
            delta = used.of(dim) - asked.of(dim)
            if delta and (key, dim) in self._tat:
                self._tat[(key, dim)] = max(self._tat[(key, dim)] + delta * WINDOW_S / limit, now)

    async def peek(self, key: str, limits: Limits) -> dict[str, Bucket]:
        now = self.clock()
        return {dim: bucket_after(self._tat.get((key, dim), now), now, limit) for dim, limit in rates(limits).items()}
