"""The SLO guard: lower tiers give way when a higher tier's latency drifts toward its target.

Each tier has a latency target (``latency_target_s``) and may have a token latency target
(``token_latency_target_s``: the time between tokens of a streamed text reply). The gate keeps
each tier's recent latencies (time to first token for chat, total time for the other endpoints)
and its streamed replies' mean time per output token, each with the time it was measured, and,
at most once per ``interval_s``, asks :func:`next_limits` for every tier's *effective*
``max_inflight`` at a time ``now``. Only the measurements of the last ``window_s`` before ``now``
count: the window slides with the time, so a tier that stopped reporting becomes idle. The
decision is additive-increase / multiplicative-decrease, per tier:

- **hot**: some higher tier's recent latency or token latency (the ``quantile`` of its window,
  with at least ``min_samples`` samples) is above ``trigger`` x its target: halve this tier's
  limit (floor 1);
- **calm**: every higher tier is below ``recover`` x its targets, or has no recent samples (idle):
  grow this tier's limit by one, up to its configured ``max_inflight``;
- otherwise hold.

Why two targets: time to first token measures the wait for a slot and a prefill, but the lower
tiers' rows also share every decode step with a higher tier's, so a higher tier's replies can
slow down token by token while their first tokens are still on time. The token target lets the
guard see that.

Limits grow back with the time, not only with traffic: after a decision, :func:`next_decision_at`
says when to decide again should no latency arrive (never, once every tier is at its configured
``max_inflight``). A lowered tier with only calm tiers above it grows at the next decision; one
below a hot or holding tier waits for that tier's measurements to age out of its window. So after
a slow spell and then silence, the lowered tiers are back at their configured limits about
``window_s`` plus one ``interval_s`` per step later, and an idle server with every tier at its
limit decides nothing.

The highest tier is never limited by the guard, and neither is batch: batch work already yields
at its next step whenever another tier has work. Like ``arbiter/policy.py``, this module is pure:
no clock, no I/O, no state; the gate owns the windows, the current limits and the timer.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

Pressure = Literal["hot", "hold", "calm"]
Measured = tuple[float, float]  # (when it was measured, seconds): when on the caller's monotonic clock


@dataclass(frozen=True)
class GuardSettings:
    enabled: bool = True
    trigger: float = 0.8  # a higher tier above trigger x target shrinks the tiers below it
    recover: float = 0.5  # all higher tiers below recover x target let them grow back
    quantile: float = 0.9  # of each tier's window
    window_s: float = 10.0  # how far back a latency counts
    interval_s: float = 1.0  # at most one decision per interval
    min_samples: int = 3  # fewer recent samples than this: that tier's latency is not judged


@dataclass(frozen=True)
class TierWindow:
    """One tier as the guard sees it: its place, target, configured limit and recent latencies,
    each with the time it was measured (any order; those older than the window are ignored)."""

    name: str
    rank: int  # 0 is the highest tier
    target_s: float
    max_inflight: int
    is_batch: bool
    samples: Sequence[Measured]  # latencies
    token_target_s: float | None = None  # None: the tier's token latency is not judged
    token_samples: Sequence[Measured] = ()  # streamed replies' mean seconds per output token


def in_window(when: float, now: float, settings: GuardSettings) -> bool:
    """Whether a measurement made at ``when`` still counts at ``now``: for ``window_s``, then not."""
    return when + settings.window_s > now


def quantile(samples: Sequence[float], q: float) -> float:
    """The nearest-rank ``q`` quantile (0 < q <= 1) of a non-empty sample."""
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def _against(samples: Sequence[Measured], target_s: float | None, settings: GuardSettings, now: float) -> Pressure:
    if target_s is None:
        return "calm"  # not judged
    recent = [seconds for when, seconds in samples if in_window(when, now, settings)]
    if len(recent) < settings.min_samples:
        return "calm"  # idle or barely used lately: nothing to protect
    value = quantile(recent, settings.quantile)
    if value > settings.trigger * target_s:
        return "hot"
    if value < settings.recover * target_s:
        return "calm"
    return "hold"


def tier_state(tier: TierWindow, settings: GuardSettings, now: float) -> Pressure:
    """How this tier's latencies of the window before ``now`` stand against its targets: the worse
    of its latency and its token latency."""
    states = {_against(tier.samples, tier.target_s, settings, now),
              _against(tier.token_samples, tier.token_target_s, settings, now)}
    return "hot" if "hot" in states else "hold" if "hold" in states else "calm"


def _with_above(tiers: Sequence[TierWindow], settings: GuardSettings,
                now: float) -> Iterator[tuple[TierWindow, Pressure]]:
    """Each tier, highest first, with the worst state among the tiers above it."""
    above: Pressure = "calm"
    for tier in sorted(tiers, key=lambda t: t.rank):
        yield tier, above
        state = tier_state(tier, settings, now)
        if state == "hot" or (state == "hold" and above == "calm"):
            above = state


def next_limits(tiers: Sequence[TierWindow], limits: Mapping[str, int], settings: GuardSettings,
                now: float) -> dict[str, int]:
    """Every tier's effective ``max_inflight`` after one decision at ``now``. ``limits`` holds the
    current effective limits (a tier missing from it is at its configured ``max_inflight``)."""
    out: dict[str, int] = {}
    for tier, above in _with_above(tiers, settings, now):
        current = min(limits.get(tier.name, tier.max_inflight), tier.max_inflight)
        if not settings.enabled or tier.is_batch:
            out[tier.name] = tier.max_inflight
        elif above == "hot":
            out[tier.name] = max(1, current // 2)
        elif above == "calm":
            out[tier.name] = min(tier.max_inflight, current + 1)
        else:
            out[tier.name] = current
    return out


def next_decision_at(tiers: Sequence[TierWindow], limits: Mapping[str, int], settings: GuardSettings,
                     now: float) -> float | None:
    """When to decide again, after the decision at ``now`` set ``limits``, should no latency be
    reported in between: None when no tier is below its configured ``max_inflight`` (nothing to
    grow back) or the guard is off; the next decision (``now + interval_s``) when a lowered tier
    has only calm tiers above it (it grows then); otherwise when the oldest measurement still in
    a window ages out (the state above can change then), but not before the next decision."""
    if not settings.enabled:
        return None
    lowered = False
    for tier, above in _with_above(tiers, settings, now):
        if tier.is_batch or limits.get(tier.name, tier.max_inflight) >= tier.max_inflight:
            continue
        if above == "calm":
            return now + settings.interval_s
        lowered = True
    if not lowered:
        return None
    ages_out = [when + settings.window_s for tier in tiers for samples in (tier.samples, tier.token_samples)
                for when, _ in samples if in_window(when, now, settings)]
    return max(min(ages_out, default=now), now + settings.interval_s)
