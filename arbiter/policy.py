"""The arbiter's decisions, as pure functions of its state.

The owner loop (one task, no locks) keeps a ``ModelState`` per model and, for each decision,
hands these functions an ``ArbiterView``: a snapshot of every model, the budgets and the time.
They return a decision value; they read no clock, do no I/O, log nothing and change nothing, so
they may be asked speculatively as often as needed (e.g. for every queued request on every
event). The owner carries out what a decision says and records the new places.

Tiers are ranks: 0 is the highest (paid); ``batch_rank`` is the lowest (batch).

Places
    ``resident`` (on the device), ``warm`` (weights in host RAM, pinned under CUDA), ``cold``
    (on disk), and the transient ``loading``. ``resident`` and ``loading`` models occupy the
    device ``budget`` (``ModelState.footprint`` each); ``warm`` models occupy the
    ``host_cache_budget`` (``ModelState.warm_bytes`` each).

Who may evict whom (``blocker``), checked in this order
    1. A pinned model is never evicted.
    2. A loading model, or one with running non-batch work, is never evicted ("busy").
       Running batch work is paused first (``Evict.pause_batch_on``), then the model goes;
       but a batch request does not pause other batch work to make room: for it that is busy.
    3. A model served to tier T within ``protect_window_s`` can only be evicted by a strictly
       higher tier (smaller rank) than T. ``served_at`` keeps the last time per tier, so a model
       served to paid and then to free is protected against everyone but paid until paid's
       window ends. Batch, the lowest tier, therefore never evicts a model in its window.

Value (``value_key``), least valuable first
    lowest last-served tier (largest rank; never served is lowest of all), then least recently
    used, then largest footprint (then name, only to be deterministic).

Making room (``plan_load``)
    Victims are taken in value order until the freed bytes make the model fit (by memory, not
    count); then victims that turn out unnecessary are dropped again, most valuable first.
    The result is one of:
      ``Fit``        it is resident or loading already, or fits in free memory: load it now.
      ``Evict``      evict these (pausing batch work on some first), then load.
      ``Refuse``     only protected models stand in the way: retry after ``retry_after``
                     seconds, when the earliest protection that frees enough ends (1..120).
      ``Impossible`` it cannot fit by evicting or waiting out protection: ``waiting_on`` names
                     the busy models whose work must end first (the caller waits or answers
                     503); empty ``waiting_on`` means never (bigger than the budget, or pinned
                     models are in the way). ``drain``: what it counts on, the idle models it may
                     evict and those of ``waiting_on`` it may evict once their work ends, as many
                     as make it fit (least valuable first; none when they cannot make it fit
                     alone): the owner gives lower tiers no new work on them and starts no
                     lower-tier load meanwhile (every free byte is counted on too), or a lower
                     tier that kept one busy would starve it.
    Every ``Evict`` leaves enough room, so a load is never started that does not fit. The owner
    loads one model at a time per device; a ``loading`` model counts as busy here.

Host cache (``host_cache_plan``, folded into every ``Evict``)
    Evicted models go warm while the host cache has room, most valuable victim first; to make
    room, warm models less valuable than the victim are dropped to cold (least valuable first,
    only as many as needed), never the model about to be loaded from the cache. A victim that
    still does not fit goes cold. A model counts against the host cache only while ``warm``, and
    not at all when it is the one about to be loaded from the cache (its copy leaves in the same
    load: a swap of two models through a cache that holds one sent the other cold every time), so
    until the owner frees that copy the host cache may briefly exceed its budget by that one model.

Batch yields (``batch_must_yield``)
    Batch work runs only while no other tier has work running or queued, here or at the
    admission gate (``others_busy``: the gate has non-batch work admitted or queued that may not
    have reached the arbiter yet, or on its way from the door); otherwise all running batch work must pause. The function
    returns the set that must be paused now; the owner pauses those and resumes the rest (an
    empty set means resume all).

Out of memory (``pick_oom_victim``)
    On ``torch.OutOfMemoryError`` during a load or a step the owner evicts the least valuable
    model that this requester may evict (same rules as above) and retries once.

Failed loads (``next_cooldown``, ``LoadCooldown``)
    Each failure of a model's load starts a cooldown of 2 s, doubling per further failure up to
    60 s; while it lasts requests for the model get 503 with ``Retry-After``. A success ends it
    (the owner drops the record).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Literal

Place = Literal["resident", "warm", "cold", "loading"]
Blocker = Literal["pinned", "busy", "protected"]

MAX_RETRY_AFTER_S = 120  # clients (the OpenAI SDK) do not wait longer than this
COOLDOWN_BASE_S = 2.0
COOLDOWN_CAP_S = 60.0


# --- state -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelState:
    """What the owner knows of one model. Update it with ``dataclasses.replace`` / ``served``."""

    name: str
    kind: str
    footprint: int  # device bytes when resident: declared, estimated, then measured
    place: Place = "cold"
    served_at: Mapping[int, float] = field(default_factory=dict)  # tier rank -> last time served
    running_nonbatch: int = 0  # non-batch work in flight on it
    running_batch: int = 0  # batch work in flight on it, paused or not
    pinned: bool = False  # admin pin: never evicted
    host_bytes: int | None = None  # host-RAM bytes when warm; None: the footprint

    @property
    def warm_bytes(self) -> int:
        return self.footprint if self.host_bytes is None else self.host_bytes

    @property
    def last_used(self) -> float:
        """When it was last served to anyone; -inf if never."""
        return max(self.served_at.values(), default=-math.inf)

    @property
    def last_tier(self) -> int | None:
        """The tier it was last served to (the higher tier on a tie); None if never served."""
        if not self.served_at:
            return None
        return min(self.served_at, key=lambda tier: (-self.served_at[tier], tier))

    def protected_until(self, requester_tier: int, protect_window_s: float, own: float | None = None) -> float:
        """Until when ``requester_tier`` may not evict it: the window of the last serve to a tier
        as high as the requester or higher (-inf if none). ``own``: when the requester's own
        request (a chain of steps on several models: speech in, a chat, speech out) last used it;
        its tier's serve at or before then is that request's own and does not protect the model
        from the request's next step. A higher tier's serve, or its tier's after then, does."""
        return max(
            (t + protect_window_s for tier, t in self.served_at.items()
             if tier < requester_tier or (tier == requester_tier and (own is None or t > own))),
            default=-math.inf,
        )


