"""What each tier saw lately, for the dashboard: admitted and refused requests per minute and
latency quantiles over the last five minutes.

Time is cut into ``bucket_s`` buckets kept for ``span_s``. A bucket holds counts and a latency
histogram with geometric bins (each 5% wider than the last, from 1 ms), so recording is O(1),
memory is bounded whatever the load, and a quantile is read to within 5%. Like the gate that owns
it, it is plain single-threaded code on the event loop; the clock is injected.
"""

from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

_FLOOR_S = 0.001  # the first bin's upper edge
_GROWTH = 1.05  # each bin's upper edge over the previous one


def _bin(seconds: float) -> int:
    if seconds <= _FLOOR_S:
        return 0
    return math.ceil(math.log(seconds / _FLOOR_S) / math.log(_GROWTH))


def _edge(index: int) -> float:
    """The upper edge of a bin: a quantile is reported as it (never below the true value)."""
    return _FLOOR_S * _GROWTH ** index


@dataclass
class _Bucket:
    start: float
    admitted: int = 0
    refused: dict[str, int] = field(default_factory=dict)  # reason -> count
    latency: dict[int, int] = field(default_factory=dict)  # bin -> count


@dataclass(frozen=True)
class TierFigures:
    admitted_per_min: int  # over the last 60 s
    refused_per_min: int
    refused_by_reason_per_min: dict[str, int]
    latency_samples: int  # over the last span_s
    p50_s: float | None
    p99_s: float | None


class TierStats:
    def __init__(self, tiers: list[str], clock: Callable[[], float] = time.monotonic,
                 bucket_s: float = 5.0, span_s: float = 300.0) -> None:
        self.clock = clock
        self.bucket_s = bucket_s
        self.span_s = span_s
        self._buckets: dict[str, deque[_Bucket]] = {t: deque() for t in tiers}

    def admitted(self, tier: str) -> None:
        self._now(tier).admitted += 1

    def refused(self, tier: str, reason: str) -> None:
        refused = self._now(tier).refused
        refused[reason] = refused.get(reason, 0) + 1

    def latency(self, tier: str, seconds: float) -> None:
        hist = self._now(tier).latency
        b = _bin(seconds)
        hist[b] = hist.get(b, 0) + 1

    def figures(self, tier: str) -> TierFigures:
        now = self.clock()
        buckets = self._trimmed(tier, now)
        last_minute = [b for b in buckets if b.start > now - 60.0]
        refused: dict[str, int] = {}
        for b in last_minute:
            for reason, n in b.refused.items():
                refused[reason] = refused.get(reason, 0) + n
        hist: dict[int, int] = {}
        for b in buckets:
            for index, n in b.latency.items():
                hist[index] = hist.get(index, 0) + n
        samples = sum(hist.values())
        return TierFigures(sum(b.admitted for b in last_minute), sum(refused.values()), refused, samples,
                           _quantile(hist, samples, 0.50), _quantile(hist, samples, 0.99))

    def _now(self, tier: str) -> _Bucket:
        now = self.clock()
        buckets = self._trimmed(tier, now)
        if not buckets or now >= buckets[-1].start + self.bucket_s:
            buckets.append(_Bucket(now - now % self.bucket_s))
        return buckets[-1]

    def _trimmed(self, tier: str, now: float) -> deque[_Bucket]:
        buckets = self._buckets[tier]
        while buckets and buckets[0].start <= now - self.span_s - self.bucket_s:
            buckets.popleft()
        return buckets


def _quantile(hist: dict[int, int], samples: int, q: float) -> float | None:
    """The nearest-rank ``q`` quantile of the histogram, as its bin's upper edge."""
    if samples == 0:
        return None
    rank = max(1, math.ceil(q * samples))
    seen = 0
    for index in sorted(hist):
        seen += hist[index]
        if seen >= rank:
            return round(_edge(index), 6)
    raise AssertionError("unreachable")
