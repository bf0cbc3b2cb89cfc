"""The SLO guard: lower tiers give way when a higher tier's latency drifts toward its target.

Each tier has a latency target (``latency_target_s``) and may have a token latency target
(``token_latency_target_s``: the time between tokens of a streamed text reply). The gate keeps a
short sliding window of each tier's recent latencies (time to first token for chat, total time
for the other endpoints) and of its streamed replies' mean time per output token, and, at most
once per ``interval_s``, asks :func:`next_limits` for every tier's *effective* ``max_inflight``.
The decision is additive-increase / multiplicative-decrease, per tier:

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

The highest tier is never limited by the guard, and neither is batch: batch work already yields
at its next step whenever another tier has work. Like ``arbiter/policy.py``, this module is pure:
no clock, no I/O, no state; the gate owns the windows and the current limits.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

Pressure = Literal["hot", "hold", "calm"]


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
    """One tier as the guard sees it: its place, target, configured limit and recent latencies."""

    name: str
    rank: int  # 0 is the highest tier
    target_s: float
    max_inflight: int
    is_batch: bool
    samples: Sequence[float]  # latencies (seconds) inside the window, any order
    token_target_s: float | None = None  # None: the tier's token latency is not judged
    token_samples: Sequence[float] = ()  # streamed replies' mean seconds per output token, in the window


def quantile(samples: Sequence[float], q: float) -> float:
    """The nearest-rank ``q`` quantile (0 < q <= 1) of a non-empty sample."""
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def _against(samples: Sequence[float], target_s: float | None, settings: GuardSettings) -> Pressure:
    if target_s is None or len(samples) < settings.min_samples:
        return "calm"  # not judged, idle or barely used: nothing to protect
    recent = quantile(samples, settings.quantile)
    if recent > settings.trigger * target_s:
        return "hot"
    if recent < settings.recover * target_s:
        return "calm"
    return "hold"


def tier_state(tier: TierWindow, settings: GuardSettings) -> Pressure:
    """How this tier's own recent latencies stand against its targets: the worse of its latency
    and its token latency."""
    states = {_against(tier.samples, tier.target_s, settings),
              _against(tier.token_samples, tier.token_target_s, settings)}
    return "hot" if "hot" in states else "hold" if "hold" in states else "calm"


def next_limits(tiers: Sequence[TierWindow], limits: Mapping[str, int], settings: GuardSettings) -> dict[str, int]:
    """Every tier's effective ``max_inflight`` after one decision. ``limits`` holds the current
    effective limits (a tier missing from it is at its configured ``max_inflight``)."""
    out: dict[str, int] = {}
    above: Pressure = "calm"  # the worst state among the tiers above the one being decided
    for tier in sorted(tiers, key=lambda t: t.rank):
        current = min(limits.get(tier.name, tier.max_inflight), tier.max_inflight)
        if not settings.enabled or tier.is_batch:
            out[tier.name] = tier.max_inflight
        elif above == "hot":
            out[tier.name] = max(1, current // 2)
        elif above == "calm":
            out[tier.name] = min(tier.max_inflight, current + 1)
        else:
            out[tier.name] = current
        state = tier_state(tier, settings)
        if state == "hot" or (state == "hold" and above == "calm"):
            above = state
    return out