def served(model: ModelState, tier: int, now: float) -> ModelState:
    """The state after serving ``tier`` at ``now``. Call it when work is admitted and again when
    it ends, so that the protection window counts from the last activity."""
    return replace(model, served_at={**model.served_at, tier: now})


@dataclass(frozen=True)
class ArbiterView:
    """A snapshot of the arbiter's state for one decision."""

    models: Mapping[str, ModelState]
    budget: int  # device bytes models may occupy in all (footprint.device_budget)
    host_cache_budget: int  # host bytes warm models may occupy in all
    now: float  # the owner's monotonic clock, seconds
    protect_window_s: float
    queued_by_tier: Mapping[int, int] = field(default_factory=dict)  # waiting requests per rank

    @property
    def used(self) -> int:
        return sum(m.footprint for m in self.models.values() if m.place in ("resident", "loading"))

    @property
    def free(self) -> int:
        return self.budget - self.used

    @property
    def host_used(self) -> int:
        return sum(m.warm_bytes for m in self.models.values() if m.place == "warm")


# --- decisions ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Fit:
    """Load now (or, if it is resident or loading already, just use it); nothing to evict."""


@dataclass(frozen=True)
class Evict:
    """Pause the batch work on ``pause_batch_on``; drop ``drop_warm`` from the host cache to cold;
    evict ``victims`` (least valuable first), ``to_warm`` into the host cache and ``to_cold`` to
    disk; then load."""

    victims: tuple[str, ...]
    pause_batch_on: tuple[str, ...] = ()
    to_warm: tuple[str, ...] = ()
    to_cold: tuple[str, ...] = ()
    drop_warm: tuple[str, ...] = ()


@dataclass(frozen=True)
class Refuse:
    """Protected models are in the way: answer with Retry-After ``retry_after`` seconds."""

    retry_after: int
    reason: str


@dataclass(frozen=True)
class Impossible:
    """It cannot fit now: after ``waiting_on``'s work ends, or never if that is empty; ``drain``:
    the models of ``waiting_on`` whose work must end for it to fit, which lower tiers may not
    start new work on meanwhile."""

    reason: str
    waiting_on: tuple[str, ...] = ()
    drain: tuple[str, ...] = ()


Decision = Fit | Evict | Refuse | Impossible


@dataclass(frozen=True)
class HostPlan:
    """Where evicted models go: see ``host_cache_plan``."""

    to_warm: tuple[str, ...]
    to_cold: tuple[str, ...]
    drop_warm: tuple[str, ...]


# --- rules -------------------------------------------------------------------------------------


def value_key(model: ModelState) -> tuple[float, float, int, str]:
    """Sort key, least valuable first: lowest last tier, then least recently used, then largest."""
    tier = model.last_tier
    return (-(math.inf if tier is None else tier), model.last_used, -model.footprint, model.name)


