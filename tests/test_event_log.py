"""The event stream (arbiter/events.py) and each tier's recent figures (gateway/tier_stats.py),
as plain objects with injected clocks."""

from __future__ import annotations

import asyncio

import pytest

from arbiter.events import EventLog, Lagged
from gateway.tier_stats import TierStats


def test_ring_keeps_the_last_events_with_growing_ids_and_times():
    now = [100.0]
    log = EventLog(capacity=3, clock=lambda: now[0])
    for i in range(5):
        now[0] += 1
        log.emit("eviction", model=f"m{i}")
    assert [e.id for e in log.recent] == [3, 4, 5] and log.last_id == 5
    assert [e.public() for e in log.since(3)] == [
        {"id": 4, "at": 104.0, "kind": "eviction", "model": "m3"},
        {"id": 5, "at": 105.0, "kind": "eviction", "model": "m4"}]
    assert [e.id for e in log.since(0, limit=2)] == [4, 5]


def test_subscribers_get_every_event_in_order_and_leave():
    async def main():
        log = EventLog()
        with log.subscribe() as a, log.subscribe() as b:
            log.emit("load_started", model="x")
            log.emit("load_finished", model="x")
            assert [(await a.next(1)).kind for _ in range(2)] == ["load_started", "load_finished"]
            assert (await b.next(1)).kind == "load_started"
            assert await a.next(0.01) is None  # nothing more: a timeout, not an error
        assert not log._subscribers
        log.emit("refusal")  # no subscribers: nothing blocks, nothing is queued
        assert log.last_id == 3

    asyncio.run(main())


def test_a_subscriber_that_falls_behind_reads_what_it_has_then_lags():
    async def main():
        log = EventLog(queue_size=2)
        sub = log.subscribe()
        for kind in ("a", "b", "c"):  # the third does not fit: the subscriber is dropped
            log.emit(kind)
        assert [(await sub.next(1)).kind for _ in range(2)] == ["a", "b"]
        with pytest.raises(Lagged):
            await sub.next(1)
        assert not log._subscribers

    asyncio.run(main())


def test_tier_figures_count_the_last_minute_and_quantiles_over_five_minutes():
    now = [1000.0]
    stats = TierStats(["paid", "free"], clock=lambda: now[0])
    for seconds in [0.1] * 50 + [0.2] * 49 + [3.0]:
        stats.latency("paid", seconds)
    stats.admitted("paid")
    stats.refused("free", "queue_full")
    stats.refused("free", "model_protected")
    stats.refused("free", "queue_full")
    paid, free = stats.figures("paid"), stats.figures("free")
    assert (paid.admitted_per_min, paid.refused_per_min, paid.latency_samples) == (1, 0, 100)
    assert 0.1 <= paid.p50_s <= 0.105 and 0.2 <= paid.p99_s <= 0.21  # 5% bins, never below the truth
    assert free.refused_per_min == 3 and free.refused_by_reason_per_min == {"queue_full": 2, "model_protected": 1}
    assert free.p50_s is None and free.latency_samples == 0

    now[0] += 90  # past the minute: the counts go; latencies stay for five minutes
    paid = stats.figures("paid")
    assert (paid.admitted_per_min, paid.latency_samples) == (0, 100)
    stats.latency("paid", 3.0)
    assert stats.figures("paid").latency_samples == 101
    now[0] += 300  # past five minutes: only the newest latency is left
    paid = stats.figures("paid")
    assert paid.latency_samples == 1 and 3.0 <= paid.p50_s == paid.p99_s <= 3.15
    now[0] += 400
    assert stats.figures("paid").latency_samples == 0


def test_tier_figures_keep_a_bounded_record_under_load():
    now = [0.0]
    stats = TierStats(["paid"], clock=lambda: now[0], bucket_s=5.0, span_s=300.0)
    for i in range(200_000):
        now[0] = i * 0.01  # 2000 s of traffic at 100 requests a second
        stats.admitted("paid")
        stats.latency("paid", 0.05 + (i % 100) / 1000)
    buckets = stats._buckets["paid"]
    assert len(buckets) <= 62 and all(len(b.latency) <= 40 for b in buckets)
    paid = stats.figures("paid")
    assert 5500 <= paid.admitted_per_min <= 6500 and paid.latency_samples >= 30_000
    assert 0.099 <= paid.p50_s <= 0.106 and 0.148 <= paid.p99_s <= 0.156