def blocker(
    view: ArbiterView, model: ModelState, requester_tier: int, batch_rank: int, own: float | None = None
) -> Blocker | None:
    """Why a request of ``requester_tier`` may not evict ``model`` now, or None if it may;
    ``own``: when that request itself last used ``model`` (``ModelState.protected_until``)."""
    if model.pinned:
        return "pinned"
    if model.place == "loading" or model.running_nonbatch > 0:
        return "busy"
    if model.running_batch > 0 and requester_tier >= batch_rank:
        return "busy"
    if view.now < model.protected_until(requester_tier, view.protect_window_s, own):
        return "protected"
    return None


def retry_after_s(seconds: float) -> int:
    """Whole seconds for a Retry-After header: rounded up, at least 1, at most 120."""
    return max(1, min(MAX_RETRY_AFTER_S, math.ceil(seconds - 1e-9)))


def _enough(
    ordered: Sequence[ModelState], need: int, size: Callable[[ModelState], int]
) -> list[ModelState]:
    """The first of ``ordered`` whose sizes add up to ``need``, less those that turn out
    unnecessary (tried most valuable first). ``ordered`` must be able to cover ``need``."""
    chosen: list[ModelState] = []
    total = 0
    for m in ordered:
        if total >= need:
            break
        chosen.append(m)
        total += size(m)
    for m in reversed(list(chosen)):
        if total - size(m) >= need:
            chosen.remove(m)
            total -= size(m)
    return chosen


def _footprint(m: ModelState) -> int:
    return m.footprint


def _warm_bytes(m: ModelState) -> int:
    return m.warm_bytes


def host_cache_plan(
    view: ArbiterView, evicting: Iterable[str], keep: Collection[str] = ()
) -> HostPlan:
    """Where the models in ``evicting`` go when they leave the device (see the module docstring);
    warm models in ``keep`` (the one about to be loaded from the cache) are never dropped."""
    victims = sorted((view.models[n] for n in evicting), key=value_key, reverse=True)
    droppable_warm = (
        m for m in view.models.values() if m.place == "warm" and not m.pinned and m.name not in keep
    )
    warm = sorted(droppable_warm, key=value_key)
    # the model about to be loaded from the cache leaves it in this same load (below: counted only while warm)
    leaving = sum(view.models[n].warm_bytes for n in keep if view.models[n].place == "warm")
    host_free = view.host_cache_budget - view.host_used + leaving
    to_warm: list[str] = []
    to_cold: list[str] = []
    dropped: list[str] = []
    for v in victims:
        size = v.warm_bytes
        if size <= host_free:
            to_warm.append(v.name)
            host_free -= size
            continue
        droppable = [w for w in warm if w.name not in dropped and value_key(w) < value_key(v)]
        if host_free + sum(w.warm_bytes for w in droppable) < size:
            to_cold.append(v.name)
            continue
        for w in _enough(droppable, size - host_free, _warm_bytes):
            dropped.append(w.name)
            host_free += w.warm_bytes
        to_warm.append(v.name)
        host_free -= size
    order = {m.name: i for i, m in enumerate(reversed(victims))}  # least valuable first
    return HostPlan(
        to_warm=tuple(sorted(to_warm, key=order.__getitem__)),
        to_cold=tuple(sorted(to_cold, key=order.__getitem__)),
        drop_warm=tuple(dropped),
    )


def _evict(view: ArbiterView, victims: Sequence[ModelState], keep: Collection[str] = ()) -> Evict:
    """Victims holding paused batch work always go warm, even past the host cache budget: their
    work resumes from where it stopped once the model is back, so it must not be dropped."""
    host = host_cache_plan(view, (v.name for v in victims), keep)
    holding = {v.name for v in victims if v.running_batch > 0}
    return Evict(
        victims=tuple(v.name for v in victims),
        pause_batch_on=tuple(v.name for v in victims if v.running_batch > 0),
        to_warm=host.to_warm + tuple(n for n in host.to_cold if n in holding),
        to_cold=tuple(n for n in host.to_cold if n not in holding),
        drop_warm=host.drop_warm,
    )


def plan_load(view: ArbiterView, model: str, requester_tier: int, batch_rank: int,
              own: Mapping[str, float] = MappingProxyType({})) -> Decision:
    """What must happen before ``model`` can be used by a request of ``requester_tier``; ``own``:
    the models that request used itself before, with when its use of each ended, whose
    protection from its own use does not hold against it (``ModelState.protected_until``)."""
    target = view.models[model]
    if target.place in ("resident", "loading"):
        return Fit()
    need = target.footprint
    if need > view.budget:
        return Impossible(f"{model} needs {need} bytes, more than the whole budget {view.budget}")
    if need <= view.free:
        return Fit()

    evictable: list[ModelState] = []
    protected: list[ModelState] = []
    busy: list[ModelState] = []
    for m in view.models.values():
        if m.name == model or m.place not in ("resident", "loading"):
            continue
        why = blocker(view, m, requester_tier, batch_rank, own.get(m.name))
        if why is None:
            evictable.append(m)
        elif why == "protected":
            protected.append(m)
        elif why == "busy":
            busy.append(m)

    shortfall = need - view.free
    evictable.sort(key=value_key)
    if sum(m.footprint for m in evictable) >= shortfall:
        return _evict(view, _enough(evictable, shortfall, _footprint), keep=(model,))

    # Which protection, once over, frees enough?
    shortfall -= sum(m.footprint for m in evictable)
    freed = 0
    window = view.protect_window_s
    for m in sorted(protected, key=lambda m: m.protected_until(requester_tier, window, own.get(m.name))):
        freed += m.footprint
        if freed >= shortfall:
            until = m.protected_until(requester_tier, window, own.get(m.name))
            return Refuse(
                retry_after_s(until - view.now),
                f"{model} needs memory held by models other requests used recently",
            )

    if freed + sum(m.footprint for m in busy) >= shortfall:
        return Impossible(
            f"{model} fits only after running work ends",
            waiting_on=tuple(sorted(m.name for m in busy)),
            drain=_drain(view, evictable, busy, shortfall, requester_tier, batch_rank, own),
        )
    return Impossible(f"{model} does not fit beside the pinned models")


def _drain(view: ArbiterView, evictable: Sequence[ModelState], busy: Sequence[ModelState], shortfall: int,
           requester_tier: int, batch_rank: int, own: Mapping[str, float]) -> tuple[str, ...]:
    """What a request waiting for busy models' work to end counts on: the idle models it may
    evict (all of them: they alone are not enough) and, least valuable first, the busy ones
    whose work must end for the ``shortfall`` left, among those it may evict once idle (a model
    loading for another request counts as what it will be once loaded); none when they cannot
    free enough alone (protection must end as well)."""
    idle = (replace(m, place="resident", running_nonbatch=0, running_batch=0) for m in busy)
    drainable = sorted((m for m in idle if blocker(view, m, requester_tier, batch_rank, own.get(m.name)) is None),
                       key=value_key)
    if sum(m.footprint for m in drainable) < shortfall:
        return ()
    return tuple(m.name for m in evictable) + tuple(m.name for m in _enough(drainable, shortfall, _footprint))


def pick_oom_victim(
    view: ArbiterView, exclude: Collection[str], requester_tier: int, batch_rank: int
) -> Evict | None:
    """After an out-of-memory error: evict the least valuable resident model (not in ``exclude``)
    that ``requester_tier`` may evict, then retry once; None if there is none."""
    candidates = [
        m
        for m in view.models.values()
        if m.place == "resident"
        and m.name not in exclude
        and blocker(view, m, requester_tier, batch_rank) is None
    ]
    if not candidates:
        return None
    return _evict(view, [min(candidates, key=value_key)])


def batch_must_yield(view: ArbiterView, batch_rank: int, others_busy: bool) -> frozenset[str]:
    """The models whose batch work must be paused now (empty: let all batch work run).
    ``others_busy``: the admission gate holds non-batch work, admitted, queued or arriving."""
    others_running = any(m.running_nonbatch > 0 for m in view.models.values())
    others_queued = any(n > 0 for tier, n in view.queued_by_tier.items() if tier < batch_rank)
    if not (others_busy or others_running or others_queued):
        return frozenset()
    return frozenset(m.name for m in view.models.values() if m.running_batch > 0)


# --- failed loads ------------------------------------------------------------------------------


def next_cooldown(
    prev: float | None, base: float = COOLDOWN_BASE_S, cap: float = COOLDOWN_CAP_S
) -> float:
    """The cooldown after a failed load: ``base`` first, then double the last, up to ``cap``."""
    return min(cap, base if prev is None else prev * 2)


@dataclass(frozen=True)
class LoadCooldown:
    """A model whose load failed may not be loaded again before ``until``."""

    seconds: float  # the length of this cooldown
    until: float
    failures: int = 1

    def active(self, now: float) -> bool:
        return now < self.until

    def retry_after(self, now: float) -> int:
        return retry_after_s(self.until - now)


def after_load_failure(
    prev: LoadCooldown | None,
    now: float,
    base: float = COOLDOWN_BASE_S,
    cap: float = COOLDOWN_CAP_S,
) -> LoadCooldown:
    """The cooldown that starts at ``now`` after a failed load (``prev``: the model's last one)."""
    seconds = next_cooldown(None if prev is None else prev.seconds, base, cap)
    return LoadCooldown(seconds, now + seconds, 1 if prev is None else prev.failures + 1)
